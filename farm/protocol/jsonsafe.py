"""Parsing JSON from untrusted peers with bounded nesting.

Python's json raises RecursionError (not ValueError) on input nested a few thousand levels deep, and a
document that parses can still be deep enough to blow the stack of code that walks it recursively. Every
reader of untrusted JSON (HTTP bodies, batch lines, KV-transfer headers) goes through `loads_bounded`,
so such input is one precise error instead of an unhandled exception in whatever reads it.
"""

from __future__ import annotations

import json
from collections.abc import Collection
from typing import Any

MAX_JSON_DEPTH = 32  # a client's JSON (a request body, a tool call's arguments) nests about 5 deep; far past it is
# an attack or a bug


class JSONTooDeep(ValueError):
    """The document nests deeper than allowed."""


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def depth_ok(obj: Any, limit: int) -> bool:
    """Whether `obj` nests at most `limit` containers deep (iterative: no recursion on hostile input)."""
    stack = [(obj, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            children = node.values()
        elif isinstance(node, list):
            children = node
        else:
            continue
        if depth > limit:
            return False
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    return True


def loads_bounded(text: str | bytes, max_depth: int) -> Any:
    """Strict JSON (no NaN/Infinity) nesting at most `max_depth` containers deep.

    Raises JSONTooDeep past that depth, ValueError (json.JSONDecodeError, UnicodeDecodeError) for
    anything else that is not valid JSON."""
    try:
        obj = json.loads(text, parse_constant=_reject_constant)
    except RecursionError:
        raise JSONTooDeep(f"nests deeper than {max_depth} levels") from None
    if not depth_ok(obj, max_depth):
        raise JSONTooDeep(f"nests deeper than {max_depth} levels")
    return obj


def one_of(value: Any, choices: Collection[str]) -> bool:
    """Whether a value read from JSON is one of the strings `choices`. A list or an object sent where a name
    belongs is not, and asking a set about it directly would raise TypeError (unhashable): a 500, not a 400."""
    return isinstance(value, str) and value in choices
