"""Structured output for the built-in engine: a request's `response_format` (a JSON object, or one matching a JSON
schema; tool calls forced by `tool_choice` arrive as one; or vLLM's regex, choice or grammar) becomes a grammar whose matcher masks every step's logits
to the tokens that keep the output valid, with the library vLLM's `guidance` backend uses (llguidance: a small Rust
wheel without dependencies).

The tokenizer's view of the vocabulary is built once per engine, on the first structured request; each sequence gets
its own matcher, which advances with every token it samples, the first one sampled on a prefill worker included.
"""

from __future__ import annotations

from typing import Any

import llguidance
import llguidance.hf
import llguidance.torch
import torch

from farm.protocol.constraints import grammar_of


class InvalidFormat(ValueError):
    """A response format the grammar library refuses."""


class Grammars:
    """Matchers over the engine's tokenizer and the model's vocabulary (which may be wider than the tokenizer's:
    padding rows are never allowed)."""

    def __init__(self, tokenizer: Any, vocab_size: int):
        self.vocab_size = vocab_size
        self._tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)

    def matcher(self, response_format: dict[str, Any]) -> llguidance.LLMatcher:
        """A fresh matcher for one sequence (InvalidFormat when the schema cannot become a grammar)."""
        try:
            m = llguidance.LLMatcher(self._tokenizer, grammar_of(response_format))
        except (ValueError, TypeError, KeyError) as e:
            raise InvalidFormat(f"response_format: {e}") from None
        if m.is_error():
            raise InvalidFormat(f"response_format: {m.get_error()}")
        return m


def mask_logits(logits: torch.Tensor, matchers: list[llguidance.LLMatcher | None], vocab_size: int) -> torch.Tensor:
    """`logits` [batch, vocab] with each constrained row's disallowed tokens at -inf (a new float tensor; the raw
    logits stay as they were, for log-probabilities)."""
    out = logits.float().cpu().clone()
    bitmask = llguidance.torch.allocate_token_bitmask(len(matchers), vocab_size)
    for i, m in enumerate(matchers):
        if m is not None and not m.is_stopped():
            llguidance.torch.fill_next_token_bitmask(m, bitmask, i)
            llguidance.torch.apply_token_bitmask_inplace(out[i], bitmask[i])
    return out
