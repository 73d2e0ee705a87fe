"""GET /openapi.json: an OpenAPI 3.1 document of every route, built from farm/openai/schemas.py,
farm/openai/utility_schemas.py and the other protocols' models (Anthropic's, the Responses API's, the Semantic
Router's classification API).

The operation table below names, per route, its request model and response models; the schemas
themselves are the pydantic models' JSON Schema (draft 2020-12, which OpenAPI 3.1 uses as is).
tests/test_openapi.py checks that every Flask route is in this table, so a new route without a
description fails the tests.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from flask import Blueprint, Response, current_app, jsonify
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from farm import __version__
from farm.openai import anthropic as a
from farm.openai import classify_schemas as c
from farm.openai import responses_api as r
from farm.openai import responses_output as ro
from farm.openai import schemas as m
from farm.openai import utility_schemas as u

bp = Blueprint("openapi", __name__)

REF = "#/components/schemas/{model}"
PUBLIC = ("/health", "/health/live", "/health/ready", "/openapi.json", "/version")


@dataclass(frozen=True)
class Op:
    """One operation: method, path (OpenAPI template), what it takes and answers."""

    method: str
    path: str
    summary: str
    body: type[BaseModel] | None = None
    body_type: str = "application/json"
    ok: type[BaseModel] | str | None = None  # a model, or a media type with a string body
    stream: bool = False  # also answers text/event-stream
    errors: tuple[int, ...] = (400, 401, 404, 429)
    query: tuple[tuple[str, dict[str, Any]], ...] = ()
    tags: tuple[str, ...] = field(default_factory=tuple)
    error: type[BaseModel] = m.ErrorResponse  # the shape of its error bodies


_PAGE = (("limit", {"type": "integer", "minimum": 1}), ("after", {"type": "string"}))

OPERATIONS: tuple[Op, ...] = (
    Op("post", "/v1/chat/completions", "Chat completion (stream or not)", m.ChatCompletionRequest,
       ok=m.ChatCompletion, stream=True, errors=(400, 401, 404, 413, 415, 429, 503, 504), tags=("openai",)),
    Op("post", "/v1/completions", "Text completion (stream or not)", m.CompletionRequest, ok=m.TextCompletion,
       stream=True, errors=(400, 401, 404, 413, 415, 429, 503, 504), tags=("openai",)),
    Op("post", "/v1/messages", "Anthropic's Messages API, text only (stream or not), on the chat-completions path",
       a.AnthropicMessagesRequest, ok=a.AnthropicMessage, stream=True,
       errors=(400, 401, 404, 413, 415, 429, 503, 504, 529), tags=("anthropic",), error=a.AnthropicErrorResponse),
    Op("post", "/v1/messages/count_tokens", "Anthropic's token count: the prompt a message request would have "
       "(its chat template, system prompt and tools), nothing generated", a.AnthropicCountTokensRequest,
       ok=a.AnthropicTokenCount, errors=(400, 401, 404, 413, 415, 429), tags=("anthropic",),
       error=a.AnthropicErrorResponse),
    Op("post", "/v1/responses", "OpenAI's Responses API, text and function tools (stream or not), on the "
       "chat-completions path; stored per API key unless store is false", r.ResponsesRequest, ok=ro.ResponseObject,
       stream=True, errors=(400, 401, 404, 413, 415, 429, 503, 504), tags=("openai",)),
    Op("get", "/v1/responses/{response_id}", "A stored response (the caller's own)", ok=ro.ResponseObject,
       errors=(401, 404, 429), tags=("openai",)),
    Op("delete", "/v1/responses/{response_id}", "Delete a stored response", ok=ro.ResponseDeleted,
       errors=(401, 404, 429), tags=("openai",)),
    Op("get", "/v1/responses/{response_id}/input_items", "A stored response's input items",
       ok=ro.ResponseInputItemList, errors=(400, 401, 404, 429),
       query=(("order", {"type": "string", "enum": ["asc", "desc"]}), *_PAGE), tags=("openai",)),
    Op("post", "/v1/embeddings", "Sentence embeddings (all-MiniLM-L6-v2, 384 dimensions)", u.EmbeddingRequest,
       ok=u.EmbeddingResponse, errors=(400, 401, 404, 413, 415, 429, 503), tags=("openai",)),
    Op("get", "/v1/models", "The configured models", ok=m.ModelList, errors=(401, 429), tags=("openai",)),
    Op("get", "/v1/models/{model_id}", "One model", ok=m.ModelCard, errors=(401, 404, 429), tags=("openai",)),
    Op("post", "/v1/files", "Upload a batch input file", m.FileUploadRequest, "multipart/form-data",
       ok=m.FileObject, errors=(400, 401, 413, 429), tags=("files",)),
    Op("get", "/v1/files", "The caller's files", ok=m.FileList, errors=(400, 401, 429),
       query=(("purpose", {"type": "string"}), *_PAGE), tags=("files",)),
    Op("get", "/v1/files/{file_id}", "One file", ok=m.FileObject, errors=(401, 404, 429), tags=("files",)),
    Op("get", "/v1/files/{file_id}/content", "A file's bytes", ok="application/octet-stream",
       errors=(401, 404, 429), tags=("files",)),
    Op("delete", "/v1/files/{file_id}", "Delete a file (409 while a batch that has not ended reads it)",
       ok=m.FileDeleted, errors=(401, 404, 409, 429), tags=("files",)),
    Op("post", "/v1/batches", "Create a batch", m.BatchCreateRequest, ok=m.Batch,
       errors=(400, 401, 404, 413, 415, 429, 503), tags=("batches",)),
    Op("get", "/v1/batches", "The caller's batches", ok=m.BatchList, errors=(400, 401, 429), query=_PAGE,
       tags=("batches",)),
    Op("get", "/v1/batches/{batch_id}", "One batch", ok=m.Batch, errors=(401, 404, 429), tags=("batches",)),
    Op("post", "/v1/batches/{batch_id}/cancel", "Cancel a batch", ok=m.Batch, errors=(401, 404, 409, 429, 503),
       tags=("batches",)),
    Op("post", "/tokenize", "vLLM's /tokenize: a prompt's or chat messages' token ids (as a completion's prompt)",
       u.TokenizeRequest, ok=u.TokenizeResponse, errors=(400, 401, 404, 413, 415, 429, 503), tags=("vllm",)),
    Op("post", "/detokenize", "vLLM's /detokenize: token ids to text", u.DetokenizeRequest,
       ok=u.DetokenizeResponse, errors=(400, 401, 404, 413, 415, 429, 503), tags=("vllm",)),
    Op("post", "/api/v1/classify/intent", "The Semantic Router's intent classification: the category and the model "
       "MoM would choose, nothing generated", c.IntentRequest, ok=c.IntentResponse,
       errors=(400, 401, 404, 413, 415, 429), tags=("semantic",)),
    Op("post", "/api/v1/classify/pii", "The Semantic Router's PII detection: the entities found and whether the "
       "answering model's policy blocks them", c.PIIRequest, ok=c.PIIResponse,
       errors=(400, 401, 404, 413, 415, 429), tags=("semantic",)),
    Op("post", "/api/v1/classify/security", "The Semantic Router's jailbreak detection: the guard's attack "
       "probability and verdict", c.SecurityRequest, ok=c.SecurityResponse,
       errors=(400, 401, 404, 413, 415, 429), tags=("semantic",)),
    Op("post", "/api/v1/classify/combined", "Intent, PII and jailbreak detection of one text", c.CombinedRequest,
       ok=c.CombinedResponse, errors=(400, 401, 404, 413, 415, 429), tags=("semantic",)),
    Op("post", "/api/v1/classify/batch", "Up to 100 texts through one of intent, PII or jailbreak detection",
       c.BatchRequest, ok=c.BatchResponse, errors=(400, 401, 404, 413, 415, 429), tags=("semantic",)),
    Op("get", "/version", "The farm's version (vLLM's /version)", ok=u.VersionResponse, errors=(),
       tags=("operations",)),
    Op("get", "/health", "Redis reachable; live workers per model and role", ok=m.Health, errors=(503,),
       tags=("operations",)),
    Op("get", "/health/live", "Liveness: the process answers (never depends on Redis)", ok=m.Liveness, errors=(),
       tags=("operations",)),
    Op("get", "/health/ready", "Readiness: Redis answers", ok=m.Health, errors=(503,), tags=("operations",)),
    Op("get", "/metrics", "Prometheus metrics (FARM_METRICS_TOKEN, or loopback without API keys, unless "
       "api.metrics_public; an API key gets 403)",
       ok="text/plain", errors=(401,), tags=("operations",)),
    Op("get", "/openapi.json", "This document", ok="application/json", errors=(), tags=("operations",)),
)


def _path_params(path: str) -> list[dict[str, Any]]:
    names = [seg[1:-1] for seg in path.split("/") if seg.startswith("{") and seg.endswith("}")]
    return [{"name": n, "in": "path", "required": True, "schema": {"type": "string", "minLength": 1}} for n in names]


def _ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": REF.format(model=model.__name__)}


def _operation(op: Op) -> dict[str, Any]:
    out: dict[str, Any] = {"summary": op.summary, "operationId": f"{op.method}_{op.path}", "tags": list(op.tags)}
    params = _path_params(op.path) + [{"name": n, "in": "query", "required": False, "schema": s}
                                      for n, s in op.query]
    if params:
        out["parameters"] = params
    if op.body is not None:
        out["requestBody"] = {"required": True, "content": {op.body_type: {"schema": _ref(op.body)}}}
    if isinstance(op.ok, str):
        ok_content = {op.ok: {"schema": {"type": "string"} if op.ok != "application/json" else {"type": "object"}}}
    elif op.ok is not None:
        ok_content = {"application/json": {"schema": _ref(op.ok)}}
        if op.stream:
            ok_content["text/event-stream"] = {"schema": {"type": "string", "description": "SSE: data: <chunk>"}}
    responses: dict[str, Any] = {"200": {"description": "OK", "content": ok_content}}
    for status in op.errors:
        responses[str(status)] = {"description": _ERROR_TEXT.get(status, "error"),
                                  "content": {"application/json": {"schema": _ref(op.error)}}}
    out["responses"] = responses
    if op.path in PUBLIC:
        out["security"] = []
    elif op.error is not m.ErrorResponse:  # Anthropic's clients send the key as x-api-key
        out["security"] = [{"bearer": []}, {"apiKey": []}]
    return out


_ERROR_TEXT = {400: "invalid request (param names the field)", 401: "missing or invalid API key",
               404: "no such object (or not the caller's)", 409: "conflict", 413: "body too large",
               415: "the body is not sent as application/json",
               429: "rate limit or token quota reached (Retry-After)", 503: "no worker / overloaded / Redis down "
               "(Retry-After)", 504: "no worker progress",
               529: "every worker is above its load threshold (Anthropic's overloaded_error, Retry-After)"}


def build_document(version: str = __version__) -> dict[str, Any]:
    """The whole OpenAPI 3.1 document."""
    models = (*m.REQUEST_MODELS, *u.REQUEST_MODELS, *a.REQUEST_MODELS, *r.REQUEST_MODELS, *c.REQUEST_MODELS,
              *m.RESPONSE_MODELS, *u.RESPONSE_MODELS, *a.RESPONSE_MODELS, *ro.RESPONSE_MODELS, *c.RESPONSE_MODELS)
    _, schemas = models_json_schema([(model, "validation") for model in models], ref_template=REF)
    paths: dict[str, dict[str, Any]] = {}
    for op in OPERATIONS:
        paths.setdefault(op.path, {})[op.method] = _operation(op)
    return {
        "openapi": "3.1.0",
        "info": {"title": "Inference Farm API", "version": version,
                 "description": "OpenAI-compatible API of the farm; errors are {error: {message, type, param, "
                                "code}} (Anthropic's {type: error, error: {type, message}} on /v1/messages)."},
        "servers": [{"url": "/"}],
        "security": [{"bearer": []}],
        "paths": paths,
        "components": {"schemas": schemas.get("$defs", {}),
                       "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"},
                                           "apiKey": {"type": "apiKey", "in": "header", "name": "x-api-key"}}},
    }


@bp.get("/openapi.json")
def openapi_json() -> Response:
    doc = current_app.extensions.get("farm_openapi")
    if doc is None:
        doc = current_app.extensions["farm_openapi"] = build_document()
    return jsonify(doc)
