"""The vLLM backend's parts that need no running engine: configuration, engine arguments, the decoding of
KV event payloads encoded exactly as vLLM encodes them (msgspec structs as in vllm/distributed/kv_events.py,
over real ZMQ sockets) and their translation into the farm's events in a real Redis and the router's real
KV index, signed handle round trips, the sampling mapping, and the clear error when vllm is missing.

The backend on a real vLLM engine (vLLM's CPU build) is tested end to end in tests/vllm/.
"""

import hashlib
import json
import os
import pickle
import sys
import threading
import time
import uuid
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest
import yaml
import zmq

from farm.backends import connector_import, make_engine
from farm.backends.vllm_args import (
    LMCACHE_TENANT_TAG,
    PREFILL_PARAMS,
    build_engine_args,
    connector_params,
    sampling_kwargs,
)
from farm.backends.vllm_events import (
    END_SEQ,
    VllmKVEventSubscriber,
    VllmKVEventTranslator,
    VllmNotInstalled,
    decode_event_batch,
    medium_tier,
)
from farm.backends.vllm_handles import (
    ConnectorImport,
    VllmRequestOutput,
    import_from_handle,
    make_connector_handle,
)
from farm.config import ConfigError, ModelConfig, load_config
from farm.protocol import SamplingParams
from farm.protocol.hashing import block_hashes
from farm.protocol.keys import worker_blocks_key
from farm.router.index import IndexFollower
from farm.router.kv_publisher import KVEventPublisher
from farm.transfer.handle import SIGNED_FIELDS, HandleError, sign_handle, verify_handle

SECRET = b"test-secret-not-for-production"
BS = 16


# -- vLLM's event structs, as vllm/distributed/kv_events.py defines them --------------------------------
def vllm_structs_v011() -> SimpleNamespace:
    """vLLM <= 0.11: array_like structs (EventBatch = [ts, events]; each event [tag, fields...])."""
    ExternalBlockHash = bytes | int  # noqa: N806 - vLLM's name

    class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
        ts: float
        events: list[Any]

    class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
        """Base class for all KV cache-related events"""

    class BlockStored(KVCacheEvent):
        block_hashes: list[ExternalBlockHash]
        parent_block_hash: ExternalBlockHash | None
        token_ids: list[int]
        block_size: int
        lora_id: int | None
        medium: str | None

    class BlockRemoved(KVCacheEvent):
        block_hashes: list[ExternalBlockHash]
        medium: str | None

    class AllBlocksCleared(KVCacheEvent):
        pass

    class KVEventBatch(EventBatch):
        events: list[BlockStored | BlockRemoved | AllBlocksCleared]

    return SimpleNamespace(KVEventBatch=KVEventBatch, BlockStored=BlockStored, BlockRemoved=BlockRemoved,
                           AllBlocksCleared=AllBlocksCleared, encode=msgspec.msgpack.Encoder().encode)


def vllm_structs_latest() -> SimpleNamespace:
    """Later vLLM: map-encoded structs with a `type` tag, data_parallel_rank, lora_name, group_idx..."""
    ExternalBlockHash = bytes | int  # noqa: N806 - vLLM's name

    class EventBatch(msgspec.Struct, omit_defaults=True, gc=False):
        ts: float
        events: list[Any]
        data_parallel_rank: int | None = None

    class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
        """Base class for all KV cache-related events"""

    class BlockStored(KVCacheEvent):
        block_hashes: list[ExternalBlockHash]
        parent_block_hash: ExternalBlockHash | None
        token_ids: list[int]
        block_size: int
        lora_id: int | None
        medium: str | None
        lora_name: str | None
        extra_keys: list[tuple[Any, ...] | None] | None = None
        group_idx: int | None = None
        kv_cache_spec_kind: str | None = None
        kv_cache_spec_sliding_window: int | None = None

    class BlockRemoved(KVCacheEvent):
        block_hashes: list[ExternalBlockHash]
        medium: str | None
        group_idx: int | None = None

    class AllBlocksCleared(KVCacheEvent):
        pass

    class KVEventBatch(EventBatch):
        events: list[BlockStored | BlockRemoved | AllBlocksCleared]

    return SimpleNamespace(KVEventBatch=KVEventBatch, BlockStored=BlockStored, BlockRemoved=BlockRemoved,
                           AllBlocksCleared=AllBlocksCleared, encode=msgspec.msgpack.Encoder().encode)


def vllm_hashes(tokens: list[int], parent: bytes | None = None) -> list[bytes]:
    """Block hashes the way vLLM's sha256 mode makes them (sha256 of a pickled (parent, tokens, extra))."""
    out = []
    for i in range(0, len(tokens) - BS + 1, BS):
        parent = hashlib.sha256(pickle.dumps((parent or b"\0" * 32, tuple(tokens[i:i + BS]), None))).digest()
        out.append(parent)
    return out


