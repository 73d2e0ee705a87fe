"""Configuration: validated with clear errors, overridable by file and environment; model paths."""

from __future__ import annotations

import pytest

from farm.config import ConfigError, load_config
from farm.models.directories import ModelNotFoundError, require_model_dir


def test_defaults_load_and_env_overrides_apply():
    cfg = load_config(environ={"FARM_API__PORT": "9123", "FARM_ROUTER__MODE": "random",
                               "FARM_ENGINE__KV_TIERS__HOST_MB": "64"})
    assert cfg.api.port == 9123 and cfg.router.mode == "random" and cfg.engine.kv_tiers.host_mb == 64
    assert cfg.default_model in [m.name for m in cfg.models]


@pytest.mark.parametrize("env,needle", [
    ({"FARM_API__PORT": "abc"}, "api.port"),
    ({"FARM_ROUTER__MODE": "fastest"}, "router.mode"),
    ({"FARM_ENGINE__BLOCK_SIZE": "0"}, "engine.block_size"),
    ({"FARM_API__TYPO": "1"}, "api.typo"),
    ({"FARM_CELERY__MAX_REQUEST_S": "99999"}, "visibility_timeout"),
])
def test_invalid_values_name_the_key(env, needle):
    with pytest.raises(ConfigError) as e:
        load_config(environ=env)
    assert needle in str(e.value) and "invalid farm configuration" in str(e.value)


def test_override_file_errors(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("default_model: nope\n")
    with pytest.raises(ConfigError, match="default_model 'nope' is not one of the models"):
        load_config(bad, environ={})
    (tmp_path / "broken.yaml").write_text("api: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(tmp_path / "broken.yaml", environ={})
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.yaml", environ={})
    both = tmp_path / "both.yaml"
    both.write_text("models:\n  - {name: m, source: 'builtin:smollm2', path: /x}\ndefault_model: m\n")
    with pytest.raises(ConfigError, match="exactly one of"):
        load_config(both, environ={})


def test_missing_model_directory_is_named(tmp_path):
    f = tmp_path / "farm.yaml"
    f.write_text(f"models:\n  - {{name: mine, path: {tmp_path / 'no-such-model'}}}\ndefault_model: mine\n")
    cfg = load_config(f, environ={})
    with pytest.raises(ModelNotFoundError, match=str(tmp_path / "no-such-model")):
        require_model_dir(cfg, cfg.model("mine"))
