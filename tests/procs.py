"""Start and stop real farm worker processes for integration tests."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import redis

from farm.cluster import registry
from farm.infra.orphans import die_with_parent

ROOT = Path(__file__).resolve().parents[1]


def run_python(code: str, env: dict[str, str] | None = None, timeout: float = 300) -> dict:
    """`code` (dedented) in a fresh interpreter started in the checkout, for what a test must not do to its own
    process (monkey-patch it, freeze its heap, fork it); its last line of output, read as JSON."""
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                         timeout=timeout, cwd=ROOT, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


class WorkerProc:
    def __init__(self, env: dict[str, str], role: str, name: str, log_dir: Path, extra_env=None):
        self.name = name if "@" in name else f"{name}@{os.uname().nodename}"
        self.log = log_dir / f"{name}.log"
        full_env = {**os.environ, **env, **(extra_env or {})}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tasks.worker", "--role", role, "--name", self.name, "--concurrency", "16",
             "--loglevel", "WARNING"],
            cwd=ROOT, env=full_env, stdout=self.log.open("wb"), stderr=subprocess.STDOUT,
            preexec_fn=die_with_parent(),  # never outlives the test process, even when that is killed
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def tail(self, n: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def stop(self, timeout: float = 30) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()


def wait_registered(r: redis.Redis, procs: list[WorkerProc], timeout: float = 120) -> None:
    deadline = time.time() + timeout
    want = {p.name for p in procs}
    while time.time() < deadline:
        have = {w.worker_id for w in registry.live_workers(r)}
        if want <= have:
            return
        for p in procs:
            if p.proc.poll() is not None:
                raise RuntimeError(f"worker {p.name} exited:\n{p.tail()}")
        time.sleep(0.2)
    raise TimeoutError(f"workers not registered: {want - have}")


def send_and_read(gw, req, task: str, args_after_request: list, queue: str):
    """Send `req`'s task by hand (to `queue`, e.g. a dead worker's own) and read it as the gateway reads the
    requests it places itself: its reader named in the request, a mailbox opened before the task leaves."""
    from farm.gateway import Dispatch, Placed, Submission

    gw.replies.start()
    req.reply_to, req.lease_s = gw.replies.reader_id, gw.cfg.reliability.lease_ttl_s
    box = gw.replies.open(req.request_id)
    gw.placer.publisher.send(task, [req.to_dict(), *args_after_request], queue)
    return Submission(gw._svc, req, Placed("decode-only", {}, Dispatch(task, "")), box)
