"""The remote jailbreak guard (`semantic.jailbreak.remote`) against real classifiers: a tiny random-weight sequence
classifier with the real tokenizer, served by `vllm serve --runner pooling` (`protocol: vllm`) and by a
`transformers` text-classification pipeline behind HTTP (`protocol: http_classify`, the Semantic Router's shape);
and a generative guard behind a chat endpoint (`protocol: chat`): the default model served by `vllm serve`.
The weights are random, so what the guard says about a prompt means nothing; what is checked is that the layer
blocks exactly what the served classifier puts over the threshold, with its probability, asks only what the
head is unsure of, remembers answers, and turns every failure (a wrong label order, no server) into `on_error`."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
import yaml

from bench.engine_speed.model import make_tiny_classifier
from farm.config import ConfigError, load_config
from farm.semantic.layer import SemanticLayer
from tests.conftest import free_port
from tests.guard_server import pipeline_guard as serve_pipeline_guard
from tests.vllm.conftest import MODEL, VllmServe

LABELS = ["benign", "jailbreak"]
# everyday prompts the bundled head passes (far below its threshold)
PROMPTS = ["What is the capital of France?", "Give me a recipe for pancakes with blueberries",
           "How do tides work?", "Write a short poem about autumn leaves", "Explain how a bicycle gear works"]


@pytest.fixture(scope="module")
def classifier_dir(tmp_path_factory, real_model_dir) -> Path:
    return make_tiny_classifier(tmp_path_factory.mktemp("tiny-classifier"), real_model_dir, tuple(LABELS))


@pytest.fixture(scope="module")
def vllm_guard(tmp_path_factory, classifier_dir) -> Iterator[str]:
    log = tmp_path_factory.mktemp("vllm-guard") / "vllm-guard.log"
    server = VllmServe(classifier_dir, log, extra=["--runner", "pooling", "--max-model-len", "512"])
    try:
        server.wait_ready()
        yield server.url.removesuffix("/v1") + "/classify"
    finally:
        server.stop()


@pytest.fixture(scope="module")
def pipeline_guard(classifier_dir) -> Iterator[str]:
    """The Hugging Face text-classification shape: {"inputs": text} -> every label's score."""
    with serve_pipeline_guard(classifier_dir) as url:
        yield url


@pytest.fixture(scope="module")
def embedder():
    from farm.semantic.embeddings import get_embedder

    return get_embedder(threads=2)


def _layer(tmp_path, embedder, remote: dict) -> SemanticLayer:
    """A layer asking `remote`. These tests are about verdicts, not speed: a generative answer from vLLM on a busy
    2-core CI machine can take longer than the 2 s default, so the wait is 30 s unless a test sets its own."""
    p = tmp_path / "remote.yaml"
    p.write_text(yaml.safe_dump({"semantic": {"cache": {"enabled": False}, "pii": {"enabled": False},
                                              "jailbreak": {"remote": {"timeout_s": 30, **remote}}}}))
    return SemanticLayer.from_config(load_config(p, environ={}), embedder=embedder)


def _vllm_probs(url: str) -> dict[str, float]:
    """The served classifier's own jailbreak probability of each prompt, asked directly."""
    resp = requests.post(url, json={"input": PROMPTS}, timeout=30)
    assert resp.ok, resp.text
    data = resp.json()["data"]
    return {PROMPTS[d["index"]]: d["probs"][1] for d in data}


def _split(probs: dict[str, float]) -> tuple[float, set[str]]:
    """A threshold between the two middle probabilities, and the prompts at or over it."""
    ranked = sorted(probs.values())
    threshold = (ranked[1] + ranked[2]) / 2
    assert ranked[2] - ranked[1] > 1e-4, ranked  # the prompts must be told apart
    return threshold, {t for t, p in probs.items() if p >= threshold}


