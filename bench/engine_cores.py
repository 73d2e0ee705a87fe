"""Two vLLM engines on two cores, decoding: where their engine cores run decides the ITL.

    .venv/bin/python -m bench.engine_cores                # 3 contenders x 2 rounds, about 20 minutes
    .venv/bin/python -m bench.engine_cores --smoke        # one short round: proves it runs

vLLM binds only its model executor's compute threads to cores; its engine core (the scheduler process, which
waits for the executor in a busy loop) may run anywhere. With two workers on two cores, an engine core that
floats spins on the other worker's core and takes CPU from that worker's executor. The farm keeps each worker's
engine core on its own core share (`models[].vllm.pin_engine_core`, farm/backends/cpu_binding.py). This bench
compares, on the same load, in alternating order (A B C, C B A, ...):
- `farm-pinned`: the farm with 2 `backend: vllm` workers, round-robin placement, as configured by default;
- `farm-floating`: the same with `pin_engine_core: false` (the engine cores float, as before);
- `router-round_robin`: vLLM's router (round_robin) over 2 `vllm serve`, each bound to one core as bench.peers
  binds them (their engine cores float: vLLM's own behaviour).
Load: `--streams` closed-loop streamed chats (SmolLM2-135M-Instruct, a short distinct prompt each,
`--max-tokens` output tokens with `ignore_eos`, greedy) for `--seconds` after a warm-up: decode dominates, so
the step time is what is measured. Reported: output tok/s, ITL p50/p90 (gaps between content chunks), errors (a
contender with one is FAILED), and CPU by process kind (cores used on average, bench/cpu.py).
Writes bench/out/engine_cores.json (smoke: engine_cores-smoke.json).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from pathlib import Path
from typing import Any

import aiohttp

from bench.common import OUT_DIR, alternating, finish, load_average, percentile, table
from bench.cpu import cpu_by_kind
from bench.peers import contenders as c
from bench.peers import install

CONTENDERS = ("farm-pinned", "farm-floating", "router-round_robin")
WORDS = "alpha beta gamma delta river mountain cloud stone paper music garden window lantern harbor".split()


def contender(name: str, s: c.Setup) -> Any:
    if name == "router-round_robin":
        return c.vllm_router(s, "round_robin")
    pinned = name == "farm-pinned"
    models = c.farm_overrides(s, "vllm", "round-robin")["models"]
    extra = {"models": [{**m, "vllm": {**m["vllm"], "pin_engine_core": pinned}} for m in models]}
    return c.farm(s, "vllm", 2, "round-robin", extra)


async def _stream(sess: aiohttp.ClientSession, url: str, prompt: str, max_tokens: int) -> tuple[list[float], int]:
    """One streamed chat: the gaps between its content chunks (s) and its completion tokens (from usage)."""
    body = {"model": c.MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0.0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    gaps: list[float] = []
    last, tokens = None, 0
    async with sess.post(url, json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {(await resp.text())[:300]}")
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if chunk.get("usage"):
                tokens = int(chunk["usage"]["completion_tokens"])
            if any((ch.get("delta") or {}).get("content") for ch in chunk.get("choices") or []):
                now = time.perf_counter()
                if last is not None:
                    gaps.append(now - last)
                last = now
    if not tokens:
        raise RuntimeError("the stream ended without usage")
    return gaps, tokens


async def closed_loop(base_url: str, streams: int, max_tokens: int, seconds: float, seed: int) -> dict[str, Any]:
    """`streams` clients, each sending its next chat when the last ended, for `seconds`."""
    rng = random.Random(seed)
    url = base_url.rstrip("/") + "/v1/chat/completions"
    gaps: list[float] = []
    tokens, errors, sent = [0], [0], [0]
    stop = time.monotonic() + seconds
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as sess:
        async def client() -> None:
            while time.monotonic() < stop:
                sent[0] += 1
                prompt = f"Story {seed}-{sent[0]}: " + " ".join(rng.choice(WORDS) for _ in range(60))
                try:
                    g, n = await _stream(sess, url, prompt, max_tokens)
                except Exception as e:  # noqa: BLE001 - counted, the run goes on
                    errors[0] += 1
                    print(f"    error: {e}", flush=True)
                    continue
                gaps.extend(g)
                tokens[0] += n

        t0 = time.perf_counter()
        await asyncio.gather(*[client() for _ in range(streams)])
        wall = time.perf_counter() - t0
    return {"wall_s": wall, "tokens": tokens[0], "tok_s": tokens[0] / wall, "errors": errors[0],
            "itl_p50_ms": 1000 * (percentile(gaps, 0.5) or 0), "itl_p90_ms": 1000 * (percentile(gaps, 0.9) or 0),
            "gaps": len(gaps)}


def run_one(name: str, rnd: int, args: argparse.Namespace, s: c.Setup) -> dict[str, Any]:
    record: dict[str, Any] = {"contender": name, "round": rnd, "load_average_start": load_average()}
    print(f"round {rnd + 1}/{args.rounds}: {name} (load {record['load_average_start']})", flush=True)
    try:
        with contender(name, s) as ep:
            asyncio.run(closed_loop(ep.base_url, args.streams, args.max_tokens, args.warmup, seed=10_000 + rnd))
            with cpu_by_kind("machine") as cpu:
                record.update(asyncio.run(closed_loop(ep.base_url, args.streams, args.max_tokens, args.seconds,
                                                      seed=rnd)))
            record["cores_by_kind"] = {k: round(v / record["wall_s"], 3) for k, v in cpu.items()}
            record["commands"] = ep.commands
    except Exception as e:  # noqa: BLE001 - a contender that fails is reported, the others still run
        record["error"] = f"{type(e).__name__}: {e}"
    print(f"    {name}: {record.get('tok_s', 0):.1f} tok/s, ITL p50 {record.get('itl_p50_ms', 0):.1f} ms, "
          f"p90 {record.get('itl_p90_ms', 0):.1f} ms, errors {record.get('errors', '-')}"
          + (f"  !! {record['error']}" if "error" in record else ""), flush=True)
    return record


def pooled(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for name in dict.fromkeys(r["contender"] for r in records):
        mine = [r for r in records if r["contender"] == name]
        ok = [r for r in mine if "error" not in r]
        failed = len(ok) < len(mine) or any(r["errors"] for r in ok)
        kinds = sorted({k for r in ok for k in r["cores_by_kind"]})
        rows.append({
            "contender": name, "status": "FAILED" if failed else "ok",
            "tok_s": [round(r["tok_s"], 1) for r in ok], "itl_p50_ms": [round(r["itl_p50_ms"], 1) for r in ok],
            "itl_p90_ms": [round(r["itl_p90_ms"], 1) for r in ok], "errors": sum(r.get("errors", 0) for r in ok),
            "cores_by_kind": {k: round(sum(r["cores_by_kind"].get(k, 0.0) for r in ok) / max(1, len(ok)), 3)
                              for k in kinds},
        })
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="one short round of each contender")
    ap.add_argument("--contenders", default=",".join(CONTENDERS))
    ap.add_argument("--rounds", type=int, help="rounds in alternating order (default 2, smoke 1)")
    ap.add_argument("--streams", type=int, default=8, help="closed-loop streams (default 8: 4 per engine)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--seconds", type=float, help="measured seconds per contender and round (default 90, smoke 15)")
    ap.add_argument("--warmup", type=float, default=10.0, help="seconds of the same load before measuring")
    ap.add_argument("--eager", action=argparse.BooleanOptionalAction, default=True,
                    help="vLLM --enforce-eager (fast starts; the default)")
    ap.add_argument("--out", help="JSON path (default bench/out/engine_cores.json)")
    args = ap.parse_args(argv)
    args.rounds = args.rounds or (1 if args.smoke else 2)
    args.seconds = args.seconds or (15.0 if args.smoke else 90.0)
    if args.smoke:
        args.warmup = min(args.warmup, 3.0)
    names = [n for n in args.contenders.split(",") if n]
    unknown = set(names) - set(CONTENDERS)
    if unknown:
        ap.error(f"unknown contenders {sorted(unknown)}; choose from {', '.join(CONTENDERS)}")
    if "router-round_robin" in names:
        install.router()
    from farm.config import load_config
    from farm.models.directories import model_dir

    base = load_config(environ={})
    logs = install.PEERS_DIR / "logs" / time.strftime("engine-cores-%Y%m%d-%H%M%S")
    setup = c.Setup(model_dir(base, base.model(base.default_model)), logs, kv_bytes=512 * 2**20,
                    enforce_eager=args.eager)
    print(f"contenders {names}; {args.streams} streams x {args.max_tokens} tokens for {args.seconds:.0f} s; "
          f"{args.rounds} round(s); load {load_average()}", flush=True)
    records = [run_one(name, rnd, args, setup) for rnd, name in alternating(names, args.rounds)]
    rows = pooled(records)
    kinds = sorted({k for row in rows for k in row["cores_by_kind"]})
    print("\nTwo vLLM engines on two cores, closed-loop decode; by round (alternating order); CPU: cores used, mean")
    print(table(["contender", "status", "tok/s", "ITL p50 ms", "ITL p90 ms", "errors", *kinds],
                [[r["contender"], r["status"], " / ".join(map(str, r["tok_s"])),
                  " / ".join(map(str, r["itl_p50_ms"])), " / ".join(map(str, r["itl_p90_ms"])), r["errors"],
                  *(r["cores_by_kind"].get(k, 0.0) for k in kinds)] for r in rows], digits=3))
    out = args.out or OUT_DIR / ("engine_cores-smoke.json" if args.smoke else "engine_cores.json")
    finish(Path(out), {"args": vars(args), "rows": rows, "records": records}, [])
    return 0 if all(r["status"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
