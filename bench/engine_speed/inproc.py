"""The built-in engine in this process, no farm: the same prompts (as the token ids the farm's API would make
of them), the same closed-loop streams (one thread each), the same `Request` records as the HTTP client.

The engine is bench.peers.inprocess's: made by farm.backends.make_engine from the same configuration the
farm's built-in worker gets (bench.peers.contenders.farm_overrides), so what separates farm-builtin from
this is the farm's serving path: HTTP, the API, Redis streams, Celery and the worker's glue. A "chunk" here
is one engine output (one decode step).
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from bench.engine_speed.farm_api import chat_prompt_ids
from bench.engine_speed.load import Request, summarize
from bench.peers import contenders as pc
from bench.peers.inprocess import InProcessEngine, inprocess_engine
from bench.peers.load import chat_messages


@contextlib.contextmanager
def builtin_config(s: pc.Setup) -> Iterator[Any]:
    """The FarmConfig of farm-builtin's worker (semantic off, the same engine numbers), in a temp state dir."""
    from farm.config import load_config

    state = Path(tempfile.mkdtemp(prefix="engine-speed-inproc-"))
    try:
        path = state / "bench.yaml"
        path.write_text(yaml.safe_dump({"state_dir": str(state), **pc.farm_overrides(s, "builtin", "kv")}))
        yield load_config(path, environ={})
    finally:
        shutil.rmtree(state, ignore_errors=True)


class InProc:
    """`level(tag, streams, per_stream, max_tokens)` against the started engine, like load.run_level."""

    def __init__(self, eng: InProcessEngine, timeout_s: float = 600.0) -> None:
        self.engine = eng.engine
        self.timeout_s = timeout_s
        self._n = 0
        self._lock = threading.Lock()

    def _one(self, rec: Request, ids: list[int], max_tokens: int) -> None:
        from farm.protocol import SamplingParams

        with self._lock:
            self._n += 1
            rid = f"inproc-{self._n}"
        done = threading.Event()

        def on_output(out: Any) -> None:  # on the engine thread
            t = time.perf_counter()
            if out.token_ids:
                rec.chunks.append(t)
                if rec.first is None:
                    rec.first = t
            if out.finished:
                rec.completion_tokens = out.completion_tokens
                rec.status = 200
                if out.finish_reason and str(out.finish_reason).startswith("error"):
                    rec.error = str(out.finish_reason)[:200]
                rec.end = t
                done.set()

        rec.prompt_tokens = len(ids)
        rec.sent = time.perf_counter()
        try:
            self.engine.submit(rid, ids, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                               on_output)
        except Exception as e:  # noqa: BLE001 - counted, never raised
            rec.error, rec.end = f"{type(e).__name__}: {e}"[:200], time.perf_counter()
            return
        if not done.wait(self.timeout_s):
            rec.error, rec.end = f"timeout after {self.timeout_s:.0f} s", time.perf_counter()
            self.engine.abort(rid)

    def level(self, tag: str, streams: int, per_stream: int, max_tokens: int) -> dict[str, Any]:
        tok = self.engine.tokenizer
        ids = [[chat_prompt_ids(tok, chat_messages(tag, i * per_stream + k)) for k in range(per_stream)]
               for i in range(streams)]
        records: list[Request] = []

        def stream(i: int) -> None:
            for k in range(per_stream):
                rec = Request(i, k)
                records.append(rec)
                self._one(rec, ids[i][k], max_tokens)

        threads = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(streams)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
        for r in records:
            r.settle(max_tokens, http=False)
        return summarize(records, wall, t0, max_tokens)


@contextlib.contextmanager
def inproc_builtin(s: pc.Setup, timeout_s: float = 600.0) -> Iterator[InProc]:
    with builtin_config(s) as cfg, inprocess_engine(cfg, pc.MODEL) as eng:
        yield InProc(eng, timeout_s)
