"""Measured engine performance, the SLA policy's ground truth: prefill TTFT by prompt length and decode
ITL by batch size, interpolated between the measured points.

`profile_engine` measures a running Engine directly (no Redis, no Celery): TTFT of single prompts of each
length, and the decode step time with `b` sequences decoding together. Prompts are random token ids, so
the prefix cache never shortens a measurement. Other work on the machine only ever adds time, so the
fastest of the prefill repetitions and a low quantile of the decode steps are kept, and with `passes` > 1
the whole grid is measured again later and the fastest pass per point kept (a busy spell on a shared
machine lasts tens of seconds): the profile should describe a worker that has its machine to itself. `farm planner profile --out config/profiles/<model>.json`
writes the result; a profile belongs to one model on one kind of machine.
"""

from __future__ import annotations

import bisect
import json
import math
import os
import platform
import random
import statistics
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

PROFILE_VERSION = 1


def interp(x: float, xs: Sequence[float], ys: Sequence[float]) -> float:
    """Piecewise-linear y(x) through the points; beyond the ends, the end segment's line continues
    (a prompt longer than any profiled one costs proportionally more, not the same)."""
    if not xs:
        raise ValueError("no points to interpolate")
    if len(xs) == 1:
        return ys[0]
    i = bisect.bisect_left(xs, x)
    i = min(max(i, 1), len(xs) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0) if x1 != x0 else y0


@dataclass
class PrefillPoint:
    isl: int
    ttft_s: float

    @property
    def tokens_per_s(self) -> float:
        return self.isl / self.ttft_s if self.ttft_s > 0 else 0.0


@dataclass
class DecodePoint:
    batch: int
    itl_s: float
    context: int = 0

    @property
    def tokens_per_s(self) -> float:
        return self.batch / self.itl_s if self.itl_s > 0 else 0.0


