"""A generative guard's answer read as a verdict (farm.semantic.remote_guard.verdict, `protocol: chat`): the first
configured word the answer names as a whole word decides, in the shapes Llama Guard, Qwen3Guard and ShieldGemma
answer; a word inside another (`safe` in `unsafe`, in `Safety:`) is not read, nor a reasoning guard's thoughts."""

from __future__ import annotations

import math

import pytest

from farm.semantic.remote_guard import verdict, verdict_token_shares

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


def _token(text: str, logprob: float, *others: tuple[str, float]) -> dict:
    """One entry of OpenAI's `choices[0].logprobs.content`."""
    return {"token": text, "logprob": logprob,
            "top_logprobs": [{"token": text, "logprob": logprob}, *({"token": t, "logprob": lp} for t, lp in others)]}


def test_logprob_shares_are_read_at_the_verdict_token():
    # Qwen3Guard: the verdict is the third token; "Safety" before it is not a verdict, "Hello" begins no label
    tokens = [_token("Safety", 0.0), _token(":", 0.0),
              _token(" Unsafe", math.log(0.6), (" Safe", math.log(0.3)), (" Controversial", math.log(0.05)),
                     ("Hello", math.log(0.05)))]
    shares = verdict_token_shares("Safety: Unsafe", tokens, WORDS)
    assert all(math.isclose(a, b) for a, b in zip(shares, [0.3 / 0.95, 0.6 / 0.95, 0.05 / 0.95], strict=True))
    # Llama Guard tokenized as "un" + "safe": "un" begins only unsafe, "safe" only safe
    tokens = [_token("\n\n", 0.0), _token("un", math.log(0.2), ("safe", math.log(0.8))), _token("safe", 0.0)]
    shares = verdict_token_shares("\n\nunsafe", tokens, ["safe", "unsafe"])
    assert math.isclose(shares[0], 0.8) and math.isclose(shares[1], 0.2)
    # a token that begins two labels ("s" in safe and, for these labels, sure) counts for neither
    tokens = [_token("s", math.log(0.5), ("no", math.log(0.5)))]
    assert verdict_token_shares("sure", tokens, ["sure", "safe", "no"]) == [0.0, 0.0, 1.0]


def test_logprob_shares_need_the_verdict_covered():
    assert verdict_token_shares("I cannot help", [_token("I", 0.0)], WORDS) is None  # no verdict word
    assert verdict_token_shares("unsafe", [], WORDS) is None  # no log-probabilities
    assert verdict_token_shares("unsafe", [_token("Hello", 0.0)], WORDS) is None  # none of the candidates is a label
