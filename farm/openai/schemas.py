"""Pydantic models of the API's request and response bodies: the one source of `/openapi.json`
(api/openapi.py) and of the set of fields each request accepts (an unknown field is a 400
`unknown_parameter`, as OpenAI answers).

farm/openai/parsing.py validates with these models' own bounds (`field_bounds`: the ranges of the
sampling fields are declared once, here) and adds what a schema cannot say (errors naming the exact
parameter and code, context length, vocabulary, the model's backend). A new request field goes here
first, or the API rejects it. Response models are loose (extra fields allowed): they document what clients can rely on.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from annotated_types import Ge, Gt, Le, MaxLen
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr, StringConstraints

from farm.openai.api_error import bad_request
from farm.openai.validation import validated
from farm.protocol import (
    MAX_ALLOWED_TOKEN_IDS,
    MAX_BAD_WORD_CHARS,
    MAX_BAD_WORDS,
    MAX_LOGPROB_TOKEN_IDS,
    MAX_STOP_TOKEN_IDS,
    MAX_TEMPERATURE,
    MAX_TOP_LOGPROBS,
)

Role = Literal["system", "user", "assistant", "developer"]
MAX_N = 16  # choices per request (each is a request of its own on the workers, sharing the prompt's KV)
MAX_CHOICES = 64  # a text completion's prompts times n: vLLM's batched prompt, each choice a request of its own
MAX_TOP_K = 1 << 20
MAX_CACHE_SALT = 128  # vLLM's limit of cache_salt
# Messages in one chat: the semantic layer embeds and scans each, and one-token messages add nothing to the
# prompt's token floor, so without a bound a request of tens of thousands held the encoder for everyone for seconds.
MAX_MESSAGES = 2048
UNSUPPORTED_NOTE = "Not supported by this server: accepted only when absent, null, false or empty."


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _Loose(BaseModel):
    model_config = ConfigDict(extra="allow")


# -- requests ------------------------------------------------------------------------------------
class TextPart(_Loose):
    type: Literal["text"]
    text: str


class FunctionCall(_Loose):
    name: str
    arguments: str = Field(description="the arguments as JSON text")


class ToolCallItem(_Loose):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Loose):
    role: Role | Literal["tool"] = Field(description="developer is handed to the chat template as system; tool "
                                                     "carries a tool's result (with tool_call_id)")
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallItem] | None = Field(None, description="an assistant message's earlier calls")
    tool_call_id: str | None = Field(None, description="a tool message: the call it answers")


class FunctionTool(_Loose):
    name: str = Field(pattern=r"^[A-Za-z0-9_.:-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="a JSON schema of the arguments")
    strict: bool | None = None


class Tool(_Loose):
    type: Literal["function"]
    function: FunctionTool


class StreamOptions(_Loose):
    include_usage: bool = False
    continuous_usage_stats: bool = Field(False, description=(
        "vLLM extension: with include_usage, every chunk carries its choice's usage so far"))


class StructuredOutputs(_Request):
    """vLLM's `structured_outputs`: exactly one constraint on the answer (its StructuredOutputsParams)."""

    json_: dict[str, Any] | StrictStr | None = Field(None, alias="json", description=(
        "a JSON schema (an object, or one as a string)"))
    regex: StrictStr | None = Field(None, min_length=1, description="a regular expression the whole answer matches")
    choice: list[StrictStr] | None = Field(None, min_length=1, description="the answer is one of these strings")
    grammar: StrictStr | None = Field(None, min_length=1, description=(
        "a context-free grammar, in Lark's syntax or GBNF (as vLLM's guidance backend takes it)"))
    json_object: Literal[True] | None = Field(None, description="any JSON object")
    disable_any_whitespace: StrictBool = Field(False, description=(
        "JSON without free whitespace (the built-in engine's JSON is always compact; vLLM workers honour it)"))
    disable_additional_properties: StrictBool = Field(False, description=(
        "objects of the schema take no property it does not name (additionalProperties: false where unset)"))
    whitespace_pattern: Any = Field(None, description=UNSUPPORTED_NOTE)
    structural_tag: Any = Field(None, description=UNSUPPORTED_NOTE)


class StructuredOutputsOf(_Request):
    """A request's `structured_outputs` alone, so a problem is named with its path (`structured_outputs.choice`)."""

    structured_outputs: StructuredOutputs


