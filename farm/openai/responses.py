"""OpenAI response objects and SSE chunks for chat and text completions."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from json.encoder import encode_basestring_ascii
from typing import Any

from farm.openai.answer import read_answer
from farm.openai.tool_parsers import ToolCall
from farm.openai.tool_stream import CallDelta
from farm.openai.tools import ToolRequest

_dumps = json.JSONEncoder(separators=(",", ":")).encode  # one encoder: json.dumps(separators=...) builds one per call


def usage(u: dict[str, int]) -> dict[str, Any]:
    """OpenAI usage from the worker's done event (cached_tokens: prompt tokens served from the prefix cache)."""
    p, c = int(u.get("prompt_tokens", 0)), int(u.get("completion_tokens", 0))
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
            "prompt_tokens_details": {"cached_tokens": int(u.get("cached_tokens", 0))}}


def finish_reason(r: str | None) -> str:
    """OpenAI has no "abort": a request aborted by the farm reports "stop"."""
    return r if r in ("stop", "length", "content_filter", "tool_calls") else "stop"


@dataclass
class Choice:
    """One choice of a response: its text (None: only calls), why it ended, its log-probabilities in OpenAI's
    shape for the response's kind (farm.openai.logprobs) when asked for, and the tools it called."""

    text: str | None
    finish_reason: str | None
    logprobs: dict[str, Any] | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)
    reasoning: str | None = None
    token_ids: list[int] | None = None  # vLLM's `return_token_ids`: the generated ids
    prompt_token_ids: list[int] | None = None  # ... and its prompt's (full_response puts them where vLLM does)
    prompt_logprobs: list[Any] | None = None  # vLLM's `prompt_logprobs` of its prompt (likewise)

    @classmethod
    def of(cls, text: str, reason: str | None, logprobs: dict[str, Any] | None = None,
           tools: ToolRequest | None = None, reasoning_parser: str | None = None, echo: str = "",
           token_ids: list[int] | None = None, prompt_token_ids: list[int] | None = None,
           prompt_logprobs: list[Any] | None = None) -> Choice:
        """A generated answer's choice: its reasoning and its calls read out of its text (farm.openai.answer)."""
        if tools is None and reasoning_parser is None:
            return cls(echo + text, reason, logprobs, token_ids=token_ids, prompt_token_ids=prompt_token_ids,
                       prompt_logprobs=prompt_logprobs)
        a = read_answer(text, reason, tools, reasoning_parser, echo)
        return cls(a.content, a.finish_reason, logprobs, a.tool_calls, a.reasoning, token_ids, prompt_token_ids,
                   prompt_logprobs)


def full_response(kind: str, rid: str, model: str, choices: list[Choice], u: dict[str, int],
                  role: str = "assistant") -> dict[str, Any]:
    """The non-streamed `chat.completion` (kind "chat", its messages' `role`) or `text_completion` object. The
    prompt's fields of vLLM's extensions (`prompt_token_ids`, `prompt_logprobs`) are where vLLM puts them: on a
    text completion's choices, on a chat's response (its one prompt's, from the first choice)."""
    created = int(time.time())
    if kind == "chat":
        out = [_vllm_fields({"index": i, "message": _message(role, c), "logprobs": c.logprobs,
                             "finish_reason": finish_reason(c.finish_reason)}, c, prompt=False)
               for i, c in enumerate(choices)]
        whole = {"id": rid, "object": "chat.completion", "created": created, "model": model, "choices": out,
                 "usage": usage(u)}
        return _vllm_fields(whole, choices[0], generated=False) if choices else whole
    out = [_vllm_fields({"index": i, "text": c.text, "logprobs": c.logprobs,
                         "finish_reason": finish_reason(c.finish_reason)}, c) for i, c in enumerate(choices)]
    return {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": out,
            "usage": usage(u)}


def _vllm_fields(obj: dict[str, Any], c: Choice, prompt: bool = True, generated: bool = True) -> dict[str, Any]:
    """`obj` with the fields of vLLM's extensions the request asked for: the prompt's (`prompt_logprobs`,
    `prompt_token_ids`) and the choice's own generated `token_ids`."""
    if prompt and c.prompt_logprobs is not None:
        obj["prompt_logprobs"] = c.prompt_logprobs
    if prompt and c.prompt_token_ids is not None:
        obj["prompt_token_ids"] = c.prompt_token_ids
    if generated and c.token_ids is not None:
        obj["token_ids"] = c.token_ids
    return obj


def _message(role: str, c: Choice) -> dict[str, Any]:
    msg: dict[str, Any] = {"role": role, "content": c.text}
    if c.reasoning is not None:  # vLLM's name, and its older one (DeepSeek's API, many clients)
        msg["reasoning"] = msg["reasoning_content"] = c.reasoning
    if c.tool_calls:
        msg["tool_calls"] = [call.to_dict() for call in c.tool_calls]
    return msg


