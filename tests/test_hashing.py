"""Block hashes: Dynamo-compatible chaining, full blocks only, equal prefixes give equal chains."""

import struct

import numpy as np
import xxhash

from farm.protocol.hashing import SEED, block_hashes, chain_hash, local_block_hash


def test_local_hash_is_xxh3_of_le_u32_with_seed_1337():
    toks = list(range(16))
    expected = xxhash.xxh3_64_intdigest(np.array(toks, dtype="<u4").tobytes(), seed=1337)
    assert SEED == 1337
    assert local_block_hash(toks) == expected


def test_chain_uses_parent_and_local_as_le_u64():
    a, b = list(range(16)), list(range(16, 32))
    hs = block_hashes(a + b, 16)
    assert hs[0] == local_block_hash(a)
    assert hs[1] == xxhash.xxh3_64_intdigest(struct.pack("<QQ", hs[0], local_block_hash(b)), seed=1337)
    assert hs[1] == chain_hash(hs[0], local_block_hash(b))


def test_only_full_blocks_are_hashed():
    assert block_hashes(list(range(15)), 16) == []
    assert len(block_hashes(list(range(47)), 16)) == 2


def test_same_block_in_different_context_hashes_differently():
    blk = [7] * 16
    assert block_hashes([1] * 16 + blk, 16)[1] != block_hashes([2] * 16 + blk, 16)[1]


def test_shared_prefix_shares_hash_chain():
    p = list(range(100, 164))
    h1 = block_hashes(p + [1, 2, 3] * 10, 16)
    h2 = block_hashes(p + [9, 9] * 20, 16)
    assert h1[:4] == h2[:4] and h1[4] != h2[4]
