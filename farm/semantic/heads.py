"""Small softmax-regression heads over the shared sentence embedding (plus hashed word n-grams).

Why this shape: the embedding is computed once per request anyway, so a linear head costs microseconds
and stays deterministic; hashed unigram+bigram features let the jailbreak head see phrasing ("no
restrictions", "system prompt verbatim") that a mean-pooled embedding blurs. Weights are trained by
`python -m farm.semantic.train` from the in-repo training data and saved in `data/heads.npz`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
import xxhash

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

    def proba(self, emb: np.ndarray, texts: list[str]) -> np.ndarray:
        """Class probabilities, shape (n, len(labels))."""
        z = self.features(emb, texts) @ self.W + self.b
        z -= z.max(axis=1, keepdims=True)
        e = np.exp(z)
        return e / e.sum(axis=1, keepdims=True)


def train_softmax(X: np.ndarray, y: np.ndarray, k: int, l2: float = 1e-3, iters: int = 300,
                  class_weight: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Multinomial logistic regression, full batch L-BFGS from zeros: deterministic for given data."""
    import torch

    Xt = torch.from_numpy(X.astype(np.float32))
    yt = torch.from_numpy(y.astype(np.int64))
    W = torch.zeros(X.shape[1], k, requires_grad=True)
    b = torch.zeros(k, requires_grad=True)
    cw = None if class_weight is None else torch.from_numpy(class_weight.astype(np.float32))
    opt = torch.optim.LBFGS([W, b], lr=1.0, max_iter=iters, history_size=20, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(Xt @ W + b, yt, weight=cw) + l2 * (W * W).sum()
        loss.backward()
        return loss

    opt.step(closure)
    return W.detach().numpy().astype(np.float32), b.detach().numpy().astype(np.float32)
