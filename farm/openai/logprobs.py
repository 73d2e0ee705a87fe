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


def chat_logprobs(tokenizer: Any, ids: list[int], lps: list[list]) -> dict[str, Any]:
    """`choices[].logprobs` of a chat completion (or of one streamed chunk)."""
    content = []
    for tid, (lp, top) in zip(ids, lps, strict=False):
        text = _token(tokenizer, tid)
        content.append({"token": text, "logprob": lp, "bytes": list(text.encode()),
                        "top_logprobs": [{"token": (t := _token(tokenizer, i)), "logprob": v, "bytes": list(t.encode())}
                                         for i, v in top]})
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
        lp, top = entry if entry is not None else (None, None)
        token_lps.append(lp)
        tops.append(None if top is None else {**{_token(tokenizer, i): v for i, v in top}, text: lp})
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


def echoed(tokenizer: Any, prompt_ids: list[int], prompt_lps: list[list | None]) -> tuple[dict[str, Any], int]:
    """An echoed prompt's log-probabilities (a text completion's `echo` with `logprobs`, as vLLM answers them) and
    the character offset its tokens end at, where the completion's token offsets go on."""
    head = completion_logprobs(tokenizer, prompt_ids, prompt_lps)
    return head, (head["text_offset"][-1] + len(head["tokens"][-1])) if head["tokens"] else 0


def for_answer(kind: str, tokenizer: Any, ids: list[int], lps: list[list], prompt_ids: Sequence[int] = (),
               prompt_lps: list[list | None] | None = None) -> dict[str, Any]:
    """A whole choice's log-probabilities: its echoed prompt's first when the worker sent them."""
    if prompt_lps is None:
        return for_kind(kind, tokenizer, ids, lps)
    head, end = echoed(tokenizer, list(prompt_ids), prompt_lps)
    return merge(kind, [head, for_kind(kind, tokenizer, ids, lps, end)]) or head
