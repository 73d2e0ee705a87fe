"""`farm serve` with the flags a `vllm serve` user types (README, "farm serve for vllm serve users"): each lands
where the farm keeps it (api, engine, the model entry, its vllm.engine_args), and a flag the model's engine cannot
honour fails with a message that says why, never ignored. Unit level: the parser and serve_config, no farm runs."""

from __future__ import annotations

import hashlib
import json

import pytest

from farm.cli.main import build_parser, main, serve_config
from farm.config import ConfigError, load_config

KEY = "sk-serve-flags-0123456789"


@pytest.fixture
def cfg(tmp_path, monkeypatch):
    monkeypatch.delenv("FARM_API_KEYS", raising=False)
    return load_config(environ={"FARM_STATE_DIR": str(tmp_path / "state")})


@pytest.fixture
def hf_dir(tmp_path):
    """A Hugging Face model directory as far as `farm serve DIR` looks (config.json); nothing is loaded."""
    d = tmp_path / "Tiny-Model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "llama"}))
    return d


def serve(cfg, *argv: str):
    return serve_config(cfg, build_parser().parse_args(["serve", *argv]))


def parse_error(capsys, *argv: str) -> str:
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["serve", *argv])
    assert e.value.code == 2
    return capsys.readouterr().err


def refused(cfg, *argv: str) -> str:
    with pytest.raises(ConfigError) as e:
        serve(cfg, *argv)
    return str(e.value)


# -- the API: --host, --port, --api-key -----------------------------------------------------------------------
def test_host_port_and_api_key_land_in_the_api_section(cfg):
    out = serve(cfg, cfg.default_model, "--host", "0.0.0.0", "--port", "9001", "--api-key", KEY)
    assert (out.api.host, out.api.port) == ("0.0.0.0", 9001)
    digest = "sha256:" + hashlib.sha256(KEY.encode()).hexdigest()
    assert out.api.api_keys == [*cfg.api.api_keys, digest], "only the key's digest is configured"
    assert KEY not in out.model_dump_json()
    two = serve(cfg, cfg.default_model, "--api-key", "a", "--api-key", "b")
    assert len(two.api.api_keys) == len(cfg.api.api_keys) + 2
    plain = serve(cfg, cfg.default_model)
    assert plain.api.host == "127.0.0.1" and plain.api.host == cfg.api.host, "the default stays loopback"


def test_api_key_reaches_no_child_command_line_nor_environment(cfg):
    from farm.supervisor import Farm
    from farm.tenancy.api_keys import KeyRing

    args = build_parser().parse_args(["serve", cfg.default_model, "--host", "0.0.0.0", "--api-key", KEY,
                                      "--workers", "1", "--no-flower"])
    out = serve_config(cfg, args)
    farm = Farm.from_flags(out, args)  # builds the farm (nothing starts): a keyed non-loopback API is allowed
    assert farm.api_host == "0.0.0.0"
    assert KeyRing.from_config(out, environ={}).owner(KEY), "the API accepts the key"
    assert KEY not in " ".join(farm.child_env().values()), "children get it through no environment variable"
    resolved = farm._write_resolved_config().read_text()  # the FARM_CONFIG every child reads
    assert KEY not in resolved and hashlib.sha256(KEY.encode()).hexdigest() in resolved


def test_a_non_loopback_host_without_a_key_is_refused(cfg, capsys):
    from farm.supervisor import Farm

    args = build_parser().parse_args(["serve", cfg.default_model, "--host", "0.0.0.0"])
    with pytest.raises(ConfigError, match="no API key is set: set FARM_API_KEYS"):
        Farm.from_flags(serve_config(cfg, args), args)
    assert "is not a host name" in parse_error(capsys, "m", "--host", "bad host")
    assert "not in [1, 65535]" in parse_error(capsys, "m", "--port", "70000")
    assert "must not be empty" in parse_error(capsys, "m", "--api-key", " ")


# -- the engine: --dtype, --max-num-seqs, --max-model-len -------------------------------------------------------
@pytest.mark.parametrize("flag, dtype", [("half", "float16"), ("float16", "float16"), ("bfloat16", "bfloat16"),
                                         ("float", "float32"), ("float32", "float32"), ("auto", "auto")])