def stored(v, hashes, parent, tokens, medium="GPU", **kw):
    if "lora_name" in v.BlockStored.__struct_fields__:
        kw.setdefault("lora_name", None)
    return v.BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens, block_size=BS,
                         lora_id=None, medium=medium, **kw)


PROMPT = list(range(1000, 1000 + 3 * BS + 5))  # three full blocks and a partial tail


# -- config ------------------------------------------------------------------------------------------
def _load(tmp_path: Path, model: dict, **top) -> Any:
    """The defaults plus `model` (beside the default model, which other sections may name)."""
    base = load_config(environ={})
    default = base.model(base.default_model).model_dump(exclude_none=True)
    f = tmp_path / "farm.yaml"
    f.write_text(yaml.safe_dump({"models": [default, model], **top}))
    return load_config(f, environ={})


def test_backend_defaults_to_builtin():
    cfg = load_config(environ={})
    m = cfg.model(cfg.default_model)
    assert m.backend == "builtin" and m.vllm is None


def test_vllm_backend_config_loads(tmp_path):
    cfg = _load(tmp_path, {"name": "llama", "path": "/models/llama", "backend": "vllm", "vllm": {
        "engine_args": {"gpu_memory_utilization": 0.8, "tensor_parallel_size": 2},
        "kv_connector": "NixlConnector"}})
    m = cfg.model("llama")
    assert m.backend == "vllm" and m.vllm.kv_connector == "NixlConnector" and m.vllm.kv_role is None
    assert cfg.block_size("llama") == 32 and cfg.block_size(cfg.default_model) == cfg.engine.block_size
    # backend: vllm alone gets the default options (no connector: aggregated serving)
    cfg = _load(tmp_path, {"name": "llama", "path": "/models/llama", "backend": "vllm"})
    assert cfg.model("llama").vllm.kv_connector is None


@pytest.mark.parametrize("model, top, message", [
    ({"backend": "builtin", "vllm": {}}, {}, "needs `backend: vllm`"),
    ({"backend": "tensorrt"}, {}, "backend"),
    ({"backend": "vllm", "vllm": {"engine_args": {"block_size": 32}}}, {}, "models[].block_size"),
    ({"backend": "vllm", "vllm": {"engine_args": {"enable_prefix_caching": False}}}, {}, "always on"),
    ({"backend": "vllm", "vllm": {"engine_args": {"max_model_len": 8192}}}, {}, "models[].max_model_len"),
    ({"backend": "vllm", "vllm": {"engine_args": {"gpu-memory-utilization": 0.9}}}, {}, "snake_case"),
    ({"backend": "vllm", "vllm": {"kv_connector": "FooConnector"}}, {}, "kv_connector"),
    ({"backend": "vllm", "vllm": {"kv_role": "producer"}}, {}, "kv_role"),
    ({"backend": "vllm", "vllm": {"engine_arg": {}}}, {}, "engine_arg"),  # a typo of a key
    ({"backend": "vllm", "block_size": 12}, {}, "block size vLLM supports"),
])
def test_vllm_option_errors(tmp_path, model, top, message):
    with pytest.raises(ConfigError) as e:
        _load(tmp_path, {"name": "m", "path": "/models/m", **model}, **top)
    assert message in str(e.value)


def test_block_size_12_is_fine_without_vllm(tmp_path):
    assert _load(tmp_path, {"name": "m", "path": "/models/m"}, engine={"block_size": 12}).engine.block_size == 12
    # the engine's block size is the built-in engine's default; a vLLM model keeps its own
    cfg = _load(tmp_path, {"name": "m", "path": "/models/m", "backend": "vllm"}, engine={"block_size": 12})
    assert cfg.block_size("m") == 32


def test_engine_args_farm_settings_and_passthrough(tmp_path):
    cfg = _load(tmp_path, {"name": "m", "path": "/models/m", "max_model_len": 8192, "backend": "vllm", "vllm": {
        "engine_args": {"gpu_memory_utilization": 0.7}, "kv_connector": "LMCacheConnectorV1",
        "kv_role": "kv_producer", "kv_connector_extra_config": {"discard_partial_chunks": False}}})
    m = cfg.model("m")
    args = build_engine_args(cfg, m, Path("/models/m"), "tcp://127.0.0.1:5557", "tcp://127.0.0.1:5558")
    assert args["model"] == args["tokenizer"] == "/models/m"
    assert args["block_size"] == 32 and args["enable_prefix_caching"] is True
    assert args["max_model_len"] == 8192 and args["gpu_memory_utilization"] == 0.7
    assert "kv_cache_memory_bytes" not in args  # the entry sizes vLLM's cache itself
    assert "dtype" not in args  # the farm's `auto` on a GPU: vLLM's own choice
    assert args["kv_events_config"] == {"enable_kv_cache_events": True, "publisher": "zmq",
                                        "endpoint": "tcp://127.0.0.1:5557",
                                        "replay_endpoint": "tcp://127.0.0.1:5558", "topic": ""}
    assert args["kv_transfer_config"] == {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_producer",
                                          "kv_connector_extra_config": {"discard_partial_chunks": False}}
    with pytest.raises(ValueError, match="gpu_memory_utilization"):  # not a field of this vLLM's args
        build_engine_args(cfg, m, Path("/models/m"), "e", None, known_fields={"model", "block_size"})


