"""Scores with 95% confidence intervals, shared by training (calibration, held-out report) and bench/semantic.

Intervals: Wilson score intervals for proportions (accuracy, TPR, FPR, recall, precision). They stay inside
[0, 1] and are honest for small n and for rates near 0 or 1, where the normal approximation is not.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any

Z95 = 1.959963984540054


def wilson(successes: int, n: int, z: float = Z95) -> tuple[float, float]:
    """The Wilson score interval of successes/n; (0, 1) when n is 0."""
    if n <= 0:
        return 0.0, 1.0
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


def rate(successes: int, n: int) -> dict[str, Any]:
    """{value, lo, hi, k, n}: one proportion with its 95% interval."""
    lo, hi = wilson(successes, n)
    return {"value": successes / n if n else None, "lo": lo, "hi": hi, "k": successes, "n": n}


def fmt(r: dict[str, Any]) -> str:
    """'0.912 [0.887, 0.932] (n=600)' for tables."""
    if r["value"] is None:
        return f"- (n={r['n']})"
    return f"{r['value']:.3f} [{r['lo']:.3f}, {r['hi']:.3f}] (n={r['n']})"


def accuracy(pred: list[str], gold: list[str]) -> dict[str, Any]:
    """Overall accuracy and per gold label, each with its interval."""
    per: dict[str, list[bool]] = defaultdict(list)
    for p, g in zip(pred, gold, strict=True):
        per[g].append(p == g)
    ok = sum(p == g for p, g in zip(pred, gold, strict=True))
    return {**rate(ok, len(gold)), "per_label": {k: rate(sum(v), len(v)) for k, v in sorted(per.items())}}


def pii_scores(rows: list[dict], detect) -> dict[str, Any]:
    """Span-level recall and precision per entity type, and micro-averaged over the types either side has.

    A predicted entity is a true positive when a gold entity of the same type overlaps it. Types the data
    does not annotate (gold never has them) are left out of precision: a NER 'DATE_TIME' in a sentence
    whose dates nobody labelled is not an error of the detector. `detect(text)` returns entities with
    `.type`, `.start`, `.end`."""
    annotated = {g["type"] for r in rows for g in r["entities"]}
    tp: dict[str, int] = defaultdict(int)
    fp: dict[str, int] = defaultdict(int)
    fn: dict[str, int] = defaultdict(int)
    errors: list[dict] = []
    for r in rows:
        pred = [p for p in detect(r["text"]) if p.type in annotated]
        used: set[int] = set()
        for g in r["entities"]:
            hit = next((i for i, p in enumerate(pred) if i not in used and p.type == g["type"]
                        and p.start < g["end"] and g["start"] < p.end), None)
            if hit is None:
                fn[g["type"]] += 1
                errors.append({"kind": "fn", "type": g["type"], "text": r["text"]})
            else:
                used.add(hit)
                tp[g["type"]] += 1
        for i, p in enumerate(pred):
            if i not in used:
                fp[p.type] += 1
                errors.append({"kind": "fp", "type": p.type, "text": r["text"], "span": r["text"][p.start:p.end]})
    per = {t: {"recall": rate(tp[t], tp[t] + fn[t]), "precision": rate(tp[t], tp[t] + fp[t])}
           for t in sorted(set(tp) | set(fp) | set(fn))}
    TP, FP, FN = sum(tp.values()), sum(fp.values()), sum(fn.values())
    return {"micro": {"recall": rate(TP, TP + FN), "precision": rate(TP, TP + FP)}, "per_type": per,
            "errors": errors}


def detection_rates(flags: list[bool], positive: list[bool], groups: list[str]) -> dict[str, Any]:
    """TPR over positives and FPR over negatives, pooled and per group (source or family)."""
    pos = [f for f, y in zip(flags, positive, strict=True) if y]
    neg = [f for f, y in zip(flags, positive, strict=True) if not y]
    by: dict[tuple[str, bool], list[bool]] = defaultdict(list)
    for f, y, g in zip(flags, positive, groups, strict=True):
        by[(g, bool(y))].append(f)
    mixed = {g for g, y in by if (g, not y) in by}  # a group with both kinds is reported once per kind
    per = {}
    for (g, is_pos), xs in sorted(by.items()):
        name = f"{g} ({'attack' if is_pos else 'benign'})" if g in mixed else g
        per[name] = {"kind": "attack" if is_pos else "benign",
                     ("tpr" if is_pos else "fpr"): rate(sum(xs), len(xs))}
    return {"tpr": rate(sum(pos), len(pos)), "fpr": rate(sum(neg), len(neg)), "per_group": per}
