"""Anthropic's Messages API (`POST /v1/messages`) translated onto the chat-completions path, both ways, without
a web framework: the request models (the accepted fields and `/openapi.json`), an Anthropic body -> the OpenAI chat
body the farm's own chat path validates, templates and generates, and the chat answer (JSON, or its SSE chunks)
-> Anthropic's message (JSON, or its event stream: message_start, content_block_start, ping, content_block_delta
..., content_block_stop, message_delta, message_stop), and errors in Anthropic's shape.

Text only: image, document, tool_use, tool_result and thinking blocks, `tools`, `tool_choice` and `thinking` are
refused with an invalid_request_error (the farm has no tool calling). Stop sequences are asked of the chat path
with `include_stop_str_in_output`, so the answer shows which one ended it (`stop_reason` "stop_sequence",
`stop_sequence` set); the translation takes the sequence off the text again, and in a stream holds back a tail
that may begin one until it knows.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Literal

from pydantic import (
    BaseModel,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    ValidationError,
)

from farm.openai.api_error import APIError, bad_request
from farm.openai.schemas import MAX_TOP_K, _Loose, _Request  # the OpenAI schemas' bases and bound, shared
from farm.protocol import MAX_STOP_CHARS, MAX_STOP_SEQUENCES

TEXT_ONLY = "this server accepts text content only (no images, documents or tool calling)"
_dumps = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False).encode


# -- requests ------------------------------------------------------------------------------------
class AnthropicTextBlockParam(_Request):
    type: Literal["text"]
    text: StrictStr
    cache_control: dict[str, Any] | None = Field(None, description=(
        "accepted and ignored: the farm's prefix cache needs no breakpoints"))


class AnthropicMessageParam(_Request):
    role: Literal["user", "assistant"] = Field(description=(
        "a last assistant message is continued (Anthropic's prefill): the answer is its continuation"))
    content: StrictStr | list[AnthropicTextBlockParam] = Field(description="a string or text blocks only")


class AnthropicMetadata(_Request):
    user_id: StrictStr | None = Field(None, max_length=256, description="accepted and ignored")


class AnthropicMessagesRequest(_Request):
    """POST /v1/messages (Anthropic's Messages API, text only)."""

    model: StrictStr = Field(description="a configured model (GET /v1/models)")
    max_tokens: StrictInt = Field(ge=1, description="required; prompt + max_tokens must fit max_model_len")
    messages: list[AnthropicMessageParam] = Field(min_length=1)
    system: StrictStr | list[AnthropicTextBlockParam] | None = Field(None, description="put first as a system message")
    stop_sequences: list[StrictStr] | None = Field(None, max_length=MAX_STOP_SEQUENCES,
                                                   description=f"at most {MAX_STOP_SEQUENCES}")
    temperature: StrictFloat | None = Field(None, ge=0, le=1)
    top_p: StrictFloat | None = Field(None, gt=0, le=1)
    top_k: StrictInt | None = Field(None, ge=0, le=MAX_TOP_K)
    stream: StrictBool | None = None
    metadata: AnthropicMetadata | None = None
    cache_control: dict[str, Any] | None = Field(None, description=(
        "accepted and ignored: the farm's prefix cache needs no breakpoints"))
    tools: list[dict[str, Any]] | None = Field(None, description="not supported: accepted only when absent or empty")
    tool_choice: dict[str, Any] | None = Field(None, description="not supported: accepted only when absent")
    thinking: dict[str, Any] | None = Field(None, description="not supported: accepted only as {type: disabled}")


# -- responses -----------------------------------------------------------------------------------
class AnthropicTextBlock(_Loose):
    type: Literal["text"] = "text"
    text: str


class AnthropicUsage(_Loose):
    input_tokens: int
    output_tokens: int


StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "refusal"]


class AnthropicMessage(_Loose):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[AnthropicTextBlock]
    stop_reason: StopReason | None
    stop_sequence: str | None = None
    usage: AnthropicUsage


class AnthropicErrorDetail(_Loose):
    type: str = Field(description="invalid_request_error, authentication_error, permission_error, not_found_error, "
                                  "request_too_large, rate_limit_error, api_error, overloaded_error, timeout_error")
    message: str


