"""Optional NIXL transport (RDMA / NVLink / GPUDirect through UCX) when the `nixl` package is present.

The prefill worker registers its whole KV cache with a NIXL agent once. A pull still starts on the farm's
TCP control channel (so the signed handle is verified first); the server answers with its agent
metadata and one transfer descriptor per (layer, K/V, block), and the decode worker READs those regions
straight into a registered buffer of its own, then acknowledges so the blocks are released. Nothing of
this needs a GPU to be described, so the descriptor layout is computed and tested without NIXL; the
transfer itself runs only where `nixl` is installed (`pip install nixl` on a UCX-capable host).
"""

from __future__ import annotations

import base64
import importlib.util
import time
from typing import Any

import torch


def available() -> bool:
    return importlib.util.find_spec("nixl") is not None


def block_regions(kv: torch.Tensor, block_ids: list[int]) -> list[tuple[int, int, int]]:
    """(address, bytes, device id) of every (layer, K/V, block) region of `kv`
    [layers, 2, num_blocks, block_size, kv_heads, head_dim], in the order fetch expects:
    layer-major, then K/V, then the handle's block order (the layout of the gathered tensor)."""
    if not kv.is_contiguous():
        raise ValueError("the KV cache must be contiguous to be described for NIXL")
    layers, two, num_blocks = kv.shape[:3]
    block_bytes = kv[0, 0, 0].numel() * kv.element_size()
    base = kv.data_ptr()
    dev = kv.device.index or 0
    out = []
    for layer in range(layers):
        for k in range(two):
            plane = (layer * two + k) * num_blocks
            out.extend((base + (plane + b) * block_bytes, block_bytes, dev) for b in block_ids)
    return out


def _mem_type(t: torch.Tensor) -> str:
    return "VRAM" if t.device.type == "cuda" else "DRAM"


class NixlSource:
    """Prefill side: one agent, the KV cache registered once."""

    def __init__(self, name: str, kv: torch.Tensor):
        from nixl._api import nixl_agent, nixl_agent_config

        self.kv = kv
        self.agent = nixl_agent(name, nixl_agent_config(backends=["UCX"]))
        self.agent.register_memory(self.agent.get_reg_descs(kv))
        self.name = name

    def offer(self, block_ids: list[int]) -> dict[str, Any]:
        """What the control channel sends to the puller."""
        return {"agent": self.name, "meta": base64.b64encode(self.agent.get_agent_metadata()).decode(),
                "regions": block_regions(self.kv, block_ids), "mem": _mem_type(self.kv)}

    def wait_done(self, puller: str, notif: bytes, timeout: float = 30.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.agent.check_remote_xfer_done(puller, notif):
                return True
            time.sleep(0.0005)
        return False


def nixl_read(name: str, offer: dict[str, Any], shape: tuple[int, ...], dtype: torch.dtype,
              device: torch.device, notif: bytes, timeout: float = 30.0) -> torch.Tensor:
    """Decode side: READ the offered regions into a new tensor of `shape` on `device`."""
    from nixl._api import nixl_agent, nixl_agent_config

    agent = nixl_agent(name, nixl_agent_config(backends=["UCX"]))
    remote = agent.add_remote_agent(base64.b64decode(offer["meta"]))
    dst = torch.empty(shape, dtype=dtype, device=device)
    agent.register_memory(agent.get_reg_descs(dst))
    local_regions = block_regions(dst, list(range(shape[2])))
    local = agent.get_xfer_descs(local_regions, _mem_type(dst))
    remote_descs = agent.get_xfer_descs([tuple(r) for r in offer["regions"]], offer["mem"])
    handle = agent.initialize_xfer("READ", local, remote_descs, remote, notif)
    agent.transfer(handle)
    deadline = time.monotonic() + timeout
    while (state := agent.check_xfer_state(handle)) != "DONE":
        if state == "ERR" or time.monotonic() > deadline:
            raise RuntimeError(f"NIXL transfer failed ({state})")
        time.sleep(0.0005)
    agent.release_xfer_handle(handle)
    return dst
