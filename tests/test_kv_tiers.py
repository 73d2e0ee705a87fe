"""KV tiers on a tiny engine: offload on eviction, onboard instead of recompute, disk rules, events."""

from __future__ import annotations

import pytest

from farm.config import EngineConfig, KVTiersConfig
from farm.engine.engine import Engine
from farm.engine.hashing import block_hashes
from farm.protocol import SamplingParams
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
