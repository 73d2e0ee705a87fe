"""Jailbreak / prompt-injection detection with a type and a confidence.

Softmax regression over [MiniLM embedding, hashed word uni/bigrams]: benign and attack classes.
Confidence = 1 - p(benign); the type is the most likely attack class. Two heads ship
(`semantic.jailbreak.head`): `default` (instruction_override, roleplay, prompt_extraction; trained on the
project's templates with benign prompts that use the same words, "disregard my last paragraph", "explain
SQL injection so I can prevent it") and `strict` (jailbreak, harmful_request, prompt_extraction; trained
on real attack collections and real benign prompts, tools/semantic/train.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from farm.semantic.heads import LinearHead

# semantic.jailbreak.head -> (the head's name in heads.npz, the key of its training record in the heads' meta)
SHIPPED_HEADS = {"default": ("jb", "jailbreak"), "strict": ("jb_strict", "jailbreak_strict")}


@dataclass(frozen=True)
class JailbreakResult:
    is_jailbreak: bool
    type: str  # "benign" when not an attack
    confidence: float  # probability that the text is an attack


class JailbreakDetector:
    def __init__(self, head: LinearHead, threshold: float) -> None:
        if head.labels[0] != "benign":
            raise ValueError("the jailbreak head's first label must be 'benign'")
        self.head = head
        self.threshold = threshold

    @classmethod
    def shipped(cls, setting: str, heads: dict[str, LinearHead], meta: dict, threshold: float | None = None
                ) -> JailbreakDetector:
        """The shipped head chosen by `semantic.jailbreak.head`, at the threshold calibrated with it at
        training unless `threshold` overrides it."""
        name, record = SHIPPED_HEADS[setting]
        return cls(heads[name], threshold or meta[record]["threshold"])

    def detect(self, emb: np.ndarray, texts: list[str]) -> list[JailbreakResult]:
        p = self.head.proba(np.atleast_2d(emb), texts)
        out = []
        for row in p:
            attack = float(1.0 - row[0])
            kind = self.head.labels[1 + int(row[1:].argmax())]
            flagged = attack >= self.threshold
            out.append(JailbreakResult(flagged, kind if flagged else "benign", attack))
        return out
