"""Every message that crosses processes survives its wire form (JSON) unchanged: the request, each stream event,
the KV event, the KV handle; and every Redis key is spelled in one module, farm/protocol/keys.py."""

from __future__ import annotations

import io
import json
import re
import tokenize
from pathlib import Path

import pytest

from farm.protocol import (
    DeltaEvent,
    DoneEvent,
    ErrorEvent,
    GenerationRequest,
    SamplingParams,
    StartEvent,
    decode_reply,
    encode_reply,
    parse_event,
)
from farm.protocol.kv_events import KVEvent, KVEventKind


def _wire(d: dict) -> dict:
    return json.loads(json.dumps(d))


def test_generation_request_round_trips_through_json():
    sampling = SamplingParams(max_tokens=16, temperature=0.7, top_p=0.9, seed=3, stop=["\n\n"], top_k=5,
                              min_p=0.05, repetition_penalty=1.1, stop_token_ids=[2], logprobs=2,
                              logit_bias={7: -1.5}, response_format={"type": "json_object"},
                              skip_special_tokens=False, include_stop_str_in_output=True)
    req = GenerationRequest(request_id="chatcmpl-client_id:1@0123456789abcdef.m1", model="smol",
                            prompt_token_ids=[1, 2, 3], sampling=sampling,
                            reply_to="api-host-12-ab", decode_queue="farm.smol.decode", lease_s=10.0,
                            origin="chatcmpl-1", cache_salt="t-0123456789abcdef", generated=2)
    back = GenerationRequest.from_dict(_wire(req.to_dict()), vocab_size=100, max_model_len=64)
    assert back == req


@pytest.mark.parametrize("event", [
    StartEvent("decode", "w1", "w0", "remote", {"bytes": 4096, "ms": 1.5}),
    StartEvent("prefill", "w0"),
    DeltaEvent("Hi", 1, [42], [[-0.1, [[42, -0.1], [7, -2.3]]]]),
    DeltaEvent("", 2, [1, 2]),
    DoneEvent("length", {"prompt_tokens": 5, "completion_tokens": 3, "cached_tokens": 0}, "w0", "w1", "remote"),
    ErrorEvent("invalid task: bad", "invalid_task"),
])
def test_stream_events_round_trip_and_carry_only_what_is_set(event):
    wire = _wire(event.to_dict())
    assert wire["type"] == event.type and None not in wire.values()
    # the stream writer adds its id and sequence number; parsing ignores them
    assert parse_event({**wire, "w": "writer-1", "s": 7}) == event


def test_a_reply_batch_carries_each_requests_typed_events_in_order():
    events = {"r1": [StartEvent("both", "w1"), DeltaEvent("a", 1, [5])],
              "r2": [DoneEvent("stop", {"prompt_tokens": 2, "completion_tokens": 1, "cached_tokens": 0})]}
    batch = decode_reply(encode_reply("writer-1", 7, {rid: [e.to_dict() for e in evs] for rid, evs in events.items()}))
    assert (batch.writer, batch.seq, batch.events) == ("writer-1", 7, events)
    assert batch.events["r2"][0].usage.total == 3


@pytest.mark.parametrize("raw", ['{"r": {}}', '{"w": "x", "s": "1", "r": {}}', '{"w": "x", "s": 1, "r": []}', "[]"])
def test_decode_reply_refuses_what_is_not_a_reply_batch(raw):
    with pytest.raises(ValueError):
        decode_reply(raw)


def test_one_requests_malformed_event_ends_that_request_only():
    """A flush with a bad event for one request (a worker's bug, or a newer worker's event type) delivers every
    other request's events, and the bad one's well-formed events followed by an error: never a hole in an answer
    that still finishes as if whole (before, the reader dropped the whole flush)."""
    good = [DeltaEvent("lo", 1, [7]).to_dict()]
    batch = decode_reply(encode_reply("w9", 3, {"a": good, "b": [DeltaEvent("x", 1, [8]).to_dict(), {"type": "progress"},
                                                              DoneEvent("stop", {}).to_dict()],
                                                "c": [{"type": "delta", "text": "x"}], "d": "not a list"}))
    assert batch.events["a"] == [DeltaEvent("lo", 1, [7])]
    assert batch.events["b"][0] == DeltaEvent("x", 1, [8]) and len(batch.events["b"]) == 2
    for rid in ("b", "c", "d"):
        last = batch.events[rid][-1]
        assert isinstance(last, ErrorEvent) and last.code == "bad_event" and "w9" in last.message


def test_parse_event_refuses_unknown_and_malformed_events():
    with pytest.raises(ValueError, match="unknown stream event"):
        parse_event({"type": "finish"})
    with pytest.raises(ValueError, match="malformed done"):
        parse_event({"type": "done", "usage": {}})  # no finish_reason


