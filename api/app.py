"""Flask application factory: `gunicorn 'api.app:create_app()'` serves the farm's OpenAI API."""

from __future__ import annotations

import atexit
import logging
import threading
import time
from typing import Any

from flask import Flask

from api.error_handlers import register_error_handlers
from farm.config import FarmConfig, get_config
from farm.gateway import Gateway
from farm.infra import tracing
from farm.infra.cooperative import cooperative
from farm.infra.gc_heap import freeze_startup_heap
from farm.infra.redis_client import connect
from farm.models.directories import ModelNotFoundError
from farm.models.tokenization import get_tokenizer
from farm.telemetry.prometheus import FarmCollector

REDIS_CONNECT_TIMEOUT_S = 5  # an unreachable Redis answers 503 in seconds instead of hanging a request
# /metrics reads the farm-wide series from Redis while Prometheus waits (10 s by default): a hung Redis must end
# the scrape with farm_redis_up 0 well before that, not time the scrape out with nothing recorded
METRICS_REDIS_TIMEOUT_S = 2
# Redis connections beyond one per open connection: the KV-event follower, metrics, warm-up
REDIS_SPARE_CONNECTIONS = 64


class FarmContext:
    """What every request handler shares in one API process: config, Redis, gateway, tokenizers."""

    def __init__(self, cfg: FarmConfig, gateway: Gateway | None = None):
        self.cfg = cfg
        # Every open stream blocks in XREAD on a connection of its own: the pool must hold as many as the
        # server holds connections (redis-py's default caps it at 100 and fails the 101st request).
        self.redis = connect(cfg.redis, health_check_interval=10, socket_keepalive=True,
                             socket_connect_timeout=REDIS_CONNECT_TIMEOUT_S,
                             max_connections=cfg.api.worker_connections + REDIS_SPARE_CONNECTIONS)
        self.gateway = gateway or Gateway(cfg, self.redis)
        self.farm_collector = FarmCollector(connect(cfg.redis, timeout=METRICS_REDIS_TIMEOUT_S, max_connections=8), cfg)
        atexit.register(self.farm_collector.release)
        self.started = int(time.time())
        self._lock = threading.Lock()
        self._tokenizers: dict[str, Any] = {}
        self._semantic_lock = threading.Lock()
        self._semantic = None
        self._served: tuple[float, set[str]] = (0.0, set())
        self._celery = None

    @property
    def celery(self):
        """The Celery app that hands a batch to a driver (generation tasks go out through the gateway's
        TaskPublisher), built on first use."""
        with self._lock:
            if self._celery is None:
                from farm.infra.broker import make_celery

                self._celery = make_celery(self.cfg)
            return self._celery

    def semantic(self):
        """The semantic layer (farm.semantic), built on first use and shared by the process's threads;
        None when `semantic.enabled` is false."""
        if not self.cfg.semantic.enabled:
            return None
        with self._semantic_lock:
            if self._semantic is None:
                from farm.semantic.layer import SemanticLayer

                self._semantic = SemanticLayer.from_config(self.cfg, self.redis, served=self.served_models,
                                                           prefer=self.prefer_model)
            return self._semantic

    def embedder(self):
        """The MiniLM sentence embedder /v1/embeddings answers with: the semantic layer's own, one copy per
        process (farm.semantic.embeddings.get_embedder, which the layer takes too: while the layer is still being
        built, a request waits only for the embedder). With the layer disabled, that instance is loaded on first
        use: the first request waits for the load (seconds)."""
        layer = self._semantic
        if layer is not None:
            return layer.embedder
        from farm.semantic.embeddings import get_embedder

        sem = self.cfg.semantic
        return get_embedder(threads=sem.embedding_threads, backend=sem.embedding_backend)

    def served_models(self) -> set[str]:
        """Models with a live worker now (cached for a second): MoM only picks a model that can answer."""
        at, names = self._served
        if time.monotonic() - at > 1.0:
            from farm.cluster import registry

            names = {w.model for w in registry.live_workers(self.redis)}
            self._served = (time.monotonic(), names)
        return names

    def prefer_model(self, tied: tuple[str, ...], messages: list[dict], scope: str) -> tuple[str, str] | None:
        """MoM among models that score alike (farm.semantic.layer.Prefer): the one the prompt would start on
        soonest, by the router's KV index and load (Gateway.soonest). The prompt is templated for each model as
        its request would be (default template options) and salted with the request's `scope` (its KV cache
        salt), so only the caller's own cached prefixes count: another tenant's cache never shows in the choice."""
        import jinja2
        import redis

        from farm.models.tokenization import chat_prompt_ids

        try:
            prompts = {m: chat_prompt_ids(self.tokenizer(m), messages) for m in tied}
            return self.gateway.soonest(prompts, scope)
        except (jinja2.TemplateError, ValueError, TypeError, KeyError, redis.RedisError):
            return None  # a tie-break only: the best-scored model answers (its own parse reports a bad template)

    def tokenizer(self, model: str):
        """The model's tokenizer, loaded on first use and kept for the process (farm.models.tokenization)."""
        tok = self._tokenizers.get(model)
        if tok is None:
            with self._lock:
                tok = self._tokenizers[model] = get_tokenizer(self.cfg, model)
        return tok


