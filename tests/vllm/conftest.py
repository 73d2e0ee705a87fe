"""Real vLLM (its CPU build, installed by `make vllm`) behind the farm, and `vllm serve` beside it.

Every engine here runs SmolLM2-135M-Instruct in fp32, eager (no torch.compile: a compiled start costs a
minute or more per engine on 2 cores, and these tests check behaviour, not speed), with the same KV block
size and KV budget, so outputs can be compared token for token.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from bench.peers.procs import vllm_server, wait_http
from farm.config import load_config
from farm.supervisor import Farm
from tests.conftest import free_port, make_farm_env

MODEL = "smol-vllm"
BLOCK_SIZE = 32
KV_CACHE_MB = 256
MAX_MODEL_LEN = 2048


@pytest.fixture(scope="session", autouse=True)
def vllm_installed() -> None:
    """These tests exist to run vLLM for real: without it they fail and say how to install it."""
    try:
        import vllm  # noqa: F401
    except ImportError as e:
        pytest.fail(f"vLLM is not installed ({e}); `make vllm` installs it (make test does)")


def farm_config(model_dir: Path, **vllm_options: Any) -> dict[str, Any]:
    """A farm configuration serving the prepared model through `backend: vllm`."""
    return {
        "default_model": MODEL,
        "engine": {"kv_cache_mb": KV_CACHE_MB},
        "semantic": {"enabled": False},
        "models": [{"name": MODEL, "path": str(model_dir), "max_model_len": MAX_MODEL_LEN, "backend": "vllm",
                    "block_size": BLOCK_SIZE, "tool_call_parser": "hermes",  # SmolLM2 is a ChatML model
                    "vllm": {"engine_args": {"enforce_eager": True}, **vllm_options}}],
    }


def write_config(tmp: Path, data: dict[str, Any]) -> Path:
    path = tmp / "farm-vllm.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@contextlib.contextmanager
def vllm_farm(tmp: Path, model_dir: Path, *, prefill: int = 0, decode: int = 0, both: int = 0,
              env: dict[str, str] | None = None, **vllm_options: Any) -> Iterator[Farm]:
    """A whole farm (its own managed Redis, the API, `backend: vllm` workers), healthy, stopped on exit."""
    farm_env = make_farm_env(f"redis://127.0.0.1:{free_port()}/0", tmp)  # the Farm starts this Redis
    farm_env["FARM_CONFIG"] = str(write_config(tmp, farm_config(model_dir, **vllm_options)))
    farm_env.update(env or {})
    cfg = load_config(environ=farm_env)
    child_env = {k: v for k, v in farm_env.items() if k != "FARM_CONFIG"}  # children read the resolved config
    with Farm(cfg, prefill=prefill, decode=decode, both=both, port=free_port(), flower=False, env=child_env,
              grace_s=60).running(600) as f:
        yield f


class VllmServe:
    """`vllm serve` (bench.peers.procs.vllm_server, as the benchmarks start it) with the farm's engine settings."""

    def __init__(self, model_dir: Path, log: Path, extra: list[str] | None = None):
        flags = ["--model", str(model_dir), "--served-model-name", MODEL, "--dtype", "float32",
                 "--max-model-len", str(MAX_MODEL_LEN), "--block-size", str(BLOCK_SIZE),
                 "--kv-cache-memory-bytes", str(KV_CACHE_MB * 2**20), "--enforce-eager", *(extra or [])]
        self.service, base = vllm_server("vllm-serve", flags, log)
        self.url = f"{base}/v1"

    def wait_ready(self, timeout: float = 600) -> VllmServe:
        """Once it answers; its log's tail in the error if it dies or never does."""
        wait_http(f"{self.url}/models", timeout, [self.service])
        return self

    def stop(self) -> None:
        self.service.stop(grace=30)


@pytest.fixture(scope="session")
def vllm_serve(tmp_path_factory, real_model_dir) -> Iterator[VllmServe]:
    """`vllm serve` on the same model and settings as the farm's vLLM workers (started once)."""
    tmp = tmp_path_factory.mktemp("vllm-serve")
    server = VllmServe(real_model_dir, tmp / "vllm-serve.log")
    try:
        yield server.wait_ready()
    finally:
        server.stop()
