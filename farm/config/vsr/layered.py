"""A Semantic Router `config.yaml` of its layered format (`version: v0.3`, since March 2026): `providers` (the
models and the default one), `routing` (signals and the decisions that route by them) and `global` (stores and
the classifier modules). What maps is what the flat formats carry, found at its new place: the default model,
the decisions over domains, embedding and keyword rules (farm/config/vsr/decisions.py), the jailbreak rules' contrastive
examples, the cache store, the prompt guard and the PII classifier's switch. Every other key is named, at most two levels below its layer."""

from __future__ import annotations

from typing import Any

from farm.config.vsr.common import VsrImport, items, mapping
from farm.config.vsr.decisions import ROUTED_BY, routed_categories, use_categories
from farm.config.vsr.sections import REASONING_ELSEWHERE, cache, classifier, guard, reads_external

LAYERS = ("listeners", "providers", "routing", "global")
_MODELS_ELSEWHERE = "the farm's models are `models:` entries served by its own workers"
_SIGNALS_ELSEWHERE = {
    "pii": "the farm's PII guard reads every message of every request; its policies are per served model "
           "(semantic.pii.policies)",
}


def is_layered(data: dict[str, Any]) -> bool:
    """A v0.3 config: a `version` and at least one of its layers, and no farm `semantic:` section."""
    return "semantic" not in data and "version" in data and any(k in data for k in LAYERS)


def translate(data: dict[str, Any], sem: dict[str, Any], out: VsrImport, rename: dict[str, str]) -> None:
    for key, value in data.items():
        if key == "version":
            if not str(value).startswith("v0."):
                out.notes.append(f"version: {value!r} is newer than the v0.3 layout this translation knows")
        elif key == "providers":
            _providers(mapping(value, key), sem, out, rename)
        elif key == "routing":
            _routing(mapping(value, key), sem, out, rename)
        elif key == "global":
            _global(mapping(value, key), sem, out)
        elif key == "listeners":
            out.skip(key, "the farm's API listens on api.host and api.port")
        else:
            out.skip(key, "not a setting of the farm's semantic layer")


def _providers(p: dict[str, Any], sem: dict[str, Any], out: VsrImport, rename: dict[str, str]) -> None:
    for key, value in p.items():
        k = f"providers.{key}"
        if key == "defaults":
            for sub, v in mapping(value, k).items():
                if sub in ("default_model", "model"):
                    sem["default_model"] = rename.get(str(v), str(v))
                elif sub in ("reasoning_families", "default_reasoning_effort", "reasoning_effort"):
                    out.skip(f"{k}.{sub}", REASONING_ELSEWHERE)
                else:
                    out.skip(f"{k}.{sub}", "not a setting of the farm's semantic layer")
        elif key == "models":
            out.skip(k, _MODELS_ELSEWHERE)
        else:
            out.skip(k, "not a setting of the farm's semantic layer")


def _routing(r: dict[str, Any], sem: dict[str, Any], out: VsrImport, rename: dict[str, str]) -> None:
    signals = mapping(r.get("signals"), "routing.signals")
    for kind in signals:
        if kind == "jailbreak":
            _jailbreak_signals(signals[kind], sem, out)
        elif kind not in ("domains", "embeddings", "keywords"):
            out.skip(f"routing.signals.{kind}", _SIGNALS_ELSEWHERE.get(kind, ROUTED_BY))
    if "decisions" in r or "domains" in signals:
        use_categories(sem, routed_categories(
            signals.get("domains"), "routing.signals.domains", {
                "embedding": (signals.get("embeddings"), "routing.signals.embeddings"),
                "keyword": (signals.get("keywords"), "routing.signals.keywords")},
            r.get("decisions"), "routing.decisions", out, rename))
    for key, value in r.items():
        if key in ("signals", "decisions") or (key == "strategy" and value == "priority"):
            continue
        out.skip(f"routing.{key}", "model cards and scoring projections are the Semantic Router's; the farm "
                                   "scores models per category" if key in ("modelCards", "projections")
                 else "not a routing setting of the farm")


def _jailbreak_signals(rules: Any, sem: dict[str, Any], out: VsrImport) -> None:
    """Jailbreak rules: their contrastive examples join the farm's attack and benign patterns (every rule's,
    since the farm's guard is one for every request); the rest is named."""
    key = "routing.signals.jailbreak"
    guard = sem.setdefault("jailbreak", {})
    for i, rule in enumerate(items(rules, key)):
        rule = mapping(rule, f"{key}[{i}]")
        rk = f"{key}[{rule.get('name', i)}]"
        for field, value in rule.items():
            if field in ("jailbreak_patterns", "benign_patterns"):
                target = "patterns" if field == "jailbreak_patterns" else "benign_patterns"
                have = guard.setdefault(target, [])
                texts = dict.fromkeys(str(t) for t in items(value, f"{rk}.{field}") if str(t).strip())
                have.extend(t for t in texts if t not in have)
            elif field == "threshold":
                out.skip(f"{rk}.threshold", "a threshold of the Semantic Router's own models; the farm's are "
                                            "semantic.jailbreak.threshold and pattern_threshold")
            elif field == "method" and value in ("classifier", "contrastive", "hybrid"):
                continue  # the farm always runs its head, and its patterns when there are any
            elif field not in ("name", "description", "include_history"):  # the farm reads every message
                out.skip(f"{rk}.{field}", "not a jailbreak setting of the farm")
        if not rule.get("jailbreak_patterns"):
            out.notes.append(f"{rk}: the farm's jailbreak guard reads every message of every request "
                             "(semantic.jailbreak)")
    if not guard:
        sem.pop("jailbreak")


def _global(g: dict[str, Any], sem: dict[str, Any], out: VsrImport) -> None:
    for key, value in g.items():
        k = f"global.{key}"
        if key == "stores":
            for store, conf in mapping(value, k).items():
                if store in ("semantic_cache", "response_cache"):
                    sem["cache"] = cache(mapping(conf, f"{k}.{store}"), out, where=f"{k}.{store}")
                else:
                    out.skip(f"{k}.{store}", "not a store of the farm's semantic layer")
        elif key == "model_catalog":
            _modules(mapping(value, k), sem, out)
        else:
            out.skip(k, "not a setting of the farm's semantic layer")


def _modules(catalog: dict[str, Any], sem: dict[str, Any], out: VsrImport) -> None:
    external = items(catalog.get("external"), "global.model_catalog.external")  # a remote prompt guard's endpoint
    modules = catalog.get("modules")
    for key, value in catalog.items():
        k = f"global.model_catalog.{key}"
        if key == "external" and isinstance(modules, dict) and reads_external(modules.get("prompt_guard")):
            continue  # read by the prompt guard (sections.remote_guard)
        if key != "modules":
            out.skip(k, "the farm runs its own models (the bundled embedder, classifier and guards)")
            continue
        for module, conf in mapping(value, k).items():
            mk = f"{k}.{module}"
            if module == "prompt_guard":
                sem.setdefault("jailbreak", {}).update(guard(mapping(conf, mk), out, where=mk, external=external))
            elif module == "classifier":
                classifier(mapping(conf, mk), sem, out, where=mk)
            else:
                out.skip(mk, "no module of this kind in the farm's semantic layer")
