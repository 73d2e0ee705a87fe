"""A vLLM Semantic Router `config.yaml` (its flat format: `categories` with `model_scores` lists,
`semantic_cache`, `prompt_guard`, `classifier`, `model_config.<m>.pii_policy`, `default_model`) translated
into the farm's settings.

Why a translation and not the Semantic Router's schema itself: the farm runs its own guards, classifier and
workers, so its endpoints, model ids and classifier thresholds mean nothing here; what carries over is the
routing intent (which model answers which category, with or without reasoning, under which system prompt),
the cache's and the guards' switches and the per-model PII policies. Every key that has no equivalent is
named in `VsrImport.unmapped` (never dropped silently); `farm config import-vsr FILE` prints them, and
`load_config` accepts such a file directly as the override file, logging them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from farm.config.base import ConfigError
from farm.config.semantic import MMLU_PRO_CATEGORIES, PII_TYPES, normalize_type

log = logging.getLogger(__name__)

# top-level keys only a Semantic Router config has (the farm's semantic settings live under `semantic:`)
VSR_MARKERS = ("vllm_endpoints", "prompt_guard", "bert_model", "model_config", "semantic_cache",
               "reasoning_families", "default_reasoning_effort", "classifier")
# the Semantic Router's PII labels that the farm's guard reports under another name
PII_RENAMES = {"GPE": "LOCATION", "STREET_ADDRESS": "LOCATION", "DOMAIN_NAME": "URL"}
_NOT_HERE = "the farm runs its own models for this"


@dataclass
class VsrImport:
    """The farm configuration override translated from a Semantic Router config, and what did not carry over."""

    config: dict[str, Any]
    unmapped: list[str] = field(default_factory=list)  # "key: why it has no equivalent", one per key
    notes: list[str] = field(default_factory=list)  # keys that map, but not one to one

    def skip(self, key: str, why: str) -> None:
        self.unmapped.append(f"{key}: no equivalent ({why})")


def looks_like_vsr(data: dict[str, Any]) -> bool:
    """A Semantic Router config rather than a farm one: its own top-level keys, or categories at the top level."""
    if "semantic" in data:
        return False
    return any(k in data for k in VSR_MARKERS) or isinstance(data.get("categories"), list)


def translate_vsr(data: dict[str, Any], model_map: dict[str, str] | None = None) -> VsrImport:
    """Translate; `model_map` renames the Semantic Router's model names to the farm's. Raises ConfigError on a
    malformed value (the key is named); keys without an equivalent are listed, not errors."""
    rename = model_map or {}
    out = VsrImport({})
    sem: dict[str, Any] = {}
    handlers = {
        "categories": lambda v: sem.update(builtin_categories=False, categories=[  # the Router's whole list
            _category(c, i, out, rename) for i, c in enumerate(_list(v, "categories"))]),
        "default_model": lambda v: sem.__setitem__("default_model", rename.get(str(v), str(v))),
        "semantic_cache": lambda v: sem.__setitem__("cache", _cache(_map(v, "semantic_cache"), out)),
        "prompt_guard": lambda v: sem.__setitem__("jailbreak", _guard(_map(v, "prompt_guard"), out)),
        "classifier": lambda v: _classifier(_map(v, "classifier"), sem, out),
        "model_config": lambda v: _models(_map(v, "model_config"), sem, out, rename),
    }
    for key, value in data.items():
        if key in handlers:
            handlers[key](value)
        elif key == "vllm_endpoints":
            out.skip(key, "the farm's models are `models:` entries served by its own workers")
        elif key in ("reasoning_families", "default_reasoning_effort"):
            out.skip(key, "reasoning is the chat template's `enable_thinking`, applied where the model's template "
                          "reads it (x-vsr-reasoning-applied)")
        elif key == "bert_model":
            out.skip(key, "the semantic layer's embedder is all-MiniLM-L6-v2, bundled")
        else:
            out.skip(key, "not a setting of the farm's semantic layer")
    if sem:
        out.config["semantic"] = sem
    return out


def vsr_override(data: dict[str, Any], source: str) -> dict[str, Any]:
    """`load_config`'s hook: a Semantic Router config as the override file, each unmapped key logged."""
    result = translate_vsr(data)
    for line in result.unmapped + result.notes:
        log.warning("%s (Semantic Router config): %s", source, line)
    return result.config