class AnthropicErrorResponse(_Loose):
    type: Literal["error"] = "error"
    error: AnthropicErrorDetail


REQUEST_MODELS: tuple[type[BaseModel], ...] = (AnthropicMessagesRequest,)
RESPONSE_MODELS: tuple[type[BaseModel], ...] = (AnthropicMessage, AnthropicErrorResponse)


# -- request -> chat body --------------------------------------------------------------------------
def _loc(loc: tuple[Any, ...]) -> str:
    """`messages[0].content[1].text` from pydantic's location, without the names of union members."""
    out = ""
    for part in loc:
        if isinstance(part, str) and (part in ("str", "int", "float", "bool") or "[" in part
                                      or part.startswith("Anthropic")):
            continue
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _refuse_non_text(body: dict[str, Any]) -> None:
    """A clear 400 for the content blocks and fields of Anthropic's API the farm does not serve."""
    blocks: list[tuple[str, Any]] = []
    messages = body.get("messages")
    if isinstance(messages, list):
        for i, m in enumerate(messages):
            if isinstance(m, dict) and isinstance(m.get("content"), list):
                blocks += [(f"messages[{i}].content[{j}]", b) for j, b in enumerate(m["content"])]
    if isinstance(body.get("system"), list):
        blocks += [(f"system[{j}]", b) for j, b in enumerate(body["system"])]
    for where, block in blocks:
        kind = block.get("type") if isinstance(block, dict) else None
        if isinstance(kind, str) and kind != "text":
            raise bad_request(f"{where}: '{kind}' content blocks are not supported; {TEXT_ONLY}", where,
                              "unsupported_content")
    if body.get("tools") not in (None, []):
        raise bad_request("'tools' is not supported by this server (no tool calling)", "tools", "unsupported_parameter")
    if body.get("tool_choice") is not None:
        raise bad_request("'tool_choice' is not supported by this server (no tool calling)", "tool_choice",
                          "unsupported_parameter")
    if body.get("thinking") not in (None, {"type": "disabled"}):
        raise bad_request("'thinking' is not supported by this server (only {\"type\": \"disabled\"})", "thinking",
                          "unsupported_parameter")


