"""Batch scheduling: one prefix-sharing batch run twice, prefix-grouped (`batch.schedule: prefix`) and in
input order (`batch.schedule: input`), on the same farm shape, in one command.

    python -m bench.batch                 # 1,000 lines: 25 documents x 40 questions, shuffled in the file
    python -m bench.batch --lines 200     # a quicker look

Each line asks a question about one of the documents (a shared ~250-token prefix: system prompt plus the
document), the lines interleaved in the file as a real export would be. Per mode, a fresh farm (two
aggregated workers, a KV cache that holds a few documents, no host/disk tiers so the comparison is about
scheduling alone), the real batch driver and the official `openai` SDK: completion time (create ->
completed) and the prefix-cache hit ratio (cached prompt tokens / prompt tokens, from the output lines'
usage, i.e. what the workers really reused).
"""

from __future__ import annotations

import argparse
import io
import json
import random
import time
from typing import Any

from bench.common import finish, goal, table
from bench.farms import bench_farm

TOPICS = ["the river", "a lighthouse", "the old library", "a mountain village", "the harbour", "a desert town",
          "the observatory", "a bakery", "the railway", "a vineyard", "the museum", "an island", "the forest",
          "a market", "the bridge", "a monastery", "the canal", "a farm", "the castle", "a mine", "the garden",
          "a school", "the theatre", "a glacier", "the factory"]
FACTS = ["was built {n} years ago", "has {n} windows facing east", "is visited by {n} people every spring",
         "keeps {n} old maps in a locked room", "was repaired {n} times after storms",
         "employs {n} workers in the summer", "is {n} kilometres from the nearest city"]


def document(i: int, rng: random.Random, args_words: int) -> str:
    topic = TOPICS[i % len(TOPICS)]
    sentences = [f"Report {i} about {topic}."]
    while len(" ".join(sentences).split()) < args_words:
        sentences.append(f"{topic.capitalize()} {rng.choice(FACTS).format(n=rng.randint(2, 900))}.")
    return " ".join(sentences)


def make_lines(model: str, n_lines: int, n_docs: int, words: int, seed: int = 0) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    docs = [document(i, rng, words) for i in range(n_docs)]
    rows = []
    for j in range(n_lines):
        d = j % n_docs
        rows.append({"custom_id": f"d{d}-q{j}", "method": "POST", "url": "/v1/chat/completions",
                     "body": {"model": model, "max_tokens": 4, "temperature": 0, "messages": [
                         {"role": "system", "content": "Answer from the report, in one short phrase.\n\n" + docs[d]},
                         {"role": "user", "content": f"Question {j}: how many are mentioned first?"}]}})
    rng.shuffle(rows)  # the file interleaves documents
    return rows


def run_mode(mode: str, rows: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    import openai

    overrides = {
        "engine": {"kv_cache_mb": args.kv_cache_mb, "kv_tiers": {"host_mb": 0, "disk_mb": 0}, "torch_threads": 1},
        "batch": {"schedule": mode, "max_inflight": args.inflight},
        "router": {"overlap_weight": args.overlap_weight},
    }
    with bench_farm(both=2, api=True, batch_drivers=1, overrides=overrides) as farm:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{farm.api_port}/v1", api_key="unused", max_retries=2)
        data = "".join(json.dumps(r) + "\n" for r in rows).encode()
        fid = client.files.create(file=("bench.jsonl", io.BytesIO(data)), purpose="batch").id
        t0 = time.time()
        b = client.batches.create(input_file_id=fid, endpoint="/v1/chat/completions", completion_window="24h")
        while b.status not in ("completed", "failed", "cancelled", "expired"):
            time.sleep(1.0)
            b = client.batches.retrieve(b.id)
        wall = time.time() - t0
        if b.status != "completed":
            raise SystemExit(f"{mode}: batch ended {b.status}: {b.errors}")
        out = [json.loads(x) for x in client.files.content(b.output_file_id).text.splitlines()]
        usage = [o["response"]["body"]["usage"] for o in out if o.get("response")]
        prompt = sum(u["prompt_tokens"] for u in usage)
        cached = sum(u["prompt_tokens_details"]["cached_tokens"] for u in usage)
        return {"mode": mode, "status": b.status, "lines": len(rows), "completed": b.request_counts.completed,
                "failed": b.request_counts.failed, "completion_s": wall,
                "server_s": (b.completed_at or 0) - (b.in_progress_at or 0),
                "prompt_tokens": prompt, "cached_tokens": cached, "hit_ratio": cached / prompt if prompt else 0.0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lines", type=int, default=1000)
    ap.add_argument("--docs", type=int, default=25)
    ap.add_argument("--words", type=int, default=150, help="document length (~1.4 tokens per word)")
    ap.add_argument("--overlap-weight", type=float, default=4.0,
                    help="router.overlap_weight in both runs (see RESULTS.md: 4 suits prefill-heavy work)")
    ap.add_argument("--kv-cache-mb", type=int, default=96, help="per worker: a few documents' worth")
    ap.add_argument("--inflight", type=int, default=16, help="batch.max_inflight, the same in both modes")
    ap.add_argument("--out", default="bench/out/batch.json")
    args = ap.parse_args()
    from farm.config import load_config

    model = load_config(environ={}).default_model
    rows = make_lines(model, args.lines, args.docs, args.words)
    results = {mode: run_mode(mode, rows, args) for mode in ("prefix", "input")}
    print(table(["schedule", "lines", "completed", "failed", "completion s", "prompt tokens", "cached tokens",
                 "hit ratio"],
                [[r["mode"], r["lines"], r["completed"], r["failed"], r["completion_s"], r["prompt_tokens"],
                  r["cached_tokens"], r["hit_ratio"]] for r in results.values()], digits=3))
    p, i = results["prefix"], results["input"]
    speedup = i["completion_s"] / p["completion_s"]
    print(f"\ninput-order time / prefix-grouped time: {speedup:.2f}x; "
          f"hit ratio {p['hit_ratio']:.1%} vs {i['hit_ratio']:.1%}")
    goals = [goal("input-order completion time / prefix-grouped", speedup, 1.0),
             goal("prefix-grouped hit ratio - input-order hit ratio", p["hit_ratio"] - i["hit_ratio"], 0.0),
             goal("lines lost", float(sum(r["lines"] - r["completed"] - r["failed"] for r in results.values())),
                  0.0, higher_is_better=False)]
    finish(args.out, {"args": vars(args), "results": results}, goals, "{:.3f}")


if __name__ == "__main__":
    main()
