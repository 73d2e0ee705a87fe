"""Category classification over the 14 MMLU-Pro domains, from the shared sentence embedding.

A softmax-regression head on the MiniLM embedding, trained by `python -m tools.semantic.train` on real MMLU
questions: microseconds per request once the embedding exists, deterministic. Its accuracy on held-out
subjects and on an independent exam source is in the heads' record and bench/RESULTS.md (bench/semantic.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from farm.semantic.heads import LinearHead


@dataclass(frozen=True)
class Category:
    name: str
    confidence: float


class CategoryClassifier:
    def __init__(self, head: LinearHead) -> None:
        self.head = head
        self.labels = head.labels

    def classify(self, emb: np.ndarray, texts: list[str]) -> list[Category]:
        """One Category per row of `emb` (unit vectors)."""
        p = self.head.proba(np.atleast_2d(emb), texts)
        idx = p.argmax(axis=1)
        return [Category(self.labels[i], float(p[r, i])) for r, i in enumerate(idx)]
