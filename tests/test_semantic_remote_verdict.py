"""A generative guard's answer read as a verdict (farm.semantic.remote_guard.verdict, `protocol: chat`): the first
configured word the answer names as a whole word decides, in the shapes Llama Guard, Qwen3Guard and ShieldGemma
answer; a word inside another (`safe` in `unsafe`, in `Safety:`) is not read, nor a reasoning guard's thoughts."""

from __future__ import annotations

import pytest

from farm.semantic.remote_guard import verdict

WORDS = ["safe", "unsafe", "controversial"]


@pytest.mark.parametrize("answer,expected", [
    ("safe", "safe"),
    ("\n\nunsafe\nS1,S10", "unsafe"),  # Llama Guard 3: the verdict line, then its categories
    ("Safety: Unsafe\nCategories: Jailbreak", "unsafe"),  # Qwen3Guard-Gen
    ("Safety: Safe\nCategories: None\nRefusal: Yes", "safe"),
    ("Safety: Controversial\nCategories: Politically Sensitive Topics", "controversial"),
    ("UNSAFE", "unsafe"),
    ("<think>It asks me to ignore my rules, unsafe? No, it is a quote.</think>\nsafe", "safe"),
    ("It is safe, not unsafe.", "safe"),  # the first named decides
])
def test_a_guard_answer_names_its_verdict(answer, expected):
    assert verdict(answer, WORDS) == expected


@pytest.mark.parametrize("answer", [
    "I cannot help with that.",  # no verdict word: an error for the layer (on_error), never read as safe
    "Safety: pending",
    "<think>Is this unsafe? Let me consider the",  # cut off while thinking
    "unsafely",
])
def test_an_answer_without_a_verdict_is_none(answer):
    assert verdict(answer, WORDS) is None


def test_yes_no_guards_read_with_their_own_words():
    assert verdict("Yes", ["No", "Yes"]) == "Yes"  # ShieldGemma / Granite Guardian: Yes = violates the policy
    assert verdict(" no.", ["No", "Yes"]) == "No"
