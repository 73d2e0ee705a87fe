"""Structured output's constraints, checked when a request arrives: a JSON schema, regex or grammar the engines'
grammar compiler (llguidance in the built-in engine; vLLM's own) cannot take is the client's 400, not a worker's
error later."""

from __future__ import annotations

from typing import Any

from farm.infra.cooperative import offload
from farm.openai.api_error import bad_request
from farm.protocol.constraints import grammar_error


def check_schema(schema: dict[str, Any], param: str) -> None:
    """A 400 naming `param` when the JSON schema `schema` cannot become a grammar."""
    check_constraint({"type": "json_schema", "json_schema": {"schema": schema}}, param, "a JSON schema")


def check_constraint(fmt: dict[str, Any], param: str, what: str) -> None:
    """A 400 naming `param` when the constraint `fmt` (farm.protocol.request.CONSTRAINTS), `what` to the client,
    cannot become a grammar. The compiler runs off the API's gevent hub (it lets go of the GIL): a request's
    megabytes of tool schemas took seconds in which no other request moved."""
    error = offload(grammar_error, fmt)
    if error:
        raise bad_request(f"'{param}' holds {what} structured output cannot use: {error[:300]}", param,
                          "invalid_value")
