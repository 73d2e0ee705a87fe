"""Sampling: greedy is argmax, seeds reproduce, top_p restricts to the nucleus, temperature flattens."""

import pytest
import torch

from farm.engine.sampling import History, TokenLogprobs, logprobs_of, make_generator, process_logits, sample
from farm.protocol import SamplingParams


def test_greedy_is_argmax():
    logits = torch.tensor([[0.1, 3.0, 0.2], [5.0, 0.0, 1.0]])
    p = SamplingParams(temperature=0)
    assert sample(logits, [p, p], [None, None]) == [1, 0]


def test_seed_reproduces_and_differs_across_seeds():
    logits = torch.zeros(1, 1000)
    p1, p2 = SamplingParams(temperature=1.0, seed=1), SamplingParams(temperature=1.0, seed=2)
    run = lambda p: [sample(logits, [p], [g])[0] for g in [make_generator(p)] for _ in range(20)]  # noqa: E731
    assert run(p1) == run(p1)
    assert run(p1) != run(p2)


def test_top_p_keeps_only_the_nucleus():
    logits = torch.log(torch.tensor([[0.6, 0.3, 0.05, 0.05]]))
    p = SamplingParams(temperature=1.0, top_p=0.5, seed=0)
    g = make_generator(p)
    assert {sample(logits, [p], [g])[0] for _ in range(200)} == {0}
    p = SamplingParams(temperature=1.0, top_p=0.85, seed=0)
    g = make_generator(p)
    assert {sample(logits, [p], [g])[0] for _ in range(300)} == {0, 1}


def test_high_temperature_spreads_low_temperature_concentrates():
    logits = torch.tensor([[2.0, 1.0, 0.0]])
    hot, cold = SamplingParams(temperature=2.0, seed=3), SamplingParams(temperature=0.05, seed=3)
    gh, gc = make_generator(hot), make_generator(cold)
    assert len({sample(logits, [hot], [gh])[0] for _ in range(300)}) == 3
    assert {sample(logits, [cold], [gc])[0] for _ in range(300)} == {0}


# -- vLLM's extra parameters, as the built-in engine applies them ------------------------------------------
def test_logit_bias_can_force_or_forbid_a_token():
    logits = torch.tensor([[5.0, 1.0, 0.0]])
    assert sample(logits, [SamplingParams(temperature=0, logit_bias={2: 100.0})], [None]) == [2]
    assert sample(logits, [SamplingParams(temperature=0, logit_bias={0: -100.0})], [None]) == [1]


def test_suppressed_tokens_are_never_sampled():
    logits = torch.tensor([[9.0, 1.0, 0.5]])
    p = SamplingParams(temperature=1.0, seed=1)
    g = make_generator(p)
    assert 0 not in {sample(logits, [p], [g], suppress=[[0]])[0] for _ in range(100)}
    assert sample(logits, [SamplingParams(temperature=0)], [None], suppress=[[0]]) == [1]


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_seen_tokens():
    row = torch.tensor([2.0, -2.0, 3.0, 1.0])
    out = process_logits(row, SamplingParams(repetition_penalty=2.0), History([0], [1]))
    assert out.tolist() == [1.0, -4.0, 3.0, 1.0]  # token 2 and 3 were not seen


def test_frequency_and_presence_penalties_count_only_completion_tokens():
    row = torch.zeros(4)
    p = SamplingParams(frequency_penalty=0.5, presence_penalty=1.0)
    out = process_logits(row, p, History(prompt_ids=[3, 3, 3], output_ids=[1, 1, 2]))
    assert out.tolist() == [0.0, -2.0, -1.5, 0.0]  # 1: 2x0.5+1, 2: 0.5+1, 3: prompt only


def test_penalties_change_a_greedy_choice():
    logits = torch.tensor([[3.0, 2.9, 0.0]])
    plain = sample(logits, [SamplingParams(temperature=0)], [None], [History([], [0])])
    penal = sample(logits, [SamplingParams(temperature=0, frequency_penalty=1.0)], [None], [History([], [0])])
    assert plain == [0] and penal == [1]


def test_top_k_and_min_p_restrict_the_candidates():
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1]]))
    k2 = SamplingParams(temperature=1.0, top_k=2, seed=0)
    g = make_generator(k2)
    assert {sample(logits, [k2], [g])[0] for _ in range(300)} == {0, 1}
    mp = SamplingParams(temperature=1.0, min_p=0.6, seed=0)  # keeps p >= 0.6 x 0.4 = 0.24
    g = make_generator(mp)
    assert {sample(logits, [mp], [g])[0] for _ in range(300)} == {0, 1}


