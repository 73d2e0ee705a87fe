"""The bench's model, made at run time and never committed: SmolLM2's tokenizer and chat template on a tiny
random Llama (2 layers, hidden 128), so a decode step costs next to nothing on a CPU, as it does on a GPU, and
what is left to measure is the serving path around the engine.

The directory has a fixed name under the system temp folder (rebuilt at every run, byte-identical: seeded
weights): vLLM's compile cache is keyed on the model's path, so a fresh random folder each run would compile
the model again at every start (1-2 minutes each on this machine).
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

TOKENIZER_PREFIXES = ("tokenizer", "chat_template", "special_tokens", "generation_config")
DEFAULT_DIR = Path(tempfile.gettempdir()) / "farm-engine-speed-tiny-llama"


def tiny_config():  # noqa: ANN201 - transformers.LlamaConfig, imported lazily
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=49152, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                       bos_token_id=1, eos_token_id=2, tie_word_embeddings=True)


def source_tokenizer_dir() -> Path:
    """The prepared default model's directory (SmolLM2-135M-Instruct): where the tokenizer files come from."""
    from bench.engine_speed.farm_api import require_model_dir
    from farm.config import load_config

    cfg = load_config(environ={})
    return require_model_dir(cfg, cfg.model(cfg.default_model))


def make_tiny_model(out: Path = DEFAULT_DIR) -> Path:
    """Write the tiny model (fp32 safetensors, seed 0) and the default model's tokenizer files into `out`."""
    import torch
    from transformers import LlamaForCausalLM

    src = source_tokenizer_dir()
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    torch.manual_seed(0)
    LlamaForCausalLM(tiny_config()).save_pretrained(tmp)
    copied = [f.name for f in sorted(src.iterdir()) if f.is_file() and f.name.startswith(TOKENIZER_PREFIXES)]
    if not any(name.startswith("tokenizer") for name in copied):
        raise RuntimeError(f"no tokenizer files in {src}")
    for name in copied:
        shutil.copy2(src / name, tmp / name)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def make_tiny_classifier(out: Path, tokenizer_dir: Path, labels: tuple[str, ...] = ("benign", "jailbreak")) -> Path:
    """The same tiny random Llama as a sequence classifier over `labels` (seed 0), for a prompt guard served by
    `vllm serve --runner pooling` or a `transformers` pipeline: its verdicts mean nothing, its cost is a guard's
    path around the model (bench.remote_guard, tests/vllm/test_vllm_remote_guard.py)."""
    import torch
    from transformers import LlamaForSequenceClassification

    cfg = tiny_config()  # head_dim 32: vLLM's CPU attention has no kernel for 16
    cfg.num_labels = len(labels)
    cfg.id2label = dict(enumerate(labels))
    cfg.label2id = {x: i for i, x in enumerate(labels)}
    cfg.pad_token_id = cfg.eos_token_id
    cfg.initializer_range = 0.5  # spread the random verdicts, so prompts get told apart
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    LlamaForSequenceClassification(cfg).save_pretrained(out)
    for f in tokenizer_dir.iterdir():
        if f.is_file() and f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy2(f, out / f.name)
    return out


def describe(model_dir: Path) -> dict[str, object]:
    """What the JSON records about the model: its folder, files and parameter count."""
    import json

    cfg = json.loads((model_dir / "config.json").read_text())
    return {"dir": str(model_dir), "files": sorted(p.name for p in model_dir.iterdir()),
            "tokenizer_from": str(source_tokenizer_dir()),
            "config": {k: cfg.get(k) for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                               "num_attention_heads", "num_key_value_heads", "torch_dtype", "dtype")}}
