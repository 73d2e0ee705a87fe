"""The served models (`models[]`: weights, context, block size, sampling defaults, backend and vLLM options)
and the worker counts (`workers`)."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, model_validator

from farm.config.base import Section


class WorkersConfig(Section):
    prefill: int = Field(1, ge=0)
    decode: int = Field(1, ge=0)
    both: int = Field(0, ge=0)
    batch_drivers: int = Field(1, ge=0)  # processes that run OpenAI batches (tasks.batch); 0 = no Batch API runs


# vLLM engine args the farm sets itself (so router, API and workers agree): where each comes from.
VLLM_RESERVED_ARGS = {
    "model": "models[].path / source", "tokenizer": "models[].path / source",
    "max_model_len": "models[].max_model_len", "block_size": "models[].block_size",
    "enable_prefix_caching": "(always on: the router's KV index needs it)",
    "kv_events_config": "(set by the farm: vLLM's KV events feed the router)",
    "kv_transfer_config": "models[].vllm.kv_connector / kv_role / kv_connector_extra_config",
}
VLLM_BLOCK_SIZES = frozenset({16, 32, 64, 128})  # block sizes vLLM's attention backends take (CPU: multiples of 32)
# A vLLM model's block size when its entry names none: the smallest one vLLM accepts on GPUs and CPUs alike.
VLLM_DEFAULT_BLOCK_SIZE = 32


class VllmOptions(Section):
    """Options of a model served by vLLM (`backend: vllm`); `engine_args` go to vllm's AsyncEngineArgs."""

    engine_args: dict[str, Any] = Field(default_factory=dict)
    # Disaggregation through vLLM's KV connector; None: no remote prefill (aggregated workers only).
    kv_connector: Literal["NixlConnector", "LMCacheConnectorV1"] | None = None
    kv_role: Literal["kv_both", "kv_producer", "kv_consumer"] | None = None  # None: from the worker's role
    kv_connector_extra_config: dict[str, Any] = Field(default_factory=dict)
    # nice value of vLLM's engine processes (engine core, model executor), whose busy waiting would otherwise
    # hold the cores the request path needs; None: 19 on CPU-only machines, 0 with a GPU (farm.backends.cpu_binding)
    engine_nice: int | None = Field(None, ge=0, le=19)
    # on a CPU machine whose vLLM workers have core shares: keep each worker's engine core (vLLM's scheduler, which
    # busy-waits for its executor) on its own share instead of letting it float onto the other workers' cores
    pin_engine_core: bool = True
    # how vLLM's engine core and model executor wait for each other's messages: "spin" (vLLM's own: sched_yield for
    # a second after each read) or "block" (sleep until the writer's ZeroMQ wake-up); None: block on CPU-only
    # machines, where the spinning takes the cores the model and the request path need, spin with a GPU
    ring_wait: Literal["spin", "block"] | None = None

    @model_validator(mode="after")
    def _args_ok(self) -> VllmOptions:
        for key in self.engine_args:
            if key in VLLM_RESERVED_ARGS:
                raise ValueError(f"vllm.engine_args.{key} is set by the farm; use {VLLM_RESERVED_ARGS[key]}")
            if not re.fullmatch(r"[a-z][a-z0-9_]*", str(key)):
                raise ValueError(f"vllm.engine_args.{key}: use the snake_case field names of vllm's "
                                 "AsyncEngineArgs (e.g. gpu_memory_utilization, tensor_parallel_size)")
        return self


class SamplingDefaults(Section):
    """A model entry's sampling defaults: what a request gets for a parameter it does not send."""

    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    max_tokens: int | None = Field(None, ge=1)  # None: up to the context length
    # vLLM's extensions, in the ranges a request may send (farm/openai/schemas.py); the defaults change nothing.
    # What `farm serve --generation-config auto` takes from a model's generation_config.json besides the above.
    top_k: int = Field(0, ge=-1, le=1 << 20)  # 0 or -1: all tokens
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)


class ModelWorkers(Section):
    """Worker processes `farm up` starts for one model (instead of the `workers` section's counts)."""

    prefill: int = Field(0, ge=0)
    decode: int = Field(0, ge=0)
    both: int = Field(0, ge=0)


MAX_CHAT_TEMPLATE_CHARS = 1_000_000


def check_chat_template(text: str) -> str:
    """`text` if it parses as a Jinja template (as transformers renders chat templates), else ValueError."""
    import jinja2

    try:
        jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(text)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"chat_template is not a valid Jinja template (line {e.lineno}: {e.message})") from None
    return text


class ModelConfig(Section):
    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9._:\-/]+$")
    source: str | None = None
    path: str | None = None
    max_model_len: int = Field(4096, ge=16)
    # KV block size of this model's workers (the router hashes its prompts with it). None: engine.block_size
    # for the built-in engine, VLLM_DEFAULT_BLOCK_SIZE for vLLM. Every worker of one model must agree.
    block_size: int | None = Field(None, ge=1, le=1024)
    # Two entries may share weights and differ here (e.g. a greedy "precise" entry for the semantic layer).
    defaults: SamplingDefaults = SamplingDefaults()
    workers: ModelWorkers | None = None  # None: the `workers` section (or farm up's flags)
    backend: Literal["builtin", "vllm"] = "builtin"  # which engine the workers of this model run
    vllm: VllmOptions | None = None  # only with backend: vllm
    # A Jinja chat template (the text itself) the API renders chats with instead of the tokenizer's own
    # (vLLM's --chat-template; `farm serve --chat-template FILE_OR_TEMPLATE` reads a file into it). None: the
    # model's own. The API tokenizes, so this one place serves both engines.
    chat_template: str | None = Field(None, min_length=1, max_length=MAX_CHAT_TEMPLATE_CHARS)
    # How the API reads tool calls out of this model's text with `tool_choice: auto` (vLLM's
    # --enable-auto-tool-choice --tool-call-parser): `hermes` (<tool_call>{...}</tool_call>, Qwen, Hermes, ChatML
    # models) or `llama3_json` (a JSON object per call, Llama 3.x). None: `auto` is refused; `required` and a
    # named function work on every model (structured output).
    tool_call_parser: Literal["hermes", "llama3_json"] | None = None
    # How the API splits a thinking model's output into `reasoning` and `content` (vLLM's --reasoning-parser):
    # `deepseek_r1` (thinking up to </think>, the template opened <think>) or `qwen3` (thinking only in <think>
    # ... </think> at the start). None: the text is all content.
    reasoning_parser: Literal["deepseek_r1", "qwen3"] | None = None

    @model_validator(mode="after")
    def _one_source(self) -> ModelConfig:
        if bool(self.source) == bool(self.path):
            raise ValueError(f"model {self.name!r}: give exactly one of `source` (builtin:...) or `path`")
        if self.source and not self.source.startswith("builtin:"):
            raise ValueError(f"model {self.name!r}: source must be builtin:<name>, got {self.source!r}")
        if self.vllm is not None and self.backend != "vllm":
            raise ValueError(f"model {self.name!r}: a `vllm` section needs `backend: vllm` (got {self.backend!r})")
        if self.backend == "vllm" and self.vllm is None:
            self.vllm = VllmOptions()
        if self.chat_template is not None:
            check_chat_template(self.chat_template)
        return self

    @property
    def trust_remote_code(self) -> bool:
        """Whether the model's own code may run (vLLM's trust_remote_code, `vllm.engine_args`): then the API loads
        the model's tokenizer with it too, as vLLM does. The built-in engine never runs a model's code."""
        return bool(self.vllm is not None and self.vllm.engine_args.get("trust_remote_code"))
