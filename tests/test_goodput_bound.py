"""bench/goodput_bound.py: the ceilings no router could beat on a bench.goodput run (pure arithmetic over
records; no services)."""

from bench.goodput_bound import (
    goal_bounds,
    recomputed_requests,
    reusable_blocks,
    reusable_tokens,
    workload_bound,
)


def _rec(conv, turn, sent, first, last, prompt, completion=4, cached=0, error=""):
    return {"conversation": conv, "turn": turn, "sent": sent, "first": first, "last": last,
            "prompt_tokens": prompt, "completion_tokens": completion, "cached_tokens": cached, "error": error}


def test_reuse_counts_whole_blocks_of_a_prefix_an_earlier_prompt_holds():
    a = list(range(40))
    shares_20 = a[:20] + [900 + i for i in range(20)]
    other = [500 + i for i in range(40)]
    # first use of a prefix: nothing; 20 shared tokens: one whole block of 16; an unrelated prompt: nothing;
    # the same prompt again: its two whole blocks (the last 8 tokens are not a block)
    assert reusable_blocks([a, shares_20, other, a], block=16) == [0, 1, 0, 2]
    # a block matches only after the same prefix: the second block of `a` elsewhere is not reusable
    assert reusable_blocks([a, other[:16] + a[16:32]], block=16) == [0, 0]


def test_a_later_turn_can_reuse_its_previous_prompt_and_answer_never_its_whole_prompt():
    raw = [_rec(0, 0, 0, 1, 2, prompt=100, completion=30), _rec(0, 1, 3, 4, 5, prompt=150),
           _rec(1, 0, 0, 1, 2, prompt=20), _rec(1, 1, 3, 4, 5, prompt=20, completion=4)]
    reuse = reusable_tokens(raw, first_turn_blocks=[0, 3], block=16)
    assert reuse[(0, 0)] == 0
    assert reuse[(0, 1)] == 128  # (100 + 30) // 16 * 16
    assert reuse[(1, 0)] == 19  # 3 blocks = 48 tokens, capped: an engine computes the last prompt token
    assert reuse[(1, 1)] == 16  # (20 + 4) // 16 * 16


def test_the_ceilings_come_from_cold_requests_and_the_last_arrival():
    # 4 single-turn requests, the last arriving at 6 s; two are cold (nothing before them shares a block)
    fast, slow = [_rec(0, 0, 0.0, 1.5, 2.0, 64), _rec(1, 0, 1.0, 1.2, 1.6, 64), _rec(2, 0, 2.0, 4.0, 5.0, 64),
                  _rec(3, 0, 6.0, 6.4, 7.0, 64)], []
    for r in fast:
        slow.append({**r, "first": r["first"] + 1, "last": r["last"] + 1})
    first_blocks = [0, 3, 0, 3]
    b = workload_bound([{"raw": fast}, {"raw": slow}], first_blocks, last_start_s=6.0, turns=1, block=16)
    assert b["cold_share"] == 0.5
    assert b["ttft_p90_floor_ms"] == 1500.0  # the fastest first token a cold request got, over both runs
    assert b["goodput_ceiling_rps"] == 4 / (6.0 + 0.6)  # the fastest request took 0.6 s (sent 1.0, done 1.6)
    assert abs(b["hit_ceiling"] - 2 * 48 / 256) < 1e-9
    # few cold requests: no p90 floor (p90 may fall among the warm ones)
    many = [_rec(i, 0, float(i), i + 0.5, i + 1.0, 64) for i in range(20)]
    assert workload_bound([{"raw": many}], [0] + [3] * 19, 19.0, 1)["ttft_p90_floor_ms"] is None


def test_a_goal_is_out_of_reach_when_even_the_ceiling_misses_it():
    bound_rows = [{"workload": "eviction", "rate": 0.8, "goodput_ceiling_rps": 0.8, "ttft_p90_floor_ms": 1900.0}]
    rows = [{"workload": "eviction", "contender": "router-cache_aware", "goodput_rps": 0.7, "ttft_p90_ms": 3400.0},
            {"workload": "eviction", "contender": "router-kv_aware", "goodput_rps": 0.5, "ttft_p90_ms": 5000.0}]
    goals = [{"name": "eviction: kv goodput / cache_aware", "value": 0.9, "target": 1.2, "op": ">="},
             {"name": "eviction: kv TTFT p90 / cache_aware", "value": 1.1, "target": 0.5, "op": "<="},
             {"name": "eviction: kv goodput / router-kv_aware", "value": 1.1, "target": 1.0, "op": ">="},
             {"name": "failed requests, every contender", "value": 0.0, "target": 0.0, "op": "<="}]
    out = {g["goal"]: g for g in goal_bounds(bound_rows, rows, goals)}
    assert set(out) == {g["name"] for g in goals[:3]}
    assert not out["eviction: kv goodput / cache_aware"]["reachable"]  # 0.8 / 0.7 = 1.14 < 1.2
    assert not out["eviction: kv TTFT p90 / cache_aware"]["reachable"]  # 1900 / 3400 = 0.56 > 0.5
    assert out["eviction: kv goodput / router-kv_aware"]["reachable"]  # 1.6 >= 1.0
    assert abs(out["eviction: kv goodput / cache_aware"]["best_any_router"] - 0.8 / 0.7) < 1e-9


def test_recomputed_counts_later_requests_of_a_prefix_that_reused_none_of_it():
    def req(label, sent, cached, error=""):
        return {"label": label, "sent": sent, "cached_tokens": cached, "error": error}

    raw = [req("a", 0, 0), req("b", 1, 0), req("a", 2, 1504), req("a", 3, 0), req("b", 4, 16),
           req("c", 5, 0), req("b", 6, 0, error="timeout")]
    # later requests of a prefix: a@2 (reused), a@3 (none), b@4 (16 tokens: under one 32-token block);
    # first visits and failed requests are not counted
    assert recomputed_requests(raw, block=32) == (2, 3)
    assert recomputed_requests(list(reversed(raw)), block=16) == (1, 3)  # arrival order, not list order