class ChunkWriter:
    """Builds the SSE lines of one streamed response (`index`: which choice a chunk belongs to).

    A text delta is a prefix (id, object, created, model, choice index), the JSON-escaped text and a fixed
    suffix, so the per-token chunk is a string concatenation (about 1 us) instead of a json.dumps of a nested
    dict (tens of us); the bytes are the same as json.dumps(..., separators=(",", ":")) would give.

    With `prompt_tokens` (a choice's prompt length by its index: vLLM's `stream_options.continuous_usage_stats`),
    every chunk of a choice carries its usage so far, counted by `generated`."""

    def __init__(self, kind: str, rid: str, model: str, role: str = "assistant",
                 prompt_tokens: Callable[[int], int] | None = None):
        self.kind, self.rid, self.model, self.message_role = kind, rid, model, role
        self._prompt_tokens = prompt_tokens
        self._generated: dict[int, int] = {}
        self.created = int(time.time())
        self.object = "chat.completion.chunk" if kind == "chat" else "text_completion"
        self._head = "data: " + _dumps({"id": rid, "object": self.object, "created": self.created,
                                        "model": model})[:-1] + ',"choices":[{"index":'
        self._text_key = ',"delta":{"content":' if kind == "chat" else ',"text":'
        self._text_end = '},"logprobs":null,"finish_reason":null}]}\n\n' if kind == "chat" else \
            ',"logprobs":null,"finish_reason":null}]}\n\n'

    def _line(self, obj: dict[str, Any]) -> str:
        return f"data: {_dumps(obj)}\n\n"

    def _chunk(self, choices: list[dict[str, Any]], **extra: Any) -> str:
        if self._prompt_tokens is not None and choices:
            index = choices[0]["index"]
            p, c = self._prompt_tokens(index), self._generated.get(index, 0)
            extra["usage"] = {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}
        return self._line({"id": self.rid, "object": self.object, "created": self.created, "model": self.model,
                           "choices": choices, **extra})

    def generated(self, index: int, tokens: int) -> None:
        """Choice `index` has `tokens` more tokens (what its next chunks' running usage counts)."""
        self._generated[index] = self._generated.get(index, 0) + tokens

    def role(self, index: int = 0, prompt_token_ids: list[int] | None = None) -> str:
        """A chat choice's first chunk (with `prompt_token_ids` on it, as vLLM's `return_token_ids` sends them)."""
        if self.kind != "chat":
            return ""
        extra = {} if prompt_token_ids is None else {"prompt_token_ids": prompt_token_ids}
        return self._chunk([{"index": index, "delta": {"role": self.message_role, "content": ""}, "logprobs": None,
                             "finish_reason": None}], **extra)

    def delta(self, text: str, index: int = 0, logprobs: dict[str, Any] | None = None,
              token_ids: list[int] | None = None, prompt_token_ids: list[int] | None = None) -> str:
        """A text delta; with vLLM's `return_token_ids`, its tokens' ids (`token_ids`) and, on a text completion's
        first chunk of a choice, its prompt's."""
        if logprobs is None and self._prompt_tokens is None and token_ids is None and prompt_token_ids is None:
            return f"{self._head}{index}{self._text_key}{encode_basestring_ascii(text)}{self._text_end}"
        if self.kind == "chat":
            choice = {"index": index, "delta": {"content": text}, "logprobs": logprobs, "finish_reason": None}
        else:
            choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": None}
            if prompt_token_ids is not None:
                choice["prompt_token_ids"] = prompt_token_ids
        if token_ids is not None:
            choice["token_ids"] = token_ids
        return self._chunk([choice])

    def token_ids(self, ids: list[int], index: int = 0) -> str:
        """A chunk of token ids alone (an empty delta): the ids of tokens whose text a tool or reasoning parser
        holds or sends as other deltas, as vLLM sends them with `return_token_ids`."""
        delta: dict[str, Any] = {"index": index, "delta": {}} if self.kind == "chat" else {"index": index, "text": ""}
        return self._chunk([{**delta, "logprobs": None, "finish_reason": None, "token_ids": ids}])

    def thought(self, text: str, index: int = 0) -> str:
        """A streamed piece of reasoning, under both of its names (as the whole message carries it)."""
        return self._chunk([{"index": index, "delta": {"reasoning": text, "reasoning_content": text},
                             "logprobs": None, "finish_reason": None}])

    def tool_call(self, d: CallDelta, index: int = 0) -> str:
        """A streamed call's piece, as OpenAI streams them: the first with its id, type and name."""
        call: dict[str, Any] = {"index": d.index}
        if d.id is not None:
            call.update(id=d.id, type="function", function={"name": d.name, "arguments": d.arguments})
        else:
            call["function"] = {"arguments": d.arguments}
        return self._chunk([{"index": index, "delta": {"tool_calls": [call]}, "logprobs": None,
                             "finish_reason": None}])

    def finish(self, reason: str, index: int = 0) -> str:
        if self.kind == "chat":
            return self._chunk([{"index": index, "delta": {}, "logprobs": None,
                                 "finish_reason": finish_reason(reason)}])
        return self._chunk([{"index": index, "text": "", "logprobs": None, "finish_reason": finish_reason(reason)}])

    def usage(self, u: dict[str, int]) -> str:
        return self._chunk([], usage=usage(u))

    def error(self, message: str, code: str = "server_error") -> str:
        return self._line({"error": {"message": message, "type": "server_error", "param": None, "code": code}})

    @staticmethod
    def done() -> str:
        return "data: [DONE]\n\n"
