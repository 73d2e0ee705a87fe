"""A Semantic Router `config.yaml` in its flat format: its sections at the top level. Until late 2025 the
categories carried `model_scores` and routed by themselves; from then on `decisions` route, and `categories` are
the domains their rules name (farm/config/vsr/decisions.py)."""

from __future__ import annotations

from typing import Any

from farm.config.vsr.common import VsrImport, items, mapping
from farm.config.vsr.decisions import ROUTED_BY, routed_categories, use_categories
from farm.config.vsr.sections import (
    REASONING_ELSEWHERE,
    cache,
    category,
    classifier,
    guard,
    models,
    reads_external,
)


def translate(data: dict[str, Any], sem: dict[str, Any], out: VsrImport, rename: dict[str, str]) -> None:
    """A flat config's keys into `sem` (the farm's `semantic:` section). With `decisions` (the format of late
    2025) its `categories` are the decisions' domains and the routing comes from the decisions."""
    routed = "decisions" in data
    handlers = {
        "default_model": lambda v: sem.__setitem__("default_model", rename.get(str(v), str(v))),
        "semantic_cache": lambda v: sem.__setitem__("cache", cache(mapping(v, "semantic_cache"), out)),
        "prompt_guard": lambda v: sem.__setitem__("jailbreak", guard(
            mapping(v, "prompt_guard"), out, external=items(data.get("external_models"), "external_models"))),
        "classifier": lambda v: classifier(mapping(v, "classifier"), sem, out),
        "model_config": lambda v: models(mapping(v, "model_config"), sem, out, rename),
    }
    if routed:
        use_categories(sem, routed_categories(
            data.get("categories"), "categories", {"embedding": (data.get("embedding_rules"), "embedding_rules"),
                                                   "keyword": (data.get("keyword_rules"), "keyword_rules")},
            data["decisions"], "decisions", out, rename))
    else:
        handlers["categories"] = lambda v: sem.update(builtin_categories=False, categories=[  # the Router's list
            category(c, i, out, rename) for i, c in enumerate(items(v, "categories"))])
    for key, value in data.items():
        if key in handlers:
            handlers[key](value)
        elif routed and key in ("categories", "decisions", "embedding_rules", "keyword_rules"):
            continue
        elif key == "strategy" and value == "priority":
            continue  # what the translation does: the highest-priority decision routes a category
        elif key == "external_models" and reads_external(data.get("prompt_guard")):
            continue  # the remote prompt guard's endpoint, read with prompt_guard
        elif key == "vllm_endpoints":
            out.skip(key, "the farm's models are `models:` entries served by its own workers")
        elif key in ("reasoning_families", "default_reasoning_effort"):
            out.skip(key, REASONING_ELSEWHERE)
        elif key == "bert_model":
            out.skip(key, "the semantic layer's embedder is all-MiniLM-L6-v2, bundled")
        elif key.endswith("_rules"):
            out.skip(key, ROUTED_BY)
        else:
            out.skip(key, "not a setting of the farm's semantic layer")
