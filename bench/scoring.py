"""Prompt scoring as lm-eval's log-likelihood tasks ask it (`local-completions`): the farm against `vllm serve`.

Each request is what lm-eval sends: a batch of token-id prompts (context + continuation), `echo`, `logprobs` 1,
`max_tokens` 1, greedy; the answer's log-probabilities cover every prompt token. Contenders, each started from
nothing (bench/peers' contenders: the same model, block size, KV cache and flags): `vllm serve` alone, and the
farm with one aggregated vLLM worker (its API, Redis, Celery, the worker's bridge into vLLM). They run in
alternating order over the rounds; a run with a failed request is a failed run. Reported per contender:
requests/s and scored tokens/s (the headline: prompt tokens scored per second, wall clock over the whole run),
request latency p50/p90, errors, and the largest difference between its log-probabilities and `vllm serve`'s
on the same prompts (the farm's answers must be vLLM's).

The model is `--model tiny` by default (bench/engine_speed's random 2-layer Llama with SmolLM2's tokenizer, made at
run time: an engine step next to free, as on a GPU, so the farm's own path is what is measured) or `default`
(SmolLM2-135M-Instruct: the engine's time dominates on a CPU).

    .venv/bin/python -m bench.scoring                 # 64 requests of 8 prompts x 96 tokens, 4 in flight, 2 rounds
    .venv/bin/python -m bench.scoring --model default # the same on the real default model
    .venv/bin/python -m bench.scoring --smoke         # 8 requests, 1 round: proves it runs
"""

from __future__ import annotations

import argparse
import random
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import requests

from bench.common import alternating, finish, goal, load_average, percentile, table
from bench.peers import contenders as c
from bench.peers.install import PEERS_DIR


def workload(tokenizer: Any, n: int, batch: int, tokens: int, seed: int = 0) -> list[list[list[int]]]:
    """`n` requests of `batch` distinct prompts of `tokens` token ids each, drawn from the vocabulary's ordinary
    words (seeded): no two prompts share a prefix a cache could serve."""
    rng = random.Random(seed)
    words = [i for tok, i in tokenizer.get_vocab().items() if tok.startswith("Ġ") and tok[1:].isalpha()]
    return [[rng.sample(words, tokens) for _ in range(batch)] for _ in range(n)]


def score(ep: c.Endpoint, reqs: list[list[list[int]]], concurrency: int, timeout: float) -> dict[str, Any]:
    """Send every request, `concurrency` in flight; latencies, errors and each request's token log-probabilities."""
    session = requests.Session()
    session.mount("http://", requests.adapters.HTTPAdapter(pool_maxsize=concurrency))

    def one(prompts: list[list[int]]) -> tuple[float, list[list[float | None]] | None, str | None]:
        body = {"model": ep.model, "prompt": prompts, "echo": True, "logprobs": 1, "max_tokens": 1,
                "temperature": 0}
        t0 = time.perf_counter()
        try:
            resp = session.post(ep.base_url + "/v1/completions", json=body, timeout=timeout)
            took = time.perf_counter() - t0
            if resp.status_code != 200:
                return took, None, f"{resp.status_code}: {resp.text[:200]}"
            choices = sorted(resp.json()["choices"], key=lambda ch: ch["index"])
            lps = [ch["logprobs"]["token_logprobs"] for ch in choices]
            if [len(x) for x in lps] != [len(p) + 1 for p in prompts]:
                return took, None, "log-probabilities do not cover every prompt token"
            return took, lps, None
        except requests.RequestException as e:
            return time.perf_counter() - t0, None, str(e)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(one, reqs))
    wall = time.perf_counter() - t0
    lat = [r[0] for r in results]
    scored = sum(len(p) for req in reqs for p in req)
    return {"wall_s": wall, "requests": len(reqs), "errors": sum(r[2] is not None for r in results),
            "first_error": next((r[2] for r in results if r[2]), None), "req_per_s": len(reqs) / wall,
            "scored_tok_per_s": scored / wall, "latency_p50_s": percentile(lat, 0.5),
            "latency_p90_s": percentile(lat, 0.9), "logprobs": [r[1] for r in results]}


