"""The vLLM backend's mapping of the farm onto vLLM's API: importing vLLM's public classes (`import_vllm`), the
engine arguments from the farm's configuration (`build_engine_args`), a request's sampling parameters
(`sampling_kwargs`, and what a request asks of its KV connector, `connector_params`), and vLLM's
log-probabilities in the farm's form (`token_logprobs`). Pure functions, testable without vLLM; the engine adapter
that uses them is farm.backends.vllm.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from farm.backends.vllm_events import VllmNotInstalled
from farm.config import FarmConfig, ModelConfig, VllmOptions
from farm.engine.sampling import TokenLogprobs
from farm.protocol import SamplingParams

# What a prefill-only request asks of each connector. NixlConnector: "keep the blocks for a remote
# decode and tell me where they are" (vLLM's disaggregation proxy sends exactly this). LMCache pushes
# the KV into its store by token hashes, so its prefill needs no per-request parameters.
PREFILL_PARAMS: dict[str, dict[str, Any]] = {
    "NixlConnector": {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                      "remote_block_ids": None, "remote_host": None, "remote_port": None},
    "LMCacheConnectorV1": {},
}

# LMCache keys its store by token hashes and a request's `lmcache.tag.*` kv_transfer_params, not by vLLM's
# `cache_salt` (LMCache issue #2878): without a tag one tenant's prompt would find another's KV there (shared
# by every worker using the store), which the tenant's salt exists to prevent.
LMCACHE_TENANT_TAG = "lmcache.tag.farm_cache_salt"


def connector_params(connector: str | None, cache_salt: str, *, prefill_only: bool = False,
                     imported: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """A request's kv_transfer_params for the worker's KV connector: what a prefill-only request asks of it,
    or what a decode request imports (`imported`, from the prefill's handle), and for LMCache the tenant's
    scope (its cache salt as a tag, on every request: a store, a lookup and a disaggregated pull agree on it).
    None when the request has nothing to say to a connector."""
    if prefill_only and connector:
        params = dict(PREFILL_PARAMS.get(connector, {}))
    else:
        params = dict(imported) if imported is not None else None
    if connector == "LMCacheConnectorV1" and cache_salt:
        params = {**(params or {}), LMCACHE_TENANT_TAG: cache_salt}
    return params


def import_vllm(model: str = "") -> SimpleNamespace:
    """The parts of vLLM's public API the backend uses; VllmNotInstalled with the fix if it is missing."""
    try:
        from vllm import SamplingParams as VSamplingParams
        from vllm.config import KVEventsConfig, KVTransferConfig
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams
    except ImportError as e:
        who = f"model {model!r} is configured with `backend: vllm`, but " if model else ""
        raise VllmNotInstalled(
            f"{who}vLLM is not installed in this environment ({e}). On a GPU host install the extra: "
            "`.venv/bin/pip install -e '.[vllm]'` (see README, 'GPU workers with vLLM')"
        ) from e
    try:
        from vllm.v1.engine.async_llm import AsyncLLM
    except ImportError:  # older layout: the documented alias
        from vllm import AsyncLLMEngine as AsyncLLM
    return SimpleNamespace(AsyncEngineArgs=AsyncEngineArgs, AsyncLLM=AsyncLLM, SamplingParams=VSamplingParams,
                           RequestOutputKind=RequestOutputKind, KVEventsConfig=KVEventsConfig,
                           KVTransferConfig=KVTransferConfig, StructuredOutputsParams=StructuredOutputsParams)


# A worker's KV role for vLLM's connector, from its farm role (unless models[].vllm.kv_role names one).
WORKER_KV_ROLES = {"prefill": "kv_producer", "decode": "kv_consumer", "both": "kv_both"}

# engine_args with which a model entry sizes vLLM's KV cache itself (else engine.kv_cache_mb does). Without
# either, vLLM's CPU backend would claim 92% of the machine's RAM and refuse to start when less is free.
KV_SIZING_ARGS = frozenset({"kv_cache_memory_bytes", "gpu_memory_utilization"})


# -- mapping our request onto vLLM's -------------------------------------------------------------------
def sampling_kwargs(p: SamplingParams, prompt_len: int, max_model_len: int, *, prefill_only: bool = False,
                    kv_transfer_params: dict[str, Any] | None = None,
                    structured: Callable[..., Any] | None = None) -> dict[str, Any]:
    """Keyword arguments for vllm.SamplingParams that reproduce the farm's sampling semantics.

    max_tokens is capped by the room left in max_model_len (the built-in engine stops there with
    `length`; vLLM would reject the request instead). A prefill-only request samples one token. A
    response_format becomes vLLM's structured outputs (`structured` builds StructuredOutputsParams).
    """
    room = max(1, max_model_len - prompt_len)
    kw: dict[str, Any] = {
        "n": 1,
        "max_tokens": 1 if prefill_only else max(1, min(int(p.max_tokens), room)),
        "temperature": max(0.0, float(p.temperature)),
        "top_p": float(p.top_p) if 0.0 < p.top_p <= 1.0 else 1.0,
        "seed": p.seed,
        "stop": list(p.stop) or None,
        "ignore_eos": bool(p.ignore_eos),
        "skip_special_tokens": bool(p.skip_special_tokens),
        "include_stop_str_in_output": bool(p.include_stop_str_in_output),
        "presence_penalty": float(p.presence_penalty),
        "frequency_penalty": float(p.frequency_penalty),
        "repetition_penalty": float(p.repetition_penalty),
        "top_k": int(p.top_k),
        "min_p": float(p.min_p),
        "min_tokens": 0 if prefill_only else min(int(p.min_tokens), room),
        "stop_token_ids": list(p.stop_token_ids) or None,
        "logprobs": None if prefill_only or p.logprob_token_ids else p.logprobs,  # the ids instead, as vLLM's server
        "logprob_token_ids": None if prefill_only else list(p.logprob_token_ids) or None,
        "prompt_logprobs": None if prefill_only else p.prompt_logprobs,
        "logit_bias": dict(p.logit_bias) or None,
        "allowed_token_ids": list(p.allowed_token_ids) or None,
        "bad_words": list(p.bad_words) or None,
    }
    if p.response_format is not None:
        kw["structured_outputs"] = structured(**structured_spec(p.response_format)) if structured else \
            structured_spec(p.response_format)
    if kv_transfer_params is not None:
        kw["extra_args"] = {"kv_transfer_params": dict(kv_transfer_params)}
    return kw


def structured_spec(fmt: dict[str, Any]) -> dict[str, Any]:
    """vLLM's StructuredOutputsParams fields for a task's `response_format` (farm.protocol.request.CONSTRAINTS)."""
    kind = fmt["type"]
    spec: dict[str, Any] = {"json_object": True} if kind == "json_object" else \
        {"json": fmt["json_schema"]["schema"]} if kind == "json_schema" else {kind: fmt[kind]}
    if fmt.get("disable_any_whitespace"):
        spec["disable_any_whitespace"] = True
    return spec


def token_logprobs(token_ids: list[int], positions: Any, k: int, ranks: bool = False,
                   exact: bool = False) -> list[TokenLogprobs]:
    """vLLM's per-token logprobs (one {token id: Logprob} per generated token, the sampled token always
    among them) in the farm's form: the sampled token's and the `k` best ranked, or with `exact` (vLLM's
    logprob_token_ids) every entry in vLLM's order (the sampled token, then the asked ones); with `ranks`, the
    token's own rank (a prompt token's, as vLLM's `prompt_logprobs` show it)."""
    out = []
    for tok, entries in zip(token_ids, positions or [], strict=False):
        entries = entries or {}
        chosen = entries.get(tok)
        top = list(entries.items()) if exact else sorted(
            ((i, e) for i, e in entries.items() if e.rank is not None and e.rank <= k), key=lambda ie: ie[1].rank)
        out.append(TokenLogprobs(float(chosen.logprob) if chosen is not None else float("nan"),
                                 [(int(i), float(e.logprob)) for i, e in top],
                                 int(chosen.rank) if ranks and chosen is not None and chosen.rank is not None
                                 else None))
    return out


def build_engine_args(cfg: FarmConfig, model: ModelConfig, model_dir: Path, kv_events_endpoint: str,
                      kv_events_replay: str | None, known_fields: set[str] | None = None,
                      vllm: SimpleNamespace | None = None, device: str = "cuda", role: str = "both"
                      ) -> dict[str, Any]:
    """AsyncEngineArgs keyword arguments: the farm's settings, then the model's `vllm.engine_args`.

    With `known_fields` (the dataclass fields of the installed AsyncEngineArgs), unknown passthrough keys
    are refused by name here instead of deep inside vLLM. `vllm` (import_vllm()) builds the config
    objects; without it they stay plain dicts (for inspection and tests).
    """
    opts = model.vllm or VllmOptions()
    if known_fields is not None:
        unknown = sorted(set(opts.engine_args) - known_fields)
        if unknown:
            raise ValueError(f"model {model.name!r}: vllm.engine_args {unknown} are not fields of this vLLM's "
                             "AsyncEngineArgs (check the spelling against `vllm serve --help`)")
    events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": kv_events_endpoint,
              "replay_endpoint": kv_events_replay, "topic": ""}
    args: dict[str, Any] = {
        "model": str(model_dir), "tokenizer": str(model_dir), "max_model_len": model.max_model_len,
        "block_size": cfg.block_size(model.name), "enable_prefix_caching": True,
        "kv_events_config": vllm.KVEventsConfig(**events) if vllm else events,
    }
    if known_fields is None or "enable_logging_iteration_details" in known_fields:
        # each step's prompt tokens and the engine core's own time for it reach the farm's stat logger: the
        # router's step costs (VllmEngine._observe_step), measured where the step runs
        args["enable_logging_iteration_details"] = True
    if not KV_SIZING_ARGS & set(opts.engine_args):  # the farm's KV budget, unless the entry sizes it itself
        args["kv_cache_memory_bytes"] = cfg.engine.kv_cache_mb * 2**20
    dtype = cfg.engine.dtype
    if dtype == "auto" and device == "cpu":
        dtype = "float32"  # the farm's `auto` is fp32 on CPUs for every backend (vLLM's own picks bf16)
    if dtype != "auto":
        args["dtype"] = dtype
    if opts.kv_connector:
        transfer = {"kv_connector": opts.kv_connector, "kv_role": opts.kv_role or WORKER_KV_ROLES[role]}
        if opts.kv_connector == "NixlConnector" and device == "cpu":  # NIXL without its busy polling thread
            transfer.update(kv_connector="FarmNixlConnector", kv_connector_module_path="farm.backends.vllm_nixl")
        if opts.kv_connector_extra_config:
            transfer["kv_connector_extra_config"] = dict(opts.kv_connector_extra_config)
        args["kv_transfer_config"] = vllm.KVTransferConfig(**transfer) if vllm else transfer
    args.update(opts.engine_args)
    return args
