"""The semantic layer (issue 8): held-out accuracy of each stage and per-request latency of the whole layer.

    python -m bench.semantic [--requests 300] [--out bench/out/semantic.json]

Accuracy, on the held-out splits in farm/semantic/data (never trained on): category accuracy over the 14
MMLU-Pro domains; jailbreak true-positive rate on attacks and false-positive rate on benign prompts (all,
and the hard ones that use attack words); PII recall and precision by entity type; semantic-cache
precision on paraphrase pairs (should hit) versus near-miss pairs (a hit there serves a wrong answer).
Latency: `SemanticLayer.before()` per request, in one thread, with the default configuration (every guard,
classification, selection, injection and a cache lookup in a real Redis): misses on held-out prompts, and
cache hits. A throwaway redis-server is started on a free port. Goals (issue 8): category >= 85%,
jailbreak TPR >= 90% at FPR <= 5%, PII recall >= 95% and precision >= 90% per type, no wrong-answer cache
hits, layer p50 <= 15 ms and p99 <= 50 ms, cache hit <= 20 ms p50 (the layer's part, and end to end
through the API app behind a real HTTP server on loopback).
"""

from __future__ import annotations

import argparse
import socket
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import redis

from bench.common import CpuShare, finish, goal, load_average, percentile, table
from farm import redis_server
from farm.config import load_config
from farm.semantic.cache import CacheQuery, guard_signature, partition_key, text_sha, word_sequence
from farm.semantic.datagen import read_jsonl
from farm.semantic.evaluate import category_accuracy, jailbreak_rates, pii_scores
from farm.semantic.layer import SemanticLayer


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def accuracy(layer: SemanticLayer) -> dict:
    emb = layer.embedder
    cat_rows = read_jsonl("categories_test.jsonl")
    texts = [r["text"] for r in cat_rows]
    pred = [c.name for c in layer.classifier.classify(emb.encode(texts), texts)]
    cat_acc, per_cat = category_accuracy(pred, [r["label"] for r in cat_rows])

    jb_rows = read_jsonl("jailbreak_test.jsonl")
    jtexts = [r["text"] for r in jb_rows]
    res = layer.jailbreak.detect(emb.encode(jtexts), jtexts)
    jb = jailbreak_rates([r.is_jailbreak for r in res], [r["label"] for r in jb_rows],
                         [bool(r.get("hard")) for r in jb_rows])
    jb["type_accuracy"] = float(np.mean([r.type == row["label"] for r, row in zip(res, jb_rows, strict=True)
                                         if row["label"] != "benign" and r.is_jailbreak]))
    jb["false_positives"] = [row["text"] for r, row in zip(res, jb_rows, strict=True)
                             if row["label"] == "benign" and r.is_jailbreak]
    jb["missed"] = [row["text"] for r, row in zip(res, jb_rows, strict=True)
                    if row["label"] != "benign" and not r.is_jailbreak]

    pii = pii_scores(read_jsonl("pii_test.jsonl"), layer.pii)
    pii_errors = pii.pop("_errors")

    # cache: store pair[0]'s answer in a partition of its own, look up pair[1]
    pairs = read_jsonl("cache_pairs.jsonl")
    va = emb.encode([p["a"] for p in pairs])
    vb = emb.encode([p["b"] for p in pairs])
    outcomes = []
    for i, p in enumerate(pairs):
        part = partition_key("bench-model", f"cache-pair-{i}-{time.time_ns()}", [])
        layer.cache.store(CacheQuery(part, va[i], text_sha(p["a"]), guard_signature(p["a"]), False,
                                     word_sequence(p["a"])), f"answer {i}")
        hit = layer.cache.lookup(CacheQuery(part, vb[i], text_sha(p["b"]), guard_signature(p["b"]), False,
                                            word_sequence(p["b"])))
        outcomes.append({"a": p["a"], "b": p["b"], "same": p["same"], "hit": hit is not None,
                         "similarity": float(va[i] @ vb[i])})
    hits = [o for o in outcomes if o["hit"]]
    wrong = [o for o in hits if not o["same"]]
    para = [o for o in outcomes if o["same"]]
    cache = {"pairs": len(outcomes), "hits": len(hits), "wrong_hits": len(wrong),
             "precision": (len(hits) - len(wrong)) / len(hits) if hits else 1.0,
             "paraphrase_hit_rate": sum(o["hit"] for o in para) / len(para),
             "threshold": layer.cfg.cache.similarity_threshold, "outcomes": outcomes}
    return {"category": {"accuracy": cat_acc, "per_category": per_cat, "n": len(cat_rows)}, "jailbreak": jb,
            "pii": pii, "pii_errors": pii_errors[:50], "cache": cache}


