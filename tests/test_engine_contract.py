"""Both engines satisfy the worker's engine interface, farm.engine.contract.ServingEngine, structurally: the
built-in Engine and the vLLM adapter have every member it names, each method with its parameters (names, kinds,
defaults), and a live instance of each passes the runtime-checkable isinstance. The vLLM adapter is built here
over a stand-in for vLLM's AsyncLLM (no model runs), so the check needs no vLLM engine."""

from __future__ import annotations

import inspect
from types import SimpleNamespace
from typing import Any

import pytest
import yaml

from farm.backends import make_engine
from farm.backends.vllm import VllmEngine
from farm.config import EngineConfig, load_config
from farm.engine.contract import BlockCount, BlockReader, ConnectorEngine, ServingEngine
from farm.engine.engine import Engine


def _methods(proto: type) -> set[str]:
    """The methods a protocol of farm.engine.contract names, its bases' included (properties are members, not
    methods: the isinstance checks below cover them)."""
    return {n for base in proto.__mro__ if base.__module__ == proto.__module__
            for n, v in vars(base).items() if not n.startswith("_") and callable(v)}


def _params(fn: Any) -> list[tuple[str, Any, Any]]:
    """A method's parameters after `self`: name, kind (positional, keyword-only, ...) and default."""
    return [(p.name, p.kind, p.default) for p in list(inspect.signature(fn).parameters.values())[1:]]


def test_the_contract_names_what_the_worker_uses():
    assert _methods(ServingEngine) == {"start", "stop", "submit", "abort", "release_held", "active_request_ids",
                                       "stats"}
    assert _methods(ConnectorEngine) == _methods(ServingEngine) | {"connector_handle"}


@pytest.mark.parametrize("cls, proto", [(Engine, ServingEngine), (VllmEngine, ConnectorEngine)])
def test_each_engine_has_every_method_with_the_contracts_parameters(cls, proto):
    for name in sorted(_methods(proto)):
        assert _params(getattr(cls, name)) == _params(getattr(proto, name)), f"{cls.__name__}.{name}"


@pytest.fixture
def builtin_engine(tiny_model_dir):
    eng = Engine(tiny_model_dir, EngineConfig(kv_cache_mb=16, kv_tiers={"host_mb": 0, "disk_mb": 0}),
                 max_model_len=512)
    yield eng
    eng.stop()


def test_the_builtin_engine_is_a_serving_engine(builtin_engine):
    assert isinstance(builtin_engine, Engine) and isinstance(builtin_engine, ServingEngine)
    assert not isinstance(builtin_engine, ConnectorEngine)  # its KV moves through the farm's transfer server
    assert isinstance(builtin_engine.runner, BlockReader) and isinstance(builtin_engine.pool, BlockCount)
    assert builtin_engine.start() is builtin_engine and set(builtin_engine.stats()) >= {"running", "waiting"}


class _StandInLLM:
    """What VllmEngine asks of vLLM's AsyncLLM before a request arrives."""

    vllm_config = SimpleNamespace(cache_config=SimpleNamespace(num_gpu_blocks=64))

    def shutdown(self) -> None:
        pass

    def get_num_unfinished_requests(self) -> int:
        return 0


def _stand_in_vllm() -> SimpleNamespace:
    """The names farm.backends.vllm_args.import_vllm returns, enough to build the adapter."""
    return SimpleNamespace(AsyncEngineArgs=lambda **kw: SimpleNamespace(**kw),
                           AsyncLLM=SimpleNamespace(from_engine_args=lambda *_a, **_k: _StandInLLM()),
                           KVEventsConfig=lambda **kw: kw, KVTransferConfig=lambda **kw: kw)


def test_the_vllm_adapter_is_a_serving_engine_with_a_connector(tmp_path, monkeypatch):
    monkeypatch.setattr("farm.backends.vllm._platform_device", lambda: "cpu")
    monkeypatch.setattr("farm.backends.vllm.import_vllm", lambda model="": _stand_in_vllm())
    monkeypatch.setenv("VLLM_USE_AOT_COMPILE", "0")  # what the adapter sets on CPUs, undone after the test
    base = load_config(environ={})
    entry = {"name": "v", "path": str(tmp_path), "backend": "vllm"}
    f = tmp_path / "farm.yaml"
    f.write_text(yaml.safe_dump({"models": [base.model(base.default_model).model_dump(exclude_none=True), entry]}))
    cfg = load_config(f, environ={})
    eng = make_engine(cfg, cfg.model("v"), tmp_path, None, worker_id="w", role="both")  # no vLLM: a stand-in
    try:
        assert isinstance(eng, VllmEngine) and isinstance(eng, ServingEngine) and isinstance(eng, ConnectorEngine)
        assert isinstance(eng.runner, BlockReader) and isinstance(eng.pool, BlockCount)
        assert eng.connector is None and eng.pool.num_blocks == 64 and eng.held == {}
        assert eng.start() is eng and eng.stats()["backend"] == "vllm" and eng.active_request_ids() == []
    finally:
        eng.stop()
