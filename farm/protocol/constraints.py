"""What a task's `response_format` constrains the answer to, as a grammar the engines' grammar library takes.

One translation for every side that reads the contract: the API compiles it once to refuse a bad constraint as the
client's 400, and the built-in engine masks every step's logits with it. OpenAI's JSON formats and vLLM's
`structured_outputs` kinds (regex, choice, grammar) all become llguidance grammars, as vLLM's `guidance` backend
builds them (llguidance.grammar_from); vLLM workers get the constraint itself (farm.backends.vllm_args).
"""

from __future__ import annotations

import functools
import json
from typing import Any


def grammar_of(response_format: dict[str, Any]) -> str:
    """The grammar of a checked `response_format` (farm.protocol.request.CONSTRAINTS). JSON is compact: unbounded
    whitespace lets a small model loop on blanks until max_tokens. Kept for the formats seen last: every choice
    of a request, and every turn of an agent's forced tools, asks again, and GBNF's translation is Python."""
    return _grammar(json.dumps(response_format, sort_keys=True))


@functools.lru_cache(maxsize=256)
def _grammar(key: str) -> str:
    import llguidance  # a Rust wheel: loaded where a constraint is first compiled, not by every importer

    response_format = json.loads(key)
    kind = response_format["type"]
    if kind in ("json_object", "json_schema"):
        schema = {"type": "object"} if kind == "json_object" else response_format["json_schema"]["schema"]
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
    return llguidance.grammar_from(kind, response_format[kind])


def grammar_error(response_format: dict[str, Any]) -> str:
    """What the grammar library finds wrong with the constraint ("" when nothing)."""
    import llguidance

    try:
        return llguidance.LLMatcher.validate_grammar(grammar_of(response_format))
    except (ValueError, TypeError, KeyError) as e:
        return str(e)
