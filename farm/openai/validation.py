"""A request body checked against the pydantic model of a protocol the farm translates onto its chat path
(Anthropic's Messages API, OpenAI's Responses API): the first problem as a 400 naming where it is."""

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


def first_problem(e: ValidationError, member_prefixes: tuple[str, ...]) -> APIError:
    """The 400 for a failed validation: in a union, the member that got furthest."""
    first = max(e.errors(), key=lambda err: len(err["loc"]))
    where = location(tuple(first["loc"]), member_prefixes)
    return bad_request(f"{where}: {first['msg']}" if where else first["msg"], where or None)


def validated(model: type[M], body: dict[str, Any], member_prefixes: tuple[str, ...]) -> M:
    """`body` as `model`, or the 400 of its first problem."""
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise first_problem(e, member_prefixes) from None
