"""`FarmConfig`: every section together, and the checks that need more than one of them."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, model_validator

from farm.config.api import ApiConfig, FlowerConfig
from farm.config.base import PROJECT_ROOT, Section
from farm.config.batch import BatchConfig
from farm.config.engine import CeleryConfig, EngineConfig, TransferConfig
from farm.config.model_entries import VLLM_BLOCK_SIZES, VLLM_DEFAULT_BLOCK_SIZE, ModelConfig, WorkersConfig
from farm.config.planner import PlannerConfig
from farm.config.processes import LogsConfig, ReliabilityConfig
from farm.config.redis import RedisConfig, has_password, is_local, redact_url
from farm.config.router import DisaggregationConfig, RouterConfig
from farm.config.semantic import SemanticConfig


class FarmConfig(Section):
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
        if not self.redis.allow_no_password and not has_password(self.redis.url):
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

    @property
    def files_path(self) -> Path:
        """The folder of the Batch API's file bodies: batch.files_dir, by default <state_dir>/files."""
        d = self.batch.files_dir
        if not d:
            return self.state_path / "files"
        p = Path(d)
        return p if p.is_absolute() else self.state_path / p

    @property
    def batch_prepared_path(self) -> Path:
        """Validated, tokenized lines of running batches (internal; re-derivable from the input file)."""
        return self.files_path / "prepared"

    def model(self, name: str) -> ModelConfig:
        for m in self.models:
            if m.name == name:
                return m
        raise KeyError(name)
