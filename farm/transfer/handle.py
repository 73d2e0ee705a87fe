"""KV handles: small signed JSON naming KV blocks held by a prefill worker.

A handle travels through the broker; the tensors it names never do. It is signed with HMAC-SHA256 under
the farm secret, so a forged or altered handle (another endpoint, other blocks, a later expiry) is refused
before any connection is made or any memory is read.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any

from farm.protocol.hashing import block_hashes, salt_root

SIGNED_FIELDS = (
    "request_id", "worker_id", "endpoint", "host_id", "transport", "block_ids", "block_hashes", "num_tokens",
    "first_token", "cached_tokens", "layout", "checksum", "expires_at",
)
# Signed too when present: a handle whose KV moves through vLLM's KV connector names the connector and
# carries its transfer parameters (opaque to the farm, passed back into the decode side's vLLM request);
# a request that asks for log-probabilities carries its first token's (sampled on the prefill worker).
# Left out of handles that lack them, so handles of the built-in engine keep their exact signed bytes.
OPTIONAL_SIGNED_FIELDS = ("connector", "kv_transfer_params", "first_logprobs")
_SIG = re.compile(r"[0-9a-f]{64}")  # HMAC-SHA256 in hex: anything else is refused before it is compared


class HandleError(ValueError):
    """A handle that must not be used: bad signature, expired, malformed."""


def _canonical(h: dict[str, Any]) -> bytes:
    body = {k: h.get(k) for k in SIGNED_FIELDS}
    body.update({k: h[k] for k in OPTIONAL_SIGNED_FIELDS if k in h})
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def sign_handle(h: dict[str, Any], secret: bytes) -> dict[str, Any]:
    out = {k: h.get(k) for k in SIGNED_FIELDS}
    out.update({k: h[k] for k in OPTIONAL_SIGNED_FIELDS if h.get(k) is not None})
    out["sig"] = hmac.new(secret, _canonical(out), hashlib.sha256).hexdigest()
    return out


def verify_handle(h: Any, secret: bytes, now: float | None = None) -> dict[str, Any]:
    """Return the handle if its signature is valid and it has not expired; raise HandleError otherwise."""
    if not isinstance(h, dict) or not isinstance(h.get("sig"), str) or not _SIG.fullmatch(h["sig"]):
        raise HandleError("malformed KV handle")
    missing = [k for k in SIGNED_FIELDS if k not in h]
    if missing:
        raise HandleError(f"KV handle lacks {missing}")
    expected = hmac.new(secret, _canonical(h), hashlib.sha256).hexdigest()
    if not hmac.compare_digest(expected, h["sig"]):
        raise HandleError("KV handle signature is invalid")
    if float(h["expires_at"]) <= (now if now is not None else time.time()):
        raise HandleError("KV handle has expired")
    return h


def check_bound(h: Any, *, request_id: str, prompt_ids: Sequence[int], block_size: int,
                cache_salt: str | None) -> None:
    """Raise HandleError unless the handle was made for this request: its id, its prompt's length and the hashes
    of the prompt's full blocks under the request's cache salt (the hashes a prefill worker signs).

    The signature says a worker of the farm made the handle; this says it made it for the task it arrived with.
    Without it, a handle moved onto another task (by anyone who can write to the broker) would have the decode
    worker file one prompt's KV under another prompt's hashes, in another tenant's prefix cache, or fail the
    engine's batch on a prompt shorter than the blocks. Compared before any connection is made."""
    if not isinstance(h, dict):
        raise HandleError("malformed KV handle")
    if h.get("request_id") != request_id:
        raise HandleError("KV handle was made for another request")
    if h.get("num_tokens") != len(prompt_ids):
        raise HandleError("KV handle covers another prompt length")
    if h.get("block_hashes") != [str(x) for x in block_hashes(prompt_ids, block_size, salt_root(cache_salt))]:
        raise HandleError("KV handle names blocks of another prompt or cache salt")


@dataclass(frozen=True)
class KVHandle:
    """A handle before signing, built in one place per engine (the built-in worker's prefill, vLLM's
    connector); `signed` is its wire form. The fields are SIGNED_FIELDS then OPTIONAL_SIGNED_FIELDS."""

    request_id: str
    worker_id: str
    endpoint: str
    host_id: str
    transport: str
    block_ids: list[int]
    block_hashes: list[str]
    num_tokens: int
    first_token: int | None
    cached_tokens: int
    layout: dict[str, Any]
    checksum: str
    expires_at: float
    connector: str | None = None
    kv_transfer_params: dict[str, Any] | None = None
    first_logprobs: list[Any] | None = None

    def signed(self, secret: bytes) -> dict[str, Any]:
        return sign_handle(asdict(self), secret)

    @classmethod
    def from_signed(cls, h: dict[str, Any], secret: bytes, now: float | None = None) -> KVHandle:
        """The handle a verified wire form names (HandleError when it is not valid)."""
        h = verify_handle(h, secret, now=now)
        return cls(**{f.name: h.get(f.name) for f in fields(cls)})