def latency(layer: SemanticLayer, n: int) -> dict:
    rows = read_jsonl("categories_test.jsonl") + read_jsonl("jailbreak_test.jsonl") + read_jsonl("pii_test.jsonl")
    rng = np.random.default_rng(0)
    texts = [rows[i]["text"] for i in rng.permutation(len(rows))[:n]]
    for t in texts[:10]:  # warm-up
        layer.before("MoM", [{"role": "user", "content": t}], no_cache=True)
    layer.cache.clear()
    miss, stages, actions = [], {}, {}
    with CpuShare() as cpu:
        for i, t in enumerate(texts):
            msgs = [{"role": "system", "content": f"run {i}"}, {"role": "user", "content": t}]  # never a hit
            s = time.perf_counter()
            v = layer.before("MoM", msgs)
            miss.append((time.perf_counter() - s) * 1000)
            actions[v.action] = actions.get(v.action, 0) + 1
            for k, ms in v.timings_ms.items():
                stages.setdefault(k, []).append(ms)
    # hits: answer some prompts once, then ask them again (the same and in other words are both hits)
    hit_texts = [r["text"] for r in read_jsonl("categories_test.jsonl")[: max(20, n // 5)]]
    for t in hit_texts:
        v = layer.before("MoM", [{"role": "user", "content": t}])
        if v.action == "forward":
            layer.after(v, f"answer to: {t}")
    hit = []
    for t in hit_texts:
        s = time.perf_counter()
        v = layer.before("MoM", [{"role": "user", "content": t}])
        if v.action == "cached":
            hit.append((time.perf_counter() - s) * 1000)

    def summary(xs: list[float]) -> dict:
        return {"n": len(xs), "p50": percentile(xs, 0.5), "p90": percentile(xs, 0.9), "p99": percentile(xs, 0.99),
                "mean": statistics.fmean(xs) if xs else None}

    return {"miss": summary(miss), "hit": summary(hit), "actions": actions, "cpu_share": cpu.share,
            "stages_p50": {k: percentile(v, 0.5) for k, v in stages.items()},
            "stages_p99": {k: percentile(v, 0.99) for k, v in stages.items()}, "miss_ms": miss, "hit_ms": hit}


def embed_paths(layer: SemanticLayer, n: int) -> dict:
    """The per-request embedding on ONNX Runtime vs eager torch, alternating on the same texts."""
    emb = layer.embedder
    texts = [r["text"] for r in read_jsonl("categories_test.jsonl")[:n]]
    onnx, torch_ = [], []
    session = emb._session
    try:
        for t in texts:
            for sess, xs in ((session, onnx), (None, torch_)):
                emb._session = sess
                s = time.perf_counter()
                emb.encode_one(t)
                xs.append((time.perf_counter() - s) * 1000)
    finally:
        emb._session = session
    return {"onnx_p50": percentile(onnx, 0.5), "torch_p50": percentile(torch_, 0.5),
            "onnx_p99": percentile(onnx, 0.99), "torch_p99": percentile(torch_, 0.99),
            "speedup_p50": percentile(torch_, 0.5) / percentile(onnx, 0.5), "n": len(texts),
            "onnx": session is not None}


def http_hits(cfg, n: int) -> dict:
    """Cache hits end to end: the API app behind a real HTTP server (werkzeug, threaded, loopback), asked
    with `requests`; from sending the request to the parsed JSON answer."""
    import threading

    import requests
    from werkzeug.serving import make_server

    from api.app import create_app

    app = create_app(cfg, warm_semantic=False)
    layer = app.extensions["farm"].semantic()
    stored: dict[str, str] = {}  # question -> the answer the cache holds for it
    for r in read_jsonl("categories_test.jsonl")[:n]:
        v = layer.before("MoM", [{"role": "user", "content": r["text"]}])
        if v.action == "cached":  # stored already (by `latency`, or a paraphrase of it)
            stored[r["text"]] = v.answer or ""
        elif v.action == "forward" and layer.after(v, f"answer to: {r['text']}"):
            stored[r["text"]] = f"answer to: {r['text']}"
    port = _free_port()
    server = make_server("127.0.0.1", port, app, threaded=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    times, hits = [], 0
    try:
        with requests.Session() as http:
            for i, text in enumerate([*stored, *stored]):
                s = time.perf_counter()
                resp = http.post(url, json={"model": "MoM", "messages": [{"role": "user", "content": text}]})
                body = resp.json()
                if i >= len(stored):  # the first round warms the connection and the code paths
                    times.append((time.perf_counter() - s) * 1000)
                    hits += (resp.headers.get("x-vsr-cache-hit") == "true"
                             and body["choices"][0]["message"]["content"] == stored[text])
    finally:
        server.shutdown()
        app.extensions["farm"].gateway.router.stop()
    return {"n": len(times), "hits": hits, "p50": percentile(times, 0.5), "p99": percentile(times, 0.99)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--out", default="bench/out/semantic.json")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="farm-bench-semantic-"))
    port = _free_port()
    url = f"redis://127.0.0.1:{port}/0"
    proc = redis_server.start(port, tmp, tmp / "redis.log", appendonly=False)
    try:
        redis_server.wait_ready(url, proc)
        cfg = load_config(environ={"FARM_REDIS__URL": url})
        t0 = time.perf_counter()
        layer = SemanticLayer.from_config(cfg, redis_client=redis.Redis.from_url(url))
        load_s = time.perf_counter() - t0
        load_before = load_average()
        acc = accuracy(layer)
        lat = latency(layer, args.requests)
        paths = embed_paths(layer, min(args.requests, 200))
        e2e = http_hits(cfg, max(20, args.requests // 5))
    finally:
        proc.terminate()
        proc.wait(timeout=10)

    print(f"layer load {load_s:.1f}s; embedder threads {layer.cfg.embedding_threads}; load average {load_before}")
    print("\nheld-out accuracy")
    jb, cache = acc["jailbreak"], acc["cache"]
    print(table(["stage", "metric", "value", "n"], [
        ["category", "accuracy", acc["category"]["accuracy"], acc["category"]["n"]],
        ["jailbreak", "true-positive rate", jb["tpr"], jb["attacks"]],
        ["jailbreak", "false-positive rate (benign)", jb["fpr"], jb["benign"]],
        ["jailbreak", "false-positive rate (hard benign)", jb["fpr_hard"], jb["benign_hard"]],
        ["jailbreak", "type accuracy (detected)", jb["type_accuracy"], jb["attacks"]],
        ["cache", "precision (no wrong hits)", cache["precision"], cache["hits"]],
        ["cache", "paraphrase hit rate", cache["paraphrase_hit_rate"], cache["pairs"] // 2],
    ], digits=3))
    print("\nPII by entity type (held-out)")
    print(table(["type", "recall", "precision", "tp", "fp", "fn"],
                [[t, s["recall"], s["precision"], s["tp"], s["fp"], s["fn"]] for t, s in acc["pii"].items()], digits=3))
    print("\ncategory accuracy per domain")
    print(table(["category", "accuracy"], list(acc["category"]["per_category"].items()), digits=3))
    print(f"\nlatency of SemanticLayer.before() in ms ({lat['actions']}, CPU share {lat['cpu_share']:.2f})")
    print(table(["path", "n", "p50", "p90", "p99", "mean"],
                [[k, lat[k]["n"], lat[k]["p50"], lat[k]["p90"], lat[k]["p99"], lat[k]["mean"]] for k in ("miss", "hit")]))
    print(table(["stage", "p50 ms", "p99 ms"], [[k, lat["stages_p50"][k], lat["stages_p99"][k]] for k in lat["stages_p50"]]))
    print(f"\nper-request embedding, ONNX Runtime vs eager torch, alternating on {paths['n']} texts in one run"
          f" (ONNX Runtime available: {paths['onnx']})")
    print(table(["encoder", "p50 ms", "p99 ms"], [["onnxruntime", paths["onnx_p50"], paths["onnx_p99"]],
                                                  ["torch", paths["torch_p50"], paths["torch_p99"]]]))
    print(f"torch / onnxruntime at p50: {paths['speedup_p50']:.2f}x")
    print(f"\ncache hits end to end over HTTP: {e2e['hits']} of {e2e['n']} served from the cache, "
          f"p50 {e2e['p50']:.2f} ms, p99 {e2e['p99']:.2f} ms")
    if jb["false_positives"] or jb["missed"]:
        print(f"\njailbreak false positives: {jb['false_positives']}\njailbreak missed: {jb['missed']}")

    goals = [goal("category accuracy", acc["category"]["accuracy"], 0.85),
             goal("jailbreak TPR", jb["tpr"], 0.90), goal("jailbreak FPR", jb["fpr"], 0.05, higher_is_better=False),
             goal("cache wrong-answer hits", cache["wrong_hits"], 0, higher_is_better=False)]
    goals += [goal(f"PII recall {t}", s["recall"], 0.95) for t, s in acc["pii"].items()]
    goals += [goal(f"PII precision {t}", s["precision"], 0.90) for t, s in acc["pii"].items()]
    goals += [goal("layer p50 ms", lat["miss"]["p50"], 15, higher_is_better=False),
              goal("layer p99 ms", lat["miss"]["p99"], 50, higher_is_better=False),
              goal("cache hit p50 ms (layer part)", lat["hit"]["p50"] or 1e9, 20, higher_is_better=False),
              goal("cache hit p50 ms (end to end, HTTP)", e2e["p50"] if e2e["hits"] == e2e["n"] else 1e9, 20,
                   higher_is_better=False)]
    finish(args.out, {"config": {"requests": args.requests, "load_s": load_s, "load_average_before": load_before,
                                 "load_average_after": load_average()}, "accuracy": acc, "latency": lat,
                  "embedding_paths": paths, "http_hits": e2e}, goals,
           fmt="{:.3f}")


if __name__ == "__main__":
    main()
