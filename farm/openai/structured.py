"""Structured output's JSON schemas, checked when a request arrives: a schema the engines' grammar compiler
(llguidance in the built-in engine; vLLM's own) cannot take is the client's 400, not a worker's error later."""

from __future__ import annotations

from typing import Any

from farm.infra.cooperative import offload
from farm.openai.api_error import bad_request


def check_schema(schema: dict[str, Any], param: str) -> None:
    """A 400 naming `param` when `schema` cannot become a grammar. The compiler runs off the API's gevent hub (it
    lets go of the GIL): a request's megabytes of tool schemas took seconds in which no other request moved."""
    error = offload(_grammar_error, schema)
    if error:
        raise bad_request(f"'{param}' holds a JSON schema structured output cannot use: {error[:300]}", param,
                          "invalid_value")


def _grammar_error(schema: dict[str, Any]) -> str:
    """What the grammar compiler finds wrong with `schema` ("" when nothing)."""
    import llguidance

    try:
        return llguidance.LLMatcher.validate_grammar(
            llguidance.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False}))
    except (ValueError, TypeError) as e:
        return str(e)
