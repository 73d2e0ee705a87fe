"""vLLM's NIXL connector, tuned for workers that run on CPUs.

vLLM imports this module inside its own processes (engine core and model worker) when a model's
`kv_transfer_config` names it (`kv_connector_module_path`); the farm does so for `kv_connector:
NixlConnector` on a machine without a GPU. It is vLLM's pull-mode NixlConnector with one change: NIXL's
progress thread pauses between polls. NIXL's Python API starts that thread with a delay of 0, which
makes it poll UCX without pause: fine on a GPU server with cores to spare, but on a CPU worker it took a
core from the model (measured on 2 cores: the model worker at 100-170% CPU while idle, and a prefill of
80 tokens taking 30 s or more instead of about one). The thread cannot simply be switched off: UCX over
TCP and shared memory needs the side that holds the blocks to make progress while a decode worker reads
them, and an idle prefill engine does not step (measured: decodes then waited 30-50 s for their KV).
"""

from __future__ import annotations

import sys
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlPullConnector
from vllm.distributed.nixl_utils import NixlWrapper

PROGRESS_DELAY_US = 500  # the progress thread's pause between polls (NIXL's own default: 0, busy polling)


class _BindingsWithPause:
    """NIXL's bindings, except that an agent with a progress thread gets a pause between polls."""

    def __init__(self, bindings: Any):
        self._bindings = bindings

    def __getattr__(self, name: str) -> Any:
        return getattr(self._bindings, name)

    def nixlAgent(self, name: str, config: Any) -> Any:  # noqa: N802 - NIXL's name
        if config.useProgThread and not config.pthrDelay:
            config.pthrDelay = PROGRESS_DELAY_US
        return self._bindings.nixlAgent(name, config)


if NixlWrapper is not None:
    _api = sys.modules[NixlWrapper.__module__]  # where nixl_agent builds its agent from `nixlBind`
    if not isinstance(_api.nixlBind, _BindingsWithPause):
        _api.nixlBind = _BindingsWithPause(_api.nixlBind)


class FarmNixlConnector(NixlPullConnector):
    """vLLM's NixlConnector (pull mode); its NIXL agent's progress thread pauses between polls."""
