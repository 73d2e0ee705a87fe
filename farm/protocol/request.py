"""The request message (Celery argument, JSON): `GenerationRequest` with its `SamplingParams`, checked as
untrusted input on arrival (anything holding the Redis password can send a task)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field, fields
from typing import Any

from farm.protocol.jsonsafe import one_of


class InvalidTask(ValueError):
    """A task message that must not run: wrong types, values out of range, oversized lists.

    Workers take tasks from Redis, which anything holding its password can write to; each task is
    checked here before it reaches an engine, and a bad one fails only its own request."""


MAX_ID_CHARS = 256
_ID = re.compile(rf"[A-Za-z0-9._:@-]{{1,{MAX_ID_CHARS}}}")  # request ids: chatcmpl-<hex>, <id>.m1, uuid hex
_QUEUE = re.compile(rf"farm\.[A-Za-z0-9._:@-]{{1,{MAX_ID_CHARS}}}")
MAX_CACHE_SALT_CHARS = 128  # vLLM's limit for cache_salt (which also refuses '@', '/', '\\' and NUL)
_CACHE_SALT = re.compile(rf"[A-Za-z0-9._:-]{{1,{MAX_CACHE_SALT_CHARS}}}")
MAX_STOP_SEQUENCES = 4
MAX_STOP_CHARS = 1024  # the engine scans a window of the longest stop string after every token
MAX_TEMPERATURE = 2.0
SEED_RANGE = (-(1 << 63), (1 << 64) - 1)  # what fits a 64-bit generator seed (signed or not)
GREEDY_BELOW_TEMPERATURE = 1e-5  # as vLLM's _SAMPLING_EPS
MAX_TOP_LOGPROBS = 20  # OpenAI's limit for top_logprobs
MAX_LOGIT_BIAS = 300  # OpenAI's limit of logit_bias entries
MAX_STOP_TOKEN_IDS = 64
MAX_ALLOWED_TOKEN_IDS = 65536  # vLLM's allowed_token_ids: at most the whole of a large vocabulary
MAX_LOGPROB_TOKEN_IDS = 128  # vLLM's MAX_LOGPROB_TOKEN_IDS
MAX_BAD_WORDS = 128  # vLLM's VLLM_MAX_NUM_BAD_WORDS: token sequences after tokenization (a word gives one or two)
# vLLM's VLLM_MAX_BAD_WORDS_TOTAL_TOKENS: its model runner checks it when the request is scheduled, where a
# ValueError kills the engine core (every request of the worker), so it is checked before
MAX_BAD_WORDS_TOTAL_TOKENS = 1024
MAX_BAD_WORD_CHARS = 256  # a word or short phrase; each is checked against the generated tokens after every step
MAX_RESPONSE_FORMAT_CHARS = 65536
RESPONSE_FORMATS = frozenset({"json_object", "json_schema"})  # OpenAI's response_format types (besides text)
# what a task's `response_format` may hold: OpenAI's, and vLLM's `structured_outputs` kinds that are no JSON schema
# ({"type": "regex", "regex": str}, {"type": "choice", "choice": [str, ...]}, {"type": "grammar", "grammar": str})
CONSTRAINTS = RESPONSE_FORMATS | {"regex", "choice", "grammar"}


def is_request_id(v: Any) -> bool:
    return isinstance(v, str) and _ID.fullmatch(v) is not None


def _int(v: Any, name: str, lo: int, hi: int) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        raise InvalidTask(f"{name} must be an integer in [{lo}, {hi}], got {str(v)[:40]!r}")
    return v


def _number(v: Any, name: str, lo: float, hi: float, lo_open: bool = False) -> float:
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not (lo < v if lo_open else lo <= v) or not v <= hi:
        raise InvalidTask(f"{name} must be a number in {'(' if lo_open else '['}{lo}, {hi}], got {str(v)[:40]!r}")
    return float(v)  # NaN fails both comparisons above


def _str(v: Any, name: str, pattern: re.Pattern[str] | None = None, empty_ok: bool = True,
         most: int = MAX_ID_CHARS) -> str:
    if not isinstance(v, str) or len(v) > most or (not v and not empty_ok) \
            or (v and pattern is not None and pattern.fullmatch(v) is None):
        raise InvalidTask(f"{name} must be a string of at most {most} allowed characters, "
                          f"got {str(v)[:40]!r}")
    return v


def _stops(v: Any) -> list[str]:
    if not isinstance(v, list) or len(v) > MAX_STOP_SEQUENCES \
            or not all(isinstance(x, str) and len(x) <= MAX_STOP_CHARS for x in v):
        raise InvalidTask(f"sampling.stop must be a list of at most {MAX_STOP_SEQUENCES} strings of at most "
                          f"{MAX_STOP_CHARS} characters")
    return list(v)


def _bad_words(v: Any) -> list[str]:
    if not isinstance(v, list) or len(v) > MAX_BAD_WORDS \
            or not all(isinstance(x, str) and 0 < len(x) <= MAX_BAD_WORD_CHARS for x in v):
        raise InvalidTask(f"sampling.bad_words must be a list of at most {MAX_BAD_WORDS} non-empty strings of at most "
                          f"{MAX_BAD_WORD_CHARS} characters")
    return list(v)


def _bool(v: Any, name: str) -> bool:
    if not isinstance(v, bool):
        raise InvalidTask(f"{name} must be a boolean")
    return v


def _token_ids(v: Any, name: str, most: int, vocab: int) -> list[int]:
    if not isinstance(v, list) or len(v) > most:
        raise InvalidTask(f"{name} must be a list of at most {most} token ids")
    return [_int(t, name, 0, vocab - 1) for t in v]


def _logit_bias(v: Any, vocab: int) -> dict[int, float]:
    """Token id -> bias in [-100, 100]; ids arrive as strings (JSON object keys)."""
    if not isinstance(v, dict) or len(v) > MAX_LOGIT_BIAS:
        raise InvalidTask(f"sampling.logit_bias must map at most {MAX_LOGIT_BIAS} token ids to biases")
    out = {}
    for k, b in v.items():
        tid = int(k) if isinstance(k, str) and k.isascii() and k.isdigit() and len(k) < 12 else k
        out[_int(tid, "sampling.logit_bias key", 0, vocab - 1)] = _number(b, "sampling.logit_bias value", -100, 100)
    return out


def _response_format(v: Any) -> dict[str, Any] | None:
    """None, {"type": "json_object"}, {"type": "json_schema", "json_schema": {"schema": {...}, ...}}, or one of
    vLLM's other structured outputs (CONSTRAINTS)."""
    if v is None:
        return None
    if not isinstance(v, dict) or not one_of(v.get("type"), CONSTRAINTS):
        raise InvalidTask(f"sampling.response_format must be an object with type in {sorted(CONSTRAINTS)}")
    kind = v["type"]
    if kind == "json_schema" and not isinstance((v.get("json_schema") or {}).get("schema"), dict):
        raise InvalidTask("sampling.response_format.json_schema.schema must be an object")
    if kind in ("regex", "grammar") and not isinstance(v.get(kind), str):
        raise InvalidTask(f"sampling.response_format.{kind} must be a string")
    if kind == "choice" and not (isinstance(v.get("choice"), list) and v["choice"]
                                 and all(isinstance(c, str) for c in v["choice"])):
        raise InvalidTask("sampling.response_format.choice must be a non-empty list of strings")
    if len(json.dumps(v)) > MAX_RESPONSE_FORMAT_CHARS:
        raise InvalidTask(f"sampling.response_format is larger than {MAX_RESPONSE_FORMAT_CHARS} characters")
    return v