def test_dtype_goes_to_engine_dtype_with_vllms_aliases(cfg, flag, dtype):
    assert serve(cfg, cfg.default_model, "--dtype", flag).engine.dtype == dtype


def test_dtype_reaches_vllm_workers_engine_args(cfg, hf_dir):
    from farm.backends.vllm_args import build_engine_args

    out = serve(cfg, str(hf_dir), "--backend", "vllm", "--dtype", "bfloat16")
    args = build_engine_args(out, out.models[0], hf_dir, "tcp://127.0.0.1:1", None)
    assert args["dtype"] == "bfloat16"


def test_max_num_seqs_and_max_model_len(cfg, hf_dir, capsys):
    out = serve(cfg, cfg.default_model, "--max-num-seqs", "8", "--max-model-len", "1024")
    assert out.engine.max_num_seqs == 8 and out.models[0].max_model_len == 1024
    v = serve(cfg, str(hf_dir), "--backend", "vllm", "--max-num-seqs", "8", "--max-model-len", "2048")
    assert v.models[0].vllm.engine_args == {"max_num_seqs": 8} and v.models[0].max_model_len == 2048
    assert v.engine.max_num_seqs == cfg.engine.max_num_seqs, "the built-in engine's setting is left alone"
    assert "is below 1" in parse_error(capsys, "m", "--max-num-seqs", "0")
    assert "invalid choice" in parse_error(capsys, "m", "--dtype", "fp8")
    assert "max_model_len" in refused(cfg, cfg.default_model, "--max-model-len", "8")


# -- vLLM's engine flags: into vllm.engine_args, or refused by the built-in engine --------------------------------
def test_vllm_engine_flags_land_in_engine_args(cfg, hf_dir):
    out = serve(cfg, str(hf_dir), "--backend", "vllm", "--tensor-parallel-size", "2",
                "--gpu-memory-utilization", "0.8", "--trust-remote-code", "--seed", "7")
    m = out.models[0]
    assert m.backend == "vllm" and m.vllm.engine_args == {
        "tensor_parallel_size": 2, "gpu_memory_utilization": 0.8, "trust_remote_code": True, "seed": 7}
    assert m.trust_remote_code, "the API loads the tokenizer with the model's code too, as vLLM does"
    assert serve(cfg, str(hf_dir), "--backend", "vllm", "-tp", "4").models[0].vllm.engine_args == {
        "tensor_parallel_size": 4}


def test_vllm_engine_flags_merge_with_a_configured_entrys_engine_args(tmp_path, monkeypatch):
    monkeypatch.delenv("FARM_API_KEYS", raising=False)
    override = tmp_path / "farm.yaml"
    override.write_text("models:\n  - name: big\n    path: /models/big\n    backend: vllm\n"
                        "    vllm: {engine_args: {enforce_eager: true}}\ndefault_model: big\n")
    cfg = load_config(override, environ={"FARM_STATE_DIR": str(tmp_path / "state")})
    out = serve(cfg, "big", "--seed", "3", "--served-model-name", "big-v2")
    assert out.models[0].vllm.engine_args == {"enforce_eager": True, "seed": 3}
    assert out.default_model == out.models[0].name == "big-v2"


@pytest.mark.parametrize("argv, why", [
    (["--tensor-parallel-size", "2"], "no tensor parallelism"),
    (["--gpu-memory-utilization", "0.9"], "engine.kv_cache_mb"),
    (["--trust-remote-code"], "never a model's own code"),
    (["--seed", "1"], "a request's `seed`"),
])
def test_the_builtin_engine_refuses_what_it_cannot_honour(cfg, argv, why):
    msg = refused(cfg, cfg.default_model, *argv)
    assert why in msg and "--backend vllm" in msg and argv[0] in msg


def test_tensor_parallel_size_1_is_what_the_builtin_engine_does(cfg):
    out = serve(cfg, cfg.default_model, "--tensor-parallel-size", "1")
    assert out.models[0].vllm is None


def test_engine_flag_ranges(capsys):
    assert "not in (0, 1]" in parse_error(capsys, "m", "--gpu-memory-utilization", "1.5")
    assert "not in (0, 1]" in parse_error(capsys, "m", "--gpu-memory-utilization", "0")
    assert "is below 1" in parse_error(capsys, "m", "--tensor-parallel-size", "0")
    assert "invalid int" in parse_error(capsys, "m", "--seed", "x")


