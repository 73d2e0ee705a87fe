"""farm.infra.sandbox: a call on untrusted input in a child process. A crash or a call past its time costs that
call, never the caller; the next call gets a new child. And the grammar checks that use it (farm.openai.structured):
grammars and schemas that kill llguidance's compiler in-process are the client's 400, the process serves on."""

from __future__ import annotations

import time

import pytest

from farm.infra.sandbox import Sandbox, SandboxCrash, SandboxTimeout
from tests.test_api_errors import app, app_client  # noqa: F401 - the API on an empty Redis (no workers)


@pytest.fixture
def sandbox():
    made: list[Sandbox] = []

    def make(target: str, timeout_s: float = 10.0, **kw) -> Sandbox:
        made.append(Sandbox(f"tests.sandbox_targets:{target}", timeout_s, **kw))
        return made[-1]

    yield make
    for s in made:
        s.close()


def test_a_call_runs_in_one_long_lived_child(sandbox):
    box = sandbox("echo")
    first, second = box.call({"a": [1, "x"]}), box.call("again")
    assert first["got"] == {"a": [1, "x"]} and second["got"] == "again"
    assert first["pid"] == second["pid"] and first["pid"] != __import__("os").getpid()
    big = "y" * 3_000_000  # past a pipe's buffer both ways
    assert box.call(big)["got"] == big


def test_a_crash_costs_the_call_and_the_next_call_gets_a_new_child(sandbox):
    box = sandbox("segfault")
    with pytest.raises(SandboxCrash):
        box.call(None)
    with pytest.raises(SandboxCrash):  # and again: a new child each time, the caller untouched
        box.call(None)


def test_a_call_past_its_time_is_stopped(sandbox):
    box = sandbox("sleep", timeout_s=0.5)
    t0 = time.monotonic()
    with pytest.raises(SandboxTimeout):
        box.call(30)
    assert time.monotonic() - t0 < 5
    assert box.call(0) is None  # a new child answers


def test_the_targets_own_error_comes_back_as_text(sandbox):
    with pytest.raises(RuntimeError, match="ValueError: no such thing"):
        sandbox("fail").call("no such thing")


def test_the_call_runs_on_a_small_stack(sandbox):
    """What needs more stack than `stack_bytes` fails in the child, so what completes there has room on a thread
    of the default size (the engines' own)."""
    small, large = sandbox("nest", stack_bytes=256 << 10), sandbox("nest", stack_bytes=64 << 20)
    assert large.call(20_000) == 40_002  # "[" and "]" per level, around the innermost "[]"
    with pytest.raises(SandboxCrash):  # the thread's stack overflows: the child dies, the caller does not
        small.call(20_000)


def _chain_grammar(n: int) -> str:
    return "start: r0\n" + "".join(f"r{i}: r{i + 1}\n" for i in range(n)) + f'r{n}: "z"\n'


def _ref_chain(n: int) -> dict:
    defs = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(n)}
    defs[f"d{n}"] = {"type": "string"}
    return {"$ref": "#/$defs/d0", "$defs": defs}


def test_grammars_that_crash_the_compiler_are_a_400_and_the_api_serves_on(app_client):  # noqa: F811
    """The review's reproductions: a Lark grammar of 3,000 chained rules (37 KB) and a JSON schema of 1,000 chained
    `$ref`s overflowed llguidance's native stack and killed the API process (SIGSEGV, no exception); this test's own
    process would die with it. They are a 400 and the API serves on; so is a 1,300-rule chain under the size bound,
    too deep for the checker's small stack (an engine's thread has four times its room)."""
    from tests.test_api_errors import assert_error, chat, post

    c, cfg = app_client
    err = assert_error(post(c, "/v1/chat/completions", chat(cfg, structured_outputs={"grammar": _chain_grammar(1300)})),
                       400, "structured_outputs.grammar", "invalid_value")
    assert "grammar compiler" in err["message"]
    assert_error(post(c, "/v1/chat/completions", chat(cfg, response_format={
        "type": "json_schema", "json_schema": {"name": "x", "schema": _ref_chain(1000)}})), 400, "response_format")
    assert_error(post(c, "/v1/chat/completions", chat(cfg, structured_outputs={"json": _ref_chain(1000)})), 400,
                 "structured_outputs.json")
    assert_error(post(c, "/v1/chat/completions", chat(cfg, structured_outputs={"grammar": _chain_grammar(3000)})),
                 400, "structured_outputs.grammar")  # past the grammar's size bound: refused before the compiler
    deep = "[" * 5000 + "]" * 5000  # a schema as JSON text nested past the body's bound: 400, not a 500
    assert_error(post(c, "/v1/chat/completions", chat(cfg, structured_outputs={"json": deep})), 400,
                 "structured_outputs.json")
    assert post(c, "/v1/chat/completions", chat(cfg, structured_outputs={"regex": "[a-z]+"})).status_code == 503
    # (503: no worker in this app; the constraint itself passed)
