"""How the farm's processes behave at run time: fault handling (`reliability`) and log files (`logs`)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from farm.config.base import Section


class ReliabilityConfig(Section):
    """How the gateway and workers survive faults (docs/ARCHITECTURE.md, "Faults")."""

    max_migrations: int = Field(2, ge=0)  # a request moves to another worker at most this often, then errors
    check_interval_s: float = Field(1.0, gt=0)  # how often a reading gateway checks its workers are alive
    migration_wait_s: float = Field(30, ge=0)  # wait this long for a worker to take a migrated request
    lease_ttl_s: float = Field(10, ge=2)  # a reader's lease on its requests; workers abort them when it lapses
    sweep_interval_s: float = Field(3, gt=0)  # workers re-send work queued for workers that vanished
    probe_interval_s: float = Field(10, gt=0)  # consumer watchdog: a ping through the worker's own queue
    probe_timeout_s: float = Field(15, gt=0)
    probe_failures: int = Field(3, ge=1)  # unanswered pings in a row before the worker exits to be restarted


class LogsConfig(Section):
    """The supervisor's log files, <state_dir>/logs/<process>.log (farm.infra.logfiles)."""

    max_mb: float = Field(20.0, gt=0)  # a log past this is rotated: <name>.log.1 .. .<backups>, oldest dropped
    backups: int = Field(3, ge=0)
    format: Literal["text", "json"] = "text"  # json: the API's, workers' and batch drivers' logs as JSON lines
