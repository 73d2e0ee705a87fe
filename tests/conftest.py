"""Shared fixtures: a real redis-server on a free port (a database of its own per test module), and the
farm's environment pointing at it. At its end the session fails if a process it started is still alive."""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import socket
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import redis

from farm.infra.orphans import die_with_parent

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("FARM_SECRET", "test-secret-not-for-production")
# The Milvus tests load gRPC into this process. Its fork handlers then run in every child forked here (the
# parent-death preexec_fn forces fork over vfork) and sometimes crash the child before its exec ("epoll_wait
# error: Bad file descriptor", a worker that never starts). The children exec at once and never use gRPC.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
# Every process the suite starts inherits this tag (children of children too, also those reparented to pid 1
# when their parent was killed), so the end of the session can find any that is still running.
SESSION_TAG = "INFERENCE_FARM_TEST_SESSION"  # not FARM_*: tests drop those from child environments
os.environ[SESSION_TAG] = uuid.uuid4().hex
# processes told to stop during the last teardowns get this long to exit (a test of the check itself shortens it)
LEFTOVER_GRACE_S = float(os.environ.get("FARM_TEST_LEFTOVER_GRACE_S", "15"))
# Helpers of this very process that end with it (multiprocessing's resource tracker and fork server, and the
# grammar checker's sandbox, farm.infra.sandbox, which exits when its parent's pipe closes).
_OWN_HELPERS = ("from multiprocessing.resource_tracker import", "from multiprocessing.forkserver import",
                "-m farm.infra.sandbox")


