"""The sections of a Semantic Router `config.yaml` that map, one translation each: a category (with `model_scores`
lists), `semantic_cache`, `prompt_guard`, `classifier`, `model_config.<m>.pii_policy`. Every format uses them:
the flat one (farm/config/vsr/flat.py), its decisions (decisions.py) and v0.3's layers (layered.py)."""

from __future__ import annotations

from typing import Any

from farm.config.base import ConfigError
from farm.config.semantic import MMLU_PRO_CATEGORIES, PII_TYPES, normalize_type
from farm.config.vsr.common import NOT_HERE, VsrImport, items, mapping

# the Semantic Router's PII labels that the farm's guard reports under another name
PII_RENAMES = {"GPE": "LOCATION", "STREET_ADDRESS": "LOCATION", "DOMAIN_NAME": "URL"}
REASONING_ELSEWHERE = ("reasoning is the chat template's `enable_thinking`, applied where the model's template reads "
                       "it (x-vsr-reasoning-applied)")


def category(c: Any, i: int, out: VsrImport, rename: dict[str, str], key: str = "categories") -> dict[str, Any]:
    """One category (`key`: where the list is, for messages: `categories`, or `routing.signals.domains` in v0.3)."""
    c = mapping(c, f"{key}[{i}]")
    name = c.get("name")
    if not isinstance(name, str) or not name.strip():
        raise ConfigError(f"{key}[{i}].name: a category needs a name")
    where = f"{key}[{name}]"
    name = farm_category_name(name, items(c.get("mmlu_categories"), f"{where}.mmlu_categories"), where, out)
    cat: dict[str, Any] = {"name": name}
    builtin = name in MMLU_PRO_CATEGORIES
    reasoning: list[tuple[float, bool]] = []  # (score of the model, its use_reasoning)
    for key, value in c.items():
        k = f"{where}.{key}"
        if key in ("name", "mmlu_categories"):  # the latter read by farm_category_name
            continue
        if key == "description":
            if builtin:
                out.notes.append(f"{k}: not used: the trained head knows {name!r} (a description would add "
                                 "similarity matching to it)")
            else:
                cat["description"] = str(value)
        elif key == "examples":  # the farm's own extension, kept when present
            cat["examples"] = [str(x) for x in items(value, k)]
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
            for j, entry in enumerate(items(value, k)):
                e = mapping(entry, f"{k}[{j}]")
                if "model" not in e or "score" not in e:
                    raise ConfigError(f"{k}[{j}]: needs `model` and `score`")
                model = rename.get(str(e["model"]), str(e["model"]))
                scores[model] = max(float(e["score"]), scores.get(model, float("-inf")))  # two names, one model
                if "use_reasoning" in e:
                    reasoning.append((float(e["score"]), bool(e["use_reasoning"])))
                for extra in sorted(set(e) - {"model", "score", "use_reasoning"}):
                    out.skip(f"{k}[{j}].{extra}", "per-model settings within a category")
            cat["model_scores"] = scores
        else:
            out.skip(k, "the farm has no per-category setting of this kind" if key.startswith(
                ("semantic_cache", "jailbreak", "pii")) else "not a category setting of the farm")
    if reasoning:
        cat["reasoning"] = category_reasoning(reasoning, f"{where}.model_scores[].use_reasoning", out)
    if not builtin and not cat.get("description") and not cat.get("examples"):
        cat["description"] = name.replace("_", " ")
        out.notes.append(f"{where}: not one of the 14 built-in categories and no description: classified by "
                         "similarity to its name alone; add a description and a few `examples`")
    return cat


def builtin_name(name: str) -> str | None:
    """The farm's built-in category a Semantic Router domain name means ("computer_science": "computer science")."""
    n = " ".join(name.replace("_", " ").replace("-", " ").lower().split())
    return n if n in MMLU_PRO_CATEGORIES else None


def farm_category_name(name: str, mmlu: list[Any], where: str, out: VsrImport) -> str:
    """A built-in category when the name or its one MMLU category is one of the 14; else the name (custom)."""
    own = builtin_name(name)
    if own is not None:
        if own != name:
            out.notes.append(f"{where}: the built-in category {own!r}")
        return own
    listed = sorted({b for m in mmlu if (b := builtin_name(str(m))) is not None})
    if len(listed) == 1:
        out.notes.append(f"{where}: the built-in category {listed[0]!r} (its mmlu_categories)")
        return listed[0]
    if len(listed) > 1:
        out.skip(f"{where}.mmlu_categories", "a category of the farm is one built-in category or a custom one, not "
                 "a union of built-in ones; it is classified as a custom category, by its description")
    return name


