"""The Semantic Router's decisions (its format since late 2025, flat or under v0.3's `routing:`) as farm categories.

A decision routes requests whose signals match its rule to its `modelRefs`, with plugins such as a system prompt.
The farm routes by one category per request: its classifier's 14 built-in ones and user-defined ones (by
similarity to a description and examples, or by keywords). So what maps is a decision whose rule is one
condition, or an OR of conditions, on domains (the classifier's categories), embedding rules (a user-defined
category whose examples are the rule's candidates) or keyword rules (a category of those keywords). Such a
decision gives each category it names the decision's models as scores, its reasoning mode, its system prompt
and its fast_response (a fixed answer, no model). A decision on the jailbreak or PII signal gives its
fast_response to that guard as its refusal text (the guards themselves block every request on their own). A
rule that combines signals with AND or NOT, or names other signals (fact checks, languages, ...), has no
equivalent and is named as such; so are the plugins the farm has as global settings only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from farm.config.base import ConfigError
from farm.config.vsr.common import VsrImport, items, mapping
from farm.config.vsr.sections import builtin_name, category

MAPPED_CONDITIONS = ("domain", "embedding", "keyword")
GUARD_CONDITIONS = ("jailbreak", "pii")  # a decision on these answers what the guard blocks
ROUTED_BY = ("the farm routes by domains (its classifier's categories), embedding rules and keyword rules "
             "(user-defined categories)")
_ONE_CACHE = "the farm's cache is one setting for every category (semantic.cache)"
_PLUGIN_ELSEWHERE = {
    "semantic-cache": _ONE_CACHE, "semantic_cache": _ONE_CACHE, "response_cache": _ONE_CACHE,
    "pii": "the farm's PII policies are per served model (semantic.pii.policies), not per route",
    "jailbreak": "the farm's jailbreak guard is one setting for every request (semantic.jailbreak)",
}
_PROMPT_MODES = {"replace": "replace", "insert": "prepend", "prepend": "prepend"}


@dataclass
class Routed:
    """What the decisions give the farm: its categories, and the guards' refusal texts (`refusal_jailbreak`,
    `refusal_pii`) from decisions that answer a guard's signal with a fast_response."""

    categories: list[dict[str, Any]]
    refusals: dict[str, str] = field(default_factory=dict)


def routed_categories(domains: Any, domains_key: str, signals: dict[str, tuple[Any, str]], decisions: Any,
                      decisions_key: str, out: VsrImport, rename: dict[str, str]) -> Routed:
    """The farm's categories: one per domain (in their order), then one per embedding or keyword rule a decision
    routes by, each carrying the settings of the highest-priority decision that names it; and the refusals of
    decisions on the guards. `signals`: the rules of each kind ("embedding", "keyword") and where they are."""
    cats: list[dict[str, Any]] = []
    refusals: dict[str, str] = {}
    by_domain: dict[str, dict[str, Any]] = {}
    for i, d in enumerate(items(domains, domains_key)):
        cat = category(d, i, out, rename, key=domains_key)
        vsr_name = str(mapping(d, f"{domains_key}[{i}]")["name"])
        same = next((c for c in cats if c["name"] == cat["name"]), None)
        if same is not None:
            out.skip(f"{domains_key}[{vsr_name}]", f"another domain already is the category {cat['name']!r}")
            by_domain[vsr_name] = same
            continue
        cats.append(cat)
        by_domain[vsr_name] = cat
    rules = {kind: (_named_rules(v, key), key) for kind, (v, key) in signals.items()}
    used_rules: set[tuple[str, str]] = set()
    routed_by: dict[str, str] = {}  # farm category -> the decision that routes it
    listed = [(i, mapping(d, f"{decisions_key}[{i}]")) for i, d in enumerate(items(decisions, decisions_key))]
    for i, d in sorted(listed, key=lambda e: -_priority(e[1], f"{decisions_key}[{e[0]}]")):  # stable: file order
        where = f"{decisions_key}[{d.get('name', i)}]"
        leaves = _leaves(d.get("rules"), f"{where}.rules")
        if leaves is None:
            out.skip(f"{where}.rules", "it combines signals with AND or NOT; the farm routes a request by its one "
                                       "category")
            continue
        kinds = {kind for kind, _ in leaves}
        if kinds <= set(GUARD_CONDITIONS):
            _guard_decision(d, kinds, where, refusals, out, rename)
            continue
        other = sorted(kinds - set(MAPPED_CONDITIONS))
        if other:
            out.skip(f"{where}.rules", f"conditions of type {', '.join(other)}; {ROUTED_BY}")
            continue
        nor = [name for kind, name in leaves if kind == "keyword" and _is_nor(rules["keyword"][0].get(name))]
        if nor:
            out.skip(f"{where}.rules", f"the keyword rule {nor[0]!r} matches prompts without its keywords (NOR); "
                                       "the farm's keyword categories match prompts with them")
            continue
        targets = []
        for kind, name in leaves:
            if kind == "domain":
                targets.append(_domain(name, by_domain, cats, domains_key, where))
            else:
                named, key = rules[kind]
                targets.append(_rule_category(kind, name, named, by_domain, cats, d, key, where, out))
                used_rules.add((kind, name))
        settings = _settings(d, where, out, rename)
        for cat in targets:
            if cat["name"] in routed_by:
                out.skip(where, f"the category {cat['name']!r} is routed by {routed_by[cat['name']]} already "
                                "(a higher priority); the farm has one route per category")
                continue
            if "model_scores" in cat and "model_scores" in settings:
                out.notes.append(f"{where}: its modelRefs replace the model_scores of the domain {cat['name']!r}")
            cat.update(settings)
            if d.get("name"):
                cat["decision"] = str(d["name"])
            routed_by[cat["name"]] = where
    for kind, (named, key) in rules.items():
        for name in named:
            if (kind, name) not in used_rules and name not in by_domain:
                out.skip(f"{key}[{name}]", "no decision routes by it")
    if not cats:
        out.notes.append(f"{decisions_key}: no decision routes by a domain, an embedding rule or a keyword rule: "
                         "the farm keeps its 14 built-in categories")
    return Routed(cats, refusals)


