"""The one serve loop: supervise the children (restart what may be restarted), stop in order on a signal,
detach; `farm up`, `farm serve` and `farm planner run` (its step as the loop's tick) all run it."""

from __future__ import annotations

import contextlib
import signal
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any, Self

from farm.supervisor.procs import (
    MAX_WORKER_RESTARTS,
    RESTARTED_ROLES,
    STOP_SIGNALS,
    STOPPING_MESSAGE,
    FarmError,
    _kill_now,
    stop_ordered,
)
from farm.supervisor.progress import ProgressPrinter


class ServeLoop:
    """Farm's serve loop and ordered stop (a part of Farm, which holds the state they use)."""

    @contextlib.contextmanager
    def running(self, timeout: float = 300.0) -> Iterator[Self]:
        """Start, wait until healthy, hand the farm over, and stop it whatever happens (tests, benches)."""
        try:
            self.start()
            self.wait_healthy(timeout)
            yield self
        finally:
            self.stop()

    def wait(self, poll_s: float = 0.5, tick: Callable[[], bool | None] | None = None,
             tick_every_s: float = 1.0) -> int:
        """Foreground: watch the children until one fails for good; returns the exit status (1).

        A worker that dies is restarted (at most MAX_WORKER_RESTARTS times), so are the data nodes and
        sentinels of a managed Redis Sentinel set; the API, Flower or a single Redis dying stops the farm.
        Returns 0 once serve() received a stop signal (the caller then calls stop()); Ctrl-C without
        serve()'s handlers (KeyboardInterrupt) propagates to the caller. `tick` (the planner's step) runs
        every `tick_every_s` between looks; it returning False ends the wait with 0.
        """
        next_tick = 0.0
        while not self._stop_signals:
            status = self.supervise_once()
            if status is not None:
                return status
            if tick is not None and time.monotonic() >= next_tick:
                next_tick = time.monotonic() + tick_every_s
                if tick() is False:
                    return 0
            time.sleep(poll_s)
        return 0

    def supervise_once(self) -> int | None:
        """One look at every child: restart what may be restarted; 1 when one failed for good, else None."""
        for p in list(self.procs):
            if not self._stopping and p.popen is not None:
                self._rotate_log(p)
            if self._stopping or p.alive():
                continue
            if p.retiring:  # scaled down: it finished its requests and left
                self.procs.remove(p)
                self.write_state()
                continue
            rc = p.returncode
            restarted = RESTARTED_ROLES + (("redis", "sentinel") if self._redis_ha_managed else ())
            if p.role in restarted and p.restarts < MAX_WORKER_RESTARTS:
                command = self._rejoin_command(p) if p.role in ("redis", "sentinel") else p.command
                if command is None:
                    continue  # a primary that died: it rejoins as a replica once the sentinels promoted one
                p.command = command
                p.restarts += 1
                print(f"farm: {p.name} exited with status {rc}; restarting it "
                      f"({p.restarts}/{MAX_WORKER_RESTARTS}); log: {p.log}\n{p.tail(10)}", file=sys.stderr)
                self._spawn(p)
                self.write_state()
                continue
            print(f"farm: {p.name} exited with status {rc}; stopping the farm (log: {p.log})\n"
                  f"{p.tail(20)}", file=sys.stderr)
            return 1
        return None

    def stop(self, grace_s: float | None = None) -> None:
        """Workers first (SIGTERM: warm shutdown, up to the grace period, then SIGKILL), then the API,
        Flower, and Redis last. A second Ctrl-C while stopping kills what is left at once."""
        self._stopping = True
        try:
            stop_ordered(self.procs, self.grace_s if grace_s is None else grace_s,
                         abort=self._kill_requested)
        except KeyboardInterrupt:
            print("farm: killing what is left", file=sys.stderr)
            _kill_now(self.procs)
        finally:
            for p in self.procs:
                p.reap()
            if self._owns_state:  # never touch the farm.json of another farm
                if not any(p.alive() for p in self.procs):
                    self.state_path.unlink(missing_ok=True)
                    self._owns_state = False
                else:
                    self.write_state()
            self._stopping = False

    def _on_stop_signal(self, signum: int, _frame: Any) -> None:
        """serve()'s handler of Ctrl-C, SIGTERM (`farm down`) and SIGHUP, installed whatever this process
        inherited: a shell starting a command in the background (`make test &`, CI runners) makes it ignore
        SIGINT, and a supervisor that kept that disposition ignored Ctrl-C for good (issue 17: the test timed
        out and its redis-server lived on). During start-up the first signal interrupts at once
        (KeyboardInterrupt); after that signals are only counted, never raised into whatever the main thread
        is doing (raised between a lock's acquire and its `try`, in subprocess's waitpid bookkeeping, it left
        a child looking alive forever): wait() returns on the first, stop_ordered() kills on the second."""
        self._stop_signals += 1
        if self._starting and not self._stopping and self._stop_signals == 1:
            raise KeyboardInterrupt(signal.Signals(signum).name)

    def _kill_requested(self) -> bool:
        """stop_ordered()'s abort: a second stop signal arrived while stopping."""
        if self._stop_signals > 1 and not self._kill_announced:
            self._kill_announced = True
            print("farm: killing what is left", file=sys.stderr, flush=True)
        return self._stop_signals > 1

    def detach(self) -> None:
        """Leave the children running on their own (`farm up --detach`); farm.json keeps their pids."""
        self.supervisor = False
        self.write_state()
        for p in self.procs:
            p.popen = None

    def serve(self, timeout: float = 300.0, detach: bool = False, tick: Callable[[], bool | None] | None = None,
              tick_every_s: float = 1.0) -> int:
        """`farm up` (and `farm planner run` with the local actuator, whose step is `tick`): start, wait until
        healthy, print the URLs; then detach or supervise until Ctrl-C."""
        handlers = {s: signal.getsignal(s) for s in STOP_SIGNALS}
        for s in handlers:
            signal.signal(s, self._on_stop_signal)
        self.supervisor = not detach
        self.bound = not detach  # a detached farm's children must outlive `farm up`
        detached = False
        try:
            try:
                self._starting = True
                self.start()
                self.wait_healthy(timeout, progress=ProgressPrinter(sys.stderr))
            except FarmError as e:
                print(f"farm: failed to start: {e}", file=sys.stderr)
                return 1
            finally:
                self._starting = False
            urls = self.urls()
            print("farm is up:")
            if urls["api"]:
                print(f"  API     {urls['api']}")
            if urls["flower"]:
                print(f"  Flower  {urls['flower']}")
            print(f"  Redis   {urls['redis']}" + ("  (managed)" if self.redis_managed else ""))
            workers = ", ".join(f"{n} ({m})" for n, _r, m in self.expected_workers) or "none"
            print(f"  Workers {workers}")
            print(f"  Logs    {self.log_dir}")
            if detach:
                self.detach()
                detached = True
                print("running in the background; `farm status` shows it, `farm down` stops it")
                return 0
            print("press Ctrl-C to stop", flush=True)
            status = self.wait(tick=tick, tick_every_s=tick_every_s)
            if self._stop_signals:
                print(STOPPING_MESSAGE, file=sys.stderr, flush=True)
            return status
        except KeyboardInterrupt:
            print(STOPPING_MESSAGE, file=sys.stderr, flush=True)
            return 0
        finally:
            if not detached:
                self.stop()
            for s, h in handlers.items():
                signal.signal(s, h)