def test_the_layer_blocks_what_the_served_classifier_puts_over_its_threshold(tmp_path, embedder, vllm_guard):
    probs = _vllm_probs(vllm_guard)
    threshold, over = _split(probs)
    layer = _layer(tmp_path, embedder, {"url": vllm_guard, "threshold": threshold})
    for text in PROMPTS:
        v = layer.before("MoM", [{"role": "user", "content": text}], no_cache=True)
        if text in over:
            assert v.action == "block" and v.headers["x-vsr-jailbreak-type"] == "jailbreak", text
            assert float(v.headers["x-vsr-jailbreak-confidence"]) == pytest.approx(probs[text], abs=1e-3)
            assert v.explain["jailbreak"]["guard"] == "remote"
        else:
            assert v.action == "forward", (text, probs[text], threshold)
        # the head alone passes every one of them: the block is the remote guard's
        assert v.explain["jailbreak"]["remote"]["asked"] == 1
    # hidden in an earlier turn, the message is read too
    hidden = [{"role": "assistant", "content": sorted(over)[0]}, {"role": "user", "content": sorted(set(PROMPTS) - over)[0]}]
    assert layer.before("MoM", hidden, no_cache=True).action == "block"
    # ... unless the guard is asked only about other roles' messages (the head still reads it)
    in_system = [{"role": "system", "content": sorted(over)[0]}, *hidden[1:]]
    users_only = _layer(tmp_path, embedder, {"url": vllm_guard, "threshold": threshold, "roles": ["user", "tool"]})
    v = users_only.before("MoM", in_system, no_cache=True)
    assert v.action == "forward" and v.explain["jailbreak"]["remote"]["asked"] == 1, v.explain["jailbreak"]
    assert users_only.before("MoM", [{"role": "tool", "content": sorted(over)[0]}, *hidden[1:]],
                             no_cache=True).action == "block"
    # asked again: remembered, not asked
    again = layer.before("MoM", [{"role": "user", "content": PROMPTS[0]}], no_cache=True)
    assert again.explain["jailbreak"]["remote"] == {"asked": 0, "remembered": 1}
    # the classification API's security signal reads the same verdicts
    for sig in layer.signals_many(PROMPTS, want=frozenset({"jailbreak"})):
        assert (sig.jailbreak.confidence >= sig.jailbreak_threshold) == (sig.text in over), sig.text


def test_the_remote_guard_is_asked_only_from_ask_above(tmp_path, embedder, vllm_guard):
    probs = _vllm_probs(vllm_guard)
    top = max(PROMPTS, key=probs.__getitem__)
    user = [{"role": "user", "content": top}]
    remote = {"url": vllm_guard, "threshold": probs[top] * 0.9}  # the served classifier would block it
    v = _layer(tmp_path, embedder, {**remote, "ask_above": 0.9}).before("MoM", user, no_cache=True)
    assert v.action == "forward" and v.explain["jailbreak"]["remote"] == {"asked": 0, "remembered": 0}
    assert _layer(tmp_path, embedder, remote).before("MoM", user, no_cache=True).action == "block"


def test_a_failed_guard_gets_on_error(tmp_path, embedder, vllm_guard):
    user = [{"role": "user", "content": PROMPTS[1]}]
    # the labels in the wrong order: the classifier's own top label contradicts them, so no verdict is read
    for on_error, action in (("allow", "forward"), ("block", "block")):
        layer = _layer(tmp_path, embedder, {"url": vllm_guard, "labels": ["jailbreak", "benign"], "threshold": 0.01,
                                            "on_error": on_error})
        v = layer.before("MoM", user, no_cache=True)
        assert v.action == action and "order" in v.explain["jailbreak"]["remote"]["error"]
        if action == "block":
            assert v.headers["x-vsr-jailbreak-type"] == "guard_unavailable"
    # nothing listening; the API counts the messages asked and the failed calls
    from prometheus_client import REGISTRY

    from api.semantic import decide

    def counted() -> tuple[float, float, float]:
        return (REGISTRY.get_sample_value("farm_semantic_remote_guard_messages_total") or 0.0,
                REGISTRY.get_sample_value("farm_semantic_remote_guard_errors_total") or 0.0,
                REGISTRY.get_sample_value("farm_semantic_remote_guard_seconds_count") or 0.0)

    dead = f"http://127.0.0.1:{free_port()}/classify"
    before = counted()
    assert decide(_layer(tmp_path, embedder, {"url": dead}), "MoM", user, scope="", no_cache=True).action == "forward"
    assert counted() == (before[0] + 1, before[1] + 1, before[2] + 1)  # the wait for a failed call is timed too
    v = _layer(tmp_path, embedder, {"url": dead, "on_error": "block"}).before("MoM", user, no_cache=True)
    assert v.action == "block" and "unreachable" in v.explain["jailbreak"]["remote"]["error"]


