"""A long-lived process's start-up heap kept out of the garbage collector's full passes.

Why: a farm process loads hundreds of thousands of objects it keeps for its whole life before it serves
(the tokenizers, chat templates and semantic layer in the API; torch, vLLM or the built-in engine in a
worker), and every full collection of Python's cyclic garbage collector walks all of them again. On the
2-core test VM one took 243-274 ms in the API (about every 15 s under one-token load) and 380-410 ms in a
vLLM worker's front end; in a gevent API no stream moves meanwhile. `gc.freeze()` once the process is warm
moves them to the permanent generation, which collections skip, as `vllm serve` does after its start-up
(vllm.utils.gc_utils.freeze_gc_heap). Reference counting still frees what they drop; only cycles among
them are never collected, which for a process's start-up objects is what lasting the process's life means.
"""

from __future__ import annotations

import gc


def freeze_startup_heap() -> int:
    """Collect what start-up left behind, then freeze every object still alive; returns how many were frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
