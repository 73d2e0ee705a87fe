"""The decode step on static buffers, replayed as CUDA graphs on CUDA (after nano-vllm's capture_cudagraph).

A CUDA graph replays fixed kernels on fixed addresses, so every tensor the step reads lives in a buffer
allocated once, at the largest shape: token ids, positions, slot mapping, context lengths and block
tables padded to `max_blocks` per sequence. A live batch of n sequences is padded up to the next
captured batch size `bs` (padded rows: token 0 at position 0, context length 1, writing and reading only
the scratch block that the block pool never hands out), its block tables up to a width, and the step for
(bs, width) is replayed; the first n rows of the output are the logits.

Width: with the Triton paged kernel, which stops at each row's own length, it is always `max_blocks`
(one graph per batch size, all captured at start). With the torch gather backend the gather cost grows
with the width, so widths are bucketed to powers of two and their graphs captured on first use.

On CPU (or with graphs off) the very same buffers, bucketing and forward run without capture: that is
what CI exercises. `enforce_eager` in the engine config bypasses all of this.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import numpy as np
import torch

from farm.config import validate_batch_sizes

log = logging.getLogger(__name__)

DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64)

StepFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def batch_bucket(n: int, sizes: Sequence[int]) -> int | None:
    """The smallest captured batch size >= n (sizes sorted), or None when n is above them all."""
    for s in sizes:
        if s >= n:
            return s
    return None


def width_bucket(blocks: int, max_blocks: int) -> int:
    """Block-table width for a batch whose longest sequence needs `blocks`: the next power of two,
    capped at `max_blocks` (few distinct widths -> few graphs; at most 2x the gather work)."""
    if blocks > max_blocks:
        raise ValueError(f"{blocks} blocks exceed the {max_blocks} per sequence")
    return min(max_blocks, 1 << max(0, (blocks - 1).bit_length()))


class StaticDecode:
    def __init__(self, step: StepFn, *, device: torch.device, batch_sizes: Sequence[int], max_blocks: int,
                 block_size: int, scratch_block: int, fixed_width: bool, use_graphs: bool):
        self.step = step
        self.device = device
        self.batch_sizes = validate_batch_sizes(batch_sizes)
        self.max_bs = self.batch_sizes[-1]
        self.max_blocks = max_blocks
        self.block_size = block_size
        self.scratch_block = scratch_block
        self.scratch_slot = scratch_block * block_size
        self.fixed_width = fixed_width
        self.use_graphs = use_graphs
        with torch.inference_mode():
            z = {"device": device}
            self.input_ids = torch.zeros(self.max_bs, dtype=torch.long, **z)
            self.positions = torch.zeros(self.max_bs, dtype=torch.long, **z)
            self.slots = torch.full((self.max_bs,), self.scratch_slot, dtype=torch.long, **z)
            self.ctx_lens = torch.ones(self.max_bs, dtype=torch.int32, **z)
            self.block_tables = torch.full((self.max_bs, max_blocks), scratch_block, dtype=torch.int32, **z)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}
        self.pool = None
        self.replays = 0  # steps served (replayed, or run graph-less)
        self.last_key: tuple[int, int] | None = None
        self.padded: set[tuple[int, int]] = set()  # (live rows, padded batch size) seen: for stats and tests

    # -- planning ----------------------------------------------------------------------------------------
    def fits(self, n: int, blocks: int) -> bool:
        return n <= self.max_bs and blocks <= self.max_blocks

    def plan(self, n: int, blocks: int) -> tuple[int, int]:
        """(padded batch size, block-table width) for n sequences whose longest needs `blocks` blocks."""
        bs = batch_bucket(n, self.batch_sizes)
        if bs is None:
            raise ValueError(f"batch of {n} is above the largest captured size {self.max_bs}")
        return bs, self.max_blocks if self.fixed_width else width_bucket(blocks, self.max_blocks)

    # -- buffers --------------------------------------------------------------------------------------------
    def load(self, token_ids: Sequence[int], positions: Sequence[int], block_tables: Sequence[Sequence[int]],
             bs: int, width: int) -> None:
        """Write a live batch into rows [0, bs) and columns [0, width) of the buffers, padding the rest of
        those rows with the scratch block. Built on the host, then one copy per buffer."""
        n = len(token_ids)
        b = self.block_size
        ids = np.zeros(bs, dtype=np.int64)
        pos = np.zeros(bs, dtype=np.int64)
        slots = np.full(bs, self.scratch_slot, dtype=np.int64)
        ctx = np.ones(bs, dtype=np.int32)
        bt = np.full((bs, width), self.scratch_block, dtype=np.int32)
        ids[:n] = token_ids
        pos[:n] = positions
        ctx[:n] = pos[:n] + 1
        for i, (row, p) in enumerate(zip(block_tables, positions, strict=True)):
            k = min(len(row), width)
            bt[i, :k] = row[:k]
            slots[i] = row[p // b] * b + p % b
        nb = self.device.type == "cuda"
        self.input_ids[:bs].copy_(torch.from_numpy(ids), non_blocking=nb)
        self.positions[:bs].copy_(torch.from_numpy(pos), non_blocking=nb)
        self.slots[:bs].copy_(torch.from_numpy(slots), non_blocking=nb)
        self.ctx_lens[:bs].copy_(torch.from_numpy(ctx), non_blocking=nb)
        self.block_tables[:bs, :width].copy_(torch.from_numpy(bt), non_blocking=nb)

    def load_padding(self, bs: int, width: int) -> None:
        """Every row a padding row (capture: the warm-up run then only touches the scratch block)."""
        self.load([], [], [], bs, width)

    def _call(self, bs: int, width: int) -> torch.Tensor:
        return self.step(self.input_ids[:bs], self.positions[:bs], self.slots[:bs],
                         self.block_tables[:bs, :width], self.ctx_lens[:bs])

    # -- graphs ---------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def capture(self, bs: int, width: int) -> None:
        """Warm up (compiles kernels, sizes cuBLAS workspaces), then capture the step for (bs, width) into
        the shared memory pool. Uses whatever the buffers hold: writes go to the same slots a replay
        would write, so capturing with a live batch loaded is harmless."""
        self._call(bs, width)
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, self.pool):
            out = self._call(bs, width)
        if self.pool is None:
            self.pool = graph.pool()
        torch.cuda.synchronize(self.device)
        self.graphs[(bs, width)] = graph
        self.outputs[(bs, width)] = out

    def capture_all(self) -> None:
        """Capture every batch size at the fixed width, largest first (so the pool is sized once)."""
        t = self.max_blocks
        for bs in reversed(self.batch_sizes):
            self.load_padding(bs, t)
            self.capture(bs, t)
        log.info("captured decode CUDA graphs for batch sizes %s (block-table width %d)", self.batch_sizes, t)

    # -- one step -------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def run(self, token_ids: Sequence[int], positions: Sequence[int],
            block_tables: Sequence[Sequence[int]]) -> torch.Tensor:
        """Logits [n, vocab] for the live batch (a copy: the graph's output is reused by the next replay)."""
        n = len(token_ids)
        blocks = max(p // self.block_size + 1 for p in positions)
        bs, width = self.plan(n, blocks)
        self.load(token_ids, positions, block_tables, bs, width)
        self.last_key = (bs, width)
        self.replays += 1
        self.padded.add((n, bs))
        if not self.use_graphs:
            return self._call(bs, width)[:n]
        key = (bs, width)
        if key not in self.graphs:
            log.info("capturing decode CUDA graph for batch %d, width %d blocks", bs, width)
            self.capture(bs, width)
        self.graphs[key].replay()
        return self.outputs[key][:n].clone()