def category_reasoning(values: list[tuple[float, bool]], key: str, out: VsrImport) -> bool:
    """The farm has one reasoning mode per category: the best-scored model's `use_reasoning`."""
    chosen = max(values, key=lambda v: v[0])[1]
    if len({flag for _, flag in values}) > 1:
        out.notes.append(f"{key}: differs between models; the farm has one reasoning mode per category: "
                         f"{'on' if chosen else 'off'} (the best-scored model's)")
    return chosen


def cache(c: dict[str, Any], out: VsrImport, where: str = "semantic_cache") -> dict[str, Any]:
    cache: dict[str, Any] = {}
    direct = {"enabled": "enabled", "similarity_threshold": "similarity_threshold", "ttl_seconds": "ttl_s",
              "max_entries": "max_entries"}
    for key, value in c.items():
        k = f"{where}.{key}"
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


REMOTE_PROTOCOLS = ("http_classify", "http_chat")  # the Router's prompt guards the farm asks over HTTP
REMOTE_KEYS = ("protocol", "threshold", "positive_labels", "on_error")  # what a remote prompt_guard maps through


def guard(c: dict[str, Any], out: VsrImport, where: str = "prompt_guard",
          external: list[Any] | None = None) -> dict[str, Any]:
    """`prompt_guard` onto `semantic.jailbreak`; with `protocol: http_classify` or `http_chat`, the guard it names
    among `external` (the Router's `external_models`, `model_role: guardrail`) becomes `semantic.jailbreak.remote`."""
    guard: dict[str, Any] = {}
    if c.get("protocol") is not None:
        remote = remote_guard(c, external or [], out, where)
        if remote is not None:
            guard["remote"] = remote
    for key, value in c.items():
        k = f"{where}.{key}"
        if key == "enabled":
            guard["enabled"] = bool(value)
        elif key == "protocol" or (key in REMOTE_KEYS and "remote" in guard):
            continue  # mapped (or named) by remote_guard
        elif key == "threshold":
            out.skip(k, "a threshold of the Semantic Router's model; the farm's heads have their own calibrated "
                        "one (semantic.jailbreak.threshold)")
        else:
            out.skip(k, NOT_HERE)
    return guard


def reads_external(prompt_guard: Any) -> bool:
    """Whether a `prompt_guard` section takes its endpoint from the external models (so they are read, not named
    as unmapped): `protocol: http_classify` or `http_chat`."""
    return isinstance(prompt_guard, dict) and prompt_guard.get("protocol") in REMOTE_PROTOCOLS


def remote_guard(c: dict[str, Any], external: list[Any], out: VsrImport, where: str) -> dict[str, Any] | None:
    """The Router's remote prompt guard as `semantic.jailbreak.remote`, or None (named as unmapped) when it is not
    a guard the farm can ask. The farm's own head still runs first and asks it about what it lets through."""
    protocol = c["protocol"]
    if protocol not in REMOTE_PROTOCOLS:
        out.skip(f"{where}.protocol", f"{protocol!r}: the farm asks a guard it can reach over HTTP "
                                      "(semantic.jailbreak.remote: http_classify, chat or vllm)")
        return None
    entries = [e for e in external if isinstance(e, dict) and e.get("model_role") == "guardrail"]
    endpoint = mapping(entries[0].get("llm_endpoint"), "llm_endpoint") if entries else {}
    if not endpoint.get("address"):
        out.skip(f"{where}.protocol", f"{protocol} without an external model of model_role guardrail that has an "
                                      "llm_endpoint.address")
        return None
    scheme = endpoint.get("protocol") or "http"
    base = f"{scheme}://{endpoint['address']}" + (f":{endpoint['port']}" if endpoint.get("port") else "")
    if protocol == "http_chat":  # a generative guard (Qwen3Guard-style): its verdict, not a label's probability
        remote: dict[str, Any] = {"url": f"{base}/v1/chat/completions", "protocol": "chat"}
        if entries[0].get("llm_model_name"):
            remote["model"] = str(entries[0]["llm_model_name"])
        out.notes.append(f"{where}.protocol: http_chat -> semantic.jailbreak.remote (protocol chat): the guard's "
                         "answer is read for safe / unsafe / controversial, unsafe blocking (controversial passes, "
                         "as in the Router); the message is sent bare (prompt: '{text}'), not inside the Router's "
                         "instruction")
        if c.get("threshold") is not None:
            out.skip(f"{where}.threshold", "a generative guard's verdict carries no probability to compare: an "
                                           "unsafe verdict blocks")
        if c.get("positive_labels") is not None:
            out.skip(f"{where}.positive_labels", "labels of a classifier's mapping; a generative guard's verdict "
                                                 "words are semantic.jailbreak.remote.labels / positive_labels")
        remote.update(_remote_common(c, entries[0], out))
        return remote
    remote = {"url": f"{base}/classify", "protocol": "http_classify"}
    positive = c.get("positive_labels") or ["jailbreak"]
    remote["positive_labels"] = [str(x) for x in items(positive, f"{where}.positive_labels")]
    remote["labels"] = ["benign", *[x for x in remote["positive_labels"] if x != "benign"]]
    out.notes.append(f"{where}.jailbreak_mapping_path: the guard's labels are taken to be {remote['labels']}; set "
                     "semantic.jailbreak.remote.labels to the classifier's own (an answer over other labels is an error)")
    if c.get("threshold") is not None:
        remote["threshold"] = float(c["threshold"])
    remote.update(_remote_common(c, entries[0], out))
    out.notes.append(f"{where}.protocol: http_classify -> semantic.jailbreak.remote, asked after the farm's own head "
                     "about every message it lets through (ask_above 0)")
    return remote


