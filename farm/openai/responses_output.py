"""The answer side of OpenAI's Responses API on the chat path (the request side is farm/openai/responses_api.py):
the chat answer, JSON or its SSE chunks, as the response object or the Responses event stream (response.created,
response.in_progress, response.output_item.added, response.content_part.added, response.output_text.delta ...,
response.output_text.done, response.content_part.done, response.output_item.done, and
response.completed | response.incomplete | response.failed; a chat tool call streams as a function_call item with
response.function_call_arguments.delta / .done, a reasoning model's thought as a reasoning item with
response.reasoning_text.delta / .done, as vLLM streams it), every event with its `sequence_number`; and the
response models of `/openapi.json`."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel

from farm.openai.chat_stream import ChunkTranslator, named_event, translate
from farm.openai.responses_api import ItemStatus, ResponsesRequest, new_id
from farm.openai.schemas import _Loose


# -- responses -----------------------------------------------------------------------------------
class ResponseOutputText(_Loose):
    type: Literal["output_text"]
    text: str
    annotations: list[Any]


class ResponseOutputMessage(_Loose):
    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    status: ItemStatus
    content: list[ResponseOutputText]


class ResponseFunctionCall(_Loose):
    id: str
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    status: ItemStatus


class ResponseReasoningText(_Loose):
    type: Literal["reasoning_text"]
    text: str


class ResponseReasoningItem(_Loose):
    id: str
    type: Literal["reasoning"]
    summary: list[Any]
    content: list[ResponseReasoningText]
    status: ItemStatus


class ResponseUsage(_Loose):
    input_tokens: int
    input_tokens_details: dict[str, int]
    output_tokens: int
    output_tokens_details: dict[str, int]
    total_tokens: int


class ResponseObject(_Loose):
    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    error: dict[str, Any] | None
    incomplete_details: dict[str, Any] | None
    model: str
    output: list[ResponseReasoningItem | ResponseOutputMessage | ResponseFunctionCall]
    usage: ResponseUsage | None
    previous_response_id: str | None
    store: bool


class ResponseDeleted(_Loose):
    id: str
    object: Literal["response"]
    deleted: bool


class ResponseInputItemList(_Loose):
    object: Literal["list"]
    data: list[dict[str, Any]]
    first_id: str | None
    last_id: str | None
    has_more: bool


RESPONSE_MODELS: tuple[type[BaseModel], ...] = (ResponseObject, ResponseDeleted, ResponseInputItemList)


# -- chat answer -> response -----------------------------------------------------------------------
@dataclass
class Turn:
    """What one chat answer said, whichever way it came (JSON or SSE chunks)."""

    text: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    finish_reason: str | None = None
    usage: dict[str, Any] = field(default_factory=dict)
    reasoning: str = ""  # a reasoning model's thought (not carried into a later response's prompt)

    def chat_message(self) -> dict[str, Any]:
        """The answer as the assistant message a later response's conversation holds."""
        msg: dict[str, Any] = {"role": "assistant", "content": self.text if self.text or not self.tool_calls
                               else None}
        if self.tool_calls:
            msg["tool_calls"] = self.tool_calls
        return msg


@dataclass
class ResponseContext:
    """One response's own fields: its id and time, and what the request asked, echoed in the object."""

    req: ResponsesRequest
    id: str = field(default_factory=lambda: new_id("resp"))
    created_at: int = field(default_factory=lambda: int(time.time()))

    def response(self, model: str, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None = None,
                 incomplete: dict[str, Any] | None = None, error: dict[str, Any] | None = None) -> dict[str, Any]:
        """The response object in OpenAI's shape."""
        req = self.req
        fmt = (req.text.format.model_dump(by_alias=True, exclude_none=True) if req.text and req.text.format
               else {"type": "text"})
        obj: dict[str, Any] = {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status,
            "background": False, "error": error, "incomplete_details": incomplete,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens, "model": model,
            "output": output, "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id,
            "reasoning": {"effort": req.reasoning.effort if req.reasoning else None,
                          "summary": req.reasoning.summary if req.reasoning else None},
            "store": req.store is not False, "temperature": req.temperature, "text": {"format": fmt},
            "tool_choice": (req.tool_choice.model_dump() if isinstance(req.tool_choice, BaseModel)
                            else req.tool_choice or "auto"),
            "tools": [t.model_dump(exclude_none=True) for t in req.tools or ()], "top_p": req.top_p,
            "truncation": req.truncation or "disabled", "usage": usage, "user": req.user, "metadata": req.metadata or {},
        }
        if status == "completed":
            obj["completed_at"] = int(time.time())
        return obj


