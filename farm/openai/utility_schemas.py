"""Pydantic models of the routes beside chat and completions that a `vllm serve` user expects: vLLM's
`POST /tokenize`, `POST /detokenize` and `GET /version`, and OpenAI's `POST /v1/embeddings`.

As in farm/openai/schemas.py, they are the one source of the fields each request accepts (an unknown field is a
400 `unknown_parameter`), of their bounds and of these routes' part of `/openapi.json` (api/openapi.py); requests
are validated against them strictly (no "1" for 1, no true for 1) by farm/openai/utility.py, which adds what a
schema cannot say (the model's vocabulary and context, the embedding window).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, RootModel

from farm.openai.schemas import UNSUPPORTED_NOTE, ChatMessage, _Loose

MAX_DETOKENIZE_TOKENS = 1 << 17  # token ids per /detokenize request
MAX_EMBEDDING_INPUTS = 256  # texts per /v1/embeddings request (each one forward on the API's CPU)


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


_MODEL = "a configured model (GET /v1/models); default: the farm's default model"
_TOKEN_STRS = "also return each token's string (the tokenizer's convert_ids_to_tokens)"


# -- requests ------------------------------------------------------------------------------------
class TokenizeCompletionRequest(_Request):
    """POST /tokenize with a text prompt: its ids as a text completion's prompt would get them."""

    model: str | None = Field(None, description=_MODEL)
    prompt: str
    add_special_tokens: bool = Field(True, description="the tokenizer's special tokens (e.g. BOS), as a completion does")
    return_token_strs: bool | None = Field(False, description=_TOKEN_STRS)


class TokenizeChatRequest(_Request):
    """POST /tokenize with chat messages: by default exactly the prompt ids a chat completion would send the
    model (its chat template with the generation prompt)."""

    model: str | None = Field(None, description=_MODEL)
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool | None = Field(
        None, description="end with the header of a new assistant turn (default true), as a chat completion does")
    continue_final_message: bool | None = Field(
        None, description="leave the last message open (default false; needs add_generation_prompt false)")
    add_special_tokens: bool = Field(False, description="the tokenizer's special tokens on top of the template's")
    return_token_strs: bool | None = Field(False, description=_TOKEN_STRS)
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="variables the chat template may read (e.g. enable_thinking); as in a chat completion")
    chat_template: str | None = Field(None, description=UNSUPPORTED_NOTE + " (a request's own template is refused, "
                                                                         "as vLLM refuses it by default)")
    tools: list[dict[str, Any]] | None = Field(None, description="function tools, rendered as a chat completion "
                                                                 "renders them")


class TokenizeRequest(RootModel[TokenizeCompletionRequest | TokenizeChatRequest]):
    """POST /tokenize: a prompt, or chat messages (vLLM's two forms)."""


class DetokenizeRequest(_Request):
    """POST /detokenize."""

    model: str | None = Field(None, description=_MODEL)
    tokens: list[Annotated[int, Field(ge=0)]] = Field(
        max_length=MAX_DETOKENIZE_TOKENS, description="token ids in [0, the model's vocabulary size)")


class EmbeddingRequest(_Request):
    """POST /v1/embeddings: sentence embeddings from the semantic layer's MiniLM model."""

    model: str | None = Field(None, description="the embedding model: all-MiniLM-L6-v2 (or its Hugging Face id "
                                                "sentence-transformers/all-MiniLM-L6-v2); default: that model")
    input: str | list[str] | list[int] | list[list[int]] = Field(
        description=f"a string or a list of at most {MAX_EMBEDDING_INPUTS} non-empty strings, each at most the "
                    "model's window (256 tokens) unless truncate_prompt_tokens; token ids are refused")
    encoding_format: Literal["float", "base64"] = Field(
        "float", description="base64: each vector's little-endian float32 bytes")
    dimensions: int | None = Field(None, ge=1, description="only the model's own size (384)")
    user: str | None = None
    truncate_prompt_tokens: int | None = Field(
        None, ge=-1, description="vLLM extension: cut each input to this many tokens (2 to 256; -1: the window), "
                                 "keeping its start")


# -- responses -----------------------------------------------------------------------------------
class TokenizeResponse(_Loose):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(_Loose):
    prompt: str


class VersionResponse(_Loose):
    version: str


class EmbeddingData(_Loose):
    object: Literal["embedding"]
    index: int
    embedding: list[float] | str = Field(description="floats, or base64 of their little-endian float32 bytes")


class EmbeddingUsage(_Loose):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(_Loose):
    object: Literal["list"]
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage


REQUEST_MODELS: tuple[type[BaseModel], ...] = (TokenizeRequest, TokenizeCompletionRequest, TokenizeChatRequest,
                                               DetokenizeRequest, EmbeddingRequest)
RESPONSE_MODELS: tuple[type[BaseModel], ...] = (TokenizeResponse, DetokenizeResponse, VersionResponse,
                                                EmbeddingResponse)
