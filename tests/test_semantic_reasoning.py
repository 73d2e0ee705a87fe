"""The category's reasoning mode reaches the chat template of models whose template reads `enable_thinking`
(Qwen3's switch), and the response says when it could not (issue 15). The API applies chat templates for
every backend (vLLM models included), so `parse_chat` with the layer's template variables is the one path.

The thinking template is a minimal Jinja template written into a copy of the default model's tokenizer
(the same behaviour as Qwen3's: with thinking off, the generation prompt gets an empty think block)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from api.semantic import reasoning_template_kwargs
from farm.models.tokenization import _load, chat_prompt_ids, template_reads
from farm.openai.parsing import parse_chat
from farm.semantic.layer import SemanticLayer, Verdict

THINKING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}")
MESSAGES = [{"role": "user", "content": "Solve 3x = 12"}]


@pytest.fixture(scope="module")
def thinking_tokenizer(tmp_path_factory, real_model_dir: Path):
    out = tmp_path_factory.mktemp("thinking-tokenizer")
    for f in real_model_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, out / f.name)
    cfg = json.loads((out / "tokenizer_config.json").read_text())
    cfg["chat_template"] = THINKING_TEMPLATE
    (out / "tokenizer_config.json").write_text(json.dumps(cfg))
    return _load(str(out))


@pytest.fixture(scope="module")
def plain_tokenizer(real_model_dir: Path):
    return _load(str(real_model_dir))


def verdict(reasoning: bool | None) -> Verdict:
    return Verdict("forward", "m", MESSAGES, {}, reasoning=reasoning)


def test_template_reads_the_variable(thinking_tokenizer, plain_tokenizer):
    assert template_reads(thinking_tokenizer, "enable_thinking")
    assert not template_reads(plain_tokenizer, "enable_thinking")  # SmolLM2's template has no switch


def test_the_switch_changes_the_prompt(thinking_tokenizer):
    on = thinking_tokenizer.decode(chat_prompt_ids(thinking_tokenizer, MESSAGES, {"enable_thinking": True}))
    off = thinking_tokenizer.decode(chat_prompt_ids(thinking_tokenizer, MESSAGES, {"enable_thinking": False}))
    assert on.endswith("<|im_start|>assistant\n") and off.endswith("<think>\n\n</think>\n\n")


@pytest.mark.parametrize("reasoning", [True, False])
def test_category_reasoning_reaches_a_template_that_reads_it(thinking_tokenizer, reasoning):
    v = verdict(reasoning)
    kwargs = reasoning_template_kwargs(v, thinking_tokenizer)
    assert kwargs == {"enable_thinking": reasoning} and v.headers["x-vsr-reasoning-applied"] == "true"
    parsed = parse_chat({"model": "m", "messages": MESSAGES}, thinking_tokenizer, 4096, MESSAGES,
                        template_kwargs=kwargs)
    text = thinking_tokenizer.decode(parsed.prompt_ids)
    assert text.endswith("</think>\n\n") is (not reasoning)


def test_a_template_without_the_switch_says_it_was_not_applied(plain_tokenizer):
    v = verdict(True)
    assert reasoning_template_kwargs(v, plain_tokenizer) == {}
    assert v.headers["x-vsr-reasoning-applied"] == "false"
    untouched = verdict(None)  # no category decided (explicit model): nothing passed, nothing claimed
    assert reasoning_template_kwargs(untouched, plain_tokenizer) == {} and untouched.headers == {}


def test_the_layer_decides_per_category(tmp_path, redis_url, redis_client):
    """Default config: math reasons, history does not; an explicit model name decides nothing."""
    import yaml

    from farm.config import load_config
    from farm.semantic.embeddings import get_embedder

    p = tmp_path / "c.yaml"
    p.write_text(yaml.safe_dump({"redis": {"url": redis_url}}))
    layer = SemanticLayer.from_config(load_config(p, environ={}), embedder=get_embedder(threads=2))
    math = layer.before("MoM", [{"role": "user", "content": "Solve for x: 2x + 6 = 10"}], no_cache=True)
    assert math.reasoning is True and math.headers["x-vsr-selected-reasoning"] == "on"
    hist = layer.before("MoM", [{"role": "user", "content": "What were the causes of the French Revolution?"}],
                        no_cache=True)
    assert hist.category == "history" and hist.reasoning is False and hist.headers["x-vsr-selected-reasoning"] == "off"
    explicit = layer.before("SmolLM2-135M-Instruct", [{"role": "user", "content": "Solve for x: 2x + 6 = 10"}],
                            no_cache=True)
    assert explicit.reasoning is None and "x-vsr-selected-reasoning" not in explicit.headers
