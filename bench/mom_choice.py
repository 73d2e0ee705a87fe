"""MoM's model choice judged by time to first token, and its fallback when a model's worker dies (issue 29, item 5).

    .venv/bin/python -m bench.mom_choice            # score vs kv-aware in alternating order, 2 rounds; the kill phase
    .venv/bin/python -m bench.mom_choice --affinity # per-turn vs conversation category, system prompts injected
    .venv/bin/python -m bench.mom_choice --kill-only  # the kill phase alone
    .venv/bin/python -m bench.mom_choice --smoke    # tiny sizes, one round: proves it runs

Two model entries with the same weights (the default model, and a copy named `<default>-b`) serve every category
equally well: the categories' `model_scores` give them 0.9 and 0.88, within `semantic.cache_aware_margin`
(0.05), and the classifier's threshold is 0, so every request gets a category. One aggregated worker per model,
one torch thread each (2 cores). Modes, each a fresh farm:
- `score`: `cache_aware_margin: 0`, the best score alone decides (every request to the first model);
- `kv-aware`: the default margin, MoM asks the router where the prompt would start soonest (its KV-block index
  and the workers' load: `x-vsr-selection-reason: kv-cache | load`).
Workload: `--conversations` conversations, each a long system prompt of its own (`--prefix-tokens`) and
`--turns` short user turns sent one after another with the growing history (so a conversation's later turns
find their prefix cached where the earlier ones ran), arriving by a seeded Poisson process at `--rate`
requests per second (bench.goodput's open-loop client), streamed, `--output-tokens` each, the semantic cache
off, and no category system prompt injected (these two modes classify each turn alone: a turn of another
category would get another system prompt in front of the conversation, and no turn would find the earlier ones'
prefix cached on any model; measured by the smoke run before conversation affinity: hit ratio 0.01-0.02). The
headline is TTFT p50 of kv-aware / score (issue 29's goal: <= 0.7), beside TTFT p90, ITL, request latency, the
prefix-cache hit ratio, the requests per model and the selection reasons. Any failed request marks its mode FAILED.

`--affinity` compares instead, on the same workload and the same kv-aware choice, with the categories' system
prompts injected (the default configuration): `per-turn` (`semantic.conversation.affinity: false`, every turn
classified alone) against `conversation` (the default: the conversation's category, farm.semantic.conversation).
Beside the table: the hit ratio of the later turns, and how often a later turn's category differed from the turn
before it (the model's or the system prompt's change that loses the conversation's cached prefix).

The kill phase (`--kill-at-s`, kv-aware): the first model's worker is killed (SIGKILL) while the load runs, and the
bench supervises the farm as `farm run` does (the worker is restarted under its name). Requests MoM sent there that
had not started move to the other model (`x-vsr-fallback: ...; reason=...`); one that had streamed tokens cannot (a
different model may not continue another's answer): it waits up to `reliability.migration_wait_s` for the restarted
worker, and fails if none takes it: counted.
Writes bench/out/mom_choice.json (smoke: mom_choice-smoke.json).
"""

from __future__ import annotations

import argparse
import os
import random
import secrets
import signal
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import yaml

from bench.common import OUT_DIR, alternating, finish, goal, load_average, table
from bench.goodput import Conversation, run_rate, summarize
from bench.peers.load import warm_up_http
from bench.routing import question, text_of

# each mode's semantic settings over farm_env's: the cache off and the classifier's threshold 0 in every mode
MODES: dict[str, dict[str, Any]] = {
    "score": {"cache_aware_margin": 0.0, "inject_system_prompt": False, "conversation": {"affinity": False}},
    "kv-aware": {"cache_aware_margin": 0.05, "inject_system_prompt": False, "conversation": {"affinity": False}},
}
AFFINITY_MODES: dict[str, dict[str, Any]] = {
    "per-turn": {"cache_aware_margin": 0.05, "inject_system_prompt": True, "conversation": {"affinity": False}},
    "conversation": {"cache_aware_margin": 0.05, "inject_system_prompt": True, "conversation": {"affinity": True}},
}


