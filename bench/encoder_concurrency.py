"""The semantic layer's encoder under concurrent requests: one forward per request, or forwards shared.

    .venv/bin/python -m bench.encoder_concurrency [--levels 1,8,64] [--calls 5] [--rounds 2]

Why: with the semantic layer on, each request's texts go through MiniLM (ONNX Runtime) behind one lock. A call
that finds the encoder busy now waits in a queue and the next holder runs the oldest waiting calls together, up
to `farm.semantic.embeddings.MAX_BATCH` texts a forward (`_Pending`). This measures that path alone, as the API
runs it: a gevent-patched process, N greenlets each encoding `--calls` short texts one after another, 1 ms apart
(a text of its own each time, so no memo helps), the forward on gevent's thread pool. Contenders: `one-at-a-time`
(MAX_BATCH 1: every call its own forward, the behaviour before) and `shared` (the shipped MAX_BATCH), in
alternating order over `--rounds`. Per level: calls per second, CPU per call (this process), call latency
p50/p90/p99, forwards and texts per forward. The farm end to end: bench.engine_speed's `farm-vllm-semantic`.
Writes bench/out/encoder_concurrency.json.
"""

from gevent import monkey

monkey.patch_all()  # as gunicorn's gevent worker does before it imports the app

import argparse  # noqa: E402 - after the patch, as in the API
import time  # noqa: E402
from typing import Any  # noqa: E402

import gevent  # noqa: E402

from bench.common import alternating, finish, percentile, table  # noqa: E402
from farm.semantic import embeddings  # noqa: E402

THINK_S = 0.001  # between a greenlet's calls (without it, gevent's lock lets one greenlet take it back at once)
SUBJECTS = ["soup", "a bicycle", "tax returns", "a garden", "jet lag", "a job interview", "sourdough", "a tent"]


def _text(i: int, k: int) -> str:
    return f"Stream {i}, question {k}: what should I know before I start with {SUBJECTS[(i + k) % len(SUBJECTS)]}?"


def run_level(emb: embeddings.Embedder, streams: int, calls: int, batch: int) -> dict[str, Any]:
    embeddings.MAX_BATCH = batch
    real, sizes = emb._hidden_batch, []

    def counted(b):
        sizes.append(len(b["input_ids"]))
        return real(b)

    emb._hidden_batch = counted
    latencies: list[float] = []

    def client(i: int) -> None:
        for k in range(calls):
            t = time.perf_counter()
            emb.encode_texts([_text(i, k)])
            latencies.append((time.perf_counter() - t) * 1000)
            gevent.sleep(THINK_S)  # a request's next text comes from another request: let the others run first

    try:
        t0, c0 = time.perf_counter(), time.process_time()
        gevent.joinall([gevent.spawn(client, i) for i in range(streams)], raise_error=True)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    finally:
        emb._hidden_batch = real
        embeddings.MAX_BATCH = SHARED
    n = len(latencies)
    return {"streams": streams, "calls": n, "calls_per_s": n / wall, "cpu_ms_per_call": cpu * 1000 / n,
            "p50_ms": percentile(latencies, 0.5), "p90_ms": percentile(latencies, 0.9),
            "p99_ms": percentile(latencies, 0.99), "forwards": len(sizes), "texts_per_forward": sum(sizes) / len(sizes)}


SHARED = embeddings.MAX_BATCH
CONTENDERS = {"one-at-a-time": 1, "shared": SHARED}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--levels", default="1,8,64", help="concurrent greenlets (comma-separated)")
    ap.add_argument("--calls", type=int, default=5, help="calls per greenlet")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=0, help="ONNX Runtime intra-op threads (0: the API's default)")
    ap.add_argument("--out", default="bench/out/encoder_concurrency.json")
    args = ap.parse_args()
    levels = [int(x) for x in args.levels.split(",")]
    emb = embeddings.Embedder(threads=args.threads)
    emb.encode_texts(["warm up the encoder"])
    runs: list[dict[str, Any]] = []
    for rnd, name in alternating(list(CONTENDERS), args.rounds):
        for streams in levels:
            r = {"round": rnd + 1, "contender": name, **run_level(emb, streams, args.calls, CONTENDERS[name])}
            runs.append(r)
            print(f"round {rnd + 1} {name:>13} x{streams:<3}: {r['calls_per_s']:.0f} calls/s, "
                  f"{r['cpu_ms_per_call']:.2f} ms CPU per call, p50 {r['p50_ms']:.1f} ms", flush=True)

    def median(name: str, streams: int, key: str) -> float:
        xs = sorted(r[key] for r in runs if r["contender"] == name and r["streams"] == streams)
        return xs[len(xs) // 2] if len(xs) % 2 else (xs[len(xs) // 2 - 1] + xs[len(xs) // 2]) / 2

    rows = [[name, s, *(median(name, s, k) for k in ("calls_per_s", "cpu_ms_per_call", "p50_ms", "p90_ms", "p99_ms",
                                                     "texts_per_forward"))]
            for s in levels for name in CONTENDERS]
    print(f"\nEncoder under concurrent calls (backend {emb.backend}, medians over {args.rounds} rounds, "
          f"{args.calls} calls per greenlet)")
    print(table(["contender", "greenlets", "calls/s", "CPU ms per call", "p50 ms", "p90 ms", "p99 ms",
                 "texts per forward"], rows))
    top = max(levels)
    ratios = {f"shared / one-at-a-time, {k} at {top} greenlets": median("shared", top, key) /
              median("one-at-a-time", top, key)
              for k, key in (("CPU per call", "cpu_ms_per_call"), ("latency p50", "p50_ms"), ("calls/s", "calls_per_s"))}
    print()
    for k, v in ratios.items():
        print(f"{k}: {v:.2f}")
    finish(args.out, {"benchmark": "encoder_concurrency", "args": vars(args), "runs": runs, "ratios": ratios}, [])

if __name__ == "__main__":
    main()
