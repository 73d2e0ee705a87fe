"""Validation of OpenAI request bodies into token ids and sampling parameters (400s name the param), with the
ranges the request models declare (farm/openai/schemas.py)."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from farm.config import SamplingDefaults
from farm.models.tokenization import (
    PromptTooLong,
    bad_words_problem,
    chat_prompt_ids,
    chat_turns,
    max_token_chars,
    prompt_tokens_at_least,
    text_prompt_ids,
    turn_tokens,
)
from farm.openai.api_error import APIError, bad_request
from farm.openai.schemas import (
    MAX_CACHE_SALT,
    MAX_CHOICES,
    MAX_MESSAGES,
    ChatCompletionRequest,
    CompletionRequest,
    StructuredOutputsOf,
    check_hints,
    field_bounds,
    reject_unknown_fields,
)
from farm.openai.structured import check_constraint, check_schema
from farm.openai.tools import ToolRequest, parse_tools, template_inputs
from farm.openai.validation import validated
from farm.protocol import (
    MAX_ALLOWED_TOKEN_IDS,
    MAX_BAD_WORD_CHARS,
    MAX_BAD_WORDS,
    MAX_LOGIT_BIAS,
    MAX_LOGPROB_TOKEN_IDS,
    MAX_RESPONSE_FORMAT_CHARS,
    MAX_STOP_CHARS,
    MAX_STOP_SEQUENCES,
    RESPONSE_FORMATS,
    SEED_RANGE,
    SamplingParams,
)
from farm.protocol.jsonsafe import MAX_JSON_DEPTH, loads_bounded, one_of

MAX_GRAMMAR_CHARS = 16384  # a regex or grammar (GBNF's translation to Lark is quadratic Python, on every worker too)
CHAT_ROLES = {"system", "user", "assistant", "developer", "tool"}  # developer is sent to the template as system
UNSUPPORTED = {"functions": "deprecated function calling: use 'tools'",
               "function_call": "deprecated function calling: use 'tool_choice'",
               "use_beam_search": "beam search: sample n choices, or score them with logprobs"}
# The chat template's own parameters (transformers' apply_chat_template, and the names the template is rendered
# with): not variables of the template, so not accepted in `chat_template_kwargs` (vLLM refuses chat_template and
# tokenize there; the output-shaping ones would change what a prompt is, padding to max_length its size).
TEMPLATE_PARAMETERS = frozenset({"conversation", "conversations", "messages", "tools", "documents", "chat_template",
                                 "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
                                 "return_assistant_tokens_mask", "tokenizer_kwargs"})
TEMPLATE_FIELDS = ("add_generation_prompt", "continue_final_message")  # request fields of their own
# The tokenizer's special tokens, which every template may read (often once per message): a request does not
# redefine them (a long "eos_token" would be repeated after every message of the prompt)
SPECIAL_TOKEN_NAMES = frozenset({"bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                                 "mask_token", "additional_special_tokens"})
MAX_TEMPLATE_KWARGS_CHARS = 16384  # chat_template_kwargs as JSON: switches and short texts, not prompts
TRUNCATION_SIDES = ("left", "right")  # vLLM's truncation_side
TRUNCATION_CHARS_PER_TOKEN = 4  # a truncated prompt's first cut, in characters a token kept (_shortest_cut)
TRUNCATION_MARGIN = 16  # tokens a cut holds beyond those kept: its edge never changes how they tokenize


@dataclass(frozen=True)
class Prompt:
    """One prompt of a request: its token ids, the text each of its choices starts with (vLLM's `echo`), and, in
    a batch that leaves `max_tokens` out, its own default (the room its context leaves it, as vLLM gives each)."""

    ids: list[int]
    echo: str = ""
    max_tokens: int | None = None


@dataclass
class ParsedRequest:
    """A validated request: what the gateway needs (token ids, sampling) plus the response flags. A chat has one
    prompt; a text completion may have several (vLLM's batched `prompt`): choice `c` is choice `c % n` of prompt
    `c // n`, in vLLM's order."""

    model: str
    prompts: list[Prompt]
    sampling: SamplingParams
    stream: bool = False
    include_usage: bool = False
    extra: dict[str, Any] = field(default_factory=dict)
    n: int = 1  # choices: n requests on the workers (seeds seed, seed+1, ...)
    cache_salt: str | None = None  # the client's (vLLM's field): combined with its tenant's (farm.tenancy.api_keys)
    tools: ToolRequest | None = None  # chat: the request's tools (farm.openai.tools), when it has any
    reasoning_parser: str | None = None  # chat: the model's (farm.openai.reasoning): reasoning split from content
    role: str = "assistant"  # chat: the response message's role (the last message's without a generation prompt)
    continuous_usage: bool = False  # vLLM's stream_options.continuous_usage_stats (with include_usage)
    prompt_only: bool = False  # vLLM's `echo` with `max_tokens` 0: each choice is its prompt alone (Answer.prompt_only)
    return_token_ids: bool = False  # vLLM's: the answer carries prompt and generated token ids
    echo_logprobs: bool = False  # a text completion's `echo` with `logprobs`: its logprobs start with the prompt's
    prompt_logprobs: int | None = None  # vLLM's `prompt_logprobs` asked for (k alternatives), not streamed
    truncated: bool = False  # vLLM's truncate_prompt_tokens dropped some of the prompt's tokens

    @property
    def prompt_ids(self) -> list[int]:
        """The first prompt's token ids (a chat's only prompt)."""
        return self.prompts[0].ids

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p.ids) for p in self.prompts)

    @property
    def choices(self) -> int:
        return len(self.prompts) * self.n

    def prompt_of(self, choice: int) -> Prompt:
        return self.prompts[choice // self.n]

    def max_tokens_of(self, choice: int) -> int:
        own = self.prompt_of(choice).max_tokens
        return own if own is not None else self.sampling.max_tokens

    def capped(self, max_tokens: int) -> ParsedRequest:
        """Every choice held to at most `max_tokens` (what is left of a quota)."""
        prompts = [p if p.max_tokens is None else replace(p, max_tokens=min(p.max_tokens, max_tokens))
                   for p in self.prompts]
        return replace(self, prompts=prompts, sampling=replace(self.sampling, max_tokens=max_tokens))


@dataclass(frozen=True)
class ChatOptions:
    """vLLM's chat-template fields of a chat request, checked (`chat_options`)."""

    template_kwargs: dict[str, Any] = field(default_factory=dict)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    echo: bool = False
    add_special_tokens: bool = False  # the tokenizer's special tokens (a BOS) on top of the template's

    @property
    def default(self) -> bool:
        """Nothing asked beyond the plain template: a semantic-cache answer may stand for this request."""
        return self == ChatOptions()


def _type_check(body: dict, name: str, types: tuple, desc: str) -> Any:
    """body[name] if present and of `types` (booleans only where asked for), else a 400 naming it."""
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) and bool not in types:
        raise bad_request(f"'{name}' must be {desc}, got a boolean", name)
    if not isinstance(v, types):
        raise bad_request(f"'{name}' must be {desc}, got {type(v).__name__}", name)
    return v


