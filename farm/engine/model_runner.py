"""Runs a Hugging Face causal LM over the paged KV cache.

The model's own modules (embeddings, projections, norms, MLPs, rotary embedding) are used as loaded by
transformers; only attention is ours, so it reads and writes the paged cache:
- the KV cache is one tensor `[layers, 2, num_blocks, block_size, kv_heads, head_dim]`;
- every new token's K/V is written to its slot (`block_id * block_size + offset`);
- prefill attends per sequence over its gathered context (cached prefix + new tokens, causal);
- decode attends for the whole batch at once, one forward per step. By default it runs on static
  buffers (farm.engine.static_decode): the batch is padded to a bucket size, block tables to a fixed
  width, and on CUDA each bucket's step is a captured CUDA graph; on CPU the same buffers and the same
  forward run without graphs. `enforce_eager` keeps the dynamic path (exact shapes, no padding).
- decode attention reads the paged cache through farm.engine.paged_attention (torch gather + SDPA,
  or a Triton paged kernel on CUDA).
The cache holds one block more than the pool hands out: the scratch block that padded rows write to.
Llama, Mistral, Qwen2 and Qwen3-style decoders are supported.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from farm.engine.paged_attention import paged_decode, pick_backend
from farm.engine.static_decode import DEFAULT_BATCH_SIZES, StaticDecode

log = logging.getLogger(__name__)

SUPPORTED_MODEL_TYPES = {"llama", "mistral", "qwen2", "qwen3"}


def pick_device(pref: str) -> torch.device:
    if pref == "cuda" or (pref == "auto" and torch.cuda.is_available()):
        return torch.device("cuda")
    return torch.device("cpu")


def pick_dtype(pref: str, device: torch.device) -> torch.dtype:
    if pref == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[pref]


@dataclass
class KVLayout:
    """Shape of the cache, carried in KV handles so a receiver can check it matches its own."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str

    def block_bytes(self) -> int:
        elem = torch.empty((), dtype=getattr(torch, self.dtype)).element_size()
        return self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim * elem

    def to_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class PrefillChunk:
    """Tokens [start, end) of one sequence, with the block table covering positions < end."""

    token_ids: list[int]
    start: int
    block_table: list[int]
    every_position: bool = False  # keep every token's hidden state (a prompt's log-probabilities need them)


def _flat(t: torch.Tensor) -> torch.Tensor:
    """[layers, 2, blocks, ...] as [layers*2, blocks, block_elems]: gathers along a middle dim of a 6-d
    tensor are ~20x slower on CPU than along this 3-d view."""
    return t.view(t.shape[0] * t.shape[1], t.shape[2], -1)


def gather_blocks(kv: torch.Tensor, block_ids: list[int], out: torch.Tensor | None = None) -> torch.Tensor:
    """Copy blocks out of a cache [layers, 2, num_blocks, ...] into [layers, 2, n, ...] (or `out`)."""
    shape = (*kv.shape[:2], len(block_ids), *kv.shape[3:])
    if out is None:
        out = torch.empty(shape, dtype=kv.dtype, device=kv.device)
    src, dst = _flat(kv), _flat(out)
    j = 0
    for start, length in _runs(block_ids):  # block tables are mostly runs: strided slice copies, no temp
        dst[:, j:j + length].copy_(src[:, start:start + length])
        j += length
    return out


def _runs(ids: list[int]) -> list[tuple[int, int]]:
    """[3, 4, 5, 9, 10] -> [(3, 3), (9, 2)]: consecutive ids as (start, length)."""
    runs: list[tuple[int, int]] = []
    for i in ids:
        if runs and runs[-1][0] + runs[-1][1] == i:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((i, 1))
    return runs


