"""The few farm functions this bench calls directly, found where the farm keeps them now or kept them before
(the farm's modules are being reorganised: farm.models -> farm.models.directories, farm.tokenization ->
farm.models.tokenization, farm.redis_client -> farm.infra.redis_client), so the bench runs on either tree."""

from __future__ import annotations

import importlib
from typing import Any


def _first(name: str, *modules: str) -> Any:
    errors = []
    for mod in modules:
        try:
            return getattr(importlib.import_module(mod), name)
        except (ImportError, AttributeError) as e:
            errors.append(f"{mod}: {e}")
    raise ImportError(f"{name} not found: {'; '.join(errors)}")


def require_model_dir(cfg: Any, model: Any) -> Any:
    return _first("require_model_dir", "farm.models.directories", "farm.models")(cfg, model)


def chat_prompt_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    return _first("chat_prompt_ids", "farm.models.tokenization", "farm.tokenization")(tokenizer, messages)


def redis_connect(target: Any, **options: Any) -> Any:
    return _first("connect", "farm.infra.redis_client", "farm.redis_client")(target, **options)
