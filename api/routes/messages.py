"""Anthropic's Messages API, `POST /v1/messages`, on the chat-completions path.

The body is checked and translated by farm.openai.anthropic into a chat-completions body, which runs through the
very path of /v1/chat/completions (api.routes.openai.generate: model check, limits, token quota, the semantic
layer, the gateway); its answer is translated back, JSON or SSE. Every error of this route, the key check and the
body's limits included, is in Anthropic's shape (`{"type": "error", "error": {"type", "message"}}`), with the
farm's status (529 when every worker is above its load threshold). The key may come as `x-api-key` (Anthropic's
header) or `Authorization: Bearer` (api/auth.py); `anthropic-version` and `anthropic-beta` are accepted and not read.
"""

from __future__ import annotations

import logging

from flask import Blueprint, Response, current_app, jsonify

from api.bodies import json_body
from api.routes.openai import generate
from farm.openai import anthropic
from farm.openai.parsing import parse_chat, require_model
from farm.semantic.embeddings import MODEL_NAMES

log = logging.getLogger(__name__)
bp = Blueprint("messages", __name__, url_prefix="/v1")


@bp.post("/messages")
def create_message() -> Response:
    req = anthropic.parse_request(json_body())
    stops = anthropic.stop_sequences(req)
    prompt_tokens: list[int] = []
    resp = generate("chat", anthropic.to_chat_body(req), on_prompt=prompt_tokens.append)
    if resp.headers.get("x-request-id"):
        resp.headers["request-id"] = anthropic.request_id(resp.headers["x-request-id"])  # where its SDKs read it
    shown = anthropic.shows_thinking(req)
    if resp.mimetype == "text/event-stream":
        resp.response = anthropic.translate_stream(resp.response, stops,
                                                   lambda: prompt_tokens[0] if prompt_tokens else 0, shown)
        return resp
    resp.set_data(jsonify(anthropic.from_chat_completion(resp.get_json(), stops, shown)).get_data())
    return resp


@bp.post("/messages/count_tokens")
def count_tokens() -> Response:
    """The prompt's token count as a message request would have it: the chat route's own parsing and templating
    (tools included) of the translated body, for the model asked (the default model's for an alias); no quota spent
    and no semantic layer (it generates nothing)."""
    farm = current_app.extensions["farm"]
    chat = anthropic.to_chat_body(anthropic.parse_count_request(json_body()))
    aliases = farm.cfg.semantic.aliases if farm.cfg.semantic.enabled else []
    model = require_model(chat, [m.name for m in farm.cfg.models] + list(aliases), MODEL_NAMES)
    model = farm.cfg.default_model if model in aliases else model
    mcfg = farm.cfg.model(model)
    parsed = parse_chat({**chat, "model": model}, farm.tokenizer(model), mcfg.max_model_len, None, mcfg.defaults,
                        farm.cfg.api.max_chars_per_token, tool_parser=mcfg.tool_call_parser,
                        reasoning_parser=mcfg.reasoning_parser)
    return jsonify({"input_tokens": len(parsed.prompt_ids)})
