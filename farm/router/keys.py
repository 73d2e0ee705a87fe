"""Redis keys of the KV-block index and the shared load (one place, so workers and routers agree)."""

from __future__ import annotations

EVENTS_STREAM = "farm:kv:events"  # every worker's KV events, in batches
EVENTS_MAXLEN = 200_000  # stream entries kept; a reader that falls further behind resyncs from sets
LOAD_KEY = "farm:load"  # hash: "<worker>|p" pending prefill tokens, "<worker>|d" active decode blocks
DEADLINES_KEY = "farm:active:deadlines"  # zset "<kind>|<worker>|<request>" -> expiry time
LOAD_EVENTS_STREAM = "farm:load:events"  # every change of LOAD_KEY: f=<worker>|<kind>, a=amount, n=+-1 requests
LOAD_EVENTS_MAXLEN = 50_000  # entries kept; a reader further behind is corrected by its next reset


def worker_blocks_key(worker_id: str) -> str:
    """Set of block hashes a worker holds (its snapshot, consistent with its event sequence)."""
    return f"farm:kv:w:{worker_id}"


def worker_seq_key(worker_id: str) -> str:
    """Id of the last KV event the worker applied to its snapshot set."""
    return f"farm:kv:seq:{worker_id}"


def active_key(kind: str, worker_id: str) -> str:
    """zset request -> load amount, per worker and kind (p: prefill tokens, d: decode blocks)."""
    return f"farm:active:{kind}:{worker_id}"


def claim_key(request_id: str, stage: str) -> str:
    """Set once by the worker that runs a request's stage: a re-sent task never runs twice."""
    return f"farm:claim:{request_id}:{stage}"


def direct_queue(worker_id: str) -> str:
    """Each worker also consumes a queue of its own, so a router can place work on it."""
    import re

    return "farm.w." + re.sub(r"[^A-Za-z0-9_.@-]+", "_", worker_id)