def usage(chat_usage: dict[str, Any]) -> dict[str, Any]:
    """The Responses API's usage from the chat path's."""
    prompt, completion = int(chat_usage.get("prompt_tokens", 0)), int(chat_usage.get("completion_tokens", 0))
    cached = int((chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0))
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached}, "output_tokens": completion,
            "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": prompt + completion}


def outcome(finish_reason: str | None) -> tuple[str, dict[str, str] | None]:
    """(status, incomplete_details) of a response whose answer ended with `finish_reason`."""
    if finish_reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    if finish_reason == "content_filter":
        return "incomplete", {"reason": "content_filter"}
    return "completed", None


def _part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    """An output message; `text` None: not begun (the item as `response.output_item.added` announces it)."""
    return {"id": item_id, "type": "message", "status": status, "role": "assistant",
            "content": [] if text is None else [_part(text)]}


def reasoning_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    """A reasoning model's thought as a reasoning item (its raw text as `reasoning_text` content, as vLLM gives it;
    no summary); `text` None: not begun."""
    return {"id": item_id, "type": "reasoning", "summary": [], "status": status,
            "content": [] if text is None else [{"type": "reasoning_text", "text": text}]}


def function_call_item(item_id: str, call: dict[str, Any], status: str) -> dict[str, Any]:
    """An output function call from a chat tool call (`{id, type, function: {name, arguments}}`)."""
    fn = call.get("function") or {}
    return {"id": item_id, "type": "function_call", "status": status, "call_id": call.get("id") or "",
            "name": fn.get("name") or "", "arguments": fn.get("arguments") or ""}


def from_chat_completion(chat: dict[str, Any], ctx: ResponseContext) -> tuple[dict[str, Any], Turn]:
    """The response object from a non-streamed `chat.completion` (one choice), and the answer as a Turn."""
    choice = chat["choices"][0]
    message = choice.get("message") or {}
    turn = Turn(message.get("content") or "", list(message.get("tool_calls") or ()), choice.get("finish_reason"),
                chat.get("usage") or {}, message.get("reasoning") or "")
    status, incomplete = outcome(turn.finish_reason)
    item_status = "incomplete" if status == "incomplete" else "completed"
    output = [reasoning_item(new_id("rs"), turn.reasoning, "completed")] if turn.reasoning else []
    output += [message_item(new_id("msg"), turn.text, item_status)] if turn.text or not turn.tool_calls else []
    output += [function_call_item(new_id("fc"), call, "completed") for call in turn.tool_calls]
    return ctx.response(chat.get("model") or ctx.req.model, status, output, usage(turn.usage), incomplete), turn