def session_processes(tag: str | None = None) -> list[psutil.Process]:
    """Live processes tagged with this session (or `tag`), except this one and its own helpers."""
    tag = tag or os.environ[SESSION_TAG]
    out = []
    for p in psutil.process_iter():
        if p.pid == os.getpid():
            continue
        try:
            if p.environ().get(SESSION_TAG) != tag or p.status() == psutil.STATUS_ZOMBIE:
                continue
            if p.ppid() == os.getpid() and any(h in " ".join(p.cmdline()) for h in _OWN_HELPERS):
                continue
        except psutil.Error:  # gone meanwhile, or not ours to read
            continue
        out.append(p)
    return out


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Fail the session when a process it started outlived it (a farm left behind by a failed stop, a
    supervisor killed without its children...): they are listed, then killed."""
    deadline = time.monotonic() + LEFTOVER_GRACE_S
    left = session_processes()
    while left and time.monotonic() < deadline:
        time.sleep(0.5)
        left = session_processes()
    if not left:
        return
    lines = []
    for p in left:
        with contextlib.suppress(psutil.Error):
            lines.append(f"pid {p.pid} (parent {p.ppid()}): {' '.join(p.cmdline())[:300]}")
        with contextlib.suppress(psutil.Error):
            p.kill()
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    write = reporter.write_line if reporter else print
    if reporter:
        reporter.ensure_newline()
        reporter.write_sep("=", f"{len(lines)} process(es) started by the tests outlived them (killed now)",
                           red=True)
    for line in lines:
        write(line)
    session.exitstatus = pytest.ExitCode.TESTS_FAILED


REDIS_DATABASES = 64
FIRST_MODULE_DB = 3  # databases 0-2 stay free for tests that pick one of their own (e.g. ".../2")
_module_dbs = itertools.count()


_handed_out: set[int] = set()


def free_port() -> int:
    """A loopback port nobody listens on and this process has not handed out before.

    The kernel may give the same free port to two binds in a row once the first socket is
    closed, so a farm asking for five ports could get one twice (a CI run did: the Redis HA
    fixture's primary and third sentinel).
    """
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _handed_out:
            _handed_out.add(port)
            return port


def start_redis(tmp: Path, port: int | None = None) -> tuple[subprocess.Popen, str]:
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.fail("redis-server is not installed (make install puts it in place)")
    port = port or free_port()
    tmp.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen(
        [exe, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(tmp), "--save", "",
         "--appendonly", "yes", "--daemonize", "no", "--loglevel", "warning", "--databases", str(REDIS_DATABASES)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=die_with_parent(),  # even if pytest is killed
    )
    url = f"redis://127.0.0.1:{port}/0"
    client = redis.Redis.from_url(url)
    for _ in range(200):
        try:
            client.ping()
            return proc, url
        except redis.ConnectionError:
            time.sleep(0.02)
    proc.kill()
    pytest.fail("redis-server did not start")


@pytest.fixture(scope="session")
def redis_session_url(tmp_path_factory) -> Iterator[str]:
    """A real redis-server for the whole test session, on a free port (its URL, database 0)."""
    proc, url = start_redis(tmp_path_factory.mktemp("redis"))
    yield url
    proc.terminate()
    proc.wait(timeout=10)


@pytest.fixture(scope="module")
def redis_url(redis_session_url) -> str:
    """A database of this test module's own on the session's redis-server, emptied first.

    No module sees what another left behind: a worker registration left by one module once turned a later
    module's "no worker" into a migration. Tests within a module share the database (module-scoped farms
    live there); `redis_client` empties it for a test that needs a clean slate.
    """
    db = FIRST_MODULE_DB + next(_module_dbs) % (REDIS_DATABASES - FIRST_MODULE_DB)
    url = f"{redis_session_url.rsplit('/', 1)[0]}/{db}"
    with redis.Redis.from_url(url) as client:
        client.flushdb()
    return url


@pytest.fixture
def redis_client(redis_url) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url)
    client.flushdb()
    yield client
    client.close()


def make_farm_env(redis_url: str, tmp_path: Path) -> dict[str, str]:
    """Environment for farm processes started by a test: its Redis, a fresh state dir, the real models.

    Models are prepared once in the project's state dir (by `make test`), so tests point at that
    directory instead of converting again.
    """
    from farm.config import load_config
    from farm.models.directories import model_dir

    cfg = load_config(environ={})
    env = {
        "FARM_REDIS__URL": redis_url,
        "FARM_STATE_DIR": str(tmp_path / "state"),
        "FARM_SECRET": os.environ["FARM_SECRET"],
    }
    # Reuse the prepared default model through an explicit path.
    env["FARM_CONFIG"] = str(_model_path_override(tmp_path, cfg, model_dir(cfg, cfg.model(cfg.default_model))))
    return env


@pytest.fixture
def farm_env(redis_url, tmp_path, monkeypatch) -> Iterator[dict[str, str]]:
    """make_farm_env, applied to this process's environment for the test's duration."""
    from farm.config import get_config

    env = make_farm_env(redis_url, tmp_path)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    get_config.cache_clear()
    yield env
    get_config.cache_clear()


def _model_path_override(tmp_path: Path, cfg, path: Path) -> Path:
    import yaml

    out = tmp_path / "farm-test.yaml"
    entry = cfg.model(cfg.default_model).model_dump(mode="json", exclude_none=True, exclude={"source"})
    models = [{**entry, "path": str(path)}]  # the default entry's own settings (max_model_len, tool_call_parser...)
    out.write_text(yaml.safe_dump({"models": models}))
    return out


@pytest.fixture(scope="session")
def real_model_dir() -> Path:
    """The prepared default model (SmolLM2-135M-Instruct); `make test` prepares it first."""
    from farm.config import load_config
    from farm.models.directories import require_model_dir

    cfg = load_config(environ={})
    return require_model_dir(cfg, cfg.model(cfg.default_model))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, real_model_dir) -> Path:
    """A tiny random-weight Llama with the real tokenizer and chat template: fast engine mechanics tests."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out = tmp_path_factory.mktemp("tiny-llama")
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                      bos_token_id=1, eos_token_id=2, tie_word_embeddings=True, initializer_range=0.5)
    LlamaForCausalLM(cfg).save_pretrained(out)
    for f in real_model_dir.iterdir():
        if f.name.startswith(("tokenizer", "chat_template", "special_tokens")):
            shutil.copy(f, out / f.name)
    return out