def test_engine_args_size_the_kv_cache_and_pick_roles_on_cpu(tmp_path):
    """On a CPU: the farm's KV budget (vLLM's own would claim 92% of RAM), fp32 for `auto`, a connector role
    from the worker's role, and NIXL through the farm's CPU variant of the connector."""
    cfg = _load(tmp_path, {"name": "m", "path": "/models/m", "backend": "vllm", "block_size": 64,
                           "vllm": {"kv_connector": "NixlConnector"}}, engine={"kv_cache_mb": 300})
    args = build_engine_args(cfg, cfg.model("m"), Path("/models/m"), "e", None, device="cpu", role="prefill")
    assert args["kv_cache_memory_bytes"] == 300 * 2**20 and args["dtype"] == "float32" and args["block_size"] == 64
    assert args["kv_transfer_config"] == {"kv_connector": "FarmNixlConnector", "kv_role": "kv_producer",
                                          "kv_connector_module_path": "farm.backends.vllm_nixl"}
    dec = build_engine_args(cfg, cfg.model("m"), Path("/models/m"), "e", None, device="cuda", role="decode")
    assert dec["kv_transfer_config"] == {"kv_connector": "NixlConnector", "kv_role": "kv_consumer"}


def test_engine_args_ask_for_vllms_iteration_details(tmp_path):
    """The router's step costs come from each step's own prompt tokens and engine time (below); a vLLM whose
    args have no such field gets none (its frontend timing is the fallback)."""
    cfg = _load(tmp_path, {"name": "m", "path": "/models/m", "backend": "vllm"})
    args = build_engine_args(cfg, cfg.model("m"), Path("/models/m"), "e", None, device="cpu")
    assert args["enable_logging_iteration_details"] is True
    old = build_engine_args(cfg, cfg.model("m"), Path("/models/m"), "e", None, device="cpu",
                            known_fields={"model", "block_size"})
    assert "enable_logging_iteration_details" not in old


def test_step_costs_come_from_vllms_iteration_details():
    """A step with prompt tokens (a chunk of a long prompt with decodes in it too) is a prefill step of those
    tokens; a step without is a decode step over the blocks in use; a dummy step is nothing. The engine
    core's time is the step's: no frontend delay reaches the decode line."""
    from farm.backends.vllm import VllmEngine
    from farm.engine.step_costs import StepCosts

    eng = SimpleNamespace(costs=StepCosts(32), pool=SimpleNamespace(num_blocks=100), _last_iteration=0.0,
                          _stats=SimpleNamespace(kv_usage=0.5, running=1, waiting=0))

    def step(ctx, gen, ms, dummy=False):
        VllmEngine._observe_step(eng, None, SimpleNamespace(num_ctx_tokens=ctx, num_generation_tokens=gen,
                                                             elapsed_ms=ms, is_dummy=dummy))

    for _ in range(6):
        step(1024, 2, 800.0)
        step(0, 2, 30.0)
    step(0, 0, 0.0, dummy=True)
    step(0, 2, 9000.0)  # no step takes 9 s: a stall, not a cost
    snap = eng.costs.snapshot()
    assert snap["prefill_samples"] == 4 and snap["decode_samples"] == 4  # the first 2 of each kind are warm-up
    assert snap["prefill_ms_per_block"] == pytest.approx(800 / 1024 * 32)
    assert snap["decode_step_ms"] + 50 * snap["decode_ms_per_block"] == pytest.approx(30.0)  # 50 blocks in use


def test_waiting_counts_vllms_deferred_requests_as_vllm_exports_them():
    """vllm:num_requests_waiting is vLLM's waiting plus its deferred (skipped) requests: a P/D decode request
    waiting for its remote KV waits (the ops audit: the farm counted it as running)."""
    from vllm.v1.metrics.stats import SchedulerStats

    from farm.backends.vllm import VllmEngine

    stats = SimpleNamespace(running=0, waiting=0, kv_usage=0.0, connector_hits=0, kv_transfers=0,
                            kv_transfer_bytes=0, prefix_queries=0, prefix_hits=0, preemptions=0)
    eng = SimpleNamespace(_stats=stats, _observe_step=lambda *_a: None)
    logger = VllmEngine._stat_logger_factory(eng)()
    logger.record(scheduler_stats=SchedulerStats(num_running_reqs=2, num_waiting_reqs=1, num_skipped_waiting_reqs=3))
    assert (stats.running, stats.waiting) == (2, 4)


