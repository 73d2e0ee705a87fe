"""Block pool: reference counting, LRU eviction of cached blocks, prefix lookup and KV events."""

import pytest

from farm.engine.block_pool import BlockPool, NoFreeBlocksError


def make(n=8):
    events = []
    pool = BlockPool(n, 16, on_event=lambda kind, hashes, parent: events.append((kind, list(hashes), parent)))
    return pool, events


def test_allocate_and_free_return_pool_to_start_state():
    pool, _ = make(4)
    a = pool.allocate(3)
    assert pool.num_free == 1 and pool.num_used == 3
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(2)
    pool.free(a)
    assert pool.num_free == 4
    with pytest.raises(RuntimeError):
        pool.free([a[0]])


def test_cached_blocks_survive_free_and_are_found_by_hash():
    pool, events = make(4)
    ids = pool.allocate(2)
    pool.cache_blocks(ids, [111, 222], None)
    assert events[-1] == ("stored", [111, 222], None)
    pool.free(list(reversed(ids)))
    assert pool.cached_prefix([111, 222, 333]) == ids
    pool.touch(ids)
    assert pool.num_free == 2
    assert [pool.blocks[i].ref_cnt for i in ids] == [1, 1]


def test_lru_eviction_takes_oldest_free_first_and_emits_removed():
    pool, events = make(3)
    a = pool.allocate(1)
    pool.cache_blocks(a, [1], None)
    b = pool.allocate(1)
    pool.cache_blocks(b, [2], None)
    pool.free(a)
    pool.free(b)  # free order: (unused block), a, b
    pool.allocate(2)  # takes the never-used block, then a
    assert pool.cached_prefix([1]) == []
    assert pool.cached_prefix([2]) == b
    assert ("removed", [1], None) in events


def test_touch_protects_cached_block_from_eviction():
    pool, _ = make(2)
    a = pool.allocate(1)
    pool.cache_blocks(a, [5], None)
    pool.free(a)
    pool.touch(a)
    assert pool.allocate(1) != a
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(1)


def test_duplicate_hash_keeps_first_block():
    pool, _ = make(4)
    a, b = pool.allocate(1), pool.allocate(1)
    pool.cache_blocks(a, [9], None)
    pool.cache_blocks(b, [9], None)
    assert pool.cached[9] == a[0] and pool.blocks[b[0]].block_hash is None


def test_reset_clears_cache_only_when_idle():
    pool, events = make(2)
    a = pool.allocate(1)
    pool.cache_blocks(a, [3], None)
    with pytest.raises(RuntimeError):
        pool.reset()
    pool.free(a)
    pool.reset()
    assert pool.cached == {} and events[-1][0] == "cleared"


def test_requests_sharing_a_prefix_that_arrive_together_compute_it_once():
    """Admitted in the same step, each would compute the shared blocks; the scheduler lets the later ones
    wait until the first has registered them, then they start from the cached prefix."""
    from farm.engine.scheduler import PrefillBatch, Scheduler, Sequence
    from farm.protocol import SamplingParams

    pool = BlockPool(64, 4)
    sched = Scheduler(pool, max_num_seqs=8, max_num_batched_tokens=256, import_fn=lambda *_: None)
    prefix = list(range(100, 124))  # 6 full blocks
    seqs = [Sequence(f"r{i}", prefix + [500 + i, 600 + i], SamplingParams(max_tokens=4), lambda _o: None)
            for i in range(3)]
    other = Sequence("x", list(range(900, 926)), SamplingParams(max_tokens=4), lambda _o: None)
    for s in [*seqs, other]:
        sched.add(s)
    first = sched.schedule()
    assert isinstance(first, PrefillBatch)
    assert [s.request_id for s in first.seqs] == ["r0", "x"]  # r1, r2 wait; an unrelated request does not
    assert [s.request_id for s in sched.waiting] == ["r1", "r2"]
    for s in first.seqs:  # what the engine does after the chunk ran
        s.num_computed = s.num_tokens
        sched.register_full_blocks(s)
        sched.prefilling.remove(s)
        sched.running.append(s)
    second = sched.schedule()
    assert [s.request_id for s in second.seqs] == ["r1", "r2"]
    assert [s.num_cached_tokens for s in second.seqs] == [24, 24]
