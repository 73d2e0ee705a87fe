"""Jailbreak / prompt-injection detection with a type and a confidence.

Softmax regression over [the guard's vector, hashed word uni/bigrams]: benign and attack classes (jailbreak,
harmful_request, prompt_extraction). Confidence = 1 - p(benign); the type is the most likely attack class.
The guard's vector is the sentence embedding, or MiniLM's with a low-rank adapter on its top layers when
heads.npz carries one (farm.semantic.adapter; none ships).
One head ships ("jb" in heads.npz): trained on real attack collections, real benign prompts and the project's
near misses ("disregard my last paragraph", "explain SQL injection so I can prevent it"), its threshold
chosen on a development split (tools/semantic/train.py); bench/semantic --final scores it once on families
no choice has seen. An encoded message (base64, hex, ROT13) is also scored as what it decodes to
(farm.semantic.decoding), and the worst of its forms counts. An operator's own attack examples
(`semantic.jailbreak.patterns`, `AttackPatterns`) block what is close to them whatever the head says.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from farm.semantic.adapter import adapter_for
from farm.semantic.decoding import DECODING_VERSION, decoded_forms
from farm.semantic.heads import LinearHead


@dataclass(frozen=True)
class JailbreakResult:
    is_jailbreak: bool
    type: str  # "benign" when not an attack
    confidence: float  # probability that the text is an attack


@dataclass(frozen=True)
class AttackPatterns:
    """An operator's attack examples and benign ones, as unit guard vectors: a text matches when its nearest
    attack example is at least `threshold` close (cosine) and no benign example is closer (the Semantic Router's
    contrastive jailbreak rule, with an absolute floor)."""

    attack: np.ndarray
    benign: np.ndarray
    threshold: float
    digest: str

    @classmethod
    def from_texts(cls, attack: list[str], benign: list[str], threshold: float,
                   vectors_of: Callable[[list[str]], np.ndarray]) -> AttackPatterns | None:
        if not attack:
            return None

        def unit(texts: list[str]) -> np.ndarray:
            if not texts:
                return np.zeros((0, 0), np.float32)
            v = np.asarray(vectors_of(texts), dtype=np.float32)
            return v / np.linalg.norm(v, axis=1, keepdims=True)

        digest = hashlib.sha256(repr((attack, benign, threshold)).encode()).hexdigest()
        return cls(unit(attack), unit(benign), threshold, digest)

    def match(self, vectors: np.ndarray) -> np.ndarray:
        """For each row of `vectors` (guard vectors), whether it matches."""
        v = np.atleast_2d(vectors).astype(np.float32)
        v = v / np.maximum(np.linalg.norm(v, axis=1, keepdims=True), 1e-12)
        near = (v @ self.attack.T).max(axis=1)
        closer_benign = (v @ self.benign.T).max(axis=1) > near if self.benign.size else np.zeros(len(v), bool)
        return (near >= self.threshold) & ~closer_benign


class JailbreakDetector:
    """The head over the guard's vectors at a threshold, and the operator's attack examples when given;
    `adapter_digest` names the adapter that makes the vectors (farm.semantic.adapter; "" for the plain sentence
    embedding)."""

    def __init__(self, head: LinearHead, threshold: float, adapter_digest: str = "",
                 patterns: AttackPatterns | None = None) -> None:
        if head.labels[0] != "benign":
            raise ValueError("the jailbreak head's first label must be 'benign'")
        self.head = head
        self.threshold = threshold
        self.adapter_digest = adapter_digest
        self.patterns = patterns

    @classmethod
    def shipped(cls, heads: dict[str, LinearHead], meta: dict, threshold: float | None = None,
                patterns: AttackPatterns | None = None) -> JailbreakDetector:
        """The shipped head at the threshold chosen with it at training, unless `threshold` overrides it."""
        adapter = adapter_for("jb")
        return cls(heads["jb"], threshold or meta["jailbreak"]["threshold"], adapter.digest() if adapter else "",
                   patterns)

    def digest(self) -> str:
        """sha256 of everything that decides a verdict: the adapter's and the head's weights, the threshold and
        the decoding rules. bench/semantic --final records the one reading of the final split under it."""
        parts = f"{self.head.digest()} {self.threshold!r} {DECODING_VERSION}"
        if self.adapter_digest:
            parts += f" {self.adapter_digest}"
        if self.patterns is not None:
            parts += f" patterns {self.patterns.digest}"
        return hashlib.sha256(parts.encode()).hexdigest()

    def detect(self, emb: np.ndarray, texts: list[str]) -> list[JailbreakResult]:
        """Each text's result; one that matches the operator's attack examples is type "pattern", confidence 1."""
        p = self.head.proba(np.atleast_2d(emb), texts)
        matched = self.patterns.match(emb) if self.patterns is not None else np.zeros(len(p), bool)
        out = []
        for row, pattern in zip(p, matched, strict=True):
            if pattern:
                out.append(JailbreakResult(True, "pattern", 1.0))
                continue
            attack = float(1.0 - row[0])
            kind = self.head.labels[1 + int(row[1:].argmax())]
            flagged = attack >= self.threshold
            out.append(JailbreakResult(flagged, kind if flagged else "benign", attack))
        return out

    def screen(self, texts: list[str], vectors_of: Callable[[list[str]], np.ndarray]) -> list[JailbreakResult]:
        """Each text's result: the worst of the text itself and of what it decodes to. `vectors_of` gives a
        list of texts' guard vectors (the serving path passes its memoised encoder, training and the bench
        their cache)."""
        forms = [[t, *decoded_forms(t)] for t in texts]
        flat = list(dict.fromkeys(x for f in forms for x in f))
        found = dict(zip(flat, self.detect(vectors_of(flat), flat), strict=True))
        return [max((found[x] for x in f), key=lambda r: r.confidence) for f in forms]
