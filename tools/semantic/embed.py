"""MiniLM embeddings of training and evaluation text, cached on disk by text digest.

The vectors are the ones the serving path computes (farm.semantic.embeddings, the same model and the same
128-token window as `semantic.max_embed_tokens`), so a head trained on them sees at run time what it saw
here. The cache lives beside the wheels (outside the repository); re-running training after a change to the
heads costs seconds instead of minutes.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

from farm.semantic.adapter import HeadAdapter
from tools.semantic.wheels import cache_dir

WINDOW = 128  # config/default.yaml semantic.max_embed_tokens


def _key(text: str) -> str:
    return hashlib.sha1(text.encode("utf-8", "replace")).hexdigest()


class EmbeddingCache:
    """The sentence embeddings of texts, or with an `adapter` its branch's vectors (a cache per adapter, named by
    its digest)."""

    def __init__(self, path: Path | None = None, adapter: HeadAdapter | None = None) -> None:
        self.adapter = adapter
        suffix = f"-adapter-{adapter.digest()[:16]}" if adapter is not None else ""
        self.path = path or cache_dir().parent / f"minilm-{WINDOW}{suffix}.npz"
        self.vectors: dict[str, np.ndarray] = {}
        if self.path.exists():
            z = np.load(self.path)
            self.vectors = dict(zip(z["keys"].tolist(), z["vecs"].astype(np.float32), strict=True))
        self._embedder = None

    def with_adapter(self, adapter: HeadAdapter | None) -> EmbeddingCache:
        """The cache of the branch's vectors under `adapter`: this one when there is none (the head then reads
        the sentence embedding), not a second copy of it read from disk."""
        return self if adapter is None else EmbeddingCache(adapter=adapter)

    def encode(self, texts: list[str]) -> np.ndarray:
        keys = [_key(t) for t in texts]
        # by length: padded batches of similar lengths (the vectors do not depend on the batch)
        missing = sorted({k: t for k, t in zip(keys, texts, strict=True) if k not in self.vectors}.items(),
                         key=lambda kt: (len(kt[1]), kt[0]))
        if missing:
            vecs = self._compute([t for _, t in missing])
            self.vectors.update({k: v for (k, _), v in zip(missing, vecs, strict=True)})
            self.save()
        return np.stack([self.vectors[k] for k in keys]) if keys else np.zeros((0, 384), np.float32)

    def _compute(self, texts: list[str]) -> np.ndarray:
        """The vectors of texts not cached yet (a subclass may cache another model's vectors)."""
        if self._embedder is None:
            from farm.semantic.embeddings import Embedder

            self._embedder = Embedder(threads=2, max_tokens=WINDOW, backend="torch", adapter=self.adapter)
        return self._embedder.encode(texts, tuned=self.adapter is not None)

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        keys = list(self.vectors)
        tmp = self.path.with_suffix(".tmp.npz")
        np.savez(tmp, keys=np.array(keys), vecs=np.stack([self.vectors[k] for k in keys]).astype(np.float32))
        tmp.replace(self.path)