# -- sections -----------------------------------------------------------------------------------------------
def _category(c: Any, i: int, out: VsrImport, rename: dict[str, str]) -> dict[str, Any]:
    c = _map(c, f"categories[{i}]")
    name = c.get("name")
    if not isinstance(name, str) or not name.strip():
        raise ConfigError(f"categories[{i}].name: a category needs a name")
    where = f"categories[{name}]"
    cat: dict[str, Any] = {"name": name}
    builtin = name in MMLU_PRO_CATEGORIES
    reasoning: list[tuple[float, bool]] = []  # (score of the model, its use_reasoning)
    for key, value in c.items():
        k = f"{where}.{key}"
        if key == "name":
            continue
        if key == "description":
            if builtin:
                out.notes.append(f"{k}: not used: the trained head knows {name!r} (a description would add "
                                 "similarity matching to it)")
            else:
                cat["description"] = str(value)
        elif key == "examples":  # the farm's own extension, kept when present
            cat["examples"] = [str(x) for x in _list(value, k)]
        elif key == "system_prompt":
            cat["system_prompt"] = str(value)
        elif key == "system_prompt_enabled":
            if value is False:
                cat["system_prompt"] = ""
        elif key == "system_prompt_mode":
            modes = {"replace": "replace", "insert": "prepend", "prepend": "prepend"}
            if value not in modes:
                raise ConfigError(f"{k}: {value!r} is not replace or insert")
            cat["system_prompt_mode"] = modes[value]
        elif key == "use_reasoning":  # the older per-category form: the category's own, so it wins
            reasoning.append((float("inf"), bool(value)))
        elif key == "model_scores":
            scores: dict[str, float] = {}
            for j, entry in enumerate(_list(value, k)):
                e = _map(entry, f"{k}[{j}]")
                if "model" not in e or "score" not in e:
                    raise ConfigError(f"{k}[{j}]: needs `model` and `score`")
                model = rename.get(str(e["model"]), str(e["model"]))
                scores[model] = float(e["score"])
                if "use_reasoning" in e:
                    reasoning.append((float(e["score"]), bool(e["use_reasoning"])))
                for extra in sorted(set(e) - {"model", "score", "use_reasoning"}):
                    out.skip(f"{k}[{j}].{extra}", "per-model settings within a category")
            cat["model_scores"] = scores
        else:
            out.skip(k, "the farm has no per-category setting of this kind" if key.startswith(
                ("semantic_cache", "jailbreak", "pii")) else "not a category setting of the farm")
    if reasoning:
        cat["reasoning"] = _category_reasoning(reasoning, f"{where}.model_scores[].use_reasoning", out)
    if not builtin and not cat.get("description") and not cat.get("examples"):
        cat["description"] = name.replace("_", " ")
        out.notes.append(f"{where}: not one of the 14 built-in categories and no description: classified by "
                         "similarity to its name alone; add a description and a few `examples`")
    return cat


def _category_reasoning(values: list[tuple[float, bool]], key: str, out: VsrImport) -> bool:
    """The farm has one reasoning mode per category: the best-scored model's `use_reasoning`."""
    chosen = max(values, key=lambda v: v[0])[1]
    if len({flag for _, flag in values}) > 1:
        out.notes.append(f"{key}: differs between models; the farm has one reasoning mode per category: "
                         f"{'on' if chosen else 'off'} (the best-scored model's)")
    return chosen


def _cache(c: dict[str, Any], out: VsrImport) -> dict[str, Any]:
    cache: dict[str, Any] = {}
    direct = {"enabled": "enabled", "similarity_threshold": "similarity_threshold", "ttl_seconds": "ttl_s",
              "max_entries": "max_entries"}
    for key, value in c.items():
        k = f"semantic_cache.{key}"
        if key in direct:
            cache[direct[key]] = value
        elif key == "backend_type":
            if value in ("memory", "redis"):
                cache["backend"] = "redis"
                if value == "memory":
                    out.notes.append(f"{k}: memory -> redis (the farm's cache is shared by every API process)")
            elif value == "milvus":
                cache["backend"] = "milvus"
            else:
                out.skip(k, f"backend {value!r}; the farm has redis and milvus")
        elif key == "eviction_policy" and value == "fifo":
            out.notes.append(f"{k}: fifo is what the farm does (oldest entries evicted first)")
        else:
            out.skip(k, "set under semantic.cache (milvus: semantic.cache.milvus)" if key == "backend_config_path"
                     else "not a cache setting of the farm")
    return cache