def use_categories(sem: dict[str, Any], routed: Routed) -> None:
    """The translated categories replace the built-in list (as the Semantic Router's list is its whole list);
    with none, the built-in ones stay. The guards' refusals join them."""
    if routed.categories:
        sem.update(builtin_categories=False, categories=routed.categories)
    sem.update(routed.refusals)


def _guard_decision(d: dict[str, Any], kinds: set[str], where: str, refusals: dict[str, str], out: VsrImport,
                    rename: dict[str, str]) -> None:
    """A decision on the jailbreak or PII signal: the farm's guards block on their own (every request, each with
    its threshold or policy), so what carries over is its fast_response as the guard's refusal text (the
    highest-priority decision's, as decisions are visited)."""
    settings = _settings(d, where, out, rename)
    message = settings.pop("fast_response", None)
    if message is None:
        out.skip(f"{where}.rules", "the farm's guards block on their own; a decision on them maps only its "
                                   "fast_response (the guard's refusal)")
        return
    for kind in sorted(kinds):
        refusals.setdefault(f"refusal_{kind}", message)
    if settings:
        out.notes.append(f"{where}: a guard's decision answers with its fast_response; its "
                         f"{', '.join(sorted(settings))} do not apply")


def _priority(d: dict[str, Any], where: str) -> float:
    try:
        return float(d.get("priority", 0) or 0)
    except (TypeError, ValueError):
        raise ConfigError(f"{where}.priority: expected a number, got {d.get('priority')!r}") from None


def _leaves(rule: Any, where: str) -> list[tuple[str, str]] | None:
    """The (type, name) conditions of a rule that is one condition or an OR of them (nested ORs too); None when
    it combines conditions otherwise."""
    rule = mapping(rule, where)
    if "type" in rule:  # a bare condition
        return [_condition(rule, where)]
    conditions = items(rule.get("conditions"), f"{where}.conditions")
    if not conditions:
        raise ConfigError(f"{where}: a rule needs conditions")
    op = str(rule.get("operator", "AND")).upper()
    if op == "NOT" or (op == "AND" and len(conditions) > 1):
        return None
    if op not in ("AND", "OR"):
        raise ConfigError(f"{where}.operator: {rule.get('operator')!r} is not AND, OR or NOT")
    out: list[tuple[str, str]] = []
    for j, c in enumerate(conditions):
        sub = _leaves(c, f"{where}.conditions[{j}]")
        if sub is None:
            return None
        out.extend(sub)
    return out