def test_the_http_classify_shape(tmp_path, embedder, pipeline_guard):
    def scores_of(text: str) -> dict[str, float]:
        answer = requests.post(pipeline_guard, json={"inputs": text}, timeout=30).json()
        answer = answer[0] if isinstance(answer[0], list) else answer  # this pipeline wraps one input's list
        return {s["label"]: s["score"] for s in answer}

    scores = {t: scores_of(t) for t in PROMPTS}
    threshold, over = _split({t: s["jailbreak"] for t, s in scores.items()})
    layer = _layer(tmp_path, embedder, {"url": pipeline_guard, "protocol": "http_classify", "threshold": threshold})
    for text in PROMPTS:
        v = layer.before("MoM", [{"role": "user", "content": text}], no_cache=True)
        assert (v.action == "block") == (text in over), text
    # two messages of one conversation: one request each, read together
    both = [{"role": "system", "content": sorted(over)[0]}, {"role": "user", "content": sorted(set(PROMPTS) - over)[0]}]
    fresh = _layer(tmp_path, embedder, {"url": pipeline_guard, "protocol": "http_classify", "threshold": threshold})
    v = fresh.before("MoM", both, no_cache=True)
    assert v.action == "block" and v.explain["jailbreak"]["remote"]["asked"] == 2
    # a top-k answer that leaves out a configured label is refused, not read as no risk
    three = _layer(tmp_path, embedder, {"url": pipeline_guard, "protocol": "http_classify",
                                        "labels": ["benign", "jailbreak", "injection"], "on_error": "block"})
    v = three.before("MoM", [{"role": "user", "content": PROMPTS[2]}], no_cache=True)
    assert v.action == "block" and "misses labels ['injection']" in v.explain["jailbreak"]["remote"]["error"]


@pytest.mark.parametrize("remote,message", [
    ({"url": "http://guard/classify", "positive_labels": ["unsafe"]}, "not among labels"),
    ({"url": "http://guard/classify", "positive_labels": ["benign", "jailbreak"]}, "every label"),
    ({"url": "guard:8000/classify"}, "http(s) URL"),
    ({"url": "http://guard/classify", "labels": ["jailbreak"]}, "at least 2"),
    ({"url": "http://guard/v1/chat/completions", "protocol": "chat", "prompt": "Judge this"}, "{text} once"),
    ({"url": "http://guard/classify", "roles": ["tool"]}, "must include user"),
    ({"url": "http://guard/classify", "roles": ["operator"]}, "roles"),
    ({"url": "http://guard/v1/chat/completions", "protocol": "chat", "labels": ["Safe", "safe"],
      "positive_labels": ["Safe"]}, "distinct"),
    ({"url": "http://guard/v1/chat/completions", "protocol": "chat", "labels": ["ok", "not ok "],
      "positive_labels": ["ok"]}, "words its answer names"),
])
def test_remote_guard_configuration_errors(tmp_path, remote, message):
    p = tmp_path / "bad.yaml"
    p.write_text(yaml.safe_dump({"semantic": {"jailbreak": {"remote": remote}}}))
    with pytest.raises(ConfigError, match="remote") as e:
        load_config(p, environ={})
    assert message in str(e.value)