def _number(body: dict, name: str, default: float, model: type = ChatCompletionRequest) -> float:
    """body[name] in the range `model` declares for it (farm/openai/schemas.py), else `default`."""
    lo, hi, lo_open = field_bounds(model, name)
    v = _type_check(body, name, (int, float), "a number")
    if v is None:
        return default
    if isinstance(v, float) and not math.isfinite(v):  # an int is finite, however long (math.isfinite overflows)
        raise bad_request(f"'{name}' must be a finite number", name, "invalid_value")
    if v > hi or v < lo or (lo_open and v == lo):  # int against float compares exactly, at any size
        lo_s = f"> {float(lo)}" if lo_open else f">= {float(lo)}"
        shown = v if -1e300 < v < 1e300 else "a number beyond a float's range"
        raise bad_request(f"'{name}' must be {lo_s} and <= {float(hi)}, got {shown}", name, "invalid_value")
    return float(v)


def _integer(body: dict, name: str, default: int, model: type = ChatCompletionRequest, hi: int | None = None) -> int:
    """body[name] in the range `model` declares for it (`hi` for a bound that depends on the request)."""
    lo, declared_hi, _ = field_bounds(model, name)
    hi = declared_hi if hi is None else hi
    v = _type_check(body, name, (int,), "an integer")
    if v is None:
        return default
    if not lo <= v <= hi:
        raise bad_request(f"'{name}' must be >= {lo} and <= {hi}, got {v}", name, "invalid_value")
    return v


def _token_ids(body: dict, name: str, vocab: int | None, most: int) -> list[int]:
    v = body.get(name)
    if v is None:
        return []
    if not isinstance(v, list) or len(v) > most or not all(isinstance(t, int) and not isinstance(t, bool) for t in v):
        raise bad_request(f"'{name}' must be a list of at most {most} token ids", name)
    if any(t < 0 or (vocab is not None and t >= vocab) for t in v):
        raise bad_request(f"token ids in '{name}' must be in [0, {vocab})", name, "invalid_value")
    return list(v)


def _bad_words(body: dict) -> list[str]:
    """vLLM's `bad_words`: at most MAX_BAD_WORDS non-empty strings (each model's tokenizer checks them again:
    check_bad_words)."""
    words = _type_check(body, "bad_words", (list,), "a list of strings") or []
    if len(words) > MAX_BAD_WORDS or not all(isinstance(w, str) and 0 < len(w) <= MAX_BAD_WORD_CHARS for w in words):
        raise bad_request(f"'bad_words' must be a list of at most {MAX_BAD_WORDS} non-empty strings of at most "
                          f"{MAX_BAD_WORD_CHARS} characters", "bad_words", "invalid_value")
    return words


def check_bad_words(params: SamplingParams, tokenizer) -> None:
    """A 400 for `bad_words` the model's tokenizer cannot take as vLLM would (farm.models.tokenization
    .bad_words_problem)."""
    if params.bad_words and (problem := bad_words_problem(tokenizer, params.bad_words)):
        raise bad_request(f"'bad_words': {problem}", "bad_words", "invalid_value")


def _logit_bias(body: dict, vocab: int | None) -> dict[int, float]:
    """OpenAI's logit_bias: token id (a JSON key, so a string) -> bias in [-100, 100]."""
    v = body.get("logit_bias")
    if v is None:
        return {}
    if not isinstance(v, dict) or len(v) > MAX_LOGIT_BIAS:
        raise bad_request(f"'logit_bias' must map at most {MAX_LOGIT_BIAS} token ids to numbers", "logit_bias")
    out = {}
    for key, bias in v.items():
        # ASCII digits only: "²".isdigit() is true, and int() refuses it
        if not (isinstance(key, str) and key.isascii() and key.isdigit() and len(key) < 12) or (vocab is not None and int(key) >= vocab):
            raise bad_request(f"'logit_bias' keys must be token ids in [0, {vocab}), got {key!r}", "logit_bias",
                              "invalid_value")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -100 <= bias <= 100:
            raise bad_request(f"'logit_bias' values must be numbers in [-100, 100], got {bias!r}", "logit_bias",
                              "invalid_value")
        out[int(key)] = float(bias)
    return out


def _response_format(body: dict) -> dict[str, Any] | None:
    """None for text; {"type": "json_object"} or {"type": "json_schema", "json_schema": {"schema": {...}}}."""
    v = body.get("response_format")
    if v is None or v == {"type": "text"}:
        return None
    if not isinstance(v, dict) or not one_of(v.get("type"), RESPONSE_FORMATS | {"text"}):
        raise bad_request("'response_format.type' must be text, json_object or json_schema", "response_format")
    if v["type"] == "text":
        return None
    if v["type"] == "json_schema":
        spec = v.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise bad_request("'response_format.json_schema.schema' must be a JSON schema object",
                              "response_format")
        fmt = format_within_bound({"type": "json_schema", "json_schema": {
            k: spec[k] for k in ("name", "schema", "strict") if k in spec}}, "response_format")
        check_schema(spec["schema"], "response_format")  # after the bound: the compiler never sees a larger one
        return fmt
    return {"type": "json_object"}


def _constraint(body: dict) -> dict[str, Any] | None:
    """What the answer is held to: OpenAI's `response_format`, or vLLM's `structured_outputs` (one of a JSON
    schema, a regex, a choice of strings, a grammar or any JSON object), as the task's `response_format`
    (farm.protocol.request.CONSTRAINTS); each compiled once here, so a bad one is the client's 400."""
    fmt = _response_format(body)
    if body.get("structured_outputs") is None:
        return fmt
    if fmt is not None:
        raise bad_request("'structured_outputs' cannot be combined with a 'response_format'", "structured_outputs",
                          "invalid_value")
    so = validated(StructuredOutputsOf, {"structured_outputs": body["structured_outputs"]}).structured_outputs
    for name in ("whitespace_pattern", "structural_tag"):
        if getattr(so, name) not in (None, "", False):
            raise bad_request(f"'structured_outputs.{name}' is not supported by this server",
                              f"structured_outputs.{name}", "unsupported_parameter")
    given = {k: v for k, v in (("json", so.json_), ("regex", so.regex), ("choice", so.choice),
                               ("grammar", so.grammar), ("json_object", so.json_object)) if v is not None}
    if len(given) != 1:
        raise bad_request("'structured_outputs' must hold exactly one of json, regex, choice, grammar or "
                          f"json_object (got {len(given)})", "structured_outputs", "invalid_value")
    (kind, value), = given.items()
    param = f"structured_outputs.{kind}"
    if kind == "json_object":
        fmt = {"type": "json_object"}
    elif kind == "json":
        schema = _json_schema(value, param)
        if so.disable_additional_properties:
            schema = closed_objects(schema)
        fmt = {"type": "json_schema", "json_schema": {"schema": schema}}
    else:
        fmt = {"type": kind, kind: value}
        if kind != "choice" and len(value) > MAX_GRAMMAR_CHARS:
            raise bad_request(f"'{param}' may be at most {MAX_GRAMMAR_CHARS} characters", param, "invalid_value")
    if so.disable_any_whitespace and kind in ("json", "json_object"):
        fmt["disable_any_whitespace"] = True
    format_within_bound(fmt, "structured_outputs")  # before the compiler sees it
    if kind != "json_object":
        check_constraint(fmt, param, {"json": "a JSON schema", "regex": "a regex", "choice": "a choice",
                                      "grammar": "a grammar"}[kind])
    return fmt


