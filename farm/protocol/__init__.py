"""Contracts that cross processes, one module each: Celery task names and queues (`queues`), Redis keys
(`keys`), the request message (`request`), stream events (`stream_events`), KV events (`kv_events`), block
hashing (`hashing`), and JSON from untrusted peers with bounded nesting (`jsonsafe`).

Everything here travels as JSON (Celery's only serializer in the farm) and is small: token ids and
sampling parameters go through the broker, KV tensors never do (only signed handles to them, farm/transfer).
This package's surface re-exports the names most processes use, so `from farm.protocol import ...` is the
one way to name a contract.
"""

from farm.protocol.keys import (
    CANCEL_TTL_S,
    OBS_STREAM,
    STREAM_TTL_S,
    cancel_key,
    claim_key,
    fallback_id,
    migration_id,
    reader_lease_key,
    reply_stream_key,
)
from farm.protocol.queues import (
    BATCH_QUEUE,
    PRIORITY_SEP,
    ROLES,
    TASK_BATCH_DRIVE,
    TASK_DECODE,
    TASK_GENERATE,
    TASK_PING,
    TASK_PREFILL,
    TASK_RELEASE_KV,
    Role,
    direct_queue,
    model_slug,
    queue_depths,
    queue_name,
    queues_for_role,
)
from farm.protocol.request import (
    CONSTRAINTS,
    GREEDY_BELOW_TEMPERATURE,
    MAX_ALLOWED_TOKEN_IDS,
    MAX_BAD_WORD_CHARS,
    MAX_BAD_WORDS,
    MAX_BAD_WORDS_TOTAL_TOKENS,
    MAX_ID_CHARS,
    MAX_LOGIT_BIAS,
    MAX_LOGPROB_TOKEN_IDS,
    MAX_RESPONSE_FORMAT_CHARS,
    MAX_STOP_CHARS,
    MAX_STOP_SEQUENCES,
    MAX_STOP_TOKEN_IDS,
    MAX_TEMPERATURE,
    MAX_TOP_LOGPROBS,
    RESPONSE_FORMATS,
    SEED_RANGE,
    GenerationRequest,
    InvalidTask,
    SamplingParams,
    is_request_id,
)
from farm.protocol.stream_events import (
    EVENT_FIELD,
    FINISH_REASONS,
    DeltaEvent,
    DoneEvent,
    ErrorEvent,
    Event,
    ReplyBatch,
    StartEvent,
    Usage,
    decode_reply,
    encode_reply,
    parse_event,
)

__all__ = [
    "BATCH_QUEUE", "CANCEL_TTL_S", "EVENT_FIELD", "FINISH_REASONS", "GREEDY_BELOW_TEMPERATURE", "MAX_ALLOWED_TOKEN_IDS", "MAX_BAD_WORD_CHARS", "MAX_BAD_WORDS", "MAX_BAD_WORDS_TOTAL_TOKENS", "MAX_LOGPROB_TOKEN_IDS", "MAX_ID_CHARS", "MAX_LOGIT_BIAS",
    "MAX_RESPONSE_FORMAT_CHARS", "MAX_STOP_CHARS", "MAX_STOP_SEQUENCES", "MAX_STOP_TOKEN_IDS", "MAX_TEMPERATURE",
    "CONSTRAINTS", "MAX_TOP_LOGPROBS", "OBS_STREAM", "PRIORITY_SEP", "RESPONSE_FORMATS", "ROLES", "SEED_RANGE", "STREAM_TTL_S",
    "TASK_BATCH_DRIVE", "TASK_DECODE", "TASK_GENERATE", "TASK_PING", "TASK_PREFILL", "TASK_RELEASE_KV", "DeltaEvent", "DoneEvent",
    "ErrorEvent", "Event", "GenerationRequest", "InvalidTask", "ReplyBatch", "Role", "SamplingParams", "StartEvent",
    "Usage", "cancel_key", "claim_key", "decode_reply", "direct_queue", "encode_reply", "fallback_id",
    "is_request_id", "migration_id", "model_slug", "parse_event", "queue_depths", "queue_name", "queues_for_role",
    "reader_lease_key", "reply_stream_key",
]