@pytest.fixture
def pipeline_fails_once(monkeypatch) -> list[int]:
    """redis-py pipelines whose first execute() on the test's own thread times out (as across a network partition),
    emptied as a failed execute() leaves them; later ones run. Returns the list of the test thread's execute() calls,
    one item each (other threads' pipelines, e.g. a module-scoped app's followers, run untouched and uncounted)."""
    from redis.client import Pipeline

    real, calls = Pipeline.execute, []
    mine = threading.get_ident()

    def execute(self, *args, **kwargs):
        if threading.get_ident() != mine:
            return real(self, *args, **kwargs)
        calls.append(1)
        if len(calls) == 1:
            self.reset()
            raise redis.TimeoutError("Timeout reading from socket")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Pipeline, "execute", execute)
    return calls


# -- what a failed test's farm logged ------------------------------------------------------------------------
# CI shows the end of a failed run only: a farm test that fails for a reason its processes logged (a worker lost,
# restarted, an engine that died) gets those lines printed there, beside the durations, instead of in log files
# that end with the CI machine.
_NOTABLE = ("Traceback", "Error", "ERROR", "CRITICAL", "lost", "restart", "exited", "died", "killed", "Killed")
_FARM_LOG_LINES = 12  # per process log, the last notable lines
_FARM_LOG_TESTS = 4  # failed tests whose farm logs are shown
_farm_log_reports: list[str] = []


def _notable_tail(path: Path, n: int) -> list[str]:
    try:
        with path.open("rb") as f:
            f.seek(max(0, path.stat().st_size - 2_000_000))
            lines = f.read().decode("utf-8", "replace").splitlines()
    except OSError:
        return []
    return [line[:300] for line in lines if any(w in line for w in _NOTABLE)][-n:]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    outcome = yield
    rep = outcome.get_result()
    if not rep.failed or len(_farm_log_reports) >= _FARM_LOG_TESTS:
        return
    farm = getattr(item, "funcargs", {}).get("farm")
    log_dir = getattr(farm, "log_dir", None)
    if not isinstance(log_dir, Path) or not log_dir.is_dir():
        return
    parts = [f"{item.nodeid} ({rep.when}): notable lines of its farm's logs, {log_dir}"]
    for path in sorted(log_dir.glob("*.log")):
        if lines := _notable_tail(path, _FARM_LOG_LINES):
            parts += [f"  {path.name}:"] + [f"    {line}" for line in lines]
    _farm_log_reports.append("\n".join(parts))
    if hasattr(item.config, "workerinput"):  # an xdist worker: the summary is the controller's, the report travels
        rep.sections.append(("farm logs", _farm_log_reports[-1]))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if _farm_log_reports:
        terminalreporter.section("farm logs of failed tests")
        for text in _farm_log_reports:
            terminalreporter.write_line(text)


VLLM_TESTS = "tests/vllm/"  # one scope: their session's `vllm serve` starts once


def _scope(nodeid: str) -> str:
    path = nodeid.split("::", 1)[0]
    return VLLM_TESTS if path.startswith(VLLM_TESTS) else path


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """`make test` runs two pytest-xdist workers: a module runs whole on one worker, so its module-scoped farm
    starts once (xdist's own `loadgroup` cannot say so under pytest 9, whose items ignore the `_nodeid` it sets),
    and the vLLM modules are one scope."""
    from xdist.scheduler import LoadScopeScheduling

    class ModuleScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _scope(nodeid)

    return ModuleScheduling(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The vLLM scope first (with `--no-loadscope-reorder`, xdist hands scopes out in this order): the longest one
    must not be the last to start."""
    items.sort(key=lambda item: _scope(item.nodeid) != VLLM_TESTS)  # stable: the collection's order otherwise
