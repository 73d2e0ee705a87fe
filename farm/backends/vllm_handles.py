"""KV handles of vLLM workers: the blocks a vLLM prefill holds move through vLLM's KV connector, and what the
decode side needs to pull them (the connector's `kv_transfer_params`) travels in the farm's signed KV handle.

`make_connector_handle` signs it on the prefill side (from a `VllmRequestOutput`), `import_from_handle` verifies it
on the decode side and turns it into the `ConnectorImport` the decode's `engine.submit(kv_import=...)` takes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from farm.engine.contract import RequestOutput
from farm.transfer.handle import HandleError, KVHandle, verify_handle


@dataclass
class ConnectorImport:
    """The decode side of a vLLM handle: what engine.submit(kv_import=...) gets instead of KV tensors."""

    kv_transfer_params: dict[str, Any]
    connector: str
    num_tokens: int
    first_token: int | None
    cached_tokens: int = 0


@dataclass
class VllmRequestOutput(RequestOutput):
    """RequestOutput plus what a vLLM prefill returns for the decode side."""

    kv_transfer_params: dict[str, Any] | None = None
    connector: str | None = None


def make_connector_handle(*, request_id: str, worker_id: str, endpoint: str, host_id: str,
                          out: VllmRequestOutput, num_tokens: int, block_size: int, ttl_s: float,
                          secret: bytes, now: float | None = None) -> dict[str, Any]:
    """A signed KV handle for blocks vLLM's connector holds: the usual fields (so routing, logs and
    expiry work as for the built-in engine) plus `connector` and `kv_transfer_params` (signed)."""
    params = out.kv_transfer_params or {}
    return KVHandle(
        request_id=request_id, worker_id=worker_id, endpoint=endpoint, host_id=host_id,
        transport=f"vllm:{out.connector}", block_ids=list(params.get("remote_block_ids") or []),
        block_hashes=[str(h) for h in (out.block_hashes or [])], num_tokens=num_tokens,
        first_token=out.first_token, cached_tokens=out.cached_tokens,
        layout={"block_size": block_size, "backend": "vllm"}, checksum="",
        expires_at=(now if now is not None else time.time()) + ttl_s,
        connector=out.connector, kv_transfer_params=params,
    ).signed(secret)


def import_from_handle(handle: dict[str, Any], secret: bytes, connector: str | None,
                       now: float | None = None) -> ConnectorImport:
    """Verify a vLLM handle and turn it into the decode request's connector parameters.

    Raises HandleError when the signature or expiry is wrong, or when this worker's connector is not
    the one that holds the blocks (a NIXL decode cannot pull from LMCache, and the reverse).
    """
    h = verify_handle(handle, secret, now=now)
    params = h.get("kv_transfer_params")
    if not isinstance(params, dict):
        raise HandleError("KV handle carries no kv_transfer_params")
    if connector is None or h.get("connector") != connector:
        raise HandleError(f"KV handle is for connector {h.get('connector')!r}; this worker has {connector!r}")
    return ConnectorImport(dict(params), connector, int(h["num_tokens"]),
                           None if h["first_token"] is None else int(h["first_token"]),
                           int(h.get("cached_tokens") or 0))
