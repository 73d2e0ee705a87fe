"""Every Redis key the farm's processes agree on, and nowhere else (tests/test_protocol.py checks that no other
module of farm/ spells a `farm:` key): the reply streams and leases of the reading processes, a request's cancel
flag and claims; the KV-block index and its events; the shared load; the worker registry and its heartbeats; the
consumer watchdog's pings and the orphan-queue sweep; the Batch API's files and batches; the Responses API's
stored responses; per-owner rate limits and quotas; metrics counters; the planner's state; the observations the
planner reads.

(The semantic cache's prefix is a setting, `semantic.cache.key_prefix`, default `farm:sc`.)
"""

from __future__ import annotations

import time
from typing import Literal

# -- requests in flight: reply streams, leases, cancel flags, claims ----------------------------------------
STREAM_TTL_S = 600
CANCEL_TTL_S = 600


def reply_stream_key(reader_id: str) -> str:
    """Redis Stream of reply batches (worker -> API) for every request one reader (an API process, a batch
    driver) has in flight: farm.protocol.stream_events."""
    return f"farm:out:{reader_id}"


def reader_lease_key(reader_id: str) -> str:
    """Kept alive by a reader while it follows its reply stream; a worker aborts the requests of a reader whose
    lease lapsed (the API process died: nobody reads), and skips their redelivered tasks."""
    return f"farm:lease:{reader_id}"


def cancel_key(request_id: str) -> str:
    """Set by the API when the client went away; workers abort the request when they see it."""
    return f"farm:cancel:{request_id}"


def claim_key(request_id: str, stage: str) -> str:
    """Set once by the worker that runs a request's stage: a re-sent task never runs twice."""
    return f"farm:claim:{request_id}:{stage}"


def migration_id(request_id: str, attempt: int) -> str:
    """The request id of the `attempt`-th migration of a request (its own claims and cancel flag)."""
    return f"{request_id}.m{attempt}"


def fallback_id(request_id: str, hop: int) -> str:
    """The request id of MoM's `hop`-th fallback to another model (its own mailbox, task and cancel flag: the
    attempt it replaces may have left a cancel flag on its id)."""
    return f"{request_id}.f{hop}"


# -- the KV-block index (farm.router.kv_publisher writes, farm.router.index follows) ----------------------
EVENTS_STREAM = "farm:kv:events"  # every worker's KV events, in batches
EVENTS_MAXLEN = 200_000  # stream entries kept; a reader that falls further behind resyncs from sets
EVENTS_KEEP_S = 300  # ... and no older than this (a count cap alone lets a quiet farm's stream grow for days)


def worker_blocks_key(worker_id: str) -> str:
    """Set of block hashes a worker holds (its snapshot, consistent with its event sequence)."""
    return f"farm:kv:w:{worker_id}"


def worker_seq_key(worker_id: str) -> str:
    """Id of the last KV event the worker applied to its snapshot set."""
    return f"farm:kv:seq:{worker_id}"


# -- the shared load (farm.router.load) -------------------------------------------------------------------
LOAD_KEY = "farm:load"  # hash: "<worker>|p" pending prefill tokens, "<worker>|d" active decode blocks
DEADLINES_KEY = "farm:active:deadlines"  # zset "<kind>|<worker>|<request>" -> expiry time
LOAD_EVENTS_STREAM = "farm:load:events"  # every change of LOAD_KEY: f=<worker>|<kind>, a=amount, n=+-1 requests
LOAD_EVENTS_MAXLEN = 50_000  # entries kept; a reader further behind is corrected by its next reset
LOAD_EVENTS_KEEP_S = 60  # ... and no older than this (readers reset from the hash every second)


def active_key(kind: str, worker_id: str) -> str:
    """zset request -> load amount, per worker and kind (p: prefill tokens, d: decode blocks)."""
    return f"farm:active:{kind}:{worker_id}"


# -- workers: the registry, heartbeats, the consumer watchdog, the orphan-queue sweep ----------------------
WORKERS_KEY = "farm:workers"  # hash worker id -> WorkerInfo JSON (farm.cluster.registry)
SWEEP_LOCK_KEY = "farm:sweep:lock"  # one worker at a time sweeps the direct queues of vanished workers


def alive_key(worker_id: str) -> str:
    """A worker's heartbeat (with its engine stats), expiring when the worker stops refreshing it.
    `alive_key("")` is the prefix every heartbeat key starts with."""
    return f"farm:alive:{worker_id}"


def ping_key(worker_id: str) -> str:
    """The token of the last ping the worker's own Celery consumer answered (farm.worker.watchdog)."""
    return f"farm:ping:{worker_id}"


# -- the Batch API: files and batches (farm.batch.store, farm.batch.file_store) ----------------------------------
FILES_KEY = "farm:files"  # before owner indexes: every file's id by creation sequence (moved on start, then gone)
FILE_BYTES_KEY = "farm:files:bytes"  # redis bodies backend: the bytes of every stored body together
BATCHES_KEY = "farm:batches"  # before owner indexes: every batch's id (moved on start, then gone)
BATCH_ACTIVE_KEY = "farm:batch:active"  # set of batches not yet final
BATCHES_ENDED_KEY = "farm:batches:ended"  # zset batch id -> when it became final (retention, farm.batch.retention)
FILES_EXPIRING_KEY = "farm:files:expiring"  # zset file id -> its expires_at: uploads with OpenAI's expires_after
BATCH_SEQ_KEY = "farm:batch:seq"  # the creation sequence of files and batches (list order)
BATCH_INFLIGHT_KEY = "farm:batch:inflight"  # zset request id -> deadline: batch lines in flight