# -- the model entry: --served-model-name, --chat-template, --generation-config ----------------------------------
def test_served_model_name_renames_a_configured_model_and_a_directory(cfg, hf_dir):
    out = serve(cfg, cfg.default_model, "--served-model-name", "my-model")
    assert [m.name for m in out.models] == ["my-model"] and out.default_model == "my-model"
    assert serve(cfg, str(hf_dir)).models[0].name == "Tiny-Model"
    assert serve(cfg, str(hf_dir), "--served-model-name", "tiny").models[0].name == "tiny"
    assert "models.0.name" in refused(cfg, str(hf_dir), "--served-model-name", "no spaces")


TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"


def test_chat_template_from_a_file_or_inline(cfg, tmp_path):
    f = tmp_path / "template.jinja"
    f.write_text(TEMPLATE)
    assert serve(cfg, cfg.default_model, "--chat-template", str(f)).models[0].chat_template == TEMPLATE
    assert serve(cfg, cfg.default_model, "--chat-template", TEMPLATE).models[0].chat_template == TEMPLATE
    assert serve(cfg, cfg.default_model).models[0].chat_template is None, "default: the model's own"
    assert "no file and not a Jinja template" in refused(cfg, cfg.default_model, "--chat-template", "missing.jinja")
    bad = refused(cfg, cfg.default_model, "--chat-template", "{% for m in messages %}")
    assert "not a valid Jinja template" in bad


def test_the_api_renders_chats_with_the_given_template(cfg, hf_dir, monkeypatch):
    """get_tokenizer hands the API the entry's template in place of the tokenizer's own."""
    from farm.models import tokenization

    class Tok:
        chat_template = "the model's"

    loads = []

    def fake_from_pretrained(path, **kw):
        loads.append((path, kw))
        return Tok()

    import transformers

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", fake_from_pretrained)
    tokenization._load.cache_clear()
    try:
        out = serve(cfg, str(hf_dir), "--backend", "vllm", "--chat-template", TEMPLATE, "--trust-remote-code")
        tok = tokenization.get_tokenizer(out, out.default_model)
        assert tok.chat_template == TEMPLATE and loads == [(str(hf_dir), {"trust_remote_code": True})]
        plain = serve(cfg, str(hf_dir))
        assert tokenization.get_tokenizer(plain, plain.default_model).chat_template == "the model's"
        assert loads[-1] == (str(hf_dir), {})
    finally:
        tokenization._load.cache_clear()


def test_generation_config(cfg, hf_dir, tmp_path):
    base = serve(cfg, str(hf_dir)).models[0].defaults
    assert serve(cfg, str(hf_dir), "--generation-config", "vllm").models[0].defaults == base
    assert serve(cfg, str(hf_dir), "--generation-config", "auto").models[0].defaults == base, \
        "no generation_config.json: neutral defaults, as vLLM"
    (hf_dir / "generation_config.json").write_text(json.dumps({
        "temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05, "max_new_tokens": 256,
        "eos_token_id": 2, "do_sample": True}))
    d = serve(cfg, str(hf_dir), "--generation-config", "auto").models[0].defaults
    assert (d.temperature, d.top_p, d.top_k, d.repetition_penalty, d.max_tokens) == (0.7, 0.8, 20, 1.05, 256)
    assert (d.min_p, d.presence_penalty, d.frequency_penalty) == (0.0, 0.0, 0.0)
    assert serve(cfg, str(hf_dir)).models[0].defaults == d, "without the flag: auto, vLLM's default"
    assert serve(cfg, str(hf_dir), "--generation-config", "vllm").models[0].defaults == base
    other = tmp_path / "gen"
    other.mkdir()
    (other / "generation_config.json").write_text(json.dumps({"temperature": 0.2, "min_p": 0.05}))
    d = serve(cfg, str(hf_dir), "--generation-config", str(other)).models[0].defaults
    assert (d.temperature, d.min_p, d.top_k) == (0.2, 0.05, 0)
    assert "no generation_config.json" in refused(cfg, str(hf_dir), "--generation-config", str(tmp_path / "none"))
    (other / "generation_config.json").write_text(json.dumps({"temperature": 3.5}))
    assert "defaults.temperature" in refused(cfg, str(hf_dir), "--generation-config", str(other)), \
        "a value the farm's requests could not carry either"
    (other / "generation_config.json").write_text("{not json")
    assert "not a valid generation config" in refused(cfg, str(hf_dir), "--generation-config", str(other))