def test_logprobs_are_the_raw_distributions_log_softmax_with_the_top_k():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    (lp,) = logprobs_of(logits, [1], [2])
    ref = torch.log_softmax(logits[0], -1)
    assert abs(lp.logprob - float(ref[1])) < 1e-6
    assert [i for i, _ in lp.top] == [0, 1] and abs(lp.top[0][1] - float(ref[0])) < 1e-6
    assert TokenLogprobs.from_list(lp.to_list()) == lp
    assert logprobs_of(logits, [3], [0])[0].top == []
    assert lp.rank is None and len(lp.to_list()) == 2  # a generated token's: no rank on the wire
    ranked = logprobs_of(torch.tensor([[2.0, 1.0, 0.0, -1.0], [0.0, 3.0, 3.0, 1.0]]), [3, 2], [1, 1], ranks=True)
    assert [r.rank for r in ranked] == [4, 2]  # a tie ranks it after the other, as vLLM counts (x >= value)
    assert TokenLogprobs.from_list(ranked[0].to_list()) == ranked[0] and ranked[0].to_list()[2] == 4


def test_a_tiny_repetition_penalty_or_temperature_never_makes_a_nan_row():
    """A positive logit divided by the smallest positive penalty (5e-324, valid input: the API takes any penalty
    above 0) or by a tiny temperature overflows to +inf; the row must still sample, and a suppressed token
    (-inf) must stay out. It failed with "probability tensor contains either inf, nan" (a 500) before."""
    logits = torch.tensor([[2.0, 1.0, -1.0, 3.0]])
    tiny = SamplingParams(temperature=0.5, repetition_penalty=5e-324, seed=1)
    g = make_generator(tiny)
    drawn = {sample(logits, [tiny], [g], [History([0, 1], [])], [[3]])[0] for _ in range(50)}
    assert drawn <= {0, 1} and 3 not in drawn  # the boosted seen tokens, never the suppressed one
    cold = SamplingParams(temperature=1e-40, seed=2)
    assert sample(logits, [cold], [make_generator(cold)])[0] == 3


def test_a_top_p_too_small_for_float32_keeps_the_most_likely_token():
    """top_p 5e-324 (valid: any value in (0, 1]) is 0 in float32, so the nucleus kept no token and the draw
    failed with "invalid multinomial distribution" (a 500, found by the fuzz test). The most likely token is
    always kept, so such a top_p is greedy."""
    logits = torch.tensor([[2.0, 1.0, -1.0, 3.0]])
    for top_p in (5e-324, 1e-50, 1e-9):
        p = SamplingParams(temperature=1.0, top_p=top_p, seed=3)
        g = make_generator(p)
        assert {sample(logits, [p], [g])[0] for _ in range(20)} == {3}, top_p


@pytest.mark.parametrize("whole", [False, True])
def test_the_held_back_tail_is_the_longest_beginning_of_a_stop(whole):
    """`partial_stop` now tries only the places where a stop's first character stands (every length was tried on
    every token before: quadratic in a stop's length). It gives what trying every length gives, on random texts
    and stops over small alphabets (where prefixes overlap most), with `whole` (a stop complete at the end, as
    the Anthropic stream holds back) and without."""
    import random

    from farm.models.tokenization import partial_stop

    def every_length(text: str, stops: list[str]) -> int:
        longest = 0
        for s in stops:
            for k in range(min(len(s) - (0 if whole else 1), len(text)), longest, -1):
                if s.startswith(text[len(text) - k:]):
                    longest = k
                    break
        return longest

    rng = random.Random(5)
    for _ in range(5000):
        alpha = rng.choice(["ab", "abc d", "a"])
        text = "".join(rng.choice(alpha) for _ in range(rng.randrange(0, 30)))
        stops = ["".join(rng.choice(alpha) for _ in range(rng.randrange(0, 8))) for _ in range(rng.randrange(1, 4))]
        assert partial_stop(text, stops, whole) == every_length(text, stops), (text, stops)
    assert partial_stop("the end is nig", ["nigh", "xx"]) == 3 and partial_stop("it was nigh", ["nigh"], True) == 4


def test_allowed_token_ids_leave_only_those_tokens():
    """vLLM's allowed_token_ids: greedy or sampled, only those tokens; the most likely of them when greedy, even
    under a bias that favours another."""
    logits = torch.tensor([[5.0, 4.0, 3.0, 2.0, 1.0]])
    greedy = SamplingParams(temperature=0, allowed_token_ids=[2, 4])
    assert sample(logits, [greedy], [None]) == [2]
    biased = SamplingParams(temperature=0, allowed_token_ids=[2, 4], logit_bias={4: 10.0, 0: 50.0})
    assert sample(logits, [biased], [None]) == [4]
    warm = SamplingParams(temperature=1.5, seed=3, allowed_token_ids=[1, 3])
    g = make_generator(warm)
    assert {sample(logits, [warm], [g])[0] for _ in range(200)} == {1, 3}

