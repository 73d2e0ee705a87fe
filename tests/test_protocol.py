"""Every message that crosses processes survives its wire form (JSON) unchanged: the request, each stream event."""

from __future__ import annotations

import json

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


def _wire(d: dict) -> dict:
    return json.loads(json.dumps(d))


def test_generation_request_round_trips_through_json():
    sampling = SamplingParams(max_tokens=16, temperature=0.7, top_p=0.9, seed=3, stop=["\n\n"], top_k=5,
                              min_p=0.05, repetition_penalty=1.1, stop_token_ids=[2], logprobs=2,
                              logit_bias={7: -1.5}, response_format={"type": "json_object"})
    req = GenerationRequest(request_id="chatcmpl-1.m1", model="smol", prompt_token_ids=[1, 2, 3], sampling=sampling,
                            reply_to="api-host-12-ab", decode_queue="farm.smol.decode", lease_s=10.0,
                            origin="chatcmpl-1", cache_salt="t-0123456789abcdef")
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


@pytest.mark.parametrize("raw", ['{"r": {}}', '{"w": "x", "s": "1", "r": {}}', '{"w": "x", "s": 1, "r": []}',
                                 '{"w": "x", "s": 1, "r": {"a": [{"type": "nope"}]}}', "[]"])
def test_decode_reply_refuses_what_is_not_a_reply_batch(raw):
    with pytest.raises(ValueError):
        decode_reply(raw)


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
