"""Farm configuration: YAML defaults in config/, an optional override file, then environment.

One way to configure: `config/default.yaml` holds every key; `FARM_CONFIG=/path.yaml` overrides
any subset; `FARM_<SECTION>__<KEY>=value` overrides single keys (values parsed as YAML scalars).
Validation errors name the key and the source so a typo never starts a half-configured farm.
"""

from __future__ import annotations

import os
import re
import secrets
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal
from urllib.parse import quote, urlsplit, urlunsplit

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from farm.batch.config import BatchConfig
from farm.planner.config import PlannerConfig
from farm.semantic.config import SemanticConfig

# The defaults ship inside the package (farm/defaults/default.yaml, a link to config/default.yaml in the
# checkout), so an installed farm finds them anywhere. Relative paths (state_dir, profiles) resolve against
# the checkout when running from one, else against the working directory.
DEFAULT_CONFIG_PATH = Path(__file__).resolve().parent / "defaults" / "default.yaml"
_PACKAGE_PARENT = Path(__file__).resolve().parents[1]
PROJECT_ROOT = _PACKAGE_PARENT if (_PACKAGE_PARENT / "config" / "default.yaml").is_file() else Path.cwd()
ENV_PREFIX = "FARM_"


class ConfigError(RuntimeError):
    """Raised for an invalid or unreadable configuration; the message says what and where."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class RedisHAConfig(_Section):
    """Redis Sentinel. Every farm process asks the sentinels where the primary is (and asks again after a
    failover); `farm up` with a managed Redis starts the primary (redis.url's port), a replica and the
    sentinels on this machine. redis.url still gives the password and the database."""

    enabled: bool = False
    master_name: str = Field("farm", pattern=r"^[A-Za-z0-9._-]{1,64}$")
    sentinels: list[str] = Field(default_factory=lambda: ["127.0.0.1:26379", "127.0.0.1:26380", "127.0.0.1:26381"],
                                 min_length=1)  # host:port
    replica_port: int = Field(6380, ge=1, le=65535)  # managed: where the replica listens
    quorum: int = Field(2, ge=1)  # sentinels that must agree the primary is down
    down_after_ms: int = Field(2000, ge=100)  # silence after which a sentinel thinks the primary is down
    failover_timeout_ms: int = Field(10000, ge=1000)
    # Token stream writes wait up to this long for a replica to hold them (WAIT), so a failover loses none
    # that a reader may not have seen yet; 0 = do not wait (asynchronous replication only).
    replica_ack_timeout_ms: int = Field(200, ge=0)

    @field_validator("sentinels", mode="before")
    @classmethod
    def _comma_list(cls, v: Any) -> Any:
        """FARM_REDIS__HA__SENTINELS=h1:26379,h2:26379 works as well as a YAML list."""
        return [p.strip() for p in v.split(",") if p.strip()] if isinstance(v, str) else v

    @field_validator("sentinels")
    @classmethod
    def _host_ports(cls, v: list[str]) -> list[str]:
        for item in v:
            host, _, port = item.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"a sentinel is host:port, got {item!r}")
        return v

    @model_validator(mode="after")
    def _quorum_reachable(self) -> RedisHAConfig:
        if self.quorum > len(self.sentinels):
            raise ValueError(f"quorum {self.quorum} is more than the {len(self.sentinels)} sentinels")
        return self

    def sentinel_addresses(self) -> list[tuple[str, int]]:
        out = []
        for item in self.sentinels:
            host, _, port = item.rpartition(":")
            out.append((host.strip("[]"), int(port)))
        return out


class RedisConfig(_Section):
    url: str = "redis://127.0.0.1:6379/0"
    managed: bool = True
    appendonly: bool = True
    # A Redis off this machine must have a password (in the URL or FARM_REDIS_PASSWORD); true waives it.
    allow_no_password: bool = False
    ha: RedisHAConfig = RedisHAConfig()


class ApiLimitsConfig(_Section):
    """Per API key (each key on its own), held in Redis so every API replica enforces the same count."""

    requests_per_minute: int = Field(0, ge=0)  # fixed 60 s windows; 0 = unlimited
    token_quota: int = Field(0, ge=0)  # prompt + completion tokens per key per window; 0 = unlimited
    token_quota_window_s: int = Field(86400, ge=1)


class ApiKeyEntry(_Section):
    """One API key with its own limits (replacing `api.limits`' for this key; unset ones are inherited)."""

    key: str = Field(min_length=1)  # the key itself, or "sha256:<hex>" of it (keeps the file free of secrets)
    requests_per_minute: int | None = Field(None, ge=0)
    token_quota: int | None = Field(None, ge=0)


class ApiConfig(_Section):
    host: str = "127.0.0.1"
    port: int = Field(8080, ge=1, le=65535)
    # gunicorn's gevent worker: the most connections one API process holds at once (an open stream is a
    # greenlet and, while it waits for tokens, one Redis connection: keep the sum over API processes under
    # Redis's maxclients, 10000 by default). Further clients wait in the listen backlog.
    worker_connections: int = Field(4096, ge=1, le=100_000)
    # Seconds a client has to send a complete request head (and a keep-alive connection may sit idle);
    # then the connection is closed: slow-header (slowloris) clients cannot hold connections for long.
    header_timeout_s: int = Field(10, ge=1, le=3600)
    max_body_bytes: int = Field(4 * 1024 * 1024, ge=1024)
    request_timeout_s: float = Field(600, gt=0)
    first_event_timeout_s: float = Field(300, gt=0)
    # API keys (Bearer): plain keys or "sha256:<hex>", or {key, requests_per_minute, token_quota} for a key
    # with its own limits; FARM_API_KEYS (comma-separated) adds more, with `limits` (api/auth.py).
    api_keys: list[str | ApiKeyEntry] = Field(default_factory=list)
    # Without keys only loopback clients are served (and `farm up` refuses a non-local api.host);
    # true serves everyone without a key (only behind your own authenticating proxy).
    allow_unauthenticated: bool = False
    metrics_public: bool = False  # /metrics without a key or FARM_METRICS_TOKEN from other hosts
    limits: ApiLimitsConfig = ApiLimitsConfig()
    # Host header names served besides loopback and api.host ("*": any); anything else is 400 (DNS rebinding).
    allowed_hosts: list[str] = Field(default_factory=list)
    # Browser origins allowed to call the API (CORS), e.g. "https://app.example.com"; none by default.
    cors_allowed_origins: list[str] = Field(default_factory=list)
    # A prompt longer than max_model_len x this many characters is refused before it is tokenized;
    # 0 = the tokenizer's longest vocabulary entry (an exact bound: no prompt that fits is refused).
    max_chars_per_token: int = Field(0, ge=0)

    @model_validator(mode="before")
    @classmethod
    def _removed_keys(cls, data: Any) -> Any:
        if isinstance(data, dict) and "threads" in data:
            raise ValueError("api.threads was removed: the API runs on gunicorn's gevent worker, where an open "
                             "stream costs memory, not a thread; set api.worker_connections (the most connections "
                             "one API process holds) instead")
        return data

    @field_validator("allowed_hosts", "cors_allowed_origins", mode="before")
    @classmethod
    def _comma_list(cls, v: Any) -> Any:
        """FARM_API__ALLOWED_HOSTS=a.example,b.example works as well as a YAML list."""
        return [p.strip() for p in v.split(",") if p.strip()] if isinstance(v, str) else v


class FlowerConfig(_Section):
    enabled: bool = True
    host: str = "127.0.0.1"
    port: int = Field(5555, ge=1, le=65535)


class KVTiersConfig(_Section):
    host_mb: float = Field(512, ge=0)  # tier 2: host memory (pinned on CUDA); 0 disables
    disk_mb: float = Field(1024, ge=0)  # tier 3: a file arena under <state_dir>/kvcache; 0 disables
    disk_min_reuse: int = Field(1, ge=0)  # only blocks reused this often are worth a disk write


def validate_batch_sizes(sizes: list[int] | tuple[int, ...]) -> list[int]:
    """Decode batch sizes for static buffers / CUDA graphs: sorted, distinct, positive, at least one."""
    out = sorted(int(s) for s in sizes)
    if not out:
        raise ValueError("engine.cuda_graph_batch_sizes needs at least one batch size")
    if out[0] < 1:
        raise ValueError(f"engine.cuda_graph_batch_sizes must be >= 1, got {out[0]}")
    if len(set(out)) != len(out):
        raise ValueError(f"engine.cuda_graph_batch_sizes has duplicates: {list(sizes)}")
    return out


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
    # decode step on static buffers, padded to these batch sizes (CUDA graphs on CUDA, graph-less on CPU)
    cuda_graph_batch_sizes: list[int] = Field(default_factory=lambda: [1, 2, 4, 8, 16, 32, 64], min_length=1)
    enforce_eager: bool = False  # true: dynamic decode shapes, no static buffers, no CUDA graphs
    decode_attention: Literal["auto", "torch", "triton"] = "auto"  # auto: triton on CUDA when installed

    @model_validator(mode="after")
    def _graph_sizes(self) -> EngineConfig:
        self.cuda_graph_batch_sizes = validate_batch_sizes(self.cuda_graph_batch_sizes)
        if self.cuda_graph_batch_sizes[-1] > 1024:
            raise ValueError("engine.cuda_graph_batch_sizes: at most 1024 (each size is one captured graph)")
        return self


class TransferConfig(_Section):
    advertise_host: str = "127.0.0.1"
    bind_host: str = "127.0.0.1"  # 0.0.0.0 (or this host's address) for workers on other machines
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


class CostPrior(_Section):
    """Step costs the router assumes for a worker until it (or a live worker of its model) has measured its
    own (farm.engine.step_costs); the defaults are SmolLM2-135M on 2 CPU cores (config/profiles/), slow
    enough to keep a cached prefix worth more than a little load when the hardware is unknown."""

    prefill_ms_per_block: float = Field(36.0, gt=0)
    prefill_step_ms: float = Field(85.0, ge=0)
    decode_step_ms: float = Field(32.0, ge=0)
    decode_ms_per_block: float = Field(0.7, ge=0)


class RouterConfig(_Section):
    mode: Literal["kv", "round-robin", "random"] = "kv"
    # measured: the predicted time to first token from each worker's measured step costs (farm.router.policy);
    # dynamo: Dynamo's overlap_weight x blocks to prefill + active blocks
    cost: Literal["measured", "dynamo"] = "measured"
    overlap_weight: float = Field(1.0, ge=0)  # cost: dynamo only
    ttft_target_ms: float = Field(30000, ge=0)  # a worker predicted slower than this (queueing) is busy; 0 = off
    cost_prior: CostPrior = CostPrior()
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


class ReliabilityConfig(_Section):
    """How the gateway and workers survive faults (docs/ARCHITECTURE.md, "Faults")."""

    max_migrations: int = Field(2, ge=0)  # a request moves to another worker at most this often, then errors
    check_interval_s: float = Field(1.0, gt=0)  # how often a reading gateway checks its workers are alive
    migration_wait_s: float = Field(30, ge=0)  # wait this long for a worker to take a migrated request
    lease_ttl_s: float = Field(10, ge=2)  # the reader's lease on a request; workers abort it when it lapses
    sweep_interval_s: float = Field(3, gt=0)  # workers re-send work queued for workers that vanished
    probe_interval_s: float = Field(10, gt=0)  # consumer watchdog: a ping through the worker's own queue
    probe_timeout_s: float = Field(15, gt=0)
    probe_failures: int = Field(3, ge=1)  # unanswered pings in a row before the worker exits to be restarted


class LogsConfig(_Section):
    """The supervisor's log files, <state_dir>/logs/<process>.log (farm.logfiles)."""

    max_mb: float = Field(20.0, gt=0)  # a log past this is rotated: <name>.log.1 .. .<backups>, oldest dropped
    backups: int = Field(3, ge=0)
    format: Literal["text", "json"] = "text"  # json: the API's, workers' and batch drivers' logs as JSON lines


class WorkersConfig(_Section):
    prefill: int = Field(1, ge=0)
    decode: int = Field(1, ge=0)
    both: int = Field(0, ge=0)
    batch_drivers: int = Field(1, ge=0)  # processes that run OpenAI batches (tasks.batch); 0 = no Batch API runs


# vLLM engine args the farm sets itself (so router, API and workers agree): where each comes from.
VLLM_RESERVED_ARGS = {
    "model": "models[].path / source", "tokenizer": "models[].path / source",
    "max_model_len": "models[].max_model_len", "block_size": "models[].block_size",
    "enable_prefix_caching": "(always on: the router's KV index needs it)",
    "kv_events_config": "(set by the farm: vLLM's KV events feed the router)",
    "kv_transfer_config": "models[].vllm.kv_connector / kv_role / kv_connector_extra_config",
}
VLLM_BLOCK_SIZES = frozenset({16, 32, 64, 128})  # block sizes vLLM's attention backends take (CPU: multiples of 32)
# A vLLM model's block size when its entry names none: the smallest one vLLM accepts on GPUs and CPUs alike.
VLLM_DEFAULT_BLOCK_SIZE = 32


class VllmOptions(_Section):
    """Options of a model served by vLLM (`backend: vllm`); `engine_args` go to vllm's AsyncEngineArgs."""

    engine_args: dict[str, Any] = Field(default_factory=dict)
    # Disaggregation through vLLM's KV connector; None: no remote prefill (aggregated workers only).
    kv_connector: Literal["NixlConnector", "LMCacheConnectorV1"] | None = None
    kv_role: Literal["kv_both", "kv_producer", "kv_consumer"] | None = None  # None: from the worker's role
    kv_connector_extra_config: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _args_ok(self) -> VllmOptions:
        for key in self.engine_args:
            if key in VLLM_RESERVED_ARGS:
                raise ValueError(f"vllm.engine_args.{key} is set by the farm; use {VLLM_RESERVED_ARGS[key]}")
            if not re.fullmatch(r"[a-z][a-z0-9_]*", str(key)):
                raise ValueError(f"vllm.engine_args.{key}: use the snake_case field names of vllm's "
                                 "AsyncEngineArgs (e.g. gpu_memory_utilization, tensor_parallel_size)")
        return self


class SamplingDefaults(_Section):
    """A model entry's sampling defaults: what a request gets for a parameter it does not send."""

    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    max_tokens: int | None = Field(None, ge=1)  # None: up to the context length


class ModelWorkers(_Section):
    """Worker processes `farm up` starts for one model (instead of the `workers` section's counts)."""

    prefill: int = Field(0, ge=0)
    decode: int = Field(0, ge=0)
    both: int = Field(0, ge=0)


class ModelConfig(_Section):
    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9._:\-/]+$")
    source: str | None = None
    path: str | None = None
    max_model_len: int = Field(4096, ge=16)
    # KV block size of this model's workers (the router hashes its prompts with it). None: engine.block_size
    # for the built-in engine, VLLM_DEFAULT_BLOCK_SIZE for vLLM. Every worker of one model must agree.
    block_size: int | None = Field(None, ge=1, le=1024)
    # Two entries may share weights and differ here (e.g. a greedy "precise" entry for the semantic layer).
    defaults: SamplingDefaults = SamplingDefaults()
    workers: ModelWorkers | None = None  # None: the `workers` section (or farm up's flags)
    backend: Literal["builtin", "vllm"] = "builtin"  # which engine the workers of this model run
    vllm: VllmOptions | None = None  # only with backend: vllm

    @model_validator(mode="after")
    def _one_source(self) -> ModelConfig:
        if bool(self.source) == bool(self.path):
            raise ValueError(f"model {self.name!r}: give exactly one of `source` (builtin:...) or `path`")
        if self.source and not self.source.startswith("builtin:"):
            raise ValueError(f"model {self.name!r}: source must be builtin:<name>, got {self.source!r}")
        if self.vllm is not None and self.backend != "vllm":
            raise ValueError(f"model {self.name!r}: a `vllm` section needs `backend: vllm` (got {self.backend!r})")
        if self.backend == "vllm" and self.vllm is None:
            self.vllm = VllmOptions()
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
    reliability: ReliabilityConfig = ReliabilityConfig()
    workers: WorkersConfig = WorkersConfig()
    logs: LogsConfig = LogsConfig()
    batch: BatchConfig = BatchConfig()
    planner: PlannerConfig = PlannerConfig()
    semantic: SemanticConfig = SemanticConfig()
    default_model: str
    models: list[ModelConfig] = Field(min_length=1)

    @model_validator(mode="after")
    def _cross_checks(self) -> FarmConfig:
        names = [m.name for m in self.models]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate model names: {names}")
        if self.default_model not in names:
            raise ValueError(f"default_model {self.default_model!r} is not one of the models {names}")
        self.semantic.check_models(names, self.default_model)
        if self.celery.max_request_s >= self.celery.visibility_timeout_s:
            raise ValueError(
                "celery.max_request_s must be smaller than celery.visibility_timeout_s, "
                "or a running request would be redelivered to a second worker"
            )
        if not self.redis.allow_no_password and not _redis_has_password(self.redis.url):
            from farm.redis_server import is_local

            if not is_local(self.redis.url) and not self.redis.url.startswith("unix:"):
                raise ValueError(
                    f"redis.url {redact_url(self.redis.url)} is not on this machine and has no password: set "
                    "FARM_REDIS_PASSWORD (or redis://:PASSWORD@host/...), or redis.allow_no_password: true")
        for m in self.models:
            if m.backend == "vllm" and self.block_size(m.name) not in VLLM_BLOCK_SIZES:
                raise ValueError(  # vLLM runs with the model's block size, or the router's hashes would not match
                    f"model {m.name!r} (backend: vllm): block_size {self.block_size(m.name)} is not a block size "
                    f"vLLM supports {sorted(VLLM_BLOCK_SIZES)}; set models[].block_size (32 works everywhere)")
        return self

    def block_size(self, model: str) -> int:
        """The KV block size of `model`'s workers: what the router hashes its prompts with."""
        m = self.model(model)
        if m.block_size:
            return m.block_size
        return VLLM_DEFAULT_BLOCK_SIZE if m.backend == "vllm" else self.engine.block_size

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


def _redis_has_password(url: str) -> bool:
    try:
        return bool(urlsplit(url).password)
    except ValueError:
        return False


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
    override = _read_yaml(Path(override_path)) if override_path else {}
    data = _deep_merge(data, override)
    data = _deep_merge(data, _env_overrides(env))
    _apply_redis_password(data, env.get("FARM_REDIS_PASSWORD", "") or _managed_redis_password(data))
    sem = override.get("semantic")
    if not (isinstance(sem, dict) and "categories" in sem):
        _prune_default_scores(data)
    try:
        return FarmConfig.model_validate(data)
    except ValidationError as e:
        lines = []
        for err in e.errors():
            where = ".".join(str(p) for p in err["loc"]) or "(top level)"
            lines.append(f"  {where}: {err['msg']}")
        src = f"{DEFAULT_CONFIG_PATH}" + (f" + {override_path}" if override_path else "") + " + FARM_* env"
        raise ConfigError(f"invalid farm configuration ({src}):\n" + "\n".join(lines)) from None


def _prune_default_scores(data: dict[str, Any]) -> None:
    """The embedded categories score the embedded models; an override that serves other models keeps
    the categories (and their system prompts) but drops scores for models it no longer has. Categories
    written in an override file are checked strictly instead (FarmConfig: unknown models are errors)."""
    models = data.get("models")
    cats = (data.get("semantic") or {}).get("categories")
    if not isinstance(models, list) or not isinstance(cats, list):
        return
    names = {m.get("name") for m in models if isinstance(m, dict)}
    for c in cats:
        if isinstance(c, dict) and isinstance(c.get("model_scores"), dict):
            c["model_scores"] = {k: v for k, v in c["model_scores"].items() if k in names}


def _apply_redis_password(data: dict[str, Any], password: str) -> None:
    """FARM_REDIS_PASSWORD (or the managed Redis's generated one) goes into redis.url (a password already
    in the URL wins), so every client of the farm (API, Celery, workers, CLI) authenticates without the
    secret living in a config file."""
    redis_cfg = data.get("redis")
    if not password or not isinstance(redis_cfg, dict) or not isinstance(redis_cfg.get("url"), str):
        return
    redis_cfg["url"] = redis_url_with_password(redis_cfg["url"], password)


def _managed_redis_password(data: dict[str, Any]) -> str:
    """The password `farm up` generated for its managed Redis (`<state_dir>/redis.password`), for a local
    URL of a managed Redis; "" when there is none (then the URL is used as it is)."""
    from farm.redis_server import is_local, read_password

    redis_cfg, state = data.get("redis"), data.get("state_dir")
    if not isinstance(redis_cfg, dict) or not isinstance(state, str) or redis_cfg.get("managed") is False:
        return ""
    url = redis_cfg.get("url")
    if not isinstance(url, str) or not is_local(url):
        return ""
    path = Path(state)
    return read_password(path if path.is_absolute() else PROJECT_ROOT / path) or ""


def redis_url_with_password(url: str, password: str) -> str:
    """`url` with `password` in its userinfo, unless it already has one."""
    u = urlsplit(url)
    if u.password or u.scheme not in ("redis", "rediss") or not u.hostname:
        return url
    user = quote(u.username or "", safe="")
    host = f"[{u.hostname}]" if ":" in u.hostname else u.hostname
    netloc = f"{user}:{quote(password, safe='')}@{host}" + (f":{u.port}" if u.port else "")
    return urlunsplit((u.scheme, netloc, u.path, u.query, u.fragment))


def redact_url(url: str) -> str:
    """A URL safe to print: its password replaced by ***."""
    u = urlsplit(url)
    if not u.password:
        return url
    return url.replace(f":{u.password}@", ":***@", 1)


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
