"""Redis keys every process agrees on: the reply streams and leases of the reading API processes, a request's
cancel flag and claims; the KV-block index and its events; the shared load; the observations the planner reads."""

from __future__ import annotations

EVENTS_STREAM = "farm:kv:events"  # every worker's KV events, in batches
EVENTS_MAXLEN = 200_000  # stream entries kept; a reader that falls further behind resyncs from sets
LOAD_KEY = "farm:load"  # hash: "<worker>|p" pending prefill tokens, "<worker>|d" active decode blocks
DEADLINES_KEY = "farm:active:deadlines"  # zset "<kind>|<worker>|<request>" -> expiry time
LOAD_EVENTS_STREAM = "farm:load:events"  # every change of LOAD_KEY: f=<worker>|<kind>, a=amount, n=+-1 requests
LOAD_EVENTS_MAXLEN = 50_000  # entries kept; a reader further behind is corrected by its next reset
OBS_STREAM = "farm:obs"  # one entry per finished request: ttft, itl, isl, osl (written by the API, read by the planner)
STREAM_TTL_S = 600
CANCEL_TTL_S = 600


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


def reply_stream_key(reader_id: str) -> str:
    """Redis Stream of reply batches (worker -> API) for every request one reader (an API process, a batch
    driver) has in flight: farm.protocol.events."""
    return f"farm:out:{reader_id}"


def cancel_key(request_id: str) -> str:
    """Set by the API when the client went away; workers abort the request when they see it."""
    return f"farm:cancel:{request_id}"


def reader_lease_key(reader_id: str) -> str:
    """Kept alive by a reader while it follows its reply stream; a worker aborts the requests of a reader whose
    lease lapsed (the API process died: nobody reads), and skips their redelivered tasks."""
    return f"farm:lease:{reader_id}"


def migration_id(request_id: str, attempt: int) -> str:
    """The request id of the `attempt`-th migration of a request (its own claims and cancel flag)."""
    return f"{request_id}.m{attempt}"
