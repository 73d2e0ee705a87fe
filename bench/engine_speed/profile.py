"""--profile: where the farm's Python processes spend their time while they serve the largest level.

A background thread waits `delay_s` into the level, measures the CPU of the farm's API (gunicorn) processes
and worker processes over `pick_s` to find the hottest of each kind (gunicorn's master and Celery's helpers
idle), then runs `py-spy record --nonblocking -r 50 -f raw -d <seconds>` on both at once (nonblocking: the
target is never paused; no --subprocesses: vLLM's engine processes are not the farm's Python). The raw
(collapsed-stack) files go to bench/out/; the report is each process's top frames by inclusive share of its
samples (py-spy leaves idle threads out, so a share is of the time the process had a thread on the CPU or
in a system call). py-spy's own CPU shows as "reaped children" in the CPU table, not as the client's.
"""

from __future__ import annotations

import re
import subprocess
import sys
import threading
from collections import Counter
from pathlib import Path
from typing import Any

from bench.common import table
from bench.cpu import FARM_API, FARM_WORKER, cpu_seconds, processes_of

PY_SPY = Path(sys.executable).parent / "py-spy"
_LINE = re.compile(r":\d+\)$")


def _frame(f: str) -> str:
    """'fn (/long/path/site-packages/pkg/mod.py:123)' -> 'fn (pkg/mod.py)': one entry per function."""
    f = _LINE.sub(")", f)
    for cut in ("site-packages/", "/work/main/", "/tmp/farm-head/", "lib/python3.11/"):
        if cut in f:
            head, _, tail = f.partition("(")
            f = head + "(" + tail.split(cut, 1)[-1]
    return f


def top_frames(raw: Path, n: int = 25) -> dict[str, Any]:
    """Inclusive (and self) share of samples per function in a py-spy raw file."""
    inclusive: Counter[str] = Counter()
    own: Counter[str] = Counter()
    total = 0
    for line in raw.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        k = int(count)
        frames = [_frame(f) for f in stack.split(";")]
        total += k
        for f in set(frames):
            inclusive[f] += k
        own[frames[-1]] += k
    rows = [{"frame": f, "inclusive": c / total, "self": own[f] / total} for f, c in inclusive.most_common(n)] \
        if total else []
    return {"samples": total, "top": rows}


def frames_table(prof: dict[str, Any]) -> str:
    return table(["#", "inclusive %", "self %", "frame"],
                 [[i + 1, 100 * r["inclusive"], 100 * r["self"], r["frame"][:150]]
                  for i, r in enumerate(prof["top"])], digits=1)


class Profiler(threading.Thread):
    """Start before the level, join() after it: `result` then holds what was profiled."""

    def __init__(self, out_dir: Path, tag: str, seconds: float = 10.0, delay_s: float = 2.0, pick_s: float = 3.0,
                 kinds: tuple[str, ...] = (FARM_API, FARM_WORKER)) -> None:
        super().__init__(name=f"profile-{tag}", daemon=True)
        self.out_dir, self.tag, self.seconds = out_dir, tag, seconds
        self.delay_s, self.pick_s, self.kinds = delay_s, pick_s, kinds
        self.result: dict[str, Any] = {}
        self._procs: list[subprocess.Popen] = []
        self._cancel = threading.Event()

    def run(self) -> None:
        try:
            self._run()
        except Exception as e:  # noqa: BLE001 - a failed profile must not fail the level
            self.result["error"] = f"{type(e).__name__}: {e}"

    def _run(self) -> None:
        if self._cancel.wait(self.delay_s):
            return
        cands = {kind: processes_of(kind) for kind in self.kinds}
        before = {p.pid: cpu_seconds(p) for ps in cands.values() for p in ps}
        if self._cancel.wait(self.pick_s):
            return
        chosen: dict[str, Any] = {}
        rates: dict[str, list[dict[str, Any]]] = {}
        for kind, ps in cands.items():
            rated = sorted((((cpu_seconds(p) - before.get(p.pid, 0.0)) / self.pick_s, p) for p in ps),
                           key=lambda rp: rp[0])
            rates[kind] = [{"pid": p.pid, "cores": round(r, 3)} for r, p in rated]
            if rated:
                chosen[kind] = rated[-1][1]
        self.result["cpu_cores_while_picking"] = rates
        self.out_dir.mkdir(parents=True, exist_ok=True)
        files: dict[str, Path] = {}
        for kind, p in chosen.items():
            slug = "api" if kind == FARM_API else "worker"
            files[kind] = self.out_dir / f"engine_speed-{self.tag}-{slug}-{p.pid}.raw.txt"
            cmd = [str(PY_SPY), "record", "--nonblocking", "-r", "50", "-f", "raw", "-d", str(int(self.seconds)),
                   "-p", str(p.pid), "-o", str(files[kind])]
            self._procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
        outs = [proc.communicate(timeout=self.seconds + 60)[0].decode(errors="replace") for proc in self._procs]
        self.result["processes"] = {}
        for (kind, path), (p, out) in zip(files.items(), zip(chosen.values(), outs, strict=True), strict=True):
            entry: dict[str, Any] = {"pid": p.pid, "raw": str(path), "py_spy": out.strip().splitlines()[-3:]}
            try:
                entry["cmdline"] = " ".join(p.cmdline())[:200]
            except Exception:  # noqa: BLE001 - it may have exited
                entry["cmdline"] = "?"
            if path.exists():
                entry.update(top_frames(path))
            self.result["processes"][kind] = entry

    def stop(self, kill: bool = False) -> None:
        """Wait for the profile to end; with `kill` (Ctrl-C, an exception) kill py-spy first."""
        if kill:
            self._cancel.set()
            for proc in self._procs:
                if proc.poll() is None:
                    proc.kill()
        self.join(timeout=self.delay_s + self.pick_s + self.seconds + 90)


def print_profile(contender: str, streams: int, result: dict[str, Any]) -> None:
    print(f"\nProfile of {contender} at {streams} streams (py-spy, 50 Hz, nonblocking)")
    if result.get("error"):
        print(f"  profiling failed: {result['error']}")
    print(f"  CPU cores while picking: {result.get('cpu_cores_while_picking')}")
    for kind, entry in (result.get("processes") or {}).items():
        print(f"\n  {kind}: pid {entry['pid']} ({entry.get('cmdline', '')[:90]}), {entry.get('samples', 0)} samples; "
              f"raw: {entry['raw']}")
        if entry.get("top"):
            print(frames_table(entry))
        else:
            print(f"  no samples; py-spy said: {entry.get('py_spy')}")
