"""Model selection for "MoM"/"auto" and per-category system prompt injection.

Per-category model scores in config pick the highest-scoring model that is served right now (the
caller passes a `served()` callback, e.g. the models with live workers), passing over at most
`semantic.fallback_hops` better-scored models that are not (the route names them: `x-vsr-fallback`); below
the classifier's confidence threshold, or with no scored model served within those hops, the default model
answers. Served models scoring within `semantic.cache_aware_margin` of the chosen one are `tied`: the layer
then lets the farm pick among them by where the prompt would start soonest (farm.semantic.layer, `prefer`).
An explicit model name is honoured as given: no selection and no category system prompt.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from farm.config.semantic import CategoryConfig, SemanticConfig


@dataclass(frozen=True)
class Route:
    model: str
    category: str | None  # the accepted category (confidence at or above the threshold), else None
    confidence: float
    reasoning: bool | None  # the chosen category's reasoning mode (MoM only); None: nothing decided
    routed: bool  # True when the model was chosen for an alias ("MoM", "auto")
    category_cfg: CategoryConfig | None
    passed_over: tuple[str, ...] = ()  # better-scored models of the category without a live worker, best first
    tied: tuple[str, ...] = ()  # served models scoring within the margin of the chosen one, it first
    # the category's further served models, best-scored first, within the hops `passed_over` left: where the
    # request goes when the chosen model fails before its first token (api/routes/openai.py)
    alternatives: tuple[str, ...] = ()
    reason: str = "score"  # why this model (x-vsr-selection-reason): score | default | fallback | kv-cache | load


class ModelSelector:
    def __init__(self, cfg: SemanticConfig, default_model: str,
                 served: Callable[[], set[str]] | None = None) -> None:
        self.cfg = cfg
        self.default_model = cfg.default_model or default_model
        self.aliases = {a.lower() for a in cfg.aliases}
        self.served = served

    def is_alias(self, model: str) -> bool:
        return model.lower() in self.aliases

    def select(self, requested: str, category: str, confidence: float) -> Route:
        accepted = confidence >= self.cfg.classifier.threshold
        cat_cfg = self.cfg.category(category) if accepted else None
        if not self.is_alias(requested):
            return Route(requested, category if accepted else None, confidence, None, False, None, reason="explicit")
        model, reason = self.default_model, "default"
        passed: list[str] = []
        tied: tuple[str, ...] = ()
        alternatives: tuple[str, ...] = ()
        if cat_cfg and cat_cfg.model_scores:
            live = self.served() if self.served else None
            ranked = sorted(cat_cfg.model_scores.items(), key=lambda kv: (-kv[1], kv[0]))
            for name, score in ranked[:1 + self.cfg.fallback_hops]:  # bounded: then the default model answers
                if live is None or name in live:
                    model, reason = name, "fallback" if passed else "score"
                    margin = self.cfg.cache_aware_margin
                    tied = tuple(n for n, sc in ranked if n == name or (
                        margin > 0 and sc >= score - margin and n not in passed and (live is None or n in live)))
                    alternatives = tuple(n for n, _ in ranked if n != name and n not in passed
                                         and (live is None or n in live))[:self.cfg.fallback_hops - len(passed)]
                    break
                passed.append(name)
        return Route(model, category if accepted else None, confidence,
                     cat_cfg.reasoning if cat_cfg else None, True, cat_cfg, passed_over=tuple(passed),
                     tied=tied if len(tied) > 1 else (), reason=reason, alternatives=alternatives)


def message_text(content) -> str:
    """A message's text: a string, or the text parts of an OpenAI content list."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    return ""


def system_prompt_of(messages: list[dict]) -> str:
    return "\n\n".join(message_text(m.get("content")) for m in messages if m.get("role") in ("system", "developer"))


def inject_system_prompt(messages: list[dict], prompt: str, mode: str) -> list[dict]:
    """A new message list with `prompt` as the system prompt (replace) or in front of the user's (prepend)."""
    if not prompt:
        return list(messages)
    rest = [dict(m) for m in messages]
    sys_idx = [i for i, m in enumerate(rest) if m.get("role") == "system"]
    if mode == "replace" or not sys_idx:
        rest = [m for m in rest if m.get("role") != "system"]
        return [{"role": "system", "content": prompt}] + rest
    first = sys_idx[0]
    rest[first] = {**rest[first], "content": prompt + "\n\n" + message_text(rest[first].get("content"))}
    return rest
