"""A request body checked against its pydantic model (the utility endpoints', the classification API's, and
those of the protocols the farm translates onto its chat path: Anthropic's Messages API, OpenAI's Responses API):
the first problem as a 400 naming where it is."""

from __future__ import annotations

from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from farm.openai.api_error import APIError, bad_request

M = TypeVar("M", bound=BaseModel)
_SCALARS = frozenset({"str", "int", "float", "bool"})


def location(loc: tuple[Any, ...], member_prefixes: tuple[str, ...]) -> str:
    """`messages[0].content[1].text` from pydantic's location, without the names of union members (scalar types,
    `list[...]`, and the protocol's models, whose class names start with one of `member_prefixes`)."""
    out = ""
    for part in loc:
        if isinstance(part, str) and (part in _SCALARS or "[" in part or part.startswith(member_prefixes)):
            continue
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


# what a client's SDK branches on: an unknown field, a missing one, else a value it may not have
_CODES = {"extra_forbidden": "unknown_parameter", "missing": "missing_required_parameter"}


def first_problem(e: ValidationError, member_prefixes: tuple[str, ...] = ()) -> APIError:
    """The 400 for a failed validation: in a union, the member that got furthest; its code says what kind."""
    first = max(e.errors(include_url=False, include_input=False), key=lambda err: len(err["loc"]))
    where = location(tuple(first["loc"]), member_prefixes)
    return bad_request(f"{where}: {first['msg']}" if where else first["msg"], where or None,
                       _CODES.get(first["type"], "invalid_value"))


def validated(model: type[M], body: Any, member_prefixes: tuple[str, ...] = ()) -> M:
    """`body` (a JSON object) as `model`, or the 400 of its first problem. Every request model of the API is
    checked here, so a problem is named alike on every route (`messages[0].content[1].text`)."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise first_problem(e, member_prefixes) from None
