"""Reading a JSON request body strictly: valid UTF-8, strict JSON (no NaN/Infinity), bounded nesting.

Each failure is its own precise 400 instead of a 500 (json's C parser raises RecursionError on very
deep input) or a silently accepted oddity. Size is bounded before this by MAX_CONTENT_LENGTH (413).
"""

from __future__ import annotations

import json
from typing import Any

from flask import request

from api.errors import bad_request

MAX_JSON_DEPTH = 32  # an OpenAI request nests about 5 deep; anything far past that is an attack or a bug


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _depth_ok(obj: Any, limit: int) -> bool:
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


def parse_json(data: bytes) -> Any:
    """`data` as strict JSON, or a 400 saying exactly what is wrong with it."""
    if not data.strip():
        raise bad_request("the request body must be a JSON object", code="invalid_json")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise bad_request(f"the request body is not valid UTF-8 (byte {e.start})", code="invalid_encoding") from None
    too_deep = False
    obj: Any = None
    try:
        obj = json.loads(text, parse_constant=_reject_constant)
    except RecursionError:
        too_deep = True
    except ValueError as e:
        raise bad_request(f"the request body is not valid JSON: {e}", code="invalid_json") from None
    if too_deep or not _depth_ok(obj, MAX_JSON_DEPTH):
        raise bad_request(f"the request body nests deeper than {MAX_JSON_DEPTH} levels", code="json_too_deep")
    return obj


def json_body() -> Any:
    """This request's body as strict JSON; 413 past the app's or blueprint's content length limit."""
    return parse_json(request.get_data(cache=True))
