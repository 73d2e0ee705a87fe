"""The worker's stream writer batches token deltas into few Redis entries without losing what they carry."""

from __future__ import annotations

import json

from farm.protocol import EVENT_FIELD, stream_key
from farm.streams import StreamWriter


def read(r, rid: str) -> list[dict]:
    return [json.loads(f[EVENT_FIELD.encode()]) for _id, f in r.xrange(stream_key(rid))]


def test_merged_deltas_keep_ids_and_logprobs_aligned(redis_client):
    w = StreamWriter(redis_client, flush_ms=10_000)  # never flushes on its own: the test flushes
    w.emit("r1", {"type": "start", "role": "both", "worker": "w"})
    w.emit("r1", {"type": "delta", "text": "He", "n": 1, "ids": [10], "lp": [[-0.1, []]]})
    w.emit("r1", {"type": "delta", "text": "llo", "n": 1, "ids": [11], "lp": [[-0.2, [[11, -0.2]]]]})
    w.emit("r1", {"type": "delta", "text": "!", "n": 1, "ids": [12], "lp": [[-0.3, []]]})
    w.emit("r2", {"type": "delta", "text": "a", "n": 1, "ids": [1]})
    w.emit("r2", {"type": "delta", "text": "b", "n": 1, "ids": [2]})
    w.flush()
    start, delta = read(redis_client, "r1")
    assert start["type"] == "start"
    assert (delta["text"], delta["n"], delta["ids"]) == ("Hello!", 3, [10, 11, 12])
    assert delta["lp"] == [[-0.1, []], [-0.2, [[11, -0.2]]], [-0.3, []]]
    (plain,) = read(redis_client, "r2")
    assert plain["ids"] == [1, 2] and "lp" not in plain
