"""The Semantic Router's classification batch: its texts one at a time against read together.

    .venv/bin/python -m bench.classify_batch [--texts 100] [--rounds 3]

Why: `/api/v1/classify/batch` takes up to 100 texts. It ran them one `SemanticLayer.signals` call at a time; it
now reads them in one `SemanticLayer.signals_many` call (the encoder's forwards shared, padded by length, and one
PII pass). Both contenders run here on one layer built from the default configuration (a scratch redis-server for
its cache), per task (intent, security, pii), in alternating order over `--rounds`, with the per-process
embedding memo cleared before each call so neither reads the other's vectors. The texts are the cache's
hand-written question pairs (tools/semantic/cache_held_out.py), short everyday questions. Writes
bench/out/classify_batch.json.
"""

from __future__ import annotations

import argparse
import statistics
import time

import redis

from bench.common import alternating, finish, table
from bench.farms import scratch_redis

TASKS = {"intent": "category", "security": "jailbreak", "pii": "pii"}
CONTENDERS = ["one_at_a_time", "together"]


def texts(n: int) -> list[str]:
    from tools.semantic.cache_held_out import FIRST_NEAR_MISSES, FIRST_PARAPHRASES

    pool = list(dict.fromkeys(t for pair in FIRST_PARAPHRASES + FIRST_NEAR_MISSES for t in pair))
    return (pool * (n // len(pool) + 1))[:n]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--texts", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="bench/out/classify_batch.json")
    args = ap.parse_args()

    from farm.config import load_config
    from farm.semantic.layer import SemanticLayer

    batch = texts(args.texts)
    ms: dict[str, dict[str, list[float]]] = {task: {c: [] for c in CONTENDERS} for task in TASKS}
    with scratch_redis("farm-bench-classify-") as url:
        layer = SemanticLayer.from_config(load_config(environ={"FARM_REDIS__URL": url}),
                                          redis_client=redis.Redis.from_url(url))
        for task, signal in TASKS.items():
            want = frozenset({signal})
            layer.signals_many(batch[:5], want=want)  # warm this stage's first call
            for _, contender in alternating(CONTENDERS, args.rounds):
                layer.forget()
                t0 = time.perf_counter()
                if contender == "together":
                    layer.signals_many(batch, want=want)
                else:
                    for text in batch:
                        layer.signals(text, want=want)
                ms[task][contender].append((time.perf_counter() - t0) * 1000)
    rows, results = [], {}
    for task, by in ms.items():
        one, together = (statistics.median(by[c]) for c in CONTENDERS)
        results[task] = {"ms": by, "median_ms": {"one_at_a_time": one, "together": together},
                         "speedup": one / together}
        rows.append([task, len(batch), " / ".join(f"{x:.0f}" for x in by["one_at_a_time"]),
                     " / ".join(f"{x:.0f}" for x in by["together"]), one / together])
    print(table(["task", "texts", "one at a time, ms by round", "together, ms by round", "speed-up (medians)"],
                rows))
    finish(args.out, {"command": "python -m bench.classify_batch", "texts": len(batch), "rounds": args.rounds,
                      "results": results}, [])


if __name__ == "__main__":
    main()