@dataclass(frozen=True)
class _Bounds:
    """What a task's values are checked against: the model's context length and vocabulary size."""

    max_tokens: int
    vocab: int


# One check per field of SamplingParams (a field without one is taken as it comes).
_SAMPLING_CHECKS: dict[str, Any] = {
    "max_tokens": lambda v, b: _int(v, "sampling.max_tokens", 1, b.max_tokens),
    "temperature": lambda v, b: _number(v, "sampling.temperature", 0.0, MAX_TEMPERATURE),
    "top_p": lambda v, b: _number(v, "sampling.top_p", 0.0, 1.0, lo_open=True),
    "seed": lambda v, b: None if v is None else _int(v, "sampling.seed", *SEED_RANGE),
    "stop": lambda v, b: _stops(v),
    "ignore_eos": lambda v, b: _bool(v, "sampling.ignore_eos"),
    "presence_penalty": lambda v, b: _number(v, "sampling.presence_penalty", -2.0, 2.0),
    "frequency_penalty": lambda v, b: _number(v, "sampling.frequency_penalty", -2.0, 2.0),
    "repetition_penalty": lambda v, b: _number(v, "sampling.repetition_penalty", 0.0, 10.0, lo_open=True),
    "top_k": lambda v, b: _int(v, "sampling.top_k", 0, b.vocab),
    "min_p": lambda v, b: _number(v, "sampling.min_p", 0.0, 1.0),
    "min_tokens": lambda v, b: _int(v, "sampling.min_tokens", 0, b.max_tokens),
    "stop_token_ids": lambda v, b: _token_ids(v, "sampling.stop_token_ids", MAX_STOP_TOKEN_IDS, b.vocab),
    "logprobs": lambda v, b: None if v is None else _int(v, "sampling.logprobs", 0, MAX_TOP_LOGPROBS),
    "prompt_logprobs": lambda v, b: None if v is None else _int(v, "sampling.prompt_logprobs", 0, MAX_TOP_LOGPROBS),
    "logit_bias": lambda v, b: _logit_bias(v, b.vocab),
    "allowed_token_ids": lambda v, b: _token_ids(v, "sampling.allowed_token_ids", MAX_ALLOWED_TOKEN_IDS, b.vocab),
    "bad_words": lambda v, b: _bad_words(v),
    "logprob_token_ids": lambda v, b: _token_ids(v, "sampling.logprob_token_ids", MAX_LOGPROB_TOKEN_IDS, b.vocab),
    "response_format": lambda v, b: _response_format(v),
    "skip_special_tokens": lambda v, b: _bool(v, "sampling.skip_special_tokens"),
    "include_stop_str_in_output": lambda v, b: _bool(v, "sampling.include_stop_str_in_output"),
}