# -- vllm missing -----------------------------------------------------------------------------------
def test_clear_error_when_vllm_is_missing(tmp_path, monkeypatch):
    for name in [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "vllm", None)  # what `import vllm` meets where it is not installed
    cfg = _load(tmp_path, {"name": "big", "path": str(tmp_path), "backend": "vllm"})
    with pytest.raises(VllmNotInstalled) as e:
        make_engine(cfg, cfg.model("big"), tmp_path, None, worker_id="w", role="both")
    msg = str(e.value)
    assert "'big'" in msg and "backend: vllm" in msg and "pip install -e '.[vllm]'" in msg


# -- sampling ---------------------------------------------------------------------------------------
def test_sampling_param_mapping():
    p = SamplingParams(max_tokens=50, temperature=0.0, top_p=0.9, seed=7, stop=["\n\n", "END"], ignore_eos=True)
    kw = sampling_kwargs(p, prompt_len=100, max_model_len=4096)
    assert kw == {"n": 1, "max_tokens": 50, "temperature": 0.0, "top_p": 0.9, "seed": 7, "stop": ["\n\n", "END"],
                  "ignore_eos": True, "skip_special_tokens": True, "include_stop_str_in_output": False,
                  "presence_penalty": 0.0, "frequency_penalty": 0.0,
                  "repetition_penalty": 1.0, "top_k": 0, "min_p": 0.0, "min_tokens": 0, "stop_token_ids": None,
                  "logprobs": None, "logprob_token_ids": None, "prompt_logprobs": None, "logit_bias": None,
                  "allowed_token_ids": None, "bad_words": None}
    full = SamplingParams(max_tokens=9, top_k=5, min_p=0.1, min_tokens=3, stop_token_ids=[2], logprobs=4,
                          logit_bias={7: -5.0}, response_format={"type": "json_schema", "json_schema": {"schema": {}}})
    kw = sampling_kwargs(full, 10, 4096, structured=lambda **k: ("structured", k))
    assert (kw["top_k"], kw["min_p"], kw["min_tokens"], kw["stop_token_ids"], kw["logprobs"]) == (5, 0.1, 3, [2], 4)
    assert kw["logit_bias"] == {7: -5.0} and kw["structured_outputs"] == ("structured", {"json": {}})
    assert sampling_kwargs(full, 10, 4096, prefill_only=True)["logprobs"] is None  # one token, for the KV only
    for fmt, spec in (({"type": "regex", "regex": "a+"}, {"regex": "a+"}),
                      ({"type": "choice", "choice": ["x", "y"]}, {"choice": ["x", "y"]}),
                      ({"type": "grammar", "grammar": 'root ::= "a"'}, {"grammar": 'root ::= "a"'}),
                      ({"type": "json_object", "disable_any_whitespace": True},
                       {"json_object": True, "disable_any_whitespace": True})):  # vLLM's structured_outputs, as sent
        assert sampling_kwargs(SamplingParams(response_format=fmt), 10, 4096)["structured_outputs"] == spec
    assert sampling_kwargs(SamplingParams(prompt_logprobs=1), 10, 4096)["prompt_logprobs"] == 1
    assert sampling_kwargs(SamplingParams(bad_words=["Paris"]), 10, 4096)["bad_words"] == ["Paris"]
    ids = sampling_kwargs(SamplingParams(logprobs=0, logprob_token_ids=[7, 3]), 10, 4096)  # the ids, not a top-k
    assert (ids["logprobs"], ids["logprob_token_ids"]) == (None, [7, 3])
    assert sampling_kwargs(SamplingParams(allowed_token_ids=[5, 9]), 10, 4096)["allowed_token_ids"] == [5, 9]
    # the room left in max_model_len caps max_tokens (vLLM would reject the request instead)
    assert sampling_kwargs(p, prompt_len=4090, max_model_len=4096)["max_tokens"] == 6
    assert sampling_kwargs(SamplingParams(stop=[]), 10, 4096)["stop"] is None
    # vLLM's own detokenizer honours the request's text options (the built-in engine's does the same)
    kept = sampling_kwargs(SamplingParams(stop=["END"], skip_special_tokens=False, include_stop_str_in_output=True),
                           10, 4096)
    assert (kept["skip_special_tokens"], kept["include_stop_str_in_output"]) == (False, True)
    pre = sampling_kwargs(SamplingParams(max_tokens=200, temperature=0.7), 10, 4096, prefill_only=True,
                          kv_transfer_params=PREFILL_PARAMS["NixlConnector"])
    assert pre["max_tokens"] == 1 and pre["temperature"] == 0.7
    assert pre["extra_args"] == {"kv_transfer_params": PREFILL_PARAMS["NixlConnector"]}
    assert pre["extra_args"]["kv_transfer_params"] is not PREFILL_PARAMS["NixlConnector"]  # a copy


