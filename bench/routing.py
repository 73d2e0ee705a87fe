"""KV-aware routing end to end: workloads that cannot flatter one mode, the default configuration first.

    python -m bench.routing [--quick] [--workloads shared-prefix,multi-turn,no-sharing] [--modes kv,round-robin]
                            [--variants dynamo] [--no-semantic] [--out bench/out/routing.json]

For each workload and router mode a fresh farm starts with 4 aggregated workers on the default model and the
farm's default configuration otherwise (KV cache size, KV tiers, torch threads, router cost: what `farm up
--workers 4` gives a new user), is warmed up (a few short unrelated chats per worker, so no mode pays the
first forwards), and serves the workload through the API: streamed chats, greedy, `ignore_eos`, a fixed
number of output tokens, `--clients` concurrent clients taking sessions from one queue whose order is
shuffled with a fixed seed (a fixed order can hand round-robin an accidental cache affinity). Workloads:
- shared-prefix: `--prefixes` system prompts of about `--prefix-tokens` tokens, `--per-prefix` chats each,
  every chat its own user question;
- multi-turn: `--conversations` conversations of `--turns` turns, each opening with its own document of
  about `--document-tokens` tokens; each turn sends the previous prompt, the answer and a new question;
- no-sharing: every chat its own system prompt and question (nothing to reuse: kv can only balance load).
Reported per run: TTFT p50/p90/p99, ITL p50, request latency p50 (client side), the prefix-cache hit ratio
(cached / prompt tokens, from each answer's usage) against the ideal placement's (every full block some
earlier request of the run computed reused: prompts tokenized as the API does, in the order they were
sent), and how many requests each worker served. Tuned or comparison variants (`--variants`, e.g. `dynamo`:
Dynamo's cost with its overlap_weight 1.0) run in kv mode beside the headline, labelled as such.
Goals (issue 14): shared-prefix round-robin / kv TTFT p50 >= 3x (stretch 5x) and hit ratio >= 90% of ideal;
multi-turn >= 2x; no-sharing kv TTFT p50 within 5% of round-robin.

`--workloads aiperf` adds NVIDIA aiperf's synthetic shared-prefix multi-turn workload (`aiperf_profile`,
shared with bench/peers; installed into bench/.venv-aiperf on first use) as a further, labelled workload.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import aiohttp
import requests
from prometheus_client.parser import text_string_to_metric_families

from bench.common import BENCH_DIR, OUT_DIR, finish, goal, load_average, percentile, table
from bench.farms import bench_farm
from bench.peers.load import RequestTiming, stream_chat
from farm.models.directories import model_dir
from farm.models.tokenization import chat_prompt_ids, get_tokenizer
from farm.protocol.hashing import block_hashes

AIPERF_VENV = BENCH_DIR / ".venv-aiperf"
WORKLOADS = ("shared-prefix", "multi-turn", "no-sharing")
VARIANTS: dict[str, dict[str, Any]] = {  # kv-mode comparisons, labelled beside the default configuration
    "dynamo": {"router": {"cost": "dynamo"}},  # Dynamo's formula and overlap_weight 1.0 (the farm's former default)
    "dynamo-w4": {"router": {"cost": "dynamo", "overlap_weight": 4.0}},  # the hand-tuned weight of earlier runs
}
# Plain words for prompts: no names, digits or anything the semantic layer's guards would act on.
VOCAB = ("the a of to and in for on with as by at from that this each every some many few more most other "
         "shop bicycle wheel chain brake saddle pedal frame tyre tube gear lever cable light bell basket lock "
         "pump rack mirror helmet glove route road path hill valley river bridge town village market station "
         "morning evening weather rain wind sun cloud season spring summer autumn winter ride rides rider "
         "repair repairs check checks clean cleans adjust adjusts replace replaces order orders deliver "
         "open opens close closes rent rents return returns book books visit visits plan plans follow "
         "quick slow light heavy small large short long simple careful friendly useful modern classic "
         "customer staff team owner guide map note list price service warranty manual part parts tool "
         "tools box shelf window door counter workshop garden street corner table chair paper pencil "
         "usually often sometimes always never gently firmly quietly easily nearly almost about again "
         "before after during while because although when where which whose how why what").split()


# -- workloads ----------------------------------------------------------------------------------------------
@dataclass
class Session:
    """One client's conversation: the system prompt (or none) and a user message per turn."""

    system: str | None
    users: list[str]
    label: str = ""