def _json_schema(value: dict[str, Any] | str, param: str) -> dict[str, Any]:
    """A JSON schema given as an object or as its JSON text (vLLM takes both)."""
    if isinstance(value, str):
        try:  # bounded as the body was: JSON inside a string is a client's too
            value = loads_bounded(value, MAX_JSON_DEPTH)
        except ValueError:  # JSONTooDeep among them
            raise bad_request(f"'{param}' must be a JSON schema: an object, or its JSON text (nested at most "
                              f"{MAX_JSON_DEPTH} deep)", param, "invalid_value") from None
    if not isinstance(value, dict):
        raise bad_request(f"'{param}' must be a JSON schema object", param, "invalid_value")
    return value


def closed_objects(schema: Any) -> Any:
    """`schema` with `additionalProperties: false` on every object that names properties and leaves it unset
    (vLLM's `disable_additional_properties`); a copy."""
    if isinstance(schema, list):
        return [closed_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: closed_objects(v) for k, v in schema.items()}
    if "additionalProperties" not in out and ("properties" in out or "patternProperties" in out):
        out["additionalProperties"] = False
    return out


def format_within_bound(fmt: dict[str, Any], param: str) -> dict[str, Any]:
    """`fmt`, or a 400 naming `param` when it is past what a worker takes (MAX_RESPONSE_FORMAT_CHARS as JSON): the
    worker refused it as an invalid task, which reached the client as a 500."""
    if len(json.dumps(fmt)) > MAX_RESPONSE_FORMAT_CHARS:
        raise bad_request(f"'{param}' is larger than {MAX_RESPONSE_FORMAT_CHARS} characters as JSON (with a tool "
                          "choice: every forced tool's parameters together)", param, "invalid_value")
    return fmt


def _logprobs(body: dict, kind: str) -> int | None:
    """How many alternatives per token (None: no log-probabilities). Chat: `logprobs` true and
    `top_logprobs` 0-20; completions: `logprobs` an integer 0-20."""
    if kind == "chat":
        on = _type_check(body, "logprobs", (bool,), "a boolean")
        top = _integer(body, "top_logprobs", 0)
        if body.get("top_logprobs") is not None and not on:
            raise bad_request("'top_logprobs' needs 'logprobs': true", "top_logprobs")
        return top if on else None
    if body.get("logprobs") is None or body["logprobs"] is False:
        return None
    return _integer(body, "logprobs", 0, CompletionRequest)


def _cache_salt(body: dict) -> str | None:
    """vLLM's `cache_salt`, checked as vLLM checks it: a non-empty string of at most 128 characters without
    '@', '/', '\\' or NUL."""
    salt = _type_check(body, "cache_salt", (str,), "a string")
    if salt is not None and (not 1 <= len(salt) <= MAX_CACHE_SALT or any(c in salt for c in "@/\\\0")):
        raise bad_request(f"'cache_salt' must be a non-empty string of at most {MAX_CACHE_SALT} characters "
                          "without '@', '/', '\\' or NUL", "cache_salt", "invalid_value")
    return salt


def chat_options(body: dict) -> ChatOptions:
    """vLLM's chat-template extensions, with vLLM's defaults and checks: `chat_template_kwargs` (an object of
    template variables), `add_generation_prompt` (true), `continue_final_message` (false; not with a generation
    prompt, as vLLM refuses both true), `echo` (false), `add_special_tokens` (false: the template writes its own)."""
    kwargs = _type_check(body, "chat_template_kwargs", (dict,), "an object") or {}
    for key in kwargs:
        if key in TEMPLATE_FIELDS:
            raise bad_request(f"'chat_template_kwargs.{key}' is a request field here: set '{key}' itself",
                              "chat_template_kwargs", "invalid_value")
        if key in TEMPLATE_PARAMETERS or key in SPECIAL_TOKEN_NAMES:
            what = "a parameter of the template's rendering" if key in TEMPLATE_PARAMETERS else \
                "one of the tokenizer's special tokens"
            raise bad_request(f"'chat_template_kwargs' may only hold variables of the chat template; {key!r} is "
                              f"{what}", "chat_template_kwargs", "invalid_value")
    if kwargs and len(json.dumps(kwargs)) > MAX_TEMPLATE_KWARGS_CHARS:
        raise bad_request(f"'chat_template_kwargs' may take at most {MAX_TEMPLATE_KWARGS_CHARS} characters as JSON",
                          "chat_template_kwargs", "invalid_value")
    add = _type_check(body, "add_generation_prompt", (bool,), "a boolean")
    add = True if add is None else add
    cont = _type_check(body, "continue_final_message", (bool,), "a boolean") or False
    if cont and add:
        raise bad_request("'continue_final_message' and 'add_generation_prompt' cannot both be true "
                          "('add_generation_prompt' is true unless set to false)", "continue_final_message",
                          "invalid_value")
    echo = _type_check(body, "echo", (bool,), "a boolean") or False
    special = _type_check(body, "add_special_tokens", (bool,), "a boolean") or False
    return ChatOptions(dict(kwargs), add, cont, echo, special)