def _guard(c: dict[str, Any], out: VsrImport) -> dict[str, Any]:
    guard: dict[str, Any] = {}
    for key, value in c.items():
        k = f"prompt_guard.{key}"
        if key == "enabled":
            guard["enabled"] = bool(value)
        elif key == "threshold":
            out.skip(k, "a threshold of the Semantic Router's model; the farm's heads have their own calibrated "
                        "one (semantic.jailbreak.threshold)")
        else:
            out.skip(k, _NOT_HERE)
    return guard


def _classifier(c: dict[str, Any], sem: dict[str, Any], out: VsrImport) -> None:
    for key, value in c.items():
        if key == "pii_model":
            sem.setdefault("pii", {})["enabled"] = True
            for sub in _map(value, "classifier.pii_model"):
                why = ("a threshold of the Semantic Router's model; the farm's is Presidio's score "
                       "(semantic.pii.threshold)") if sub == "threshold" else _NOT_HERE
                out.skip(f"classifier.pii_model.{sub}", why)
        elif key == "category_model":
            for sub in _map(value, "classifier.category_model"):
                why = ("a threshold of the Semantic Router's model; the farm's head has its own "
                       "(semantic.classifier.threshold)") if sub == "threshold" else _NOT_HERE
                out.skip(f"classifier.category_model.{sub}", why)
        else:
            out.skip(f"classifier.{key}", _NOT_HERE)


def _models(c: dict[str, Any], sem: dict[str, Any], out: VsrImport, rename: dict[str, str]) -> None:
    policies: dict[str, Any] = {}
    for model, settings in c.items():
        name = rename.get(str(model), str(model))
        for key, value in _map(settings, f"model_config.{model}").items():
            k = f"model_config.{model}.{key}"
            if key == "pii_policy":
                policies[name] = _pii_policy(_map(value, k), k, out)
            elif key == "reasoning_family":
                out.skip(k, "the farm applies reasoning through the model's chat template (`enable_thinking`)")
            else:
                out.skip(k, "the farm's per-model settings are its `models:` entries")
    if policies:
        sem.setdefault("pii", {})["policies"] = policies
        out.notes.append("model_config: models without a pii_policy keep the farm's default policy (identity and "
                         "payment data blocked, the rest reported), not the Semantic Router's allow-all")


def _pii_policy(p: dict[str, Any], where: str, out: VsrImport) -> dict[str, Any]:
    allow = bool(p.get("allow_by_default", False))
    types: list[str] = []
    for t in _list(p.get("pii_types_allowed", []), f"{where}.pii_types_allowed"):
        n = normalize_type(str(t))
        n = PII_RENAMES.get(n, n)
        if n in PII_TYPES:
            types.append(n)
        elif n != "NO_PII":
            out.skip(f"{where}.pii_types_allowed[{t}]", "a type the farm's PII guard does not detect (so never blocks)")
    for key in sorted(set(p) - {"allow_by_default", "pii_types_allowed"}):
        out.skip(f"{where}.{key}", "not a PII policy setting of the farm")
    if allow:  # the Semantic Router: allow_by_default lets every type through
        return {"allow_by_default": True, "denied_types": []}
    return {"allow_by_default": False, "allowed_types": sorted(set(types))}


def _map(v: Any, key: str) -> dict[str, Any]:
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise ConfigError(f"{key}: expected a mapping, got {type(v).__name__}")
    return v


def _list(v: Any, key: str) -> list[Any]:
    if v is None:
        return []
    if not isinstance(v, list):
        raise ConfigError(f"{key}: expected a list, got {type(v).__name__}")
    return v