@dataclass
class Profile:
    """Per-worker performance of one model on one machine kind."""

    model: str
    prefill: list[PrefillPoint]
    decode: list[DecodePoint]
    block_size: int = 16
    kv_blocks: int = 0  # KV-cache blocks of one worker
    max_num_seqs: int = 64
    device: str = "cpu"
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.prefill.sort(key=lambda p: p.isl)
        self.decode.sort(key=lambda p: p.batch)
        if not self.prefill or not self.decode:
            raise ValueError("a profile needs at least one prefill and one decode point")
        # Noise can make a measured curve dip; cost never falls with more work, so keep the running max.
        self._isl = [float(p.isl) for p in self.prefill]
        self._ttft = _running_max([p.ttft_s for p in self.prefill])
        self._batch = [float(p.batch) for p in self.decode]
        self._itl = _running_max([p.itl_s for p in self.decode])

    # -- prefill ------------------------------------------------------------------------------------------
    def ttft(self, isl: float) -> float:
        """Seconds to prefill one prompt of `isl` tokens on an idle worker."""
        floor = self._ttft[0] * min(1.0, max(isl, 1.0) / self._isl[0])
        return max(interp(isl, self._isl, self._ttft), floor, 1e-6)

    def prefill_tokens_per_s(self, isl: float) -> float:
        return max(isl, 1.0) / self.ttft(isl)

    # -- decode -------------------------------------------------------------------------------------------
    def itl(self, batch: float) -> float:
        """Seconds per decode step with `batch` sequences decoding together."""
        return max(interp(max(batch, 1.0), self._batch, self._itl), 1e-6)

    def decode_tokens_per_s(self, batch: float) -> float:
        return max(batch, 1.0) / self.itl(batch)

    def max_batch_for_itl(self, itl_s: float, limit: int | None = None) -> int:
        """The largest batch whose step time stays within `itl_s` (0 when even batch 1 is slower)."""
        limit = limit or self.max_num_seqs
        best = 0
        for b in range(1, limit + 1):
            if self.itl(b) <= itl_s:
                best = b
            else:
                break
        return best

    def kv_max_batch(self, context_tokens: float) -> int:
        """Sequences of `context_tokens` tokens whose KV fits one worker's cache at once."""
        if not self.kv_blocks:
            return self.max_num_seqs
        per_seq = max(1, math.ceil(context_tokens / self.block_size))
        return max(1, min(self.max_num_seqs, self.kv_blocks // per_seq))

    # -- files --------------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "version": PROFILE_VERSION, "model": self.model, "device": self.device, "block_size": self.block_size,
            "kv_blocks": self.kv_blocks, "max_num_seqs": self.max_num_seqs, "meta": self.meta,
            "prefill": [{**asdict(p), "tokens_per_s": round(p.tokens_per_s, 1)} for p in self.prefill],
            "decode": [{**asdict(p), "tokens_per_s": round(p.tokens_per_s, 1)} for p in self.decode],
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Profile:
        return cls(model=d["model"], device=d.get("device", "cpu"), block_size=int(d.get("block_size", 16)),
                   kv_blocks=int(d.get("kv_blocks", 0)), max_num_seqs=int(d.get("max_num_seqs", 64)),
                   meta=dict(d.get("meta", {})),
                   prefill=[PrefillPoint(int(p["isl"]), float(p["ttft_s"])) for p in d["prefill"]],
                   decode=[DecodePoint(int(p["batch"]), float(p["itl_s"]), int(p.get("context", 0)))
                           for p in d["decode"]])

    def save(self, path: str | Path) -> Path:
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        return p

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        return cls.from_dict(json.loads(Path(path).read_text()))


def _running_max(xs: list[float]) -> list[float]:
    out, m = [], 0.0
    for x in xs:
        m = max(m, x)
        out.append(m)
    return out


# -- measuring a real engine ---------------------------------------------------------------------------------
class _Recorder:
    """Output timestamps of one request (called on the engine thread; only appends)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.done = threading.Event()
        self.error: str | None = None

    def __call__(self, out) -> None:
        if out.token_ids or out.first_token is not None or out.finished:
            self.times.append(time.perf_counter())
        if out.finished:
            if out.finish_reason and out.finish_reason.startswith("error"):
                self.error = out.finish_reason
            self.done.set()


def _prompt(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(100, vocab) for _ in range(n)]


def _run(engine, prompts: list[list[int]], max_tokens: int, timeout: float = 600) -> list[tuple[float, _Recorder]]:
    from farm.protocol import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    runs = []
    for ids in prompts:
        rec = _Recorder()
        t0 = time.perf_counter()
        engine.submit(uuid.uuid4().hex, ids, params, rec)
        runs.append((t0, rec))
    for _t0, rec in runs:
        if not rec.done.wait(timeout):
            raise TimeoutError("the engine did not finish a profiling request")
        if rec.error:
            raise RuntimeError(f"profiling request failed: {rec.error}")
    return runs


def measure_prefill(engine, isl: int, reps: int, rng: random.Random, vocab: int) -> float:
    """Fastest TTFT (s) of `reps` single prompts of `isl` tokens on an otherwise idle engine."""
    ttfts = []
    for _ in range(reps):
        ((t0, rec),) = _run(engine, [_prompt(rng, isl, vocab)], max_tokens=1)
        ttfts.append(rec.times[0] - t0)
    return min(ttfts)


def measure_decode(engine, batch: int, context: int, tokens: int, rng: random.Random, vocab: int) -> float:
    """Decode step time (s), 25th percentile, while exactly `batch` sequences decode together.

    Only gaps between a sequence's consecutive tokens that fall after the last sequence started
    decoding and before the first one finished count, so interleaved prefills are left out."""
    runs = _run(engine, [_prompt(rng, context, vocab) for _ in range(batch)], max_tokens=tokens)
    start = max(rec.times[0] for _t0, rec in runs)
    end = min(rec.times[-1] for _t0, rec in runs)
    gaps = [b - a for _t0, rec in runs for a, b in zip(rec.times, rec.times[1:], strict=False)
            if a >= start and b <= end]
    if not gaps:
        raise RuntimeError(f"batch {batch}: no decode step ran with every sequence active; raise `tokens`")
    return statistics.quantiles(gaps, n=4)[0] if len(gaps) >= 2 else gaps[0]


def profile_engine(engine, model: str, isls: Sequence[int] = (128, 512, 2048),
                   batches: Sequence[int] = (1, 4, 8, 16, 32), decode_context: int = 256,
                   decode_tokens: int = 48, reps: int = 3, passes: int = 1, seed: int = 0,
                   progress: Callable[[str], None] | None = None) -> Profile:
    """Measure a started Engine: TTFT per prompt length, ITL per decode batch size (fastest of `passes`)."""
    rng = random.Random(seed)
    vocab = int(getattr(getattr(engine.runner.model, "config", None), "vocab_size", 0) or len(engine.tokenizer))
    say = progress or (lambda _msg: None)
    _run(engine, [_prompt(rng, 64, vocab)], max_tokens=4)  # warm-up: first-call allocations, kernels
    ttfts: dict[int, list[float]] = {int(i): [] for i in isls}
    itls: dict[int, list[float]] = {int(b): [] for b in batches}
    for n in range(1, passes + 1):
        for isl in ttfts:
            ttfts[isl].append(measure_prefill(engine, isl, reps, rng, vocab))
            say(f"pass {n}/{passes} prefill isl={isl}: ttft {ttfts[isl][-1] * 1000:.0f} ms "
                f"({isl / ttfts[isl][-1]:.0f} tok/s)")
        for b in itls:
            itls[b].append(measure_decode(engine, b, decode_context, decode_tokens, rng, vocab))
            say(f"pass {n}/{passes} decode batch={b}: itl {itls[b][-1] * 1000:.1f} ms ({b / itls[b][-1]:.0f} tok/s)")
    prefill = [PrefillPoint(isl, min(v)) for isl, v in ttfts.items()]
    decode = [DecodePoint(b, min(v), decode_context) for b, v in itls.items()]
    cfg = engine.cfg
    meta = {"created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "platform": platform.platform(),
            "cpu_count": os.cpu_count(), "load_average": [round(x, 2) for x in os.getloadavg()], "reps": reps,
            "passes": passes, "decode_tokens": decode_tokens, "max_num_batched_tokens": cfg.max_num_batched_tokens,
            "dtype": cfg.dtype, "all_passes": {"ttft_s": {str(k): [round(x, 4) for x in v] for k, v in ttfts.items()},
                                               "itl_s": {str(k): [round(x, 4) for x in v] for k, v in itls.items()}}}
    try:
        import torch

        meta.update(torch=torch.__version__, torch_threads=torch.get_num_threads())
    except ImportError:
        pass
    return Profile(model=model, prefill=prefill, decode=decode, block_size=cfg.block_size,
                   kv_blocks=engine.pool.num_blocks, max_num_seqs=cfg.max_num_seqs,
                   device=str(engine.runner.device), meta=meta)


def profile_model(farm_cfg, model: str | None = None, **kw: Any) -> Profile:
    """Start an Engine for a configured model, profile it, stop it."""
    from farm.engine.engine import Engine
    from farm.models.directories import require_model_dir

    name = model or farm_cfg.default_model
    mcfg = farm_cfg.model(name)
    engine = Engine(require_model_dir(farm_cfg, mcfg), farm_cfg.engine, mcfg.max_model_len).start()
    try:
        return profile_engine(engine, name, **kw)
    finally:
        engine.stop()