@dataclass
class SamplingParams:
    """How to sample one completion: OpenAI's parameters and vLLM's common extensions, with vLLM's meaning."""

    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    presence_penalty: float = 0.0  # minus this for every token already in the completion
    frequency_penalty: float = 0.0  # minus this times how often the token is already in the completion
    repetition_penalty: float = 1.0  # tokens of prompt and completion: logits > 0 divided, < 0 multiplied
    top_k: int = 0  # sample among the k most likely tokens (0: all)
    min_p: float = 0.0  # drop tokens less likely than min_p times the most likely one
    min_tokens: int = 0  # no end of sequence (EOS, stop_token_ids, stop strings) before this many tokens
    stop_token_ids: list[int] = field(default_factory=list)  # these end the completion (not shown)
    logprobs: int | None = None  # None: none; k: the sampled token's log-probability and the k most likely
    # None: none; k: each prompt token's log-probability (after the first) and the k most likely there (vLLM's
    # prompt_logprobs; the whole prompt is computed, no prefix-cache hit, and never on a separate prefill worker)
    prompt_logprobs: int | None = None
    # vLLM's: with logprobs, each generated token's log-probability and these tokens' (in this order) instead of
    # the k most likely
    logprob_token_ids: list[int] = field(default_factory=list)
    logit_bias: dict[int, float] = field(default_factory=dict)  # added to the logits before sampling
    allowed_token_ids: list[int] = field(default_factory=list)  # vLLM's: only these may be sampled (empty: all)
    # vLLM's: words whose last token may not complete them (each engine tokenizes them as vLLM does:
    # farm.models.tokenization.bad_words_token_ids)
    bad_words: list[str] = field(default_factory=list)
    response_format: dict[str, Any] | None = None  # json_object / json_schema: structured output (vLLM)
    skip_special_tokens: bool = True  # the completion's text leaves out special tokens (vLLM's default)
    # the stop string (or the text of the stop token: EOS, stop_token_ids) that ended the completion is kept
    include_stop_str_in_output: bool = False

    @property
    def greedy(self) -> bool:
        """Temperatures this close to 0 are greedy: dividing logits by a subnormal one gives inf/NaN."""
        return self.temperature < GREEDY_BELOW_TEMPERATURE

    @property
    def penalized(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    def to_dict(self) -> dict[str, Any]:
        """The wire form (lists and maps copied one level: dataclasses.asdict's deep copy costs more than the
        rest of a request's message put together)."""
        d = {name: getattr(self, name) for name in _SAMPLING_FIELDS}
        d["stop"], d["stop_token_ids"], d["logit_bias"] = list(self.stop), list(self.stop_token_ids), dict(self.logit_bias)
        d["allowed_token_ids"], d["bad_words"] = list(self.allowed_token_ids), list(self.bad_words)
        d["logprob_token_ids"] = list(self.logprob_token_ids)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any], max_model_len: int | None = None,
                  vocab_size: int | None = None) -> SamplingParams:
        """From a message; every field is type- and range-checked (InvalidTask): max_tokens against
        `max_model_len` and token ids against `vocab_size`, when given."""
        if not isinstance(d, dict):
            raise InvalidTask("sampling must be an object")
        bounds = _Bounds(max_model_len or (1 << 31), vocab_size or (1 << 32))
        out = {}
        for k in cls.__dataclass_fields__:
            if k in d:
                check = _SAMPLING_CHECKS.get(k)
                out[k] = check(d[k], bounds) if check is not None else d[k]
        return cls(**out)