def _common(body: dict, prompt_len: int, max_model_len: int, prompt_param: str,
            defaults: SamplingDefaults | None = None, *, kind: str = "chat", vocab: int | None = None
            ) -> tuple[SamplingParams, bool, bool, int]:
    """Sampling parameters, stream flags and n shared by chat and completions, checked like OpenAI's (and
    vLLM's extensions: top_k, min_p, repetition_penalty, min_tokens, stop_token_ids, ignore_eos); parameters
    the body leaves out come from the model entry's `defaults`. `vocab` bounds token ids."""
    defaults = defaults or SamplingDefaults()
    _type_check(body, "use_beam_search", (bool,), "a boolean")  # vLLM's beam-search pair: false is accepted,
    penalty = _type_check(body, "length_penalty", (int, float), "a number")  # the penalty checked, not applied
    if isinstance(penalty, float) and not math.isfinite(penalty):
        raise bad_request("'length_penalty' must be a finite number", "length_penalty", "invalid_value")
    for key, what in UNSUPPORTED.items():
        if body.get(key) not in (None, False, [], {}):
            raise bad_request(f"'{key}' is not supported by this server ({what})", key, "unsupported_parameter")
    n = _integer(body, "n", 1)
    temperature = _number(body, "temperature", defaults.temperature)
    top_p = _number(body, "top_p", defaults.top_p)
    presence = _number(body, "presence_penalty", defaults.presence_penalty)
    frequency = _number(body, "frequency_penalty", defaults.frequency_penalty)
    repetition = _number(body, "repetition_penalty", defaults.repetition_penalty)
    top_k = _integer(body, "top_k", defaults.top_k)
    min_p = _number(body, "min_p", defaults.min_p)
    stop_token_ids = _token_ids(body, "stop_token_ids", vocab, int(field_bounds(ChatCompletionRequest, "stop_token_ids")[1]))
    logit_bias = _logit_bias(body, vocab)
    allowed = _token_ids(body, "allowed_token_ids", vocab, MAX_ALLOWED_TOKEN_IDS)
    if body.get("allowed_token_ids") is not None and not allowed:
        raise bad_request("'allowed_token_ids' must not be empty", "allowed_token_ids", "invalid_value")
    bad_words = _bad_words(body)
    response_format = _constraint(body)
    logprobs = _logprobs(body, kind)
    logprob_ids = _token_ids(body, "logprob_token_ids", vocab, MAX_LOGPROB_TOKEN_IDS)
    if logprob_ids and logprobs is None:  # as vLLM: the ids say which log-probabilities, `logprobs` asks for them
        raise bad_request("when using 'logprob_token_ids', " + ("'logprobs' must be true" if kind == "chat" else
                                                                "'logprobs' must be set"), "logprob_token_ids",
                          "invalid_value")
    seed = _type_check(body, "seed", (int,), "an integer")
    if seed is not None and not SEED_RANGE[0] <= seed <= SEED_RANGE[1]:
        raise bad_request(f"'seed' must be in [{SEED_RANGE[0]}, {SEED_RANGE[1]}]", "seed", "invalid_value")
    stop = body.get("stop")
    if stop is None:
        stops: list[str] = []
    elif isinstance(stop, str):
        stops = [stop]
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        if len(stop) > MAX_STOP_SEQUENCES:
            raise bad_request(f"'stop' may hold at most {MAX_STOP_SEQUENCES} sequences", "stop", "invalid_value")
        stops = list(stop)
    else:
        raise bad_request("'stop' must be a string or a list of strings", "stop")
    stops = [s for s in stops if s]
    if any(len(s) > MAX_STOP_CHARS for s in stops):
        raise bad_request(f"each 'stop' sequence may be at most {MAX_STOP_CHARS} characters", "stop", "invalid_value")
    max_tokens = None
    for name in ("max_tokens", "max_completion_tokens"):  # the newer name wins when both are given
        v = _type_check(body, name, (int,), "an integer")
        if v is not None:
            if v < 1:
                raise bad_request(f"'{name}' must be >= 1, got {v}", name, "invalid_value")
            max_tokens = v
    if prompt_len >= max_model_len:
        raise bad_request(f"This model's maximum context length is {max_model_len} tokens; your prompt has "
                          f"{prompt_len} tokens.", prompt_param, "context_length_exceeded")
    if max_tokens is None:
        max_tokens = _default_max_tokens(prompt_len, max_model_len, defaults)
    elif prompt_len + max_tokens > max_model_len:
        raise bad_request(f"This model's maximum context length is {max_model_len} tokens; you requested "
                          f"{prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} for the "
                          "completion). Reduce the prompt or max_tokens.", "max_tokens", "context_length_exceeded")
    ignore_eos = _type_check(body, "ignore_eos", (bool,), "a boolean") or False  # vLLM extension
    skip_special = _type_check(body, "skip_special_tokens", (bool,), "a boolean")  # vLLM extension, default true
    include_stop = _type_check(body, "include_stop_str_in_output", (bool,), "a boolean") or False  # vLLM extension
    min_tokens = _integer(body, "min_tokens", 0, hi=max_tokens)
    stream = _type_check(body, "stream", (bool,), "a boolean") or False
    opts = _type_check(body, "stream_options", (dict,), "an object") or {}
    include_usage = opts.get("include_usage", False)
    for name in ("include_usage", "continuous_usage_stats"):
        if not isinstance(opts.get(name, False), bool):
            raise bad_request(f"'stream_options.{name}' must be a boolean", f"stream_options.{name}")
    if opts and not stream:
        raise bad_request("'stream_options' is only allowed when 'stream' is true", "stream_options")
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed,
                            stop=stops, ignore_eos=ignore_eos, presence_penalty=presence,
                            frequency_penalty=frequency, repetition_penalty=repetition,
                            top_k=max(0, min(top_k, vocab) if vocab else top_k),  # past the vocabulary: all, as vLLM
                            min_p=min_p, min_tokens=min_tokens, stop_token_ids=stop_token_ids, logprobs=logprobs,
                            logprob_token_ids=logprob_ids,
                            logit_bias=logit_bias, allowed_token_ids=allowed, bad_words=bad_words,
                            response_format=response_format,
                            skip_special_tokens=skip_special is not False, include_stop_str_in_output=include_stop)
    return params, stream, include_usage, n


def _default_max_tokens(prompt_len: int, max_model_len: int, defaults: SamplingDefaults | None) -> int:
    """`max_tokens` when a request leaves it out: the room its prompt leaves in the context, at most the model
    entry's default."""
    room = max_model_len - prompt_len
    cap = defaults.max_tokens if defaults is not None else None
    return room if cap is None else min(room, cap)


def prompt_char_limit(tokenizer, max_model_len: int, chars_per_token: int = 0) -> int:
    """The most characters a prompt that fits `max_model_len` tokens can have: `chars_per_token`
    (api.max_chars_per_token) or, when 0, the tokenizer's longest vocabulary entry per token."""
    return max_model_len * (chars_per_token or max_token_chars(tokenizer))


def check_prompt_chars(n_chars: int, limit: int, max_model_len: int, param: str) -> None:
    """context_length_exceeded at once for a prompt too long to fit by its characters alone: a
    multi-megabyte prompt is refused without tokenizing it (seconds of CPU and a memory high-water mark)."""
    if n_chars > limit:
        raise bad_request(f"This model's maximum context length is {max_model_len} tokens; your prompt has "
                          f"{n_chars} characters, more than {max_model_len} tokens can hold.", param,
                          "context_length_exceeded")