def conversations(args: argparse.Namespace, tok: Any, tag: str) -> list[Conversation]:
    rng = random.Random(f"{args.seed}-{tag}")
    return [Conversation(f"Project {tag}-{c}. Background notes: " + text_of(rng, tok, args.prefix_tokens),
                         [question(rng, tok, args.question_tokens) for _ in range(args.turns)], f"conversation {c}")
            for c in range(args.conversations)]


def farm_env(tmp: Path, semantic: dict[str, Any], args: argparse.Namespace) -> tuple[dict[str, str], list[str]]:
    """The environment of a farm serving the default model's weights under two names that score alike."""
    from farm.config import load_config
    from tests.conftest import free_port, make_farm_env

    env = make_farm_env(f"redis://127.0.0.1:{free_port()}/0", tmp)
    one = yaml.safe_load(Path(env["FARM_CONFIG"]).read_text())["models"][0]  # the prepared default, by path
    names = [one["name"], f"{one['name']}-b"]
    cats = [{**c.model_dump(mode="json", exclude_none=True), "model_scores": {names[0]: 0.9, names[1]: 0.88}}
            for c in load_config(environ={}).semantic.categories]
    override = {"models": [{**one, "name": n} for n in names],
                "engine": {"torch_threads": 1, "kv_cache_mb": args.kv_mb},
                "api": {"allow_unauthenticated": True},
                "semantic": {"categories": cats, "classifier": {"threshold": 0.0}, "cache": {"enabled": False},
                             **semantic}}
    path = tmp / "mom-choice.yaml"
    path.write_text(yaml.safe_dump(override))
    env["FARM_CONFIG"] = str(path)
    return env, names


def run_mode(mode: str, rnd: int, args: argparse.Namespace, tok: Any, kill_at_s: float = 0.0) -> dict[str, Any]:
    """A fresh farm in `mode`; the workload once (its texts differ per round); with `kill_at_s`, the first
    model's worker is killed that long into the run."""
    from farm.config import load_config
    from farm.supervisor import Farm
    from tests.conftest import free_port

    tmp = Path(tempfile.mkdtemp(prefix=f"farm-mom-{mode}-"))
    env, names = farm_env(tmp, {**MODES, **AFFINITY_MODES}[mode], args)
    cfg = load_config(environ=env)
    rec: dict[str, Any] = {"mode": mode, "round": rnd, "killed": bool(kill_at_s)}
    print(f"round {rnd + 1}: {mode}{' + kill' if kill_at_s else ''} (load {load_average()})", flush=True)
    t0 = time.monotonic()
    try:
        with Farm(cfg, prefill=0, decode=0, both=1, models=names, port=free_port(), flower=False,
                  env=env).running(600) as farm:
            rec["start_s"] = time.monotonic() - t0
            url = f"http://127.0.0.1:{farm.api_port}"
            for name in names:
                warm_up_http(url, name)
            time.sleep(3.0)  # the workers' heartbeats carry their first measured step costs to the router
            killer = None
            supervising = threading.Event()
            if kill_at_s:
                victim = next(p for p in farm.procs if p.name == "both-1")  # the first model's worker

                def kill() -> None:
                    time.sleep(kill_at_s)
                    os.kill(victim.pid, signal.SIGKILL)
                    rec["killed_at_s"] = kill_at_s

                def supervise() -> None:  # as `farm run` does: a worker that dies is restarted under its name
                    while not supervising.wait(0.5):
                        farm.supervise_once()
                killer = threading.Thread(target=kill, daemon=True)
                killer.start()
                threading.Thread(target=supervise, daemon=True).start()
            tag = f"r{rnd}" + ("-kill" if kill_at_s else "")
            try:
                rec["run"] = run_rate(url, "MoM", conversations(args, tok, tag), args.rate, args.turns,
                                      f"{args.seed}-{tag}", args)
            finally:
                supervising.set()
            if killer is not None:
                killer.join()
            rec["restarts"] = {p.name: p.restarts for p in farm.procs if p.restarts}
    except Exception as e:  # noqa: BLE001 - a farm that fails to run is reported FAILED, not a crash
        rec["error"] = f"{type(e).__name__}: {e}"
    rec["names"] = names
    return rec


