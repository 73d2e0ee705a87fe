"""The disk tier's file arena: one file per engine under `<state_dir>/kvcache`, a slot per KV block.

Blocks are written with pwrite and read with pread into one staging buffer, not through a memory map:
a mapped page cannot be dropped from the page cache (posix_fadvise skips mapped pages), so a mapped arena
could never be measured cold, and a read could not be timed on its own. The page cache still absorbs
writes and keeps hot blocks, as for any file; `drop_page_cache()` (fsync, then POSIX_FADV_DONTNEED) makes
the next reads come from the device, which is what `read_rate()` measures once at start: the tier's
onboard-or-recompute policy (farm.kvcache.tiers) starts from the device's cold rate, never from a guess.

The arena is a real file in the farm's state directory (sparse: only written slots take space), locked
with flock by its engine and removed when the engine stops. An engine that was killed leaves its file
behind; the next arena created in that directory removes every arena whose lock nobody holds.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import itertools
import os
import time
from pathlib import Path

import torch

SUFFIX = ".arena"
PROBE_BYTES = 4 * 2**20  # what read_rate() writes, syncs, drops and reads back
_seq = itertools.count()


def remove_stale(directory: Path) -> list[Path]:
    """Remove the arenas in `directory` no live engine holds (their process was killed); returns them."""
    removed = []
    for path in directory.glob(f"*{SUFFIX}"):
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue  # held: a live engine's arena
        else:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
                removed.append(path)
        finally:
            os.close(fd)
    return removed


class DiskArena:
    """`capacity` block slots in a file of `directory`; one reader at a time (the engine thread)."""

    def __init__(self, directory: Path, capacity: int, block_shape: tuple[int, ...], dtype: torch.dtype):
        directory.mkdir(parents=True, exist_ok=True)
        remove_stale(directory)
        self._staging = torch.empty(block_shape, dtype=dtype)
        self._staging_bytes = self._staging.view(-1).view(torch.uint8).numpy()  # shares the tensor's memory
        self.block_bytes = self._staging_bytes.nbytes
        self.capacity = capacity
        name = f"kv-{os.getpid()}-{next(_seq)}"
        tmp = directory / f"{name}.tmp"
        self.fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # locked before anyone may see it as an arena
        os.ftruncate(self.fd, capacity * self.block_bytes)
        self.path = directory / f"{name}{SUFFIX}"
        os.replace(tmp, self.path)

    def write(self, slot: int, block: torch.Tensor) -> None:
        data = block.detach().to("cpu").contiguous().view(-1).view(torch.uint8).numpy()
        _pwrite_all(self.fd, memoryview(data), slot * self.block_bytes)

    def read(self, slot: int) -> torch.Tensor:
        _pread_all(self.fd, memoryview(self._staging_bytes), slot * self.block_bytes)
        return self._staging

    def drop_page_cache(self) -> None:
        """Write back and evict this file's pages, so the next reads come from the device."""
        os.fsync(self.fd)
        os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_DONTNEED)

    def read_rate(self, nbytes: int = PROBE_BYTES) -> float:
        """Bytes per second of cold block reads from this arena's device (written, synced, dropped, read
        back block by block, as onboarding reads), measured on the arena's first slots."""
        blocks = max(1, min(self.capacity, nbytes // max(self.block_bytes, 1)))
        payload = os.urandom(self.block_bytes)  # real bytes: a hole would read without any I/O
        for slot in range(blocks):
            _pwrite_all(self.fd, memoryview(payload), slot * self.block_bytes)
        self.drop_page_cache()
        t0 = time.perf_counter()
        for slot in range(blocks):
            self.read(slot)
        return blocks * self.block_bytes / max(time.perf_counter() - t0, 1e-9)

    def resident_fraction(self) -> float:
        """Share of the arena's written pages in the page cache (mincore): 0 after drop_page_cache()."""
        return resident_fraction(self.fd)

    def close(self) -> None:
        if self.fd < 0:
            return
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        os.close(self.fd)
        self.fd = -1


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while data:
        n = os.pwrite(fd, data, offset)
        data, offset = data[n:], offset + n


def _pread_all(fd: int, buf: memoryview, offset: int) -> None:
    while buf:
        n = os.preadv(fd, [buf], offset)
        if n == 0:
            raise OSError(f"KV arena: unexpected end of file at offset {offset}")
        buf, offset = buf[n:], offset + n


def resident_fraction(fd: int) -> float:
    """Share of a file's pages that sit in the page cache (mincore over a read-only map of it; mapping
    faults no page in). Holes of a sparse file count as not resident."""
    size = os.fstat(fd).st_size
    if size == 0:
        return 0.0
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    page = os.sysconf("SC_PAGE_SIZE")
    addr = libc.mmap(None, size, 0x1, 0x01, fd, 0)  # PROT_READ, MAP_SHARED
    if addr in (None, ctypes.c_void_p(-1).value):
        raise OSError(ctypes.get_errno(), "mmap failed")
    try:
        pages = (size + page - 1) // page
        vec = (ctypes.c_ubyte * pages)()
        if libc.mincore(addr, size, vec) != 0:
            raise OSError(ctypes.get_errno(), "mincore failed")
        return sum(b & 1 for b in vec) / pages
    finally:
        libc.munmap(addr, size)