# -- KV events ---------------------------------------------------------------------------------------
class Recorder:
    def __init__(self):
        self.events = []

    def __call__(self, kind, hashes, parent, tier=None):
        self.events.append((kind, list(hashes), parent, tier))


@pytest.mark.parametrize("layout", [vllm_structs_v011, vllm_structs_latest])
def test_decode_real_vllm_payloads(layout):
    v = layout()
    hs = vllm_hashes(PROMPT)
    batch = v.KVEventBatch(ts=time.time(), events=[
        stored(v, hs[:2], None, PROMPT[:2 * BS]), stored(v, hs[2:], hs[1], PROMPT[2 * BS:3 * BS], medium="CPU"),
        v.BlockRemoved(block_hashes=[hs[2]], medium="CPU"), v.AllBlocksCleared()])
    payload = v.encode(batch)
    _ts, events, _dp = decode_event_batch(payload)
    assert [e["type"] for e in events] == ["BlockStored", "BlockStored", "BlockRemoved", "AllBlocksCleared"]
    assert events[0]["block_hashes"] == hs[:2] and events[0]["parent_block_hash"] is None
    assert events[1]["parent_block_hash"] == hs[1] and events[1]["token_ids"] == PROMPT[2 * BS:3 * BS]
    assert events[1]["medium"] == "CPU" and events[1]["block_size"] == BS and events[1]["group_idx"] is None
    assert events[2]["block_hashes"] == [hs[2]]


@pytest.mark.parametrize("layout", [vllm_structs_v011, vllm_structs_latest])
def test_translation_rehashes_with_the_farm_contract(layout):
    v = layout()
    hs = vllm_hashes(PROMPT)
    ours = block_hashes(PROMPT, BS)  # what the API/router compute for this prompt
    rec = Recorder()
    t = VllmKVEventTranslator(rec, BS)
    # vLLM stores the first block, then the next two (with the first as parent), like two steps
    t.apply(decode_event_batch(v.encode(v.KVEventBatch(ts=1.0, events=[stored(v, hs[:1], None, PROMPT[:BS])])))[1])
    t.apply(decode_event_batch(v.encode(v.KVEventBatch(ts=2.0, events=[
        stored(v, hs[1:3], hs[0], PROMPT[BS:3 * BS])])))[1])
    assert rec.events == [("stored", ours[:1], None, "device"), ("stored", ours[1:3], ours[0], "device")]
    assert [t.farm_hash(h) for h in hs] == ours and t.device_blocks == 3
    # the same blocks offloaded to CPU: the host tier; removal from the GPU keeps the host copy
    t.apply(decode_event_batch(v.encode(v.KVEventBatch(ts=3.0, events=[
        stored(v, hs[1:3], hs[0], PROMPT[BS:3 * BS], medium="CPU"),
        v.BlockRemoved(block_hashes=hs[1:3], medium="GPU")])))[1])
    assert rec.events[2:] == [("stored", ours[1:3], ours[0], "host"), ("removed", ours[1:3], None, "device")]
    assert t.device_blocks == 1 and len(t) == 3  # the engine's cached blocks (heartbeat) count the device's
    # a block whose parent was never reported cannot be re-hashed: skipped, not guessed
    other = vllm_hashes(list(range(5000, 5000 + 2 * BS)))
    t.apply([{"type": "BlockStored", "block_hashes": other[1:], "parent_block_hash": other[0],
              "token_ids": list(range(5000 + BS, 5000 + 2 * BS)), "block_size": BS, "medium": "GPU"}])
    assert t.skipped == 1 and len(rec.events) == 4
    # another block size, another KV cache group, a LoRA: not indexed
    for extra in ({"block_size": 32}, {"group_idx": 1}, {"lora_id": 3}):
        t.apply([{"type": "BlockStored", "block_hashes": other[:1], "parent_block_hash": None,
                  "token_ids": list(range(5000, 5000 + BS)), "block_size": BS, "medium": "GPU", **extra}])
    assert t.skipped == 4 and len(rec.events) == 4
    t.apply([{"type": "AllBlocksCleared"}])
    assert rec.events[-1] == ("cleared", [], None, None) and len(t) == 0 == t.device_blocks


def test_removed_is_reference_counted_across_vllm_hashes():
    """Two vLLM blocks with the same tokens but different extra keys (e.g. cache_salt) are one farm block:
    it leaves the index only when vLLM has removed both."""
    rec = Recorder()
    t = VllmKVEventTranslator(rec, BS)
    a, b = vllm_hashes(PROMPT[:BS])[0], b"salted" + bytes(26)
    for h in (a, b):
        t.apply([{"type": "BlockStored", "block_hashes": [h], "parent_block_hash": None,
                  "token_ids": PROMPT[:BS], "block_size": BS, "medium": None}])
    t.apply([{"type": "BlockRemoved", "block_hashes": [a], "medium": None}])
    assert [e[0] for e in rec.events] == ["stored"]
    t.apply([{"type": "BlockRemoved", "block_hashes": [b], "medium": None}])
    assert rec.events[-1] == ("removed", block_hashes(PROMPT[:BS], BS), None, "device")


