"""Faults against a farm of real processes with the real default model, and what became of every request.

    python -m bench.chaos [--requests 6] [--tokens 160] [--out bench/out/chaos.json]

One farm (tests/chaos/harness.py: its own redis-server with AOF, a prefill worker and two decode workers as
Celery processes, gateways reading like API processes). For each fault, `--requests` greedy streaming
requests are put in flight, the fault is injected once they are streaming, and every request is followed
to its end:
- `decode kill -9`: the decode worker serving the first request is killed mid-stream (requests migrate);
- `prefill kill -9`: the prefill worker is frozen, requests are placed on it, then it is killed before it
  prefills (the prefill is redone elsewhere or locally);
- `redis restart`: redis-server is stopped (SIGTERM, AOF flushed) mid-stream and started again on the same
  port and data dir (readers wait it out; workers keep their tokens until it is back);
- `redis down 35 s`: the same, down longer than a worker's flush retries (about 25 s), which used to give
  the events up;
- `redis refuses writes`: `maxmemory 1` for 3 s mid-stream (every write fails with OOM, as a full Redis under
  `noeviction` answers), which used to drop the flush in hand;
- `API (reader) killed`: a reader process is killed mid-stream; the worker must stop the orphaned request
  once its lease lapses (recovery = until no request runs on any worker).
Columns: requests in flight, completed (done with every token asked for, each of them received), failed cleanly
(an error event, a bounded wait), lost (no end within the timeout, or a done whose tokens did not all arrive:
must be 0), migrated (Redis faults: attempts moved to another worker, each computing its answer again; a live
worker judged gone for a heartbeat Redis could not take), recovery (s from the fault until every affected stream produced again, or the orphan stopped).
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.common import finish, goal, table
from farm.config import load_config
from farm.models.directories import require_model_dir
from farm.models.tokenization import chat_prompt_ids, get_tokenizer
from farm.protocol import DeltaEvent, DoneEvent, ErrorEvent, StartEvent
from tests.chaos.harness import MODEL, ChaosFarm, kill, reader_process

WAIT_S = 120  # a stream silent this long counts as lost


class Tracker:
    """One request followed from submit to its end, with the time of every token batch."""

    def __init__(self, farm: ChaosFarm, prompt: list[int], tokens: int):
        self.farm, self.tokens = farm, tokens
        self.sub = farm.gw.submit(farm.request(prompt, max_tokens=tokens, ignore_eos=True))
        self.outcome = "lost"
        self.delta_times: list[float] = []
        self.decode_worker: str | None = None
        self.n = 0
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        try:
            for ev in self.sub.events(first_timeout_s=WAIT_S, idle_timeout_s=WAIT_S):
                if isinstance(ev, StartEvent) and ev.decodes:
                    self.decode_worker = ev.worker
                elif isinstance(ev, DeltaEvent):
                    self.n += ev.n
                    self.delta_times.append(time.monotonic())
                elif isinstance(ev, DoneEvent):  # the usage counts what the worker made, not what arrived
                    whole = ev.usage.completion_tokens == self.tokens == self.n
                    self.outcome = "completed" if whole else "lost"
                elif isinstance(ev, ErrorEvent):
                    self.outcome = "failed"
        except Exception:  # noqa: BLE001 - a timeout: the request never ended
            self.outcome = "lost"

    def first_delta_after(self, t: float) -> float | None:
        return next((x for x in self.delta_times if x > t), None)


def wait_streaming(trackers: list[Tracker], min_tokens: int = 8, timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while any(t.n < min_tokens for t in trackers) and time.monotonic() < deadline:
        time.sleep(0.05)


def settle(trackers: list[Tracker]) -> dict[str, int]:
    for t in trackers:
        t.thread.join(WAIT_S + 10)
    out = {"completed": 0, "failed": 0, "lost": 0}
    for t in trackers:
        out[t.outcome] += 1
    return out


def recovery(trackers: list[Tracker], t_fault: float) -> float | None:
    after = [t.first_delta_after(t_fault) for t in trackers if t.outcome == "completed"]
    after = [x for x in after if x is not None]
    return round(max(after) - t_fault, 2) if after else None


def fault_decode_kill(farm: ChaosFarm, prompt: list[int], n: int, tokens: int) -> dict[str, Any]:
    trackers = [Tracker(farm, prompt, tokens) for _ in range(n)]
    wait_streaming(trackers)
    victim = next(t.decode_worker for t in trackers if t.decode_worker)
    t0 = time.monotonic()
    kill(farm.worker(victim))
    hit = [t for t in trackers if t.decode_worker == victim]
    counts = settle(trackers)
    farm.start_workers(("decode", f"decode-r{int(t0)}"))  # two decode workers again for the next fault
    return {"fault": "decode kill -9", **counts, "in_flight": n, "recovery_s": recovery(hit, t0)}


def fault_prefill_kill(farm: ChaosFarm, prompt: list[int], n: int, tokens: int) -> dict[str, Any]:
    import os
    import signal

    prefill = farm.workers["prefill-1"]
    os.kill(prefill.pid, signal.SIGSTOP)  # still registered and alive-looking: requests are placed on it
    t0 = time.monotonic()
    trackers = [Tracker(farm, prompt, tokens) for _ in range(n)]
    kill(prefill)
    counts = settle(trackers)
    firsts = [t.delta_times[0] for t in trackers if t.delta_times]
    farm.start_workers(("prefill", "prefill-2"))
    farm.workers["prefill-1"] = farm.workers.pop("prefill-2")
    return {"fault": "prefill kill -9 (before prefill)", **counts, "in_flight": n,
            "recovery_s": round(max(firsts) - t0, 2) if firsts else None}


def _redis_fault(farm: ChaosFarm, prompt: list[int], n: int, tokens: int, name: str, begin: Callable[[], Any],
                 end: Callable[[], Any], hold_s: float) -> dict[str, Any]:
    """`n` requests streaming, then `begin()`, `hold_s` seconds, `end()`; every request followed to its end, and
    the workers healed as farm up's supervisor does (a worker Celery gave up on)."""
    trackers = [Tracker(farm, prompt, tokens) for _ in range(n)]
    wait_streaming(trackers)
    t0 = time.monotonic()
    begin()
    time.sleep(hold_s)
    end()
    counts = settle(trackers)
    restarted = farm.heal()
    return {"fault": name, **counts, "in_flight": n, "recovery_s": recovery(trackers, t0),
            "workers_restarted": len(restarted), "migrated": sum(t.sub.migrations for t in trackers)}


