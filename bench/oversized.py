"""One client's oversized request against everyone else's: how long an ordinary request waits behind it.

    .venv/bin/python -m bench.oversized [--rounds 2]

Why: the semantic layer's work runs on shared parts of an API process, its encoder and its one PII thread. An
audit found requests that held them for tens of seconds and were then refused, costing their sender no token:
an earlier assistant turn of 160 KB (left out of the prompt's token floor, so its PII pass ran before the template
refused it), 20,000 one-token system messages (each embedded and scanned), and the classification API's PII pass
over 100,000 characters, or a batch of two such texts (one Presidio call over a long text costs time quadratic
in its findings), and a later one: 100,000 characters of "a." (Presidio's schema-less URL pattern backtracked
over 253 characters and every TLD at each position). Each attack here is sent while a victim, `POST /api/v1/classify/combined` on a short
sentence (the layer's every stage, nothing generated), is asked again and again; the table gives the attack's
status and time, and the victim's longest wait while it ran, next to the victim's own time with no attack.

A real farm: the API on gunicorn (gevent) with the default configuration, its own Redis, no workers (no attack
needs one: each is refused, or answered by the layer alone). Attacks in alternating order over `--rounds`. Writes
bench/out/oversized.json.
"""

from __future__ import annotations

import argparse
import threading
import time
from typing import Any

import requests

from bench.common import alternating, finish, summarize, table
from bench.farms import bench_farm

VICTIM = {"text": "Please call Maria Keller on 020 7946 0958 about the invoice."}


def _emails(n: int) -> str:
    return "".join(f"u{i}@ex.com " for i in range(n // 10 + 1))[:n]


def attacks(model: str) -> dict[str, tuple[str, dict[str, Any]]]:
    return {
        "assistant turn, 160 KB": ("/v1/chat/completions", {"model": model, "messages": [
            {"role": "user", "content": "hi"}, {"role": "assistant", "content": _emails(160_000)},
            {"role": "user", "content": "and?"}]}),
        "20,000 system messages": ("/v1/chat/completions", {"model": model, "messages": [
            *({"role": "system", "content": f"s{i}"} for i in range(20_000)), {"role": "user", "content": "hi"}]}),
        "classify pii, 100 KB": ("/api/v1/classify/pii", {"text": _emails(100_000)}),
        "classify batch pii, 2 x 100 KB": ("/api/v1/classify/batch", {"texts": [_emails(100_000)] * 2,
                                                                        "task_type": "pii"}),
        "classify pii, 100 KB of 'a.'": ("/api/v1/classify/pii", {"text": "a." * 50_000}),
    }


def victim_ms(base: str) -> float:
    t0 = time.perf_counter()
    r = requests.post(f"{base}/api/v1/classify/combined", json=VICTIM, timeout=600)
    r.raise_for_status()
    return (time.perf_counter() - t0) * 1000


def run_attack(base: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    """The attack on its own thread; the victim asked over and over (after 0.3 s) until it ends."""
    out: dict[str, Any] = {}

    def attack() -> None:
        t0 = time.perf_counter()
        try:
            r = requests.post(f"{base}{path}", json=body, timeout=900)
            out["status"] = r.status_code
            out["code"] = (r.json().get("error") or {}).get("code") if r.status_code >= 400 else None
        except requests.RequestException as e:
            out["status"], out["code"] = None, type(e).__name__
        out["attack_s"] = time.perf_counter() - t0

    th = threading.Thread(target=attack)
    th.start()
    time.sleep(0.3)
    waits = []
    while th.is_alive() or not waits:
        waits.append(victim_ms(base))
    th.join()
    out["victim_max_ms"] = max(waits)
    out["victim_asks"] = len(waits)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default="bench/out/oversized.json")
    args = ap.parse_args()
    with bench_farm(api=True) as farm:
        base = f"http://127.0.0.1:{farm.cfg.api.port}"
        for _ in range(5):
            victim_ms(base)  # warm: the layer's first calls load lazy state
        quiet = [victim_ms(base) for _ in range(20)]
        named = attacks(farm.cfg.default_model)
        runs: dict[str, list[dict[str, Any]]] = {name: [] for name in named}
        for _, name in alternating(list(named), args.rounds):
            path, body = named[name]
            runs[name].append(run_attack(base, path, body))
            print(name, runs[name][-1], flush=True)
    q = summarize(quiet)
    rows = [("no attack (victim alone)", "-", "-", "-", q["median"], q["max"])]
    for name, rs in runs.items():
        rows.append((name, ", ".join(f"{r['status']} {r['code'] or ''}".strip() for r in rs),
                     max(r["attack_s"] for r in rs), sum(r["victim_asks"] for r in rs),
                     min(r["victim_max_ms"] for r in rs), max(r["victim_max_ms"] for r in rs)))
    print(table(["request", "answer", "attack s (max)", "victim asks", "victim longest wait ms (best round)",
                 "(worst round)"], rows))
    finish(args.out, {"victim_quiet_ms": q, "runs": runs, "rounds": args.rounds}, [])


if __name__ == "__main__":
    main()
