"""Settings of the OpenAI Batch API (files, batches, the batch driver): the `batch` section of the config.

`FarmConfig` (farm/config/root.py) holds it as `batch`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from farm.config.base import Section


class BatchConfig(Section):

    # -- files ----------------------------------------------------------------------------------------
    # Where file bodies live (metadata is always in Redis). disk: a directory, files_dir, which every API
    # replica and batch driver must share (one machine, or a ReadWriteMany volume). redis: in Redis itself, so
    # every replica sees them with nothing shared but Redis (compose and the Helm chart), up to
    # files_redis_max_mb in all (they take Redis memory).
    files_backend: Literal["disk", "redis"] = "disk"
    files_dir: str = ""  # disk: the directory; "" = <state_dir>/files (relative = under state_dir)
    files_redis_max_mb: int = Field(1024, ge=1)  # redis: all file bodies together; an upload beyond it is 413
    max_file_bytes: int = Field(200 * 1024 * 1024, ge=1024)  # POST /v1/files upload limit (OpenAI: 200 MB)
    # per API key (owner), on either backend: an upload past either is 413 file_quota_exceeded. Output files
    # the farm writes count too (they go when the retention sweep or the owner deletes them) but are never refused.
    # The bytes of an owner's files together; unset: 2048 on disk, a quarter of files_redis_max_mb in Redis, whose
    # room all keys share: one key must not be able to fill it for every other (set, it must stay below it).
    owner_files_max_mb: int | None = Field(None, ge=1)
    owner_files_max: int = Field(1000, ge=1)  # an owner's files
    # -- validation -------------------------------------------------------------------------------------
    max_lines: int = Field(50_000, ge=1)  # requests per batch (OpenAI: 50,000)
    max_reported_errors: int = Field(100, ge=1)  # line errors listed on a batch that failed validation
    completion_window_s: int = Field(24 * 3600, ge=60)  # the one accepted window, "24h"
    # -- scheduling -------------------------------------------------------------------------------------
    # prefix: lines sorted by the block hashes of their tokenized prompt, so lines sharing a prefix run
    # together and the KV-aware router sends them where the prefix is cached; input: file order.
    schedule: Literal["prefix", "input"] = "prefix"
    # with `prefix`: a line whose prompt shares at least this many more blocks with a line still in
    # prefill than with what is already computed waits for that prefill (then reuses its KV blocks).
    warm_prefix_min_blocks: int = Field(2, ge=0)  # 0 disables the wait
    # -- priority against interactive traffic -------------------------------------------------------------
    max_inflight: int = Field(32, ge=1)  # batch lines in flight per driver process, farm idle
    min_inflight: int = Field(2, ge=1)  # ... while interactive requests are in flight
    interactive_threshold: int = Field(1, ge=1)  # in-flight non-batch requests that count as "interactive load"
    interactive_hold_s: float = Field(5.0, ge=0)  # keep the small window this long after the last sighting
    load_check_s: float = Field(0.5, gt=0)  # how often the farm's load is read
    priority: int = Field(9, ge=0, le=9)  # Celery priority of line tasks (Redis transport: 0 first, 9 last)
    # -- robustness -----------------------------------------------------------------------------------
    max_attempts: int = Field(3, ge=1)  # runs of one line when its worker dies or it times out
    poll_s: float = Field(1.0, gt=0)  # a running line checks its workers' liveness this often
    lease_ttl_s: float = Field(10.0, ge=2)  # a driver's hold on a batch; a dead driver's lapses after this
    reaper_interval_s: float = Field(2.0, gt=0)  # how often a driver process looks for unowned batches
    # A final batch, its results and its output and error files are deleted this long after it ended (OpenAI
    # keeps batch output files 30 days), so the keyspace does not grow with every batch ever run.
    retention_s: int = Field(30 * 86400, ge=60)
    kick_ttl_s: float = Field(60.0, gt=0)  # a batch re-sent to the driver queue is not re-sent again for this long
    driver_concurrency: int = Field(8, ge=1)  # batches driven at once by one driver process
    shutdown_grace_s: float = Field(10.0, ge=0)  # warm shutdown: in-flight lines get this long to finish

    @model_validator(mode="after")
    def _window(self) -> BatchConfig:
        if self.min_inflight > self.max_inflight:
            raise ValueError("batch.min_inflight must not exceed batch.max_inflight")
        return self

    @model_validator(mode="after")
    def _owner_room(self) -> BatchConfig:
        shared = self.files_backend == "redis"
        if self.owner_files_max_mb is None:
            self.owner_files_max_mb = max(1, self.files_redis_max_mb // 4) if shared else 2048
        elif shared and self.owner_files_max_mb >= self.files_redis_max_mb:
            raise ValueError(f"batch.owner_files_max_mb ({self.owner_files_max_mb}) must be below "
                             f"batch.files_redis_max_mb ({self.files_redis_max_mb}) with files_backend redis: "
                             "one key could fill the room every key's uploads share")
        return self

