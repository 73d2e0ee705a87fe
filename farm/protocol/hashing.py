"""Block hashes shared by workers and router (Dynamo-compatible).

A block's local hash is `xxh3_64` of its token ids as little-endian u32, seed 1337. Blocks are chained
as Dynamo does: the first block's sequence hash is its local hash; every later block's sequence hash is
`xxh3_64(parent_seq_hash || local_hash)` over the two values as little-endian u64, seed 1337. Equal
prefixes therefore give equal hash chains on every worker, and a block hash identifies its whole prefix.
Only full blocks are hashed: a partial tail block is never shared.

A request with a cache salt (GenerationRequest.cache_salt: its tenant's) chains its first block from the
salt's root (`salt_root`: `xxh3_64` of a domain prefix and the salt's UTF-8 bytes, seed 1337) instead of
from nothing, so equal prompts under different salts give disjoint chains, and a tenant's requests only
ever find the tenant's own blocks in a prefix cache or the router's index. No salt: the chain is unchanged.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import numpy as np
import xxhash

SEED = 1337
# never the bytes of a token block ("farm" as a LE u32 is ~1.8e9, far above any vocabulary), so a root is not
# the local hash of some block an unsalted chain could start with
SALT_DOMAIN = b"farm-cache-salt\x00"


def local_block_hash(tokens: Sequence[int]) -> int:
    return xxhash.xxh3_64_intdigest(np.asarray(tokens, dtype="<u4").tobytes(), seed=SEED)


def chain_hash(parent: int | None, local: int) -> int:
    if parent is None:
        return local
    return xxhash.xxh3_64_intdigest(struct.pack("<QQ", parent, local), seed=SEED)


def salt_root(salt: str | None) -> int | None:
    """The parent of a salted chain's first block; None (an unsalted chain) for no salt."""
    if not salt:
        return None
    return xxhash.xxh3_64_intdigest(SALT_DOMAIN + salt.encode("utf-8"), seed=SEED)


def block_hashes(tokens: Sequence[int], block_size: int, parent: int | None = None) -> list[int]:
    """Sequence hashes of every full block of `tokens` (a partial tail block is not hashed), chained from
    `parent` (a salted prompt: `salt_root(salt)`)."""
    arr = np.asarray(tokens, dtype="<u4")
    out: list[int] = []
    for start in range(0, len(arr) - block_size + 1, block_size):
        local = xxhash.xxh3_64_intdigest(arr[start:start + block_size].tobytes(), seed=SEED)
        parent = chain_hash(parent, local)
        out.append(parent)
    return out
