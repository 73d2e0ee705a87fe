"""Why disaggregation exists: short chats beside periodic long prompts, aggregated vs disaggregated.

    python -m bench.disagg [--seconds 40] [--out bench/out/disagg.json]

Both layouts run two worker processes on the default model (aggregated: 2 x `both`; disaggregated:
1 prefill + 1 decode with conditional disaggregation), each worker with one torch thread. Workload, the
same for both: `--chats` clients streaming short chats back to back, plus one long prompt (~2,000 tokens)
every `--long-every` seconds. Reported for the short chats: TTFT and ITL p50/p99 (ITL from token
arrival gaps at the client). Then, on the disaggregated farm, the TTFT of a 2,000-token prompt
prefilled remotely vs locally and the measured KV transfer time. Goals (issue 4): disaggregated ITL
p99 <= 0.5x aggregated; the transfer adds <= 10% of the prefill time.
"""

from __future__ import annotations

import argparse
import random
import statistics
import threading
import time
import uuid

from bench.common import finish, goal, percentile, table
from bench.farms import bench_farm
from farm.gateway import Gateway
from farm.infra.redis_client import connect
from farm.models.tokenization import chat_prompt_ids, get_tokenizer
from farm.protocol import DeltaEvent, DoneEvent, ErrorEvent, GenerationRequest, SamplingParams, StartEvent

WORDS = ("river mountain ledger harbor copper violet engine garden signal lantern orbit canyon meadow "
         "falcon quartz timber").split()


pct = percentile


def long_prompt(rng: random.Random, tok, n_tokens: int) -> list[int]:
    text = " ".join(rng.choice(WORDS) for _ in range(n_tokens))
    ids = chat_prompt_ids(tok, [{"role": "user", "content": "Summarize: " + text}])
    return ids[: n_tokens - 8] + ids[-8:] if len(ids) > n_tokens else ids