def parse_request(body: Any) -> AnthropicMessagesRequest:
    """The body as an AnthropicMessagesRequest, or a 400 naming the first problem (an unknown field, a missing
    `max_tokens`, a block that is not text, a value out of range)."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    for name in body:
        if name not in AnthropicMessagesRequest.model_fields:
            raise bad_request(f"{name}: Extra inputs are not permitted (unknown parameter)", str(name),
                              "unknown_parameter")
    _refuse_non_text(body)
    try:
        req = AnthropicMessagesRequest.model_validate(body)
    except ValidationError as e:
        first = max(e.errors(), key=lambda err: len(err["loc"]))  # in a union, the member that got furthest
        where = _loc(tuple(first["loc"]))
        raise bad_request(f"{where}: {first['msg']}" if where else first["msg"], where or None) from None
    if any(len(s) > MAX_STOP_CHARS for s in req.stop_sequences or ()):
        raise bad_request(f"each stop sequence may be at most {MAX_STOP_CHARS} characters", "stop_sequences")
    return req


def _text(content: str | list[AnthropicTextBlockParam]) -> str:
    return content if isinstance(content, str) else "".join(b.text for b in content)


def stop_sequences(req: AnthropicMessagesRequest) -> list[str]:
    return [s for s in req.stop_sequences or () if s]


def to_chat_body(req: AnthropicMessagesRequest) -> dict[str, Any]:
    """The OpenAI chat-completions body the farm's chat path serves for `req`: the system prompt as the first
    message, text blocks joined, Anthropic's sampling fields under OpenAI's (vLLM's) names; a last assistant message
    is continued (vLLM's `continue_final_message`); with stop sequences the matched one is kept in the text
    (`include_stop_str_in_output`) so that `split_stop` can tell which ended the answer; a stream reports usage."""
    messages: list[dict[str, str]] = []
    system = _text(req.system) if req.system is not None else ""
    if system:
        messages.append({"role": "system", "content": system})
    messages += [{"role": m.role, "content": _text(m.content)} for m in req.messages]
    body: dict[str, Any] = {"model": req.model, "messages": messages, "max_tokens": req.max_tokens}
    for name in ("temperature", "top_p", "top_k"):
        if (value := getattr(req, name)) is not None:
            body[name] = value
    if stops := stop_sequences(req):
        body["stop"] = stops
        body["include_stop_str_in_output"] = True
    if req.messages[-1].role == "assistant":
        body["add_generation_prompt"] = False
        body["continue_final_message"] = True
    if req.stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return body


# -- chat answer -> message ------------------------------------------------------------------------
def message_id(chat_id: str) -> str:
    """`msg_<id>` from the chat response's `chatcmpl-<id>` (the client's X-Request-Id, when it sent one)."""
    return "msg_" + chat_id.removeprefix("chatcmpl-")


def split_stop(text: str, finish_reason: str | None, stops: list[str]) -> tuple[str, str | None]:
    """(the text without the stop sequence that ended it, that sequence) for an answer generated with
    `include_stop_str_in_output`; (text, None) when none did (the engine picks, among sequences ending at the same
    place, the first listed: so does this)."""
    if finish_reason == "stop":
        for s in stops:
            if s and text.endswith(s):
                return text[:-len(s)], s
    return text, None


def stop_reason(finish_reason: str | None, stop_sequence: str | None) -> StopReason:
    if stop_sequence is not None:
        return "stop_sequence"
    if finish_reason == "length":
        return "max_tokens"
    return "refusal" if finish_reason == "content_filter" else "end_turn"


def from_chat_completion(chat: dict[str, Any], stops: list[str]) -> dict[str, Any]:
    """Anthropic's message from a non-streamed `chat.completion` (one choice)."""
    choice = chat["choices"][0]
    text, seq = split_stop(choice["message"].get("content") or "", choice.get("finish_reason"), stops)
    usage = chat.get("usage") or {}
    msg = AnthropicMessage(id=message_id(chat["id"]), model=chat["model"], content=[AnthropicTextBlock(text=text)],
                           stop_reason=stop_reason(choice.get("finish_reason"), seq), stop_sequence=seq,
                           usage=AnthropicUsage(input_tokens=int(usage.get("prompt_tokens", 0)),
                                                output_tokens=int(usage.get("completion_tokens", 0))))
    return msg.model_dump()


def _held_back(text: str, stops: list[str]) -> int:
    """How many characters at the end of `text` may begin (or be) a stop sequence: held back until known."""
    best = 0
    for s in stops:
        for k in range(min(len(s), len(text)), best, -1):
            if s.startswith(text[-k:]):
                best = k
                break
    return best


def event(kind: str, data: dict[str, Any]) -> str:
    return f"event: {kind}\ndata: {_dumps(data)}\n\n"


class StreamTranslator:
    """OpenAI chat chunks (the `data:` payloads of one choice, with a usage chunk) -> Anthropic's SSE events.
    `input_tokens()` is the prompt's token count for message_start (known once the prompt was templated; the final
    message_delta carries the usage the workers reported)."""

    def __init__(self, stops: list[str], input_tokens: Callable[[], int] = lambda: 0):
        self.stops = [s for s in stops if s]
        self.input_tokens = input_tokens
        self.started = self.block_open = self.closed = False
        self.held = ""
        self.finish: str | None = None
        self.stop_sequence: str | None = None
        self.usage: dict[str, Any] = {}

    def _start(self, chunk: dict[str, Any]) -> str:
        self.started = self.block_open = True
        message = {"id": message_id(str(chunk.get("id", ""))), "type": "message", "role": "assistant",
                   "model": chunk.get("model", ""), "content": [], "stop_reason": None, "stop_sequence": None,
                   "usage": {"input_tokens": self.input_tokens(), "output_tokens": 0}}
        return (event("message_start", {"type": "message_start", "message": message})
                + event("content_block_start", {"type": "content_block_start", "index": 0,
                                                "content_block": {"type": "text", "text": ""}})
                + event("ping", {"type": "ping"}))

    @staticmethod
    def _delta(text: str) -> str:
        if not text:
            return ""
        return event("content_block_delta", {"type": "content_block_delta", "index": 0,
                                             "delta": {"type": "text_delta", "text": text}})

    def _text(self, text: str) -> str:
        if not self.stops:
            return self._delta(text)
        buf = self.held + text
        keep = _held_back(buf, self.stops)
        self.held = buf[len(buf) - keep:]
        return self._delta(buf[:len(buf) - keep])

    def _stop_block(self) -> str:
        if not self.block_open:
            return ""
        self.block_open = False
        rest, self.stop_sequence = split_stop(self.held, self.finish, self.stops)
        self.held = ""
        return self._delta(rest) + event("content_block_stop", {"type": "content_block_stop", "index": 0})

    def feed(self, payload: str) -> str:
        """The SSE text for one `data:` payload of the chat stream ("" when it adds nothing yet)."""
        if self.closed:
            return ""
        if payload == "[DONE]":
            return self.end()
        chunk = json.loads(payload)
        if "error" in chunk:
            self.closed = True
            err = chunk["error"] or {}
            code = err.get("code")
            status = 503 if code in OVERLOADED_CODES else 504 if code == "timeout" else 500
            return event("error", error_body(status, str(err.get("message") or "generation failed"), code)[1])
        out = "" if self.started else self._start(chunk)
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        for choice in chunk.get("choices") or ():
            content = (choice.get("delta") or {}).get("content")
            if content:
                out += self._text(content)
            if choice.get("finish_reason") is not None:
                self.finish = choice["finish_reason"]
                out += self._stop_block()
        return out

    def end(self) -> str:
        """message_delta (stop reason, usage) and message_stop, once."""
        if self.closed:
            return ""
        self.closed = True
        out = self._stop_block()
        usage = {"input_tokens": int(self.usage.get("prompt_tokens", self.input_tokens())),
                 "output_tokens": int(self.usage.get("completion_tokens", 0))}
        out += event("message_delta", {"type": "message_delta",
                                       "delta": {"stop_reason": stop_reason(self.finish, self.stop_sequence),
                                                 "stop_sequence": self.stop_sequence},
                                       "usage": usage})
        return out + event("message_stop", {"type": "message_stop"})


def translate_stream(chunks: Iterable[str | bytes], stops: list[str],
                     input_tokens: Callable[[], int] = lambda: 0) -> Iterator[str]:
    """Anthropic's event stream from the chat path's SSE text (`data: ...` blocks, whatever way they are cut into
    writes). Closing this generator closes `chunks` (the chat stream ends its generation)."""
    t = StreamTranslator(stops, input_tokens)
    buf = ""
    try:
        for piece in chunks:
            buf += piece.decode() if isinstance(piece, bytes) else piece
            *blocks, buf = buf.split("\n\n")
            out = "".join(t.feed(b[len("data: "):]) for b in blocks if b.startswith("data: "))
            if out:
                yield out
        tail = t.end()
        if tail:
            yield tail
    finally:
        close = getattr(chunks, "close", None)
        if close is not None:
            close()


# -- errors --------------------------------------------------------------------------------------
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
                504: "timeout_error", 529: "overloaded_error"}
OVERLOADED_CODES = frozenset({"overloaded", "no_workers"})


def error_body(status: int, message: str, code: str | None = None) -> tuple[int, dict[str, Any]]:
    """(status, body) of an error in Anthropic's shape, `{"type": "error", "error": {"type", "message"}}`: the farm's
    "every worker is above its load threshold" is Anthropic's 529 overloaded_error; no worker for the model is a 503
    overloaded_error (retry later); other 4xx are invalid_request_error, other 5xx api_error."""
    if code == "overloaded" and status == 503:
        status = 529
    if status in _ERROR_TYPES:
        kind = _ERROR_TYPES[status]
    elif status == 503:
        kind = "overloaded_error" if code in OVERLOADED_CODES else "api_error"
    else:
        kind = "invalid_request_error" if 400 <= status < 500 else "api_error"
    return status, {"type": "error", "error": {"type": kind, "message": message}}


def from_api_error(err: APIError) -> tuple[int, dict[str, Any]]:
    return error_body(err.status, err.message, err.code)
