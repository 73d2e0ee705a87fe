"""Categories a user defines in the configuration (issue 29): a description, five examples, model scores; the
layer classifies against them without retraining, beside the trained head's 14 built-in categories.

The held-out prompts (tools/semantic/custom_held_out.py) were written apart from the development set that chose
`semantic.classifier.custom_threshold` (tools/semantic/layer_dev.py) and were not used for any choice.
"""

from __future__ import annotations

import pytest
import yaml

from farm.config import ConfigError, load_config
from farm.semantic.layer import SemanticLayer
from tools.semantic.custom_held_out import BUILT_IN, HELD_OUT
from tools.semantic.layer_dev import DEV_CATEGORIES

MODEL_A = "SmolLM2-135M-Instruct"
MODEL_B = "SmolLM2-135M-Instruct-b"

# the three categories as defined in the development set that chose the threshold (same descriptions and
# examples); the held-out prompts are not of that set
SCORES = {"cooking": {MODEL_B: 0.9, MODEL_A: 0.4}, "travel": {MODEL_A: 0.8}, "customer_support": {MODEL_A: 0.7}}
CATEGORIES = [{**c, "model_scores": SCORES[c["name"]]} for c in DEV_CATEGORIES]
CATEGORIES[0]["system_prompt"] = "You are a chef."

@pytest.fixture(scope="module")
def embedder():
    from farm.semantic.embeddings import get_embedder

    return get_embedder(threads=2)


def _cfg(tmp_path, semantic: dict):
    override = {"models": [{"name": MODEL_A, "source": "builtin:smollm2"}, {"name": MODEL_B, "source": "builtin:smollm2"}],
                "semantic": {"cache": {"enabled": False}, "pii": {"enabled": False}, **semantic}}
    p = tmp_path / "custom.yaml"
    p.write_text(yaml.safe_dump(override))
    return load_config(p, environ={})


@pytest.fixture(scope="module")
def layer(tmp_path_factory, embedder) -> SemanticLayer:
    cfg = _cfg(tmp_path_factory.mktemp("custom"), {"categories": CATEGORIES})
    return SemanticLayer.from_config(cfg, embedder=embedder)


def _user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def test_held_out_prompts_of_user_categories(layer):
    """Issue 29's goal: >= 0.80 on a held-out test of 3 user-defined categories with 5 examples each."""
    wrong = []
    for gold, text in HELD_OUT:
        v = layer.before("MoM", _user(text))
        if v.category != gold:
            wrong.append((gold, v.category, text))
    accuracy = 1 - len(wrong) / len(HELD_OUT)
    print(f"custom categories, held out: {accuracy:.3f} ({len(HELD_OUT) - len(wrong)}/{len(HELD_OUT)}); wrong: {wrong}")
    assert accuracy >= 0.80, wrong


def test_built_in_prompts_stay_with_the_head(layer):
    custom = {c["name"] for c in CATEGORIES}
    swallowed = [(gold, text) for gold, text in BUILT_IN if layer.before("MoM", _user(text)).category in custom]
    assert len(swallowed) <= 1, swallowed
    assert layer.before("MoM", _user("Solve for x: 2x + 6 = 10")).category == "math"


def test_a_custom_category_routes_and_explains(layer):
    v = layer.before("MoM", _user("How do I cook rice so it is fluffy?"))
    assert v.category == "cooking" and v.model == MODEL_B  # its model_scores
    assert v.headers["x-vsr-selected-category"] == "cooking" == v.headers["x-vsr-matched-embeddings"]
    assert float(v.headers["x-vsr-selected-confidence"]) >= layer.cfg.classifier.threshold
    assert v.headers["x-vsr-selected-decision"] == "cooking"  # no decision imported: the category's name
    assert v.messages[0] == {"role": "system", "content": "You are a chef."}
    why = v.explain["category"]
    assert why["rule"] == "custom" and why["confidence"] >= layer.cfg.classifier.threshold and why["accepted"]
    assert len(why["alternatives"]) == 3
    by_head = layer.before("MoM", _user("What is the derivative of x^3?"))
    head = by_head.explain["category"]
    assert head["rule"] == "head" and head["name"] == "math" == by_head.headers["x-vsr-matched-domains"]
    assert "x-vsr-matched-embeddings" not in by_head.headers


