"""The simulated farm driven by the real Planner: replicas follow a load step up and back down."""

from __future__ import annotations

import random

import pytest

from farm.config.planner import Bounds, LoadPolicyConfig, PlannerConfig, SlaPolicyConfig
from farm.planner.profile import DecodePoint, PrefillPoint, Profile
from farm.planner.simulate import simulate


@pytest.fixture
def profile() -> Profile:
    return Profile(model="m", block_size=16, kv_blocks=2000, max_num_seqs=64,
                   prefill=[PrefillPoint(128, 0.1), PrefillPoint(512, 0.3), PrefillPoint(2048, 1.5)],
                   decode=[DecodePoint(1, 0.020), DecodePoint(8, 0.030), DecodePoint(32, 0.080)])


def step_trace(seed: int = 1) -> list[tuple[float, int, int]]:
    """Poisson arrivals: 1 req/s, then 8 req/s from 60 s to 180 s, then 1 req/s until 300 s."""
    rng, t, rows = random.Random(seed), 0.0, []
    while t < 300:
        t += rng.expovariate(8.0 if 60 <= t < 180 else 1.0)
        rows.append((t, 512, 100))
    return rows


def cfg(mode: str) -> PlannerConfig:
    return PlannerConfig(mode=mode, interval_s=5, window_s=5, cooldown_up_s=5, cooldown_down_s=30,
                         bounds={"prefill": Bounds(min=1, max=6), "decode": Bounds(min=1, max=6)},
                         load=LoadPolicyConfig(prefill_tokens_per_worker=1700, decode_requests_per_worker=20),
                         sla=SlaPolicyConfig(ttft_ms=1000, itl_ms=50, headroom=1.1, min_requests=2))


@pytest.mark.parametrize("mode", ["sla", "load"])
def test_planner_follows_a_load_step(profile, mode):
    res = simulate(step_trace(), profile, cfg(mode), "m", startup_s=5, end_s=300)
    at = {round(p["t"]): p for p in res.timeline}
    assert at[40]["prefill"] == 1 and at[40]["decode"] == 1  # 1 req/s: one of each is enough
    peak = max(p["prefill"] for p in res.timeline if 60 <= p["t"] <= 180)
    assert peak >= 3  # 8 req/s x 0.3 s = 2.4 workers of prefill
    assert max(p["decode"] for p in res.timeline) >= 2
    assert res.timeline[-1]["prefill"] <= 2 and res.timeline[-1]["decode"] == 1  # back down after the step
    s = res.summary(1.0, 0.05)
    assert s["finished"] == s["requests"]
    if mode == "sla":
        assert s["ttft_ok"] >= 0.8 and s["itl_ok"] >= 0.9  # misses: the minute after the 8x step


def test_static_farm_drowns_and_costs_are_counted(profile):
    static = simulate(step_trace(), profile, None, "m", drain_s=60).summary(1.0, 0.05)
    planned = simulate(step_trace(), profile, cfg("sla"), "m", startup_s=5).summary(1.0, 0.05)
    assert static["ttft_ok"] < 0.5 < planned["ttft_ok"]
    assert 0 < planned["worker_seconds"]
