"""What a served guard costs the semantic layer (`semantic.jailbreak.remote`): a prompt classifier asked about
every message or only about what the bundled head is unsure of, and a generative guard behind a chat endpoint.

    .venv/bin/python -m bench.remote_guard [--requests 300] [--rounds 2] [--ask-above 0.05]

The classifier: the tiny random-weight sequence classifier (bench.engine_speed.model.make_tiny_classifier:
SmolLM2's tokenizer, 2 layers, hidden 128; made here, never committed) served by `vllm serve --runner pooling` on
this machine, where a forward costs about what a real guard's costs on a GPU. Its verdicts mean nothing, so its
threshold is 1.0 (it never blocks) and every classifier contender runs the same stages: what is measured is the
farm's path to the guard and back (HTTP, JSON, the checks) and vLLM's own serving path. The generative guard:
the same tiny Llama as a causal LM (make_tiny_model) served by `vllm serve`, its answer constrained to
`safe` / `unsafe` (`choice`); its verdicts mean nothing either, but an `unsafe` one blocks (a generative verdict
has no probability to hold under a threshold), and a blocked request skips the layer's later stages, so the
table gives that contender's blocked count and its latency over the requests it let through.
Contenders, in alternating order over `--rounds`, each a fresh layer (nothing remembered) from the default
configuration with the cache off, over the held-out prompts of `bench.semantic`'s latency run, one at a time:
- `head`: no remote guard (the default);
- `remote-all`: the classifier asked about every message (`ask_above` 0);
- `remote-cascade`: asked only when the head's attack probability is at least `--ask-above`;
- `remote-chat`: the generative guard asked about every message (`protocol: chat`, `choice`, 4 answer tokens);
- `remote-chat-logprobs`: the same with `score: logprobs` (the answer's top-20 log-probabilities, P(unsafe) held
  under `threshold` 0.5).
Writes bench/out/remote_guard.json; guard errors are counted (a run with any is a failed run).
"""

from __future__ import annotations

import argparse
import contextlib
import tempfile
import time
from pathlib import Path

import yaml

from bench.common import alternating, finish, percentile, table
from bench.peers.procs import Service, vllm_server, wait_http

CONTENDERS = ["head", "remote-all", "remote-cascade", "remote-chat", "remote-chat-logprobs"]


def serve_guard(name: str, model_dir: Path, log: Path, *flags: str) -> tuple[Service, str]:
    """A guard on `vllm serve` (eager, float32, a 64 MiB KV cache), served as `name`."""
    return vllm_server(f"vllm-{name}", ["--model", str(model_dir), "--served-model-name", name, "--dtype", "float32",
                                        "--kv-cache-memory-bytes", str(64 * 2**20), "--enforce-eager", *flags], log)


def guard_cpu_s(guard: Service) -> float:
    """CPU seconds used so far by the guard's processes (vLLM's API server, its engine core and workers)."""
    import psutil

    total = 0.0
    try:
        root = psutil.Process(guard.proc.pid)
        for p in [root, *root.children(recursive=True)]:
            with contextlib.suppress(psutil.NoSuchProcess):
                t = p.cpu_times()
                total += t.user + t.system
    except psutil.NoSuchProcess:
        pass
    return total


