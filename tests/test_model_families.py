"""Any Hugging Face causal-LM directory of the supported families runs on the engine's paged attention
with the same logits as transformers' own forward (tiny random models of each family)."""

from __future__ import annotations

import shutil

import pytest
import torch

from farm.engine.model_runner import ModelRunner, PrefillChunk

FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": None}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16}),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_prefill_and_decode_logits_match_transformers(family, tmp_path, real_model_dir):
    import transformers

    cfg_name, model_name, extra = FAMILIES[family]
    config = getattr(transformers, cfg_name)(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False, **extra)
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(config).eval()
    model.save_pretrained(tmp_path)
    for f in real_model_dir.glob("tokenizer*"):
        shutil.copy(f, tmp_path / f.name)
    runner = ModelRunner(tmp_path, block_size=4, kv_cache_bytes=8 * 2**20)
    ids = list(range(200, 237))
    table = list(range(10))
    with torch.inference_mode():
        ref = model(torch.tensor([ids + [7]])).logits[0]
    # prefix in two chunks (the second reads the first from the paged cache), then one decode step
    runner.prefill([PrefillChunk(ids[:16], 0, table)])
    got = runner.prefill([PrefillChunk(ids[16:], 16, table)])[0]
    torch.testing.assert_close(got, ref[len(ids) - 1], atol=1e-4, rtol=1e-4)
    step = runner.decode([7], [len(ids)], [table])[0]
    torch.testing.assert_close(step, ref[len(ids)], atol=1e-4, rtol=1e-4)


def test_unsupported_family_is_a_clear_error(tmp_path):
    import transformers

    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=100)
    transformers.GPT2LMHeadModel(config).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="not supported by the built-in engine"):
        ModelRunner(tmp_path, block_size=4, kv_cache_bytes=2**20)