def stream(gw: Gateway, ids: list[int], max_tokens: int, cfg=None) -> dict:
    req = GenerationRequest(uuid.uuid4().hex, gw.cfg.default_model, ids,
                            SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    t0 = time.perf_counter()
    sub = gw.submit(req)
    first, last, itl, transfer, done = None, None, [], None, None
    for ev in sub.events(first_timeout_s=600, idle_timeout_s=600):
        now = time.perf_counter()
        if isinstance(ev, StartEvent) and ev.kv_transfer:
            transfer = ev.kv_transfer
        elif isinstance(ev, DeltaEvent) and ev.n:
            if first is None:
                first = now
            elif last is not None:
                itl.extend([(now - last) / ev.n] * ev.n)
            last = now
        elif isinstance(ev, (DoneEvent, ErrorEvent)):
            done = ev.to_dict()
    return {"ttft": (first or time.perf_counter()) - t0, "itl": itl, "done": done, "transfer": transfer}


def run_layout(name: str, counts: dict, args) -> dict:
    overrides = {"engine": {"torch_threads": 1}}
    if counts.get("prefill"):
        overrides["disaggregation"] = {"mode": args.disagg_mode}
    with bench_farm(**counts, overrides=overrides) as farm:
        cfg = farm.cfg
        gw = Gateway(cfg, connect(cfg.redis))
        tok = get_tokenizer(cfg, cfg.default_model)
        rng = random.Random(1)
        stream(gw, chat_prompt_ids(tok, [{"role": "user", "content": "warm up"}]), 4)  # load paths
        stop = time.perf_counter() + args.seconds
        chats: list[dict] = []
        longs: list[dict] = []
        lock = threading.Lock()

        def chat_client(i: int) -> None:
            j = 0
            while time.perf_counter() < stop:
                q = f"Client {i} question {j}: name three {rng.choice(WORDS)} facts."
                res = stream(gw, chat_prompt_ids(tok, [{"role": "user", "content": q}]), args.chat_tokens)
                with lock:
                    chats.append(res)
                j += 1

        def long_client() -> None:
            r2 = random.Random(2)
            while time.perf_counter() < stop:
                t = time.perf_counter()
                res = stream(gw, long_prompt(r2, tok, args.long_tokens), 4)
                with lock:
                    longs.append(res)
                time.sleep(max(0.0, args.long_every - (time.perf_counter() - t)))

        threads = [threading.Thread(target=chat_client, args=(i,)) for i in range(args.chats)]
        threads.append(threading.Thread(target=long_client))
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        out = {
            "layout": name, "counts": counts, "chats": len(chats), "longs": len(longs),
            "chat_ttft": [c["ttft"] for c in chats], "chat_itl": [x for c in chats for x in c["itl"]],
            "long_ttft": [c["ttft"] for c in longs],
            "long_prefill": [c["done"]["prefill"] for c in longs if c["done"]],
        }
        if counts.get("prefill"):
            out["remote_vs_local"] = remote_vs_local(gw, tok, args)
        gw.router.stop()
        return out


def remote_vs_local(gw: Gateway, tok, args) -> dict:
    """TTFT of a fresh 2,000-token prompt prefilled on the prefill worker vs on the decode worker."""
    rng = random.Random(3)
    res: dict[str, list] = {"remote": [], "local": [], "transfer_s": [], "transfer_bytes": []}
    base_cfg = gw.cfg
    for mode in ("always", "never") * args.ttft_repeat:
        gw.cfg = base_cfg.model_copy(update={"disaggregation": base_cfg.disaggregation.model_copy(
            update={"mode": mode})})
        r = stream(gw, long_prompt(rng, tok, args.long_tokens), 1)
        res["remote" if mode == "always" else "local"].append(r["ttft"])
        if r["transfer"]:
            res["transfer_s"].append(r["transfer"]["seconds"])
            res["transfer_bytes"].append(r["transfer"]["bytes"])
    gw.cfg = base_cfg
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=40)
    ap.add_argument("--chats", type=int, default=3)
    ap.add_argument("--chat-tokens", type=int, default=48)
    ap.add_argument("--long-tokens", type=int, default=2000)
    ap.add_argument("--long-every", type=float, default=6)
    ap.add_argument("--ttft-repeat", type=int, default=3)
    ap.add_argument("--disagg-mode", default="conditional", choices=["conditional", "always"],
                    help="disaggregated layout: conditional (short prompts prefill on the decode worker) "
                         "or always (the decode worker only decodes)")
    ap.add_argument("--out", default="bench/out/disagg.json")
    args = ap.parse_args()
    runs = [run_layout("aggregated", {"both": 2}, args),
            run_layout("disaggregated", {"prefill": 1, "decode": 1}, args)]
    rows = []
    for r in runs:
        rows.append([r["layout"], r["chats"], r["longs"], pct(r["chat_ttft"], .5), pct(r["chat_ttft"], .99),
                     1000 * (pct(r["chat_itl"], .5) or 0), 1000 * (pct(r["chat_itl"], .99) or 0),
                     1000 * (pct(r["chat_itl"], .999) or 0), 1000 * max(r["chat_itl"] or [0]),
                     pct(r["long_ttft"], .5)])
    print(table(["layout", "chats", "long", "chat TTFT p50 s", "chat TTFT p99 s", "ITL p50 ms", "ITL p99 ms",
                 "ITL p99.9 ms", "ITL max ms", "long TTFT p50 s"], rows))
    agg, dis = runs
    itl_ratio = (pct(dis["chat_itl"], .99) or 0) / (pct(agg["chat_itl"], .99) or 1)
    rl = dis["remote_vs_local"]
    remote, local = statistics.median(rl["remote"]), statistics.median(rl["local"])
    transfer = statistics.median(rl["transfer_s"]) if rl["transfer_s"] else float("nan")
    print(f"\n2,000-token prompt TTFT: remote prefill {remote:.3f}s, local {local:.3f}s; KV transfer "
          f"{transfer * 1000:.1f} ms for {statistics.median(rl['transfer_bytes']) / 2**20:.1f} MiB "
          f"= {transfer / local:.1%} of the local prefill")
    goals = [goal("disaggregated / aggregated chat ITL p99", itl_ratio, 0.5, higher_is_better=False),
             goal("KV transfer / prefill time", transfer / local, 0.10, higher_is_better=False)]
    finish(args.out, {"args": vars(args), "runs": runs}, goals, "{:.3f}")


if __name__ == "__main__":
    main()
