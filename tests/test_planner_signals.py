"""Signals read from a real Redis, the planner's dry run, its published state and `farm status`."""

from __future__ import annotations

import json
import time

import pytest

from farm.cli.main import main
from farm.cli.status import collect_status
from farm.cluster import registry
from farm.config import load_config
from farm.config.planner import Bounds, LoadPolicyConfig, PlannerConfig
from farm.planner.planner import Planner, read_state
from farm.planner.signals import RedisSignals
from farm.protocol import PRIORITY_SEP, queue_name
from farm.protocol.keys import OBS_STREAM, PLANNER_EVENTS_KEY
from farm.protocol.queues import direct_queue
from farm.router.load import LoadTracker

MODEL = "SmolLM2-135M-Instruct"


def worker(r, wid: str, role: str, **stats) -> None:
    registry.register(r, registry.WorkerInfo(wid, role, MODEL, "h", 1, 16))
    registry.heartbeat(r, wid, stats)


def obs(r, ts: float, **o) -> None:
    r.xadd(OBS_STREAM, {"o": json.dumps({"model": MODEL, "ts": ts, **o})})


@pytest.fixture
def busy_farm(redis_client):
    """One prefill and two decode workers with queued work, placed load, KV use and finished requests."""
    r = redis_client
    worker(r, "prefill-1@h", "prefill", running=1, waiting=2, blocks_total=100, blocks_free=90)
    worker(r, "decode-1@h", "decode", running=3, waiting=0, blocks_total=100, blocks_free=40)
    worker(r, "decode-2@h", "decode", running=1, waiting=0, blocks_total=100, blocks_free=80)
    r.lpush(queue_name(MODEL, "prefill"), "a", "b")
    r.lpush(f"{direct_queue('prefill-1@h')}{PRIORITY_SEP}3", "c")
    r.lpush(queue_name(MODEL, "decode"), "d")
    lt = LoadTracker(r)
    lt.begin("p", "prefill-1@h", "r1", 1500)
    lt.begin("p", "prefill-1@h", "r2", 700)
    for i, w in enumerate(["decode-1@h"] * 3 + ["decode-2@h"]):
        lt.begin("d", w, f"q{i}", 10)
    now = time.time()
    obs(r, now - 5, ttft=0.5, itl=0.04, isl=2000, osl=100, prefill="remote")
    obs(r, now - 3, ttft=0.1, itl=0.02, isl=100, osl=50, prefill="local")
    obs(r, now - 2, ttft=0.3, itl=0.03, isl=300, osl=30, prefill="local")
    r.xadd(OBS_STREAM, {"o": json.dumps({"model": "other", "ts": now, "ttft": 9, "isl": 1, "osl": 1})})
    return r


def test_role_signals_from_redis(busy_farm):
    sig = RedisSignals(busy_farm, window_s=30, remote_min_tokens=1000).collect(MODEL)
    pre, dec = sig.roles["prefill"], sig.roles["decode"]
    assert (pre.workers, pre.queued, pre.pending_tokens, pre.pending_requests) == (1, 3, 2200, 2)
    assert (pre.running, pre.waiting, pre.kv_used, pre.kv_total) == (1, 2, 10, 100)
    assert (dec.workers, dec.queued, dec.decoding, dec.running) == (2, 1, 4, 4)
    assert dec.kv_util == pytest.approx(0.4)  # (60 + 20) / 200
    t = sig.traffic
    assert t.requests == 3 and t.isl == pytest.approx(800) and t.osl == pytest.approx(60)
    assert t.remote_fraction == pytest.approx(1 / 3) and t.remote_isl == 2000 and t.inflight == 4
    assert t.rate == pytest.approx(3 / 30)  # first reading: completions over the window


def test_arrival_rate_counts_requests_still_in_flight(redis_client):
    clock = [1000.0]
    sig = RedisSignals(redis_client, window_s=30, clock=lambda: clock[0])
    worker(redis_client, "decode-1@h", "decode")
    sig.collect(MODEL)
    lt = LoadTracker(redis_client)
    for i in range(5):
        lt.begin("d", "decode-1@h", f"q{i}", 1)
    clock[0] += 10
    assert sig.collect(MODEL).traffic.rate == pytest.approx(0.5)  # 5 arrived in 10 s, none finished yet


def test_dry_run_decides_logs_and_publishes_but_changes_nothing(busy_farm, caplog):
    cfg = PlannerConfig(dry_run=True, cooldown_up_s=0, bounds={"prefill": Bounds(min=1, max=3),
                                                                "decode": Bounds(min=1, max=3)},
                        load=LoadPolicyConfig(queued_per_worker=1, decode_requests_per_worker=8))
    planner = Planner(cfg, RedisSignals(busy_farm), None, [MODEL], r=busy_farm)
    with caplog.at_level("INFO", logger="farm.planner"):
        pre, dec = planner.step()
    assert pre.role == "prefill" and pre.action == "scale_up" and pre.dry_run and pre.applied == ""
    assert (pre.current, pre.target) == (1, 3) and "queue util 3.00" in pre.reason
    assert dec.action == "hold" and dec.reason.startswith("queue util 0.50 within")  # 1 queued / 2 workers
    assert "DRY RUN: would scale up 1 -> 3" in caplog.text
    assert registry.live_workers(busy_farm, MODEL, "prefill")[0].worker_id == "prefill-1@h"  # untouched
    state = read_state(busy_farm)
    assert state["dry_run"] is True and state["mode"] == "load"
    assert state["models"][MODEL]["prefill"]["target"] == 3
    assert state["traffic"][MODEL]["requests"] == 3
    assert json.loads(busy_farm.lindex(PLANNER_EVENTS_KEY, 0))["action"] == "scale_up"


def test_farm_status_shows_the_planner(busy_farm, redis_url, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FARM_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("FARM_REDIS__URL", redis_url)
    cfg = load_config()
    assert collect_status(cfg)["planner"] is None
    Planner(PlannerConfig(dry_run=True), RedisSignals(busy_farm), None, [MODEL], r=busy_farm).step()
    st = collect_status(cfg)
    assert st["planner"]["models"][MODEL]["decode"]["action"] == "hold"
    assert main(["status"]) == 0
    out = capsys.readouterr().out
    assert "Planner\n  load mode, dry run, last step" in out
    assert f"{MODEL} prefill hold       current 1 ready 1 desired 1 target 1: queue util 0.75 within" in out
