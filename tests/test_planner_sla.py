"""SLA math with real numbers: interpolation over the profile, prefill and decode replica counts, the predictor."""

from __future__ import annotations

import pytest

from farm.config.planner import SlaPolicyConfig
from farm.planner.profile import DecodePoint, PrefillPoint, Profile, interp
from farm.planner.signals import Traffic, summarize_traffic
from farm.planner.sla_policy import SlaPolicy, decode_replicas, prefill_replicas


@pytest.fixture
def profile() -> Profile:
    return Profile(
        model="m", block_size=16, kv_blocks=1000, max_num_seqs=64,
        prefill=[PrefillPoint(512, 0.3), PrefillPoint(128, 0.1), PrefillPoint(2048, 1.5)],  # sorted on load
        decode=[DecodePoint(1, 0.020), DecodePoint(4, 0.025), DecodePoint(8, 0.030), DecodePoint(16, 0.045),
                DecodePoint(32, 0.080)],
    )


def test_interp_is_piecewise_linear_and_extends_the_end_segments():
    xs, ys = [1, 4, 8], [10.0, 40.0, 48.0]
    assert interp(2, xs, ys) == pytest.approx(20.0)
    assert interp(6, xs, ys) == pytest.approx(44.0)
    assert interp(16, xs, ys) == pytest.approx(64.0)  # beyond the last point: slope 2 per unit continues
    assert interp(0, xs, ys) == pytest.approx(0.0)
    assert interp(5, [3], [7.0]) == 7.0


def test_profile_interpolates_ttft_and_itl(profile):
    assert profile.ttft(320) == pytest.approx(0.2)  # halfway between 128 (0.1 s) and 512 (0.3 s)
    assert profile.ttft(4096) == pytest.approx(3.1)  # 1.5 s + 2048 tokens at the last segment's 1.2 s/1536
    assert profile.prefill_tokens_per_s(512) == pytest.approx(512 / 0.3)
    assert profile.itl(12) == pytest.approx(0.0375)
    assert profile.decode_tokens_per_s(32) == pytest.approx(400.0)
    assert profile.max_batch_for_itl(0.05) == 18  # itl(18) = 49.4 ms, itl(19) = 51.6 ms
    assert profile.max_batch_for_itl(0.015) == 0  # even one sequence is slower
    assert profile.kv_max_batch(712) == 22  # 1000 blocks / 45 blocks per sequence


def test_noisy_dips_do_not_make_more_work_cheaper():
    p = Profile("m", [PrefillPoint(128, 0.2), PrefillPoint(512, 0.15)], [DecodePoint(1, 0.03), DecodePoint(8, 0.02)])
    assert p.ttft(512) == 0.2 and p.itl(8) == 0.03


def test_prefill_replicas_meet_the_ttft_target(profile):
    n, why = prefill_replicas(profile, rate=4, isl=512, ttft_s=1.0, max_util=0.85)
    assert n == 2  # rho 0.6: 0.3 s + 0.225 s queueing = 525 ms
    assert "predicted TTFT 525 ms at util 0.60" in why
    assert prefill_replicas(profile, rate=4, isl=512, ttft_s=0.41)[0] == 3  # 0.3 + 0.1 s at rho 0.4
    assert prefill_replicas(profile, rate=0, isl=512, ttft_s=1.0)[0] == 0
    n, why = prefill_replicas(profile, rate=2, isl=2048, ttft_s=1.0)
    assert n == 4 and "unreachable" in why  # 1.5 s per prompt: only throughput can be planned (2*1.5/0.85)


def test_decode_replicas_from_the_itl_operating_point(profile):
    n, why = decode_replicas(profile, rate=10, isl=512, osl=200, itl_s=0.05)
    # batch 18 (itl 49.4 ms) = 364.6 tok/s per worker; 10 req/s x 200 tok = 2000 tok/s -> 5.49 -> 6
    assert n == 6 and "batch 18" in why
    n, why = decode_replicas(profile, rate=2, isl=2048, osl=512, itl_s=0.05)
    assert n == 5 and "KV-bound (6 seqs" in why  # 6 x 160 blocks fit: 6 / 27.5 ms = 218 tok/s; 1024/218 = 4.7
    n, why = decode_replicas(profile, rate=10, isl=512, osl=200, itl_s=0.05, local_rate=10, local_isl=128)
    assert n == 7 and "+1.00 workers of local prefill" in why  # 10 x 0.1 s of prefill per second
    assert decode_replicas(profile, rate=0, isl=512, osl=200, itl_s=0.05)[0] == 0
    n, why = decode_replicas(profile, rate=1, isl=512, osl=200, itl_s=0.05, inflight=40)  # a burst admitted
    assert n == 3 and why.startswith("40 requests in flight need 3 workers at batch 18")  # rate alone: 1