def create_app(cfg: FarmConfig | None = None, gateway: Gateway | None = None, warm_semantic: bool = True) -> Flask:
    """One app per API process: its own Redis client and Gateway; config from get_config() by default."""
    cfg = cfg or get_config()
    tracing.setup("farm-api")  # OTLP traces when OTEL_EXPORTER_OTLP_ENDPOINT is set; nothing otherwise
    app = Flask("inference-farm")
    app.config["MAX_CONTENT_LENGTH"] = cfg.api.max_body_bytes
    app.json.sort_keys = False
    app.extensions["farm"] = FarmContext(cfg, gateway)
    register_error_handlers(app)
    from api import admission, auth, http_policy, openapi, request_tracing
    from api.routes import (
        batches,
        classify,
        embeddings,
        files,
        health,
        messages,
        openai,
        response_routes,
        scrape,
        utility,
    )

    http_policy.install(app)  # Host allow-list, Origin check and CORS (before the key check)
    auth.install(app)  # keys, the no-key loopback rule, per-key limits (before every route)
    admission.install(app)  # the request body's deadline, requests in progress per key (slow bodies)
    request_tracing.install(app)  # last, so outermost: fresh log fields per request, and its span (tracing on)
    app.register_blueprint(openapi.bp)
    app.register_blueprint(openai.bp)
    app.register_blueprint(messages.bp)  # Anthropic's /v1/messages on the chat path, its errors in its shape
    app.register_blueprint(response_routes.bp)  # OpenAI's /v1/responses on the chat path, stored per key
    app.register_blueprint(embeddings.bp)
    app.register_blueprint(classify.bp)  # the Semantic Router's classification API (/api/v1/classify/*)
    app.register_blueprint(utility.bp)
    app.register_blueprint(files.bp)
    app.register_blueprint(batches.bp)
    app.register_blueprint(health.bp)
    app.register_blueprint(scrape.bp)
    logging.getLogger("farm").setLevel(logging.INFO)
    ctx = app.extensions["farm"]
    if cooperative():
        # Under gunicorn's gevent worker a "thread" is a greenlet on the one hub: loading tokenizers or the
        # semantic layer there later would freeze every open stream (and /health/live) for seconds. Load
        # them now, before the worker accepts its first connection; then keep what they loaded out of the
        # garbage collector's full passes, which would stall every stream for a quarter of a second.
        _warm(ctx, warm_semantic)
        freeze_startup_heap()
    else:  # a plain process (tests, tools): a real thread, so the first request need not pay for it
        threading.Thread(target=_warm, args=(ctx, warm_semantic), name="api-warmup", daemon=True).start()
    return app


def _warm(ctx: FarmContext, semantic: bool) -> None:
    """Load what the first requests would otherwise load: every prepared model's tokenizer, the semantic layer."""
    log = logging.getLogger(__name__)
    for m in ctx.cfg.models:
        try:
            ctx.tokenizer(m.name)
        except ModelNotFoundError:
            continue  # not prepared on this host: a request for it answers 503 model_unavailable
        except Exception:  # noqa: BLE001 - the first request loads it again and reports the error
            log.exception("loading the tokenizer of %s failed", m.name)
    if semantic and ctx.cfg.semantic.enabled:
        try:
            ctx.semantic()
        except Exception:  # noqa: BLE001 - the first request builds it again and reports the error
            log.exception("semantic layer warm-up failed")
