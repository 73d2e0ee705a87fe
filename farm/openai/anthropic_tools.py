"""Tool use in Anthropic's Messages API, translated to and from the chat path's tool calling (farm.openai.tools):
`tools` (name, description, input_schema) -> function tools; `tool_choice` auto / any / tool / none -> auto /
required / a named function / none (`disable_parallel_tool_use` -> `parallel_tool_calls: false`); an assistant's
`tool_use` blocks -> its `tool_calls`; a user's `tool_result` blocks -> `tool` messages (before the user's text);
and the answer's calls -> `tool_use` blocks (`stop_reason` "tool_use")."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import Field, StrictBool, StrictStr, model_validator

from farm.openai.api_error import bad_request
from farm.openai.schemas import _Request
from farm.protocol.jsonsafe import MAX_JSON_DEPTH, loads_bounded

CHOICES = {"auto": "auto", "any": "required", "none": "none"}


class AnthropicTextBlockParam(_Request):
    type: Literal["text"]
    text: StrictStr
    cache_control: dict[str, Any] | None = Field(None, description=(
        "accepted and ignored: the farm's prefix cache needs no breakpoints"))
    citations: list[dict[str, Any]] | None = Field(None, description=(
        "accepted and ignored (an earlier answer's citations, sent back with it)"))


class AnthropicThinkingBlockParam(_Request):
    """An assistant's earlier reasoning, sent back as it came: not put in the prompt again (reasoning templates
    leave earlier turns' reasoning out; vLLM's Qwen3 and DeepSeek-R1 templates do)."""

    type: Literal["thinking"]
    thinking: StrictStr
    signature: StrictStr
    cache_control: dict[str, Any] | None = None


class AnthropicRedactedThinkingBlockParam(_Request):
    type: Literal["redacted_thinking"]
    data: StrictStr


class AnthropicToolUseBlockParam(_Request):
    """An assistant's earlier call."""

    type: Literal["tool_use"]
    id: StrictStr
    name: StrictStr
    input: dict[str, Any]
    cache_control: dict[str, Any] | None = None


class AnthropicToolResultBlockParam(_Request):
    """A tool's result, in a user message."""

    type: Literal["tool_result"]
    tool_use_id: StrictStr
    content: StrictStr | list[AnthropicTextBlockParam] | None = None
    is_error: StrictBool | None = None
    cache_control: dict[str, Any] | None = None


class AnthropicToolParam(_Request):
    name: StrictStr = Field(pattern=r"^[A-Za-z0-9_.:-]{1,64}$")
    description: StrictStr | None = None
    input_schema: dict[str, Any] = Field(description="a JSON schema of the tool's input")
    type: Literal["custom"] | None = None
    cache_control: dict[str, Any] | None = None
    strict: StrictBool | None = Field(None, description="the chat path's function `strict`")


class AnthropicToolChoice(_Request):
    type: Literal["auto", "any", "tool", "none"]
    name: StrictStr | None = Field(None, description="with type tool: the tool to call")
    disable_parallel_tool_use: StrictBool | None = None

    @model_validator(mode="after")
    def _named(self) -> AnthropicToolChoice:
        if self.type == "tool" and not self.name:
            raise ValueError("type 'tool' needs the tool's 'name'")
        return self


Block = (AnthropicTextBlockParam | AnthropicToolUseBlockParam | AnthropicToolResultBlockParam
         | AnthropicThinkingBlockParam | AnthropicRedactedThinkingBlockParam)
_ASSISTANTS = (AnthropicToolUseBlockParam, AnthropicThinkingBlockParam, AnthropicRedactedThinkingBlockParam)
TEXT_JOIN = "\n"  # between a message's text blocks, as vLLM joins them (Anthropic keeps them apart)


def join_text(blocks: list[AnthropicTextBlockParam] | str | None) -> str:
    if blocks is None:
        return ""
    return blocks if isinstance(blocks, str) else TEXT_JOIN.join(b.text for b in blocks)


def check_blocks(i: int, role: str, content: str | list[Block]) -> None:
    """A 400 for a call or reasoning in a user message, or a tool's result in an assistant's."""
    for b in content if isinstance(content, list) else ():
        if isinstance(b, AnthropicToolResultBlockParam) and role == "assistant" or \
                isinstance(b, _ASSISTANTS) and role == "user":
            where = "user" if b.type == "tool_result" else "assistant"
            raise bad_request(f"messages[{i}]: '{b.type}' blocks belong in {where} messages", f"messages[{i}].content")


def chat_messages(i: int, role: str, content: str | list[Block]) -> list[dict[str, Any]]:
    """One Anthropic message as chat messages: a user's tool results first (a `tool` message each), then its text; an
    assistant's text with its calls."""
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    check_blocks(i, role, content)
    text = join_text([b for b in content if isinstance(b, AnthropicTextBlockParam)])
    uses = [b for b in content if isinstance(b, AnthropicToolUseBlockParam)]
    results = [b for b in content if isinstance(b, AnthropicToolResultBlockParam)]
    if role == "assistant":
        msg: dict[str, Any] = {"role": "assistant", "content": text}
        if uses:
            msg["tool_calls"] = [{"id": u.id, "type": "function", "function": {
                "name": u.name, "arguments": json.dumps(u.input, ensure_ascii=False)}} for u in uses]
        return [msg]
    out: list[dict[str, Any]] = [{"role": "tool", "tool_call_id": r.tool_use_id,
                                  "content": ("Error: " if r.is_error else "") + join_text(r.content)} for r in results]
    if text or not results:
        out.append({"role": "user", "content": text})
    return out


def chat_tool_fields(tools: list[AnthropicToolParam] | None, choice: AnthropicToolChoice | None) -> dict[str, Any]:
    """The chat body's `tools`, `tool_choice` and `parallel_tool_calls` for Anthropic's."""
    out: dict[str, Any] = {}
    if tools:
        out["tools"] = [{"type": "function", "function": {k: v for k, v in (
            ("name", t.name), ("description", t.description), ("parameters", t.input_schema), ("strict", t.strict))
            if v is not None}} for t in tools]
    if choice is not None:
        if choice.type == "tool":
            out["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
        else:
            out["tool_choice"] = CHOICES[choice.type]
        if choice.disable_parallel_tool_use and tools:
            out["parallel_tool_calls"] = False
    return out


def tool_use_blocks(tool_calls: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """The chat answer's calls as `tool_use` blocks (their arguments as the `input` object)."""
    return [{"type": "tool_use", "id": tool_use_id(c["id"]), "name": c["function"]["name"],
             "input": _input(c["function"]["arguments"])} for c in tool_calls or ()]


def tool_use_id(call_id: str) -> str:
    """A chat call's id as Anthropic writes a tool_use block's (`toolu_...`); the client sends it back in its
    tool_result, and the conversation keeps it as sent."""
    return "toolu_" + call_id.removeprefix("call_")


def _input(arguments: str) -> Any:
    try:
        value = loads_bounded(arguments, MAX_JSON_DEPTH)
    except ValueError:  # not JSON, or nested past the bound (RecursionError is a JSONTooDeep here)
        return {}
    return value if isinstance(value, dict) else {}
