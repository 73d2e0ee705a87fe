"""Farm configuration: YAML defaults in config/, an optional override file, then environment.

One way to configure: `config/default.yaml` holds every key; `FARM_CONFIG=/path.yaml` overrides
any subset; `FARM_<SECTION>__<KEY>=value` overrides single keys (values parsed as YAML scalars).
Validation errors name the key and the source so a typo never starts a half-configured farm.
"""

from __future__ import annotations

import os
import secrets
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from farm.batch.config import BatchConfig
from farm.planner.config import PlannerConfig

PROJECT_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG_PATH = PROJECT_ROOT / "config" / "default.yaml"
ENV_PREFIX = "FARM_"


class ConfigError(RuntimeError):
    """Raised for an invalid or unreadable configuration; the message says what and where."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class RedisConfig(_Section):
    url: str = "redis://127.0.0.1:6379/0"
    managed: bool = True
    appendonly: bool = True


class ApiConfig(_Section):
    host: str = "127.0.0.1"
    port: int = Field(8080, ge=1, le=65535)
    threads: int = Field(64, ge=1)
    max_body_bytes: int = Field(4 * 1024 * 1024, ge=1024)
    request_timeout_s: float = Field(600, gt=0)
    first_event_timeout_s: float = Field(300, gt=0)


class FlowerConfig(_Section):
    enabled: bool = True
    host: str = "127.0.0.1"
    port: int = Field(5555, ge=1, le=65535)


class KVTiersConfig(_Section):
    host_mb: float = Field(512, ge=0)  # tier 2: host memory (pinned on CUDA); 0 disables
    disk_mb: float = Field(1024, ge=0)  # tier 3: a file arena under <state_dir>/kvcache; 0 disables
    disk_min_reuse: int = Field(1, ge=0)  # only blocks reused this often are worth a disk write


class EngineConfig(_Section):
    block_size: int = Field(16, ge=1, le=1024)
    kv_cache_mb: int = Field(768, ge=1)
    max_num_seqs: int = Field(64, ge=1)
    max_num_batched_tokens: int = Field(2048, ge=16)
    device: Literal["auto", "cpu", "cuda"] = "auto"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    torch_threads: int = Field(0, ge=0)
    stream_flush_ms: float = Field(20, ge=0)
    kv_tiers: KVTiersConfig = KVTiersConfig()


class TransferConfig(_Section):
    advertise_host: str = "127.0.0.1"
    bind_host: str = "0.0.0.0"
    handle_ttl_s: float = Field(120, gt=0)
    transports: list[Literal["nixl", "shm", "tcp"]] = Field(default_factory=lambda: ["shm", "tcp"], min_length=1)

    @model_validator(mode="after")
    def _tcp_required(self) -> TransferConfig:
        if "tcp" not in self.transports:
            raise ValueError("transfer.transports must include tcp (the control channel, and across hosts)")
        return self


class CeleryConfig(_Section):
    visibility_timeout_s: int = Field(3600, ge=10)
    worker_threads: int = Field(96, ge=1)
    max_request_s: int = Field(1800, ge=1)


class RouterConfig(_Section):
    mode: Literal["kv", "round-robin", "random"] = "kv"
    overlap_weight: float = Field(1.0, ge=0)
    temperature: float = Field(0.0, ge=0)
    use_kv_events: bool = True
    approx_ttl_s: float = Field(120, gt=0)
    prediction_ttl_s: float = Field(10, gt=0)
    tier_weights: dict[str, float] = Field(default_factory=lambda: {"device": 1.0, "host": 0.8, "disk": 0.5})

    @model_validator(mode="after")
    def _tiers_named(self) -> RouterConfig:
        if set(self.tier_weights) != {"device", "host", "disk"}:
            raise ValueError("router.tier_weights needs exactly the keys device, host and disk")
        return self
    busy_threshold: float = Field(0.95, ge=0)
    retry_after_s: int = Field(2, ge=1)
    placement_timeout_s: float = Field(5, gt=0)


class DisaggregationConfig(_Section):
    # conditional: remote prefill only when it pays; always: every request (fails without prefill
    # workers); never: decode workers prefill everything locally.
    mode: Literal["conditional", "always", "never"] = "conditional"
    remote_min_uncached_tokens: int = Field(1000, ge=0)
    max_prefill_queue: int = Field(2, ge=1)


class WorkersConfig(_Section):
    prefill: int = Field(1, ge=0)
    decode: int = Field(1, ge=0)
    both: int = Field(0, ge=0)
    batch_drivers: int = Field(1, ge=0)  # processes that run OpenAI batches (tasks.batch); 0 = no Batch API runs


class ModelConfig(_Section):
    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9._:\-/]+$")
    source: str | None = None
    path: str | None = None
    max_model_len: int = Field(4096, ge=16)

    @model_validator(mode="after")
    def _one_source(self) -> ModelConfig:
        if bool(self.source) == bool(self.path):
            raise ValueError(f"model {self.name!r}: give exactly one of `source` (builtin:...) or `path`")
        if self.source and not self.source.startswith("builtin:"):
            raise ValueError(f"model {self.name!r}: source must be builtin:<name>, got {self.source!r}")
        return self


class FarmConfig(_Section):
    state_dir: str = ".farm"
    redis: RedisConfig = RedisConfig()
    api: ApiConfig = ApiConfig()
    flower: FlowerConfig = FlowerConfig()
    engine: EngineConfig = EngineConfig()
    transfer: TransferConfig = TransferConfig()
    celery: CeleryConfig = CeleryConfig()
    router: RouterConfig = RouterConfig()
    disaggregation: DisaggregationConfig = DisaggregationConfig()
    workers: WorkersConfig = WorkersConfig()
    batch: BatchConfig = BatchConfig()
    planner: PlannerConfig = PlannerConfig()
    default_model: str
    models: list[ModelConfig] = Field(min_length=1)

    @model_validator(mode="after")
    def _cross_checks(self) -> FarmConfig:
        names = [m.name for m in self.models]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate model names: {names}")
        if self.default_model not in names:
            raise ValueError(f"default_model {self.default_model!r} is not one of the models {names}")
        if self.celery.max_request_s >= self.celery.visibility_timeout_s:
            raise ValueError(
                "celery.max_request_s must be smaller than celery.visibility_timeout_s, "
                "or a running request would be redelivered to a second worker"
            )
        return self

    # -- derived paths ---------------------------------------------------------------------------
    @property
    def state_path(self) -> Path:
        p = Path(self.state_dir)
        return p if p.is_absolute() else PROJECT_ROOT / p

    def model(self, name: str) -> ModelConfig:
        for m in self.models:
            if m.name == name:
                return m
        raise KeyError(name)


def _deep_merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in override.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _deep_merge(out[k], v)
        else:
            out[k] = v
    return out


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except FileNotFoundError as e:
        raise ConfigError(f"config file not found: {path}") from e
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {path} is not valid YAML: {e}") from e
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping at the top level")
    return data


def _env_overrides(environ: dict[str, str]) -> dict[str, Any]:
    """FARM_API__PORT=9000 -> {"api": {"port": 9000}}; only keys with `__` are config keys."""
    out: dict[str, Any] = {}
    for key, raw in environ.items():
        if not key.startswith(ENV_PREFIX) or "__" not in key:
            continue
        path = [p.lower() for p in key[len(ENV_PREFIX):].split("__")]
        node = out
        for part in path[:-1]:
            node = node.setdefault(part, {})
        try:
            node[path[-1]] = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError:
            node[path[-1]] = raw
    # FARM_STATE_DIR is the one top-level key people set often.
    if "FARM_STATE_DIR" in environ:
        out["state_dir"] = environ["FARM_STATE_DIR"]
    return out


def load_config(path: str | Path | None = None, environ: dict[str, str] | None = None) -> FarmConfig:
    """Load defaults, then the override file (argument or FARM_CONFIG), then the environment."""
    env = dict(os.environ if environ is None else environ)
    data = _read_yaml(DEFAULT_CONFIG_PATH)
    override_path = path or env.get("FARM_CONFIG")
    if override_path:
        data = _deep_merge(data, _read_yaml(Path(override_path)))
    data = _deep_merge(data, _env_overrides(env))
    try:
        return FarmConfig.model_validate(data)
    except ValidationError as e:
        lines = []
        for err in e.errors():
            where = ".".join(str(p) for p in err["loc"]) or "(top level)"
            lines.append(f"  {where}: {err['msg']}")
        src = f"{DEFAULT_CONFIG_PATH}" + (f" + {override_path}" if override_path else "") + " + FARM_* env"
        raise ConfigError(f"invalid farm configuration ({src}):\n" + "\n".join(lines)) from None


@lru_cache(maxsize=1)
def get_config() -> FarmConfig:
    """The process-wide configuration, loaded once."""
    return load_config()


def farm_secret(cfg: FarmConfig) -> bytes:
    """The HMAC secret shared by every process of the farm.

    FARM_SECRET wins; otherwise a random one is created once in the state dir (mode 0600) so all
    processes started from this checkout agree. Workers on other hosts must get FARM_SECRET.
    """
    env = os.environ.get("FARM_SECRET")
    if env:
        return env.encode()
    path = cfg.state_path / "secret"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
    return path.read_text().strip().encode()
