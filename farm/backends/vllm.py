"""The vLLM backend: vLLM's async engine (AsyncLLM) in the worker process, behind the Engine interface.

The adapter is in three modules: the mapping of the farm's configuration and requests onto vLLM's API
(vllm_args.py), the KV-connector handles (vllm_handles.py), and here the engine and its event loop bridge.

WorkerRuntime talks to an engine through farm.engine.contract.ServingEngine (submit, abort, release_held, stats,
active_request_ids, start, stop; held, runner, pool, costs); `VllmEngine` provides it, with a KV connector's
`connector_handle` (ConnectorEngine), so the Celery tasks, streams, claims and registry work unchanged. vLLM is
imported lazily: a farm without GPUs never needs it, and a worker configured for it without the `vllm` extra
fails with a clear error.

- Prefix caching is always on, and vLLM's KV events are translated into the farm's (vllm_events.py).
- Disaggregation goes through vLLM's KV connector (NixlConnector, or LMCacheConnectorV1): a prefill-only
  request runs with max_tokens=1 and the connector's `kv_transfer_params`; vLLM holds the blocks and
  returns the parameters a decode instance needs to pull them. They travel in our signed KV handle
  (`connector`, `kv_transfer_params`), and the decode worker passes them back into its vLLM request
  (SamplingParams.extra_args["kv_transfer_params"], as vLLM's own OpenAI server does).
- One asyncio loop in a thread runs every request as a task; `abort` cancels the task, which makes
  vLLM's `generate` abort the request in the engine.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from farm.backends import vllm_plugin
from farm.backends.cpu_binding import engine_core_cpus, engine_nice, lower_priority, pin_threads, ring_wait
from farm.backends.reaper import start_reaper
from farm.backends.vllm_args import (
    build_engine_args,
    connector_params,
    import_vllm,
    sampling_kwargs,
    token_logprobs,
)
from farm.backends.vllm_events import VllmKVEventSubscriber, VllmKVEventTranslator
from farm.backends.vllm_handles import ConnectorImport, VllmRequestOutput, make_connector_handle
from farm.config import FarmConfig, ModelConfig, VllmOptions
from farm.engine.contract import RequestOutput
from farm.engine.sampling import TokenLogprobs
from farm.engine.step_costs import StepCosts
from farm.engine.timings import RequestTokens, from_prometheus
from farm.models.tokenization import bad_words_problem
from farm.protocol import SamplingParams
from farm.protocol.hashing import block_hashes, salt_root
from farm.protocol.kv_events import KVEventHook

log = logging.getLogger(__name__)


class _WarningsOnly(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING


_WARNINGS_ONLY = _WarningsOnly()  # one instance: addFilter keeps it once however many engines start


# -- the engine adapter -------------------------------------------------------------------------------
class _Runner:
    """What WorkerRuntime reads from `engine.runner`: vLLM's connector moves the KV, not our transfer
    server, so there are no blocks to read here (a built-in decode worker asking gets a refusal and
    prefills locally)."""

    def __init__(self, block_size: int, device: str):
        self.device = device
        self.kv = None
        self.layout = SimpleNamespace(to_dict=lambda: {"block_size": block_size, "backend": "vllm"})

    def read_blocks(self, block_ids: list[int]) -> Any:
        from farm.transfer.tcp import TransferError

        raise TransferError("this is a vLLM worker: its KV moves through vLLM's KV connector")


@dataclass
class _Stats:
    """What vLLM's scheduler reports, kept for the worker's heartbeat (counters are totals since start)."""

    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    prefix_queries: int = 0
    prefix_hits: int = 0
    preemptions: int = 0
    connector_hits: int = 0  # prompt tokens whose KV the KV connector brought in (a remote prefill's)
    kv_transfers: int = 0  # KV transfers the connector completed, and their bytes
    kv_transfer_bytes: int = 0


class VllmEngine:
    """Engine's interface over vLLM's AsyncLLM (see the module docstring)."""

    def __init__(self, cfg: FarmConfig, model: ModelConfig, model_dir: Path, on_kv_event: KVEventHook | None,
                 worker_id: str = "", role: str = "both", vllm: SimpleNamespace | None = None):
        self.vllm = vllm or import_vllm(model.name)
        self.cfg = cfg
        self.model = model
        self.opts = model.vllm or VllmOptions()
        self.worker_id = worker_id
        self.block_size = cfg.block_size(model.name)
        self.max_model_len = model.max_model_len
        self.device = _platform_device()
        if self.device == "cpu" and self.block_size % 32:
            raise ValueError(f"model {model.name!r}: vLLM's CPU attention needs a KV block size that is a multiple "
                             f"of 32, this model has {self.block_size}; set models[].block_size: 32")
        if self.device == "cpu":
            # vLLM 0.31's AOT compile cache fails to load beside torch 2.13 ("'function' object has no
            # attribute 'finalize_loading'") and every start compiled again (80-400 s here); its regular
            # compile cache loads, halving a restart.
            os.environ.setdefault("VLLM_USE_AOT_COMPILE", "0")
        self.connector = self.opts.kv_connector
        if role == "prefill" and not self.connector:
            raise ValueError(f"model {model.name!r}: a vLLM prefill worker needs models[].vllm.kv_connector "
                             "(NixlConnector or LMCacheConnectorV1) to hand its KV to decode workers")
        if self.connector == "NixlConnector":  # where decode workers reach this worker's NIXL side channel:
            # its host, and a port of its own (vLLM's fixed default, 5600, would collide between the workers
            # of one machine); the port travels to decode workers inside the signed handle.
            os.environ.setdefault("VLLM_NIXL_SIDE_CHANNEL_HOST", cfg.transfer.advertise_host)
            os.environ.setdefault("VLLM_NIXL_SIDE_CHANNEL_PORT", str(_free_port(cfg.transfer.bind_host)))
        self.handle_ttl_s = cfg.transfer.handle_ttl_s
        self.held: dict[str, Any] = {}  # vLLM's connector holds prefilled blocks, not us
        self.runner = _Runner(self.block_size, self.device)
        self.translator = VllmKVEventTranslator(on_kv_event or (lambda *a, **k: None), self.block_size)
        self.events = VllmKVEventSubscriber(self.translator)
        known = {f.name for f in dataclasses.fields(self.vllm.AsyncEngineArgs)} \
            if dataclasses.is_dataclass(self.vllm.AsyncEngineArgs) else None
        self.model_dir = model_dir
        self._tokenizer: Any = None  # the model's, for the checks vLLM makes where a failure is fatal to it
        self.engine_args = build_engine_args(cfg, model, model_dir, self.events.endpoint,
                                             self.events.replay_endpoint, known, self.vllm, self.device, role)
        self._stats = _Stats()
        self.costs = StepCosts(self.block_size)  # the router's cost weights, from vLLM's iterations
        self._last_iteration = 0.0
        self._reaper = start_reaper()  # vLLM's engine processes end with this one, even on kill -9
        self._tasks: dict[str, Any] = {}  # request id -> concurrent Future of its task on the loop
        self._tasks_lock = threading.Lock()
        self.tokens_generated = 0
        self.tokens = RequestTokens(self.max_model_len)  # vLLM's per-request series, counted once per request
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="vllm-loop", daemon=True)
        self._thread.start()
        self._choose_ring_wait()
        try:
            self.llm = asyncio.run_coroutine_threadsafe(self._create(), self.loop).result()
        except BaseException:
            self._stop_loop()
            self.events.stop()
            self._reaper.terminate()
            raise
        cache = getattr(getattr(self.llm, "vllm_config", None), "cache_config", None)
        self.pool = SimpleNamespace(num_blocks=int(getattr(cache, "num_gpu_blocks", 0) or 0))
        self._yield_cores()

    def _choose_ring_wait(self) -> None:
        """Tell vLLM's processes, through the environment they inherit, how to wait for each other (the farm's vLLM
        plugin, farm.backends.vllm_plugin, reads it in each of them)."""
        mode = ring_wait(self.opts.ring_wait, self.device)
        os.environ[vllm_plugin.ENV] = mode
        if mode == vllm_plugin.BLOCK and (why := vllm_plugin.why_not_installed()):
            log.warning("models[].vllm.ring_wait is block, but vLLM will not load the farm's plugin (%s): vLLM's "
                        "processes will spin", why)
        else:
            log.info("vLLM's engine core and executor %s while they wait for each other (models[].vllm.ring_wait)",
                     mode)

    def _yield_cores(self) -> None:
        """On a CPU host: keep vLLM's engine core (this process's own children but the reaper; the model executor is
        the engine core's child, bound by vLLM) on this worker's cores, and lower all of vLLM's processes so their
        busy waiting gives way to the request path on shared cores (farm.backends.cpu_binding)."""
        import psutil

        if self.device == "cpu" and self.opts.pin_engine_core and (cpus := engine_core_cpus()):
            cores = [p.pid for p in psutil.Process().children() if p.pid != self._reaper.pid]
            log.info("vLLM engine core %s kept on cores %s (%d threads)", cores, cpus, pin_threads(cores, cpus))
        nice = engine_nice(self.opts.engine_nice, self.device)
        if nice <= 0:
            return
        pids = [p.pid for p in psutil.Process().children(recursive=True) if p.pid != self._reaper.pid]
        log.info("vLLM engine processes %s run at nice %d (%d threads)", pids, nice, lower_priority(pids, nice))

    async def _create(self) -> Any:
        args = self.vllm.AsyncEngineArgs(**self.engine_args)
        # vLLM's own logging stat logger would print every step's iteration details at INFO; the farm's stat
        # logger (below) keeps what the heartbeat and metrics show. A filter, not a level: vLLM reconfigures
        # its loggers when it builds an engine, which resets a child logger's level but not its filters.
        logging.getLogger("vllm.v1.metrics.loggers").addFilter(_WARNINGS_ONLY)
        try:
            return self.vllm.AsyncLLM.from_engine_args(args, stat_loggers=[self._stat_logger_factory()])
        except TypeError:  # a vLLM without stat_loggers: stats fall back to our own counts
            return self.vllm.AsyncLLM.from_engine_args(args)

    def _stat_logger_factory(self) -> Callable[..., Any]:
        """vLLM calls each stat logger with its scheduler stats every step: keep what the heartbeat shows."""
        stats, observe_step = self._stats, self._observe_step
        try:
            from vllm.v1.metrics.loggers import StatLoggerBase
        except ImportError:
            StatLoggerBase = object  # noqa: N806 - vLLM's base class when it has one

        class FarmStatLogger(StatLoggerBase):  # type: ignore[misc, valid-type]
            def __init__(self, *_a: Any, **_k: Any) -> None:
                pass

            def record(self, scheduler_stats: Any = None, iteration_stats: Any = None, *_a: Any, **_k: Any) -> None:
                if iteration_stats is not None:
                    stats.preemptions += int(getattr(iteration_stats, "num_preempted_reqs", 0) or 0)
                details = getattr(scheduler_stats, "iteration_details", None)
                if details is None and iteration_stats is not None:
                    observe_step(iteration_stats, None)
                if scheduler_stats is None:
                    return
                cpc = getattr(scheduler_stats, "connector_prefix_cache_stats", None)
                if cpc is not None:
                    stats.connector_hits += int(getattr(cpc, "hits", 0))
                transfers = (getattr(scheduler_stats, "kv_connector_stats", None) or {}).get("bytes_transferred")
                if transfers:
                    stats.kv_transfers += len(transfers)
                    stats.kv_transfer_bytes += int(sum(transfers))
                stats.running = int(getattr(scheduler_stats, "num_running_reqs", 0))
                # as vLLM exports vllm:num_requests_waiting: the deferred ones too (a P/D decode request waiting
                # for its remote KV)
                stats.waiting = int(getattr(scheduler_stats, "num_waiting_reqs", 0)) + \
                    int(getattr(scheduler_stats, "num_skipped_waiting_reqs", 0) or 0)
                usage = getattr(scheduler_stats, "kv_cache_usage", None)
                stats.kv_usage = float(usage if usage is not None else getattr(scheduler_stats, "gpu_cache_usage", 0.0))
                pc = getattr(scheduler_stats, "prefix_cache_stats", None)
                if pc is not None:
                    stats.prefix_queries += int(getattr(pc, "queries", 0))
                    stats.prefix_hits += int(getattr(pc, "hits", 0))
                if details is not None:
                    observe_step(None, details)  # after kv_usage: a decode step's blocks are this step's

            def log_engine_initialized(self) -> None:
                pass

            def log(self) -> None:
                pass

        return FarmStatLogger

    def _observe_step(self, it: Any, details: Any) -> None:
        """One engine step as a step cost: a step that computed prompt tokens counts as prefill (those tokens),
        else as decode (the KV blocks in use).

        `details`: vLLM's iteration details (engine arg `enable_logging_iteration_details`, which the farm sets):
        the prompt tokens the step computed, a chunk of a long prompt included, and the engine core's own time
        for it. Without them (a vLLM that has no such field), `it`'s iteration stats: the time since the
        previous iteration the frontend saw, if the engine had work meanwhile, and the prompts the step
        completed. That reading lets the frontend's own delays, and a step that computed only part of a
        prompt, into the decode line: under load it made decode steps look several times their cost."""
        if details is not None:
            seconds = float(getattr(details, "elapsed_ms", 0.0) or 0.0) / 1000
            computed = int(getattr(details, "num_ctx_tokens", 0) or 0)
            decoded = int(getattr(details, "num_generation_tokens", 0) or 0)
            if getattr(details, "is_dummy", False) or not 0 < seconds < 5:
                return
        else:
            now = float(getattr(it, "iteration_timestamp", 0.0) or 0.0)
            last, self._last_iteration = self._last_iteration, now
            if not last or not (self._stats.running or self._stats.waiting) or not 0 < now - last < 5:
                return
            seconds = now - last
            computed = int(getattr(getattr(it, "prompt_token_stats", None), "computed", 0) or 0)
            decoded = int(getattr(it, "num_generation_tokens", 0) or 0)
        if computed:
            self.costs.observe_prefill(computed, seconds)
        elif decoded:
            self.costs.observe_decode(int(self._stats.kv_usage * self.pool.num_blocks), seconds)

    # -- lifecycle -----------------------------------------------------------------------------------
    def start(self) -> VllmEngine:
        self.events.start()
        return self

    def stop(self) -> None:
        for fut in list(self._tasks.values()):
            fut.cancel()

        async def shutdown() -> None:  # on the loop thread: vLLM cancels its own asyncio tasks there
            self.llm.shutdown()

        try:
            asyncio.run_coroutine_threadsafe(shutdown(), self.loop).result(timeout=60)
        except Exception:  # shutting down anyway
            log.warning("vLLM shutdown failed", exc_info=True)
        self._stop_loop()
        self.events.stop()
        self._reaper.terminate()  # vLLM has stopped its processes itself

    def _stop_loop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)

    # -- Engine's thread-safe API ------------------------------------------------------------------------
    def submit(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
               on_output: Callable[[RequestOutput], None], *, prefill_only: bool = False,
               kv_import: Any = None, max_request_s: float | None = None, cache_salt: str = "",
               generated: int = 0) -> None:
        """Start the request on vLLM; outputs arrive through `on_output` (from the loop thread). `cache_salt`
        goes to vLLM as its own (its prefix cache is scoped by it as the built-in engine's is). vLLM's structured
        outputs start their grammar at the prompt's end, so a migrated structured request (`generated`) fails
        with a clear error rather than continue outside its format."""
        if generated and params.response_format is not None:
            on_output(RequestOutput(request_id, finished=True, finish_reason="error:structured output cannot resume "
                                    "on a vLLM worker after its first worker was lost"))
            return
        if params.bad_words and (problem := bad_words_problem(self.tokenizer(), params.bad_words)):
            # vLLM's model runner would raise when scheduling it, which ends its engine core: refused here
            on_output(RequestOutput(request_id, finished=True, finish_reason=f"error:invalid request: bad_words: "
                                    f"{problem}"))
            return
        imported = kv_import.kv_transfer_params if isinstance(kv_import, ConnectorImport) else None
        kv_params = connector_params(self.connector, cache_salt, prefill_only=prefill_only, imported=imported)
        if kv_import is not None and not isinstance(kv_import, ConnectorImport):
            # raw tensors from a built-in prefill worker: vLLM cannot take them
            log.warning("request %s: vLLM cannot import KV tensors pulled from a built-in worker; "
                        "prefilling locally", request_id)
            if getattr(kv_import, "release", None):
                kv_import.release(kv_import.data)
        sp = self.vllm.SamplingParams(
            **sampling_kwargs(params, len(prompt_ids), self.max_model_len, prefill_only=prefill_only,
                              kv_transfer_params=kv_params, structured=self.vllm.StructuredOutputsParams),
            output_kind=self.vllm.RequestOutputKind.DELTA,
        )
        coro = self._generate(request_id, list(prompt_ids), sp, on_output, prefill_only, max_request_s,
                              cache_salt, imported=isinstance(kv_import, ConnectorImport))
        with self._tasks_lock:  # the task removes itself under the same lock, even if it ends at once
            self._tasks[request_id] = asyncio.run_coroutine_threadsafe(coro, self.loop)

    def tokenizer(self) -> Any:
        """The model's tokenizer, loaded at its first use (from the worker's model directory)."""
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        return self._tokenizer

    def abort(self, request_id: str) -> None:
        """Cancel the request's task: vLLM's generate aborts it in the engine on cancellation."""
        fut = self._tasks.get(request_id)
        if fut is not None:
            fut.cancel()

    def release_held(self, request_id: str) -> None:
        """Nothing to release: vLLM's connector frees prefilled blocks once pulled (or on its timeout)."""
        self.held.pop(request_id, None)

    def active_request_ids(self) -> list[str]:
        return list(self._tasks)

    def connector_handle(self, req: Any, out: VllmRequestOutput, endpoint: str, host_id: str,
                         secret: bytes) -> dict[str, Any]:
        """The signed handle a prefill passes to the decode task (WorkerRuntime.prefill)."""
        return make_connector_handle(request_id=req.request_id, worker_id=self.worker_id, endpoint=endpoint,
                                     host_id=host_id, out=out, num_tokens=len(req.prompt_token_ids),
                                     block_size=self.block_size, ttl_s=self.handle_ttl_s, secret=secret)

    def stats(self) -> dict[str, Any]:
        s, total = self._stats, self.pool.num_blocks
        tokens = self.tokens.snapshot()
        return {
            "backend": "vllm",
            "running": max(0, len(self._tasks) - s.waiting),
            "waiting": s.waiting,
            "held": 0,
            "blocks_total": total,
            "blocks_free": int(total * (1.0 - s.kv_usage)),
            "cached_blocks": self.translator.device_blocks,
            "prefix_hit_tokens": s.prefix_hits,
            "prefix_query_tokens": s.prefix_queries,
            "tokens_generated": self.tokens_generated,
            "vllm_unfinished": int(self.llm.get_num_unfinished_requests()),  # requests vLLM still holds
            "preemptions": s.preemptions,
            "kv_usage": s.kv_usage,
            "prompt_tokens": tokens["prompt_tokens"],
            "request_success": tokens["request_success"],
            # vLLM's own request timings (its Prometheus logger); the token series counted here (RequestTokens:
            # vLLM's logger would count a disaggregated request on both its prefill and its decode worker)
            "histograms": {**from_prometheus(), **tokens["histograms"]},
            "costs": self.costs.snapshot(),
            "connector": {"hit_tokens": s.connector_hits, "transfers": s.kv_transfers,
                          "bytes": s.kv_transfer_bytes},
            "kv_events": {"batches": self.events.batches, "gaps": self.events.gaps,
                          "stored": self.translator.stored, "removed": self.translator.removed,
                          "skipped": self.translator.skipped},
        }

    # -- the loop thread -------------------------------------------------------------------------------
    async def _generate(self, rid: str, prompt_ids: list[int], sp: Any, on_output: Callable[[RequestOutput], None],
                        prefill_only: bool, max_request_s: float | None, cache_salt: str = "",
                        imported: bool = False) -> None:
        """`imported`: the prompt's KV comes through the connector (a remote prefill counted the prompt)."""
        n_out, cached, first = 0, 0, None
        done = False
        asked = getattr(sp, "logprob_token_ids", None)  # vLLM's: these tokens' log-probabilities instead of the k best
        k, kp = (len(asked) if asked else sp.logprobs), getattr(sp, "prompt_logprobs", None)

        def finish(reason: str, text: str = "", tokens: list[int] | None = None, params: Any = None,
                   logprobs: list[TokenLogprobs] | None = None,
                   prompt_lps: list[TokenLogprobs | None] | None = None) -> None:
            nonlocal done
            if done:
                return
            done = True
            if not prefill_only or reason == "abort":  # else the decode stage goes on (and ends the request)
                self.tokens.finished(reason, len(prompt_ids), n_out)
            out = VllmRequestOutput(rid, text=text, token_ids=tokens or [], finished=True, finish_reason=reason,
                                    prompt_tokens=len(prompt_ids), completion_tokens=n_out, cached_tokens=cached,
                                    logprobs=logprobs, prompt_logprobs=prompt_lps)
            if reason == "prefilled":
                out.first_token = first
                out.block_hashes = block_hashes(prompt_ids, self.block_size, salt_root(cache_salt))
                out.connector = self.connector
                # NIXL returns the parameters when it holds the blocks; LMCache needs none (keyed by
                # tokens). Without them the worker sends no handle and the decode side prefills.
                if self.connector == "NixlConnector":
                    out.kv_transfer_params = dict(params) if params else None
                elif self.connector:
                    out.kv_transfer_params = dict(params or {})
            on_output(out)

        prompt: dict[str, Any] = {"prompt_token_ids": prompt_ids}
        if cache_salt:
            prompt["cache_salt"] = cache_salt  # in the extra keys of the first block's hash and KV event
        try:
            async with asyncio.timeout(max_request_s):
                async for ro in self.llm.generate(prompt, sp, rid):
                    comp = ro.outputs[0] if ro.outputs else None
                    tokens = [int(t) for t in (comp.token_ids if comp else [])]
                    text = comp.text if comp else ""
                    lps = token_logprobs(tokens, comp.logprobs, k, exact=bool(asked)) if k is not None and comp \
                        else None
                    plps = None  # vLLM sends the prompt's with the first output
                    if kp is not None and getattr(ro, "prompt_logprobs", None):
                        plps = [None, *token_logprobs(prompt_ids[1:], ro.prompt_logprobs[1:], kp, ranks=True)]
                        kp = None
                    n_out += len(tokens)
                    self.tokens_generated += len(tokens)
                    cached = int(getattr(ro, "num_cached_tokens", 0) or 0)
                    if first is None and tokens:
                        first = tokens[0]
                        if not imported:  # the prompt was computed here
                            self.tokens.prefilled(len(prompt_ids))
                    if ro.finished:
                        if prefill_only:
                            finish("prefilled", params=getattr(ro, "kv_transfer_params", None))
                        else:
                            reason = (comp.finish_reason if comp else None) or "stop"
                            finish("abort" if reason == "abort" else reason, text, tokens, logprobs=lps,
                                   prompt_lps=plps)
                        break
                    if text or tokens:
                        on_output(VllmRequestOutput(rid, text=text, token_ids=tokens, logprobs=lps,
                                                    prompt_logprobs=plps))
        except TimeoutError:
            finish("length")  # the farm's cap on one request, as the built-in engine ends it
        except asyncio.CancelledError:
            finish("abort")
        except Exception as e:  # a request vLLM refused (too long, bad params) fails alone
            log.warning("vLLM request %s failed: %s", rid, e)
            finish("error:" + str(e))
        finally:
            finish("abort")
            with self._tasks_lock:
                self._tasks.pop(rid, None)


def _platform_device() -> str:
    """The device vLLM runs on here ("cuda", "cpu", ...), as its platform detection sees it."""
    from vllm.platforms import current_platform

    return str(current_platform.device_type)


def _free_port(host: str = "127.0.0.1") -> int:
    """A port free on `host` now, for a socket vLLM binds itself."""
    import socket

    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