def max_difference(a: list[Any], b: list[Any]) -> float | None:
    """The largest |a - b| over two runs' token log-probabilities of the same requests (None where one failed)."""
    diffs = [abs(x - y) for ra, rb in zip(a, b, strict=True) if ra is not None and rb is not None
             for pa, pb in zip(ra, rb, strict=True) for x, y in zip(pa, pb, strict=True)
             if x is not None and y is not None]
    return max(diffs) if diffs else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8, help="prompts per request (lm-eval's batch_size)")
    ap.add_argument("--tokens", type=int, default=96, help="token ids per prompt")
    ap.add_argument("--concurrency", type=int, default=4, help="requests in flight (lm-eval's num_concurrent)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--kv-mb", type=int, default=512)
    ap.add_argument("--eager", action=argparse.BooleanOptionalAction, default=True,
                    help="vLLM without torch.compile (both contenders alike; starts in seconds, not minutes)")
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--model", choices=("tiny", "default"), default="tiny")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--out", default="bench/out/scoring.json")
    args = ap.parse_args(argv)
    if args.smoke:
        args.requests, args.rounds = 8, 1
    from farm.config import load_config
    from farm.models.directories import model_dir
    from farm.models.tokenization import get_tokenizer

    base = load_config(environ={})
    if args.model == "tiny":
        from bench.engine_speed.model import make_tiny_model

        mdir = make_tiny_model()
    else:
        mdir = model_dir(base, base.model(base.default_model))
    reqs = workload(get_tokenizer(base, base.default_model), args.requests, args.batch, args.tokens)
    logs = PEERS_DIR / "logs" / time.strftime("scoring-%Y%m%d-%H%M%S")
    setup = c.Setup(mdir, logs, kv_bytes=args.kv_mb * 2**20, enforce_eager=args.eager,
                    max_model_len=2048)  # the tiny model's positions; plenty for the prompts here
    starts = {"vllm serve": lambda: c.vllm_serve(setup), "farm (vLLM worker)": lambda: c.farm(setup, "vllm", 1)}
    load0, runs = load_average(), []
    for rnd, name in alternating(list(starts), args.rounds):
        print(f"round {rnd + 1}: {name}", flush=True)
        try:
            with starts[name]() as ep:
                score(ep, reqs[:2], 1, args.timeout)  # warm-up: the first requests' one-time costs
                r = score(ep, reqs, args.concurrency, args.timeout)
        except Exception as e:  # noqa: BLE001 - a contender that cannot start is a failed run, reported
            r = {"errors": args.requests, "first_error": f"{type(e).__name__}: {e}", "logprobs": []}
        runs.append({"contender": name, "round": rnd + 1, **r})
        print(f"  {r.get('scored_tok_per_s', 0):.0f} scored tokens/s, {r['errors']} errors", flush=True)
    reference = next((r["logprobs"] for r in runs if r["contender"] == "vllm serve" and not r["errors"]), None)
    rows, means = [], {}
    for name in starts:
        mine = [r for r in runs if r["contender"] == name]
        ok = [r for r in mine if not r["errors"]]
        diff = max_difference(mine[0]["logprobs"], reference) if reference and mine[0]["logprobs"] else None
        means[name] = {k: sum(r[k] for r in ok) / len(ok) if ok else None
                       for k in ("req_per_s", "scored_tok_per_s", "latency_p50_s", "latency_p90_s")}
        means[name]["failed_runs"] = len(mine) - len(ok)
        means[name]["max_logprob_diff"] = diff
        rows.append([name, len(mine), means[name]["failed_runs"], means[name]["req_per_s"],
                     means[name]["scored_tok_per_s"], means[name]["latency_p50_s"], means[name]["latency_p90_s"],
                     diff])
    print(f"\n{args.model} model; {args.requests} requests of {args.batch} prompts x {args.tokens} tokens, "
          f"{args.concurrency} in flight; means over {args.rounds} round(s); load at start {load0}")
    print(table(["contender", "runs", "failed", "req/s", "scored tok/s", "p50 s", "p90 s", "max |dlogprob|"], rows,
                digits=3))
    farm_tps, vllm_tps = means["farm (vLLM worker)"]["scored_tok_per_s"], means["vllm serve"]["scored_tok_per_s"]
    goals = [goal("farm / vllm serve scored tokens/s", farm_tps / vllm_tps, 1.0)] if farm_tps and vllm_tps else []
    for r in runs:
        r.pop("logprobs", None)
    finish(args.out, {"benchmark": "scoring", "args": vars(args), "model_dir": str(mdir), "logs": str(logs),
                      "load_average_start": load0, "load_average_end": load_average(), "runs": runs,
                      "means": means}, goals)
    return 0 if all(not r["errors"] for r in runs) else 1


if __name__ == "__main__":
    raise SystemExit(main())