def row(name: str, recs: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    runs = [{**r["run"], "error": r.get("error")} for r in recs if "run" in r]
    runs += [{"raw": [], "errors": [], "span_s": 0.0, "error": r["error"]} for r in recs if "run" not in r]
    s = summarize(runs, args.ttft_slo_ms / 1000, args.itl_slo_ms / 1000)
    done = [x for run in runs for x in run["raw"] if not x["error"]]
    s["models"] = dict(Counter(x.get("model", "") for x in done))
    s["reasons"] = dict(Counter((x.get("vsr") or {}).get("x-vsr-selection-reason", "") for x in done))
    s["fallbacks"] = sum(1 for x in done if "x-vsr-fallback" in (x.get("vsr") or {}))
    s["first_errors"] = [e for run in runs for e in run["errors"]][:5] + [r["error"] for r in runs if r.get("error")]
    s.update(later_turns(runs))
    return {"contender": name, **s}


def later_turns(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """What the turns after a conversation's first met: their prefix-cache hit ratio, and the share of them whose
    category (x-vsr-selected-category) or model differed from the turn before in the same conversation."""
    hit = prompt = changed = later = 0
    for run in runs:
        before: dict[int, tuple[str, str]] = {}
        for x in sorted((x for x in run["raw"] if not x["error"]), key=lambda x: (x["conversation"], x["turn"])):
            now = ((x.get("vsr") or {}).get("x-vsr-selected-category", ""), x.get("model", ""))
            if x["turn"] > 0:
                hit, prompt, later = hit + x["cached_tokens"], prompt + x["prompt_tokens"], later + 1
                changed += x["conversation"] in before and before[x["conversation"]] != now
            before[x["conversation"]] = now
    return {"later_hit_ratio": hit / prompt if prompt else None, "later_changed": changed / later if later else None}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--kill-only", action="store_true", help="the kill phase alone (kv-aware, a worker killed)")
    ap.add_argument("--affinity", action="store_true",
                    help="per-turn vs conversation category, system prompts injected (no kill phase)")
    ap.add_argument("--rounds", type=int, help="rounds in alternating order (default 2, smoke 1)")
    ap.add_argument("--conversations", type=int, help="default 24, smoke 4")
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--prefix-tokens", type=int, help="each conversation's system prompt (default 700, smoke 200)")
    ap.add_argument("--question-tokens", type=int, default=24)
    ap.add_argument("--output-tokens", type=int, default=24)
    ap.add_argument("--rate", type=float, default=0.5, help="requests per second (Poisson)")
    ap.add_argument("--kv-mb", type=int, default=256, help="KV cache per worker, MiB")
    ap.add_argument("--kill-at-s", type=float, help="the kill phase: seconds into it (default 40, smoke 0 = off)")
    ap.add_argument("--ttft-slo-ms", type=float, default=4000.0)
    ap.add_argument("--itl-slo-ms", type=float, default=250.0)
    ap.add_argument("--seed", type=int, default=29)
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    defaults = ({"rounds": 1, "conversations": 4, "prefix_tokens": 200, "kill_at_s": 0.0} if args.smoke else
                {"rounds": 2, "conversations": 24, "prefix_tokens": 700, "kill_at_s": 40.0})
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.affinity:
        args.kill_at_s = 0.0
    if args.kill_only and not args.kill_at_s:
        ap.error("--kill-only needs the kill phase (--kill-at-s > 0; off in --smoke and --affinity)")
    name = "mom_affinity" if args.affinity else "mom_choice-kill" if args.kill_only else "mom_choice"
    args.out = args.out or str(OUT_DIR / (f"{name}-smoke.json" if args.smoke else f"{name}.json"))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from farm.config import load_config
    from farm.models.tokenization import get_tokenizer

    os.environ.setdefault("FARM_SECRET", secrets.token_hex(16))
    base = load_config(environ={})
    tok = get_tokenizer(base, base.default_model)
    t0 = time.monotonic()
    modes = [] if args.kill_only else list(AFFINITY_MODES if args.affinity else MODES)
    records = [run_mode(mode, rnd, args, tok) for rnd, mode in alternating(modes, args.rounds)]
    if args.kill_at_s:
        records.append(run_mode("kv-aware", args.rounds, args, tok, kill_at_s=args.kill_at_s))
    rows = [row(m, [r for r in records if r["mode"] == m and not r["killed"]], args) for m in modes]
    if args.kill_at_s:
        rows.append(row("kv-aware, first model's worker killed", [r for r in records if r["killed"]], args))
    print(f"\n{args.conversations} conversations x {args.turns} turns at {args.rate:g} req/s, system prompts of "
          f"{args.prefix_tokens} tokens, {args.output_tokens} output tokens; pooled over {args.rounds} round(s)")
    print(table(["mode", "status", "TTFT p50", "p90", "ITL p50", "latency p50", "p90", "goodput", "hit",
                 "later turns: hit", "changed", "per model", "reasons", "fallbacks", "errors"],
                [[r["contender"], "FAILED" if r["failed"] else "ok", r["ttft_p50_ms"], r["ttft_p90_ms"],
                  r["itl_p50_ms"], r["latency_p50_ms"], r["latency_p90_ms"], r["goodput_rps"], r["hit_ratio"],
                  r["later_hit_ratio"], r["later_changed"], "/".join(str(v) for v in r["models"].values()),
                  r["reasons"], r["fallbacks"], r["errors"]]
                 for r in rows], digits=2))
    by = {r["contender"]: r for r in rows}
    if args.affinity:
        ratios = {k: by["conversation"][k] / by["per-turn"][k] for k in ("ttft_p50_ms", "ttft_p90_ms", "latency_p50_ms")
                  if by["per-turn"][k] and by["conversation"][k] is not None}
        print("\nconversation / per-turn: " + ", ".join(f"{k} {v:.2f}" for k, v in ratios.items()))
        goals = [goal("failed requests (per-turn, conversation)",
                      float(by["per-turn"]["errors"] + by["conversation"]["errors"]), 0.0, higher_is_better=False)]
        finish(args.out, {"benchmark": "mom_affinity", "args": vars(args), "wall_s": time.monotonic() - t0,
                          "rows": rows, "ratios": ratios, "records": records}, goals)
        return 1 if any(r["failed"] for r in rows) else 0
    goals = []
    if modes and by["score"]["ttft_p50_ms"] and by["kv-aware"]["ttft_p50_ms"] is not None:
        goals.append(goal("TTFT p50 kv-aware / score", by["kv-aware"]["ttft_p50_ms"] / by["score"]["ttft_p50_ms"],
                          0.7, higher_is_better=False))
    if modes:
        goals.append(goal("failed requests (score, kv-aware)", float(by["score"]["errors"] + by["kv-aware"]["errors"]),
                          0.0, higher_is_better=False))
    if args.kill_at_s:
        goals.append(goal("failed requests with a model's worker killed", float(rows[-1]["errors"]), 0.0,
                          higher_is_better=False))
    finish(args.out, {"benchmark": "mom_choice", "args": vars(args), "wall_s": time.monotonic() - t0,
                      "rows": rows, "records": records}, goals)
    return 1 if any(r["failed"] for r in rows[:len(modes)]) else 0


if __name__ == "__main__":
    raise SystemExit(main())