def text_of(rng: random.Random, tok, tokens: int) -> str:
    """Plain sentences of about `tokens` tokens (by the model's tokenizer)."""
    sentences: list[str] = []
    n = 0
    while n < tokens:
        words = [rng.choice(VOCAB) for _ in range(rng.randint(8, 16))]
        s = " ".join(words).capitalize() + "."
        sentences.append(s)
        n += len(tok.encode(" " + s, add_special_tokens=False))
    return " ".join(sentences)


def question(rng: random.Random, tok, tokens: int) -> str:
    return text_of(rng, tok, tokens).rstrip(".") + "?"


def make_sessions(workload: str, args: argparse.Namespace, tok) -> list[Session]:
    """The workload's sessions in their (seeded, shuffled) arrival order."""
    rng = random.Random(args.seed)
    if workload == "shared-prefix":
        systems = [f"You are assistant {i} of a bicycle shop. " + text_of(rng, tok, args.prefix_tokens)
                   for i in range(args.prefixes)]
        sessions = [Session(systems[p], [question(rng, tok, args.question_tokens)], f"prefix {p}")
                    for p in range(args.prefixes) for _ in range(args.per_prefix)]
    elif workload == "multi-turn":
        sessions = [Session(None, ["Read this shop note, then answer my questions. " + text_of(rng, tok, args.document_tokens)
                                   + " " + question(rng, tok, args.question_tokens)]
                            + [question(rng, tok, args.question_tokens) for _ in range(args.turns - 1)],
                            f"conversation {c}")
                    for c in range(args.conversations)]
    elif workload == "no-sharing":
        n = args.prefixes * args.per_prefix
        sessions = [Session(text_of(rng, tok, args.prefix_tokens // 2), [question(rng, tok, args.question_tokens)],
                            f"chat {i}") for i in range(n)]
    else:
        raise ValueError(f"unknown workload {workload!r}")
    random.Random(args.seed + 1).shuffle(sessions)
    return sessions


# -- the client ---------------------------------------------------------------------------------------------
@dataclass
class Sent:
    session: int
    turn: int
    messages: list[dict[str, str]]
    timing: RequestTiming | None = None
    error: str = ""


@dataclass
class ClientRun:
    sent: list[Sent] = field(default_factory=list)
    wall_s: float = 0.0


async def _serve_sessions(base_url: str, model: str, sessions: list[Session], clients: int, max_tokens: int,
                          timeout_s: float) -> ClientRun:
    url = base_url.rstrip("/") + "/v1/chat/completions"
    queue = list(enumerate(sessions))
    queue.reverse()  # pop() takes them in arrival order
    run = ClientRun()
    headers = {"Cache-Control": "no-cache"}  # never answered by the semantic cache
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s), headers=headers,
                                     connector=aiohttp.TCPConnector(limit=0)) as http:
        async def client() -> None:
            while queue:
                idx, s = queue.pop()
                history: list[dict[str, str]] = [{"role": "system", "content": s.system}] if s.system else []
                for turn, user in enumerate(s.users):
                    history = history + [{"role": "user", "content": user}]
                    rec = Sent(idx, turn, history)
                    run.sent.append(rec)
                    try:
                        rec.timing = await stream_chat(http, url, model, history, max_tokens)
                    except (TimeoutError, aiohttp.ClientError, RuntimeError) as e:
                        rec.error = f"{type(e).__name__}: {e}"[:500]
                        break
                    history = history + [{"role": "assistant", "content": rec.timing.text}]

        t0 = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(clients)))
        run.wall_s = time.perf_counter() - t0
    return run


