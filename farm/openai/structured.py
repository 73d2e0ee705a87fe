"""Structured output's constraints, checked when a request arrives: a JSON schema, regex or grammar the engines'
grammar compiler (llguidance in the built-in engine; vLLM's own) cannot take is the client's 400, not a worker's
error later.

The compiler runs in a sandbox (farm.infra.sandbox): a grammar that crashes it (a chain of a few thousand rules
overflows its native stack) or keeps it busy (its GBNF converter is quadratic Python) costs that request a 400,
never the API process and the streams it serves. Verdicts are kept by the constraint's digest: agents send the same
tool schemas with every turn."""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from typing import Any

from farm.infra.sandbox import Sandbox, SandboxCrash, SandboxTimeout
from farm.openai.api_error import bad_request

COMPILE_TIMEOUT_S = 2.0  # a real schema or grammar compiles in milliseconds
_VERDICTS_KEPT = 1024
_SANDBOX = Sandbox("farm.protocol.constraints:grammar_error", COMPILE_TIMEOUT_S)
_verdicts: OrderedDict[str, str] = OrderedDict()  # digest -> "" (compiles) or what is wrong
_verdicts_lock = threading.Lock()


def check_schema(schema: dict[str, Any], param: str) -> None:
    """A 400 naming `param` when the JSON schema `schema` cannot become a grammar."""
    check_constraint({"type": "json_schema", "json_schema": {"schema": schema}}, param, "a JSON schema")


def check_constraint(fmt: dict[str, Any], param: str, what: str) -> None:
    """A 400 naming `param` when the constraint `fmt` (farm.protocol.request.CONSTRAINTS), `what` to the client,
    cannot become a grammar, crashes the compiler or takes it past COMPILE_TIMEOUT_S."""
    error = grammar_verdict(fmt)
    if error:
        raise bad_request(f"'{param}' holds {what} structured output cannot use: {error[:300]}", param,
                          "invalid_value")


def grammar_verdict(fmt: dict[str, Any]) -> str:
    """What is wrong with `fmt` as a grammar ("" when nothing), from the sandbox or the verdicts kept."""
    digest = hashlib.sha256(json.dumps(fmt, sort_keys=True).encode()).hexdigest()
    with _verdicts_lock:
        if digest in _verdicts:
            _verdicts.move_to_end(digest)
            return _verdicts[digest]
    try:
        error = str(_SANDBOX.call(fmt))
    except SandboxTimeout:
        error = f"it takes the grammar compiler longer than {COMPILE_TIMEOUT_S:g} s"
    except SandboxCrash:
        error = "the grammar compiler fails on it (too deep: a chain of rules or references too long)"
    except RuntimeError as e:
        error = str(e)
    with _verdicts_lock:
        _verdicts[digest] = error
        while len(_verdicts) > _VERDICTS_KEPT:
            _verdicts.popitem(last=False)
    return error
