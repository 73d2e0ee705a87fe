"""The five contenders, each a context manager that starts it from nothing, yields a `Target` (how to run a
level against it) and stops everything it started, also on errors and Ctrl-C.

- vllm-serve: `python -m vllm.entrypoints.openai.api_server` (bench.peers.contenders.vllm_serve: prefix
  caching, --block-size 32, --kv-cache-memory-bytes, --max-model-len, fp32).
- farm-vllm: a farm with one aggregated `backend: vllm` worker, semantic layer off (bench.peers' farm).
- farm-vllm-semantic: the same with the farm's default semantic layer on (guards, semantic cache): what
  `farm serve` gives by default.
- farm-builtin: a farm with one built-in-engine worker, semantic layer off.
- inproc-builtin: the built-in engine in this process, configured as farm-builtin's worker.

vLLM's scheduler defaults are the same on both vLLM sides on this CPU build (max_num_seqs 128,
max_num_batched_tokens 2048: `vllm serve`'s OPENAI_API_SERVER defaults for CPUs equal the engine defaults the
farm's AsyncLLM gets); the built-in engine runs `engine.max_num_seqs` (64) at a time.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from bench.engine_speed import load
from bench.engine_speed.inproc import inproc_builtin
from bench.peers import contenders as pc

NAMES = ["vllm-serve", "farm-vllm", "farm-vllm-semantic", "farm-builtin", "inproc-builtin"]
FARMS = ("farm-vllm", "farm-vllm-semantic", "farm-builtin")
SEMANTIC_ON = {"semantic": {"enabled": True}}  # the rest of the section: the farm's defaults


@dataclass
class Target:
    """A started contender: `level(tag, streams, per_stream, max_tokens)` runs one measured level."""

    name: str
    level: Callable[[str, int, int, int], dict[str, Any]]
    start_s: float
    commands: list[str] = field(default_factory=list)
    base_url: str | None = None
    farm: Any = None  # farm.supervisor.Farm for the farm contenders


def _http_level(ep: pc.Endpoint, timeout_s: float) -> Callable[[str, int, int, int], dict[str, Any]]:
    def level(tag: str, streams: int, per_stream: int, max_tokens: int) -> dict[str, Any]:
        return load.run_level(ep.base_url, ep.model, tag, streams, per_stream, max_tokens, timeout_s)
    return level


def endpoint(name: str, s: pc.Setup, extra: dict[str, Any] | None = None
             ) -> contextlib.AbstractContextManager[pc.Endpoint]:
    """The HTTP contender `name` (vllm-serve or a farm); `extra` is merged over a farm's configuration."""
    if name == "vllm-serve":
        return pc.vllm_serve(s)
    backend = "builtin" if name.endswith("builtin") else "vllm"
    more = dict(SEMANTIC_ON) if name == "farm-vllm-semantic" else {}
    return pc.farm(s, backend, 1, extra={**more, **(extra or {})})


@contextlib.contextmanager
def started(name: str, s: pc.Setup, timeout_s: float = 600.0) -> Iterator[Target]:
    t0 = time.monotonic()
    if name == "inproc-builtin":
        with inproc_builtin(s, timeout_s) as eng:
            yield Target(name, eng.level, time.monotonic() - t0,
                         ["(in this process) farm.backends.make_engine(<farm-builtin's worker configuration>)"])
        return
    if name not in NAMES:
        raise ValueError(f"unknown contender {name!r}; known: {NAMES}")
    with endpoint(name, s) as ep:
        yield Target(name, _http_level(ep, timeout_s), ep.start_s, ep.commands, ep.base_url, ep.farm)
