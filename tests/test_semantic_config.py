"""The `semantic` config section: defaults work, mistakes are reported with the key that is wrong."""

from __future__ import annotations

import pytest
import yaml

from farm.config import ConfigError, load_config
from farm.config.semantic import MMLU_PRO_CATEGORIES, PIIConfig


def _load(tmp_path, override: dict, env: dict | None = None):
    p = tmp_path / "override.yaml"
    p.write_text(yaml.safe_dump(override))
    return load_config(p, environ=env or {})


def test_defaults_out_of_the_box():
    cfg = load_config(environ={})
    s = cfg.semantic
    assert s.enabled and s.jailbreak.enabled and s.pii.enabled and s.cache.enabled
    assert s.cache.backend == "redis"
    assert sorted(c.name for c in s.categories) == sorted(MMLU_PRO_CATEGORIES)
    assert {"MoM", "auto"} <= set(s.aliases)
    # the default policy refuses identity data (the seed's SSN request) and reports contacts and names
    assert s.pii.policy(cfg.default_model).violations({"US_SSN", "EMAIL_ADDRESS", "PERSON"}) == {"US_SSN"}
    assert s.pii.default_policy == PIIConfig().default_policy  # config/default.yaml says what the code says
    for c in s.categories:
        assert set(c.model_scores) <= {m.name for m in cfg.models}


def test_unknown_model_in_scores(tmp_path):
    cats = [{"name": "math", "model_scores": {"NoSuchModel": 0.9}}]
    with pytest.raises(ConfigError, match=r"semantic.categories\[math\].model_scores names unknown models \['NoSuchModel'\]"):
        _load(tmp_path, {"semantic": {"categories": cats}})


def test_unknown_category(tmp_path):
    with pytest.raises(ConfigError, match="not categories the classifier knows"):
        _load(tmp_path, {"semantic": {"categories": [{"name": "astrology"}]}})


def test_duplicate_category(tmp_path):
    with pytest.raises(ConfigError, match="duplicate names"):
        _load(tmp_path, {"semantic": {"categories": [{"name": "math"}, {"name": "math"}]}})


def test_an_overrides_categories_join_the_built_in_ones(tmp_path):
    """What the README's example of a category of your own does: the 14 built-in categories stay, with their
    system prompts and scores; a built-in name replaces that category where it stands; a new name is added."""
    default = load_config(environ={}).semantic
    cooking = {"name": "cooking", "description": "Cooking and recipes.", "examples": ["How do I poach an egg?"],
               "model_scores": {"SmolLM2-135M-Instruct": 0.9}}
    math = {"name": "math", "system_prompt": "Give the number only.", "model_scores": {"SmolLM2-135M-Instruct": 1.0}}
    s = _load(tmp_path, {"semantic": {"categories": [cooking, math]}}).semantic
    assert [c.name for c in s.categories] == [c.name for c in default.categories] + ["cooking"]
    assert s.category("math").system_prompt == "Give the number only."
    assert s.category("biology") == default.category("biology")
    assert [c.name for c in s.custom_categories] == ["cooking"]
    only = _load(tmp_path, {"semantic": {"builtin_categories": False, "categories": [cooking, math]}}).semantic
    assert [c.name for c in only.categories] == ["cooking", "math"]  # the override's list is the whole list


def test_built_in_scores_for_models_an_override_does_not_serve_are_dropped(tmp_path):
    """An override serving other models keeps the built-in categories without their scores for the models it no
    longer has; the categories it writes itself are checked strictly."""
    models = [{"name": "other", "source": "builtin:smollm2"}]
    cooking = {"name": "cooking", "description": "Cooking and recipes.", "model_scores": {"other": 0.9}}
    s = _load(tmp_path, {"models": models, "default_model": "other", "semantic": {"categories": [cooking]}}).semantic
    assert s.category("biology").model_scores == {} and s.category("cooking").model_scores == {"other": 0.9}
    with pytest.raises(ConfigError, match=r"semantic.categories\[cooking\].model_scores names unknown models"):
        _load(tmp_path, {"models": models, "default_model": "other",
                         "semantic": {"categories": [{**cooking, "model_scores": {"SmolLM2-135M-Instruct": 0.9}}]}})


def test_bad_values_name_the_key(tmp_path):
    with pytest.raises(ConfigError, match=r"semantic.jailbreak.threshold"):
        _load(tmp_path, {"semantic": {"jailbreak": {"threshold": 1.5}}})
    with pytest.raises(ConfigError, match=r"semantic.cache.backend"):
        load_config(environ={"FARM_SEMANTIC__CACHE__BACKEND": "memcached"})
    with pytest.raises(ConfigError, match=r"semantic.cache.similarity_threshold"):
        load_config(environ={"FARM_SEMANTIC__CACHE__SIMILARITY_THRESHOLD": "0"})
    with pytest.raises(ConfigError, match=r"semantic.cache.colour"):
        _load(tmp_path, {"semantic": {"cache": {"colour": "blue"}}})
    with pytest.raises(ConfigError, match="model score"):
        _load(tmp_path, {"semantic": {"categories": [{"name": "math", "model_scores": {"SmolLM2-135M-Instruct": 3}}]}})


def test_pii_policy_errors(tmp_path):
    with pytest.raises(ConfigError, match="unknown PII type 'SHOE_SIZE'"):
        _load(tmp_path, {"semantic": {"pii": {"policies": {"SmolLM2-135M-Instruct": {"allowed_types": ["SHOE_SIZE"]}}}}})
    with pytest.raises(ConfigError, match=r"semantic.pii.policies names unknown models \['Ghost'\]"):
        _load(tmp_path, {"semantic": {"pii": {"policies": {"Ghost": {"allow_by_default": True}}}}})
    cfg = _load(tmp_path, {"semantic": {"pii": {"policies": {"SmolLM2-135M-Instruct": {"allowed_types": ["B-PERSON"]}}}}})
    assert cfg.semantic.pii.policy("SmolLM2-135M-Instruct").allowed_types == ["PERSON"]


def test_alias_may_not_shadow_a_model(tmp_path):
    with pytest.raises(ConfigError, match="'SmolLM2-135M-Instruct' is also a configured model name"):
        _load(tmp_path, {"semantic": {"aliases": ["SmolLM2-135M-Instruct"]}})
    with pytest.raises(ConfigError, match="semantic.default_model 'Nope'"):
        _load(tmp_path, {"semantic": {"default_model": "Nope"}})