def warm_up(base_url: str, model: str, workers: int, max_tokens: int) -> None:
    """Three short unrelated chats per worker, all at once (every worker gets some under any mode), then
    time for the workers' heartbeats to carry their first measured step costs to the router."""
    rng = random.Random(12345)
    chats = [Session(f"Warm-up {i}. " + " ".join(rng.choice(VOCAB) for _ in range(12)), ["Say something short."])
             for i in range(3 * workers)]
    run = asyncio.run(_serve_sessions(base_url, model, chats, len(chats), max_tokens, 600))
    failed = [s.error for s in run.sent if s.error]
    if failed:
        raise RuntimeError(f"warm-up failed: {failed[0]}")
    time.sleep(3.0)


def ideal_reuse(sent: list[Sent], tok, block_size: int) -> tuple[float, int]:
    """The ideal placement's hit ratio: in send order, each prompt's leading full blocks that an earlier
    request of the run computed (its prompt and its answer) count as reused; and how many prompts the API
    counted differently from this tokenization (0 expected)."""
    seen: set[int] = set()
    reused = total = mismatched = 0
    for s in sorted((s for s in sent if s.timing), key=lambda s: s.timing.sent):
        ids = chat_prompt_ids(tok, s.messages)
        mismatched += len(ids) != s.timing.prompt_tokens
        lead = 0
        for h in block_hashes(ids, block_size):
            if h not in seen:
                break
            lead += 1
        reused += min(lead * block_size, len(ids) - 1)
        total += len(ids)
        seen.update(block_hashes(ids + tok.encode(s.timing.text, add_special_tokens=False), block_size))
    return (reused / total if total else 0.0), mismatched


def summarize(run: ClientRun, tok, block_size: int) -> dict[str, Any]:
    done = [s.timing for s in run.sent if s.timing]
    ms = lambda xs: [x * 1000 for x in xs]  # noqa: E731
    ttft = ms(t.ttft for t in done)
    prompt = sum(t.prompt_tokens for t in done)
    cached = sum(t.cached_tokens for t in done)
    ideal, mismatched = ideal_reuse(run.sent, tok, block_size)
    hit = cached / prompt if prompt else 0.0
    return {
        "requests": len(run.sent), "errors": [s.error for s in run.sent if s.error], "wall_s": run.wall_s,
        "ttft_p50_ms": percentile(ttft, 0.5), "ttft_p90_ms": percentile(ttft, 0.9),
        "ttft_p99_ms": percentile(ttft, 0.99),
        "itl_p50_ms": percentile(ms(x for t in done if (x := t.itl) is not None), 0.5),
        "latency_p50_ms": percentile(ms(t.last - t.sent for t in done), 0.5),
        "prompt_tokens": prompt, "cached_tokens": cached, "hit_ratio": hit, "ideal_hit_ratio": ideal,
        "hit_of_ideal": hit / ideal if ideal else None, "tokenization_mismatches": mismatched,
        "per_worker": dict(sorted(Counter(t.worker for t in done).items())),
        "raw": [{"session": s.session, "turn": s.turn, "error": s.error,
                 **({k: v for k, v in vars(s.timing).items() if k != "text"} if s.timing else {})} for s in run.sent],
    }


# -- aiperf (also bench/peers' two-engine workload) ----------------------------------------------------------
def aiperf_bin() -> Path:
    exe = AIPERF_VENV / "bin" / "aiperf"
    if not exe.exists():
        print("installing aiperf into", AIPERF_VENV, flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(AIPERF_VENV)], check=True)
        subprocess.run([str(AIPERF_VENV / "bin" / "pip"), "install", "-q", "aiperf"], check=True)
    return exe


