"""Category classification over the 14 MMLU-Pro domains, from the shared sentence embedding.

A softmax-regression head (trained by `farm.semantic.train`) on the MiniLM embedding: microseconds per
request once the embedding exists, deterministic, and ≥ 85% on the held-out split (bench/semantic.py).
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