def _remote_common(c: dict[str, Any], entry: dict[str, Any], out: VsrImport) -> dict[str, Any]:
    """What both remote protocols carry over: `on_error` and the external model's timeout; its key is named."""
    remote: dict[str, Any] = {}
    if c.get("on_error") in ("allow", "block"):
        remote["on_error"] = c["on_error"]
    seconds = entry.get("llm_timeout_seconds")
    if isinstance(seconds, int | float) and 0 < seconds <= 60:
        remote["timeout_s"] = float(seconds)
    if entry.get("access_key"):
        out.notes.append("external_models[guardrail].access_key: not copied into the file; give it as "
                         "FARM_SEMANTIC__JAILBREAK__REMOTE__API_KEY")
    return remote


def classifier(c: dict[str, Any], sem: dict[str, Any], out: VsrImport, where: str = "classifier") -> None:
    """The Semantic Router's classifier models: a PII model turns the farm's PII guard on; the rest is theirs.
    (v0.3 names them `pii` and `domain` under global.model_catalog.modules.classifier.)"""
    for key, value in c.items():
        k = f"{where}.{key}"
        if key in ("pii_model", "pii"):
            sem.setdefault("pii", {})["enabled"] = True
            for sub in mapping(value, k):
                why = ("a threshold of the Semantic Router's model; the farm's is Presidio's score "
                       "(semantic.pii.threshold)") if sub == "threshold" else NOT_HERE
                out.skip(f"{k}.{sub}", why)
        elif key in ("category_model", "domain"):
            for sub in mapping(value, k):
                why = ("a threshold of the Semantic Router's model; the farm's head has its own "
                       "(semantic.classifier.threshold)") if sub == "threshold" else NOT_HERE
                out.skip(f"{k}.{sub}", why)
        else:
            out.skip(k, NOT_HERE)


def models(c: dict[str, Any], sem: dict[str, Any], out: VsrImport, rename: dict[str, str]) -> None:
    policies: dict[str, Any] = {}
    for model, settings in c.items():
        name = rename.get(str(model), str(model))
        for key, value in mapping(settings, f"model_config.{model}").items():
            k = f"model_config.{model}.{key}"
            if key == "pii_policy":
                policies[name] = pii_policy(mapping(value, k), k, out)
            elif key == "reasoning_family":
                out.skip(k, "the farm applies reasoning through the model's chat template (`enable_thinking`)")
            else:
                out.skip(k, "the farm's per-model settings are its `models:` entries")
    if policies:
        sem.setdefault("pii", {})["policies"] = policies
        out.notes.append("model_config: models without a pii_policy keep the farm's default policy (identity and "
                         "payment data blocked, the rest reported), not the Semantic Router's allow-all")


def pii_policy(p: dict[str, Any], where: str, out: VsrImport) -> dict[str, Any]:
    allow = bool(p.get("allow_by_default", False))
    types: list[str] = []
    for t in items(p.get("pii_types_allowed", []), f"{where}.pii_types_allowed"):
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

