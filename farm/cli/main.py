"""`farm`: run and inspect an Inference Farm.

    farm up [--detach] [--prefill-workers N] [--decode-workers N] [--workers N] [--port P] ...
    farm serve PATH_OR_GGUF [--workers N] [--prefill-workers N --decode-workers N] [--backend B] [--port P] ...
    farm logs [component] [-f] [-n N]
    farm down
    farm status [--json]
    farm prepare
    farm worker --role decode [--model NAME] [--name NAME]
    farm planner run [--mode load|sla] [--dry-run] | farm planner profile --out config/profiles/M.json
    farm config import-vsr FILE [-o OUT] | farm semantic test "prompt"   (farm/cli/semantic.py)

Configuration comes from config/default.yaml, then the file in FARM_CONFIG (or --config), then
FARM_<SECTION>__<KEY> environment variables. A configuration error exits with status 2.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from typing import Any

from farm.cli.status import cmd_status
from farm.config import ConfigError, FarmConfig, load_config
from farm.protocol import ROLES


# -- farm up ----------------------------------------------------------------------------------------
def cmd_up(cfg: FarmConfig, args: argparse.Namespace) -> int:
    from farm.supervisor import Farm

    if args.router_mode:
        if not hasattr(cfg, "router"):
            raise ConfigError("--router-mode: this farm has no router settings")
        # The resolved configuration (with this mode) is what every child process loads.
        cfg = cfg.model_copy(update={"router": cfg.router.model_copy(update={"mode": args.router_mode})})
    if args.redis_ha:  # the resolved configuration (with HA) is what every child process loads
        ha = cfg.redis.ha.model_copy(update={"enabled": True})
        cfg = cfg.model_copy(update={"redis": cfg.redis.model_copy(update={"ha": ha})})
    models = [cfg.default_model] if args.default_only else [m.name for m in cfg.models]
    return Farm.from_flags(cfg, args, models).serve(timeout=args.timeout, detach=args.detach)


# -- farm serve -------------------------------------------------------------------------------------
def _rename_models(node: Any, names: dict[str, str]) -> Any:
    """A copy of a configuration subtree with every model name (as a value or a key) renamed."""
    if isinstance(node, dict):
        return {names.get(k, k): _rename_models(v, names) for k, v in node.items()}
    if isinstance(node, list):
        return [_rename_models(v, names) for v in node]
    return names.get(node, node) if isinstance(node, str) else node


def serve_config(cfg: FarmConfig, args: argparse.Namespace) -> FarmConfig:
    """The configuration `farm serve MODEL` runs: the farm's defaults (and --config) with MODEL as the one model.

    MODEL is a configured model's name, a Hugging Face model directory (with config.json), or a GGUF file
    (converted once into <state_dir>/models/<name>). The semantic layer's references to the configured models
    are pointed at MODEL, so its routes and guards keep working with one model.
    """
    from pathlib import Path

    from farm.models.directories import convert_gguf

    target = args.model
    router: dict[str, Any] = {}
    for flag, key in (("router_mode", "mode"), ("router_temperature", "temperature"),
                      ("kv_overlap_score_weight", "overlap_weight")):
        if getattr(args, flag) is not None:
            router[key] = getattr(args, flag)
    if args.kv_overlap_score_weight is not None:
        router["cost"] = "dynamo"  # Dynamo's flag: its cost formula, where this weight applies
    data = cfg.model_dump(mode="json")
    data["router"].update(router)
    known = {m.name: m for m in cfg.models}
    if target in known:  # a configured model: its entry as it is (renamed by --served-model-name)
        entry = data["models"][[m.name for m in cfg.models].index(target)]
        name = args.served_model_name or target
    else:
        path = Path(target).expanduser().resolve()
        if path.is_file() and path.suffix == ".gguf":
            name = args.served_model_name or path.stem
            out = cfg.state_path / "models" / re.sub(r"[^A-Za-z0-9._-]+", "_", name)
            convert_gguf(path, out, name)
            path = out
        elif path.is_dir() and (path / "config.json").is_file():
            name = args.served_model_name or path.name
        else:
            raise ConfigError(f"farm serve: {target!r} is no configured model ({', '.join(known)}), no Hugging "
                              "Face model directory (with config.json) and no .gguf file")
        entry = {"name": name, "path": str(path), "max_model_len": args.max_model_len or 4096}
    if args.backend:
        entry["backend"] = args.backend
        if args.backend != "vllm":
            entry.pop("vllm", None)
    if args.max_model_len:
        entry["max_model_len"] = args.max_model_len
    entry.pop("workers", None)  # the flags (or the `workers` section) say how many
    entry["name"] = name
    _vllm_serve_flags(cfg, args, data, entry, configured=target in known)
    names = {m: name for m in known}
    data["semantic"] = _rename_models(data.get("semantic"), names) if "semantic" in data else None
    if data["semantic"] is None:
        data.pop("semantic")
    data["models"] = [entry]
    data["default_model"] = name
    try:
        return FarmConfig.model_validate(data)
    except ValueError as e:
        raise ConfigError(f"farm serve: {e}") from None


# vLLM's --dtype values -> engine.dtype (both engines: vLLM workers get engine.dtype as their dtype)
SERVE_DTYPES = {"auto": "auto", "half": "float16", "float16": "float16", "bfloat16": "bfloat16",
                "float": "float32", "float32": "float32"}
# generation_config.json keys vLLM applies as default sampling parameters (ModelConfig.get_diff_sampling_param)
# -> models[].defaults
GENERATION_DEFAULTS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                       "repetition_penalty": "repetition_penalty", "presence_penalty": "presence_penalty",
                       "frequency_penalty": "frequency_penalty", "max_new_tokens": "max_tokens"}


def _chat_template(value: str) -> str:
    """vLLM's --chat-template: a file's text, else the argument itself when it is a Jinja template."""
    from pathlib import Path

    path = Path(value).expanduser()
    try:
        is_file = path.is_file()
    except OSError:  # e.g. a template longer than a file name may be
        is_file = False
    if is_file:
        try:
            return path.read_text()
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"farm serve: --chat-template {value}: cannot read it ({e})") from None
    if any(c in value for c in "{}\n"):
        return value
    raise ConfigError(f"farm serve: --chat-template {value!r} is no file and not a Jinja template (vLLM's rule: "
                      "a path to a template file, or the template itself)")


def _generation_defaults(cfg: FarmConfig, src: str, entry: dict[str, Any]) -> dict[str, Any]:
    """vLLM's --generation-config as models[].defaults: `vllm` = neutral defaults (a configured entry's own are
    dropped), `auto` = the model's generation_config.json (vLLM's default), a folder = that folder's; the sampling
    parameters vLLM takes from it, a value out of the farm's ranges failing the configuration's validation."""
    from pathlib import Path

    from farm.config import ModelConfig
    from farm.models.directories import model_dir

    if src == "vllm":
        return {}  # vLLM's neutral sampling, whatever a configured entry sets
    defaults = dict(entry.get("defaults") or {})
    if src == "auto":
        try:  # a path's own folder as it is: the entry is validated with the whole configuration
            folder = Path(entry["path"]) if entry.get("path") else model_dir(cfg, ModelConfig.model_validate(entry))
        except ValueError as e:
            raise ConfigError(f"farm serve: {e}") from None
        if not (folder / "generation_config.json").is_file():
            return defaults  # no file: vLLM's neutral defaults too
    else:
        folder = Path(src).expanduser().resolve()
        if not (folder / "generation_config.json").is_file():
            raise ConfigError(f"farm serve: --generation-config {src}: no generation_config.json in that folder "
                              "(give a folder, `auto` or `vllm`)")
    try:
        from transformers import GenerationConfig

        gen = GenerationConfig.from_pretrained(folder).to_diff_dict()  # what vLLM reads: the non-default values
    except (OSError, ValueError) as e:
        raise ConfigError(f"farm serve: --generation-config {src}: {folder / 'generation_config.json'} is not a "
                          f"valid generation config ({e})") from None
    for key, field in GENERATION_DEFAULTS.items():
        if gen.get(key) is not None:
            defaults[field] = gen[key]
    return defaults


def _tool_flags(args: argparse.Namespace, entry: dict[str, Any]) -> None:
    """vLLM's --enable-auto-tool-choice with --tool-call-parser: `tool_choice: auto` read by that parser
    (models[].tool_call_parser). As in vLLM, the parser alone does not enable auto, and auto needs a parser; a model
    served from a path has no parser unless these flags give one (a configured model keeps its entry's)."""
    from farm.openai.tool_parsers import PARSERS

    parser = args.tool_call_parser
    if parser is not None and parser not in PARSERS:
        raise ConfigError(f"farm serve: --tool-call-parser {parser!r}: the farm reads {', '.join(sorted(PARSERS))}")
    if args.enable_auto_tool_choice:
        if parser is None:
            raise ConfigError("farm serve: --enable-auto-tool-choice needs --tool-call-parser (as in vLLM)")
        entry["tool_call_parser"] = parser
    elif parser is not None:
        entry["tool_call_parser"] = None
    if args.reasoning_parser is not None:
        entry["reasoning_parser"] = args.reasoning_parser


def _vllm_serve_flags(cfg: FarmConfig, args: argparse.Namespace, data: dict[str, Any], entry: dict[str, Any],
                      configured: bool = False) -> None:
    """vLLM's `vllm serve` flags, each where the farm keeps it: the API section, the engine section (built-in
    engine) or the model's `vllm.engine_args` (vLLM workers); a flag the model's engine cannot honour is refused.
    A model served from a path samples as `vllm serve` would by default (`--generation-config auto`); a configured
    model as its entry says unless the flag is given."""
    import hashlib

    from farm.tenancy.api_keys import HASH_PREFIX

    if args.host is not None:
        data["api"]["host"] = args.host  # not loopback: needs an API key (Farm refuses to start otherwise)
    if args.port is not None:
        data["api"]["port"] = args.port
    for key in args.api_key or []:
        # only the key's digest goes into the configuration every child reads (<state_dir>/config.resolved.yaml,
        # 0600): no child's command line nor environment carries the key
        data["api"]["api_keys"] = [*data["api"].get("api_keys", []),
                                   HASH_PREFIX + hashlib.sha256(key.encode()).hexdigest()]
    if args.chat_template is not None:
        entry["chat_template"] = _chat_template(args.chat_template)
    _tool_flags(args, entry)
    src = args.generation_config or (None if configured else "auto")
    if src is not None:
        entry["defaults"] = _generation_defaults(cfg, src, entry)
    if args.dtype is not None:
        data["engine"]["dtype"] = SERVE_DTYPES[args.dtype]
    vllm = entry.get("backend", "builtin") == "vllm"
    engine_args: dict[str, Any] = {}
    if args.max_num_seqs is not None:
        if vllm:
            engine_args["max_num_seqs"] = args.max_num_seqs
        else:
            data["engine"]["max_num_seqs"] = args.max_num_seqs
    for flag, value in (("tensor_parallel_size", args.tensor_parallel_size),
                        ("gpu_memory_utilization", args.gpu_memory_utilization),
                        ("trust_remote_code", args.trust_remote_code or None), ("seed", args.seed)):
        if value is None:
            continue
        if vllm:
            engine_args[flag] = value
        elif flag != "tensor_parallel_size" or value > 1:
            raise ConfigError(f"farm serve: --{flag.replace('_', '-')}: {BUILTIN_REFUSALS[flag]}; it applies to "
                              "vLLM workers (--backend vllm)")
    if engine_args:
        opts = entry.get("vllm") or {}
        entry["vllm"] = {**opts, "engine_args": {**(opts.get("engine_args") or {}), **engine_args}}


# Why the built-in engine refuses a vLLM engine flag (no honest mapping onto its settings)
BUILTIN_REFUSALS = {
    "tensor_parallel_size": "the built-in engine runs a model on one device (no tensor parallelism); run more "
                            "workers instead (--workers)",
    "gpu_memory_utilization": "the built-in engine sizes its KV cache in MiB, not as a share of GPU memory: set "
                              "engine.kv_cache_mb (FARM_ENGINE__KV_CACHE_MB)",
    "trust_remote_code": "the built-in engine runs only the architectures it knows (Llama, Mistral, Qwen2, Qwen3) "
                         "with transformers' own modules, never a model's own code",
    "seed": "the built-in engine draws each request's randomness on its own; a request's `seed` makes it "
            "reproducible",
}


def cmd_serve(cfg: FarmConfig, args: argparse.Namespace) -> int:
    from farm.supervisor import Farm

    cfg = serve_config(cfg, args)
    return Farm.from_flags(cfg, args).serve(timeout=args.timeout, detach=args.detach)


# -- farm logs --------------------------------------------------------------------------------------
def cmd_logs(cfg: FarmConfig, args: argparse.Namespace) -> int:
    from farm.infra import logfiles

    log_dir = cfg.state_path / "logs"
    names = logfiles.log_names(log_dir) if log_dir.is_dir() else []
    if not names:
        print(f"farm: no logs under {log_dir} (has `farm up` run with this state_dir?)", file=sys.stderr)
        return 1
    if args.component is None and not args.follow:
        for name in names:
            print(f"==> {name} ({log_dir / (name + '.log')}) <==")
            for line in logfiles.tail_lines(log_dir / f"{name}.log", args.lines):
                print(line)
        return 0
    component = args.component or "api"
    if component not in names:
        print(f"farm: no log named {component!r}; there are: {', '.join(names)}", file=sys.stderr)
        return 1
    path = log_dir / f"{component}.log"
    for line in logfiles.tail_lines(path, args.lines):
        print(line)
    if args.follow:
        try:
            for line in logfiles.follow(path):
                print(line, flush=True)
        except KeyboardInterrupt:
            return 0
    return 0


# -- farm down --------------------------------------------------------------------------------------
def cmd_down(cfg: FarmConfig, args: argparse.Namespace) -> int:
    from farm.supervisor import stop_from_state_file

    stopped = stop_from_state_file(cfg, grace_s=args.grace)
    if stopped:
        print(f"stopped: {', '.join(stopped)}")
    else:
        print(f"no farm is running from {cfg.state_path}")
    return 0


# -- farm prepare / worker --------------------------------------------------------------------------
def cmd_prepare(cfg: FarmConfig, args: argparse.Namespace) -> int:
    from farm.models.directories import ModelNotFoundError, prepare_all

    try:
        paths = prepare_all(cfg, progress=not args.quiet)
    except ModelNotFoundError as e:
        print(f"farm: {e}", file=sys.stderr)
        return 1
    for name, path in paths.items():
        print(f"{name}: {path}")
    return 0


def cmd_worker(cfg: FarmConfig, args: argparse.Namespace) -> int:
    if args.model is not None:
        try:
            cfg.model(args.model)
        except KeyError:
            raise ConfigError(f"unknown model {args.model!r}; configured: {[m.name for m in cfg.models]}") from None
    argv = [sys.executable, "-m", "tasks.worker", "--role", args.role]
    for flag in ("model", "name", "concurrency", "loglevel"):
        value = getattr(args, flag)
        if value is not None:
            argv += [f"--{flag}", str(value)]
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, argv)
    return 0  # not reached


