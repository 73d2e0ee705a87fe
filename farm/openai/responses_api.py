"""OpenAI's Responses API (`POST /v1/responses`) translated onto the chat-completions path, both ways, without a
web framework, as farm/openai/anthropic.py does for Anthropic's Messages API: the request models (the accepted
fields and `/openapi.json`), a Responses body plus the conversation its `previous_response_id` continues -> the
chat body the farm's own chat path validates, templates and generates, and the chat answer (JSON, or its SSE
chunks) -> the response object (JSON, or the Responses event stream: response.created, response.in_progress,
response.output_item.added, response.content_part.added, response.output_text.delta ..., response.output_text.done,
response.content_part.done, response.output_item.done, response.completed | response.incomplete | response.failed,
each with its `sequence_number`).

Input items: messages (user, assistant, system, developer; a string or input_text / output_text parts),
`function_call` and `function_call_output` (an assistant message's `tool_calls` and a `tool` message on the chat
path); images, files, reasoning items, item references and built-in tools are a 400. Function tools in the
Responses' flat shape become chat's nested ones; `text.format` becomes `response_format`. `reasoning` is accepted
and not applied (the semantic layer picks a category's reasoning mode); `instructions` are the first (system)
message of this response only, not carried over by `previous_response_id`, as OpenAI does.
"""

from __future__ import annotations

import operator
import uuid
from functools import reduce
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    Discriminator,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    StringConstraints,
    Tag,
)

from farm.openai.api_error import APIError, bad_request
from farm.openai.chat_stream import streamed_with_usage
from farm.openai.response_store import MAX_ID_CHARS
from farm.openai.schemas import ServingHints, _Request, reject_unknown_fields
from farm.openai.validation import validated
from farm.protocol import MAX_TEMPERATURE

MEMBERS = ("Responses",)  # the prefix of this protocol's model names: union members left out of error locations
ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")
PART_TYPES = ("input_text", "output_text")
# a chat-path error's param under the name this API gives it
PARAMS = {"max_tokens": "max_output_tokens", "messages": "input", "response_format": "text.format"}
ItemStatus = Literal["in_progress", "completed", "incomplete"]


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _one_of(members: dict[str, type[BaseModel]], default: str | None = None) -> Any:
    """The union of `members` told apart by their `type` (the key; `default` when absent), each tagged with its
    class name so that error locations leave it out (MEMBERS)."""
    tags = {kind: model.__name__ for kind, model in members.items()}

    def pick(v: Any) -> str | None:
        kind = v.get("type", default) if isinstance(v, dict) else getattr(v, "type", None)
        return tags.get(kind) if isinstance(kind, str) else None

    union = reduce(operator.or_, (Annotated[model, Tag(model.__name__)] for model in members.values()))
    return Annotated[union, Discriminator(pick)]


# -- requests ------------------------------------------------------------------------------------
class ResponsesInputText(_Request):
    type: Literal["input_text"]
    text: StrictStr


class ResponsesOutputText(_Request):
    """An earlier answer's text, passed back."""

    type: Literal["output_text"]
    text: StrictStr
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


ResponsesContentPart = _one_of({"input_text": ResponsesInputText, "output_text": ResponsesOutputText})


class ResponsesInputMessage(_Request):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"] = Field(description="developer is sent as system")
    content: StrictStr | list[ResponsesContentPart] = Field(description="a string, or input_text / output_text parts")
    id: StrictStr | None = Field(None, max_length=MAX_ID_CHARS)
    status: ItemStatus | None = None


class ResponsesFunctionCall(_Request):
    """A function call of an earlier answer (an assistant message's tool call on the chat path)."""

    type: Literal["function_call"]
    call_id: StrictStr = Field(max_length=MAX_ID_CHARS)
    name: StrictStr
    arguments: StrictStr
    id: StrictStr | None = Field(None, max_length=MAX_ID_CHARS)
    status: ItemStatus | None = None


