"""The planner with the local actuator on a real farm: a load ramp scales decode workers 1 -> 2 -> 1.

Real worker processes (the supervisor's Farm), real requests through the Gateway, the planner's `step()`
in a loop with small thresholds. The scale-down happens while the retired worker still decodes a long
request: Celery's warm shutdown must let it finish (a `done` event from that worker after the SIGTERM),
then the process exits with status 0. No request may end in anything but `done`.
"""

from __future__ import annotations

import threading
import time
import uuid

import pytest
import redis

from farm.config import get_config, load_config
from farm.config.planner import Bounds, LoadPolicyConfig, PlannerConfig
from farm.gateway import Gateway
from farm.models.tokenization import chat_prompt_ids, get_tokenizer
from farm.planner.actuators import LocalActuator
from farm.planner.planner import Planner, read_state
from farm.planner.signals import RedisSignals
from farm.protocol import GenerationRequest, SamplingParams
from farm.supervisor import Farm
from tests.conftest import make_farm_env

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
# the ramp-down's long requests must still decode when the planner's 10 s window lets it scale down: 160 tokens
# once finished first on a fast day (CI on 2026-11-27); 400 keep them decoding on fast and slow machines alike
LONG_TOKENS = 400


class Client(threading.Thread):
    """Sends requests one after another until stopped (or `once`); keeps every request's outcome."""

    def __init__(self, gw: Gateway, tok, n: int, max_tokens: int, once: bool = False):
        super().__init__(daemon=True)
        self.gw, self.tok, self.n, self.max_tokens, self.once = gw, tok, n, max_tokens, once
        self.stop = threading.Event()
        self.results: list[dict] = []  # {"last": final event, "worker": placed on, "t_done": monotonic}
        self.placed = threading.Event()
        self.worker = ""

    def run(self) -> None:
        i = 0
        while not self.stop.is_set():
            i += 1
            text = f"Client {self.n}, request {i} ({uuid.uuid4().hex[:8]}): tell me about ships and harbours."
            req = GenerationRequest(uuid.uuid4().hex, self.gw.cfg.default_model,
                                    chat_prompt_ids(self.tok, [{"role": "user", "content": text}]),
                                    SamplingParams(max_tokens=self.max_tokens, temperature=0, ignore_eos=True))
            try:
                sub = self.gw.submit(req)
                self.worker = sub.placements["both"].worker.worker_id
                self.placed.set()
                last = None
                for ev in sub.events(first_timeout_s=120, idle_timeout_s=120):
                    last = ev.to_dict()
                self.results.append({"last": last, "worker": self.worker, "t_done": time.monotonic()})
            except Exception as e:  # noqa: BLE001 - a failed request is a test failure, recorded here
                self.results.append({"last": {"type": "exception", "message": repr(e)}, "worker": self.worker,
                                     "t_done": time.monotonic()})
            if self.once:
                return


@pytest.fixture
def farm_cfg(redis_url, tmp_path, monkeypatch):
    for k, v in make_farm_env(redis_url, tmp_path).items():
        monkeypatch.setenv(k, v)
    get_config.cache_clear()
    yield load_config()
    get_config.cache_clear()


def test_local_planner_scales_decode_up_under_load_and_back_down(farm_cfg, redis_url):
    cfg = farm_cfg
    r = redis.Redis.from_url(redis_url)
    r.flushdb()
    pcfg = PlannerConfig(
        roles=["decode"], interval_s=0.5, window_s=10, cooldown_up_s=0, cooldown_down_s=3,
        bounds={"decode": Bounds(min=1, max=2)},
        load=LoadPolicyConfig(scale_up_util=0.75, scale_down_util=0.3, up_intervals=2, down_intervals=3,
                              decode_requests_per_worker=4, kv_util_weight=0),
    )
    farm = Farm(cfg, prefill=0, decode=1, both=0, api=False, flower=False, grace_s=60)
    clients: list[Client] = []
    longs: list[Client] = []
    gw = None
    try:
        farm.start()
        farm.wait_healthy(timeout=120)
        planner = Planner(pcfg, RedisSignals(r, pcfg.window_s), LocalActuator(farm), [cfg.default_model], r=r)
        gw = Gateway(cfg, r)
        tok = get_tokenizer(cfg, cfg.default_model)
        first = farm.workers("decode")[0].worker_id
        t0 = time.monotonic()

        # -- ramp: 6 concurrent streams on one worker sized for 4 -> the planner adds a second worker
        clients = [Client(gw, tok, n, max_tokens=24) for n in range(6)]
        for c in clients:
            c.start()
        decisions = []
        deadline = time.monotonic() + 120
        second = None
        while time.monotonic() < deadline:
            decisions += planner.step()
            ws = farm.workers("decode")
            second = ws[1].worker_id if len(ws) > 1 else None
            served = [x for c in clients for x in c.results if second and x["worker"] == second]
            if len(served) >= 2:
                break
            time.sleep(pcfg.interval_s)
        ups = [d for d in decisions if d.action == "scale_up"]
        assert [(d.current, d.target) for d in ups] == [(1, 2)], [d.line() for d in decisions]
        assert second is not None and len(served) >= 2, "the added worker never served a request"
        print(f"scaled up and served by {second} after {time.monotonic() - t0:.0f}s")
        for c in clients:
            c.stop.set()
        for c in clients:
            c.join(timeout=120)

        # -- ramp down: two long requests, one on each worker; load 2/8 -> retire the newest (decode-2)
        longs = []
        while not any(c.worker == second for c in longs) and len(longs) < 4:
            c = Client(gw, tok, 100 + len(longs), max_tokens=LONG_TOKENS, once=True)
            c.start()
            assert c.placed.wait(30)
            longs.append(c)
        assert any(c.worker == second for c in longs), "no long request landed on the second worker"
        retired = None
        t_sigterm = 0.0
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and retired is None:
            step = planner.step()
            decisions += step
            if any(d.action == "scale_down" for d in step):
                t_sigterm = time.monotonic()
                retired = next(p for p in farm.procs if p.retiring)
            time.sleep(pcfg.interval_s)
        assert retired is not None, [d.line() for d in decisions[-5:]]
        assert retired.worker_id == second and retired.alive(), "the retired worker should still be finishing"
        assert [w.worker_id for w in farm.workers("decode")] == [first]
        for c in longs:
            c.join(timeout=120)
        assert retired.popen.wait(timeout=60) == 0  # warm shutdown: finished its request, then exited cleanly
        print(f"retired {second} exited 0 after {time.monotonic() - t_sigterm:.1f}s of warm shutdown; "
              f"test body took {time.monotonic() - t0:.0f}s")
        on_retired = [x for c in longs for x in c.results if x["worker"] == second]
        assert on_retired and all(x["last"]["type"] == "done" and x["last"]["decode_worker"] == second
                                  and x["t_done"] > t_sigterm for x in on_retired)

        state = read_state(r)
        assert state["models"][cfg.default_model]["decode"]["action"] == "scale_down"
        for _ in range(10):  # the planner notices the exit and forgets the process
            planner.step()
            if not any(p.retiring for p in farm.procs):
                break
            time.sleep(0.5)
        assert not any(p.retiring for p in farm.procs)
        assert len(farm.workers("decode")) == 1
    finally:
        for c in clients:
            c.stop.set()
        for c in clients + longs:
            c.join(timeout=60)
        if gw is not None:
            gw.stop()
        farm.stop()
        r.close()

    results = [x for c in clients + longs for x in c.results]
    bad = [x["last"] for x in results if not x["last"] or x["last"]["type"] != "done"]
    assert not bad, bad
    assert len(results) >= 8
