"""Hosts and ports: how the farm's addresses are shown, connected to, and checked free."""

from __future__ import annotations

import socket

from farm.config import (
    ConfigError,
    FarmConfig,
)


def _display_host(host: str) -> str:
    return socket.gethostname() if host in ("0.0.0.0", "", "::") else host


def _connect_host(host: str) -> str:
    if host in ("0.0.0.0", ""):
        return "127.0.0.1"
    if host == "::":
        return "::1"
    return host


def _hostport(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _port_in_use(host: str, port: int) -> bool:
    try:
        with socket.create_connection((_connect_host(host), port), timeout=0.3):
            return True
    except OSError:
        return False


def worker_counts(cfg: FarmConfig, prefill: int | None, decode: int | None, both: int | None) -> dict[str, int]:
    """Worker counts from the flags; `--workers N` alone means N aggregated workers and nothing else."""
    if both is not None and prefill is None and decode is None:
        prefill = decode = 0
    counts = {
        "prefill": cfg.workers.prefill if prefill is None else prefill,
        "decode": cfg.workers.decode if decode is None else decode,
        "both": cfg.workers.both if both is None else both,
    }
    if any(n < 0 for n in counts.values()):
        raise ConfigError(f"worker counts must not be negative: {counts}")
    if sum(counts.values()) == 0:
        raise ConfigError("no workers to start: give --workers N, or --prefill-workers N --decode-workers N")
    if counts["prefill"] and not (counts["decode"] or counts["both"]):
        raise ConfigError("prefill workers hand every request to a decode worker: add --decode-workers N "
                          "(or --workers N)")
    return counts
