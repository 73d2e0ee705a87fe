"""Anthropic's Messages API (`POST /v1/messages`) translated onto the chat-completions path, both ways, without
a web framework: the request models (the accepted fields and `/openapi.json`), an Anthropic body -> the OpenAI chat
body the farm's own chat path validates, templates and generates, and the chat answer (JSON, or its SSE chunks)
-> Anthropic's message (JSON, or its event stream: message_start, content_block_start, ping, content_block_delta
..., content_block_stop, message_delta, message_stop), and errors in Anthropic's shape.

Text, tool use (farm.openai.anthropic_tools: `tools`, `tool_choice`, `tool_use` and `tool_result` blocks onto the
chat path's tool calling; calls stream as `tool_use` blocks with `input_json_delta`s) and thinking (a model's
reasoning, from its reasoning parser, as `thinking` blocks; `thinking` switches a reasoning template's
`enable_thinking`); `output_config.format` is the chat path's json_schema response format; consecutive turns of one
role are one turn, as Anthropic combines them; image and document blocks are refused with an invalid_request_error. Stop sequences are asked of the chat path
with `include_stop_str_in_output`, so the answer shows which one ended it (`stop_reason` "stop_sequence",
`stop_sequence` set); the translation takes the sequence off the text again, and in a stream holds back a tail
that may begin one until it knows.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Literal

from pydantic import (
    BaseModel,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
)

from farm.models.tokenization import partial_stop
from farm.openai.anthropic_tools import (
    AnthropicTextBlockParam,
    AnthropicToolChoice,
    AnthropicToolParam,
    Block,
    chat_messages,
    chat_tool_fields,
    check_blocks,
    join_text,
    tool_use_blocks,
    tool_use_id,
)
from farm.openai.api_error import APIError, bad_request
from farm.openai.chat_stream import ChunkTranslator, named_event, streamed_with_usage, translate
from farm.openai.reasoning import THINKING_FLAG
from farm.openai.schemas import MAX_TOP_K, _Loose, _Request  # the OpenAI schemas' bases and bound, shared
from farm.openai.validation import validated
from farm.protocol import MAX_STOP_CHARS, MAX_STOP_SEQUENCES

TEXT_ONLY = "this server accepts text, tool use and thinking only (no images or documents)"
BLOCK_TYPES = ("text", "tool_use", "tool_result", "thinking", "redacted_thinking")


# -- requests ------------------------------------------------------------------------------------
class AnthropicMessageParam(_Request):
    role: Literal["user", "assistant"] = Field(description=(
        "a last assistant message is continued (Anthropic's prefill): the answer is its continuation"))
    content: StrictStr | list[Block] = Field(
        description="a string, or text, tool_use (assistant) and tool_result (user) blocks")


class AnthropicMetadata(_Request):
    user_id: StrictStr | None = Field(None, max_length=256, description="accepted and ignored")


class AnthropicThinkingConfig(_Request):
    type: Literal["enabled", "adaptive", "disabled"] = Field(description=(
        "enabled / adaptive: the model's reasoning template thinks (enable_thinking), disabled: it does not"))
    budget_tokens: StrictInt | None = Field(None, ge=1024, description=(
        "accepted; the thinking is bounded by max_tokens alone"))
    display: Literal["summarized", "omitted"] | None = Field(None, description=(
        "omitted: thinking blocks carry no text"))


class AnthropicJsonFormat(_Request):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema", description="the answer's JSON schema")


class AnthropicOutputConfig(_Request):
    format: AnthropicJsonFormat | None = Field(None, description="the chat path's json_schema response format")
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = Field(None, description="accepted and ignored")


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
    service_tier: Literal["auto", "standard_only"] | None = Field(None, description=(
        "accepted; every request is served alike"))
    cache_control: dict[str, Any] | None = Field(None, description=(
        "accepted and ignored: the farm's prefix cache needs no breakpoints"))
    tools: list[AnthropicToolParam] | None = Field(None, max_length=128, description="client tools (custom)")
    tool_choice: AnthropicToolChoice | None = Field(None, description=(
        "auto (the model's tool_call_parser reads its calls), any, tool (forced by structured output), none"))
    thinking: AnthropicThinkingConfig | None = None
    output_config: AnthropicOutputConfig | None = None


class AnthropicCountTokensRequest(_Request):
    """POST /v1/messages/count_tokens: what a message request's prompt would count, without generating."""

    model: StrictStr = Field(description="a configured model (GET /v1/models)")
    messages: list[AnthropicMessageParam] = Field(min_length=1)
    system: StrictStr | list[AnthropicTextBlockParam] | None = None
    tools: list[AnthropicToolParam] | None = Field(None, max_length=128)
    tool_choice: AnthropicToolChoice | None = None
    thinking: AnthropicThinkingConfig | None = None
    output_config: AnthropicOutputConfig | None = None


