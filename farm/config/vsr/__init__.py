"""A vLLM Semantic Router `config.yaml` translated into the farm's settings, in each of its formats: the flat one
(`categories` with `model_scores` lists, `semantic_cache`, `prompt_guard`, `classifier`,
`model_config.<m>.pii_policy`, `default_model`), the same with `decisions` (late 2025), and the layered v0.3
(`providers`, `routing.signals` and `routing.decisions`, `global`).

Why a translation and not the Semantic Router's schema itself: the farm runs its own guards, classifier and
workers, so its endpoints, model ids and classifier thresholds mean nothing here; what carries over is the
routing intent (which model answers which category, with or without reasoning, under which system prompt),
the cache's and the guards' switches and the per-model PII policies. Every key that has no equivalent is
named in `VsrImport.unmapped` (never dropped silently); `farm config import-vsr FILE` prints them, and
`load_config` accepts such a file directly as the override file, logging them.
"""

from __future__ import annotations

import logging
from typing import Any

from farm.config.vsr import flat, layered
from farm.config.vsr.common import VsrImport

log = logging.getLogger(__name__)

__all__ = ["VsrImport", "looks_like_vsr", "translate_vsr", "vsr_override"]

# top-level keys only a flat Semantic Router config has (the farm's semantic settings live under `semantic:`)
VSR_MARKERS = ("vllm_endpoints", "prompt_guard", "bert_model", "model_config", "semantic_cache",
               "reasoning_families", "default_reasoning_effort", "classifier", "decisions", "keyword_rules",
               "embedding_rules")


def looks_like_vsr(data: dict[str, Any]) -> bool:
    """A Semantic Router config rather than a farm one: its own top-level keys, categories at the top level, or
    the v0.3 layers."""
    if "semantic" in data:
        return False
    return (any(k in data for k in VSR_MARKERS) or isinstance(data.get("categories"), list)
            or layered.is_layered(data))


def translate_vsr(data: dict[str, Any], model_map: dict[str, str] | None = None) -> VsrImport:
    """Translate; `model_map` renames the Semantic Router's model names to the farm's. Raises ConfigError on a
    malformed value (the key is named); keys without an equivalent are listed, not errors."""
    out = VsrImport({})
    sem: dict[str, Any] = {}
    (layered if layered.is_layered(data) else flat).translate(data, sem, out, model_map or {})
    if sem:
        out.config["semantic"] = sem
    return out


def vsr_override(data: dict[str, Any], source: str) -> dict[str, Any]:
    """`load_config`'s hook: a Semantic Router config as the override file, each unmapped key logged."""
    result = translate_vsr(data)
    for line in result.unmapped + result.notes:
        log.warning("%s (Semantic Router config): %s", source, line)
    return result.config
