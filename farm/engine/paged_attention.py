"""Decode attention over the paged KV cache, with static shapes (CUDA-graph safe), in two backends.

Both take the same arguments: `q` [b, heads, d], the flat caches `k_cache`/`v_cache`
[num_blocks * block_size, kv_heads, d], `block_tables` [b, width] (padded block ids; padding points at
any valid block) and `ctx_lens` [b] (tokens to attend to per row, >= 1). They return [b, heads, d].

- `torch`: gathers the `width` blocks of every row and runs SDPA with a length mask. Works everywhere
  (the CPU path, and the CUDA fallback); it reads `width` blocks per row whatever the context, so the
  caller buckets `width` to the batch's longest context.
- `triton` (CUDA, or CPU under TRITON_INTERPRET=1 for tests): a split-K paged kernel (flash-decoding)
  that reads each row's blocks straight from the cache and stops at the row's own length, so one
  captured graph at the maximum width serves every context length, and KV is read once (the gather
  path reads it three times: gather, write, SDPA).
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Literal

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

Backend = Literal["torch", "triton"]


def paged_decode_torch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       block_tables: torch.Tensor, ctx_lens: torch.Tensor, block_size: int,
                       scale: float) -> torch.Tensor:
    """Gather + SDPA: the same computation as the eager decode, with the context padded to `width`."""
    b, width = block_tables.shape
    offs = torch.arange(block_size, device=q.device)
    slot_idx = (block_tables.long()[:, :, None] * block_size + offs).reshape(b, width * block_size)
    ks = k_cache[slot_idx].transpose(1, 2)  # [b, kvh, n, d]
    vs = v_cache[slot_idx].transpose(1, 2)
    keys = torch.arange(width * block_size, device=q.device)
    mask = (keys[None, :] < ctx_lens.long()[:, None])[:, None, None, :]
    o = F.scaled_dot_product_attention(q[:, :, None, :], ks, vs, attn_mask=mask, scale=scale, enable_gqa=True)
    return o[:, :, 0]


@functools.cache
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:  # ImportError, or a broken install without a driver
        return False
    return True


@functools.cache
def _kernel() -> Any:
    """Defined lazily so importing this module never needs triton (and TRITON_INTERPRET, read when the
    kernel is defined, can still be set by a test first)."""
    import triton
    import triton.language as tl

    @triton.jit
    def paged_decode_kernel(Q, K, V, BT, CL, M_out, L_out, O_out, stride_bt, scale,
                            H: tl.constexpr, KVH: tl.constexpr, G: tl.constexpr, GP: tl.constexpr,
                            D: tl.constexpr, DP: tl.constexpr, PAGE: tl.constexpr, P: tl.constexpr):
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        part = tl.program_id(2)
        ctx = tl.load(CL + b).to(tl.int32)
        n_pages = tl.cdiv(ctx, PAGE)
        per_part = tl.cdiv(n_pages, P)  # each row splits its own pages over the P partitions
        start = part * per_part
        end = tl.minimum(start + per_part, n_pages)
        g = tl.arange(0, GP)
        d = tl.arange(0, DP)
        t = tl.arange(0, PAGE)
        gmask = g < G
        dmask = d < D
        heads = kvh * G + g
        q = tl.load(Q + (b * H + heads)[:, None] * D + d[None, :], mask=gmask[:, None] & dmask[None, :],
                    other=0.0).to(tl.float32)
        m = tl.full([GP], float("-inf"), tl.float32)
        lsum = tl.zeros([GP], tl.float32)
        acc = tl.zeros([GP, DP], tl.float32)
        for i in range(start, end):
            blk = tl.load(BT + b * stride_bt + i).to(tl.int64)
            tmask = (i * PAGE + t) < ctx
            off = ((blk * PAGE + t) * KVH + kvh)[:, None] * D + d[None, :]
            kvmask = tmask[:, None] & dmask[None, :]
            k = tl.load(K + off, mask=kvmask, other=0.0).to(tl.float32)  # [PAGE, DP]
            s = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale  # [GP, PAGE]
            s = tl.where(tmask[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=1))
            alpha = tl.exp(m - m_new)
            p = tl.exp(s - m_new[:, None])
            lsum = lsum * alpha + tl.sum(p, axis=1)
            v = tl.load(V + off, mask=kvmask, other=0.0).to(tl.float32)
            acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
            m = m_new
        row = (b * H + heads) * P + part  # partials laid out [b, H, P(, D)]
        tl.store(M_out + row, m, mask=gmask)
        tl.store(L_out + row, lsum, mask=gmask)
        tl.store(O_out + row[:, None] * D + d[None, :], acc, mask=gmask[:, None] & dmask[None, :])

    return paged_decode_kernel


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def num_partitions(batch: int, kv_heads: int, target_programs: int = 256, max_parts: int = 16) -> int:
    """Split-K partitions: enough programs to fill the GPU at small batch, 1 when the batch already does
    (the partials cost a write and a read of [b, heads, P, d] floats per layer)."""
    want = max(1, target_programs // max(1, batch * kv_heads))
    return min(max_parts, _next_pow2(want))


def paged_decode_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        block_tables: torch.Tensor, ctx_lens: torch.Tensor, block_size: int,
                        scale: float, parts: int | None = None) -> torch.Tensor:
    """The paged kernel plus a small torch combine of the partitions (log-sum-exp weights)."""
    b, h, d = q.shape
    kvh = k_cache.shape[1]
    g = h // kvh
    p = parts or num_partitions(b, kvh)
    q = q.contiguous()
    m = torch.empty(b, h, p, dtype=torch.float32, device=q.device)
    lsum = torch.empty_like(m)
    o = torch.empty(b, h, p, d, dtype=torch.float32, device=q.device)
    bt = block_tables if block_tables.stride(1) == 1 else block_tables.contiguous()
    _kernel()[(b, kvh, p)](q, k_cache, v_cache, bt, ctx_lens, m, lsum, o, bt.stride(0), float(scale),
                           H=h, KVH=kvh, G=g, GP=max(2, _next_pow2(g)), D=d, DP=max(16, _next_pow2(d)),
                           PAGE=block_size, P=p)
    mx = m.amax(-1, keepdim=True)  # partition 0 always holds >= 1 token, so this is finite
    w = torch.exp(m - mx)  # empty partitions (-inf) weigh 0
    out = (o * w[..., None]).sum(2) / (lsum * w).sum(-1, keepdim=True)
    return out.to(q.dtype)


def pick_backend(pref: str, device: torch.device, block_size: int) -> Backend:
    """`auto`: triton on CUDA when importable, else torch. Triton needs a power-of-two block size."""
    pow2 = block_size & (block_size - 1) == 0
    if pref == "torch":
        return "torch"
    if pref == "triton" or (pref == "auto" and device.type == "cuda"):
        if triton_available() and pow2:
            return "triton"
        if pref == "triton":
            log.warning("decode_attention=triton unavailable (triton importable: %s, block size %d); using torch",
                        triton_available(), block_size)
    return "torch"


def paged_decode(backend: Backend, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 block_tables: torch.Tensor, ctx_lens: torch.Tensor, block_size: int, scale: float) -> torch.Tensor:
    fn = paged_decode_triton if backend == "triton" else paged_decode_torch
    return fn(q, k_cache, v_cache, block_tables, ctx_lens, block_size, scale)
