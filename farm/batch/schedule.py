"""The order a batch's lines are dispatched in.

`input`: file order. `prefix`: lines sorted by the block hashes of their tokenized prompt
(`farm.protocol.hashing.block_hashes` with each model's block size). The hashes are chained, so equal
leading hashes mean an equal token prefix, and sorting the hash sequences puts lines that share a prefix
next to each other, the longest shared prefixes closest, at every depth (a trie walk). Dispatched in that
order, the KV-aware router (which scores workers by the prompt's cached blocks) sends each run of lines
to the worker that already holds their prefix, and the run finishes before the cache has to make room.

One refinement, because a worker's prefix cache only knows blocks that are computed: lines admitted
together all compute a prefix none of them has yet. So in `prefix` mode a line whose prompt shares at
least `warm_min_blocks` more blocks with a line still in prefill than with prefixes already computed
waits until that prefill is done (its first token), then reuses the blocks; other prefixes are
dispatched meanwhile. Checking is cheap: a chain's hashes are in a set for every depth up to the deepest
present, so the shared depth is a binary search.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Sequence

from farm.batch.validate import PreparedLine
from farm.protocol.hashing import block_hashes


def _depth(hashes: Sequence[int], present) -> int:
    """How many leading hashes of a chain are in `present` (membership is prefix-closed)."""
    lo, hi = 0, len(hashes)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if hashes[mid - 1] in present:
            lo = mid
        else:
            hi = mid - 1
    return lo


BlockSize = int | Callable[[str], int]  # one block size, or the block size of each model


def prefix_order(lines: Sequence[PreparedLine], block_size: BlockSize) -> tuple[list[PreparedLine], dict[int, list[int]]]:
    """Lines sorted so shared prefixes are adjacent, and each line's block hashes (by line index), each
    hashed with its model's block size."""
    size = block_size if callable(block_size) else (lambda _model: block_size)
    hashes = {ln.index: block_hashes(ln.prompt_ids, size(ln.model)) for ln in lines}
    ordered = sorted(lines, key=lambda ln: (ln.model, hashes[ln.index], ln.index))
    return ordered, hashes


class Plan:
    """Hands out the next line to run; thread-safe (line threads report prefill completion)."""

    def __init__(self, lines: Sequence[PreparedLine], mode: str, block_size: BlockSize, warm_min_blocks: int = 2,
                 lookahead: int = 512):
        self.mode = mode
        self.warm_min_blocks = warm_min_blocks if mode == "prefix" else 0
        self.lookahead = lookahead
        if mode == "prefix":
            self.queue, self.hashes = prefix_order(lines, block_size)
        else:
            self.queue, self.hashes = sorted(lines, key=lambda ln: ln.index), {}
        self.taken = [False] * len(self.queue)
        self.head = 0
        self.left = len(self.queue)
        self.retry: list[tuple[float, PreparedLine]] = []
        self.warm: dict[str, set[int]] = {}
        self.pending: dict[str, Counter[int]] = {}
        self._prefilling: set[int] = set()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return self.left + len(self.retry)

    def order(self) -> list[int]:
        return [ln.index for ln in self.queue]

    def next(self, now: float) -> PreparedLine | None:
        """The next line that may start now, or None (nothing left, or everything left must wait)."""
        with self._lock:
            for i, (t, ln) in enumerate(self.retry):
                if t <= now:
                    del self.retry[i]
                    self._start(ln)
                    return ln
            scanned = 0
            i = self.head
            while i < len(self.queue) and scanned < self.lookahead:
                if not self.taken[i]:
                    ln = self.queue[i]
                    if not self._blocked(ln):
                        self.taken[i] = True
                        self.left -= 1
                        while self.head < len(self.queue) and self.taken[self.head]:
                            self.head += 1
                        self._start(ln)
                        return ln
                    scanned += 1
                i += 1
            return None

    def again(self, line: PreparedLine, at: float) -> None:
        """Run `line` again from time `at` on (after finished() was called for its last run)."""
        with self._lock:
            self.retry.append((at, line))

    def prefilled(self, line: PreparedLine) -> None:
        """The line's prompt is computed on its worker: its prefix is now cached there."""
        with self._lock:
            hs = self._end(line)
            if hs:
                self.warm.setdefault(line.model, set()).update(hs)

    def finished(self, line: PreparedLine) -> None:
        with self._lock:
            self._end(line)

    # -- internals (under the lock) -------------------------------------------------------------------
    def _blocked(self, line: PreparedLine) -> bool:
        if not self.warm_min_blocks:
            return False
        hs = self.hashes.get(line.index)
        pend = self.pending.get(line.model)
        if not hs or not pend:
            return False
        in_prefill = _depth(hs, pend)
        if in_prefill < self.warm_min_blocks:
            return False
        return in_prefill - _depth(hs, self.warm.get(line.model, ())) >= self.warm_min_blocks

    def _start(self, line: PreparedLine) -> None:
        hs = self.hashes.get(line.index)
        if self.warm_min_blocks and hs and line.index not in self._prefilling:
            self._prefilling.add(line.index)
            self.pending.setdefault(line.model, Counter()).update(hs)

    def _end(self, line: PreparedLine) -> list[int] | None:
        if line.index not in self._prefilling:
            return None
        self._prefilling.discard(line.index)
        hs = self.hashes[line.index]
        pend = self.pending[line.model]
        pend.subtract(hs)
        for h in hs:
            if pend[h] <= 0:
                del pend[h]
        return hs