def scatter_blocks(kv: torch.Tensor, block_ids: list[int], data: torch.Tensor) -> None:
    """Write [layers, 2, n, ...] into the cache's blocks `block_ids`."""
    src, dst = _flat(data.to(device=kv.device, dtype=kv.dtype)), _flat(kv)
    j = 0
    for start, length in _runs(block_ids):
        dst[:, start:start + length].copy_(src[:, j:j + length])
        j += length


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class ModelRunner:
    def __init__(self, model_dir: Path | None, block_size: int, kv_cache_bytes: int, device: str = "auto",
                 dtype: str = "auto", max_num_blocks: int | None = None, *, max_model_len: int | None = None,
                 enforce_eager: bool = False, graph_batch_sizes: Sequence[int] = DEFAULT_BATCH_SIZES,
                 decode_attention: str = "auto", model: Any = None):
        """`model`: an already built transformers causal LM in `dtype` (benchmarks with random weights of
        real shapes); otherwise it is loaded from `model_dir`."""
        from transformers import AutoConfig, AutoModelForCausalLM

        self.device = pick_device(device)
        self.dtype = pick_dtype(dtype, self.device)
        config = model.config if model is not None else AutoConfig.from_pretrained(model_dir)
        if config.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model type {config.model_type!r} is not supported by the built-in engine "
                f"(supported: {sorted(SUPPORTED_MODEL_TYPES)})"
            )
        if model is None:
            model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=self.dtype)
        self.model = model.to(self.device).eval()  # not .to(dtype): rotary inv_freq stays float32
        self.config = config
        inner = self.model.model
        self.layers = list(inner.layers)
        attn0 = self.layers[0].self_attn
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(attn0, "head_dim", None) or config.hidden_size // self.num_heads
        self.scaling = getattr(attn0, "scaling", self.head_dim ** -0.5)
        self.block_size = block_size
        self.layout = KVLayout(len(self.layers), self.num_kv_heads, self.head_dim, block_size,
                               str(self.dtype).removeprefix("torch."))
        # one block of the budget is the scratch block (padded decode rows write there)
        num_blocks = max(1, kv_cache_bytes // self.layout.block_bytes() - 1)
        if max_num_blocks:
            num_blocks = min(num_blocks, max_num_blocks)
        self.num_blocks = int(num_blocks)  # what the block pool may hand out: ids 0 .. num_blocks-1
        self.scratch_block = self.num_blocks
        self.kv = torch.zeros(len(self.layers), 2, self.num_blocks + 1, block_size, self.num_kv_heads,
                              self.head_dim, dtype=self.dtype, device=self.device)
        self.attention = pick_backend(decode_attention, self.device, block_size)
        limit = max_model_len or getattr(config, "max_position_embeddings", None) or self.num_blocks * block_size
        self.max_blocks_per_seq = min(self.num_blocks, -(-(limit + 1) // block_size))
        self.enforce_eager = enforce_eager
        self.static: StaticDecode | None = None
        if not enforce_eager:
            self.static = StaticDecode(
                self._static_forward, device=self.device, batch_sizes=graph_batch_sizes,
                max_blocks=self.max_blocks_per_seq, block_size=block_size, scratch_block=self.scratch_block,
                fixed_width=self.attention == "triton", use_graphs=self.device.type == "cuda")
            if self.static.use_graphs and self.static.fixed_width:
                self.static.capture_all()  # the widths are known: capture every batch size now
        log.info("model %s on %s/%s: %d layers, KV cache %d blocks x %d tokens; decode %s, attention %s",
                 model_dir, self.device, self.dtype, len(self.layers), self.num_blocks, block_size,
                 "eager" if self.static is None else ("CUDA graphs" if self.static.use_graphs else "static buffers"),
                 self.attention)

    # -- KV cache access (used by transfer) ---------------------------------------------------------
    def read_blocks(self, block_ids: list[int], out: torch.Tensor | None = None) -> torch.Tensor:
        """A contiguous copy of the given blocks: [layers, 2, n, block_size, kv_heads, head_dim]."""
        return gather_blocks(self.kv, block_ids, out)

    def write_blocks(self, block_ids: list[int], data: torch.Tensor) -> None:
        scatter_blocks(self.kv, block_ids, data)

    # -- forward ------------------------------------------------------------------------------------
    def _slots(self, block_table: list[int], start: int, end: int) -> list[int]:
        bs = self.block_size
        return [block_table[p // bs] * bs + p % bs for p in range(start, end)]

    @torch.inference_mode()
    def prefill(self, chunks: list[PrefillChunk]) -> torch.Tensor:
        """Compute chunks (one per sequence); returns logits of each chunk's last token [n, vocab]."""
        return self.prefill_positions(chunks)[0]

    @torch.inference_mode()
    def prefill_positions(self, chunks: list[PrefillChunk]) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """`prefill`, and the last layer's output [n_i, hidden] for every token of each chunk marked
        `every_position`, by chunk index: `logits` of a slice of them gives its positions' logits (a prompt's
        logits at once would be prompt x vocabulary floats: 400 MB for 2,000 tokens of a 49k vocabulary)."""
        ids, pos, slots, spans = [], [], [], []
        for c in chunks:
            n = len(c.token_ids)
            ids.extend(c.token_ids)
            pos.extend(range(c.start, c.start + n))
            slots.extend(self._slots(c.block_table, c.start, c.start + n))
            spans.append((len(ids) - n, n, c))

        def attend(li: int, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
            outs = []
            for off, n, c in spans:
                # 4-d inputs ([1, heads, n, d]) take SDPA's fused CPU kernel; 3-d ones fall back to the
                # slow math path (8x slower at 2k tokens).
                qs = q[off:off + n].transpose(0, 1)[None]
                ctx = c.start + n
                if c.start == 0:
                    ks = k_new[off:off + n].transpose(0, 1)[None]
                    vs = v_new[off:off + n].transpose(0, 1)[None]
                    o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=self.scaling,
                                                       enable_gqa=True)
                else:
                    cslots = torch.tensor(self._slots(c.block_table, 0, ctx), device=self.device)
                    ks = k_cache[cslots].transpose(0, 1)[None]
                    vs = v_cache[cslots].transpose(0, 1)[None]
                    mask = torch.ones(n, ctx, dtype=torch.bool, device=self.device).tril(ctx - n)
                    o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=self.scaling,
                                                       enable_gqa=True)
                o = o[0]
                outs.append(o.transpose(0, 1).reshape(n, -1))
            return torch.cat(outs, 0)

        k_new = v_new = None

        def capture(k: torch.Tensor, v: torch.Tensor) -> None:
            nonlocal k_new, v_new
            k_new, v_new = k, v

        last = torch.tensor([off + n - 1 for off, n, _ in spans], device=self.device)
        h = self._hidden(ids, pos, slots, attend, capture)
        kept = {i: h[off:off + n] for i, (off, n, c) in enumerate(spans) if c.every_position}
        return self.logits(h.index_select(0, last)), kept

    @torch.inference_mode()
    def decode(self, token_ids: list[int], positions: list[int], block_tables: list[list[int]]) -> torch.Tensor:
        """One token for each sequence at `positions`; returns logits [batch, vocab].

        Static buffers (CUDA graphs on CUDA) when the batch fits a bucket, else the eager path."""
        if self.static is not None:
            need = max(p // self.block_size + 1 for p in positions)
            if self.static.fits(len(token_ids), need):
                return self.static.run(token_ids, positions, block_tables)
        return self.decode_eager(token_ids, positions, block_tables)

    @torch.inference_mode()
    def decode_eager(self, token_ids: list[int], positions: list[int],
                     block_tables: list[list[int]]) -> torch.Tensor:
        """The dynamic decode: exact batch and context shapes, gathered contexts, one SDPA."""
        b = len(token_ids)
        ctx_lens = [p + 1 for p in positions]
        max_ctx = max(ctx_lens)
        slot_rows = []
        for bt, n in zip(block_tables, ctx_lens, strict=True):
            row = self._slots(bt, 0, n)
            slot_rows.append(row + [0] * (max_ctx - n))
        slot_idx = torch.tensor(slot_rows, device=self.device)  # [b, max_ctx]
        lens = torch.tensor(ctx_lens, device=self.device)
        mask = (torch.arange(max_ctx, device=self.device)[None, :] < lens[:, None])[:, None, None, :]
        slots = [row[n - 1] for row, n in zip(slot_rows, ctx_lens, strict=True)]

        def attend(li: int, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
            qs = q.view(b, 1, self.num_heads, self.head_dim).transpose(1, 2)  # [b, h, 1, d]
            ks = k_cache[slot_idx].transpose(1, 2)  # [b, kvh, ctx, d]
            vs = v_cache[slot_idx].transpose(1, 2)
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=self.scaling, enable_gqa=True)
            return o.transpose(1, 2).reshape(b, -1)

        last = torch.arange(b, device=self.device)
        return self._forward(token_ids, positions, slots, attend, None, last)

    def _static_forward(self, input_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                        block_tables: torch.Tensor, ctx_lens: torch.Tensor) -> torch.Tensor:
        """One decode step on device tensors only: no host syncs and no shape that depends on the data,
        so it can be captured in a CUDA graph. Returns logits [rows, vocab] (float32)."""
        b = input_ids.shape[0]

        def attend(li: int, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
            o = paged_decode(self.attention, q, k_cache, v_cache, block_tables, ctx_lens, self.block_size,
                             self.scaling)
            return o.reshape(b, -1)

        return self.logits(self._layers(input_ids, positions, slots, attend, None))

    def _forward(self, ids, pos, slots, attend, capture, last_idx) -> torch.Tensor:
        return self.logits(self._hidden(ids, pos, slots, attend, capture).index_select(0, last_idx))

    def _hidden(self, ids, pos, slots, attend, capture) -> torch.Tensor:
        dev = self.device
        input_ids = torch.tensor(ids, dtype=torch.long, device=dev)
        positions = torch.tensor(pos, dtype=torch.long, device=dev)
        slot_t = torch.tensor(slots, dtype=torch.long, device=dev)
        return self._layers(input_ids, positions, slot_t, attend, capture)

    @torch.inference_mode()
    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Logits (float32) of the rows of the last layer's output `h` (what `prefill_positions` keeps)."""
        return self.model.lm_head(self.model.model.norm(h)).float()

    def _layers(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_t: torch.Tensor,
                attend: Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
                capture: Callable[[torch.Tensor, torch.Tensor], None] | None) -> torch.Tensor:
        """Embeddings and every decoder layer (our attention, their modules); hidden states [T, hidden]."""
        inner = self.model.model
        h = inner.embed_tokens(input_ids)
        cos, sin = inner.rotary_emb(h[None], positions[None])
        cos, sin = cos[0][:, None, :], sin[0][:, None, :]  # [T, 1, d]
        t = input_ids.shape[0]
        nbs = self.kv.shape[2] * self.block_size
        for li, layer in enumerate(self.layers):
            attn = layer.self_attn
            residual = h
            x = layer.input_layernorm(h)
            q = attn.q_proj(x).view(t, self.num_heads, self.head_dim)
            k = attn.k_proj(x).view(t, self.num_kv_heads, self.head_dim)
            v = attn.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
            if hasattr(attn, "q_norm"):
                q, k = attn.q_norm(q), attn.k_norm(k)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            k_cache = self.kv[li, 0].view(nbs, self.num_kv_heads, self.head_dim)
            v_cache = self.kv[li, 1].view(nbs, self.num_kv_heads, self.head_dim)
            k_cache.index_copy_(0, slot_t, k.to(self.dtype))
            v_cache.index_copy_(0, slot_t, v.to(self.dtype))
            if capture is not None:
                capture(k, v)
            o = attend(li, q, k_cache, v_cache)
            h = residual + attn.o_proj(o)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return h