def test_the_bundled_model_samples_as_its_card_recommends_unless_told_vllm(cfg):
    bundled = serve(cfg, cfg.default_model).models[0].defaults
    assert (bundled.temperature, bundled.top_p) == (0.2, 0.9), "SmolLM2's model card: temperature 0.2, top_p 0.9"
    neutral = serve(cfg, cfg.default_model, "--generation-config", "vllm").models[0].defaults
    assert (neutral.temperature, neutral.top_p, neutral.max_tokens) == (1.0, 1.0, None)
    precise = serve(cfg, "SmolLM2-135M-Instruct-precise").models[0].defaults
    assert (precise.temperature, precise.max_tokens) == (0.0, 512), "a configured entry keeps its own"


def test_generation_defaults_apply_to_requests_that_leave_them_out(cfg, hf_dir):
    from farm.openai.parsing import _common

    (hf_dir / "generation_config.json").write_text(json.dumps({
        "temperature": 0.7, "top_k": 20, "min_p": 0.1, "repetition_penalty": 1.05, "presence_penalty": 0.5,
        "frequency_penalty": 0.25, "max_new_tokens": 64}))
    defaults = serve(cfg, str(hf_dir), "--generation-config", "auto").models[0].defaults
    p, *_ = _common({}, 10, 1000, "prompt", defaults)
    assert (p.temperature, p.top_k, p.min_p, p.repetition_penalty, p.presence_penalty, p.frequency_penalty,
            p.max_tokens) == (0.7, 20, 0.1, 1.05, 0.5, 0.25, 64)
    p, *_ = _common({"top_k": 5, "repetition_penalty": 1.0, "temperature": 0}, 10, 1000, "prompt", defaults)
    assert (p.top_k, p.repetition_penalty, p.temperature) == (5, 1.0, 0.0), "the request's own values win"


# -- tool calling: vLLM's two flags -----------------------------------------------------------------------------
def test_tool_calling_flags_set_the_models_parser(cfg, hf_dir, capsys, tmp_path, monkeypatch):
    assert serve(cfg, str(hf_dir)).models[0].tool_call_parser is None  # a model from a path: auto needs the flags
    on = serve(cfg, str(hf_dir), "--enable-auto-tool-choice", "--tool-call-parser", "llama3_json")
    assert on.models[0].tool_call_parser == "llama3_json"
    assert serve(cfg, cfg.default_model).models[0].tool_call_parser == cfg.model(cfg.default_model).tool_call_parser
    assert serve(cfg, cfg.default_model, "--tool-call-parser", "hermes").models[0].tool_call_parser is None, \
        "as in vLLM, a parser without --enable-auto-tool-choice does not enable auto"
    assert "needs --tool-call-parser" in refused(cfg, str(hf_dir), "--enable-auto-tool-choice")
    assert "hermes, llama3_json" in refused(cfg, str(hf_dir), "--enable-auto-tool-choice", "--tool-call-parser",
                                            "pythonic")
    monkeypatch.setenv("FARM_STATE_DIR", str(tmp_path / "state"))
    assert main(["serve", cfg.default_model, "--enable-auto-tool-choice"]) == 2
    assert "needs --tool-call-parser" in capsys.readouterr().err


def test_reasoning_parser_flag(cfg, hf_dir, capsys):
    assert serve(cfg, str(hf_dir), "--reasoning-parser", "qwen3").models[0].reasoning_parser == "qwen3"
    assert serve(cfg, str(hf_dir)).models[0].reasoning_parser is None
    assert "invalid choice: 'granite'" in parse_error(capsys, str(hf_dir), "--reasoning-parser", "granite")


def test_refusals_exit_2_from_the_command_line(cfg, capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("FARM_STATE_DIR", str(tmp_path / "state"))
    assert main(["serve", cfg.default_model, "--gpu-memory-utilization", "0.5"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("farm: farm serve: --gpu-memory-utilization") and "engine.kv_cache_mb" in err