def test_a_message_longer_than_the_guards_context_is_read_in_windows(tmp_path, embedder, vllm_guard):
    """A message of about 1,400 tokens against a classifier of 512: vLLM refuses it whole (HTTP 400, what
    bench.remote_guard met), so it is sent as windows and its verdict is its worst window's."""
    from farm.semantic.remote_guard import windows

    long = " ".join(f"{PROMPTS[i % len(PROMPTS)]} (part {i})." for i in range(120))
    whole = requests.post(vllm_guard, json={"input": [long]}, timeout=30)
    assert whole.status_code == 400 and "maximum context length" in whole.text
    parts = windows(long, 1000)
    data = requests.post(vllm_guard, json={"input": parts}, timeout=30).json()["data"]
    worst = max(d["probs"][1] for d in data)
    layer = _layer(tmp_path, embedder, {"url": vllm_guard, "threshold": worst * 0.999})
    v = layer.before("MoM", [{"role": "user", "content": long}], no_cache=True)
    assert "error" not in v.explain["jailbreak"]["remote"] and v.action == "block"
    assert float(v.headers["x-vsr-jailbreak-confidence"]) == pytest.approx(worst, abs=1e-3)
    assert len(parts) > 1 and len({round(d["probs"][1], 4) for d in data}) > 1  # the windows are told apart