def test_medium_names():
    assert [medium_tier(m) for m in (None, "GPU", "cuda:0", "CPU", "cpu_pinned", "DISK", "LocalDisk")] == \
        ["device", "device", "device", "host", "host", "disk", "disk"]


def _wait(cond, timeout=10.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.02)
    return False


def _follow(r, worker, hashes, want, timeout=10.0):
    """Follow the real event stream with the router's real index until `worker` holds `want` blocks."""
    f = IndexFollower(r)

    def ok():
        f.poll(block_ms=50)
        return f.index.overlaps(hashes).get(worker, 0) == want

    assert _wait(ok, timeout), (f.index.overlaps(hashes), want)
    return f


@pytest.mark.parametrize("layout", [vllm_structs_v011, vllm_structs_latest])
def test_zmq_events_reach_the_router_index(redis_client, layout):
    """vLLM's stream over a real ZMQ PUB -> our SUB -> farm events in Redis -> the router's KVIndex."""
    v = layout()
    worker = f"vllm-{uuid.uuid4().hex[:6]}@test"
    pub_events = KVEventPublisher(redis_client, worker, flush_ms=10).start()
    sub = VllmKVEventSubscriber(VllmKVEventTranslator(pub_events, BS)).start()
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    try:
        pub.bind(sub.endpoint)  # vLLM's publisher binds an ipc:// endpoint, and our SUB connects to it
        hs = vllm_hashes(PROMPT)
        ours = block_hashes(PROMPT, BS)
        batches = [v.KVEventBatch(ts=time.time(), events=[stored(v, hs[:2], None, PROMPT[:2 * BS])]),
                   v.KVEventBatch(ts=time.time(), events=[stored(v, hs[2:], hs[1], PROMPT[2 * BS:3 * BS])])]
        seq = 0

        def send(batch):
            nonlocal seq
            pub.send_multipart((b"", seq.to_bytes(8, "big"), v.encode(batch)))
            seq += 1

        time.sleep(0.2)  # ZMQ's slow joiner: the subscription must reach the publisher first
        assert _wait(lambda: (send(batches[0]) or True) and sub.batches > 0, 5)  # resend until subscribed
        send(batches[1])
        f = _follow(redis_client, worker, ours, 3)
        members = {int(m) for m in redis_client.smembers(worker_blocks_key(worker))}
        assert members == set(ours)
        send(v.KVEventBatch(ts=time.time(), events=[v.BlockRemoved(block_hashes=hs[1:], medium="GPU")]))

        def one_left():
            f.poll(block_ms=50)
            return f.index.overlaps(ours).get(worker, 0) == 1

        assert _wait(one_left)
        send(v.KVEventBatch(ts=time.time(), events=[v.AllBlocksCleared()]))
        assert _wait(lambda: not redis_client.smembers(worker_blocks_key(worker)))
    finally:
        pub.close(linger=0)
        ctx.term()
        sub.stop()
        pub_events.stop()


def test_the_event_sockets_are_private_to_the_worker():
    """vLLM's replay socket keeps the last batches, whose stored blocks carry their token ids: on
    tcp://127.0.0.1 any local user could read every tenant's prompts from it (the listeners audit did, as
    `nobody`), or publish forged events. The sockets are ipc:// in a 0700 directory of the worker's own, which
    another user cannot enter, removed on stop. (No frame bound: libzmq 4.3 does not reconnect after a frame
    past ZMQ_MAXMSGSIZE, so one big batch would stop the stream for good; only vLLM can reach the socket.)"""
    import pwd
    import shutil
    import subprocess

    sub = VllmKVEventSubscriber(VllmKVEventTranslator(Recorder(), BS)).start()
    ctx = zmq.Context()
    pub, router = ctx.socket(zmq.PUB), ctx.socket(zmq.ROUTER)
    try:
        assert sub.endpoint.startswith("ipc://") and sub.replay_endpoint.startswith("ipc://")
        pub.bind(sub.endpoint)
        router.bind(sub.replay_endpoint)  # both as vLLM binds them
        folder = Path(sub.replay_endpoint[len("ipc://"):]).parent
        assert folder.stat().st_mode & 0o777 == 0o700 and folder.stat().st_uid == os.geteuid()
        if os.geteuid() == 0:  # another user cannot connect (as root here: the tests run as root in CI)
            probe = ("import socket, sys\ns = socket.socket(socket.AF_UNIX)\n"
                     "try:\n    s.connect(sys.argv[1]); print('connected')\n"
                     "except PermissionError:\n    print('refused')\n")
            system_python = shutil.which("python3", path="/usr/local/bin:/usr/bin")  # nobody may run it
            out = subprocess.run([system_python, "-c", probe, sub.replay_endpoint[len("ipc://"):]],
                                 user=pwd.getpwnam("nobody").pw_uid, capture_output=True, text=True, timeout=30)
            assert out.stdout.strip() == "refused", out
    finally:
        pub.close(linger=0)
        router.close(linger=0)
        ctx.term()
        sub.stop()
    assert not folder.exists()