class ResponsesFunctionCallOutput(_Request):
    """The result of a function call (a `tool` message on the chat path)."""

    type: Literal["function_call_output"]
    call_id: StrictStr = Field(max_length=MAX_ID_CHARS)
    output: StrictStr | list[ResponsesInputText]
    id: StrictStr | None = Field(None, max_length=MAX_ID_CHARS)
    status: ItemStatus | None = None


class ResponsesReasoningText(_Request):
    type: Literal["reasoning_text"]
    text: StrictStr


class ResponsesReasoningItem(_Request):
    """An earlier answer's reasoning, passed back as it came (the agents SDKs send it with the answer): kept among
    the input items, not put in the prompt again (reasoning templates leave earlier turns' reasoning out)."""

    type: Literal["reasoning"]
    id: StrictStr | None = Field(None, max_length=MAX_ID_CHARS)
    summary: list[dict[str, Any]] = Field(default_factory=list)
    content: list[ResponsesReasoningText] | None = None
    encrypted_content: StrictStr | None = None
    status: ItemStatus | None = None


ResponsesInputItem = _one_of({"message": ResponsesInputMessage, "function_call": ResponsesFunctionCall,
                              "function_call_output": ResponsesFunctionCallOutput,
                              "reasoning": ResponsesReasoningItem}, default="message")


class ResponsesFunctionTool(_Request):
    type: Literal["function"]
    name: StrictStr = Field(min_length=1, max_length=64)
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class ResponsesToolChoiceFunction(_Request):
    type: Literal["function"]
    name: StrictStr


class ResponsesFormatText(_Request):
    type: Literal["text"]


class ResponsesFormatJsonObject(_Request):
    type: Literal["json_object"]


class ResponsesFormatJsonSchema(_Request):
    type: Literal["json_schema"]
    name: StrictStr = Field(min_length=1, max_length=64)
    json_schema: dict[str, Any] = Field(alias="schema")
    description: StrictStr | None = None
    strict: StrictBool | None = None


ResponsesFormat = _one_of({"text": ResponsesFormatText, "json_object": ResponsesFormatJsonObject,
                           "json_schema": ResponsesFormatJsonSchema})


class ResponsesTextConfig(_Request):
    format: ResponsesFormat | None = Field(None, description=(
        "text, json_object or json_schema (chat's response_format: models with backend vllm)"))
    verbosity: Literal["low", "medium", "high"] | None = Field(None, description="accepted and ignored")


class ResponsesReasoning(_Request):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None


MetadataKey = Annotated[str, StringConstraints(max_length=64)]
MetadataValue = Annotated[StrictStr, StringConstraints(max_length=512)]


class ResponsesRequest(ServingHints):
    """POST /v1/responses (text and function tools)."""

    model: StrictStr = Field(description="a configured model (GET /v1/models)")
    input: StrictStr | list[ResponsesInputItem] | None = Field(None, description=(
        "a user message as a string, or items: messages, function_call, function_call_output"))
    instructions: StrictStr | None = Field(None, description="a first system message (not carried over)")
    previous_response_id: StrictStr | None = Field(None, max_length=MAX_ID_CHARS, description=(
        "continue a stored response of the same API key: its conversation, then this input"))
    max_output_tokens: StrictInt | None = Field(None, ge=1, description="prompt + this must fit max_model_len")
    temperature: StrictFloat | None = Field(None, ge=0, le=MAX_TEMPERATURE)
    top_p: StrictFloat | None = Field(None, gt=0, le=1)
    stream: StrictBool | None = None
    store: StrictBool | None = Field(None, description="keep the response for GET and previous_response_id "
                                                       "(default true; api.responses_ttl_s)")
    metadata: dict[MetadataKey, MetadataValue] | None = Field(None, max_length=16)
    user: StrictStr | None = Field(None, max_length=256)
    text: ResponsesTextConfig | None = None
    tools: list[ResponsesFunctionTool] | None = Field(None, description="function tools only")
    tool_choice: Literal["none", "auto", "required"] | ResponsesToolChoiceFunction | None = None
    parallel_tool_calls: StrictBool | None = None
    reasoning: ResponsesReasoning | None = Field(None, description="accepted and not applied")
    truncation: Literal["disabled", "auto"] | None = Field(None, description=(
        "disabled (the default): a prompt too long is a 400; auto: its earliest tokens are dropped to fit the "
        "context, as vLLM does (the chat path's truncate_prompt_tokens -1)"))
    background: StrictBool | None = Field(None, description="not supported: only false")
    include: list[StrictStr] | None = Field(None, description="not supported: only empty")
    stream_options: dict[str, Any] | None = Field(None, description="accepted and ignored")