def test_custom_categories_are_embedded_once_at_start(tmp_path, embedder):
    calls = []

    class Counting:
        max_tokens = 128

        def __getattr__(self, name):
            return getattr(embedder, name)

        def encode(self, texts):
            calls.append(len(texts))
            return embedder.encode(texts)

    lay = SemanticLayer.from_config(_cfg(tmp_path, {"categories": CATEGORIES}), embedder=Counting())
    assert calls[0] == 18  # 3 descriptions + 15 examples, in one call
    n = len(calls)
    lay.before("MoM", _user("How do I cook rice?"))
    assert len(calls) == n


def test_a_category_of_ones_own_needs_a_description_or_examples(tmp_path):
    with pytest.raises(ConfigError, match="needs a `description` and a few `examples`, or `keywords`"):
        _cfg(tmp_path, {"categories": [{"name": "astrology", "model_scores": {MODEL_A: 1.0}}]})
    cfg = _cfg(tmp_path, {"categories": [{"name": "astrology", "description": "Horoscopes and star signs."}]})
    assert [c.name for c in cfg.semantic.custom_categories] == ["astrology"]


def test_keyword_categories_route_before_the_head_and_the_similarity_rule(tmp_path, embedder):
    """A category with `keywords` (the Semantic Router's keyword signal): whole words, any or all of them, case
    as configured; it wins over a confident head, and a prompt without its keywords is classified as before."""
    lay = SemanticLayer.from_config(_cfg(tmp_path, {"categories": [
        *CATEGORIES,
        {"name": "billing", "keywords": ["invoice", "refund"], "model_scores": {MODEL_B: 1.0},
         "decision": "billing_route"},  # imported from a Semantic Router decision
        {"name": "incident", "keywords": ["SEV1", "outage"], "keyword_operator": "all", "case_sensitive": True,
         "model_scores": {MODEL_A: 1.0}}]}), embedder=embedder)
    v = lay.before("MoM", _user("Solve for x: 2x + 6 = 10, then put the answer on my invoice"))
    why = v.explain["category"]
    assert v.category == "billing" and v.model == MODEL_B and why["rule"] == "keyword" and why["confidence"] == 1.0
    assert v.headers["x-vsr-matched-keywords"] == "billing" and v.headers["x-vsr-selected-confidence"] == "1.000"
    assert v.headers["x-vsr-selected-decision"] == "billing_route"
    assert why["alternatives"][0][0] == "math"  # what the head would have said, as the first runner-up
    assert lay.before("MoM", _user("Where is my REFUND?")).category == "billing"  # case-insensitive by default
    assert lay.before("MoM", _user("Solve for x: 2x + 6 = 10 (refunding)")).category == "math"  # whole words only
    assert lay.before("MoM", _user("SEV1 outage in the payments API")).category == "incident"  # all of them
    assert lay.before("MoM", _user("sev1 outage in the payments API")).category != "incident"  # case-sensitive
    assert lay.before("MoM", _user("an outage, not a SEV1 yet")).category == "incident"  # anywhere, any order
    assert lay.before("MoM", _user("a SEV1 in the payments API")).category != "incident"  # one of two: not all
    # in a conversation, a turn a keyword rule routes moves it (a follow-up otherwise keeps the first turn's)
    turns = [{"role": "user", "content": "Solve for x: 2x + 6 = 10"}, {"role": "assistant", "content": "x = 2"},
             {"role": "user", "content": "Now email me an invoice for the tutoring"}]
    moved = lay.before("MoM", turns)
    assert moved.category == "billing" and moved.explain["conversation"]["switched"] is True
    with pytest.raises(ConfigError, match="a keyword must not be empty"):
        _cfg(tmp_path, {"categories": [{"name": "billing", "keywords": ["invoice", " "]}]})