def fault_redis_restart(farm: ChaosFarm, prompt: list[int], n: int, tokens: int) -> dict[str, Any]:
    return _redis_fault(farm, prompt, n, tokens, "redis restart (2 s down)", farm.redis.stop, farm.redis.start, 2.0)


def fault_redis_long_outage(farm: ChaosFarm, prompt: list[int], n: int, tokens: int) -> dict[str, Any]:
    """Down longer than a worker's flush retries (about 25 s)."""
    return _redis_fault(farm, prompt, n, tokens, "redis down 35 s", farm.redis.stop, farm.redis.start, 35.0)


def fault_redis_refuses_writes(farm: ChaosFarm, prompt: list[int], n: int, tokens: int) -> dict[str, Any]:
    """Every write fails (OOM command not allowed), as a full Redis under `noeviction` answers."""
    return _redis_fault(farm, prompt, n, tokens, "redis refuses writes 3 s",
                        lambda: farm.r.config_set("maxmemory", 1), lambda: farm.r.config_set("maxmemory", 0), 3.0)


def fault_reader_killed(farm: ChaosFarm, prompt: list[int], tokens: int) -> dict[str, Any]:
    req = farm.request(prompt, max_tokens=tokens * 20, ignore_eos=True)
    reader = reader_process(farm.env, req)
    assert reader.stdout is not None
    for _ in range(8):  # a few token batches: it is generating
        reader.stdout.readline()
    t0 = time.monotonic()
    kill(reader)
    stopped = None
    while time.monotonic() - t0 < 60:
        if all(farm.stats(w).get("running", 0) == 0 for w in farm.live()):
            stopped = round(time.monotonic() - t0, 2)
            break
        time.sleep(0.1)
    return {"fault": "API (reader) kill -9", "in_flight": 1, "completed": 0,
            "failed": 1 if stopped is not None else 0, "lost": 0 if stopped is not None else 1,
            "recovery_s": stopped}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=6, help="requests in flight per fault")
    ap.add_argument("--tokens", type=int, default=160, help="greedy tokens per request (ignore_eos)")
    ap.add_argument("--out", default="bench/out/chaos.json")
    args = ap.parse_args()
    cfg = load_config()
    model_dir = require_model_dir(cfg, cfg.model(cfg.default_model))
    tmp = Path(tempfile.mkdtemp(prefix="farm-chaos-"))
    farm = ChaosFarm(tmp, model_dir, FARM_SEMANTIC__ENABLED="false")
    rows: list[dict[str, Any]] = []
    try:
        farm.start_workers(("prefill", "prefill-1"), ("decode", "decode-1"), ("decode", "decode-2"))
        prompt = chat_prompt_ids(get_tokenizer(farm.cfg, MODEL),
                                 [{"role": "user", "content": "Tell me a long story about a lighthouse."}])
        for fault in (fault_decode_kill, fault_prefill_kill, fault_redis_restart, fault_redis_long_outage,
                      fault_redis_refuses_writes):
            rows.append(fault(farm, prompt, args.requests, args.tokens))
            print(rows[-1], flush=True)
        rows.append(fault_reader_killed(farm, prompt, args.tokens))
    finally:
        farm.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    cols = ["fault", "in_flight", "completed", "failed", "lost", "migrated", "recovery_s"]
    print(table(cols, [[r.get(c, "-") for c in cols] for r in rows]))
    lost = sum(r["lost"] for r in rows)
    goals = [goal("requests lost over every fault", lost, 0, higher_is_better=False)]
    finish(args.out, {"config": vars(args), "rows": rows}, goals)


if __name__ == "__main__":
    main()