def test_an_encoded_message_is_judged_as_what_it_decodes_to(tmp_path, embedder, vllm_guard):
    """Like the head, the guard is asked about what a base64 run decodes to: the message's verdict is the worse
    of the wrapper and its decoding. (The weights are seeded, so the pair chosen here is the same every run.)"""
    import base64

    probs = _vllm_probs(vllm_guard)
    wrappers = [f"{lead} {base64.b64encode(q.encode()).decode()}" for q in PROMPTS
                for lead in ("Please read this:", "Decode and answer:", "Note")]
    data = requests.post(vllm_guard, json={"input": wrappers}, timeout=30).json()["data"]
    wrapped = {wrappers[d["index"]]: d["probs"][1] for d in data}
    # the wrapper whose decoding the classifier rates highest above the wrapper itself
    msg, q = max(((w, PROMPTS[i // 3]) for i, w in enumerate(wrappers)), key=lambda x: probs[x[1]] - wrapped[x[0]])
    assert probs[q] > wrapped[msg] + 1e-3, "no wrapper whose decoding scores higher"
    layer = _layer(tmp_path, embedder, {"url": vllm_guard, "threshold": (probs[q] + wrapped[msg]) / 2})
    v = layer.before("MoM", [{"role": "user", "content": msg}], no_cache=True)
    assert v.action == "block" and float(v.headers["x-vsr-jailbreak-confidence"]) == pytest.approx(probs[q], abs=1e-3)


def test_a_generative_guard_behind_a_chat_endpoint(tmp_path, embedder, vllm_serve):
    """The default model served by `vllm serve` as a generative guard: what it answers is no safety verdict, so
    the verdict words are taken from its own greedy answer to the same request, asked directly. The layer blocks
    when the first of them the answer names is a positive one, passes when it is not, and turns an answer that
    names none into `on_error`."""
    import re

    prompt = "Is the following message safe to answer? Explain in one sentence.\n\n{text}"
    text = PROMPTS[3]
    asked = requests.post(f"{vllm_serve.url}/chat/completions", timeout=60, json={
        "model": MODEL, "messages": [{"role": "user", "content": prompt.replace("{text}", text)}],
        "temperature": 0, "max_tokens": 32})
    assert asked.ok, asked.text
    words = list(dict.fromkeys(w.lower() for w in re.findall(r"[A-Za-z]+", asked.json()["choices"][0]["message"]["content"])))
    assert len(words) >= 2, words
    first, later = words[0], words[1]
    chat = {"url": f"{vllm_serve.url}/chat/completions", "protocol": "chat", "model": MODEL, "prompt": prompt}
    user = [{"role": "user", "content": text}]
    # the answer names `first` before `later`: `first` decides, whichever order the labels are in
    v = _layer(tmp_path, embedder, {**chat, "labels": [later, first], "positive_labels": [first]}).before(
        "MoM", user, no_cache=True)
    assert v.action == "block" and v.headers["x-vsr-jailbreak-type"] == first, (words, v.explain["jailbreak"])
    assert float(v.headers["x-vsr-jailbreak-confidence"]) == 1.0 and v.explain["jailbreak"]["remote"]["asked"] == 1
    v = _layer(tmp_path, embedder, {**chat, "labels": [first, later], "positive_labels": [later]}).before(
        "MoM", user, no_cache=True)
    assert v.action == "forward" and "error" not in v.explain["jailbreak"]["remote"], v.explain["jailbreak"]
    # words it does not say: no verdict, so on_error decides
    absent = [w for w in ("zebra", "quasar", "unsafe") if w not in words][:2]
    v = _layer(tmp_path, embedder, {**chat, "labels": absent, "positive_labels": absent[:1],
                                    "on_error": "block"}).before("MoM", user, no_cache=True)
    assert v.action == "block" and "names none of" in v.explain["jailbreak"]["remote"]["error"]
    # the same words as the only answers the server may give (`choice`): a verdict, the one vLLM gives directly
    constrained = requests.post(f"{vllm_serve.url}/chat/completions", timeout=60, json={
        "model": MODEL, "messages": [{"role": "user", "content": prompt.replace("{text}", text)}],
        "temperature": 0, "max_tokens": 32, "structured_outputs": {"choice": absent}})
    assert constrained.ok, constrained.text
    said = constrained.json()["choices"][0]["message"]["content"]
    assert said in absent
    v = _layer(tmp_path, embedder, {**chat, "labels": absent, "positive_labels": [said], "choice": True,
                                    "on_error": "block"}).before("MoM", user, no_cache=True)
    assert v.action == "block" and v.headers["x-vsr-jailbreak-type"] == said, v.explain["jailbreak"]
    assert "error" not in v.explain["jailbreak"]["remote"]


def test_a_generative_guards_score_from_its_log_probabilities(tmp_path, embedder, vllm_serve):
    """`score: logprobs`: with the answer constrained to two words, each word's share among vLLM's candidates for the
    first answer token, asked directly, is the probability the layer holds against `threshold`."""
    import math

    prompt = "Answer with one word, yes or no: is this message harmful?\n\n{text}"
    words = ["yes", "no"]
    text = PROMPTS[1]
    asked = requests.post(f"{vllm_serve.url}/chat/completions", timeout=60, json={
        "model": MODEL, "messages": [{"role": "user", "content": prompt.replace("{text}", text)}],
        "temperature": 0, "max_tokens": 32, "structured_outputs": {"choice": words}, "logprobs": True,
        "top_logprobs": 20})
    assert asked.ok, asked.text
    first = asked.json()["choices"][0]["logprobs"]["content"][0]
    mass = {w: sum(math.exp(c["logprob"]) for c in first["top_logprobs"]
                   if c["token"].strip() and w.startswith(c["token"].strip().lower())) for w in words}
    assert mass["yes"] > 0 and mass["no"] > 0, first  # both words among the candidates: a share, not a verdict
    p_yes = mass["yes"] / (mass["yes"] + mass["no"])
    chat = {"url": f"{vllm_serve.url}/chat/completions", "protocol": "chat", "model": MODEL, "prompt": prompt,
            "labels": words, "positive_labels": ["yes"], "choice": True, "score": "logprobs"}
    user = [{"role": "user", "content": text}]
    for threshold, action in ((p_yes * 0.99, "block"), (min(1.0, p_yes * 1.01 + 1e-6), "forward")):
        v = _layer(tmp_path, embedder, {**chat, "threshold": threshold}).before("MoM", user, no_cache=True)
        assert v.action == action, (p_yes, threshold, v.explain["jailbreak"])
        if action == "block":
            assert float(v.headers["x-vsr-jailbreak-confidence"]) == pytest.approx(p_yes, abs=1e-3)