class AnthropicTokenCount(_Loose):
    input_tokens: int


# -- responses -----------------------------------------------------------------------------------
class AnthropicTextBlock(_Loose):
    type: Literal["text"] = "text"
    text: str


class AnthropicToolUseBlock(_Loose):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


class AnthropicThinkingBlock(_Loose):
    type: Literal["thinking"] = "thinking"
    thinking: str
    signature: str = Field(description="opaque; a block sent back is not put in the prompt again")


class AnthropicUsage(_Loose):
    input_tokens: int = Field(description="the prompt's tokens not read from the prefix cache")
    output_tokens: int
    cache_read_input_tokens: int = Field(0, description="the prompt's tokens read from the prefix cache")
    cache_creation_input_tokens: int = 0


StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "refusal", "tool_use"]


class AnthropicMessage(_Loose):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[AnthropicThinkingBlock | AnthropicTextBlock | AnthropicToolUseBlock]
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
    request_id: str | None = Field(None, description="the request's `req_...` id, as its request-id header")


REQUEST_MODELS: tuple[type[BaseModel], ...] = (AnthropicMessagesRequest, AnthropicCountTokensRequest)
RESPONSE_MODELS: tuple[type[BaseModel], ...] = (AnthropicMessage, AnthropicErrorResponse, AnthropicTokenCount)


# -- request -> chat body --------------------------------------------------------------------------
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
        if isinstance(kind, str) and kind not in (BLOCK_TYPES if where.startswith("messages") else ("text",)):
            raise bad_request(f"{where}: '{kind}' content blocks are not supported; {TEXT_ONLY}", where,
                              "unsupported_content")


def _known_fields(body: Any, model: type[BaseModel]) -> dict[str, Any]:
    """`body` when it is an object of `model`'s fields only, else a 400 naming the first other one."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    for name in body:
        if name not in model.model_fields:
            raise bad_request(f"{name}: Extra inputs are not permitted (unknown parameter)", str(name),
                              "unknown_parameter")
    return body


def parse_count_request(body: Any) -> AnthropicMessagesRequest:
    """A count_tokens body (its own fields only) as the message request whose prompt it counts."""
    return parse_request({**_known_fields(body, AnthropicCountTokensRequest), "max_tokens": 1})


def parse_request(body: Any) -> AnthropicMessagesRequest:
    """The body as an AnthropicMessagesRequest, or a 400 naming the first problem (an unknown field, a missing
    `max_tokens`, a block that is not text, a value out of range)."""
    _refuse_non_text(_known_fields(body, AnthropicMessagesRequest))
    req = validated(AnthropicMessagesRequest, body, ("Anthropic",))
    for i, m in enumerate(req.messages):
        check_blocks(i, m.role, m.content)
    if any(len(s) > MAX_STOP_CHARS for s in req.stop_sequences or ()):
        raise bad_request(f"each stop sequence may be at most {MAX_STOP_CHARS} characters", "stop_sequences")
    return req


def stop_sequences(req: AnthropicMessagesRequest) -> list[str]:
    return [s for s in req.stop_sequences or () if s]


def shows_thinking(req: AnthropicMessagesRequest) -> bool:
    """Whether thinking blocks carry their text (`thinking.display` omitted: only the signature)."""
    return req.thinking is None or req.thinking.display != "omitted"


def to_chat_body(req: AnthropicMessagesRequest) -> dict[str, Any]:
    """The OpenAI chat-completions body the farm's chat path serves for `req`: the system prompt as the first
    message, text blocks joined, Anthropic's sampling fields under OpenAI's (vLLM's) names; a last assistant message
    is continued (vLLM's `continue_final_message`); with stop sequences the matched one is kept in the text
    (`include_stop_str_in_output`) so that `split_stop` can tell which ended the answer; a stream reports usage."""
    messages: list[dict[str, Any]] = []
    system = join_text(req.system)
    if system:
        messages.append({"role": "system", "content": system})
    for i, m in enumerate(req.messages):
        messages += chat_messages(i, m.role, m.content)
    body: dict[str, Any] = {"model": req.model, "messages": _combined(messages), "max_tokens": req.max_tokens,
                            **chat_tool_fields(req.tools, req.tool_choice)}
    if req.thinking is not None:
        body["chat_template_kwargs"] = {THINKING_FLAG: req.thinking.type != "disabled"}
    if req.output_config is not None and req.output_config.format is not None:
        body["response_format"] = {"type": "json_schema", "json_schema": {
            "name": "output", "schema": req.output_config.format.schema_}}
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
        body.update(streamed_with_usage())
    return body


def _combined(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Consecutive user turns, or assistant turns, as one (Anthropic combines them; a template that wants turns to
    alternate would refuse them): their texts joined by a blank line, an assistant's calls kept in order."""
    out: list[dict[str, Any]] = []
    for m in messages:
        prev = out[-1] if out else None
        if prev is not None and m["role"] == prev["role"] and m["role"] in ("user", "assistant") \
                and not prev.get("tool_calls"):
            merged = {**prev, "content": "\n\n".join(t for t in (prev["content"], m["content"]) if t)}
            if m.get("tool_calls"):
                merged["tool_calls"] = m["tool_calls"]
            out[-1] = merged
        else:
            out.append(m)
    return out


# -- chat answer -> message ------------------------------------------------------------------------
def request_id(rid: str) -> str:
    """Anthropic's `request-id` (`req_<id>`, in its header and error bodies) for the farm's request id (the chat
    path's `chatcmpl-<id>`, the error path's `req_<id>`, or the client's own X-Request-Id)."""
    return "req_" + rid.removeprefix("chatcmpl-").removeprefix("req_")


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


def stop_reason(finish_reason: str | None, stop_sequence: str | None, called: bool = False) -> StopReason:
    """Anthropic's stop reason; `called`: the answer holds a tool_use block (a forced tool's call ends as "stop" on
    the chat path, as OpenAI's does, and is "tool_use" here: an agent loop runs while it reads "tool_use")."""
    if stop_sequence is not None:
        return "stop_sequence"
    if finish_reason == "length":
        return "max_tokens"
    if finish_reason == "tool_calls" or called and finish_reason == "stop":
        return "tool_use"
    return "refusal" if finish_reason == "content_filter" else "end_turn"


def usage_of(usage: dict[str, Any], prompt_tokens: int = 0) -> dict[str, int]:
    """Anthropic's usage from the chat path's: the prompt's tokens read from the prefix cache apart from the rest,
    as Anthropic and vLLM count them (`prompt_tokens` when the chat usage has none yet)."""
    cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0))
    prompt = int(usage.get("prompt_tokens", prompt_tokens))
    return AnthropicUsage(input_tokens=prompt - cached, output_tokens=int(usage.get("completion_tokens", 0)),
                          cache_read_input_tokens=cached).model_dump()