def _condition(c: dict[str, Any], where: str) -> tuple[str, str]:
    if not c.get("type") or not c.get("name"):
        raise ConfigError(f"{where}: a condition needs `type` and `name`")
    return str(c["type"]), str(c["name"])


def _named_rules(rules: Any, key: str) -> dict[str, tuple[int, dict[str, Any]]]:
    """Signal rules by name (`name`, or `category` in the earliest decision format)."""
    out = {}
    for i, r in enumerate(items(rules, key)):
        r = mapping(r, f"{key}[{i}]")
        name = r.get("name", r.get("category"))
        if not isinstance(name, str) or not name.strip():
            raise ConfigError(f"{key}[{i}]: a rule needs a name")
        out[name] = (i, r)
    return out


def _is_nor(entry: tuple[int, dict[str, Any]] | None) -> bool:
    return entry is not None and str(entry[1].get("operator", "OR")).upper() == "NOR"


def _domain(name: str, by_domain: dict[str, dict[str, Any]], cats: list[dict[str, Any]], key: str,
            where: str) -> dict[str, Any]:
    if name in by_domain:
        return by_domain[name]
    builtin = builtin_name(name)
    if builtin is None:
        raise ConfigError(f"{where}: the condition on domain {name!r} names no domain of {key}")
    cat = next((c for c in cats if c["name"] == builtin), None)
    if cat is None:  # a built-in category the config routes without listing it
        cat = {"name": builtin}
        cats.append(cat)
    by_domain[name] = cat
    return cat


def _rule_category(kind: str, name: str, rules: dict[str, tuple[int, dict[str, Any]]],
                   by_domain: dict[str, dict[str, Any]], cats: list[dict[str, Any]], decision: dict[str, Any],
                   key: str, where: str, out: VsrImport) -> dict[str, Any]:
    """The user-defined category of an embedding rule (its candidates as examples) or of a keyword rule (its
    keywords); a domain of the same name, when there is one, gets them."""
    if name not in rules:
        raise ConfigError(f"{where}: the condition on {kind} {name!r} names no rule of {key}")
    _, rule = rules[name]
    rk = f"{key}[{name}]"
    cat = by_domain.get(name) or next((c for c in cats if c["name"] == name), None)
    if cat is None:
        cat = {"name": name}
        if kind == "embedding":
            cat["description"] = str(decision.get("description") or name.replace("_", " "))
        cats.append(cat)
    field = "examples" if kind == "embedding" else "keywords"
    if field in cat:
        return cat  # a second decision naming the same rule
    (_embedding if kind == "embedding" else _keywords)(rule, cat, rk, out)
    if not cat.get(field):
        raise ConfigError(f"{rk}: a rule needs {'candidates' if kind == 'embedding' else 'keywords'}")
    return cat


def _embedding(rule: dict[str, Any], cat: dict[str, Any], rk: str, out: VsrImport) -> None:
    for k, value in rule.items():
        if k in ("name", "category"):
            continue
        if k in ("candidates", "keywords"):
            cat["examples"] = [str(x) for x in items(value, f"{rk}.{k}")]
        elif k == "threshold":
            out.skip(f"{rk}.{k}", "user-defined categories share one similarity threshold "
                                  "(semantic.classifier.custom_threshold), chosen for the farm's embedder")
        else:
            out.skip(f"{rk}.{k}", "not a setting of the farm's user-defined categories")


def _keywords(rule: dict[str, Any], cat: dict[str, Any], rk: str, out: VsrImport) -> None:
    for k, value in rule.items():
        if k in ("name", "category"):
            continue
        if k == "keywords":
            cat["keywords"] = [str(x) for x in items(value, f"{rk}.{k}")]
        elif k == "operator":
            op = str(value).upper()
            if op not in ("AND", "OR"):
                raise ConfigError(f"{rk}.operator: {value!r} is not AND, OR or NOR")
            cat["keyword_operator"] = "all" if op == "AND" else "any"
        elif k == "case_sensitive":
            cat["case_sensitive"] = bool(value)
        elif k == "method" and value in ("exact", "regex", None):
            continue
        elif k == "method" or k.endswith(("_threshold", "_arity", "_match")):
            out.skip(f"{rk}.{k}", "the farm matches keywords as whole words, not by bm25, n-gram or fuzzy scores")
        else:
            out.skip(f"{rk}.{k}", "not a setting of the farm's keyword categories")


