"""A jailbreak check the farm asks over HTTP: a prompt classifier or a generative guard the operator serves
(`semantic.jailbreak.remote`).

Three wire shapes, each read as a probability per label:
- `vllm`: `vllm serve --runner pooling` of a sequence classifier, POST `/classify` with
  `{"model", "input": [texts]}` -> `{"data": [{"index", "label", "probs": [...]}]}`; `probs` is by class index,
  so the configured `labels` give the classes' order, and the answer's own top `label` must agree with it.
- `http_classify`: the Hugging Face text-classification shape (TEI, a `transformers` pipeline server), as the
  Semantic Router's `prompt_guard.protocol: http_classify` sends it: `{"inputs": text}` ->
  `[{"label", "score"}, ...]`, every configured label once, scores summing to 1.
- `chat`: a generative guard (Llama Guard, Qwen3Guard, ShieldGemma) behind an OpenAI-compatible chat endpoint, as
  the Router's `http_chat`: one user message (`prompt` around the text), greedy; the answer's first whole-word
  verdict among `labels` (`verdict`: "unsafe\nS1" -> unsafe, "Safety: Unsafe" -> Unsafe) gets probability 1, so a
  positive verdict blocks; with `score: logprobs` each label gets its share among the candidates for the verdict's
  first token (`verdict_token_shares`), a probability `threshold` weighs.

An answer that does not fit (a label not configured, a missing one, probabilities that are not a distribution)
is a `RemoteGuardError`, like a timeout: the layer then applies `on_error`, never a verdict read from a
misconfigured guard.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import requests
from requests.adapters import HTTPAdapter

from farm.config.semantic import RemoteGuardConfig
from farm.semantic.decoding import decoded_forms

SUM_TOLERANCE = 0.02  # how far a distribution's sum may drift from 1 (rounding in whatever serialized it)
POOL_SIZE = 32  # connections kept to the guard per API process (one request per message asked)
TOP_LOGPROBS = 20  # candidates asked for per answer token with `score: logprobs` (OpenAI's and vLLM's most)


def windows(text: str, size: int) -> list[str]:
    """`text`, or overlapping windows of `size` characters covering it (a tenth overlapping, so a phrase cut by one
    window's edge is whole in the next), each starting at a word boundary where one is near."""
    if len(text) <= size:
        return [text]
    step = size - size // 10
    out, start = [], 0
    while True:
        out.append(text[start:start + size])
        if start + size >= len(text):
            return out
        nxt = start + step
        space = text.rfind(" ", nxt - size // 20, nxt)  # back to a space within 5% of the window, if any
        start = space + 1 if space > start else nxt


def _verdict_at(answer: str, labels: Sequence[str]) -> tuple[int, str] | None:
    """Where the answer's verdict word starts, and which label it is (see `verdict`)."""
    close = answer.lower().rfind("</think>")
    start = close + len("</think>") if close >= 0 else 0  # a reasoning guard's thoughts are not its verdict
    if "<think>" in answer[start:].lower():
        return None  # cut off before the thoughts ended: no verdict yet
    found = [(m.start() + start, label) for label in labels
             if (m := re.search(rf"(?<!\w){re.escape(label)}(?!\w)", answer[start:], re.I)) is not None]
    return min(found) if found else None


def verdict(answer: str, labels: Sequence[str]) -> str | None:
    """The first of `labels` that `answer` names as a whole word, case aside (so `safe` is not read in `unsafe`
    nor in `Safety:`), after any `<think>` block; None when it names none, or is still thinking."""
    found = _verdict_at(answer, labels)
    return found[1] if found else None


def verdict_token_shares(content: str, tokens: Sequence[dict], labels: Sequence[str]) -> list[float] | None:
    """Each label's probability from a chat answer's log-probabilities (OpenAI's `logprobs.content`: per token its
    `token`, `logprob` and `top_logprobs`): at the token where the answer's verdict word (`verdict`) starts, the
    candidates that begin one label and no other, each label's summed probability over theirs. None when the answer
    has no verdict or the log-probabilities do not cover it."""
    found = _verdict_at(content, labels)
    if found is None:
        return None
    at, pos = found[0], 0
    for entry in tokens:
        token = entry.get("token") if isinstance(entry, dict) else None
        if not isinstance(token, str):
            return None
        if pos + len(token) > at:  # the token the verdict word starts in
            shares = [0.0] * len(labels)
            seen = set()
            for cand in [entry, *(entry.get("top_logprobs") or [])]:
                text, lp = (cand.get("token"), cand.get("logprob")) if isinstance(cand, dict) else (None, None)
                if not isinstance(text, str) or not isinstance(lp, int | float) or text in seen:
                    continue
                seen.add(text)
                stem = text.strip().lower()
                begins = [i for i, x in enumerate(labels) if stem and x.lower().startswith(stem)]
                if len(begins) == 1 and -1e300 < lp <= 0:  # a log-probability (a huge int would overflow exp)
                    shares[begins[0]] += math.exp(lp)
            total = sum(shares)
            return [x / total for x in shares] if total > 0 else None
        pos += len(token)
    return None


class RemoteGuardError(RuntimeError):
    """The guard could not give a verdict: unreachable, timed out, or an answer that is not a distribution over
    the configured labels."""


class RemoteGuard:
    """Asks the configured guard; `attack_probabilities(texts)` -> each text's summed positive-label
    probability, and its most likely positive label."""

    def __init__(self, cfg: RemoteGuardConfig) -> None:
        self.cfg = cfg
        self._session = requests.Session()
        adapter = HTTPAdapter(pool_connections=1, pool_maxsize=POOL_SIZE)
        self._session.mount("http://", adapter)
        self._session.mount("https://", adapter)
        self._headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if cfg.api_key:
            self._headers["Authorization"] = f"Bearer {cfg.api_key}"
        self._positive = [cfg.labels.index(x) for x in cfg.positive_labels]
        self._ask = {"vllm": self._vllm, "http_classify": self._each(self._one_http_classify),
                     "chat": self._each(self._one_chat)}[cfg.protocol]  # texts -> each one's label probabilities

    def attack_probabilities(self, texts: Sequence[str]) -> list[tuple[float, str]]:
        """(summed probability of the positive labels, the most likely positive label) per text, in order: the worst
        of what the text is read as, its windows (`windows`) and, like the head, what it decodes to (base64, hex,
        ROT13: farm.semantic.decoding), so an encoded attack is judged as the guard would judge it in the clear."""
        if not texts:
            return []
        pieces = [[w for form in (t, *decoded_forms(t)) for w in windows(form, self.cfg.chunk_chars)] for t in texts]
        flat = [w for p in pieces for w in p]
        rows = self._ask(flat)
        scored = []
        for probs in rows:
            top = max(self._positive, key=lambda i: probs[i])
            scored.append((min(1.0, sum(probs[i] for i in self._positive)), self.cfg.labels[top]))
        out, at = [], 0
        for p in pieces:
            out.append(max(scored[at:at + len(p)], key=lambda s: s[0]))
            at += len(p)
        return out

    # -- the wire shapes ---------------------------------------------------------------------------------
    def _post(self, body: dict) -> object:
        try:
            resp = self._session.post(self.cfg.url, json=body, headers=self._headers, timeout=self.cfg.timeout_s)
        except requests.RequestException as e:
            raise RemoteGuardError(f"remote guard {self.cfg.url} unreachable: {type(e).__name__}") from None
        if not resp.ok:
            raise RemoteGuardError(f"remote guard {self.cfg.url} answered HTTP {resp.status_code}: {resp.text[:200]}")
        try:
            return resp.json()
        except ValueError:
            raise RemoteGuardError(f"remote guard {self.cfg.url} answered something that is not JSON") from None

    def _vllm(self, texts: list[str]) -> list[list[float]]:
        body: dict = {"input": texts, "truncate_prompt_tokens": -1}  # a window over the context: cut, not refused
        if self.cfg.model:
            body["model"] = self.cfg.model
        answer = self._post(body)
        data = answer.get("data") if isinstance(answer, dict) else None
        if not isinstance(data, list) or len(data) != len(texts):
            raise RemoteGuardError(f"remote guard answered {len(data) if isinstance(data, list) else 'no'} "
                                   f"results for {len(texts)} texts")
        rows: list[list[float]] = [[]] * len(texts)
        for item in data:
            index, probs = item.get("index"), item.get("probs")
            if not isinstance(index, int) or not 0 <= index < len(texts) or not isinstance(probs, list):
                raise RemoteGuardError("remote guard answered a result without a valid index and probs")
            if len(probs) != len(self.cfg.labels):
                raise RemoteGuardError(f"remote guard's classifier has {len(probs)} classes; labels name "
                                       f"{len(self.cfg.labels)}: {self.cfg.labels}")
            checked = self._distribution(probs)
            label = item.get("label")
            if label is not None and label != self.cfg.labels[max(range(len(checked)), key=checked.__getitem__)]:
                raise RemoteGuardError(f"remote guard's top label {label!r} is not labels[argmax(probs)]: the "
                                       f"classes' order is not {self.cfg.labels}")
            rows[index] = checked
        if any(not row for row in rows):
            raise RemoteGuardError("remote guard answered one text twice and another not at all")
        return rows

    @staticmethod
    def _each(ask_one: Callable[[str], list[float]]) -> Callable[[list[str]], list[list[float]]]:
        """A shape that takes one text per request: the texts' requests sent together."""
        def ask(texts: list[str]) -> list[list[float]]:
            if len(texts) == 1:
                return [ask_one(texts[0])]
            with ThreadPoolExecutor(min(len(texts), 8)) as pool:
                return list(pool.map(ask_one, texts))
        return ask

    def _one_http_classify(self, text: str) -> list[float]:
        answer = self._post({"inputs": text})
        if isinstance(answer, list) and len(answer) == 1 and isinstance(answer[0], list):
            answer = answer[0]  # a pipeline server may wrap one input's scores in a list of one
        if not isinstance(answer, list) or not all(isinstance(x, dict) for x in answer):
            raise RemoteGuardError("remote guard's answer is not a list of {label, score}")
        scores: dict[str, float] = {}
        for item in answer:
            label = item.get("label")
            if label not in self.cfg.labels:
                raise RemoteGuardError(f"remote guard answered label {label!r}, not one of {self.cfg.labels}")
            if label in scores:
                raise RemoteGuardError(f"remote guard answered label {label!r} twice")
            scores[label] = item.get("score")  # type: ignore[assignment]
        missing = [x for x in self.cfg.labels if x not in scores]
        if missing:
            raise RemoteGuardError(f"remote guard's answer misses labels {missing} (top-k answers are refused: "
                                   "a missing positive label would read as no risk)")
        return self._distribution([scores[x] for x in self.cfg.labels])

    def _one_chat(self, text: str) -> list[float]:
        body: dict = {"messages": [{"role": "user", "content": self.cfg.prompt.replace("{text}", text)}],
                      "temperature": 0, "max_tokens": self.cfg.max_tokens}
        if self.cfg.model:
            body["model"] = self.cfg.model
        if self.cfg.choice:
            body["structured_outputs"] = {"choice": self.cfg.labels}
        if self.cfg.score == "logprobs":
            body.update(logprobs=True, top_logprobs=TOP_LOGPROBS)
        answer = self._post(body)
        try:
            choice = answer["choices"][0]  # type: ignore[index]
            content = choice["message"]["content"]
        except (KeyError, IndexError, TypeError):
            choice, content = None, None
        if not isinstance(content, str):
            raise RemoteGuardError("remote guard's answer is not a chat completion with a message")
        label = verdict(content, self.cfg.labels)
        if label is None:
            raise RemoteGuardError(f"remote guard's answer names none of {self.cfg.labels}: {content[:100]!r}")
        if self.cfg.score == "verdict":
            return [1.0 if x == label else 0.0 for x in self.cfg.labels]
        logprobs = choice.get("logprobs")
        tokens = logprobs.get("content") if isinstance(logprobs, dict) else None
        shares = verdict_token_shares(content, tokens, self.cfg.labels) if isinstance(tokens, list) else None
        if shares is None:
            raise RemoteGuardError("remote guard's answer has no log-probabilities for its verdict (score: logprobs "
                                   "needs a server that returns them, as vLLM does)")
        return shares

    @staticmethod
    def _distribution(probs: list) -> list[float]:
        try:
            values = [float(p) for p in probs]
        except (TypeError, ValueError, OverflowError):  # OverflowError: an int beyond a float's range
            raise RemoteGuardError("remote guard answered a probability that is not a number") from None
        if not all(math.isfinite(p) and 0.0 <= p <= 1.0 for p in values):
            raise RemoteGuardError(f"remote guard answered probabilities outside [0, 1]: {values}")
        if abs(sum(values) - 1.0) > SUM_TOLERANCE:
            raise RemoteGuardError(f"remote guard's probabilities sum to {sum(values):.3f}, not 1")
        return values