def signature(thinking: str) -> str:
    """A thinking block's `signature`: opaque to the client, which sends it back with the block (the farm verifies
    nothing: earlier reasoning is not put in the prompt again)."""
    return "farm-" + hashlib.sha256(thinking.encode()).hexdigest()[:32]


def from_chat_completion(chat: dict[str, Any], stops: list[str], show_thinking: bool = True) -> dict[str, Any]:
    """Anthropic's message from a non-streamed `chat.completion` (one choice); the model's reasoning as a thinking
    block first (without its text unless `show_thinking`: `thinking.display` omitted)."""
    choice = chat["choices"][0]
    text, seq = split_stop(choice["message"].get("content") or "", choice.get("finish_reason"), stops)
    uses = [AnthropicToolUseBlock(**b) for b in tool_use_blocks(choice["message"].get("tool_calls"))]
    blocks: list[AnthropicThinkingBlock | AnthropicTextBlock | AnthropicToolUseBlock] = []
    if reasoning := choice["message"].get("reasoning"):
        blocks.append(AnthropicThinkingBlock(thinking=reasoning if show_thinking else "", signature=signature(reasoning)))
    if text or not uses:
        blocks.append(AnthropicTextBlock(text=text))
    msg = AnthropicMessage(id=message_id(chat["id"]), model=chat["model"], content=blocks + uses,
                           stop_reason=stop_reason(choice.get("finish_reason"), seq, bool(uses)), stop_sequence=seq,
                           usage=AnthropicUsage(**usage_of(chat.get("usage") or {})))
    return msg.model_dump()


def _held_back(text: str, stops: list[str]) -> int:
    """How many characters at the end of `text` may begin (or be) a stop sequence: held back until known."""
    return partial_stop(text, stops, whole=True)


event = named_event  # Anthropic's SSE blocks name their event