class _Sampling(_Request):
    model: str = Field(description="a configured model (GET /v1/models)")
    max_tokens: int | None = Field(None, ge=1, description="prompt + max_tokens must fit max_model_len")
    temperature: float | None = Field(None, ge=0, le=MAX_TEMPERATURE)
    top_p: float | None = Field(None, gt=0, le=1)
    n: int | None = Field(None, ge=1, le=MAX_N, description="choices (each generated as a request of its own)")
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    seed: int | None = None
    stop: str | list[str] | None = Field(None, description="at most 4 sequences")
    stream: bool | None = None
    stream_options: StreamOptions | None = Field(None, description="only with stream: true")
    user: str | None = None
    ignore_eos: bool | None = Field(None, description="vLLM extension: generate max_tokens tokens")
    logit_bias: dict[str, float] | None = Field(None, description="token id -> bias in [-100, 100], at most 300")
    top_k: int | None = Field(None, ge=-1, le=MAX_TOP_K, description="vLLM extension: sample among the k most likely (0, -1: all)")
    min_p: float | None = Field(None, ge=0, le=1, description="vLLM extension: minimum probability relative "
                                                              "to the most likely token")
    repetition_penalty: float | None = Field(None, gt=0, le=10, description="vLLM extension: > 1 discourages "
                                                                            "tokens of prompt and completion")
    min_tokens: int | None = Field(None, ge=0, description="vLLM extension: no end of sequence before this many")
    stop_token_ids: list[int] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS, description="vLLM extension: token ids that "
                                                                             "end the completion")
    skip_special_tokens: bool | None = Field(None, description="vLLM extension: leave special tokens out of the "
                                                               "text (default true)")
    include_stop_str_in_output: bool | None = Field(None, description=(
        "vLLM extension: keep the stop string (or the stop token's text) that ended the completion (default false)"))
    allowed_token_ids: list[int] | None = Field(None, min_length=1, max_length=MAX_ALLOWED_TOKEN_IDS, description=(
        "vLLM extension: only these tokens may be sampled"))
    bad_words: list[Annotated[str, Field(min_length=1, max_length=MAX_BAD_WORD_CHARS)]] | None = Field(
        None, max_length=MAX_BAD_WORDS, description=(
            "vLLM extension: words the answer may not contain (the token that would complete one is never sampled; "
            "each word with and without a leading space, as vLLM tokenizes them)"))
    logprob_token_ids: list[int] | None = Field(None, max_length=MAX_LOGPROB_TOKEN_IDS, description=(
        "vLLM extension: with logprobs, each generated token's log-probability and these tokens' (after the "
        "sampled one, in this order) instead of the most likely ones: a label set's scores at every position"))
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS, description=(
        "vLLM extension: each prompt token's log-probability, rank and this many alternatives (chat: on the "
        "response; a text completion: on each choice); not with stream"))
    return_token_ids: bool | None = Field(None, description=(
        "vLLM extension: each choice carries its generated `token_ids` and the prompt's `prompt_token_ids` (chat: on "
        "the response; streamed: on a choice's first chunk, and each chunk its own ids)"))
    truncate_prompt_tokens: int | None = Field(None, ge=-1, description=(
        "vLLM extension: keep this many of the prompt's tokens (-1: as many as leave room for max_tokens, or for one "
        "token without it) instead of refusing a prompt too long for the context"))
    truncation_side: Literal["left", "right"] | None = Field(None, description=(
        "vLLM extension: with truncate_prompt_tokens, 'left' (the default, as vLLM's for generation) keeps the "
        "prompt's last tokens, 'right' its first"))
    structured_outputs: StructuredOutputs | None = Field(None, description=(
        "vLLM extension: the answer held to a JSON schema, a regex, a choice of strings or a grammar (not with "
        "response_format, nor with a forced tool_choice)"))
    use_beam_search: StrictBool | None = Field(None, description=(
        "vLLM extension: " + UNSUPPORTED_NOTE + " Beam search is not served: true is a 400"))
    length_penalty: float | None = Field(None, description=(
        "vLLM extension: beam search's length penalty; accepted and, as in vLLM without use_beam_search, not applied"))
    cache_salt: str | None = Field(None, min_length=1, max_length=MAX_CACHE_SALT, description=(
        "vLLM extension: prefix-cache reuse only among requests with this salt, within the caller's own API key's "
        "scope (which every request has anyway); no '@', '/', '\\' or NUL"))


