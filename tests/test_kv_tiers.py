"""KV tiers on a tiny engine: offload on eviction, onboard instead of recompute, disk rules, events."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from farm.config import EngineConfig, KVTiersConfig
from farm.engine.engine import Engine
from farm.kvcache.arena import DiskArena
from farm.protocol import SamplingParams
from farm.protocol.hashing import block_hashes
from tests.procs import ROOT
from tests.test_engine import run

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
BLOCK_KB = 2 * 2 * 4 * 2 * 16 * 4 / 1024  # tiny model: layers x K/V x block 4 x kv heads x head dim x fp32


@pytest.fixture
def make(tiny_model_dir, tmp_path):
    engines = []

    def _make(host_blocks=64, disk_blocks=0, device_blocks=12, min_reuse=1):
        events = []
        cfg = EngineConfig(block_size=4, kv_tiers=KVTiersConfig(host_mb=host_blocks * BLOCK_KB / 1024,
                                                                disk_mb=disk_blocks * BLOCK_KB / 1024,
                                                                disk_min_reuse=min_reuse))
        eng = Engine(tiny_model_dir, cfg, max_model_len=256, max_num_blocks=device_blocks, kv_tier_dir=tmp_path,
                     on_kv_event=lambda kind, hs, parent, tier="device": events.append((kind, tier, list(hs))))
        engines.append(eng.start())
        return eng, events
    yield _make
    for e in engines:
        e.stop()


def churn(eng, n=3):
    """Other prompts that push earlier blocks out of the small device pool."""
    for i in range(n):
        run(eng, list(range(9000 + 40 * i, 9000 + 40 * i + 30)), GREEDY)


def test_evicted_blocks_are_offloaded_to_host_and_onboarded_on_reuse(make, tiny_model_dir):
    eng, events = make()
    ref, _ = make(host_blocks=0)
    prompt = list(range(100, 121))  # 21 tokens: 5 full blocks
    first = run(eng, prompt, GREEDY)
    churn(eng)
    assert eng.tiers.host.used > 0 and ("stored", "host") in {(k, t) for k, t, _ in events}
    assert not eng.pool.cached_prefix(block_hashes(prompt, 4))  # gone from the device
    again = run(eng, prompt, GREEDY)
    assert again.last.cached_tokens == 20  # 5 blocks onboarded from host, not recomputed
    assert eng.tiers.stats()["host"]["hits"] >= 5
    assert again.token_ids == first.token_ids == run(ref, prompt, GREEDY).token_ids


def test_host_evictions_go_to_disk_only_when_reused(make):
    eng, events = make(host_blocks=6, disk_blocks=64, min_reuse=1)
    reused = list(range(300, 321))
    once = list(range(500, 521))
    run(eng, reused, GREEDY)
    run(eng, reused, GREEDY)  # a device hit: its blocks are now worth keeping
    run(eng, once, GREEDY)
    churn(eng, 5)  # device -> host -> (disk or dropped)
    disk_hashes = set(eng.tiers.disk.slots)
    assert set(block_hashes(reused, 4)[:4]) & disk_hashes
    assert not set(block_hashes(once, 4)) & disk_hashes
    assert any(t == "disk" and k == "stored" for k, t, _ in events)
    again = run(eng, reused, GREEDY)
    assert again.last.cached_tokens > 0 and eng.tiers.stats()["disk"]["hits"] > 0


def test_disk_is_skipped_when_recompute_is_faster(make):
    eng, _ = make(host_blocks=0, disk_blocks=64, min_reuse=0)
    prompt = list(range(700, 721))
    run(eng, prompt, GREEDY)
    churn(eng)
    hs = block_hashes(prompt, 4)
    assert eng.tiers.lookup(hs[:4])  # on disk and (with default estimates) worth reading
    eng.tiers.disk_bytes_per_s = 1.0  # a disk slower than any recompute
    assert eng.tiers.lookup(hs[:4]) == []
    assert run(eng, prompt, GREEDY).last.cached_tokens == 0


def test_disk_arena_is_a_file_in_the_tier_dir_removed_when_the_engine_stops(make, tmp_path):
    eng, _ = make(host_blocks=0, disk_blocks=64, min_reuse=0)
    arena = eng.tiers.disk.storage
    assert arena.path.parent == tmp_path and arena.path.exists() and arena.path.suffix == ".arena"
    assert 0 < eng.tiers.disk_bytes_per_s < float("inf")  # measured on the device at start, not assumed
    prompt = list(range(900, 921))
    first = run(eng, prompt, GREEDY)
    churn(eng)
    arena.drop_page_cache()
    assert arena.resident_fraction() == 0.0  # the next reads come from the device
    eng.tiers.recompute_s_per_token = 1.0  # whatever the device's speed today: read, do not recompute
    again = run(eng, prompt, GREEDY)
    assert again.last.cached_tokens > 0 and again.token_ids == first.token_ids  # read back intact, cold
    eng.stop()
    assert not arena.path.exists()


_KILLED_ARENA = """
import sys, time, torch
from pathlib import Path
from farm.kvcache.arena import DiskArena
a = DiskArena(Path(sys.argv[1]), 4, (2, 8), torch.float32)
print(a.path, flush=True)
time.sleep(600)
"""


def test_an_arena_left_by_a_killed_engine_is_removed_by_the_next(tmp_path):
    mine = DiskArena(tmp_path, 4, (2, 8), torch.float32)
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_ARENA, str(tmp_path)], cwd=ROOT, stdout=subprocess.PIPE,
                            text=True)
    left = Path(proc.stdout.readline().strip())
    proc.kill()
    proc.wait()
    assert left.exists()  # kill -9: nothing removed it
    nxt = DiskArena(tmp_path, 4, (2, 8), torch.float32)
    assert not left.exists()
    assert mine.path.exists() and nxt.path.exists()  # live arenas are locked: kept
    mine.close()
    nxt.close()
    assert list(tmp_path.iterdir()) == []
