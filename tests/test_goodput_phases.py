"""bench/goodput_phases.py: SLO misses split into a run's cold start and the rest (arithmetic over records)."""

from bench.goodput_phases import phase_misses, phases


def _rec(sent, ttft, itl, completion=5, error=""):
    first = sent + ttft
    return {"sent": sent, "first": first, "last": first + itl * (completion - 1), "completion_tokens": completion,
            "error": error}


def test_a_request_belongs_to_the_phase_of_its_arrival_and_misses_by_either_target():
    raw = [
        _rec(100.0, 5.0, 0.1),    # cold start, TTFT missed
        _rec(110.0, 1.0, 0.4),    # cold start, ITL missed
        _rec(129.9, 5.0, 0.4),    # cold start, both: one miss
        _rec(130.0, 1.0, 0.1),    # after (30 s from the first arrival), met
        _rec(150.0, 4.5, 0.1),    # after, TTFT missed
        _rec(151.0, 9.0, 0.9, error="HTTP 500"),  # failed: not a completed request of either phase
    ]
    out = phase_misses(raw, cold_s=30, ttft_slo_s=4.0, itl_slo_s=0.25)
    assert out["cold"] == {"requests": 3, "ttft_missed": 2, "itl_missed": 2, "missed": 3}
    assert out["after"] == {"requests": 2, "ttft_missed": 1, "itl_missed": 0, "missed": 1}


def test_rounds_of_a_contender_are_pooled_per_run():
    run_a = {"raw": [_rec(0.0, 5.0, 0.1), _rec(40.0, 1.0, 0.1)]}
    run_b = {"raw": [_rec(7.0, 1.0, 0.1), _rec(50.0, 1.0, 0.3)]}
    records = [{"contender": "farm-kv", "runs": {"eviction-0.8": run_a}},
               {"contender": "peer", "runs": {"eviction-0.8": run_b}},
               {"contender": "farm-kv", "runs": {"eviction-0.8": run_b}}]
    rows = phases(records, cold_s=30, ttft_slo_s=4.0, itl_slo_s=0.25)
    assert [(r["contender"], r["rounds"]) for r in rows] == [("farm-kv", 2), ("peer", 1)]
    farm = rows[0]
    assert farm["cold"] == {"requests": 2, "ttft_missed": 1, "itl_missed": 0, "missed": 1}
    assert farm["after"] == {"requests": 2, "ttft_missed": 0, "itl_missed": 1, "missed": 1}