def refuse_oversized(models: list[tuple[Any, int]], prompt: list[dict[str, Any]] | str, param: str,
                     chars_per_token: int = 0) -> None:
    """context_length_exceeded before the semantic layer, the template or the tokenizer pays for a prompt that
    cannot fit any of `models` ((tokenizer, max_model_len) pairs; one, or every model an alias may pick): by
    its characters alone (prompt_char_limit), then by a floor under its tokens (check_prompt_floor)."""
    limit, context = max((prompt_char_limit(tok, n, chars_per_token), n) for tok, n in models)
    check_prompt_chars(len(prompt) if isinstance(prompt, str) else messages_chars(prompt), limit, context, param)
    check_prompt_floor(models, prompt, param)


def check_prompt_floor(models: list[tuple[Any, int]], prompt: list[dict[str, Any]] | str, param: str) -> None:
    """context_length_exceeded when, for every (tokenizer, max_model_len) in `models`, a floor under the prompt's
    tokens is past the context: a chat's by farm.models.tokenization.prompt_tokens_at_least, a text's by its
    own tokens. Skipped when the prompt is too short to be past any context (4 bytes a character, at least one a
    token, in a byte-level vocabulary), so an ordinary request pays nothing for it."""
    if isinstance(prompt, str):
        size, turns = len(prompt), 0
    else:
        size, turns = messages_chars(prompt), chat_turns(prompt)
    floors = []
    for tok, context in models:
        if 4 * size + turns * turn_tokens(tok) <= context:
            return
        floor = len(text_prompt_ids(tok, prompt, False)) if isinstance(prompt, str) else \
            prompt_tokens_at_least(tok, prompt)
        if floor <= context:
            return
        floors.append((floor, context))
    floor, context = min(floors)
    raise bad_request(f"This model's maximum context length is {context} tokens; your prompt has at least "
                      f"{floor} tokens.", param, "context_length_exceeded")


def messages_chars(messages: list[dict[str, Any]]) -> int:
    return sum(len(m["content"]) + sum(len(c["function"]["arguments"]) + len(c["function"]["name"])
                                       for c in m.get("tool_calls", ())) for m in messages)