REQUEST_MODELS: tuple[type[BaseModel], ...] = (ResponsesRequest,)


# -- request -> chat body --------------------------------------------------------------------------
def _refuse_unsupported(body: dict[str, Any]) -> None:
    """A clear 400 for the items, parts, tools and modes of OpenAI's API the farm does not serve."""
    if body.get("background") is True:
        raise bad_request("'background' is not supported by this server: a response is answered in its request",
                          "background", "unsupported_parameter")
    if body.get("include") not in (None, []):
        raise bad_request("'include' is not supported by this server", "include", "unsupported_parameter")
    items = body.get("input")
    for i, item in enumerate(items if isinstance(items, list) else ()):
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if isinstance(kind, str) and kind not in ITEM_TYPES:
            raise bad_request(f"input[{i}]: '{kind}' items are not supported; this server takes "
                              f"{', '.join(ITEM_TYPES)} items", f"input[{i}].type", "unsupported_value")
        parts = item.get("content") if isinstance(item, dict) and kind != "reasoning" else None
        for j, part in enumerate(parts if isinstance(parts, list) else ()):
            ptype = part.get("type") if isinstance(part, dict) else None
            if isinstance(ptype, str) and ptype not in PART_TYPES:
                raise bad_request(f"input[{i}].content[{j}]: '{ptype}' content is not supported (text only)",
                                  f"input[{i}].content[{j}].type", "unsupported_value")
    tools = body.get("tools")
    for i, tool in enumerate(tools if isinstance(tools, list) else ()):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if isinstance(kind, str) and kind != "function":
            raise bad_request(f"tools[{i}]: '{kind}' tools are not supported (function tools only)",
                              f"tools[{i}].type", "unsupported_value")


def parse_request(body: Any) -> ResponsesRequest:
    """The body as a ResponsesRequest, or a 400 naming the first problem (an unknown field, an item or tool
    this server does not serve, a value out of range)."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    reject_unknown_fields(body, ResponsesRequest)
    _refuse_unsupported(body)
    return validated(ResponsesRequest, body, MEMBERS)


def _text(content: str | list[Any]) -> str:
    return content if isinstance(content, str) else "".join(p.text for p in content)


def input_messages(req: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's input as chat messages: function calls join the assistant message before them (or one of
    their own) as its `tool_calls`; their outputs are `tool` messages."""
    if req.input is None:
        return []
    if isinstance(req.input, str):
        return [{"role": "user", "content": req.input}]
    out: list[dict[str, Any]] = []
    for item in req.input:
        if isinstance(item, ResponsesReasoningItem):
            continue
        if isinstance(item, ResponsesInputMessage):
            out.append({"role": item.role, "content": _text(item.content)})
        elif isinstance(item, ResponsesFunctionCall):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            if not (out and out[-1]["role"] == "assistant"):
                out.append({"role": "assistant", "content": None})
            out[-1].setdefault("tool_calls", []).append(call)
        else:
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": _text(item.output)})
    return out


