"""Same-host shared memory for KV transfer: blocks are gathered straight into a file in /dev/shm.

The prefill worker gathers the held blocks straight into a memory-mapped file; the decode worker maps
the same file and the engine copies from it into its own cache: no bytes objects, no socket copies. The file is unlinked as soon as the receiver
has mapped it, so nothing is left behind if either side dies. Only names the farm created
(`/dev/shm/farm-kv-<hex>`) are accepted, so a handle cannot make a worker map an arbitrary file.
"""

from __future__ import annotations

import os
import re
import secrets
from functools import lru_cache
from pathlib import Path

import torch

SHM_DIR = Path("/dev/shm")
_NAME = re.compile(r"^/dev/shm/farm-kv-[0-9a-f]{32}$")


@lru_cache(maxsize=1)
def host_id() -> str:
    """Identity of this host *and* network namespace: two processes with the same id share /dev/shm
    and loopback; different network namespaces count as different hosts (they talk over TCP)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = os.uname().nodename
    try:
        netns = os.stat("/proc/self/ns/net").st_ino
    except OSError:
        netns = 0
    return f"{boot}:{netns}"


def available() -> bool:
    return SHM_DIR.is_dir() and os.access(SHM_DIR, os.W_OK)


def export_to_shm(read_blocks, block_ids: list[int], shape: tuple[int, ...], dtype: torch.dtype) -> tuple[str, int]:
    """Gather blocks (with `read_blocks(ids, out=...)`) into a new shared-memory file; returns
    (path, nbytes). `shape` is the gathered shape [layers, 2, n, block_size, kv_heads, head_dim]."""
    nbytes = int(torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size())
    path = str(SHM_DIR / f"farm-kv-{secrets.token_hex(16)}")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.posix_fallocate(fd, 0, nbytes)  # allocate the pages now: the gather then writes, not faults
    finally:
        os.close(fd)
    try:
        raw = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
        read_blocks(block_ids, out=raw.view(dtype).view(shape))
        del raw
    except Exception:
        os.unlink(path)
        raise
    return path, nbytes


def import_from_shm(path: str, nbytes: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """Map a file made by export_to_shm and unlink it; the tensor stays valid while referenced."""
    if not _NAME.match(path):
        raise ValueError(f"refusing shared-memory path {path!r}")
    try:
        raw = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)  # maps, never copies
    finally:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
    return raw.view(dtype).view(shape)


def discard(path: str) -> None:
    if _NAME.match(path):
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