def test_kv_handle_round_trips_through_its_signed_json_form():
    from farm.transfer.handle import OPTIONAL_SIGNED_FIELDS, SIGNED_FIELDS, HandleError, KVHandle

    assert [f for f in KVHandle.__dataclass_fields__] == [*SIGNED_FIELDS, *OPTIONAL_SIGNED_FIELDS]
    secret = b"s" * 32
    for h in (KVHandle("r1", "w0", "127.0.0.1:9", "host", "shm,tcp", [3, 4], ["11", "12"], 64, 7, 32,
                       {"num_layers": 2, "block_size": 32}, "abc", 2e9, first_logprobs=[-0.5, [[7, -0.5]]]),
              KVHandle("r2", "w0", "127.0.0.1:9", "host", "vllm:NixlConnector", [1], ["5"], 40, 9, 0,
                       {"block_size": 32, "backend": "vllm"}, "", 2e9, connector="NixlConnector",
                       kv_transfer_params={"remote_block_ids": [1]})):
        wire = _wire(h.signed(secret))
        assert None not in wire.values()  # unset optional fields are not signed (the built-in's bytes stay)
        assert KVHandle.from_signed(wire, secret, now=1e9) == h
        with pytest.raises(HandleError, match="signature"):
            KVHandle.from_signed({**wire, "endpoint": "10.0.0.1:9"}, secret, now=1e9)


@pytest.mark.parametrize("event", [
    KVEvent("w1", 1700000000000000000, 1, KVEventKind.CLEARED),
    KVEvent("w1", 1700000000000000000, 2, KVEventKind.STORED, [2**63 - 1, 5], 17, "host"),
    KVEvent("w1", 1700000000000000000, 3, KVEventKind.REMOVED, [5], None, "disk"),
])
def test_kv_events_round_trip_in_their_wire_form(event):
    wire = _wire(event.to_dict())
    assert wire == {"worker_id": "w1", "epoch": event.epoch, "event_id": event.event_id, "kind": event.kind.value,
                    "blocks": event.blocks, "parent_hash": event.parent_hash, "tier": event.tier}
    assert KVEvent.from_dict(wire) == event


def test_kv_events_as_the_first_workers_wrote_them_and_what_is_not_one():
    old = {"worker_id": "w1", "event_id": "4", "kind": "stored", "blocks": ["9"], "parent_hash": None}
    assert KVEvent.from_dict(old) == KVEvent("w1", 0, 4, KVEventKind.STORED, [9], None, "device")
    assert KVEventKind.STORED == "stored"  # a StrEnum: the engines' hooks may still name a kind by its string
    with pytest.raises(ValueError):
        KVEvent.from_dict({**old, "kind": "evicted"})
    with pytest.raises(KeyError):
        KVEvent.from_dict({"worker_id": "w1", "event_id": 1, "kind": "cleared"})  # no blocks


# A Redis key of the farm spelled as a string literal ("farm:...", f"farm:{...}"): keys live in
# farm/protocol/keys.py.
FARM_KEY_LITERAL = re.compile(r"farm:[\w{*]")
KEY_LITERALS_ALLOWED = {
    # a setting's default (farm/config imports nothing of the farm, so it cannot name farm.protocol.keys); the
    # semantic cache builds its keys, in Python and in its Lua script, under this configurable prefix
    ("farm/config/semantic.py", "farm:sc"),
}


def _string_literals(path: Path) -> list[tuple[int, str]]:
    """(line, contents) of every string literal of a module, f-strings included, without prefix and quotes."""
    out = []
    for tok in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
        if tok.type == tokenize.STRING:
            body = tok.string.lstrip("rbfuRBFU")
            quote = body[:3] if body[:3] in ('"""', "'''") else body[:1]
            out.append((tok.start[0], body[len(quote):-len(quote)]))
    return out


def test_every_redis_key_is_spelled_in_farm_protocol_keys():
    root = Path(__file__).resolve().parent.parent
    found = []
    for path in sorted((root / "farm").rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel == "farm/protocol/keys.py":
            continue
        for line, text in _string_literals(path):
            if FARM_KEY_LITERAL.match(text) and (rel, text) not in KEY_LITERALS_ALLOWED:
                found.append(f"{rel}:{line}: {text!r}")
    assert found == [], "Redis keys belong in farm/protocol/keys.py:\n" + "\n".join(found)
    # and the check sees a key where one is: the module that holds them all
    assert any(FARM_KEY_LITERAL.match(t) for _, t in _string_literals(root / "farm/protocol/keys.py"))
