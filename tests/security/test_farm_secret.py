"""FARM_SECRET, the KV handles' HMAC key: processes started together agree on one whole secret, and a key anyone
could guess or forge with (empty, short, the example's placeholder) stops the process with the fix."""

from __future__ import annotations

import multiprocessing
import os
import stat

import pytest

from farm.config import ConfigError, load_config
from farm.infra.secret import farm_secret


def _read_secret(state_dir: str, barrier, out) -> None:
    cfg = load_config(environ={"FARM_STATE_DIR": state_dir})
    barrier.wait()
    try:
        out.put(farm_secret(cfg).decode())
    except Exception as e:  # noqa: BLE001 - reported to the test
        out.put(f"error: {type(e).__name__}: {e}")


def test_processes_started_together_read_one_whole_secret(tmp_path, monkeypatch):
    """Workers of a Procfile start at the same moment on a fresh state dir: each must get the one secret that was
    made, never an empty file another process was still writing, nor a FileExistsError (the old check, create,
    write raced: 3 empty secrets and 90 errors in 300 races of two processes)."""
    monkeypatch.delenv("FARM_SECRET", raising=False)
    ctx = multiprocessing.get_context("fork")
    for round_no in range(15):
        state = tmp_path / f"s{round_no}"
        barrier, out = ctx.Barrier(4), ctx.Queue()
        procs = [ctx.Process(target=_read_secret, args=(str(state), barrier, out)) for _ in range(4)]
        for p in procs:
            p.start()
        got = [out.get(timeout=30) for _ in procs]
        for p in procs:
            p.join(10)
        assert len(set(got)) == 1 and len(got[0]) == 64, got
        assert (state / "secret").read_text() == got[0]
        assert stat.S_IMODE(os.stat(state / "secret").st_mode) == 0o600
        assert sorted(p.name for p in state.iterdir()) == ["secret"]  # nothing left aside


@pytest.mark.parametrize("value,why", [("short-secret", "12 characters"), ("change-me-hmac-secret", "placeholder")])
def test_a_guessable_farm_secret_is_refused(tmp_path, monkeypatch, value, why):
    monkeypatch.setenv("FARM_SECRET", value)
    with pytest.raises(ConfigError, match=why):
        farm_secret(load_config(environ={"FARM_STATE_DIR": str(tmp_path)}))


def test_an_empty_secret_file_is_refused_not_used(tmp_path, monkeypatch):
    """An empty key signs handles anyone can forge: a file left empty (a crash while it was written) is an error
    naming the file, not a key."""
    monkeypatch.delenv("FARM_SECRET", raising=False)
    (tmp_path / "secret").write_text("")
    with pytest.raises(ConfigError, match="delete it"):
        farm_secret(load_config(environ={"FARM_STATE_DIR": str(tmp_path)}))


@pytest.mark.parametrize("where,environ,named", [
    ("env", {"FARM_REDIS_PASSWORD": "change-me-redis"}, "FARM_REDIS_PASSWORD"),
    ("env", {"FARM_REDIS__URL": "redis://:change-me-redis@redis:6379/0"}, "redis.url's password"),
    ("env", {"FARM_METRICS_TOKEN": "CHANGEME-metrics"}, "FARM_METRICS_TOKEN"),
    ("env", {"FARM_FLOWER_AUTH": "admin:change-me-flower"}, "FARM_FLOWER_AUTH"),
    ("env", {"FLOWER_BASIC_AUTH": "admin:change-me-flower"}, "FLOWER_BASIC_AUTH"),
    ("env", {"FARM_API_KEYS": "sk-real-1f0c9e,sk-farm-change-me"}, "FARM_API_KEYS"),
    ("file", {}, "api.api_keys"),
])
def test_a_placeholder_secret_anywhere_stops_the_farm(tmp_path, where, environ, named):
    """The compose example's and the chart example's `change-me` values are public: any process of the farm refuses
    to load its configuration while one is a secret, naming where it is; real values load."""
    environ = {**environ, "FARM_STATE_DIR": str(tmp_path)}
    if where == "file":
        (tmp_path / "farm.yaml").write_text("api:\n  api_keys: [sk-real-key-1, {key: sk-farm-change-me}]\n")
        environ["FARM_CONFIG"] = str(tmp_path / "farm.yaml")
    with pytest.raises(ConfigError, match="placeholder") as refused:
        load_config(environ=environ)
    assert named in str(refused.value)
    assert not any(v in str(refused.value) for v in environ.values() if "change" in v.lower())  # never echoed
    real = {k: v.replace("change-me", "9f2c41d7a0b3").replace("CHANGEME", "9f2c41d7a0b3") for k, v in environ.items()}
    if where == "file":
        (tmp_path / "farm.yaml").write_text("api:\n  api_keys: [sk-real-key-1, {key: sk-real-key-2}]\n")
    load_config(environ=real)


@pytest.mark.parametrize("value", ["admin:", ":pw-long-enough", "admin", "ops:Long-Random-Part,x1"])
@pytest.mark.parametrize("name", ["FARM_FLOWER_AUTH", "FLOWER_BASIC_AUTH"])
def test_a_weak_flower_credential_is_refused(tmp_path, name, value):
    """Flower's basic auth took an empty password, and read `user:pass,x1` as two logins, the second being `x1`
    (a much shorter secret): every farm process (Flower's included) refuses such a value, without echoing it."""
    with pytest.raises(ConfigError, match=name) as refused:
        load_config(environ={"FARM_STATE_DIR": str(tmp_path), name: value})
    assert value not in str(refused.value)
    load_config(environ={"FARM_STATE_DIR": str(tmp_path), name: "ops:Long-Random-Part-x1"})
