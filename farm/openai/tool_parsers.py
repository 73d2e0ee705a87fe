"""Reading tool calls out of a model's text, per model family (`models[].tool_call_parser`, vLLM's
`--tool-call-parser`), and writing them back into a prompt for templates that know nothing of tools.

- `hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks, text before them is content
  (Hermes, Qwen 2.5/3 and other ChatML models; vLLM's `hermes`).
- `llama3_json`: the answer is one JSON object `{"name": ..., "parameters": {...}}` per call, several joined by
  `;`, optionally after `<|python_tag|>` (Llama 3.x; vLLM's `llama3_json`).

A parser works on text alone, so the same one reads both engines' output (the API detokenizes for both).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from farm.protocol.jsonsafe import MAX_JSON_DEPTH, loads_bounded

_DECODER = json.JSONDecoder()
PYTHON_TAG = "<|python_tag|>"  # Llama 3's marker before a call (text only when special tokens are shown)


@dataclass(frozen=True)
class ToolCall:
    """One call the model made: `arguments` is the JSON text of its arguments, as OpenAI sends it."""

    id: str
    name: str
    arguments: str

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _call(obj: Any, args_key: str) -> ToolCall | None:
    """A ToolCall from a parsed `{"name": str, <args_key>: object}`, else None (not a call)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = loads_bounded(args, MAX_JSON_DEPTH)
        except ValueError:  # not JSON, or nested past the bound: not a call
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(call_id(), obj["name"], json.dumps(args, ensure_ascii=False))


class ToolParser:
    """The format of one model family. `extract` reads a whole answer; `start` is what begins a call (a streamed
    answer's text is content until it appears)."""

    name = ""
    start = ""
    starts_anywhere = True  # a call may follow some content (else the answer is either calls or content)

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a whole answer; an answer that is not a well-formed call is all content."""
        raise NotImplementedError

    def instructions(self, tools: list[dict[str, Any]]) -> str:
        """A system prompt telling a model whose chat template ignores `tools` which tools it has and how to call
        them (the format this parser reads)."""
        raise NotImplementedError

    def render_call(self, name: str, arguments: Any) -> str:
        """An earlier call of the conversation as the model would have written it."""
        raise NotImplementedError

    def render_result(self, content: str) -> str:
        """A tool's result as the model expects to read it."""
        return content


class HermesParser(ToolParser):
    name = "hermes"
    start = "<tool_call>"
    _block = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        if self.start not in text:
            return text, []
        calls = []
        for body in self._block.findall(text):
            try:
                call = _call(loads_bounded(body, MAX_JSON_DEPTH), "arguments")
            except ValueError:
                call = None
            if call is None:
                return text, []  # one unreadable block: the answer stays text, as vLLM returns it
            calls.append(call)
        content = text[:text.index(self.start)].strip()
        return (content or None), calls

    def instructions(self, tools: list[dict[str, Any]]) -> str:
        listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        return ("You are a function calling AI model. You are provided with function signatures within <tools></tools> "
                "XML tags. You may call one or more functions to assist with the user query. Don't make assumptions "
                f"about what values to plug into functions.\n<tools>\n{listed}\n</tools>\nFor each function call, "
                "return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n"
                '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')

    def render_call(self, name: str, arguments: Any) -> str:
        return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments}, ensure_ascii=False)}\n</tool_call>"

    def render_result(self, content: str) -> str:
        return f"<tool_response>\n{content}\n</tool_response>"


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    start = "{"
    starts_anywhere = False

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        rest = text.strip()
        if rest.startswith(PYTHON_TAG):
            rest = rest[len(PYTHON_TAG):].lstrip()
        if not rest.startswith("{"):
            return text, []
        calls = []
        while rest:
            try:
                obj, end = _DECODER.raw_decode(rest)
            except (ValueError, RecursionError):  # not JSON, or a model's text nesting past Python's stack
                return text, []
            call = _call(obj, "parameters")
            if call is None:
                return text, []
            calls.append(call)
            rest = rest[end:].strip()
            if rest.startswith(";"):
                rest = rest[1:].strip()
            elif rest:
                return text, []
        return None, calls

    def instructions(self, tools: list[dict[str, Any]]) -> str:
        listed = "\n\n".join(json.dumps(t, indent=4, ensure_ascii=False) for t in tools)
        return ("Given the following functions, please respond with a JSON for a function call with its proper "
                "arguments that best answers the given prompt.\n\nRespond in the format {\"name\": function name, "
                "\"parameters\": dictionary of argument name and its value}. Do not use variables.\n\n" + listed)

    def render_call(self, name: str, arguments: Any) -> str:
        return json.dumps({"name": name, "parameters": arguments}, ensure_ascii=False)


PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (HermesParser, Llama3JsonParser)}


def get_parser(name: str | None) -> ToolParser:
    """The parser of that name; `hermes` for None (the format a template without tools is taught)."""
    return PARSERS[name or "hermes"]()
