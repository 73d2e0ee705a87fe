"""Token sampling: greedy, temperature, nucleus (top_p), reproducible per request with a seed."""

from __future__ import annotations

import torch

from farm.protocol import SamplingParams


def make_generator(params: SamplingParams) -> torch.Generator | None:
    """A per-request generator: a seeded request samples the same tokens however it is batched."""
    if params.greedy:
        return None
    g = torch.Generator()
    if params.seed is not None:
        g.manual_seed(int(params.seed) & 0xFFFF_FFFF_FFFF_FFFF)
    else:
        g.seed()
    return g


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]) -> list[int]:
    """Sample one token per row of `logits` [batch, vocab] (float32)."""
    logits = logits.float().cpu()
    out: list[int] = []
    greedy = logits.argmax(dim=-1).tolist()
    for i, p in enumerate(params):
        if p.greedy:
            out.append(int(greedy[i]))
            continue
        probs = torch.softmax(logits[i] / p.temperature, dim=-1)
        if p.top_p < 1.0:
            sorted_p, idx = probs.sort(descending=True)
            cum = sorted_p.cumsum(0)
            keep = cum - sorted_p < p.top_p  # always keeps the most likely token
            sorted_p = sorted_p * keep
            probs = torch.zeros_like(probs).scatter_(0, idx, sorted_p)
        out.append(int(torch.multinomial(probs, 1, generator=generators[i]).item()))
    return out
