"""Flask application factory: `gunicorn 'api.app:create_app()'` serves the farm's OpenAI API."""

from __future__ import annotations

import logging
import threading
import time

import redis
from flask import Flask

from api.errors import register_error_handlers
from farm.config import FarmConfig, get_config
from farm.gateway import Gateway
from farm.metrics import FarmCollector
from farm.tokenization import get_tokenizer

REDIS_CONNECT_TIMEOUT_S = 5  # an unreachable Redis answers 503 in seconds instead of hanging a thread


class FarmContext:
    """What every request handler shares in one API process: config, Redis, gateway, tokenizers."""

    def __init__(self, cfg: FarmConfig, gateway: Gateway | None = None):
        self.cfg = cfg
        self.redis = redis.Redis.from_url(cfg.redis.url, health_check_interval=10, socket_keepalive=True,
                                          socket_connect_timeout=REDIS_CONNECT_TIMEOUT_S)
        self.gateway = gateway or Gateway(cfg, self.redis)
        self.farm_collector = FarmCollector(self.redis, cfg)
        self.started = int(time.time())
        self._lock = threading.Lock()

    def tokenizer(self, model: str):
        """The model's tokenizer, loaded on first use and cached per process (farm.tokenization)."""
        with self._lock:
            return get_tokenizer(self.cfg, model)


def create_app(cfg: FarmConfig | None = None, gateway: Gateway | None = None) -> Flask:
    """One app per API process: its own Redis client and Gateway; config from get_config() by default."""
    cfg = cfg or get_config()
    app = Flask("inference-farm")
    app.config["MAX_CONTENT_LENGTH"] = cfg.api.max_body_bytes
    app.json.sort_keys = False
    app.extensions["farm"] = FarmContext(cfg, gateway)
    register_error_handlers(app)
    from api import auth, openapi
    from api.routes import batches, files, health, metrics, openai

    auth.install(app)  # keys, the no-key loopback rule, per-key limits (before every route)
    app.register_blueprint(openapi.bp)
    app.register_blueprint(openai.bp)
    app.register_blueprint(files.bp)
    app.register_blueprint(batches.bp)
    app.register_blueprint(health.bp)
    app.register_blueprint(metrics.bp)
    logging.getLogger("farm").setLevel(logging.INFO)
    return app
