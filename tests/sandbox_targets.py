"""Targets for tests/test_sandbox.py, run in the sandbox's child process (farm.infra.sandbox)."""

from __future__ import annotations

import os
import signal
import sys
import time
from typing import Any


def echo(arg: Any) -> Any:
    return {"got": arg, "pid": os.getpid()}


def segfault(_arg: Any) -> None:
    os.kill(os.getpid(), signal.SIGSEGV)  # what a native stack overflow does to the process


def sleep(seconds: float) -> None:
    time.sleep(seconds)


def fail(message: str) -> None:
    raise ValueError(message)


def nest(depth: int) -> int:
    """Native recursion on the call's thread (the repr of lists nested `depth` deep, in C), as a grammar
    compiler's: deep enough, it needs more than the sandbox's small stack."""
    sys.setrecursionlimit(depth + 1000)
    value: list = []
    for _ in range(depth):
        value = [value]
    return len(repr(value))
