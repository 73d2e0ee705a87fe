"""--api-scale: how many output tokens per second one API process carries per core of its own CPU.

A farm with its one API process (gunicorn, gevent) and 2 built-in workers (one torch thread each, semantic
layer off) on the tiny model, at 1, 64, 256 and 1,024 concurrent streams; beside it `vllm serve` on the same
load, counting its API process only (its engine core and model executor are other processes). Per level:
output tok/s, the API process's CPU seconds over the level, tok/s per API core (= output tokens / API CPU
seconds: what one fully busy core of API would carry), and errors (a 503 from the farm's admission counts).

Each stream sends requests until `seconds` have passed (at least one each), so a level lasts about that
long, longer at 1,024 streams where one request per stream is already more. Before 1,024 streams this
process raises its open-files limit, and the farm's `api.worker_connections` is checked to hold them.
"""

from __future__ import annotations

from typing import Any

from bench.common import table
from bench.cpu import FARM_API, MACHINE_OTHERS, VLLM_API, cpu_by_kind, summary
from bench.engine_speed import load
from bench.peers import contenders as pc

SCALE_FARM = {"engine": {"torch_threads": 1}}  # 2 workers on 2 cores: one torch thread each


def _level(ep: pc.Endpoint, api_kind: str, streams: int, seconds: float, max_tokens: int,
           timeout_s: float) -> dict[str, Any]:
    with cpu_by_kind() as cpu:
        lv = load.run_level(ep.base_url, ep.model, f"scale-{streams}", streams, 100_000, max_tokens, timeout_s,
                            deadline_s=seconds)
    api = cpu.get(api_kind, 0.0)
    lv.update(cpu_s=cpu, api_cpu_s=api, tok_s_per_api_core=lv["output_tokens"] / api if api > 0 else None,
              api_cores=api / lv["wall_s"] if lv["wall_s"] else None)
    print(f"    {streams:5d} streams: {lv['output_tok_s']:8.0f} tok/s, API {api:.1f} CPU s "
          f"({lv['api_cores'] or 0:.2f} cores) -> {lv['tok_s_per_api_core'] or 0:,.0f} tok/s per API core; "
          f"{lv['requests']} requests, {lv['errors']} errors {lv['error_kinds'] or ''}; CPU s: {summary(cpu)}",
          flush=True)
    return lv


def run_scale(s: pc.Setup, levels: list[int], seconds: float, max_tokens: int, timeout_s: float,
              contenders: tuple[str, ...] = ("farm", "vllm-serve")) -> dict[str, Any]:
    """Both contenders at every level; {contender: {"levels": {streams: level}, ...}} (errors recorded)."""
    out: dict[str, Any] = {}
    load.raise_open_files(2 * max(levels) + 512)
    for name in contenders:
        rec: dict[str, Any] = {"levels": {}}
        out[name] = rec
        print(f"[api-scale] {name}", flush=True)
        try:
            if name == "farm":
                cm = pc.farm(s, "builtin", 2, extra=SCALE_FARM)
            else:
                cm = pc.vllm_serve(s)
            with cm as ep:
                rec.update(start_s=ep.start_s, commands=ep.commands)
                if ep.farm is not None:
                    wc = ep.farm.cfg.api.worker_connections
                    rec["worker_connections"] = wc
                    rec["worker_connections_ok"] = wc >= max(levels) + 64
                    print(f"    api.worker_connections {wc}: {'enough' if rec['worker_connections_ok'] else 'TOO FEW'} "
                          f"for {max(levels)} streams", flush=True)
                rec["warm_up"] = load.warm_up(lambda tag, n, k, m, ep=ep: load.run_level(
                    ep.base_url, ep.model, tag, n, k, m, timeout_s))
                for streams in levels:
                    rec["levels"][streams] = _level(ep, FARM_API if name == "farm" else VLLM_API, streams, seconds,
                                                    max_tokens, timeout_s)
        except Exception as e:  # noqa: BLE001 - one contender failing must not lose the other's numbers
            rec["error"] = f"{type(e).__name__}: {str(e)[:2000]}"
            print(f"  !! api-scale {name} failed: {rec['error'][:500]}", flush=True)
    return out


def scale_table(res: dict[str, Any]) -> str:
    rows = []
    for name, rec in res.items():
        for streams, lv in sorted(rec.get("levels", {}).items()):
            rows.append([name, streams, "FAILED" if lv["failed"] else "ok", lv["wall_s"], lv["output_tok_s"],
                         lv["api_cpu_s"], lv["api_cores"], lv["tok_s_per_api_core"], lv["requests"], lv["errors"],
                         str(lv["error_kinds"] or ""), lv["cpu_s"].get(MACHINE_OTHERS, 0.0) / lv["wall_s"]])
    return table(["API process of", "streams", "status", "wall s", "out tok/s", "API CPU s", "API cores",
                  "tok/s per API core", "requests", "errors", "error kinds", "others' cores"], rows, digits=1)
