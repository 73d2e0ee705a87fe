"""Scoring on the held-out splits, shared by the benchmark and the tests so both measure the same thing."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import numpy as np

from farm.semantic.pii import PIIDetector


def pii_scores(rows: list[dict], detector: PIIDetector) -> dict[str, dict[str, Any]]:
    """Per entity type: a predicted entity is a true positive when a gold entity of the same type overlaps it."""
    tp: dict[str, int] = defaultdict(int)
    fp: dict[str, int] = defaultdict(int)
    fn: dict[str, int] = defaultdict(int)
    errors: list[dict] = []
    for r in rows:
        pred = detector.detect(r["text"])
        gold = r["entities"]
        matched_pred = set()
        for g in gold:
            hit = next((i for i, p in enumerate(pred) if p.type == g["type"] and p.start < g["end"]
                        and g["start"] < p.end and i not in matched_pred), None)
            if hit is None:
                fn[g["type"]] += 1
                errors.append({"kind": "fn", "type": g["type"], "text": r["text"]})
            else:
                matched_pred.add(hit)
                tp[g["type"]] += 1
        for i, p in enumerate(pred):
            if i not in matched_pred:
                fp[p.type] += 1
                errors.append({"kind": "fp", "type": p.type, "text": r["text"], "span": p.text})
    out: dict[str, dict[str, Any]] = {}
    for t in sorted(set(tp) | set(fp) | set(fn)):
        p_den, r_den = tp[t] + fp[t], tp[t] + fn[t]
        out[t] = {"tp": tp[t], "fp": fp[t], "fn": fn[t],
                  "precision": tp[t] / p_den if p_den else 1.0, "recall": tp[t] / r_den if r_den else 1.0}
    out["_errors"] = errors  # type: ignore[assignment]
    return out


def category_accuracy(pred: list[str], gold: list[str]) -> tuple[float, dict[str, float]]:
    """Overall accuracy and accuracy per gold label."""
    per: dict[str, list[bool]] = defaultdict(list)
    for p, g in zip(pred, gold, strict=True):
        per[g].append(p == g)
    acc = float(np.mean([p == g for p, g in zip(pred, gold, strict=True)])) if gold else 0.0
    return acc, {k: float(np.mean(v)) for k, v in sorted(per.items())}


def jailbreak_rates(flagged: list[bool], labels: list[str], hard: list[bool]) -> dict[str, float]:
    """True-positive rate on attacks, false-positive rate on benign prompts (all, and the hard near-misses)."""
    att = [f for f, lab in zip(flagged, labels, strict=True) if lab != "benign"]
    ben = [f for f, lab in zip(flagged, labels, strict=True) if lab == "benign"]
    hard_ben = [f for f, lab, h in zip(flagged, labels, hard, strict=True) if lab == "benign" and h]
    return {"tpr": float(np.mean(att)) if att else 0.0, "fpr": float(np.mean(ben)) if ben else 0.0,
            "fpr_hard": float(np.mean(hard_ben)) if hard_ben else 0.0,
            "attacks": len(att), "benign": len(ben), "benign_hard": len(hard_ben)}