def layer_for(contender: str, urls: dict[str, str], ask_above: float, tmp: Path):  # noqa: ANN201 - a SemanticLayer
    from farm.config import load_config
    from farm.semantic.layer import SemanticLayer

    jailbreak: dict = {}
    if contender.startswith("remote-chat"):
        jailbreak["remote"] = {"url": urls["chat"] + "/v1/chat/completions", "protocol": "chat", "model": "chat-guard",
                               "labels": ["safe", "unsafe"], "positive_labels": ["unsafe"], "choice": True,
                               "max_tokens": 4}
        if contender == "remote-chat-logprobs":
            jailbreak["remote"].update(score="logprobs", threshold=0.5)
    elif contender != "head":
        jailbreak["remote"] = {"url": urls["classify"] + "/classify", "model": "guard", "threshold": 1.0,
                               "ask_above": ask_above if contender == "remote-cascade" else 0.0}
    path = tmp / f"{contender}.yaml"
    path.write_text(yaml.safe_dump({"semantic": {"cache": {"enabled": False}, "jailbreak": jailbreak}}))
    return SemanticLayer.from_config(load_config(path, environ={}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--ask-above", type=float, default=0.05)
    ap.add_argument("--out", default="bench/out/remote_guard.json")
    args = ap.parse_args()

    from bench.engine_speed.model import make_tiny_classifier, make_tiny_model, source_tokenizer_dir
    from bench.semantic import latency_texts

    texts = latency_texts(args.requests)
    runs: dict[str, list[dict]] = {c: [] for c in CONTENDERS}
    with tempfile.TemporaryDirectory(prefix="farm-bench-guard-") as d:
        tmp = Path(d)
        model = make_tiny_classifier(tmp / "guard-model", source_tokenizer_dir())
        guard, url = serve_guard("guard", model, tmp / "vllm-guard.log", "--runner", "pooling", "--max-model-len", "512")
        chat_guard, chat_url = serve_guard("chat-guard", make_tiny_model(tmp / "chat-guard-model"),
                                           tmp / "vllm-chat-guard.log", "--max-model-len", "2048")
        urls = {"classify": url, "chat": chat_url}
        try:
            start_s = wait_http(url + "/v1/models", 600, [guard, chat_guard])
            wait_http(chat_url + "/v1/models", 600, [guard, chat_guard])
            for rnd, contender in alternating(CONTENDERS, args.rounds):
                layer = layer_for(contender, urls, args.ask_above, tmp)
                served = chat_guard if contender.startswith("remote-chat") else guard
                for t in texts[:10]:  # warm-up; then a fresh memo, so every prompt is embedded and asked
                    layer.before("MoM", [{"role": "user", "content": t}], no_cache=True)
                layer.forget()
                ms, asked, errors, blocked, quiet, passed = [], 0, 0, 0, [], []
                cpu0, wall0 = guard_cpu_s(served), time.perf_counter()
                for t in texts:
                    t0 = time.perf_counter()
                    v = layer.before("MoM", [{"role": "user", "content": t}], no_cache=True)
                    ms.append((time.perf_counter() - t0) * 1000)
                    remote = v.explain.get("jailbreak", {}).get("remote", {})
                    asked += remote.get("asked", 0)
                    if not remote.get("asked"):
                        quiet.append(ms[-1])  # requests that did not ask the guard
                    errors += "error" in remote
                    blocked += v.action == "block"
                    if v.action != "block":
                        passed.append(ms[-1])  # requests that went through every stage
                # the guard's CPU share of the run: a co-located guard takes cores from the layer
                guard_share = (guard_cpu_s(served) - cpu0) / (time.perf_counter() - wall0)
                runs[contender].append({"round": rnd, "ms": ms, "asked": asked, "errors": errors, "blocked": blocked,
                                        "not_asked_ms": quiet, "passed_ms": passed, "guard_cpu_share": guard_share})
                print(f"round {rnd} {contender}: p50 {percentile(ms, 0.5):.1f} ms, asked {asked}, errors {errors}",
                      flush=True)
        finally:
            guard.stop()
            chat_guard.stop()
    rows, results = [], {}
    for c in CONTENDERS:
        pooled = [x for r in runs[c] for x in r["ms"]]
        res = {"p50_ms": percentile(pooled, 0.5), "p90_ms": percentile(pooled, 0.9), "p99_ms": percentile(pooled, 0.99),
               "p50_by_round": [percentile(r["ms"], 0.5) for r in runs[c]], "asked_share":
               sum(r["asked"] for r in runs[c]) / (len(texts) * len(runs[c])), "errors": sum(r["errors"] for r in runs[c]),
               "blocked": sum(r["blocked"] for r in runs[c]),
               "p50_not_asked_ms": percentile([x for r in runs[c] for x in r["not_asked_ms"]], 0.5),
               "p50_passed_ms": percentile([x for r in runs[c] for x in r["passed_ms"]], 0.5),
               "guard_cpu_share": sum(r["guard_cpu_share"] for r in runs[c]) / len(runs[c])}
        results[c] = {**res, "runs": runs[c]}
        rows.append([c, "FAILED" if res["errors"] else "ok", " / ".join(f"{x:.1f}" for x in res["p50_by_round"]),
                     res["p50_ms"], res["p90_ms"], res["p99_ms"], res["p50_not_asked_ms"], f"{res['asked_share']:.2f}",
                     res["blocked"], res["p50_passed_ms"], f"{res['guard_cpu_share']:.2f}", res["errors"]])
    print(table(["contender", "status", "p50 ms by round", "p50 ms", "p90 ms", "p99 ms", "p50 ms, not asked",
                 "asked", "blocked", "p50 ms, not blocked", "guard CPU (cores)", "errors"], rows, digits=1))
    finish(args.out, {"command": "python -m bench.remote_guard", "requests": len(texts), "rounds": args.rounds,
                      "ask_above": args.ask_above, "guard_start_s": start_s, "results": results}, [])


if __name__ == "__main__":
    main()