def test_plan_and_predictor(profile):
    cfg = SlaPolicyConfig(ttft_ms=1000, itl_ms=50, predictor="ema", ema_alpha=0.5, headroom=1.0, min_requests=3)
    pol = SlaPolicy(cfg, profile)
    t = Traffic(requests=40, rate=4.0, isl=512, osl=200, remote_fraction=1.0, remote_isl=512, inflight=10)
    plan = pol.plan("m", t, {"prefill": 1, "decode": 1})
    assert plan["prefill"].desired == 2 and plan["decode"].desired == 3  # 4*200/364.6 = 2.19
    t2 = Traffic(requests=80, rate=8.0, isl=512, osl=200, remote_fraction=1.0, remote_isl=512, inflight=20)
    plan = pol.plan("m", t2, {"prefill": 2, "decode": 3})
    assert pol.predicted("m").rate == pytest.approx(8.0)  # a rise is followed at once
    assert plan["decode"].desired == 5  # 8*200/364.6 = 4.39
    idle = pol.plan("m", Traffic(), {"prefill": 2, "decode": 5})  # nothing finished, nothing in flight
    assert pol.predicted("m").rate == pytest.approx(4.0)  # a fall is smoothed: (0 + 8) / 2
    assert idle["decode"].desired == 3  # 4*200/364.6 = 2.19; also 3 at 1.2x the load (2.63)
    for _ in range(10):
        idle = pol.plan("m", Traffic(), {"prefill": 2, "decode": 2})
    assert pol.predicted("m").rate == 0.0 and idle["decode"].desired == 0 and idle["prefill"].desired == 0
    fresh = SlaPolicy(cfg, profile).plan("m", Traffic(requests=1, rate=0.5, inflight=3), {"decode": 2})
    assert fresh["decode"].desired == 2 and "too few observations" in fresh["decode"].reason


def test_scale_down_hysteresis_and_prefill_backlog(profile):
    from farm.planner.signals import RoleSignals

    pol = SlaPolicy(SlaPolicyConfig(ttft_ms=1000, itl_ms=50, predictor="last", headroom=1.0,
                                    scale_down_margin=1.2), profile)
    t = Traffic(requests=40, rate=3.5, isl=512, osl=200, remote_fraction=1.0, remote_isl=512, inflight=5)
    # 3.5 req/s fits 2 decode workers (1.92), but 1.2x that (2.30) does not: stay at 3 instead of flapping
    plan = pol.plan("m", t, {"prefill": 2, "decode": 3})
    assert plan["decode"].desired == 3 and "3 needed at x1.2 load" in plan["decode"].reason
    assert pol.plan("m", t, {"prefill": 2, "decode": 1})["decode"].desired == 2  # scaling up: no margin
    assert pol.plan("m", t, {"prefill": 2, "decode": 3})["prefill"].desired == 2  # rho 0.53 -> 498 ms
    # 32 prompts placed on 2 busy prefill workers: 30 to drain within a 10 s interval add 3 req/s
    busy = {"prefill": RoleSignals("prefill", workers=2, pending_requests=32)}
    plan = pol.plan("m", t, {"prefill": 2, "decode": 3}, busy, drain_s=10)
    assert "backlog 3.00 req/s" in plan["prefill"].reason
    assert plan["prefill"].desired == 3  # 6.5 req/s x 0.3 s: rho 0.65 on 3 workers -> 579 ms


def test_without_prefill_workers_decode_workers_carry_the_prefills(profile):
    pol = SlaPolicy(SlaPolicyConfig(itl_ms=50, predictor="last", headroom=1.0), profile)
    t = Traffic(requests=40, rate=4.0, isl=512, osl=200, remote_fraction=1.0, remote_isl=512, inflight=5)
    plan = pol.plan("m", t, {"decode": 1})
    assert plan["decode"].desired == 4  # 2.19 workers decoding + 4 x 0.3 s = 1.2 workers prefilling


def test_traffic_summary_uses_the_disaggregation_rule():
    obs = [{"ts": 1, "ttft": 0.2, "itl": 0.03, "isl": 2000, "osl": 50, "prefill": "local"},
           {"ts": 2, "ttft": 0.4, "itl": 0.05, "isl": 100, "osl": 150, "prefill": "local"}]
    t = summarize_traffic(obs, window_s=10, inflight=5, inflight_before=1, remote_min_tokens=1000)
    assert t.rate == pytest.approx(0.6)  # 2 done + 4 more in flight, over 10 s
    assert t.isl == 1050 and t.osl == 100 and t.remote_fraction == 0.5 and t.remote_isl == 2000
    assert t.local_isl == 100 and t.itl_mean == pytest.approx(0.04) and t.ttft_p90 == 0.4
    assert summarize_traffic(obs, 10).remote_fraction == 0.0  # no rule: where they really ran
