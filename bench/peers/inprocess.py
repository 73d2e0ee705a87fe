"""The built-in engine in this process, no farm: the same prompts (as the token ids the farm's API would
send), the same closed-loop clients (one thread each), the same timings as the HTTP client.

The engine is built from the same configuration file as the farm's built-in worker (block size, KV cache
size, torch threads, static decode buffers), so the difference between the two is the farm's plumbing:
HTTP, Celery, Redis streams and the worker's glue.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

from bench.engine import Tracker
from bench.peers.load import WARM_UP_CLIENTS, RequestTiming, request_sets, summarize_level
from farm.config import FarmConfig


class InProcessEngine:
    """A started farm.engine.engine.Engine plus its tokenizer; `run_level` mirrors load.run_http_level."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self._n = 0
        self._lock = threading.Lock()

    def _one(self, ids: list[int], max_tokens: int) -> RequestTiming:
        from farm.protocol import SamplingParams

        with self._lock:
            self._n += 1
            rid = f"inproc-{self._n}"
        tr = Tracker()
        tr.submitted = time.perf_counter()  # bench.common.now() is the same clock
        self.engine.submit(rid, ids, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True), tr)
        if not tr.done.wait(timeout=900):
            raise RuntimeError(f"in-process request {rid} did not finish within 900 s")
        return RequestTiming(tr.submitted, tr.first_at, tr.done_at, tr.completion_tokens, len(ids), tr.cached_tokens)

    def run_level(self, tag: str, clients: int, per_client: int, max_tokens: int) -> dict[str, Any]:
        from farm.models.tokenization import chat_prompt_ids

        tok = self.engine.tokenizer
        sets = [[chat_prompt_ids(tok, m) for m in convs] for convs in request_sets(tag, clients, per_client)]
        results: list[list[RequestTiming]] = [[] for _ in sets]
        errors: list[BaseException] = []

        def client(i: int) -> None:
            try:
                results[i] = [self._one(ids, max_tokens) for ids in sets[i]]
            except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
                errors.append(e)

        threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(len(sets))]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
        if errors:
            raise errors[0]
        return summarize_level([t for ts in results for t in ts], wall)

    def warm_up(self, max_tokens: int = 16) -> None:
        for clients in WARM_UP_CLIENTS:
            self.run_level(f"warmup{clients}", clients=clients, per_client=1, max_tokens=max_tokens)


@contextlib.contextmanager
def inprocess_engine(cfg: FarmConfig, model_name: str) -> Iterator[InProcessEngine]:
    """The model's built-in engine, made exactly as a farm worker of `cfg` makes it (make_engine)."""
    from farm.backends import make_engine
    from farm.models.directories import require_model_dir

    mcfg = cfg.model(model_name)
    eng = make_engine(cfg, mcfg, require_model_dir(cfg, mcfg)).start()
    try:
        yield InProcessEngine(eng)
    finally:
        eng.stop()