class ServingHints(_Request):
    """OpenAI's serving hints, accepted and not applied by chat and by the Responses API alike."""

    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = Field(
        None, description="accepted; every request is served alike")
    prompt_cache_key: StrictStr | None = Field(None, max_length=1024, description=(
        "accepted; the KV-aware router finds a cached prefix from the prompt itself"))
    safety_identifier: StrictStr | None = Field(None, max_length=256, description="accepted, as `user`")


class OpenAIHints(ServingHints):
    """Fields of OpenAI's chat API that are accepted and not applied, as vLLM accepts them: none changes what a
    client may rely on in the answer (wrappers such as LiteLLM and LangChain send several on their own). What
    would change it (audio, web search) stays a 400."""

    store: StrictBool | None = Field(None, description="accepted; a chat completion is not kept for retrieval")
    metadata: dict[Annotated[str, StringConstraints(max_length=64)],
                   Annotated[StrictStr, StringConstraints(max_length=512)]] | None = Field(
        None, max_length=16, description="accepted, not kept (OpenAI keeps it with a stored completion)")
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = Field(
        None, description="accepted, not applied: the semantic layer picks the reasoning mode")
    verbosity: Literal["low", "medium", "high"] | None = Field(None, description="accepted, not applied")
    modalities: list[Literal["text"]] | None = Field(None, description="text only")
    prediction: dict[str, Any] | None = Field(None, description=(
        "a predicted output: accepted; it would only speed the answer up, which is the same without it"))


def check_hints(body: dict[str, Any]) -> None:
    """400 naming the first of the body's OpenAIHints fields whose value OpenAI would refuse."""
    sub = {k: body[k] for k in OpenAIHints.model_fields if k in body}
    if not sub:
        return
    validated(OpenAIHints, sub)


class ChatCompletionRequest(_Sampling, OpenAIHints):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = Field(None, ge=1, description="wins over max_tokens")
    logprobs: bool | None = Field(None, description="log-probabilities of the generated tokens")
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS, description="alternatives per token (with logprobs)")
    tools: list[Tool] | None = Field(None, max_length=128, description=(
        "function tools: rendered by the model's chat template (or, for a template without tools, as a system "
        "prompt in the model's tool-call format)"))
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = Field(None, description=(
        "auto (default with tools; needs the model's tool_call_parser), none, required, or "
        "{\"type\": \"function\", \"function\": {\"name\": ...}}; required and a named function are "
        "forced by structured output"))
    parallel_tool_calls: bool | None = Field(None, description="false: at most one call (default true)")
    functions: list[dict[str, Any]] | None = Field(None, description=UNSUPPORTED_NOTE)
    function_call: str | dict[str, Any] | None = Field(None, description=UNSUPPORTED_NOTE)
    response_format: dict[str, Any] | None = Field(
        None, description="text, json_object or json_schema (structured output, on both engines)")
    chat_template_kwargs: dict[str, Any] | None = Field(None, description=(
        "vLLM extension: variables for the model's chat template (e.g. enable_thinking); not the template's own "
        "parameters (tokenize, tools, ..., and add_generation_prompt / continue_final_message, which are fields here)"))
    add_generation_prompt: bool | None = Field(None, description=(
        "vLLM extension: end the prompt with the header of a new assistant turn (default true); false: the "
        "response's role is the last message's"))
    continue_final_message: bool | None = Field(None, description=(
        "vLLM extension: leave the last message open and let the model continue it (default false; needs "
        "add_generation_prompt false)"))
    echo: bool | None = Field(None, description=(
        "vLLM extension: the answer starts with the last message's content when that message has the response's "
        "role (an assistant message to continue, with continue_final_message)"))
    add_special_tokens: bool | None = Field(None, description=(
        "vLLM extension: the tokenizer's special tokens (e.g. a BOS) on top of what the chat template writes "
        "(default false)"))