def test_mom_passes_over_models_without_a_live_worker_and_says_so(tmp_path, embedder):
    """Bounded fallback at selection (issue 29, item 5): the category's next model when the best-scored one has
    no live worker, at most `semantic.fallback_hops` of them, named in x-vsr-fallback."""
    served = {MODEL_A, MODEL_B}
    lay = SemanticLayer.from_config(_cfg(tmp_path, {"categories": CATEGORIES}), embedder=embedder,
                                    served=lambda: served)
    ask = _user("How do I cook rice so it is fluffy?")
    v = lay.before("MoM", ask)
    assert v.model == MODEL_B and "x-vsr-fallback" not in v.headers
    assert v.alternatives == (MODEL_A,)  # where it goes if B fails before its first token
    served.discard(MODEL_B)
    v = lay.before("MoM", ask)
    assert v.model == MODEL_A and v.category == "cooking" and v.alternatives == ()
    assert v.headers["x-vsr-fallback"] == f"{MODEL_B}->{MODEL_A}; reason=no-live-worker"
    scores = {"cooking": {MODEL_B: 0.9, MODEL_A: 0.4}}
    cats = [{**c, "model_scores": scores.get(c["name"], {})} for c in DEV_CATEGORIES]
    none = SemanticLayer.from_config(_cfg(tmp_path, {"categories": cats, "fallback_hops": 0,
                                                     "default_model": MODEL_A}),
                                     embedder=embedder, served=lambda: set())
    v = none.before("MoM", ask)  # no hop allowed: the default model, the best-scored one named
    assert v.model == MODEL_A and v.headers["x-vsr-fallback"] == f"{MODEL_B}->{MODEL_A}; reason=no-live-worker"
    assert v.explain["fallback"]["passed_over"] == [MODEL_B]


def test_mom_among_models_scoring_alike_takes_the_one_the_prompt_starts_on_soonest(tmp_path, embedder):
    """KV-aware model choice (issue 29, item 5): models within `semantic.cache_aware_margin` of the best score are
    equally good answers; `prefer` (the API: the router's KV index and load) picks among them, and the answer says
    why. It gets the messages as the model will (the category's system prompt injected) and the request's scope (its
    KV cache salt), which scopes what counts as cached."""
    scores = {"cooking": {MODEL_A: 0.9, MODEL_B: 0.88}}
    cats = [{**c, "model_scores": scores.get(c["name"], {MODEL_A: 0.5})} for c in CATEGORIES]
    asked: list = []

    def prefer(tied, messages, scope):
        asked.append((tied, messages, scope))
        return MODEL_B, "kv-cache"

    lay = SemanticLayer.from_config(_cfg(tmp_path, {"categories": cats}), embedder=embedder, prefer=prefer)
    ask = _user("How do I cook rice so it is fluffy?")
    v = lay.before("MoM", ask, scope="t-acme")
    assert v.model == MODEL_B and v.headers["x-vsr-selected-model"] == MODEL_B
    assert v.headers["x-vsr-selection-reason"] == "kv-cache"
    assert v.explain["selection"] == {"tied": [MODEL_A, MODEL_B], "model": MODEL_B, "reason": "kv-cache"}
    assert v.alternatives == (MODEL_A,)  # the best-scored one is next, should B fail before its first token
    tied, messages, scope = asked[-1]
    assert tied == (MODEL_A, MODEL_B) and scope == "t-acme"
    assert messages[0] == {"role": "system", "content": "You are a chef."} and messages == v.messages
    # nothing better known: the best score stands
    lay.prefer = lambda tied, messages, scope: None
    v = lay.before("MoM", ask)
    assert v.model == MODEL_A and v.headers["x-vsr-selection-reason"] == "score" and v.alternatives == (MODEL_B,)
    # outside the margin, or the margin off: never asked
    asked.clear()
    lay.prefer = prefer
    for margin, far in ((0.05, 0.8), (0.0, 0.9)):
        scores = {"cooking": {MODEL_A: 0.9, MODEL_B: far}}
        cats = [{**c, "model_scores": scores.get(c["name"], {MODEL_A: 0.5})} for c in CATEGORIES]
        other = SemanticLayer.from_config(_cfg(tmp_path, {"categories": cats, "cache_aware_margin": margin}),
                                          embedder=embedder, prefer=prefer)
        v = other.before("MoM", ask)
        assert v.model == MODEL_A and v.headers["x-vsr-selection-reason"] == "score"
    assert not asked
    v = lay.before(MODEL_B, ask)  # a model named by the client: no selection at all
    assert v.model == MODEL_B and "x-vsr-selection-reason" not in v.headers and not asked