def test_gap_is_filled_from_the_replay_socket(redis_client):
    """A lost batch is fetched from vLLM's ROUTER replay socket (vLLM's protocol: start seq in, then
    (seq, payload) frames and an END_SEQ marker out)."""
    v = vllm_structs_v011()
    hs = vllm_hashes(PROMPT)
    payloads = [v.encode(v.KVEventBatch(ts=1.0, events=[stored(v, hs[:1], None, PROMPT[:BS])])),
                v.encode(v.KVEventBatch(ts=2.0, events=[stored(v, hs[1:2], hs[0], PROMPT[BS:2 * BS])])),
                v.encode(v.KVEventBatch(ts=3.0, events=[stored(v, hs[2:3], hs[1], PROMPT[2 * BS:3 * BS])]))]
    rec = Recorder()
    sub = VllmKVEventSubscriber(VllmKVEventTranslator(rec, BS))
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.bind(sub.replay_endpoint)  # vLLM binds it

    def serve():
        if router.poll(5000):
            client, _, start = router.recv_multipart()
            for seq in range(int.from_bytes(start, "big"), len(payloads)):
                router.send_multipart((client, b"", seq.to_bytes(8, "big"), payloads[seq]))
            router.send_multipart((client, b"", END_SEQ, b""))

    server = threading.Thread(target=serve)
    server.start()
    try:
        sub.handle(2, payloads[2])  # batches 0 and 1 were lost
        server.join(10)
        assert sub.gaps == 1 and sub.next_seq == 3
        assert [e[1] for e in rec.events] == [[h] for h in block_hashes(PROMPT[:3 * BS], BS)]
        sub.handle(1, payloads[1])  # a duplicate: ignored
        assert len(rec.events) == 3
    finally:
        sub.stop()
        router.close(linger=0)
        ctx.term()
    # no replay socket answers: the worker's index is reset rather than left wrong
    rec = Recorder()
    sub = VllmKVEventSubscriber(VllmKVEventTranslator(rec, BS), replay_timeout_s=0.2)
    try:
        sub.handle(5, payloads[0])
        assert rec.events[0][0] == "cleared" and rec.events[1][0] == "stored"
    finally:
        sub.stop()


# -- handles ----------------------------------------------------------------------------------------
NIXL_OUT = {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [7, 8, 9, 12],
            "remote_engine_id": "7f3c-engine", "remote_host": "10.0.0.5", "remote_port": 5600, "tp_size": 1}


def _prefill_out(params=NIXL_OUT, connector="NixlConnector"):
    return VllmRequestOutput("req-1", finished=True, finish_reason="prefilled", prompt_tokens=len(PROMPT),
                             cached_tokens=16, first_token=42, block_hashes=block_hashes(PROMPT, BS),
                             kv_transfer_params=params, connector=connector)


def test_handle_round_trip_with_signature():
    h = make_connector_handle(request_id="req-1", worker_id="prefill-1@a", endpoint="10.0.0.5:7000",
                              host_id="hostA", out=_prefill_out(), num_tokens=len(PROMPT), block_size=BS,
                              ttl_s=60, secret=SECRET)
    wire = json.loads(json.dumps(h))  # through Celery's JSON
    assert wire["connector"] == "NixlConnector" and wire["kv_transfer_params"] == NIXL_OUT
    assert wire["block_ids"] == [7, 8, 9, 12] and wire["transport"] == "vllm:NixlConnector"
    assert wire["block_hashes"] == [str(x) for x in block_hashes(PROMPT, BS)]
    imp = import_from_handle(wire, SECRET, "NixlConnector")
    assert imp == ConnectorImport(NIXL_OUT, "NixlConnector", len(PROMPT), 42, 16)
    # the parameters are signed: altered, stripped or re-targeted handles are refused
    for bad in ({**wire, "kv_transfer_params": {**NIXL_OUT, "remote_host": "evil"}},
                {k: x for k, x in wire.items() if k != "kv_transfer_params"},
                {**wire, "connector": "LMCacheConnectorV1"}):
        with pytest.raises(HandleError):
            import_from_handle(bad, SECRET, "NixlConnector")
    with pytest.raises(HandleError, match="signature"):
        import_from_handle(wire, b"another-secret", "NixlConnector")
    with pytest.raises(HandleError, match="expired"):
        import_from_handle(wire, SECRET, "NixlConnector", now=time.time() + 61)
    with pytest.raises(HandleError, match="connector"):  # a decode worker with another connector
        import_from_handle(wire, SECRET, "LMCacheConnectorV1")
    # the worker-side helper: a built-in engine (no connector) cannot use it -> None (prefill locally)
    assert connector_import(SimpleNamespace(), wire, SECRET) is None
    assert connector_import(SimpleNamespace(connector="NixlConnector"), wire, SECRET) == imp


