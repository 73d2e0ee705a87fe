"""Worker engine backends, chosen per model by `models[].backend`: `builtin` (farm.engine) or `vllm`.

The worker calls `make_engine` once; everything else it does goes through the interface both engines
share, farm.engine.contract.ServingEngine (submit, abort, release_held, stats, active_request_ids, held, runner,
pool, costs, start, stop). vLLM is imported only when a model uses it, so the farm installs and runs without it.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from farm.config import FarmConfig, ModelConfig
from farm.engine.contract import ServingEngine
from farm.protocol.kv_events import KVEventHook

log = logging.getLogger(__name__)


def make_engine(cfg: FarmConfig, model: ModelConfig, model_dir: Path, on_kv_event: KVEventHook | None = None, *,
                worker_id: str = "", role: str = "both") -> ServingEngine:
    """The engine for `model`: farm.engine.engine.Engine, or a VllmEngine over vLLM's AsyncLLM."""
    if model.backend == "vllm":
        from farm.backends.vllm import VllmEngine

        return VllmEngine(cfg, model, model_dir, on_kv_event, worker_id=worker_id, role=role)
    from farm.engine.engine import Engine

    engine_cfg = cfg.engine.model_copy(update={"block_size": cfg.block_size(model.name)})
    return Engine(model_dir, engine_cfg, model.max_model_len, on_kv_event=on_kv_event,
                  handle_ttl_s=cfg.transfer.handle_ttl_s, kv_tier_dir=cfg.state_path / "kvcache")


def connector_import(engine: ServingEngine, handle: dict[str, Any], secret: bytes) -> Any | None:
    """For a handle whose KV moves through vLLM's KV connector: what the decode side passes to
    `engine.submit(kv_import=...)`, or None when this engine cannot use it (a built-in engine, another
    connector, a bad or expired handle); the caller then prefills locally."""
    from farm.backends.vllm_handles import import_from_handle
    from farm.transfer.handle import HandleError

    connector = getattr(engine, "connector", None)
    try:
        return import_from_handle(handle, secret, connector)
    except (HandleError, KeyError, TypeError, ValueError) as e:
        log.warning("request %s: vLLM KV handle not usable here (%s); prefilling locally",
                    handle.get("request_id"), e)
        return None
