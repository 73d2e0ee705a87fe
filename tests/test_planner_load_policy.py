"""Load policy (thresholds, hysteresis, streaks) and the guard (bounds, cooldowns, step limits)."""

from __future__ import annotations

import pytest

from farm.config.planner import Bounds, LoadPolicyConfig, PlannerConfig, load_planner_config
from farm.planner.guard import Guard
from farm.planner.load_policy import LoadPolicy
from farm.planner.signals import RoleSignals

KEY = ("m", "decode")


def policy(**kw) -> LoadPolicy:
    base = {"scale_up_util": 0.8, "scale_down_util": 0.3, "up_intervals": 1, "down_intervals": 2,
            "decode_requests_per_worker": 4, "prefill_tokens_per_worker": 4096, "queued_per_worker": 4}
    return LoadPolicy(LoadPolicyConfig(**{**base, **kw}))


def decode(workers: int, decoding: int = 0, queued: int = 0, kv: tuple[int, int] = (0, 0)) -> RoleSignals:
    return RoleSignals("decode", workers=workers, decoding=decoding, queued=queued, kv_used=kv[0], kv_total=kv[1])


def test_overload_scales_to_the_middle_of_the_band():
    # 6 decoding requests on 1 worker of capacity 4: util 1.5 -> ceil(1.5 / 0.55) = 3 workers
    p = policy().propose(KEY, decode(1, decoding=6), current=1)
    assert p.desired == 3 and p.util == pytest.approx(1.5)
    assert "decode util 1.50" in p.reason


def test_each_signal_can_trigger_a_scale_up():
    pol = policy()
    kv = pol.propose(KEY, decode(2, decoding=1, kv=(900, 1000)), current=2)  # 90% of the KV cache in use
    assert kv.desired == 4 and kv.reason.startswith("kv util 0.90")
    q = pol.propose(("m", "prefill"), RoleSignals("prefill", workers=1, queued=5), current=1)
    assert q.desired == 3 and q.reason.startswith("queue util 1.25")
    pre = pol.propose(("m", "prefill"), RoleSignals("prefill", workers=2, pending_tokens=10_000), current=2)
    assert pre.desired == 5  # 10000 / (2 * 4096) = 1.22 -> ceil(2 * 1.22 / 0.55)


def test_inside_the_band_nothing_changes_and_streaks_reset():
    pol = policy()
    assert pol.propose(KEY, decode(2, decoding=1), current=2).desired == 2  # util 0.125: low 1/2
    assert pol.propose(KEY, decode(2, decoding=4), current=2).desired == 2  # util 0.5: in the band, reset
    p = pol.propose(KEY, decode(2, decoding=1), current=2)  # low again, but only 1/2 readings
    assert p.desired == 2 and "(1/2 readings)" in p.reason
    assert pol.propose(KEY, decode(2, decoding=1), current=2).desired == 1


def test_scale_down_only_when_the_rest_stay_below_the_up_threshold():
    # band [0.5, 0.8]: util 0.45 on 2 workers would be 0.9 on one -> no scale-down (it would bounce back)
    pol = policy(scale_down_util=0.5, down_intervals=1, decode_requests_per_worker=10)
    p = pol.propose(KEY, decode(2, decoding=9, kv=(0, 100)), current=2)
    assert p.desired == 2 and "0.90 with one fewer" in p.reason
    assert pol.propose(KEY, decode(2, decoding=2), current=2).desired == 1  # 0.1 -> 0.2 alone: fine


def test_up_intervals_require_sustained_overload():
    pol = policy(up_intervals=2)
    assert pol.propose(KEY, decode(1, decoding=8), current=1).desired == 1
    assert pol.propose(KEY, decode(1, decoding=8), current=1).desired == 4


def test_the_last_worker_goes_only_when_idle_and_work_without_workers_asks_for_one():
    pol = policy(down_intervals=1)
    assert pol.propose(("m", "prefill"), RoleSignals("prefill", workers=1, pending_tokens=100), current=1).desired == 1
    assert pol.propose(("m", "prefill"), RoleSignals("prefill", workers=1), current=1).desired == 0
    p = pol.propose(("m", "prefill"), RoleSignals("prefill", workers=0, queued=1), current=0)
    assert p.desired == 1 and "no ready worker" in p.reason


def test_guard_bounds_and_step_limits():
    g = Guard(cooldown_up_s=0, cooldown_down_s=0, max_step_up=2, max_step_down=1)
    b = Bounds(min=1, max=4)
    assert g.apply(KEY, 2, 10, b, 0).target == 4
    gate = g.apply(KEY, 1, 10, b, 0)
    assert gate.target == 3 and "step limited to 2" in gate.held and "bounded" in gate.held
    assert g.apply(KEY, 4, 0, b, 0).target == 3  # one down at a time
    assert g.apply(KEY, 1, 0, b, 0).target == 1  # never below min
    assert g.apply(KEY, 0, 0, b, 0).target == 1 and g.apply(KEY, 6, 6, b, 0).target == 4  # out of bounds: fixed


def test_guard_cooldowns():
    g = Guard(cooldown_up_s=10, cooldown_down_s=60)
    b = Bounds(min=1, max=8)
    g.record(KEY, now=100.0)  # a change at t=100 (say, 1 -> 2)
    up = g.apply(KEY, 2, 3, b, now=105.0)
    assert up.target == 2 and up.held == "scale-up cooldown (5s left)"
    assert g.apply(KEY, 2, 3, b, now=110.0).target == 3
    down = g.apply(KEY, 2, 1, b, now=150.0)
    assert down.target == 2 and down.held == "scale-down cooldown (10s left)"
    assert g.apply(KEY, 2, 1, b, now=160.0).target == 1
    assert g.apply(("m", "prefill"), 2, 1, b, now=101.0).target == 1  # cooldowns are per model and role
    g.record(KEY, now=200.0)
    assert g.apply(KEY, 0, 0, b, now=201.0).target == 1  # below min: corrected even during a cooldown


def test_config_validation_and_yaml(tmp_path):
    with pytest.raises(ValueError, match="hysteresis"):
        LoadPolicyConfig(scale_up_util=0.5, scale_down_util=0.6)
    with pytest.raises(ValueError, match="min"):
        Bounds(min=3, max=2)
    f = tmp_path / "p.yaml"
    f.write_text("planner:\n  mode: sla\n  bounds: {decode: {min: 2, max: 6}}\n  sla: {ttft_ms: 500}\n")
    cfg = load_planner_config(f)
    assert cfg.mode == "sla" and cfg.bounds_for("decode") == Bounds(min=2, max=6) and cfg.sla.ttft_ms == 500
    assert cfg.bounds_for("prefill") == Bounds(min=0, max=4)
    f.write_text("planner:\n  interval: 3\n")
    with pytest.raises(ValueError, match="planner.interval"):
        load_planner_config(f)
    assert PlannerConfig().roles == ["prefill", "decode"]