class StreamTranslator(ChunkTranslator):
    """OpenAI chat chunks (the `data:` payloads of one choice, with a usage chunk) -> Anthropic's SSE events: the
    answer's text as a text block, each call as a `tool_use` block whose input streams as `input_json_delta`s, blocks
    numbered in order. `input_tokens()` is the prompt's token count for message_start (known once the prompt was
    templated; the final message_delta carries the usage the workers reported)."""

    def __init__(self, stops: list[str], input_tokens: Callable[[], int] = lambda: 0, show_thinking: bool = True):
        self.stops = [s for s in stops if s]
        self.input_tokens = input_tokens
        self.show_thinking = show_thinking
        self.started = self.closed = False
        self.block: str | None = None  # the open block's type (thinking, text, tool_use)
        self.blocks = 0  # blocks opened so far (the next one's index)
        self.held = ""
        self.thought = ""  # the open thinking block's text (its signature is sent when it closes)
        self.called = False  # a tool_use block was opened (stop_reason)
        self.texted = False  # a text block was opened
        self.finish: str | None = None
        self.stop_sequence: str | None = None
        self.usage: dict[str, Any] = {}

    def _start(self, chunk: dict[str, Any]) -> str:
        self.started = True
        message = {"id": message_id(str(chunk.get("id", ""))), "type": "message", "role": "assistant",
                   "model": chunk.get("model", ""), "content": [], "stop_reason": None, "stop_sequence": None,
                   "usage": usage_of({}, self.input_tokens())}
        return event("message_start", {"type": "message_start", "message": message})

    def _open(self, block: dict[str, Any]) -> str:
        out = self._stop_block()
        self.block = block["type"]
        self.blocks += 1
        out += event("content_block_start", {"type": "content_block_start", "index": self.blocks - 1,
                                             "content_block": block})
        return out + event("ping", {"type": "ping"}) if self.blocks == 1 else out  # where Anthropic sends its ping

    def _delta(self, delta: dict[str, Any]) -> str:
        return event("content_block_delta", {"type": "content_block_delta", "index": self.blocks - 1, "delta": delta})

    def _reasoning(self, text: str) -> str:
        out = "" if self.block == "thinking" else self._open({"type": "thinking", "thinking": "", "signature": ""})
        self.thought += text
        return out + (self._delta({"type": "thinking_delta", "thinking": text}) if self.show_thinking else "")

    def _text_delta(self, text: str) -> str:
        return self._delta({"type": "text_delta", "text": text}) if text else ""

    def _text(self, text: str) -> str:
        out = "" if self.block == "text" else self._open({"type": "text", "text": ""})
        self.texted = True
        if not self.stops:
            return out + self._text_delta(text)
        buf = self.held + text
        keep = _held_back(buf, self.stops)
        self.held = buf[len(buf) - keep:]
        return out + self._text_delta(buf[:len(buf) - keep])

    def _tool_call(self, call: dict[str, Any]) -> str:
        out = ""
        fn = call.get("function") or {}
        if call.get("id"):
            out += self._open({"type": "tool_use", "id": tool_use_id(call["id"]), "name": fn.get("name", ""),
                               "input": {}})
            self.called = True
        if fn.get("arguments") and self.block == "tool_use":
            out += self._delta({"type": "input_json_delta", "partial_json": fn["arguments"]})
        return out

    def _stop_block(self) -> str:
        if self.block is None:
            return ""
        out = ""
        if self.block == "text":
            rest, self.stop_sequence = split_stop(self.held, self.finish, self.stops)
            self.held = ""
            out = self._text_delta(rest)
        elif self.block == "thinking":  # Anthropic's thinking block ends with its signature
            out = self._delta({"type": "signature_delta", "signature": signature(self.thought)})
            self.thought = ""
        self.block = None
        return out + event("content_block_stop", {"type": "content_block_stop", "index": self.blocks - 1})

    def chunk(self, chunk: dict[str, Any]) -> str:
        """The SSE text for one chunk of the chat stream ("" when it adds nothing yet)."""
        if "error" in chunk:
            self.closed = True
            err = chunk["error"] or {}
            code = err.get("code")
            status = 503 if code in OVERLOADED_CODES else 504 if code == "timeout" else 500
            return event("error", error_body(status, str(err.get("message") or "generation failed"), code)[1])
        out = "" if self.started else self._start(chunk)
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        return out + self.choices(chunk)

    def _finished(self, reason: str) -> str:
        self.finish = reason
        return self._stop_block()

    def end(self) -> str:
        """message_delta (stop reason, usage) and message_stop, once; an answer without a block gets an empty text
        block, as Anthropic's message always has content."""
        if self.closed:
            return ""
        self.closed = True
        # a text block when the answer has neither text nor a call (as the JSON answer has one, thinking or not)
        out = self._open({"type": "text", "text": ""}) if not (self.texted or self.called) else ""
        out += self._stop_block()
        reason = stop_reason(self.finish, self.stop_sequence, self.called)
        out += event("message_delta", {"type": "message_delta",
                                       "delta": {"stop_reason": reason, "stop_sequence": self.stop_sequence},
                                       "usage": usage_of(self.usage, self.input_tokens())})
        return out + event("message_stop", {"type": "message_stop"})


def translate_stream(chunks: Iterable[str | bytes], stops: list[str],
                     input_tokens: Callable[[], int] = lambda: 0, show_thinking: bool = True) -> Iterator[str]:
    """Anthropic's event stream from the chat path's SSE text (`data: ...` blocks, whatever way they are cut into
    writes). Closing this generator closes `chunks` (the chat stream ends its generation)."""
    t = StreamTranslator(stops, input_tokens, show_thinking)
    return translate(chunks, t)


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
