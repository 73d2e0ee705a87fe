"""The built-in engine (`engine`, its KV tiers), KV transfer between workers (`transfer`) and Celery's limits
(`celery`)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from farm.config.base import Section


class KVTiersConfig(Section):
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


class EngineConfig(Section):
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


class TransferConfig(Section):
    advertise_host: str = "127.0.0.1"
    bind_host: str = "127.0.0.1"  # 0.0.0.0 (or this host's address) for workers on other machines
    handle_ttl_s: float = Field(120, gt=0)
    # A decode worker's pull gives up when the prefill host is silent this long (connecting, or between reads:
    # a partition), then prefills locally; a large pull also gets a second per 10 MiB on top.
    pull_timeout_s: float = Field(10, gt=0)
    transports: list[Literal["nixl", "shm", "tcp"]] = Field(default_factory=lambda: ["shm", "tcp"], min_length=1)

    @model_validator(mode="after")
    def _tcp_required(self) -> TransferConfig:
        if "tcp" not in self.transports:
            raise ValueError("transfer.transports must include tcp (the control channel, and across hosts)")
        return self


class CeleryConfig(Section):
    visibility_timeout_s: int = Field(3600, ge=10)
    worker_threads: int = Field(96, ge=1)
    max_request_s: int = Field(1800, ge=1)
    # task events (received, started, succeeded per task) from the start; Flower turns them on itself when it
    # runs (its enable_events), so this matters only without Flower: a few Redis writes per request otherwise
    task_events: bool = False