class CompletionRequest(_Sampling):
    """POST /v1/completions: a prompt as text or token ids, or a batch of them (vLLM's)."""

    prompt: str | list[int] | list[str | list[int]] = Field(description=(
        f"a string, a list of token ids, or a list of those (a batch: choice i*n+j is the j-th of prompt i; at "
        f"most {MAX_CHOICES} choices in all)"))
    max_tokens: int | None = Field(None, ge=0, description=(
        "prompt + max_tokens must fit max_model_len; 0 only with echo: the choice is the prompt alone (one token "
        "is generated and counted, as vLLM does)"))
    echo: bool | None = Field(None, description=(
        "each choice starts with its prompt's text; with logprobs, its log-probabilities start with the prompt "
        "tokens' (null for the first), as vLLM answers"))
    suffix: str | None = Field(None, description=UNSUPPORTED_NOTE)
    best_of: Literal[1] | None = None
    add_special_tokens: bool | None = Field(None, description=(
        "vLLM extension: a text prompt tokenized with the tokenizer's special tokens (e.g. a BOS; default true); "
        "token-id prompts are taken as they are"))
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS, description="log-probabilities with this many alternatives")


class BatchCreateRequest(_Request):
    """POST /v1/batches."""

    input_file_id: str
    endpoint: Literal["/v1/chat/completions", "/v1/completions"]
    completion_window: Literal["24h"]
    metadata: dict[str, str] | None = Field(None, max_length=16)
    schedule: Literal["prefix", "input"] | None = Field(None, description="extension: line order of this batch")


class FileUploadRequest(_Request):
    """POST /v1/files (multipart/form-data)."""

    purpose: Literal["batch"]
    file: bytes = Field(json_schema_extra={"format": "binary"})


# -- responses -----------------------------------------------------------------------------------
class ErrorDetail(_Loose):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(_Loose):
    """Every 4xx/5xx body."""

    error: ErrorDetail


class ModelCard(_Loose):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int


class ModelList(_Loose):
    object: Literal["list"]
    data: list[ModelCard]


class Usage(_Loose):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class AssistantMessage(_Loose):
    role: Literal["assistant", "user", "system"] = Field(
        description="assistant; with add_generation_prompt false, the last message's role (as vLLM answers)")
    content: str


class ChatChoice(_Loose):
    index: int
    message: AssistantMessage
    finish_reason: str


class ChatCompletion(_Loose):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class TextChoice(_Loose):
    index: int
    text: str
    finish_reason: str | None


class TextCompletion(_Loose):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[TextChoice]
    usage: Usage


class FileObject(_Loose):
    id: str
    object: Literal["file"]
    bytes: int
    created_at: int
    filename: str
    purpose: str


class _Page(_Loose):
    object: Literal["list"]
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool = False


class FileList(_Page):
    data: list[FileObject]


class FileDeleted(_Loose):
    id: str
    object: Literal["file"]
    deleted: bool


class Batch(_Loose):
    id: str
    object: Literal["batch"]
    endpoint: str
    input_file_id: str
    completion_window: str
    status: str
    request_counts: dict[str, int]


class BatchList(_Page):
    data: list[Batch]


class Health(_Loose):
    status: str
    redis: str


class Liveness(_Loose):
    status: str


REQUEST_MODELS: tuple[type[BaseModel], ...] = (ChatCompletionRequest, CompletionRequest, BatchCreateRequest,
                                               FileUploadRequest)
RESPONSE_MODELS: tuple[type[BaseModel], ...] = (ErrorResponse, ModelCard, ModelList, ChatCompletion,
                                                TextCompletion, FileObject, FileList, FileDeleted, Batch,
                                                BatchList, Health, Liveness)


def reject_unknown_fields(body: dict[str, Any], model: type[BaseModel]) -> None:
    """400 `unknown_parameter` naming the first field `model` does not declare (OpenAI's answer)."""
    for name in body:
        if name not in model.model_fields:
            raise bad_request(f"Unknown parameter: '{name}'.", str(name), "unknown_parameter")


def field_bounds(model: type[BaseModel], name: str) -> tuple[float | None, float | None, bool]:
    """(low, high, low excluded) of a numeric request field as declared above: the validator's ranges and the
    OpenAPI document's are the same numbers."""
    lo = hi = None
    lo_open = False
    for m in model.model_fields[name].metadata:
        if isinstance(m, Ge):
            lo = m.ge
        elif isinstance(m, Gt):
            lo, lo_open = m.gt, True
        elif isinstance(m, Le):
            hi = m.le
        elif isinstance(m, MaxLen):
            hi = m.max_length
    return lo, hi, lo_open
