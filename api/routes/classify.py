"""The Semantic Router's classification API on the farm's API: `POST /api/v1/classify/intent`, `/pii`,
`/security`, `/combined` and `/batch`, in its shapes (farm/semantic/classify_api.py). Nothing is generated or
cached; the same API key and request-rate limit as /v1 apply (api/auth.py; each text of a batch counts as one
request), and no token of the quota is spent.
"""

from __future__ import annotations

import time

from flask import Blueprint, Response, current_app, jsonify

from api.auth import count_requests, request_scope
from api.bodies import json_body
from farm.openai import classify_schemas as schemas
from farm.openai.api_error import APIError
from farm.openai.validation import validated
from farm.semantic import classify_api as vsr

bp = Blueprint("classify", __name__, url_prefix="/api/v1/classify")


def _json(model) -> Response:
    return jsonify(model.model_dump(exclude_none=True))


def _layer(model: str | None):
    """The farm's semantic layer, once the model asked about is known (404s as the Router gives them)."""
    farm = current_app.extensions["farm"]
    layer = farm.semantic()
    if layer is None:
        raise APIError(404, "The semantic layer is disabled on this farm (semantic.enabled: false).",
                       code="semantic_layer_disabled")
    if model is not None and not layer.is_alias(model) and model not in {m.name for m in farm.cfg.models}:
        raise APIError(404, f"The model '{model}' does not exist.", param="model", code="model_not_found")
    return layer


def _signals(text: str, model: str | None, want: frozenset[str]):
    return _layer(model).signals(text, model or "", scope=request_scope(), want=want)


@bp.post("/intent")
def intent() -> Response:
    req = validated(schemas.IntentRequest, json_body())
    return _json(vsr.intent(_signals(req.text, req.model, frozenset({"category"})), req.options))


@bp.post("/pii")
def pii() -> Response:
    req = validated(schemas.PIIRequest, json_body())
    # the policy of the model the alias would choose needs the category
    want = frozenset({"pii", "category"}) if req.model is None else frozenset({"pii"})
    return _json(vsr.pii(_signals(req.text, req.model, want), req.options))


@bp.post("/security")
def security() -> Response:
    req = validated(schemas.SecurityRequest, json_body())
    return _json(vsr.security(_signals(req.text, None, frozenset({"jailbreak"})), req.options))


@bp.post("/combined")
def combined() -> Response:
    req = validated(schemas.CombinedRequest, json_body())
    return _json(vsr.combined(_signals(req.text, req.model, frozenset({"category", "jailbreak", "pii"})), req))


@bp.post("/batch")
def batch() -> Response:
    """Up to 100 texts, one task each (intent, pii or security), in the Router's one-label form: read together
    (shared forwards, one PII pass), and counted as one request each."""
    req = validated(schemas.BatchRequest, json_body())
    layer = _layer(None)
    count_requests(len(req.texts) - 1, "texts")
    t0 = time.perf_counter()
    want = frozenset({{"intent": "category", "security": "jailbreak", "pii": "pii"}[req.task_type]})
    sigs = layer.signals_many(req.texts, scope=request_scope(), want=want)
    return _json(vsr.batch(sigs, req.task_type, req.options, (time.perf_counter() - t0) * 1000))
