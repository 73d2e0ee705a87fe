"""Log-probabilities in OpenAI's shapes, from the workers' form.

Workers send, for each generated token, `[logprob, [[token id, logprob], ...]]` (the sampled token's
log-probability and the top alternatives, most likely first); the API turns token ids into the token's
text with the model's tokenizer, as vLLM's OpenAI server does.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

_TEXTS: dict[int, tuple[Any, dict[int, str]]] = {}  # id(tokenizer) -> (tokenizer, token id -> its text)
_TEXTS_LOCK = threading.Lock()


def _token(tokenizer: Any, token_id: int) -> str:
    """A token's text, decoded once per tokenizer: an answer of n x 4,000 tokens with 20 alternatives each asked
    the tokenizer over a million times."""
    with _TEXTS_LOCK:
        hit = _TEXTS.get(id(tokenizer))
        if hit is None or hit[0] is not tokenizer:
            hit = _TEXTS[id(tokenizer)] = (tokenizer, {})
    texts = hit[1]
    text = texts.get(token_id)
    if text is None:
        text = texts[token_id] = tokenizer.decode([token_id])
    return text


def _shown(logprob: float) -> float:
    """A log-probability as vLLM's server shows it: -inf (a token a mask or a constraint ruled out) is -9999.0, since
    JSON has no infinity (Python writes `-Infinity`, which JavaScript's JSON.parse and most strict parsers refuse)."""
    return max(logprob, -9999.0)


def chat_logprobs(tokenizer: Any, ids: list[int], lps: list[list]) -> dict[str, Any]:
    """`choices[].logprobs` of a chat completion (or of one streamed chunk)."""
    content = []
    for tid, (lp, top) in zip(ids, lps, strict=False):
        text = _token(tokenizer, tid)
        content.append({"token": text, "logprob": _shown(lp), "bytes": list(text.encode()),
                        "top_logprobs": [{"token": (t := _token(tokenizer, i)), "logprob": _shown(v),
                                          "bytes": list(t.encode())} for i, v in top]})
    return {"content": content}


def completion_logprobs(tokenizer: Any, ids: list[int], lps: list[list | None], offset: int = 0) -> dict[str, Any]:
    """`choices[].logprobs` of a text completion: tokens, their log-probabilities, the top alternatives
    per position and each token's character offset in the completion (starting at `offset`). As OpenAI's legacy
    completions and vLLM answer, a position's alternatives include its own token (up to k + 1 of them). An entry
    None (an echoed prompt's first token: nothing predicts it) is null in both lists."""
    tokens, token_lps, tops, offsets = [], [], [], []
    for tid, entry in zip(ids, lps, strict=False):
        text = _token(tokenizer, tid)
        tokens.append(text)
        lp, top = (_shown(entry[0]), entry[1]) if entry is not None else (None, None)  # a prompt token's: rank third
        token_lps.append(lp)
        tops.append(None if top is None else {**{_token(tokenizer, i): _shown(v) for i, v in top}, text: lp})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def merge(kind: str, parts: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The logprobs of a whole completion from those of its pieces (streamed deltas)."""
    if not parts:
        return None
    if kind == "chat":
        return {"content": [e for p in parts for e in p["content"]]}
    return {k: [x for p in parts for x in p[k]] for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}


def for_kind(kind: str, tokenizer: Any, ids: list[int], lps: list[list], offset: int = 0) -> dict[str, Any]:
    return chat_logprobs(tokenizer, ids, lps) if kind == "chat" else completion_logprobs(tokenizer, ids, lps, offset)


def echoed(tokenizer: Any, prompt_ids: list[int], prompt_lps: list[list | None],
           k: int | None = None) -> tuple[dict[str, Any], int]:
    """An echoed prompt's log-probabilities (a text completion's `echo` with `logprobs`, as vLLM answers them, with
    at most `k` alternatives: the worker computed as many as the larger of `logprobs` and `prompt_logprobs`) and
    the character offset its tokens end at, where the completion's token offsets go on."""
    if k is not None:
        prompt_lps = [None if e is None else [e[0], e[1][:k]] for e in prompt_lps]
    head = completion_logprobs(tokenizer, prompt_ids, prompt_lps)
    return head, (head["text_offset"][-1] + len(head["tokens"][-1])) if head["tokens"] else 0


def for_answer(kind: str, tokenizer: Any, ids: list[int], lps: list[list], prompt_ids: Sequence[int] = (),
               prompt_lps: list[list | None] | None = None, k: int | None = None) -> dict[str, Any]:
    """A whole choice's log-probabilities: its echoed prompt's first (at most `k` alternatives each) when the
    worker sent them."""
    if prompt_lps is None:
        return for_kind(kind, tokenizer, ids, lps)
    head, end = echoed(tokenizer, list(prompt_ids), prompt_lps, k)
    return merge(kind, [head, for_kind(kind, tokenizer, ids, lps, end)]) or head


def prompt_logprobs(tokenizer: Any, prompt_ids: Sequence[int], prompt_lps: list[list | None],
                    k: int) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's `prompt_logprobs` of a choice (a text completion's) or a response (a chat's): null for the first
    token, then for each prompt token {token id: {logprob, rank, decoded_token}}, the token's own first, then the
    `k` most likely (ranked 1..k; one of them may be the token itself). A log-probability of -inf is -9999.0, as
    vLLM clamps it (JSON has no infinity)."""
    out: list[dict[str, dict[str, Any]] | None] = []
    for tid, entry in zip(prompt_ids, prompt_lps, strict=False):
        if entry is None:
            out.append(None)
            continue
        found = {str(tid): _entry(tokenizer, tid, entry[0], entry[2] if len(entry) > 2 else None)}
        for rank, (i, v) in enumerate(entry[1][:k], start=1):
            found[str(i)] = _entry(tokenizer, i, v, rank)
        out.append(found)
    return out


def _entry(tokenizer: Any, token_id: int, logprob: float, rank: int | None) -> dict[str, Any]:
    return {"logprob": _shown(logprob), "rank": rank, "decoded_token": _token(tokenizer, token_id)}
