"""Network faults across hosts: Redis, the API, a prefill host and two decode hosts, each in a network namespace
of its own behind the test switch (tests/netns.py), the real processes (redis-server, gunicorn, Celery workers
with a tiny random-weight model). Each scenario (tests/netfarm.py) cuts, slows or makes lossy some links while
streams are open and checks that every request ends in bounded time with nothing lost or repeated (its greedy text
equal to the unfaulted answer, or a clean error after a prefix of it), and that the farm serves again once healed.

Short timeouts come from the configuration, so the cases "longer than the lease" take seconds: reader leases of
4 s (reliability.lease_ttl_s), the workers' heartbeat TTL of 6 s, Redis commands bounded by 4 s (redis.socket),
KV pulls by 3 s (transfer.pull_timeout_s). bench/netfaults.py runs the same scenarios at full length with the
default settings."""

from __future__ import annotations

import pytest

from tests.netfarm import (
    Host,
    NetFarm,
    Outcome,
    api_partitioned,
    kv_pull_cut,
    running,
    under_link,
    worker_partitioned,
)

pytestmark = pytest.mark.slow

PRE, D1, D2 = Host("pre", "prefill"), Host("d1", "decode"), Host("d2", "decode")
TOKENS = 400
LONG = 8000  # about half a minute of generation: still running when the lease lapses
FAST_ENV = {
    "FARM_DISAGGREGATION__MODE": "always",  # every request pulls KV across hosts
    "FARM_RELIABILITY__LEASE_TTL_S": "4",
    "FARM_REDIS__SOCKET__TIMEOUT_S": "4",
    "FARM_REDIS__SOCKET__CONNECT_TIMEOUT_S": "2",
    "FARM_REDIS__SOCKET__HEALTH_CHECK_INTERVAL_S": "3",
    "FARM_TRANSFER__PULL_TIMEOUT_S": "3",
    "FARM_API__REQUEST_TIMEOUT_S": "20",  # a stream silent this long ends with an error
}
REFERENCES: dict = {}  # (prompt, tokens) -> the unfaulted answer, shared by the scenarios


@pytest.fixture(scope="module")
def farm(tiny_model_dir, tmp_path_factory):
    with running(tmp_path_factory.mktemp("netfaults"), ["redis", "api", PRE.name, D1.name, D2.name], tiny_model_dir,
                 [PRE, D1, D2], FAST_ENV, max_model_len=LONG + 200) as f:
        yield f


@pytest.fixture(autouse=True)
def healed(farm):
    """Every scenario starts and ends on a healthy network."""
    farm.net.heal()
    yield
    farm.net.heal()


def report(out: Outcome, capsys) -> None:
    with capsys.disabled():
        print(f"\n{out.row()}")


def assert_nothing_lost(farm: NetFarm, out: Outcome, all_complete: bool = True) -> None:
    rows = [(r.error, r.finish_reason, r.usage, len(r.text)) for r in out.results]
    assert out.wrong == 0, f"tokens lost or repeated: {rows}\n{farm.tails()}"
    if all_complete:
        assert out.completed == len(out.results), f"{rows}\n{farm.tails()}"


@pytest.mark.parametrize("seconds", [5, 9], ids=["5s", "past-heartbeat-and-lease"])
def test_decode_host_partitioned_from_redis_mid_stream(farm, seconds, capsys):
    """5 s: within the heartbeat TTL the worker's flushes wait (or, if its heartbeat lapsed first, the request
    migrates) and the stream completes. 9 s: past the heartbeat TTL (6 s) and the lease (4 s), the API finds the
    worker gone and migrates the request to the other decode host; the partitioned worker's late events are
    dropped. Either way the client gets every token once, and the worker rejoins and takes tasks again."""
    out = worker_partitioned(farm, seconds, TOKENS, REFERENCES)
    report(out, capsys)
    assert_nothing_lost(farm, out)
    if seconds > 6:
        assert "migrated" in out.note, farm.tail("api")
    assert out.recovery_s is not None and out.recovery_s < 30


@pytest.mark.parametrize("tokens", [TOKENS, LONG], ids=["answer-waits-in-redis", "lease-lapses-mid-generation"])
def test_api_host_partitioned_from_redis_mid_stream(farm, tokens, capsys):
    """The API can neither read the reply stream nor renew its lease for 10 s. A short answer is finished by then
    and waits in Redis: the client gets all of it. A long one is still generating when the reader's lease has
    been missing for its grace (4 + 4 s): the worker stops it, and the client gets a clear error after a prefix
    of the answer (never a truncated answer passed off as finished). Bounded by the request timeout either way,
    and the API serves new requests once healed. (The long answer, far longer than the cut, is not compared
    with an unfaulted run: that would take half a minute; the other scenarios compare.)"""
    out = api_partitioned(farm, 10, tokens, REFERENCES, compare=tokens == TOKENS)
    report(out, capsys)
    assert_nothing_lost(farm, out, all_complete=tokens == TOKENS)
    res = out.results[0]
    if tokens == LONG:
        assert out.failed_cleanly == 1 and "lease" in (res.error or "") and res.text, res
    assert res.elapsed_s < 10 + float(FAST_ENV["FARM_API__REQUEST_TIMEOUT_S"]) + 15
    assert out.recovery_s is not None, out.note


def test_decode_host_partitioned_from_prefill_host_prefills_locally(farm, capsys):
    """The KV pull cannot reach the prefill host: the decode worker gives up after transfer.pull_timeout_s and
    prefills locally; the answer is the same, and pulls work again once healed."""
    out = kv_pull_cut(farm, 32, REFERENCES, PRE.name, [D1.name, D2.name])
    report(out, capsys)
    assert_nothing_lost(farm, out)
    assert out.note.startswith("prefill local;"), out.note
    assert out.results[0].ttft_s < float(FAST_ENV["FARM_TRANSFER__PULL_TIMEOUT_S"]) + 10
    assert out.note.endswith("after healing remote"), f"{out.note}\n{farm.tail(PRE.name)}"


def test_load_over_50ms_rtt_and_1pct_loss(farm, capsys):
    """Every link 25 ms each way (50 ms round trips) and 1% of frames lost: no request fails."""
    prompts = [f"Load request {i}: tell me about networks." for i in range(12)]
    out = under_link(farm, "50 ms RTT, 1% loss", prompts, 48, 6, REFERENCES, delay_ms=25, loss=0.01)
    report(out, capsys)
    assert_nothing_lost(farm, out)


def test_slow_redis_requests_still_complete(farm, capsys):
    """Redis's host answers 200 ms late (every frame it sends delayed): slower, but every request completes."""
    prompts = [f"Slow Redis {i}." for i in range(4)]
    out = under_link(farm, "Redis +200 ms", prompts, 32, 4, REFERENCES, src="redis", delay_ms=200)
    report(out, capsys)
    assert_nothing_lost(farm, out)