@dataclass
class GenerationRequest:
    """What the API sends to workers (as a dict through Celery)."""

    request_id: str
    model: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    reply_to: str = ""  # the reader whose reply stream gets the events (reply_stream_key); "": nobody reads
    decode_queue: str = ""  # where the prefill worker sends the decode task
    created: float = 0.0
    lease_s: float = 0.0  # > 0: the reader holds reader_lease_key(reply_to); its lapse for this long orphans it
    origin: str = ""  # a migrated request: the original request id (its prompt ends with tokens generated)
    # prefix-cache scope, its tenant's (farm.tenancy.api_keys.tenant_cache_salt): blocks are shared only within one
    # salt, the hash chain starts from hashing.salt_root(cache_salt). "": no salt (a farm without API keys)
    cache_salt: str = ""
    # a migrated request: how many of its prompt's last tokens the model already generated (a structured output's
    # grammar resumes after them)
    generated: int = 0

    def to_dict(self) -> dict[str, Any]:
        d = {name: getattr(self, name) for name in _REQUEST_FIELDS}
        d["prompt_token_ids"] = list(self.prompt_token_ids)
        d["sampling"] = self.sampling.to_dict()
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any], *, vocab_size: int | None = None,
                  max_model_len: int | None = None) -> GenerationRequest:
        """From a task message, as untrusted input: InvalidTask unless every field has its type and range
        (token ids below `vocab_size`, at most `max_model_len` of them, when given)."""
        if not isinstance(d, dict):
            raise InvalidTask("the request must be an object")
        ids = d.get("prompt_token_ids")
        most = max_model_len or (1 << 20)
        if not isinstance(ids, list) or not 1 <= len(ids) <= most:
            raise InvalidTask(f"prompt_token_ids must be a list of 1 to {most} token ids")
        top = (vocab_size or (1 << 32)) - 1
        if not all(type(t) is int and 0 <= t <= top for t in ids):
            raise InvalidTask(f"prompt_token_ids must be integers in [0, {top}]")
        return cls(
            request_id=_str(d.get("request_id"), "request_id", _ID, empty_ok=False),
            model=_str(d.get("model"), "model", empty_ok=False),
            prompt_token_ids=list(ids),
            sampling=SamplingParams.from_dict(d.get("sampling", {}), max_model_len, vocab_size),
            reply_to=_str(d.get("reply_to", ""), "reply_to", _ID),
            decode_queue=_str(d.get("decode_queue", ""), "decode_queue", _QUEUE),
            created=_number(d.get("created", 0.0), "created", 0.0, 1e12),
            lease_s=_number(d.get("lease_s", 0.0), "lease_s", 0.0, 86400.0),
            origin=_str(d.get("origin", ""), "origin", _ID),
            cache_salt=_str(d.get("cache_salt", ""), "cache_salt", _CACHE_SALT, most=MAX_CACHE_SALT_CHARS),
            generated=_int(d.get("generated", 0), "generated", 0, len(ids) - 1),
        )


_SAMPLING_FIELDS = tuple(f.name for f in fields(SamplingParams))
_REQUEST_FIELDS = tuple(f.name for f in fields(GenerationRequest))