def owner_files_key(owner: str) -> str:
    """Zset of one owner's file ids by creation sequence: a listing reads its owner's files, never everyone's."""
    return f"farm:files:owner:{owner}"


def owner_file_bytes_key(owner: str) -> str:
    """The bytes of one owner's file bodies together (uploads and the farm's output files): its storage quota."""
    return f"farm:files:owner:{owner}:bytes"


def owner_uploads_key(owner: str) -> str:
    """Zset of one owner's uploads under way (upload id -> when it last reserved room): with
    `owner_upload_bytes_key`, what they hold of its quota, so two uploads at once cannot both take the last room
    (farm.batch.upload_room). An entry not touched for an hour is dropped (its API process died)."""
    return f"farm:files:owner:{owner}:uploading"


def owner_upload_bytes_key(owner: str) -> str:
    """Hash upload id -> the bytes that upload under way has reserved of its owner's quota."""
    return f"farm:files:owner:{owner}:uploading:bytes"


def owner_batches_key(owner: str) -> str:
    """Zset of one owner's batch ids by creation sequence."""
    return f"farm:batches:owner:{owner}"


def file_key(file_id: str) -> str:
    """Hash of a file's metadata."""
    return f"farm:file:{file_id}"


def file_body_key(file_id: str) -> str:
    """A file's body, with the redis bodies backend."""
    return f"{file_key(file_id)}:body"


def file_upload_key(file_id: str, token: str) -> str:
    """An upload in progress, renamed to `file_body_key` once complete (expires if cut off half-way)."""
    return f"{file_body_key(file_id)}:upload:{token}"


def batch_key(batch_id: str) -> str:
    """Hash of a batch's state and counters."""
    return f"farm:batch:{batch_id}"


def batch_results_key(batch_id: str) -> str:
    """Hash custom_id -> recorded result of a batch's lines."""
    return f"farm:batch:{batch_id}:results"


def batch_answered_key(batch_id: str) -> str:
    """Hash custom_id -> [answer, finish_reason] of the lines the semantic layer answered at validation (a guard's
    refusal): kept where every driver reads it, so one that prepares the lines again never runs them."""
    return f"farm:batch:{batch_id}:answered"


def batch_lease_key(batch_id: str) -> str:
    """The lease of the batch driver that runs a batch (not a reader's lease, `reader_lease_key`)."""
    return f"farm:batch:{batch_id}:lease"


def batch_kick_key(batch_id: str) -> str:
    """Set while a batch waits on the driver queue, so it is sent there once."""
    return f"farm:batch:{batch_id}:kick"


# -- the Responses API's stored responses (farm.openai.response_store) ----------------------------------------
def owner_responses_key(owner: str) -> str:
    """Zset of an owner's stored response ids by when each expires, beside a hash of their sizes (`:sizes`) and
    their total (`:bytes`): the owner's quota of stored responses (farm.openai.response_store)."""
    return f"farm:resps:owner:{owner}"


def response_key(owner: str, response_id: str) -> str:
    """A stored response of `owner` (its object, input items and conversation as JSON, with a TTL): the owner
    is part of the key, so another owner's id is simply not found."""
    return f"farm:resp:{owner}:{response_id}"


# -- per-owner rate limits and token quotas (farm.tenancy.quota) ---------------------------------------------
def rate_key(counter: Literal["req", "tok"], owner: str, window: int) -> str:
    """A counter of `owner` in one fixed window (number `window` since the epoch): its requests (`req`, in the
    rate window) or the tokens charged to it (`tok`, in the quota window)."""
    return f"farm:rl:{counter}:{owner}:{window}"


# -- metrics (farm.telemetry.prometheus) and the planner (farm.planner.planner) -------------------------------
METRICS_EXPORTER_KEY = "farm:metrics:exporter"  # the API replica that exports the farm-wide series now
OBS_STREAM = "farm:obs"  # per finished request: ttft, itl, isl, osl (written by the API, read by the planner)
OBS_MAXLEN = 20_000  # entries kept
OBS_KEEP_S = 600  # ... and no older than this: the longest planner window (farm.config.planner)
PLANNER_STATE_KEY = "farm:planner:state"  # the planner's last decisions, as JSON
PLANNER_EVENTS_KEY = "farm:planner:events"  # list of its recent scaling decisions, newest first


def stats_key(name: str) -> str:
    """Hash label value -> count of a farm-wide counter (`farm_batches`, `farm_batch_lines`, ...)."""
    return f"farm:stats:{name}"


def stream_min_id(keep_s: float, now: float | None = None) -> str:
    """The oldest entry id a stream trimmed to its last `keep_s` seconds keeps (XTRIM/XADD MINID): entry ids
    start with the Redis server's clock in ms, compared here with this host's (a few seconds of skew against a
    window of minutes only keeps a little more or less)."""
    return f"{int(((time.time() if now is None else now) - keep_s) * 1000)}-0"