# -- argument parsing -------------------------------------------------------------------------------
def _int_in(lo: int, hi: int | None = None):
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if v < lo or (hi is not None and v > hi):
            raise argparse.ArgumentTypeError(f"{v} is not in [{lo}, {hi}]" if hi is not None else f"{v} is below {lo}")
        return v
    return parse


def _fraction(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0.0 < v <= 1.0:
        raise argparse.ArgumentTypeError(f"{v} is not in (0, 1]")
    return v


def _nonempty(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("must not be empty")
    return text


def _host(text: str) -> str:
    if not re.fullmatch(r"[A-Za-z0-9.:%_-]{1,253}", text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a host name or an IP address")
    return text


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="farm", description="Inference Farm: run and inspect the serving farm.")
    p.add_argument("--config", metavar="PATH", help="override file (default: $FARM_CONFIG)")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    up = sub.add_parser("up", help="start Redis (if needed), workers, the API and Flower")
    up.add_argument("--detach", action="store_true",
                    help="return once every component is healthy, leaving the farm running")
    up.add_argument("--prefill-workers", type=int, metavar="N", help="prefill workers (default: workers.prefill)")
    up.add_argument("--decode-workers", type=int, metavar="N", help="decode workers (default: workers.decode)")
    up.add_argument("--workers", type=int, metavar="N",
                    help="aggregated (prefill+decode) workers; alone, runs only these")
    up.add_argument("--default-only", action="store_true", help="workers for default_model only "
                    "(default: every configured model, each with its models[].workers or the counts above)")
    up.add_argument("--port", type=int, metavar="P", help="API port (default: api.port)")
    up.add_argument("--router-mode", choices=("kv", "least-loaded", "round-robin", "random"),
                    help="how the API places requests on workers (default: router.mode)")
    up.add_argument("--no-flower", action="store_true", help="do not start Flower")
    up.add_argument("--redis-ha", action="store_true",
                    help="Redis Sentinel (redis.ha.enabled): a primary, a replica and three sentinels, failing over "
                         "on their own")
    up.add_argument("--timeout", type=float, default=300.0, metavar="S",
                    help="seconds to wait for every component to become healthy (default: 300)")
    up.add_argument("--grace", type=float, default=60.0, metavar="S",
                    help="on stop, seconds workers get to finish their requests (default: 60)")
    up.set_defaults(func=cmd_up)

    sv = sub.add_parser("serve", help="serve one model (a configured name, a Hugging Face directory or a GGUF "
                        "file) like `vllm serve`: the farm's defaults for everything else")
    sv.add_argument("model", metavar="PATH_OR_GGUF", help="configured model name, model directory or .gguf file")
    sv.add_argument("--served-model-name", metavar="NAME", help="the model's name in the API (default: the "
                    "configured name, or the directory's or file's name)")
    sv.add_argument("--workers", type=int, metavar="N", help="aggregated (prefill+decode) workers; alone, only these")
    sv.add_argument("--prefill-workers", type=int, metavar="N", help="prefill workers (default: workers.prefill)")
    sv.add_argument("--decode-workers", type=int, metavar="N", help="decode workers (default: workers.decode)")
    sv.add_argument("--backend", choices=("builtin", "vllm"), help="engine of the workers (default: builtin)")
    sv.add_argument("--max-model-len", type=int, metavar="N", help="context length (default: 4096)")
    sv.add_argument("--port", type=_int_in(1, 65535), metavar="P", help="API port (api.port)")
    # vLLM's `vllm serve` flags (README, "farm serve for vllm serve users")
    sv.add_argument("--host", type=_host, metavar="H", help="API bind address (api.host; default 127.0.0.1); "
                    "any other than loopback needs an API key (--api-key, FARM_API_KEYS or api.api_keys)")
    sv.add_argument("--api-key", action="append", type=_nonempty, metavar="KEY",
                    help="an API key clients must send as Bearer (repeatable; api.api_keys, as its sha256 digest). "
                         "Visible in this process's command line, as with vLLM: FARM_API_KEYS=KEY is the safer way")
    sv.add_argument("--dtype", choices=tuple(SERVE_DTYPES), help="weights' dtype (engine.dtype; default: auto = "
                    "float32 on CPUs, the model's on GPUs)")
    sv.add_argument("--max-num-seqs", type=_int_in(1), metavar="N", help="most sequences a worker runs at once "
                    "(engine.max_num_seqs; vLLM workers: vllm.engine_args.max_num_seqs)")
    sv.add_argument("--chat-template", metavar="FILE_OR_TEMPLATE", help="a Jinja chat template (a file, or the "
                    "template itself) used instead of the model's (models[].chat_template)")
    sv.add_argument("--generation-config", metavar="auto|vllm|DIR", type=_nonempty,
                    help="default sampling parameters (models[].defaults): auto = the model's "
                         "generation_config.json (the default for a path, as vLLM's; a configured model keeps its "
                         "entry's unless given), vllm = neutral, DIR = that folder's")
    sv.add_argument("--trust-remote-code", action="store_true", help="let vLLM workers run the model's own code "
                    "(vllm.engine_args.trust_remote_code; the API's tokenizer too); refused by the built-in engine")
    sv.add_argument("--tensor-parallel-size", "-tp", type=_int_in(1), metavar="N",
                    help="GPUs per vLLM worker (vllm.engine_args); the built-in engine takes only 1")
    sv.add_argument("--gpu-memory-utilization", type=_fraction, metavar="F",
                    help="share of GPU memory a vLLM worker takes (vllm.engine_args; instead of engine.kv_cache_mb); "
                         "refused by the built-in engine")
    sv.add_argument("--seed", type=int, metavar="S", help="vLLM workers' engine seed (vllm.engine_args.seed); "
                    "refused by the built-in engine")
    sv.add_argument("--enable-auto-tool-choice", action="store_true", help="tool_choice auto, read by "
                    "--tool-call-parser (models[].tool_call_parser); required and named functions work without it")
    sv.add_argument("--tool-call-parser", metavar="NAME", help="how tool calls are read from the model's text: "
                    "hermes or llama3_json")
    sv.add_argument("--reasoning-parser", choices=("deepseek_r1", "qwen3"), help="split a thinking model's output "
                    "into reasoning and content (models[].reasoning_parser)")
    sv.add_argument("--router-mode", choices=("kv", "least-loaded", "round-robin", "random"), help="default: router.mode")
    sv.add_argument("--router-temperature", type=float, metavar="T",
                    help="softmax temperature over the router's cost (router.temperature; 0 = cheapest)")
    sv.add_argument("--kv-overlap-score-weight", type=float, metavar="W",
                    help="Dynamo's weight of blocks to prefill against active blocks (router.overlap_weight; "
                         "selects router.cost: dynamo)")
    sv.add_argument("--no-flower", action="store_true", help="do not start Flower")
    sv.add_argument("--detach", action="store_true", help="return once healthy, leaving the farm running")
    sv.add_argument("--timeout", type=float, default=300.0, metavar="S",
                    help="seconds to wait for every component to become healthy (default: 300)")
    sv.add_argument("--grace", type=float, default=60.0, metavar="S",
                    help="on stop, seconds workers get to finish their requests (default: 60)")
    sv.set_defaults(func=cmd_serve)

    lg = sub.add_parser("logs", help="the farm's logs (<state_dir>/logs): every component's tail, or one's")
    lg.add_argument("component", nargs="?", help="api, redis, flower, prefill-1, decode-1, batch-1, ...")
    lg.add_argument("-f", "--follow", action="store_true", help="keep printing new lines (default component: api)")
    lg.add_argument("-n", "--lines", type=int, default=20, metavar="N", help="lines of each tail (default: 20)")
    lg.set_defaults(func=cmd_logs)

    down = sub.add_parser("down", help="stop the farm recorded in <state_dir>/farm.json")
    down.add_argument("--grace", type=float, default=60.0, metavar="S",
                      help="seconds workers get to finish their requests before SIGKILL (default: 60)")
    down.set_defaults(func=cmd_down)

    status = sub.add_parser("status", help="workers by role, queue depths, processes, models")
    status.add_argument("--json", action="store_true", help="one JSON object: workers, queues, processes, models")
    status.set_defaults(func=cmd_status)

    prep = sub.add_parser("prepare", help="prepare (convert) every configured model once")
    prep.add_argument("--quiet", action="store_true", help="no progress bar")
    prep.set_defaults(func=cmd_prepare)

    w = sub.add_parser("worker", help="run one worker in the foreground (e.g. on a second machine)")
    w.add_argument("--role", choices=ROLES, required=True)
    w.add_argument("--model", help="model name from the config (default: default_model)")
    w.add_argument("--name", help="worker id (default: <role>@<hostname>)")
    w.add_argument("--concurrency", type=int, help="task threads (default: celery.worker_threads)")
    w.add_argument("--loglevel", help="log level (default: INFO)")
    w.set_defaults(func=cmd_worker)

    from farm.batch.cli import add_parser as add_batch_parser
    from farm.cli.semantic import add_parser as add_semantic_parser
    from farm.planner.cli import add_parser as add_planner_parser

    add_batch_parser(sub)
    add_planner_parser(sub)
    add_semantic_parser(sub)  # farm config import-vsr, farm semantic test
    return p


def main(argv: list[str] | None = None) -> int:
    from farm.infra.filemodes import private_umask

    private_umask()  # what the farm writes (state, logs, Redis's data, batch files) is this user's alone
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help(sys.stderr)
        return 2
    if args.config:
        os.environ["FARM_CONFIG"] = os.path.abspath(args.config)  # children (farm worker) see it too
    try:
        cfg = load_config(args.config)
        return args.func(cfg, args)
    except ConfigError as e:
        print(f"farm: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:
        from farm.supervisor import FarmError

        if isinstance(e, FarmError):
            print(f"farm: {e}", file=sys.stderr)
            return 1
        raise


if __name__ == "__main__":
    sys.exit(main())