def _settings(d: dict[str, Any], where: str, out: VsrImport, rename: dict[str, str]) -> dict[str, Any]:
    """What a decision gives the categories it routes: model scores, reasoning, system prompt."""
    settings: dict[str, Any] = {}
    for key, value in d.items():
        k = f"{where}.{key}"
        if key in ("name", "description", "priority", "rules"):
            continue
        if key == "modelRefs":
            settings.update(_models(items(value, k), k, out, rename))
        elif key == "plugins":
            for j, p in enumerate(items(value, k)):
                settings.update(_plugin(mapping(p, f"{k}[{j}]"), f"{k}[{j}]", out))
        elif key == "algorithm" and mapping(value, k).get("type", "static") == "static":
            continue
        elif key == "algorithm":
            out.skip(k, "MoM answers with the category's highest-scored live model and falls back down the list")
        else:
            out.skip(k, "not a decision setting of the farm")
    return settings


def _models(refs: list[Any], key: str, out: VsrImport, rename: dict[str, str]) -> dict[str, Any]:
    """modelRefs as model scores: their weights when given, else their order (1.0, 0.9, ...)."""
    if not refs:
        raise ConfigError(f"{key}: a decision needs at least one model")
    weighted = any(isinstance(r, dict) and "weight" in r for r in refs)
    scores: dict[str, float] = {}
    reasoning = None
    for j, r in enumerate(refs):
        r = mapping(r, f"{key}[{j}]")
        if not r.get("model"):
            raise ConfigError(f"{key}[{j}]: needs `model`")
        model = rename.get(str(r["model"]), str(r["model"]))
        try:
            score = float(r.get("weight", 0.0)) if weighted else round(max(1.0 - 0.1 * j, 0.1), 2)
        except (TypeError, ValueError):
            raise ConfigError(f"{key}[{j}].weight: expected a number, got {r.get('weight')!r}") from None
        scores[model] = max(score, scores.get(model, score))  # --map-model may give two refs one farm model
        if j == 0 and "use_reasoning" in r:
            reasoning = bool(r["use_reasoning"])
        elif "use_reasoning" in r and reasoning is not None and bool(r["use_reasoning"]) != reasoning:
            out.notes.append(f"{key}[{j}].use_reasoning: the farm has one reasoning mode per category: the first "
                             f"model's ({'on' if reasoning else 'off'})")
        for extra in sorted(set(r) - {"model", "use_reasoning", "weight"}):
            out.skip(f"{key}[{j}].{extra}", "per-model settings within a route")
    top = max(scores.values())
    if weighted and top > 1:  # scores are 0..1: weights such as 80 / 20 keep their ratio
        scores = {m: round(v / top, 4) for m, v in scores.items()}
    if len(scores) > 1:
        out.notes.append(f"{key}: scores {scores} ({'weights' if weighted else 'by order'}): MoM answers with the "
                         "highest-scored live model and falls back to the next; it does not split traffic")
    return {"model_scores": scores, **({"reasoning": reasoning} if reasoning is not None else {})}


def _plugin(p: dict[str, Any], where: str, out: VsrImport) -> dict[str, Any]:
    kind = str(p.get("type", ""))
    conf = mapping(p.get("configuration"), f"{where}.configuration")
    if kind == "fast_response":  # a fixed answer, no model
        if not str(conf.get("message", "")).strip():
            raise ConfigError(f"{where}.configuration.message: a fast_response needs a message")
        for key in sorted(set(conf) - {"message"}):
            out.skip(f"{where}.configuration.{key}", "not a fast_response setting of the farm")
        return {"fast_response": str(conf["message"])}
    if kind != "system_prompt":
        out.skip(f"{where} ({kind})", _PLUGIN_ELSEWHERE.get(kind, "no plugin of this kind in the farm"))
        return {}
    settings: dict[str, Any] = {}
    for key, value in conf.items():
        k = f"{where}.configuration.{key}"
        if key == "system_prompt":
            settings.setdefault("system_prompt", str(value))
        elif key == "enabled":
            if value is False:
                settings["system_prompt"] = ""
        elif key == "mode":
            if value not in _PROMPT_MODES:
                raise ConfigError(f"{k}: {value!r} is not replace or insert")
            settings["system_prompt_mode"] = _PROMPT_MODES[value]
        else:
            out.skip(k, "not a system prompt setting of the farm")
    return settings
