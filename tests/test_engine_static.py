"""The static-buffer decode step (the CUDA-graph path, run graph-less on CPU) against the eager decode:
bucketing, padding, sequences joining and leaving, prefix-cached sequences, config validation, and the
Triton paged kernel (under TRITON_INTERPRET=1 when triton is installed)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest
import torch

from farm.config import ConfigError, EngineConfig, load_config
from farm.engine.engine import Engine
from farm.engine.model_runner import ModelRunner, PrefillChunk
from farm.engine.paged_attention import num_partitions, pick_backend
from farm.engine.static_decode import batch_bucket, width_bucket
from farm.protocol import SamplingParams

SIZES = [1, 2, 4, 8, 16]


# -- bucketing and config -------------------------------------------------------------------------------
def test_batch_bucket_picks_the_next_captured_size():
    assert [batch_bucket(n, SIZES) for n in (1, 2, 3, 4, 5, 8, 9, 16)] == [1, 2, 4, 4, 8, 8, 16, 16]
    assert batch_bucket(17, SIZES) is None


def test_width_bucket_is_a_power_of_two_capped_at_max_blocks():
    assert [width_bucket(b, 100) for b in (1, 2, 3, 5, 16, 17, 64, 65, 100)] == [1, 2, 4, 8, 16, 32, 64, 100, 100]
    with pytest.raises(ValueError):
        width_bucket(101, 100)


def test_engine_config_validates_graph_batch_sizes():
    assert EngineConfig().cuda_graph_batch_sizes == [1, 2, 4, 8, 16, 32, 64]
    assert EngineConfig(cuda_graph_batch_sizes=[8, 1, 4]).cuda_graph_batch_sizes == [1, 4, 8]
    for bad in ([], [0, 4], [4, 4], [2048]):
        with pytest.raises(ValueError):
            EngineConfig(cuda_graph_batch_sizes=bad)
    with pytest.raises(ValueError):
        EngineConfig(decode_attention="flash")
    cfg = load_config(environ={"FARM_ENGINE__CUDA_GRAPH_BATCH_SIZES": "[1, 3]", "FARM_ENGINE__ENFORCE_EAGER": "true"})
    assert cfg.engine.cuda_graph_batch_sizes == [1, 3] and cfg.engine.enforce_eager
    with pytest.raises(ConfigError, match="cuda_graph_batch_sizes"):
        load_config(environ={"FARM_ENGINE__CUDA_GRAPH_BATCH_SIZES": "[2, 2]"})


def test_backend_choice():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert pick_backend("auto", cpu, 16) == "torch"
    assert pick_backend("torch", cuda, 16) == "torch"
    assert pick_backend("triton", cuda, 12) == "torch"  # not a power of two: falls back
    assert num_partitions(1, 8) == 16 and num_partitions(64, 8) == 1


# -- the runner: static path == eager path ----------------------------------------------------------------
@pytest.fixture(scope="module")
def runner(tiny_model_dir) -> ModelRunner:
    return ModelRunner(tiny_model_dir, block_size=4, kv_cache_bytes=8 * 2**20, max_num_blocks=256,
                       max_model_len=256, graph_batch_sizes=SIZES)


def _prefill(runner: ModelRunner, prompts: list[list[int]], first_block: int) -> list[list[int]]:
    tables, nxt = [], first_block
    for p in prompts:
        n = -(-(len(p) + 8) // runner.block_size)  # room for 8 decode steps
        tables.append(list(range(nxt, nxt + n)))
        nxt += n
        runner.prefill([PrefillChunk(p, 0, tables[-1])])
    return tables


@pytest.mark.parametrize("n", [1, 3, 5, 6, 16])
def test_static_decode_equals_eager_with_padding(runner, n):
    torch.manual_seed(n)
    prompts = [torch.randint(100, 40000, (int(torch.randint(1, 30, ())),)).tolist() for _ in range(n)]
    tables = _prefill(runner, prompts, first_block=0)
    assert max(t[-1] for t in tables) < runner.num_blocks
    ids = [p[-1] for p in prompts]
    pos = [len(p) for p in prompts]
    kv_before = runner.kv[:, :, :runner.scratch_block].clone()
    got = runner.decode(ids, pos, tables)  # static buffers (graph-less on CPU)
    bs, width = runner.static.last_key
    assert bs == batch_bucket(n, SIZES) and width == width_bucket(max(p // 4 + 1 for p in pos), runner.max_blocks_per_seq)
    # padded rows wrote only the scratch block; live rows only their own slot
    changed = (runner.kv[:, :, :runner.scratch_block] != kv_before).flatten(4).any(-1).any(0).any(0)  # [blocks, bs]
    live = {(t[p // 4], p % 4) for t, p in zip(tables, pos, strict=True)}
    assert {(int(b), int(o)) for b, o in changed.nonzero().tolist()} <= live
    want = runner.decode_eager(ids, pos, tables)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert got.argmax(-1).tolist() == want.argmax(-1).tolist()


def test_batch_above_the_largest_size_falls_back_to_eager(runner):
    prompts = [list(range(500 + 7 * i, 510 + 7 * i)) for i in range(17)]
    tables = _prefill(runner, prompts, first_block=0)
    before = runner.static.replays
    got = runner.decode([p[-1] for p in prompts], [len(p) for p in prompts], tables)
    assert runner.static.replays == before and got.shape[0] == 17


# -- the engine: static vs enforce_eager, requests joining, leaving, prefix-cached ------------------------
class Collector:
    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.cached = 0
        self.done = threading.Event()

    def __call__(self, out) -> None:
        self.tokens.extend(out.token_ids)
        if out.finished:
            self.cached = out.cached_tokens
            self.done.set()


def _workload(eng: Engine) -> dict[str, Collector]:
    """Requests of different lengths (so they leave at different steps) submitted in three waves (so
    they join a running batch), the last wave sharing a long prefix with the first."""
    shared = list(range(7000, 7040))
    waves = [
        [("a0", shared + [1, 2, 3], 12), ("a1", list(range(100, 113)), 5), ("a2", list(range(200, 207)), 9)],
        [("b0", list(range(300, 333)), 7), ("b1", [42], 11), ("b2", list(range(400, 420)), 3),
         ("b3", list(range(500, 509)), 6)],
        [("c0", shared + [9, 8], 8), ("c1", shared + [5], 4)],
    ]
    outs: dict[str, Collector] = {}
    for w, wave in enumerate(waves):
        for rid, prompt, n in wave:
            outs[rid] = Collector()
            eng.submit(rid, prompt, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True), outs[rid])
        if w == 0:  # let the first wave decode a few steps, then join
            while len(outs["a0"].tokens) < 3:
                time.sleep(0.005)
        if w == 1:  # wait until a0 finished so its prefix blocks are cached for wave 3
            assert outs["a0"].done.wait(60)
    for c in outs.values():
        assert c.done.wait(120)
    return outs


def test_engine_static_path_matches_eager_engine(tiny_model_dir):
    mk = lambda eager: Engine(tiny_model_dir, EngineConfig(block_size=4, max_num_batched_tokens=64,  # noqa: E731
                                                           enforce_eager=eager, cuda_graph_batch_sizes=[1, 2, 4, 8]),
                              max_model_len=256).start()
    static, eager = mk(False), mk(True)
    try:
        assert eager.runner.static is None and static.runner.static is not None
        got, want = _workload(static), _workload(eager)
        for rid in want:
            assert got[rid].tokens == want[rid].tokens, rid
        assert got["c0"].cached == 40 and got["c1"].cached == 40  # prefix-cached sequences decoded statically
        sd = static.runner.static
        assert sd.replays > 0
        assert any(bs > n for n, bs in sd.padded)  # some steps needed padding
        assert len({n for n, _ in sd.padded}) >= 3  # and the batch changed size as requests came and went
        time.sleep(0.05)
        assert static.pool.num_free == static.pool.num_blocks
    finally:
        static.stop()
        eager.stop()


# -- the Triton paged kernel (CPU interpreter) ---------------------------------------------------------------
TRITON_CHECK = """
import torch
from farm.engine.paged_attention import paged_decode_torch, paged_decode_triton
torch.manual_seed(0)
bsz, nblocks, kvh, d, h = 4, 24, 2, 16, 6  # GQA group of 3: padded to 4 in the kernel
k, v = torch.randn(nblocks * bsz, kvh, d), torch.randn(nblocks * bsz, kvh, d)
bt = torch.randint(0, nblocks, (3, 8), dtype=torch.int32)
ctx = torch.tensor([1, 9, 31], dtype=torch.int32)
q = torch.randn(3, h, d)
want = paged_decode_torch(q, k, v, bt, ctx, bsz, 0.3)
for parts in (1, 4):
    torch.testing.assert_close(paged_decode_triton(q, k, v, bt, ctx, bsz, 0.3, parts=parts), want,
                               atol=1e-5, rtol=1e-5)
print("ok")
"""


def test_triton_paged_kernel_matches_torch_gather():
    """In a fresh interpreter: TRITON_INTERPRET must be set before triton is first imported."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-c", TRITON_CHECK], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]
