"""A worker process: its runtime (`runtime`: one engine, its transfer server and registry heartbeat, the Celery
tasks' entry points), the writer of its reply streams (`stream_writer`), and its guard thread (`watchdog`:
orphan-queue sweeps, the consumer watchdog). `from farm.worker import get_runtime` is how tasks reach it.
"""

from farm.worker.runtime import WorkerRuntime, get_runtime, set_runtime

__all__ = ["WorkerRuntime", "get_runtime", "set_runtime"]
