"""Farm configuration, one module per section (redis, api, engine, router, batch, planner, semantic; the model
entries in model_entries.py, reliability and logs in processes.py), `FarmConfig` over them (root.py), and loading
(loader.py: defaults, override file, environment).

This package's surface is what the rest of the farm imports (`from farm.config import FarmConfig, load_config`),
so a section can move between modules here without touching its users.
"""

from farm.config.api import ApiConfig, ApiKeyEntry, ApiLimitsConfig, FlowerConfig
from farm.config.base import DEFAULT_CONFIG_PATH, PROJECT_ROOT, ConfigError
from farm.config.engine import CeleryConfig, EngineConfig, KVTiersConfig, TransferConfig, validate_batch_sizes
from farm.config.loader import get_config, load_config
from farm.config.model_entries import ModelConfig, SamplingDefaults, VllmOptions, WorkersConfig
from farm.config.redis import RedisConfig, RedisHAConfig, redact_url, redis_url_with_password
from farm.config.root import FarmConfig
from farm.config.router import CostPrior, DisaggregationConfig, RouterConfig

__all__ = [
    "DEFAULT_CONFIG_PATH", "PROJECT_ROOT", "ApiConfig", "ApiKeyEntry", "ApiLimitsConfig", "CeleryConfig", "ConfigError",
    "CostPrior", "DisaggregationConfig", "EngineConfig", "FarmConfig", "FlowerConfig", "KVTiersConfig",
    "ModelConfig", "RedisConfig", "RedisHAConfig", "RouterConfig", "SamplingDefaults", "TransferConfig",
    "VllmOptions", "WorkersConfig", "get_config", "load_config", "redact_url",
    "redis_url_with_password", "validate_batch_sizes",
]
