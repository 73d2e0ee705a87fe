"""Tool calling on the chat route, as vLLM serves it: `tools` reach the model's chat template, and the answer's text
becomes `tool_calls`.

- `tool_choice: "auto"` (the default with tools): the model decides; the model's parser
  (`models[].tool_call_parser`, farm.openai.tool_parsers) reads calls out of its text. Without a parser, `auto` is
  refused as vLLM refuses it without `--tool-call-parser`.
- `"required"` and a named function: structured output forces the answer (a JSON list of `{name, parameters}`, or
  the named function's arguments), as vLLM does, so they work on every model and both engines.
- `"none"`: plain text.

A template that never reads `tools` (SmolLM2's, many small models') is given them as a system prompt in the parser's
format, and earlier calls and results are written into the conversation as that format has them.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from farm.models.tokenization import template_reads
from farm.openai.api_error import bad_request
from farm.openai.structured import check_schema
from farm.openai.tool_parsers import PARSERS, ToolCall, ToolParser, call_id, get_parser
from farm.protocol.jsonsafe import MAX_JSON_DEPTH, loads_bounded

MAX_TOOLS = 128
_DECODER = json.JSONDecoder()
FUNCTION_NAME = re.compile(r"[A-Za-z0-9_.:-]{1,64}")
CHOICES = ("none", "auto", "required")


@dataclass(frozen=True)
class ToolRequest:
    """A request's checked tools: `choice` is none, auto, required or function (`function` names it)."""

    tools: list[dict[str, Any]]
    choice: str
    function: str | None = None
    parallel: bool = True
    parser: str | None = None

    @property
    def active(self) -> bool:
        """Whether the answer may hold calls (tool_choice other than none)."""
        return self.choice != "none" and bool(self.tools)

    def _parameters(self, name: str) -> dict[str, Any]:
        fn = next(t["function"] for t in self.tools if t["function"]["name"] == name)
        return fn.get("parameters") or {"type": "object", "properties": {}}

    def response_format(self) -> dict[str, Any] | None:
        """The structured output that forces a `required` or named answer (None for auto and none)."""
        if self.choice == "function":
            return {"type": "json_schema", "json_schema": {"name": self.function, "schema":
                                                           self._parameters(str(self.function))}}
        if self.choice != "required":
            return None
        items = [{"type": "object", "properties": {"name": {"type": "string", "enum": [t["function"]["name"]]},
                                                   "parameters": self._parameters(t["function"]["name"])},
                  "required": ["name", "parameters"], "additionalProperties": False} for t in self.tools]
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
        if not self.parallel:
            schema["maxItems"] = 1
        return {"type": "json_schema", "json_schema": {"name": "tool_calls", "schema": schema}}

    def read(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a whole answer."""
        if not self.active:
            return text, []
        if self.choice == "function":
            return None, [ToolCall(call_id(), str(self.function), text)]
        if self.choice == "required":  # forced JSON: never content, even with no call complete (cut by max_tokens),
            calls = _required_calls(text)  # as vLLM answers it; the raw JSON as text misled agents into a final answer
            content, calls = (None, calls) if calls else ("", [])
        else:
            content, calls = get_parser(self.parser).extract(text)
        return content, calls if self.parallel else calls[:1]

    def finish_reason(self, engine_reason: str | None, calls: list[ToolCall]) -> str | None:
        """vLLM's: tool_calls when the model chose to call (auto, required); a named call ends as the engine says."""
        return "tool_calls" if calls and self.choice in ("auto", "required") else engine_reason

    def to_dict(self) -> dict[str, Any]:
        return {"tools": self.tools, "choice": self.choice, "function": self.function, "parallel": self.parallel,
                "parser": self.parser}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ToolRequest:
        return cls(list(d["tools"]), str(d["choice"]), d.get("function"), bool(d.get("parallel", True)),
                   d.get("parser"))


def _required_calls(text: str) -> list[ToolCall]:
    """The calls of a forced answer (a JSON list of {name, parameters}); of an answer cut short (max_tokens), the
    calls it completed."""
    rest = text.strip()
    if not rest.startswith("["):
        return []
    rest = rest[1:]
    calls = []
    while True:
        rest = rest.lstrip().removeprefix(",").lstrip()
        try:
            item, end = _DECODER.raw_decode(rest)
        except (ValueError, RecursionError):  # not JSON, or nesting past Python's stack
            return calls
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return calls
        calls.append(ToolCall(call_id(), item["name"], json.dumps(item.get("parameters", {}), ensure_ascii=False)))
        rest = rest[end:]


# -- the request ----------------------------------------------------------------------------------------------------
def _check_tool(i: int, tool: Any) -> dict[str, Any]:
    param = f"tools[{i}]"
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
        raise bad_request(f"'{param}' must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}", "tools")
    fn = tool["function"]
    name = fn.get("name")
    if not isinstance(name, str) or FUNCTION_NAME.fullmatch(name) is None:
        raise bad_request(f"'{param}.function.name' must be 1-64 letters, digits, '_', '-', '.' or ':'", "tools")
    if fn.get("description") is not None and not isinstance(fn["description"], str):
        raise bad_request(f"'{param}.function.description' must be a string", "tools")
    params = fn.get("parameters")
    if params is not None:
        if not isinstance(params, dict):
            raise bad_request(f"'{param}.function.parameters' must be a JSON schema object", "tools")
        check_schema(params, "tools")
    return {"type": "function", "function": {k: fn[k] for k in ("name", "description", "parameters", "strict")
                                             if fn.get(k) is not None}}


def check_tools(tools: Any) -> list[dict[str, Any]]:
    """A request's `tools`, checked (a 400 naming `tools`), in the shape templates read."""
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise bad_request(f"'tools' must be a list of at most {MAX_TOOLS} tools", "tools")
    checked = [_check_tool(i, t) for i, t in enumerate(tools)]
    names = [t["function"]["name"] for t in checked]
    if len(set(names)) != len(names):
        raise bad_request("'tools' names a function twice", "tools", "invalid_value")
    return checked


def parse_tools(body: dict[str, Any], parser: str | None, model: str = "") -> ToolRequest | None:
    """The body's `tools`, `tool_choice` and `parallel_tool_calls`, checked as OpenAI and vLLM check them; None when
    the request has no tools. `parser` is the model's tool-call parser (auto needs one)."""
    tools = body.get("tools")
    choice = body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise bad_request("'parallel_tool_calls' must be a boolean", "parallel_tool_calls")
    if tools in (None, []):
        if choice not in (None, "none"):
            raise bad_request("'tool_choice' is only allowed when 'tools' are specified", "tool_choice")
        return None
    checked = check_tools(tools)
    names = [t["function"]["name"] for t in checked]
    function = None
    if choice is None:
        choice = "auto"
    elif isinstance(choice, dict):
        fn = choice.get("function")
        function = fn.get("name") if choice.get("type") == "function" and isinstance(fn, dict) else None
        if not isinstance(function, str):
            raise bad_request("'tool_choice' must be none, auto, required or {\"type\": \"function\", \"function\": "
                              "{\"name\": ...}}", "tool_choice")
        if function not in names:
            raise bad_request(f"'tool_choice' names function {function!r}, which is not in 'tools'", "tool_choice",
                              "invalid_value")
        choice = "function"
    elif choice not in CHOICES:
        raise bad_request("'tool_choice' must be none, auto, required or {\"type\": \"function\", \"function\": "
                          "{\"name\": ...}}", "tool_choice")
    if choice == "auto" and parser not in PARSERS:
        raise bad_request(f"tool_choice 'auto' needs a tool call parser for model {model!r} (models[].tool_call_parser,"
                          " as vLLM needs --enable-auto-tool-choice --tool-call-parser); 'required' or a named "
                          "function work without one", "tool_choice", "unsupported_value")
    if choice in ("required", "function") and body.get("response_format") not in (None, {"type": "text"}):
        raise bad_request("'response_format' cannot be combined with tool_choice 'required' or a named function",
                          "response_format", "invalid_value")
    if choice in ("required", "function") and body.get("structured_outputs") is not None:
        raise bad_request("'structured_outputs' cannot be combined with tool_choice 'required' or a named function",
                          "structured_outputs", "invalid_value")
    return ToolRequest(checked, str(choice), function, parallel is not False, parser)


# -- the prompt -----------------------------------------------------------------------------------------------------
def template_inputs(messages: list[dict[str, Any]], tools: ToolRequest | None, tokenizer: Any, parser: str | None
                    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(messages, tools) for the chat template. A conversation without tools or calls goes as it is (the common
    case: nothing copied, the template not searched). A template that reads `tools` gets them with earlier calls'
    arguments as objects (as vLLM hands them over); any other template gets a conversation in the parser's own
    text format, and the tools as a system prompt while the model may call them."""
    if tools is None and not any(m.get("tool_calls") or m["role"] == "tool" for m in messages):
        return messages, None
    if template_reads(tokenizer, "tools"):
        out = []
        for m in messages:
            if m.get("tool_calls"):
                m = {**m, "content": m.get("content") or "", "tool_calls": [
                    {**c, "function": {**c["function"], "arguments": _arguments(c["function"]["arguments"])}}
                    for c in m["tool_calls"]]}
            out.append(m)
        return out, (tools.tools if tools is not None else None)
    fmt: ToolParser = get_parser(parser)
    out = []
    for m in messages:
        if m.get("tool_calls"):
            calls = "\n".join(fmt.render_call(c["function"]["name"], _arguments(c["function"]["arguments"]))
                              for c in m["tool_calls"])
            out.append({"role": m["role"], "content": f"{m['content']}\n{calls}" if m.get("content") else calls})
        elif m["role"] == "tool":
            out.append({"role": "tool", "content": fmt.render_result(m["content"])})
        else:
            out.append({"role": m["role"], "content": m["content"]})
    if tools is not None and tools.active:
        text = fmt.instructions(tools.tools)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{text}" if out[0]["content"] else text}
        else:
            out.insert(0, {"role": "system", "content": text})
    return out, None


def _arguments(text: str) -> Any:
    """An earlier call's arguments as an object when they are JSON (templates print them), else as sent (also
    when they nest past MAX_JSON_DEPTH: the body's own depth bound does not reach JSON inside a string, and a
    client's 4 kB of brackets raised RecursionError, a 500)."""
    try:
        return loads_bounded(text, MAX_JSON_DEPTH)
    except ValueError:
        return text