class StreamTranslator(ChunkTranslator):
    """OpenAI chat chunks (the `data:` payloads of one choice, with a usage chunk) -> the Responses API's SSE
    events. `on_final(response, turn)` sees the final response object before its last event is sent (the route
    stores it)."""

    def __init__(self, ctx: ResponseContext, on_final: Callable[[dict[str, Any], Turn], None]):
        self.ctx, self.on_final = ctx, on_final
        self.model = ctx.req.model
        self.seq = 0
        self.started = self.closed = False
        self.turn = Turn()
        self.output: list[dict[str, Any]] = []  # items done
        self.item: dict[str, Any] | None = None  # the item being streamed: a message or a function call
        self.item_text = ""  # its text (a message's)
        self.call: dict[str, Any] | None = None  # its chat tool call (a function call's)
        self.call_index: int | None = None

    def _event(self, kind: str, **data: Any) -> str:
        out = named_event(kind, {"type": kind, **data, "sequence_number": self.seq})
        self.seq += 1
        return out

    def _start(self) -> str:
        self.started = True
        head = self.ctx.response(self.model, "in_progress", [])
        return self._event("response.created", response=head) + self._event("response.in_progress", response=head)

    def _where(self) -> dict[str, Any]:
        assert self.item is not None
        return {"item_id": self.item["id"], "output_index": len(self.output)}

    def _open(self, item: dict[str, Any]) -> str:
        self.item = item
        return self._event("response.output_item.added", output_index=len(self.output), item=item)

    def _open_message(self) -> str:
        out = self._close("completed") + self._open(message_item(new_id("msg"), None, "in_progress"))
        self.item_text = ""
        return out + self._event("response.content_part.added", **self._where(), content_index=0, part=_part(""))

    def _text(self, delta: str) -> str:
        out = "" if self.item is not None and self.item["type"] == "message" else self._open_message()
        self.item_text += delta
        self.turn.text += delta
        return out + self._event("response.output_text.delta", **self._where(), content_index=0, delta=delta,
                                 logprobs=[])

    def _reasoning(self, delta: str) -> str:
        out = ""
        if self.item is None or self.item["type"] != "reasoning":
            out = self._close("completed") + self._open(reasoning_item(new_id("rs"), None, "in_progress"))
            self.item_text = ""
        self.item_text += delta
        self.turn.reasoning += delta
        return out + self._event("response.reasoning_text.delta", **self._where(), content_index=0, delta=delta)

    def _tool_call(self, delta: dict[str, Any]) -> str:
        """A piece of a chat tool call: its first (id, name) opens a function call item, arguments stream."""
        index = delta.get("index", 0)
        fn = delta.get("function") or {}
        out = ""
        if self.item is None or self.item["type"] != "function_call" or self.call_index != index:
            out += self._close("completed")
            self.call = {"id": delta.get("id") or new_id("call"), "type": "function",
                         "function": {"name": fn.get("name") or "", "arguments": ""}}
            self.call_index = index
            self.turn.tool_calls.append(self.call)
            out += self._open(function_call_item(new_id("fc"), self.call, "in_progress"))
        assert self.call is not None
        if args := fn.get("arguments") or "":
            self.call["function"]["arguments"] += args
            out += self._event("response.function_call_arguments.delta", **self._where(), delta=args)
        return out

    def _close(self, status: str) -> str:
        """The done events of the item being streamed, if any."""
        if self.item is None:
            return ""
        where = self._where()
        if self.item["type"] == "message":
            done = message_item(self.item["id"], self.item_text, status)
            out = (self._event("response.output_text.done", **where, content_index=0, text=self.item_text,
                               logprobs=[])
                   + self._event("response.content_part.done", **where, content_index=0, part=_part(self.item_text)))
        elif self.item["type"] == "reasoning":  # its thought is whole: completed, whatever ends the answer
            done = reasoning_item(self.item["id"], self.item_text, "completed")
            out = self._event("response.reasoning_text.done", **where, content_index=0, text=self.item_text)
        else:
            assert self.call is not None
            done = function_call_item(self.item["id"], self.call, status)
            out = self._event("response.function_call_arguments.done", **where, arguments=done["arguments"])
        out += self._event("response.output_item.done", output_index=where["output_index"], item=done)
        self.output.append(done)
        self.item = self.call = self.call_index = None
        return out

    def chunk(self, chunk: dict[str, Any]) -> str:
        """The SSE text for one chunk of the chat stream ("" when it adds nothing yet)."""
        self.model = chunk.get("model") or self.model
        out = "" if self.started else self._start()
        if "error" in chunk:
            err = chunk["error"] or {}
            return out + self._finish({"code": err.get("code") or "server_error",
                                       "message": str(err.get("message") or "generation failed")})
        if chunk.get("usage"):
            self.turn.usage = chunk["usage"]
        return out + self.choices(chunk)

    def _finished(self, reason: str) -> str:
        self.turn.finish_reason = reason
        return ""

    def end(self) -> str:
        """The last item's done events and the final response event, once."""
        if self.closed:
            return ""
        return ("" if self.started else self._start()) + self._finish()

    def _finish(self, error: dict[str, Any] | None = None) -> str:
        self.closed = True
        status, incomplete = ("failed", None) if error else outcome(self.turn.finish_reason)
        item_status = "completed" if status == "completed" else "incomplete"
        out = ""
        if not error and not self.turn.text and not self.turn.tool_calls:  # no answer: an empty message, as JSON has
            out += self._open_message() if self.item is None or self.item["type"] != "message" else ""
        out += self._close(item_status)
        final = self.ctx.response(self.model, status, self.output, usage(self.turn.usage) if not error else None,
                                  incomplete, error)
        self.on_final(final, self.turn)
        return out + self._event(f"response.{status}", response=final)


def translate_stream(chunks: Iterable[str | bytes], ctx: ResponseContext,
                     on_final: Callable[[dict[str, Any], Turn], None]) -> Iterator[str]:
    """The Responses event stream from the chat path's SSE text. Closing it closes `chunks` (the chat stream ends
    its generation)."""
    t = StreamTranslator(ctx, on_final)
    return translate(chunks, t)
