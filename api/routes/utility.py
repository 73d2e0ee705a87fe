"""vLLM's routes beside the OpenAI API, at the root as `vllm serve` has them: `POST /tokenize`, `POST /detokenize`
(the farm's own tokenizers and chat templating: a chat completion's prompt gets the very ids /tokenize shows) and
`GET /version` (the farm's version, public like /health). /tokenize and /detokenize take the same API key and
request-rate limit as /v1 (api/auth.py); they spend no tokens of the quota.
"""

from __future__ import annotations

from flask import Blueprint, Response, current_app, jsonify

from api.bodies import json_body
from farm import __version__
from farm.openai.utility import detokenize, parse_detokenize, parse_tokenize, resolve_model, tokenize

bp = Blueprint("utility", __name__)


def _model(asked: str | None) -> str:
    cfg = current_app.extensions["farm"].cfg
    aliases = cfg.semantic.aliases if cfg.semantic.enabled else []
    return resolve_model(asked, [m.name for m in cfg.models], cfg.default_model, aliases)


@bp.post("/tokenize")
def tokenize_route() -> Response:
    farm = current_app.extensions["farm"]
    job = parse_tokenize(json_body())
    model = _model(job.model)
    return jsonify(tokenize(job, farm.tokenizer(model), farm.cfg.model(model).max_model_len,
                            farm.cfg.api.max_chars_per_token, farm.cfg.model(model).tool_call_parser))


@bp.post("/detokenize")
def detokenize_route() -> Response:
    farm = current_app.extensions["farm"]
    req = parse_detokenize(json_body())
    return jsonify(detokenize(req.tokens, farm.tokenizer(_model(req.model))))


@bp.get("/version")
def version() -> Response:
    """The farm's package version, as vLLM's /version gives vLLM's; nothing else about the host."""
    return jsonify({"version": __version__})