def aiperf_profile(exe: Path, model: str, url: str, tokenizer_dir: Path, art: Path, w, timeout: float
                   ) -> tuple[dict, Path | None, float]:
    """aiperf's shared-prefix multi-turn workload against `url`: `w` has requests, concurrency, prefixes,
    prefix_tokens, output_tokens and turns; seeded, shuffled (aiperf's synthetic default, made explicit).
    Returns aiperf's summary JSON, its raw records file and the wall time; raises with aiperf's stderr."""
    cmd = [str(exe), "profile", "--model", model, "--url", url, "--endpoint-type", "chat",
           "--streaming", "--tokenizer", str(tokenizer_dir), "--concurrency", str(w.concurrency),
           "--request-count", str(w.requests), "--prefix-prompt-pool-size", str(w.prefixes),
           "--prefix-prompt-length", str(w.prefix_tokens), "--prompt-input-tokens-mean", "48",
           "--prompt-input-tokens-stddev", "0", "--prompt-output-tokens-mean", str(w.output_tokens),
           "--prompt-output-tokens-stddev", "0", "--conversation-turn-mean", str(w.turns),
           "--conversation-turn-stddev", "0", "--conversation-num", str(w.requests // max(w.turns, 1)),
           "--extra-inputs", "ignore_eos:true", "--random-seed", "7", "--dataset-sampling-strategy", "shuffle",
           "--export-level", "raw", "--artifact-dir", str(art), "--ui-type", "none"]
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    shutil.rmtree(art, ignore_errors=True)  # a summary left by an earlier run must not be read as this one's
    t0 = time.time()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    wall = time.time() - t0
    art.mkdir(parents=True, exist_ok=True)
    (art / "aiperf.log").write_text(" ".join(cmd) + "\n" + proc.stdout + "\n" + proc.stderr)
    if proc.returncode != 0:
        raise RuntimeError(f"aiperf failed against {url}:\n{proc.stderr[-3000:]}")
    summary = json.loads(next(art.rglob("profile_export_aiperf.json")).read_text())
    return summary, next(art.rglob("*raw.jsonl"), None), wall


def metric(summary: dict, name: str, stat: str) -> float | None:
    m = summary.get(name) or summary.get("records", {}).get(name) or {}
    v = m.get(stat)
    return float(v) if v is not None else None


def scrape(url: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(requests.get(url, timeout=10).text):
        for s in fam.samples:
            if s.name in ("farm_prompt_tokens_total", "farm_cached_prompt_tokens_total"):
                out[s.name] = out.get(s.name, 0.0) + s.value
    return out


def aiperf_ideal(raw: Path, tok, block_size: int) -> float:
    """The ideal hit ratio of the prompts aiperf sent (its raw records), as ideal_reuse computes it."""
    sent = []
    for line in raw.read_text().splitlines():
        rec = json.loads(line) if line.strip() else {}
        payload = rec.get("payloads") or rec.get("payload") or rec.get("request") or {}
        payload = (payload[0] if payload else {}) if isinstance(payload, list) else payload
        if msgs := payload.get("messages"):
            order = rec.get("start_perf_ns") or rec.get("request_start_ns") or 0
            ids = chat_prompt_ids(tok, msgs)
            sent.append(Sent(0, 0, msgs, RequestTiming(order, order, order, 0, len(ids))))
    return ideal_reuse(sent, tok, block_size)[0]


def run_aiperf(base: str, cfg, args: argparse.Namespace, label: str) -> dict[str, Any]:
    w = SimpleNamespace(requests=args.aiperf_requests, concurrency=args.clients, prefixes=args.prefixes,
                        prefix_tokens=args.prefix_tokens, output_tokens=args.output_tokens, turns=2)
    before = scrape(base + "/metrics")
    summary, raw, wall = aiperf_profile(aiperf_bin(), cfg.default_model, base, model_dir(cfg, cfg.model(cfg.default_model)),
                                        OUT_DIR / f"aiperf-{label}", w, args.timeout)
    after = scrape(base + "/metrics")
    prompt = after.get("farm_prompt_tokens_total", 0) - before.get("farm_prompt_tokens_total", 0)
    cached = after.get("farm_cached_prompt_tokens_total", 0) - before.get("farm_cached_prompt_tokens_total", 0)
    ideal = aiperf_ideal(raw, get_tokenizer(cfg, cfg.default_model), cfg.block_size(cfg.default_model)) if raw else 0.0
    hit = cached / prompt if prompt else 0.0
    return {"requests": w.requests, "errors": [], "wall_s": wall, "aiperf": summary,
            "ttft_p50_ms": metric(summary, "time_to_first_token", "p50"),
            "ttft_p90_ms": metric(summary, "time_to_first_token", "p90"),
            "ttft_p99_ms": metric(summary, "time_to_first_token", "p99"),
            "itl_p50_ms": metric(summary, "inter_token_latency", "p50"),
            "latency_p50_ms": metric(summary, "request_latency", "p50"), "prompt_tokens": prompt,
            "cached_tokens": cached, "hit_ratio": hit, "ideal_hit_ratio": ideal,
            "hit_of_ideal": hit / ideal if ideal else None, "per_worker": {}}


# -- runs ---------------------------------------------------------------------------------------------------
def run_one(workload: str, mode: str, variant: str | None, args: argparse.Namespace) -> dict[str, Any]:
    label = mode + (f", {variant}" if variant else "")
    overrides: dict[str, Any] = {"router": {"mode": mode}}
    if args.no_semantic:
        overrides["semantic"] = {"enabled": False}
    for section, values in VARIANTS.get(variant or "", {}).items():
        overrides.setdefault(section, {}).update(values)
    print(f"[{workload}] {label}: starting a farm of {args.workers} workers (load {load_average()})", flush=True)
    with bench_farm(both=args.workers, api=True, overrides=overrides) as farm:
        cfg = farm.cfg
        base = f"http://127.0.0.1:{farm.api_port}"
        model = cfg.default_model
        tok = get_tokenizer(cfg, model)
        warm_up(base, model, args.workers, args.output_tokens)
        if workload == "aiperf":
            res = run_aiperf(base, cfg, args, f"{mode}-{variant or 'default'}")
        else:
            sessions = make_sessions(workload, args, tok)
            run = asyncio.run(_serve_sessions(base, model, sessions, args.clients, args.output_tokens, args.timeout))
            res = summarize(run, tok, cfg.block_size(model))
    res.update(workload=workload, mode=mode, variant=variant, label=label + (" (variant)" if variant else " (default)"))
    print(f"    TTFT p50 {res['ttft_p50_ms']:.0f} ms, hit ratio {res['hit_ratio']:.2f} of ideal {res['ideal_hit_ratio']:.2f}, "
          f"{len(res['errors'])} errors, per worker {res['per_worker']}", flush=True)
    return res


def ratio(a: float | None, b: float | None) -> float:
    return a / b if a and b else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", default=",".join(WORKLOADS), help=f"of {', '.join(WORKLOADS)}, aiperf")
    ap.add_argument("--modes", default="kv,round-robin", help="router modes of the headline (also: least-loaded, random)")
    ap.add_argument("--variants", default="dynamo", help=f"kv-mode variants ('' for none): {', '.join(VARIANTS)}")
    ap.add_argument("--variant-workloads", default="shared-prefix", help="the workloads the variants run")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--prefixes", type=int, default=8)
    ap.add_argument("--per-prefix", type=int, default=6)
    ap.add_argument("--prefix-tokens", type=int, default=900)
    ap.add_argument("--question-tokens", type=int, default=40)
    ap.add_argument("--conversations", type=int, default=12)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--document-tokens", type=int, default=600)
    ap.add_argument("--output-tokens", type=int, default=16)
    ap.add_argument("--aiperf-requests", type=int, default=96)
    ap.add_argument("--seed", type=int, default=14)
    ap.add_argument("--timeout", type=int, default=1800)
    ap.add_argument("--quick", action="store_true", help="a small run to check the plumbing")
    ap.add_argument("--no-semantic", action="store_true",
                    help="semantic.enabled: false (the layer in front of the router; the same work in every mode)")
    ap.add_argument("--out", default="bench/out/routing.json")
    args = ap.parse_args()
    if args.quick:
        args.prefixes, args.per_prefix, args.conversations, args.turns = 2, 3, 3, 2
        args.prefix_tokens, args.document_tokens, args.aiperf_requests = 300, 200, 16
    workloads = [w for w in args.workloads.split(",") if w]
    modes = [m for m in args.modes.split(",") if m]
    variants = [v for v in args.variants.split(",") if v]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        ap.error(f"unknown variants {unknown}; known: {', '.join(VARIANTS)}")
    runs: list[dict[str, Any]] = []
    partial = Path(args.out).with_suffix(".partial.json")  # every finished run, kept if a later one fails
    partial.parent.mkdir(parents=True, exist_ok=True)
    plan = [(wl, mode, None) for wl in workloads for mode in modes]
    plan += [(wl, "kv", v) for wl in workloads if wl in args.variant_workloads.split(",") for v in variants]
    plan.sort(key=lambda p: workloads.index(p[0]))  # a workload's runs together, headline modes first
    for wl, mode, variant in plan:
        runs.append(run_one(wl, mode, variant, args))
        partial.write_text(json.dumps({"args": vars(args), "runs": runs}, default=str))
    rows = [[r["workload"], r["label"], r["ttft_p50_ms"], r["ttft_p90_ms"], r["ttft_p99_ms"], r["itl_p50_ms"],
             r["latency_p50_ms"], r["hit_ratio"], r["ideal_hit_ratio"], r["hit_of_ideal"], len(r["errors"])]
            for r in runs]
    print(table(["workload", "run", "TTFT p50 ms", "p90", "p99", "ITL p50 ms", "latency p50 ms", "hit ratio",
                 "ideal", "of ideal", "errors"], rows))
    by = {(r["workload"], r["mode"], r["variant"]): r for r in runs}
    goals = []

    def p50(wl: str, mode: str) -> float | None:
        r = by.get((wl, mode, None))
        return r["ttft_p50_ms"] if r else None

    if p50("shared-prefix", "kv") and p50("shared-prefix", "round-robin"):
        x = ratio(p50("shared-prefix", "round-robin"), p50("shared-prefix", "kv"))
        goals.append(goal("shared-prefix: round-robin TTFT p50 / kv TTFT p50", x, 3.0))
        goals.append(goal("shared-prefix: the same, stretch", x, 5.0))
    if (kv := by.get(("shared-prefix", "kv", None))) and kv["hit_of_ideal"] is not None:
        goals.append(goal("shared-prefix: kv hit ratio / ideal", kv["hit_of_ideal"], 0.9))
    if p50("multi-turn", "kv") and p50("multi-turn", "round-robin"):
        goals.append(goal("multi-turn: round-robin TTFT p50 / kv TTFT p50",
                          ratio(p50("multi-turn", "round-robin"), p50("multi-turn", "kv")), 2.0))
    if p50("no-sharing", "kv") and p50("no-sharing", "round-robin"):
        goals.append(goal("no-sharing: kv TTFT p50 / round-robin TTFT p50",
                          ratio(p50("no-sharing", "kv"), p50("no-sharing", "round-robin")), 1.05, higher_is_better=False))
    errors = sum(len(r["errors"]) for r in runs)
    if errors:
        print(f"\n{errors} requests failed: the figures above are not valid")
    finish(args.out, {"args": vars(args), "runs": runs, "errors": errors}, goals)


if __name__ == "__main__":
    main()