def test_lmcache_handle_carries_empty_params():
    h = make_connector_handle(request_id="req-1", worker_id="p", endpoint="e:1", host_id="h",
                              out=_prefill_out({}, "LMCacheConnectorV1"), num_tokens=len(PROMPT),
                              block_size=BS, ttl_s=60, secret=SECRET)
    assert h["kv_transfer_params"] == {}
    assert import_from_handle(h, SECRET, "LMCacheConnectorV1").kv_transfer_params == {}


def _lmcache_tags(kv_transfer_params: dict[str, Any] | None) -> dict[str, Any]:
    """What LMCache's vLLM adapter makes of a request's kv_transfer_params: its `lmcache.tag.*` entries are
    part of every key it stores and looks up (its extract_request_configs and CacheEngineKey tags)."""
    return {k: v for k, v in (kv_transfer_params or {}).items() if k.startswith("lmcache.tag.")}


def test_lmcache_requests_are_scoped_by_their_tenants_salt():
    """LMCache's store is shared by every worker and keyed by tokens, not by vLLM's cache_salt: every salted
    request to it (aggregated, prefill-only, and the decode that pulls the prefill's KV) carries the salt as a
    tag, so two tenants with the same prompt never share an entry, and one tenant's stages agree."""
    a, b = "t-" + "a" * 32, "t-" + "b" * 32
    for kw in ({}, {"prefill_only": True}, {"imported": {}}):
        tags_a = _lmcache_tags(connector_params("LMCacheConnectorV1", a, **kw))
        tags_b = _lmcache_tags(connector_params("LMCacheConnectorV1", b, **kw))
        assert tags_a == {LMCACHE_TENANT_TAG: a} and tags_b == {LMCACHE_TENANT_TAG: b}, kw
    # prefill and decode of one tenant's request look up the same key
    assert (_lmcache_tags(connector_params("LMCacheConnectorV1", a, prefill_only=True))
            == _lmcache_tags(connector_params("LMCacheConnectorV1", a, imported={})))
    # nothing salted (a farm without keys): LMCache as before, aggregated requests ask nothing of it
    assert connector_params("LMCacheConnectorV1", "") is None
    assert connector_params("LMCacheConnectorV1", "", prefill_only=True) == {}
    # NIXL moves one request's own blocks, hashed with its salt by vLLM: its parameters are untouched
    assert connector_params("NixlConnector", a, prefill_only=True) == PREFILL_PARAMS["NixlConnector"]
    assert connector_params("NixlConnector", a, imported={"remote_block_ids": [1]}) == {"remote_block_ids": [1]}
    assert connector_params(None, a) is None


def test_lmcache_tag_reaches_vllms_request():
    """The tag travels as vLLM carries kv_transfer_params to a connector: in the SamplingParams' extra_args."""
    from vllm import SamplingParams as VllmSamplingParams  # `make test` installs vLLM

    salt = "t-" + "c" * 32
    p = SamplingParams(max_tokens=4)
    sp = VllmSamplingParams(**sampling_kwargs(p, 8, 64, kv_transfer_params=connector_params(
        "LMCacheConnectorV1", salt)))
    assert _lmcache_tags(sp.extra_args["kv_transfer_params"]) == {LMCACHE_TENANT_TAG: salt}


def test_builtin_handles_keep_their_signature():
    """The optional connector fields change nothing for the built-in engine's handles."""
    import hashlib as hl
    import hmac

    body = {k: 1 for k in SIGNED_FIELDS}
    body["expires_at"] = time.time() + 60
    h = sign_handle(body, SECRET)
    assert "connector" not in h and "kv_transfer_params" not in h
    canon = json.dumps({k: body[k] for k in SIGNED_FIELDS}, sort_keys=True, separators=(",", ":")).encode()
    assert h["sig"] == hmac.new(SECRET, canon, hl.sha256).hexdigest()
    assert verify_handle(h, SECRET) is h


def test_vllm_prefill_worker_needs_a_connector(tmp_path):
    cfg = _load(tmp_path, {"name": "big", "path": str(tmp_path), "backend": "vllm"})
    with pytest.raises(ValueError, match="kv_connector"):  # refused before any engine starts
        make_engine(cfg, cfg.model("big"), tmp_path, None, worker_id="p", role="prefill")


def test_model_config_type():
    assert ModelConfig(name="x", path="/m").backend == "builtin"