def _content_text(content: Any, i: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad_request(f"messages[{i}].content[{j}]: only text parts are supported",
                                  f"messages[{i}].content")
            parts.append(part["text"])
        return "".join(parts)
    if content is None:
        return ""
    raise bad_request(f"messages[{i}].content must be a string or a list of text parts", f"messages[{i}].content")


def _tool_calls(calls: Any, i: int) -> list[dict[str, Any]]:
    """An assistant message's earlier `tool_calls`, checked: [{id, type: function, function: {name, arguments}}]."""
    param = f"messages[{i}].tool_calls"
    if not isinstance(calls, list) or not calls:
        raise bad_request(f"'{param}' must be a non-empty list of tool calls", param)
    out = []
    for c in calls:
        fn = c.get("function") if isinstance(c, dict) else None
        if not (isinstance(fn, dict) and isinstance(fn.get("name"), str) and isinstance(fn.get("arguments"), str)
                and isinstance(c.get("id", ""), str) and c.get("type", "function") == "function"):
            raise bad_request(f"'{param}' items must be {{\"id\", \"type\": \"function\", \"function\": "
                              "{\"name\": string, \"arguments\": string}}", param)
        out.append({"id": c.get("id") or "", "type": "function",
                    "function": {"name": fn["name"], "arguments": fn["arguments"]}})
    return out


def normalize_messages(body: dict) -> list[dict[str, Any]]:
    """`messages` as [{"role", "content": str}] for the chat template; developer becomes system. An assistant
    message may carry its `tool_calls` (content may then be null), a tool message its `tool_call_id`."""
    messages = body.get("messages")
    if messages is None:
        raise bad_request("'messages' is required", "messages", "missing_required_parameter")
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty list", "messages")
    if len(messages) > MAX_MESSAGES:
        raise bad_request(f"'messages' has {len(messages)} messages, more than the {MAX_MESSAGES} a request may have",
                          "messages", "array_above_max_length")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise bad_request(f"messages[{i}] must be an object", f"messages[{i}]")
        role = m.get("role")
        if not one_of(role, CHAT_ROLES):
            raise bad_request(f"messages[{i}].role must be one of {sorted(CHAT_ROLES)}, got {role!r}",
                              f"messages[{i}].role")
        msg: dict[str, Any] = {"role": "system" if role == "developer" else role,
                               "content": _content_text(m.get("content"), i)}
        if role == "assistant" and m.get("tool_calls") is not None:
            msg["tool_calls"] = _tool_calls(m["tool_calls"], i)
        elif m.get("tool_calls") is not None:
            raise bad_request(f"messages[{i}]: only assistant messages carry tool_calls", f"messages[{i}].tool_calls")
        if role == "tool":
            if not isinstance(m.get("tool_call_id"), str):
                raise bad_request(f"messages[{i}].tool_call_id is required (a string) in a tool message",
                                  f"messages[{i}].tool_call_id", "missing_required_parameter")
            msg["tool_call_id"] = m["tool_call_id"]
        out.append(msg)
    return out


def validate_chat(body: dict) -> list[dict[str, str]]:
    """The checks of a chat body that need no model: declared fields, the messages (normalized), the
    chat-template options."""
    reject_unknown_fields(body, ChatCompletionRequest)
    check_hints(body)
    messages = normalize_messages(body)
    chat_options(body)
    return messages


def local_params(body: dict, kind: str = "chat") -> tuple[SamplingParams, bool, bool, int]:
    """(sampling, stream, include_usage, n) of a request answered without a model (semantic block or cache
    hit), after the same checks of every parameter as a generated answer gets. `max_tokens` is only
    bounded when the body sets it (there is no prompt length to bound it by)."""
    if kind == "completion":
        body, _prompt_only = _echo_only(body)
    return _common(body, 0, 1 << 30, "messages", kind=kind)


def _echo_only(body: dict) -> tuple[dict, bool]:
    """vLLM's scoring form of a text completion, `echo` with `max_tokens` 0: the body as the engine runs it (one
    token, generated and counted, not answered) and whether it is that form."""
    if body.get("echo") is True and body.get("max_tokens") == 0 and type(body["max_tokens"]) is int:
        return {**body, "max_tokens": 1}, True
    return body, False


def parse_chat(body: dict, tokenizer, max_model_len: int, messages: list[dict[str, Any]] | None = None,
               defaults: SamplingDefaults | None = None, chars_per_token: int = 0,
               tool_parser: str | None = None, template_kwargs: dict[str, Any] | None = None,
               reasoning_parser: str | None = None) -> ParsedRequest:
    """Validate a /v1/chat/completions body (model already checked) and apply the chat template to
    `messages` (the body's, normalized, unless the semantic layer rewrote them); `tool_parser` is the model's
    (farm.openai.tools: what `tool_choice: auto` needs), `reasoning_parser` too (farm.openai.reasoning);
    `template_kwargs` reach the template (the semantic layer's
    reasoning mode: api.semantic.reasoning_template_kwargs; the client's own `chat_template_kwargs` win over
    them). vLLM's template fields apply: `add_generation_prompt`, `continue_final_message`, and `echo` (every
    choice starts with the last message's content when that message has the response's role, which is the last
    message's own without a generation prompt)."""
    if messages is None:
        messages = validate_chat(body)
    opts = chat_options(body)
    tools = parse_tools(body, tool_parser, body.get("model", ""))
    if tools is not None and tools.active and body.get("stream") is True and body.get("logprobs"):
        raise bad_request("'logprobs' cannot be streamed together with tool calls", "logprobs", "unsupported_value")
    limit = prompt_char_limit(tokenizer, max_model_len, chars_per_token)
    if (keep := _kept_tokens(body, max_model_len)) is not None and keep >= 1:
        messages = _shortest_cut(messages, truncation(body)[1], [(tokenizer, keep, limit)])
    check_prompt_chars(messages_chars(messages), limit, max_model_len, "messages")
    rendered, tool_list = template_inputs(messages, tools, tokenizer, tool_parser)
    try:  # with template variables or tools, the rendered prompt's size is checked again before it is tokenized
        ids = chat_prompt_ids(tokenizer, rendered, {**(template_kwargs or {}), **opts.template_kwargs},
                              add_generation_prompt=opts.add_generation_prompt,
                              continue_final_message=opts.continue_final_message, tools=tool_list,
                              max_chars=limit if opts.template_kwargs or tools is not None else None,
                              add_special_tokens=opts.add_special_tokens)
    except PromptTooLong as e:
        check_prompt_chars(e.chars, limit, max_model_len, "messages")
        raise
    except Exception as e:  # a template that rejects the conversation (e.g. role order, nothing to continue)
        raise bad_request(f"the model's chat template rejected these messages: {e}", "messages") from None
    whole = len(ids)
    ids = _truncated(ids, body, max_model_len)
    params, stream, include_usage, n = _common(body, len(ids), max_model_len, "messages", defaults, kind="chat",
                                               vocab=len(tokenizer))
    check_bad_words(params, tokenizer)
    if tools is not None and (forced := tools.response_format()) is not None:
        params = replace(params, response_format=format_within_bound(forced, "tools"))
    params, prompt_k = _prompt_logprobs(body, params, stream)
    role = "assistant" if opts.add_generation_prompt else messages[-1]["role"]
    echo = messages[-1]["content"] if opts.echo and messages[-1]["role"] == role else ""
    return ParsedRequest(body["model"], [Prompt(ids, echo)], params, stream, include_usage, {"messages": messages},
                         n, cache_salt=_cache_salt(body),
                         tools=tools if tools is not None and tools.active else None,
                         reasoning_parser=reasoning_parser, role=role,
                         continuous_usage=_continuous_usage(body, include_usage),
                         return_token_ids=_return_token_ids(body), prompt_logprobs=prompt_k,
                         truncated=len(ids) < whole)


def raw_prompts(body: dict) -> list[Any]:
    """A completion body's prompts, each unchecked: a string or a list of token ids, or a list of those (vLLM's
    batched prompt); anything else is one malformed prompt (parse_completion's 400). More than MAX_CHOICES is a
    400 here, before the guards and the classifier look at any of them (each costs them an embedding)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        if len(prompt) > MAX_CHOICES:
            raise bad_request(f"'prompt' may hold at most {MAX_CHOICES} prompts, got {len(prompt)}", "prompt",
                              "invalid_value")
        return list(prompt)
    return [prompt]


def prompt_param(index: int, count: int) -> str:
    """How an error names a prompt: `prompt` alone, `prompt[i]` in a batch."""
    return "prompt" if count == 1 else f"prompt[{index}]"


def _is_token_ids(prompt: Any) -> bool:
    return isinstance(prompt, list) and bool(prompt) and all(type(t) is int for t in prompt)


def completion_messages(body: dict, tokenizer) -> list[dict[str, str]]:
    """A text completion's prompts as user messages (one each), for the guards and the classifier: every prompt
    of a batch is scanned. Token-id prompts are decoded with `tokenizer`; a malformed prompt gives no text here
    (and its 400 from parse_completion)."""
    return [{"role": "user", "content": _prompt_text(p, tokenizer)} for p in raw_prompts(body)]


def _prompt_text(prompt: Any, tokenizer, skip_special_tokens: bool = True) -> str:
    if _is_token_ids(prompt):
        try:
            vocab = len(tokenizer)  # once: a tokenizer's len() is not cheap, and a prompt has thousands of ids
            return tokenizer.decode([t for t in prompt if 0 <= t < vocab],
                                    skip_special_tokens=skip_special_tokens)
        except Exception:  # noqa: BLE001 - undecodable ids: parse_completion reports them
            return ""
    return prompt if isinstance(prompt, str) else ""


def parse_completion(body: dict, tokenizer, max_model_len: int,
                     defaults: SamplingDefaults | None = None, chars_per_token: int = 0) -> ParsedRequest:
    """Validate a /v1/completions body (model already checked): its prompts, each as text or token ids (vLLM's
    batch: up to MAX_CHOICES choices in all), and vLLM's `echo` (each choice starts with its prompt's text; with
    `logprobs`, its log-probabilities start with the prompt's; with `max_tokens` 0, the prompt is all it holds)."""
    reject_unknown_fields(body, CompletionRequest)
    if body.get("suffix"):
        raise bad_request("'suffix' is not supported by this server", "suffix", "unsupported_parameter")
    echo = _type_check(body, "echo", (bool,), "a boolean") or False
    best_of = _type_check(body, "best_of", (int,), "an integer")
    if best_of not in (None, 1):
        raise bad_request("only best_of=1 is supported", "best_of", "unsupported_value")
    body, prompt_only = _echo_only(body)
    special = _type_check(body, "add_special_tokens", (bool,), "a boolean") is not False  # vLLM's default: true
    raw = raw_prompts(body)
    limit = prompt_char_limit(tokenizer, max_model_len, chars_per_token)
    prompts = []
    single = pretrimmed(body, "completion", [(tokenizer, max_model_len, limit)])
    for i, prompt in enumerate(raw_prompts(single) if single is not None and single is not body else raw):
        whole = _completion_ids(prompt, tokenizer, limit, max_model_len, prompt_param(i, len(raw)), special)
        ids = _truncated(whole, body, max_model_len)
        shown = ""
        if echo:  # the prompt the model read
            shown = tokenizer.decode(ids, skip_special_tokens=False) if len(ids) < len(whole) else \
                _prompt_text(prompt, tokenizer, skip_special_tokens=False)
        prompts.append(Prompt(ids, shown))
    longest = max(range(len(prompts)), key=lambda i: len(prompts[i].ids))
    params, stream, include_usage, n = _common(body, len(prompts[longest].ids), max_model_len,
                                               prompt_param(longest, len(raw)), defaults,
                                               kind="completion", vocab=len(tokenizer))
    check_bad_words(params, tokenizer)
    if len(prompts) > 1 and all(body.get(k) is None for k in ("max_tokens", "max_completion_tokens")):
        # each prompt's own room (the shared value is the longest prompt's), as vLLM defaults each prompt
        prompts = [replace(p, max_tokens=_default_max_tokens(len(p.ids), max_model_len, defaults)) for p in prompts]
    if prompt_only and params.logprob_token_ids:
        raise bad_request("'logprob_token_ids' is not supported with 'echo' and 'max_tokens' 0: no token is answered",
                          "logprob_token_ids", "invalid_value")
    echo_logprobs = echo and params.logprobs is not None
    if echo_logprobs:  # the echoed prompt's too, as vLLM (lm-eval's log-likelihoods)
        params = replace(params, prompt_logprobs=params.logprobs)
    params, prompt_k = _prompt_logprobs(body, params, stream)
    if echo_logprobs and prompt_k is None and not stream:  # vLLM's choice shows the echo's as prompt_logprobs too
        prompt_k = params.logprobs
    if len(prompts) * n > MAX_CHOICES:
        raise bad_request(f"a request may ask for at most {MAX_CHOICES} choices (prompts times n), got "
                          f"{len(prompts)} x {n}", "n", "invalid_value")
    return ParsedRequest(body["model"], prompts, params, stream, include_usage, n=n, cache_salt=_cache_salt(body),
                         continuous_usage=_continuous_usage(body, include_usage), prompt_only=prompt_only,
                         return_token_ids=_return_token_ids(body), echo_logprobs=echo_logprobs,
                         prompt_logprobs=prompt_k)


def _prompt_logprobs(body: dict, params: SamplingParams, stream: bool) -> tuple[SamplingParams, int | None]:
    """vLLM's `prompt_logprobs` (0-20: each prompt token's log-probability, rank and that many alternatives;
    vLLM's -1, the whole vocabulary, is refused) and the sampling that computes them: as many alternatives as
    this or an echo's `logprobs` asks, whichever is more. Not with `stream`, as vLLM."""
    if body.get("prompt_logprobs") is None:
        return params, None
    k = _integer(body, "prompt_logprobs", 0)
    if stream:  # 0 is accepted and shows nothing, as vLLM
        if k:
            raise bad_request("'prompt_logprobs' are not available when 'stream' is true", "prompt_logprobs",
                              "invalid_value")
        return params, None
    return replace(params, prompt_logprobs=max(k, params.prompt_logprobs or 0)), k


def truncation(body: dict) -> tuple[int | None, str]:
    """vLLM's `truncate_prompt_tokens` (how many of the prompt's tokens to keep, -1: all the context leaves room
    for; None: no truncation, a prompt too long is a 400) and `truncation_side` ('left', vLLM's default for
    generation, keeps the last tokens; 'right' the first). 0 would leave no prompt to generate from: a 400."""
    k = _type_check(body, "truncate_prompt_tokens", (int,), "an integer")
    side = _type_check(body, "truncation_side", (str,), "a string") or "left"
    if side not in TRUNCATION_SIDES:
        raise bad_request(f"'truncation_side' must be 'left' or 'right', got {side!r}", "truncation_side",
                          "invalid_value")
    if k is not None and k < 1 and k != -1:
        raise bad_request(f"'truncate_prompt_tokens' must be -1 or at least 1, got {k}", "truncate_prompt_tokens",
                          "invalid_value")
    return k, side


def _cut(seq: Any, keep: int, side: str) -> Any:
    """`seq` (a text or token ids) cut to its last `keep` items ('left' truncation) or its first."""
    if len(seq) <= keep:
        return seq
    return seq[len(seq) - keep:] if side == "left" else seq[:keep]


def _kept_tokens(body: dict, max_model_len: int) -> int | None:
    """How many prompt tokens vLLM's truncation keeps for this model (None: no truncation; < 1: no room for any,
    _common's context_length_exceeded): at most what the context leaves beside the answer's `max_tokens` (one
    token when the body leaves it out), else a 400 as vLLM's."""
    k, _side = truncation(body)
    if k is None:
        return None
    asked = [v for v in (body.get("max_tokens"), body.get("max_completion_tokens")) if type(v) is int and v >= 1]
    answer = asked[-1] if asked else 1  # the newer name wins, as in _common
    room = max_model_len - answer
    if k > room >= 1:
        raise bad_request(f"'truncate_prompt_tokens' ({k}) cannot be greater than the model's context less the "
                          f"answer's tokens ({max_model_len} - {answer} = {room})", "truncate_prompt_tokens",
                          "invalid_value")
    return room if k == -1 else k


def _truncated(ids: list[int], body: dict, max_model_len: int) -> list[int]:
    """The prompt's ids as vLLM's `truncate_prompt_tokens` and `truncation_side` keep them."""
    keep = _kept_tokens(body, max_model_len)
    return ids if keep is None or keep < 1 else _cut(ids, keep, truncation(body)[1])


def _cut_messages(messages: list[dict[str, Any]], size: int, side: str) -> list[dict[str, Any]]:
    """A conversation cut to `size` characters (messages_chars) on `side`: the messages on that side emptied (their
    turns kept, so that a template checking the order of roles renders it as it would the whole; the token
    truncation drops them), the one across the cut keeping the part of its content nearest the rest."""
    if messages_chars(messages) <= size:
        return messages
    order = range(len(messages) - 1, -1, -1) if side == "left" else range(len(messages))
    out = list(messages)
    room = size
    for i in order:
        m, n = messages[i], messages_chars([messages[i]])
        if n <= room:
            room -= n
        elif room > n - len(m["content"]):  # its calls fit: its content cut to the room left
            out[i], room = {**m, "content": _cut(m["content"], room - (n - len(m["content"])), side)}, 0
        else:
            out[i] = _emptied(m)
    return out


def _emptied(m: dict[str, Any]) -> dict[str, Any]:
    """A message past a truncation's cut: its turn, without its text (nor its calls' arguments)."""
    out = {**m, "content": ""}
    if m.get("tool_calls"):
        out["tool_calls"] = [{**c, "function": {**c["function"], "arguments": ""}} for c in m["tool_calls"]]
    return out


def _message_tokens(tokenizer, messages: list[dict[str, Any]]) -> int:
    """The tokens of a conversation's texts, without its template's (which only adds to them)."""
    return sum(len(text_prompt_ids(tokenizer, m["content"], False)) for m in messages)


def _shortest_cut(prompt: Any, side: str, models: list[tuple[Any, int, int]]) -> Any:
    """The prompt (a text, or a chat's messages) cut to the fewest characters that still hold, for each model
    (tokenizer, tokens to keep, its character limit), TRUNCATION_MARGIN tokens more than it keeps: the token
    truncation of the cut keeps what it would keep of the whole prompt, and nothing reads (the semantic layer, the
    template, the tokenizer) what no model would. From TRUNCATION_CHARS_PER_TOKEN characters a token, doubled
    while too few; never past the character limit, which holds a whole context (prompt_char_limit)."""
    is_text = isinstance(prompt, str)
    total = len(prompt) if is_text else messages_chars(prompt)
    longest = 0
    for tok, keep, limit in models:
        need, size = keep + TRUNCATION_MARGIN, (keep + TRUNCATION_MARGIN) * TRUNCATION_CHARS_PER_TOKEN
        while size < min(total, limit):
            piece = _cut(prompt, size, side) if is_text else _cut_messages(prompt, size, side)
            if (len(text_prompt_ids(tok, piece, False)) if is_text else _message_tokens(tok, piece)) >= need:
                break
            size *= 2
        longest = max(longest, min(size, total, limit))
    return _cut(prompt, longest, side) if is_text else _cut_messages(prompt, longest, side)


def pretrimmed(body: dict, kind: str, models: list[tuple[Any, int, int]]) -> dict | None:
    """The body as vLLM's truncation reads it, for any of `models` ((tokenizer, max_model_len, character limit):
    one, or every model an alias may pick): each text prompt or the chat's messages (normalized) cut to what
    their token truncation keeps (_shortest_cut), a token-id prompt to the most ids any keeps; the body itself when
    it asks for no truncation; None when no model has room for any prompt token beside `max_tokens` (the caller then
    refuses the prompt by its size, as without truncation). The semantic layer then reads what a model may read, no
    more."""
    k, side = truncation(body)
    if k is None:
        return body
    keeps, refusals = [], []
    for tok, context, limit in models:  # an alias: what the models with room keep (a smaller one refuses alone)
        try:
            keep = _kept_tokens(body, context) or 0
        except APIError as e:
            refusals.append(e)
            continue
        if keep >= 1:
            keeps.append((tok, keep, limit))
    if not keeps:
        if refusals:
            raise refusals[0]
        return None  # no model has room beside max_tokens: the prompt is checked whole (refuse_oversized)
    if kind == "chat":
        return {**body, "messages": _shortest_cut(validate_chat(body), side, keeps)}
    raw = raw_prompts(body)
    most = max(keep for _, keep, _ in keeps)
    cut = [_shortest_cut(p, side, keeps) if isinstance(p, str) and p else _cut(p, most, side) if _is_token_ids(p)
           else p for p in raw]
    return {**body, "prompt": cut[0] if len(raw) == 1 and raw[0] is body.get("prompt") else cut}


def refuse_showing_added_prompt(body: dict) -> None:
    """A 400 for a request whose answer would show the system prompt the semantic layer added for its category:
    its prompt's tokens (vLLM's `return_token_ids`, `prompt_logprobs`), or an `echo` of a last system message (which
    the added prompt replaced or begins). That prompt is the operator's, not the client's
    (`semantic.reveal_injected_prompt` lets it be shown). Callers ask only when the layer added one."""
    messages = body.get("messages")
    last = messages[-1] if isinstance(messages, list) and messages and isinstance(messages[-1], dict) else {}
    shown = [name for name in ("return_token_ids", "prompt_logprobs")
             if body.get(name) is not None and body.get(name) is not False]  # prompt_logprobs 0 shows them too
    if body.get("echo") is True and last.get("role") in ("system", "developer"):
        shown.append("echo")
    if shown:
        raise bad_request(f"'{shown[0]}' would show the system prompt the semantic layer added for this request's "
                          "category; ask for a model by name, or the operator may allow it "
                          "(semantic.reveal_injected_prompt)", shown[0], "invalid_value")


def refuse_cutting_added_prompt(parsed: ParsedRequest) -> None:
    """A 400 for a request whose truncation (vLLM's truncate_prompt_tokens) dropped part of a prompt that begins with
    the system prompt the semantic layer added: a client does not cut the operator's instructions off. Callers ask
    only when the layer added one."""
    if parsed.truncated:
        raise bad_request("'truncate_prompt_tokens' would cut the system prompt the semantic layer added for this "
                          "request's category; ask for a model by name, or send a shorter prompt",
                          "truncate_prompt_tokens", "invalid_value")


def _return_token_ids(body: dict) -> bool:
    """vLLM's `return_token_ids` (the ids an RL trainer learns from, without a tokenizer round trip)."""
    return _type_check(body, "return_token_ids", (bool,), "a boolean") or False


def _continuous_usage(body: dict, include_usage: bool) -> bool:
    """vLLM's `stream_options.continuous_usage_stats`: every chunk carries its choice's usage so far; only with
    `include_usage`, as vLLM (the body passed _common)."""
    return include_usage and body["stream_options"].get("continuous_usage_stats", False)


def _completion_ids(prompt: Any, tokenizer, limit: int, max_model_len: int, param: str,
                    add_special_tokens: bool = True) -> list[int]:
    """One prompt's token ids: a string tokenized (with the tokenizer's special tokens unless the request's
    `add_special_tokens` is false, as vLLM), or token ids checked against the vocabulary and taken as they are."""
    if isinstance(prompt, str):
        if not prompt:
            raise bad_request(f"'{param}' must not be empty", param)
        check_prompt_chars(len(prompt), limit, max_model_len, param)
        return text_prompt_ids(tokenizer, prompt, add_special_tokens)
    if _is_token_ids(prompt):
        vocab = len(tokenizer)
        if any(t < 0 or t >= vocab for t in prompt):
            raise bad_request(f"token ids in '{param}' must be in [0, {vocab})", param, "invalid_value")
        return list(prompt)
    if prompt is None:
        raise bad_request("'prompt' is required", "prompt", "missing_required_parameter")
    raise bad_request(f"'{param}' must be a string, a list of token ids, or a list of those", param)


def require_model(body: Any, known: list[str], embedding: Sequence[str] = ()) -> str:
    """The body must be an object naming a configured model (unknown: 404 model_not_found; the embedding model,
    one of `embedding`, which /v1/models lists too: a 400 pointing to /v1/embeddings)."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    model = body.get("model")
    if model is None:
        raise bad_request("'model' is required", "model", "missing_required_parameter")
    if not isinstance(model, str):
        raise bad_request("'model' must be a string", "model")
    if model in embedding and model not in known:
        raise bad_request(f"The model '{model}' is an embedding model: it is served by /v1/embeddings only", "model",
                          "model_not_supported")
    if model not in known:
        raise APIError(404, f"The model '{model}' does not exist. Available: {', '.join(known)}", param="model",
                       code="model_not_found")
    return model
