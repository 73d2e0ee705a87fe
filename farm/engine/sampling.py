"""Token sampling with vLLM's semantics: allowed tokens, logit bias, suppressed tokens (min_tokens), repetition,
frequency and presence penalties, then greedy or temperature, min_p, top_k and nucleus (top_p) sampling,
reproducible per request with a seed; and the log-probabilities a request asks for.

Rows that ask for nothing beyond temperature and top_p take the plain path (one argmax over the batch for
greedy rows), so the common case costs what it did before the extra parameters existed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from farm.protocol import SamplingParams


@dataclass
class TokenLogprobs:
    """The sampled (or prompt) token's log-probability, the `k` most likely tokens' (id, log-probability), and, for
    a prompt token, its rank among the whole vocabulary (1: the most likely; vLLM's `prompt_logprobs` show it)."""

    logprob: float
    top: list[tuple[int, float]]
    rank: int | None = None

    def to_list(self) -> list:
        """The stream event's form: [logprob, [[id, logprob], ...]], and the rank third when there is one."""
        out = [self.logprob, [[i, lp] for i, lp in self.top]]
        return out if self.rank is None else [*out, self.rank]

    @classmethod
    def from_list(cls, v: list | None) -> TokenLogprobs | None:
        if v is None:
            return None
        return cls(float(v[0]), [(int(i), float(lp)) for i, lp in v[1]], int(v[2]) if len(v) > 2 else None)


@dataclass
class History:
    """What a row's penalties look at: its prompt and the tokens generated so far."""

    prompt_ids: Sequence[int]
    output_ids: Sequence[int]


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


_FLOAT_MAX = torch.finfo(torch.float32).max


def _finite(x: torch.Tensor) -> torch.Tensor:
    """+inf (a logit divided by a tiny repetition penalty or temperature) as the largest float, so softmax ranks it
    first instead of turning the row into NaNs; -inf (a suppressed token) stays."""
    return torch.nan_to_num(x, posinf=_FLOAT_MAX, neginf=-torch.inf)


def _plain(p: SamplingParams, suppress: Sequence[int]) -> bool:
    return not (p.penalized or p.logit_bias or p.top_k or p.min_p or suppress or p.allowed_token_ids)


def process_logits(row: torch.Tensor, p: SamplingParams, history: History | None,
                   suppress: Sequence[int] = ()) -> torch.Tensor:
    """Allowed tokens, bias, suppression and penalties applied to one row of logits (float32, a new tensor)."""
    if p.allowed_token_ids:  # vLLM's: every other token out, before the rest (as its logits processor)
        ids = torch.tensor(p.allowed_token_ids, dtype=torch.long)
        kept, row = row[ids], torch.full_like(row, -torch.inf)
        row[ids] = kept
    else:
        row = row.clone()
    if p.logit_bias:
        ids = torch.tensor(list(p.logit_bias), dtype=torch.long)
        row[ids] += torch.tensor(list(p.logit_bias.values()), dtype=row.dtype)
    if suppress:
        row[torch.tensor(list(suppress), dtype=torch.long)] = -torch.inf
    if history is not None and p.penalized:
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(history.prompt_ids) | set(history.output_ids)), dtype=torch.long)
            if len(seen):
                vals = row[seen]
                row[seen] = _finite(torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty))
        if (p.frequency_penalty or p.presence_penalty) and history.output_ids:
            ids, counts = torch.tensor(list(history.output_ids), dtype=torch.long).unique(return_counts=True)
            row[ids] -= p.frequency_penalty * counts.to(row.dtype) + p.presence_penalty
    return row


def _draw(row: torch.Tensor, p: SamplingParams, generator: torch.Generator | None) -> int:
    """One token from processed logits: argmax when greedy, else temperature, min_p, top_k, top_p."""
    if p.greedy:
        return int(row.argmax())
    probs = torch.softmax(_finite(row / p.temperature), dim=-1)
    if p.min_p > 0.0:
        probs = torch.where(probs < p.min_p * probs.max(), torch.zeros_like(probs), probs)
    if p.top_k and p.top_k < probs.numel():
        kth = probs.topk(p.top_k).values[-1]
        probs = torch.where(probs < kth, torch.zeros_like(probs), probs)
    if p.top_p < 1.0:
        sorted_p, idx = probs.sort(descending=True)
        sorted_p = sorted_p / sorted_p.sum()
        keep = sorted_p.cumsum(0) - sorted_p < p.top_p
        keep[0] = True  # the most likely token, also for a top_p that rounds to 0 in float32 (5e-324)
        probs = torch.zeros_like(probs).scatter_(0, idx, sorted_p * keep)
    return int(torch.multinomial(probs, 1, generator=generator).item())


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
           histories: list[History | None] | None = None, suppress: list[Sequence[int]] | None = None) -> list[int]:
    """Sample one token per row of `logits` [batch, vocab]. `histories` (for penalties) and `suppress`
    (token ids that must not be sampled now, e.g. EOS before min_tokens) are per row when given."""
    logits = logits.float().cpu()
    suppress = suppress or [()] * len(params)
    histories = histories or [None] * len(params)
    greedy = logits.argmax(dim=-1).tolist() if any(p.greedy for p in params) else []
    out: list[int] = []
    for i, p in enumerate(params):
        if _plain(p, suppress[i]):
            out.append(int(greedy[i]) if p.greedy else _draw(logits[i], p, generators[i]))
        else:
            out.append(_draw(process_logits(logits[i], p, histories[i], suppress[i]), p, generators[i]))
    return out


def logprobs_of(logits: torch.Tensor, tokens: list[int], ks: list[int | list[int]],
                ranks: bool = False) -> list[TokenLogprobs]:
    """Each row's sampled token's log-probability and its `k` most likely tokens, from the model's raw
    logits (before penalties and temperature, as vLLM reports them by default), or, where `k` is a list of token
    ids (vLLM's logprob_token_ids), the sampled token's then those tokens', in that order, each once (vLLM's order);
    with `ranks`, each token's rank (how many tokens are at least as likely, itself included: a tie ranks it after
    the others, as vLLM counts)."""
    logp = torch.log_softmax(logits.float().cpu(), dim=-1)
    if len(tokens) != len(ks):
        raise ValueError(f"{len(tokens)} tokens but {len(ks)} counts of alternatives")
    chosen = logp[torch.arange(len(tokens)), torch.tensor(tokens, dtype=torch.long)]
    at_least = (logp >= chosen[:, None]).sum(dim=-1).tolist() if ranks else None
    out = []
    for i, k in enumerate(ks):
        if isinstance(k, list):
            ids = list(dict.fromkeys([tokens[i], *k]))
            top = [(t, float(v)) for t, v in zip(ids, logp[i, torch.tensor(ids, dtype=torch.long)].tolist(),
                                                 strict=True)]
        else:
            best = logp[i].topk(k) if k else None
            top = [] if best is None else [(int(t), float(v)) for v, t in zip(best.values, best.indices, strict=True)]
        out.append(TokenLogprobs(float(chosen[i]), top, None if at_least is None else at_least[i]))
    return out
