"""Which cores each vLLM worker on a CPU-only machine computes on.

vLLM's CPU backend binds its OpenMP threads itself (`VLLM_CPU_OMP_THREADS_BIND`). Its `auto` setting
picks the cores of NUMA node 0 and keeps one back for the scheduler process, which suits one engine
per machine. Several workers on one machine would each take the same cores (measured on 2 cores: both
engines bound to core 0, the other core idle). So when the farm starts more than one vLLM worker on a
machine, it gives each its own share of the cores; one worker keeps vLLM's own choice. A bind the user
sets in the environment always wins. On a GPU, vLLM ignores the variable.

vLLM binds only its model executor's compute threads; its engine core (the scheduler process, which waits for the
executor in a busy loop) floats over every core. With one worker per core share that float is a thief: on 2 cores
with 2 SmolLM2 workers decoding 8 streams, the floating engine cores spun on each other's cores and took 0.36 of the
2 cores, and the executors got 1.51; kept each on its own worker's share, the engine cores took 0.07 and the
executors 1.74, 1.37x the tokens per second (`python -m bench.engine_cores`, bench/RESULTS.md "The engine core on
its worker's cores"). So the worker keeps its engine core on its own share (`engine_core_cpus`): the spinning then
waits on the cores whose result it waits for.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"


def usable_cores() -> list[int]:
    """The cores this process may run on (its affinity), in order."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def core_shares(cores: list[int], n: int) -> list[str]:
    """`n` CPU lists in vLLM's syntax ("0-3", "5"), one per worker: contiguous, equal shares of `cores`
    when there are enough (the remainder goes to the first workers), otherwise one core each, reused
    round robin. One worker gets "auto" (vLLM's own binding)."""
    if n <= 1:
        return ["auto"] * n
    if n > len(cores):
        return [str(cores[i % len(cores)]) for i in range(n)]
    base, extra = divmod(len(cores), n)
    shares, at = [], 0
    for i in range(n):
        size = base + (1 if i < extra else 0)
        part = cores[at:at + size]
        at += size
        shares.append(",".join(str(c) for c in part))
    return shares


def bind_env(index: int, count: int, environ: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for the `index`-th of `count` vLLM workers started on this machine: its core share, or
    nothing when the user set the bind (or with a single worker, which keeps vLLM's `auto`)."""
    environ = os.environ if environ is None else environ
    if BIND_ENV in environ or count <= 1:
        return {}
    return {BIND_ENV: core_shares(usable_cores(), count)[index % count]}


def parse_cpu_list(spec: str) -> list[int]:
    """The cores of a bind in vLLM's syntax ("0-3,5", ranks separated by "|"); [] for "auto", "nobind" or nothing."""
    cores: set[int] = set()
    for rank in spec.split("|"):
        for part in rank.split(","):
            part = part.strip()
            if not part or not part[0].isdigit():
                continue
            lo, _, hi = part.partition("-")
            cores.update(range(int(lo), int(hi or lo) + 1))
    return sorted(cores)


def engine_core_cpus(environ: dict[str, str] | None = None) -> list[int]:
    """Where this worker's vLLM engine core should run: the cores of its bind (its share, or the user's), [] when
    vLLM binds itself ("auto": it keeps a core back for the engine core) or nothing is bound."""
    environ = os.environ if environ is None else environ
    return parse_cpu_list(environ.get(BIND_ENV, ""))


def _threads(pids: list[int]) -> Iterator[int]:
    """The thread ids of the processes `pids` (Linux sets affinity and nice per thread); a process whose threads
    cannot be listed yields its own id, which the caller's call then skips if it is gone."""
    for pid in pids:
        try:
            yield from (int(t) for t in os.listdir(f"/proc/{pid}/task"))
        except OSError:
            yield pid


def pin_threads(pids: list[int], cpus: list[int]) -> int:
    """Set the CPU affinity of every thread of the processes `pids` to `cpus` (threads started later take their
    creator's); returns how many threads were set. A thread that is gone, or a core this process may not use, is
    skipped."""
    pinned = 0
    for tid in _threads(pids):
        try:
            os.sched_setaffinity(tid, cpus)
            pinned += 1
        except OSError:
            continue
    return pinned


# -- the engine's processes and the request path on shared cores ---------------------------------------------
# vLLM's engine core and model executor wait for each other in busy loops (a shared-memory ring polled with
# sched_yield). On a CPU-only machine those loops run on the same cores as the farm's request path (the worker's
# Celery consumer and stream writer, the API, Redis): measured on 2 cores, a process that wanted to run every
# millisecond waited up to 300-800 ms for a core while vLLM's two processes spun, and requests sat that long
# between Redis and the engine. Lowered in priority, the loops give way at once to anything else that has work,
# and keep every core when nothing else has: the engine loses no throughput (it computes whenever the request
# path is idle), the request path stops queueing behind spinning. On a GPU host the spinning is off the path's
# cores, so nothing is changed there by default.
CPU_ENGINE_NICE = 19


def engine_nice(setting: int | None, device: str) -> int:
    """The nice value for the vLLM engine's processes: the model's `vllm.engine_nice`, else 19 on CPU, 0 elsewhere."""
    if setting is not None:
        return setting
    return CPU_ENGINE_NICE if device == "cpu" else 0


def ring_wait(setting: str | None, device: str) -> str:
    """How vLLM's processes wait for each other's messages (farm.backends.vllm_plugin): the model's
    `vllm.ring_wait`, else "block" on CPU, where a spinning engine core stretches its own executor's steps on the
    cores they share, and "spin" (vLLM's own) with a GPU, where the spinning runs beside idle cores."""
    if setting is not None:
        return setting
    return "block" if device == "cpu" else "spin"


def lower_priority(pids: list[int], nice: int) -> int:
    """Set `nice` on every thread of the processes `pids` (Linux keeps a nice value per thread, and the threads
    these processes start later take their creator's); returns how many threads were changed. Raising nice needs
    no privilege; a thread that is gone or not ours is skipped."""
    changed = 0
    for tid in _threads(pids):
        try:
            if os.getpriority(os.PRIO_PROCESS, tid) < nice:
                os.setpriority(os.PRIO_PROCESS, tid, nice)
                changed += 1
        except OSError:
            continue
    return changed