def input_items(req: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's input as the items `GET /v1/responses/{id}/input_items` lists, each with an id."""
    if req.input is None:
        return []
    if isinstance(req.input, str):
        return [{"id": new_id("msg"), "type": "message", "role": "user", "status": "completed",
                 "content": [{"type": "input_text", "text": req.input}]}]
    out = []
    for item in req.input:
        if isinstance(item, ResponsesInputMessage):
            kind = "output_text" if item.role == "assistant" else "input_text"
            # an earlier answer's annotations and log-probabilities are not read: not stored either
            content = ([{"type": kind, "text": item.content}] if isinstance(item.content, str)
                       else [p.model_dump(exclude_none=True, exclude={"annotations", "logprobs"}) for p in item.content])
            out.append({"id": item.id or new_id("msg"), "type": "message", "role": item.role,
                        "status": item.status or "completed", "content": content})
        else:
            prefix = {ResponsesFunctionCall: "fc", ResponsesReasoningItem: "rs"}.get(type(item), "fco")
            out.append({**item.model_dump(exclude_none=True), "id": item.id or new_id(prefix),
                        "status": item.status or "completed"})
    return out


def _response_format(text: ResponsesTextConfig | None) -> dict[str, Any] | None:
    fmt = text.format if text is not None else None
    if isinstance(fmt, ResponsesFormatJsonObject):
        return {"type": "json_object"}
    if isinstance(fmt, ResponsesFormatJsonSchema):
        spec: dict[str, Any] = {"name": fmt.name, "schema": fmt.json_schema}
        if fmt.strict is not None:
            spec["strict"] = fmt.strict
        return {"type": "json_schema", "json_schema": spec}
    return None


def chat_tool(tool: ResponsesFunctionTool) -> dict[str, Any]:
    """A Responses function tool (flat) as a chat tool (`{type: function, function: {...}}`)."""
    return {"type": "function", "function": tool.model_dump(exclude_none=True, exclude={"type"})}


def chat_tool_choice(choice: str | ResponsesToolChoiceFunction) -> str | dict[str, Any]:
    if isinstance(choice, str):
        return choice
    return {"type": "function", "function": {"name": choice.name}}


def to_chat_body(req: ResponsesRequest, history: list[dict[str, Any]]) -> dict[str, Any]:
    """The chat-completions body the farm's chat path serves for `req` after the stored conversation
    `history` (of its previous response): the instructions as the first message, the history, the input;
    OpenAI's chat names for the sampling fields; a stream reports usage."""
    messages = [{"role": "system", "content": req.instructions}] if req.instructions else []
    messages += history + input_messages(req)
    if not messages:
        raise bad_request("'input' is required", "input", "missing_required_parameter")
    body: dict[str, Any] = {"model": req.model, "messages": messages}
    if req.max_output_tokens is not None:
        body["max_tokens"] = req.max_output_tokens
    if req.truncation == "auto":
        body["truncate_prompt_tokens"] = -1
    for name in ("temperature", "top_p", "user"):
        if (value := getattr(req, name)) is not None:
            body[name] = value
    if (fmt := _response_format(req.text)) is not None:
        body["response_format"] = fmt
    if req.tools:
        body["tools"] = [chat_tool(t) for t in req.tools]
        if req.tool_choice is not None:
            body["tool_choice"] = chat_tool_choice(req.tool_choice)
        if req.parallel_tool_calls is False:  # chat's default is true as well: sent only when it differs
            body["parallel_tool_calls"] = False
    elif req.tool_choice is not None:  # the chat path refuses it without tools (a 400), as OpenAI does: never ignored
        body["tool_choice"] = chat_tool_choice(req.tool_choice)
    if req.stream:
        body.update(streamed_with_usage())
    return body


def renamed(err: APIError) -> APIError:
    """A chat-path error naming this API's parameter (`max_output_tokens` for `max_tokens`, `input` for
    `messages[...]`)."""
    base = (err.param or "").split(".", 1)[0].split("[", 1)[0]
    if base in PARAMS:
        err.param = PARAMS[base]
    return err
