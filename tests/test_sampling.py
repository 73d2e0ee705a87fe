"""Sampling: greedy is argmax, seeds reproduce, top_p restricts to the nucleus, temperature flattens."""

import torch

from farm.engine.sampling import make_generator, sample
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
