"""Category classification: the 14 MMLU-Pro domains from a trained head, plus categories a user defines.

The head is a softmax regression on the MiniLM embedding, trained by `python -m tools.semantic.train` on real
MMLU questions: microseconds per request once the embedding exists, deterministic. Its accuracy on held-out
subjects and on an independent exam source is in the heads' record and bench/RESULTS.md (bench/semantic.py).

Categories of the user's own (`semantic.categories[]` with a `description` and a few `examples`) need no
retraining: their texts are embedded once at start, and a prompt's similarity to such a category is its cosine
similarity to the centroid of them. The combination rule: a cosine similarity and the head's softmax
probability are not on one scale, so the similarity is first calibrated into a probability that the prompt
belongs to that category, p = sigmoid(CUSTOM_SLOPE * (similarity - classifier.custom_threshold)), both chosen
on a hand-written development set of user-category and built-in prompts (tools/semantic/layer_dev.py);
`custom_threshold` is the similarity at which a match is as likely right as wrong. The best custom category
wins when its p is at least the head's top probability; otherwise the head's category stands. The head never
saw the user's categories, so its own probability cannot speak for them, but a confident head (a clear exam
question) keeps its prompt against a weak custom match.

Categories with `keywords` come first: a prompt that contains them is that category (rule "keyword",
confidence 1), whatever the two other rules say. It is the Semantic Router's keyword signal: an operator's
route that must not depend on a model's judgement ("refund", "invoice" -> the billing model).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Literal, Protocol

import numpy as np

from farm.config.semantic import CategoryConfig
from farm.semantic.heads import LinearHead

Rule = Literal["head", "custom", "keyword"]
# the Semantic Router's name for the signal each rule is (its x-vsr-matched-* headers, its matched_signals lists)
SIGNAL_OF_RULE: dict[str, str] = {"head": "domains", "custom": "embeddings", "keyword": "keywords"}
# the slope of the similarity -> probability calibration: chosen with custom_threshold on the development set
# (tools/semantic/layer_dev.py sweeps both: with the first head, slope 8 held accuracy >= 0.938 over the widest
# range of midpoints, 0.30 to 0.48; with the adapter's heads, 0.938 to 0.979 from 0.30 to 0.40, the best 0.32)
CUSTOM_SLOPE = 8.0


class TextEncoder(Protocol):
    def encode(self, texts: list[str]) -> np.ndarray: ...


@dataclass(frozen=True)
class Category:
    name: str
    confidence: float  # the head's probability (rule "head") or the calibrated similarity (rule "custom")
    rule: Rule = "head"
    # the runners-up, best first: (name, score, rule), each scored by its own rule
    alternatives: tuple[tuple[str, float, Rule], ...] = field(default=())


class CustomCategories:
    """The user's categories as unit centroids of their embedded texts (description and examples), computed once
    at start. The centroid, not the best single example: on the development set it separated the categories'
    prompts from everything else better (0.958 against 0.917 for the best example; tools/semantic/layer_dev.py)."""

    def __init__(self, names: list[str], centroids: np.ndarray) -> None:
        self.names = names
        self.centroids = centroids  # shape (categories, 384), unit rows

    @classmethod
    def from_config(cls, categories: list[CategoryConfig], embedder: TextEncoder) -> CustomCategories | None:
        cats = [c for c in categories if c.is_custom]
        if not cats:
            return None
        texts = [[t for t in [c.description, *c.examples] if t.strip()] for c in cats]
        flat = embedder.encode([t for group in texts for t in group])
        rows, at = [], 0
        for group in texts:
            c = flat[at:at + len(group)].mean(axis=0)
            rows.append(c / max(float(np.linalg.norm(c)), 1e-12))
            at += len(group)
        return cls([c.name for c in cats], np.stack(rows).astype(np.float32))

    def scores(self, vec: np.ndarray) -> list[tuple[str, float]]:
        """(category, cosine similarity of `vec` to its centroid), best first."""
        sims = self.centroids @ vec
        return [(self.names[i], float(sims[i])) for i in np.argsort(-sims)]


class KeywordCategories:
    """The categories with `keywords`, in configuration order: each keyword a whole-word pattern (letters or digits
    on neither side), so "refund" matches "a refund?" but not "refunding"."""

    def __init__(self, rules: list[tuple[str, list[re.Pattern[str]], bool]]) -> None:
        self.rules = rules  # (category, its keywords' patterns, whether all must match)

    @classmethod
    def from_config(cls, categories: list[CategoryConfig]) -> KeywordCategories | None:
        rules = []
        for c in categories:
            if c.keywords:
                flags = 0 if c.case_sensitive else re.IGNORECASE
                words = [re.escape(k.strip()) for k in c.keywords]
                every = c.keyword_operator == "all"
                # any: one alternation, one scan of the text; all: one pattern per keyword
                alternatives = words if every else ["|".join(sorted(words, key=len, reverse=True))]
                patterns = [re.compile(rf"(?<!\w)(?:{a})(?!\w)", flags) for a in alternatives]
                rules.append((c.name, patterns, every))
        return cls(rules) if rules else None

    def match(self, text: str) -> str | None:
        """The first category whose keywords the text contains (any, or all of them), or None."""
        for name, patterns, every in self.rules:
            hits = (p.search(text) is not None for p in patterns)
            if all(hits) if every else any(hits):
                return name
        return None


class CategoryClassifier:
    def __init__(self, head: LinearHead, custom: CustomCategories | None = None,
                 custom_threshold: float = 0.32, slope: float | None = None,
                 keywords: KeywordCategories | None = None) -> None:
        self.head = head
        self.slope = CUSTOM_SLOPE if slope is None else slope
        self.labels = head.labels
        self.custom = custom
        self.custom_threshold = custom_threshold
        self.keywords = keywords

    def calibrated(self, similarity: float) -> float:
        """A custom category's similarity as a probability on the head's scale (see the module's docstring)."""
        return 1.0 / (1.0 + math.exp(-self.slope * (similarity - self.custom_threshold)))

    def classify(self, emb: np.ndarray, texts: list[str]) -> list[Category]:
        """The head's Category per row of `emb` (what the head reads: `Encoded.for_head("cat")`): the 14 built-in
        categories only."""
        p = self.head.proba(np.atleast_2d(emb), texts)
        idx = p.argmax(axis=1)
        return [Category(self.labels[i], float(p[r, i])) for r, i in enumerate(idx)]

    def decide(self, vec: np.ndarray, text: str, top: int = 3, head_vec: np.ndarray | None = None) -> Category:
        """One prompt's category by the combined rule (see the module's docstring), with the runners-up. `vec` is
        the sentence embedding (the custom categories' centroids are embeddings); `head_vec` what the head reads
        when an adapter serves it (farm.semantic.adapter), else `vec`."""
        p = self.head.proba((vec if head_vec is None else head_vec)[None, :], [text])[0]
        ranked: list[tuple[str, float, Rule]] = [(self.labels[i], float(p[i]), "head") for i in np.argsort(-p)]
        if self.custom is not None:
            sims: list[tuple[str, float, Rule]] = [(n, self.calibrated(x), "custom") for n, x in self.custom.scores(vec)]
            ranked = sorted(sims + ranked, key=lambda x: (-x[1], x[2] != "custom"))  # a tie: the user's category
        keyword = self.keywords.match(text) if self.keywords is not None else None
        if keyword is not None:
            ranked.insert(0, (keyword, 1.0, "keyword"))
        seen: set[str] = set()
        uniq = [r for r in ranked if not (r[0] in seen or seen.add(r[0]))]  # a built-in name with examples: once
        name, conf, rule = uniq[0]
        return Category(name, conf, rule, tuple(uniq[1:1 + top]))
