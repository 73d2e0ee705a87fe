"""The engine as a worker uses it: what `farm.backends.make_engine` returns, whichever backend builds it
(`ServingEngine`), and what it hands back (`RequestOutput`, to the request's `on_output`, from every step).

Two engines satisfy `ServingEngine` structurally, without naming it: the built-in `farm.engine.engine.Engine` and
the vLLM adapter `farm.backends.vllm.VllmEngine` (tests/test_engine_contract.py checks both, members and
signatures). The worker runtime (farm.worker.runtime) goes through nothing else, so a third backend is one more
class of this shape. Every method is thread-safe: task threads submit and abort, the engine runs on its own thread
and calls `on_output` from there.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:  # names for the hints only: this module stays light (no torch) for whoever imports backends
    from farm.engine.sampling import TokenLogprobs
    from farm.engine.step_costs import StepCosts
    from farm.protocol import SamplingParams


@dataclass
class RequestOutput:
    """What one engine step produced for one request."""

    request_id: str
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    logprobs: list[TokenLogprobs] | None = None  # per token of token_ids, when the request asks for them
    # prefill-only results
    held_blocks: list[int] | None = None
    block_hashes: list[int] | None = None
    first_token: int | None = None
    first_logprobs: TokenLogprobs | None = None


@runtime_checkable
class BlockReader(Protocol):
    """`engine.runner` as the worker reads it: the KV a prefill holds, for the decode worker that pulls it."""

    device: Any  # where the KV lives (torch device or its name)
    kv: Any  # the KV cache tensors a NIXL source registers (None when the backend moves KV itself)
    layout: Any  # `.to_dict()`: the KV layout a handle carries

    def read_blocks(self, block_ids: list[int]) -> Any: ...


@runtime_checkable
class BlockCount(Protocol):
    """`engine.pool` as the worker reads it: the size of the KV cache, for the registry."""

    num_blocks: int


@runtime_checkable
class ServingEngine(Protocol):
    """One model's engine in a worker process (farm.engine.engine.Engine, farm.backends.vllm.VllmEngine)."""

    costs: StepCosts  # the measured step costs (the router's weights, in the heartbeat's stats)

    @property
    def held(self) -> Mapping[str, Any]:
        """Prefilled requests whose KV waits for their decode worker, by request id."""
        ...

    @property
    def runner(self) -> BlockReader: ...

    @property
    def pool(self) -> BlockCount: ...

    def start(self) -> ServingEngine: ...

    def stop(self) -> None: ...

    def submit(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
               on_output: Callable[[RequestOutput], None], *, prefill_only: bool = False,
               kv_import: Any = None, max_request_s: float | None = None, cache_salt: str = "") -> None:
        """Queue a request; its outputs arrive through `on_output` (on the engine's thread: it must not block),
        the last with `finished` set. `prefill_only` computes the prompt's KV and holds it (`held`) for a decode
        worker; `kv_import` is a decode's KV pulled from its prefill worker."""
        ...

    def abort(self, request_id: str) -> None: ...

    def release_held(self, request_id: str) -> None:
        """The decode worker has the KV of a prefilled request (or gave up): free what it held."""
        ...

    def active_request_ids(self) -> list[str]: ...

    def stats(self) -> dict[str, Any]:
        """What the worker's heartbeat carries (farm.cluster.registry): load, cache, costs, timings."""
        ...


@runtime_checkable
class ConnectorEngine(ServingEngine, Protocol):
    """An engine whose KV moves through a KV connector of its own (vLLM's NIXL or LMCache connector): the
    prefill's hand-over is a signed handle the connector's parameters travel in."""

    connector: str | None  # the connector's name, None without one

    def connector_handle(self, req: Any, out: Any, endpoint: str, host_id: str, secret: bytes) -> dict[str, Any]:
        ...
