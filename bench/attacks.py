"""The attacks of issue 19 replayed at scale against a real farm, and what a normal user sees meanwhile.

    python -m bench.attacks [--seconds 20] [--only baseline,huge_prompts,...] [--out bench/out/attacks.json]

One farm (bench/farms.py: its own redis-server, one aggregated worker with the default model, the API as
`farm up` runs it). A normal user sends one streaming chat request after another (16 tokens, greedy,
`Cache-Control: no-cache`) and its time to first token (TTFT) is recorded; the API's and the worker's
memory (RSS, children included) and threads are sampled every half second. Each phase runs one attack
for `--seconds` (after a few seconds to build up), then stops it and lets the farm settle:

- baseline: no attack.
- slowloris (item 1): 300 connections sending `POST /v1/chat/completions HTTP/1.1`, `Host`, then one more
  header line every 5 s, never finishing the head (reopened when the server drops them).
- abandoned_non_streaming (item 5): 4 clients each send a non-streaming request for 600 tokens (ignore_eos)
  every 5 s and hang up after 2 s of it.
- huge_prompts (item 9): 4 clients each send a 3.8 MB prompt every 0.5 s (8 a second: each cost the API
  10-14 s of CPU before).
- transfer_port_flood (item 10): 300 idle connections held open on the worker's KV-transfer port (each
  reopened within a second when dropped or refused), and 4 clients each sending a round of headers that
  are not objects or nest 100k deep every 0.1 s.
- transfer_rogue_server (item 10): 4 clients each send the worker a decode task every second whose (validly
  signed) KV handle points at a server that announces 3 GB of blocks (the worker then prefills the 33-token
  prompt locally, all but its last token from its prefix cache, and stops after one token).

Goal: the user's median TTFT during each attack within 2x of the baseline's. The attacks run on the same
2-core machine as the farm, so what they cost as clients (CPU, loopback copies) counts against the farm
too; the paced ones are paced so that the same attack before the fixes would have overwhelmed the farm
(one huge prompt took 10-14 s of API CPU, one abandoned request ran its 600 tokens, one rogue pull grew
the worker by gigabytes), while their honest share of work stays small.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import socket
import socketserver
import statistics
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import requests

from bench.common import finish, goal, percentile, table
from bench.farms import bench_farm
from farm.cluster import registry
from farm.config import FarmConfig
from farm.infra.redis_client import connect
from farm.infra.secret import farm_secret
from farm.models.directories import model_dir
from farm.protocol import (
    EVENT_FIELD,
    TASK_DECODE,
    GenerationRequest,
    SamplingParams,
    decode_reply,
    queue_name,
    reply_stream_key,
)
from farm.transfer.handle import sign_handle

SLOWLORIS_CONNECTIONS = 300
IDLE_TRANSFER_CONNECTIONS = 300
BUILD_UP_S = 3.0
SETTLE_S = 3.0
USER_TIMEOUT_S = 60.0


# -- the normal user ------------------------------------------------------------------------------------
def user_request(url: str, model: str) -> tuple[float, float]:
    """One streaming chat: (TTFT, total) in seconds; raises on any failure."""
    body = {"model": model, "messages": [{"role": "user", "content": "Write one sentence about the sea."}],
            "max_tokens": 16, "temperature": 0, "stream": True}
    t0 = time.perf_counter()
    ttft = None
    with requests.post(url, json=body, stream=True, timeout=(10, USER_TIMEOUT_S),
                       headers={"Cache-Control": "no-cache"}) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if not line.startswith(b"data: "):
                continue
            if line == b"data: [DONE]":
                break
            chunk = json.loads(line[6:])
            if ttft is None and chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                ttft = time.perf_counter() - t0
    if ttft is None:
        raise RuntimeError("no token")
    return ttft, time.perf_counter() - t0


def user_loop(url: str, model: str, stop: threading.Event, out: dict[str, list]) -> None:
    while not stop.is_set():
        try:
            ttft, total = user_request(url, model)
            out["ttft"].append(ttft)
            out["total"].append(total)
        except Exception as e:  # noqa: BLE001 - a failed request is a result here
            out["errors"].append(f"{type(e).__name__}: {e}"[:200])
            time.sleep(0.5)
        time.sleep(0.1)


# -- sampling the farm ----------------------------------------------------------------------------------
def tree(pid: int) -> list[psutil.Process]:
    p = psutil.Process(pid)
    return [p, *p.children(recursive=True)]


def usage(pids: list[int]) -> tuple[float, int]:
    """(RSS in MB, threads) of the processes and their children."""
    rss, threads = 0, 0
    for pid in pids:
        for p in tree(pid):
            try:
                rss += p.memory_info().rss
                threads += p.num_threads()
            except psutil.Error:
                pass
    return rss / 2**20, threads


def sampler(groups: dict[str, list[int]], stop: threading.Event, out: dict[str, list]) -> None:
    while not stop.is_set():
        for name, pids in groups.items():
            rss, threads = usage(pids)
            out[f"{name}_rss_mb"].append(rss)
            out[f"{name}_threads"].append(threads)
        stop.wait(0.5)


# -- the attacks ----------------------------------------------------------------------------------------
Attack = Callable[[threading.Event], None]


def forever(stop: threading.Event, fn: Callable[[], None], pause: float = 0.0) -> None:
    while not stop.is_set():
        try:
            fn()
        except Exception:  # noqa: BLE001 - the server refusing or dropping us is expected
            time.sleep(0.05)
        if pause:
            stop.wait(pause)


def slowloris(host: str, port: int, n: int) -> Attack:
    """Item 1: hold `n` connections whose request head never ends."""

    def run(stop: threading.Event) -> None:
        socks: list[socket.socket | None] = [None] * n
        while not stop.is_set():
            for i in range(n):
                try:
                    if socks[i] is None:
                        s = socket.create_connection((host, port), timeout=5)
                        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
                        socks[i] = s
                    else:
                        socks[i].sendall(f"X-Wait-{i}: {time.time()}\r\n".encode())
                except OSError:
                    if socks[i] is not None:
                        socks[i].close()
                    socks[i] = None
            stop.wait(5)
        for s in socks:
            if s is not None:
                s.close()

    return run


def abandoned_non_streaming(url: str, model: str, n: int, period_s: float = 5.0) -> Attack:
    """Item 5: non-streaming requests for 600 tokens whose clients hang up after 2 s, one per client per period."""
    body = {"model": model, "messages": [{"role": "user", "content": "Write a very long essay about the history of trains."}],
            "max_tokens": 600, "ignore_eos": True}  # a prompt the jailbreak guard passes: the attack is the hang-up

    def one() -> None:
        try:
            requests.post(url, json=body, timeout=(5, 2), headers={"Cache-Control": "no-cache"})
        except requests.Timeout:
            pass

    return lambda stop: _threads(n, stop, lambda: forever(stop, one, max(0.0, period_s - 2)))


def huge_prompts(url: str, model: str, n: int, pause_s: float = 0.5) -> Attack:
    """Item 9: 3.8 MB prompts, one per client every `pause_s` (plus its answer's time)."""
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "lorem ipsum " * 316_000}]}).encode()

    def one() -> None:
        requests.post(url, data=body, headers={"Content-Type": "application/json"}, timeout=60)

    return lambda stop: _threads(n, stop, lambda: forever(stop, one, pause_s))


def transfer_port_flood(endpoint: str, idle: int, n: int, pause_s: float = 0.1) -> Attack:
    """Item 10 (rogue clients): idle connections held open (reopened as soon as dropped or refused), and
    malformed headers, a round of them per client every `pause_s`."""
    host, port = endpoint.rsplit(":", 1)
    junk = [b"[1, 2, 3]\n", b"[" * 100_000 + b"]" * 100_000 + b"\n", b'{"handle": 5}\n', b"\xff\n"]

    def hold(stop: threading.Event) -> None:
        socks: list[socket.socket | None] = [None] * idle
        while not stop.is_set():
            for i in range(idle):
                if socks[i] is None:
                    try:
                        socks[i] = socket.create_connection((host, int(port)), timeout=5)
                    except OSError:
                        pass
            stop.wait(1)
            for i, s in enumerate(socks):  # reopen what the server dropped
                if s is not None:
                    s.setblocking(False)
                    try:
                        if s.recv(4096) == b"":
                            s.close()
                            socks[i] = None
                    except BlockingIOError:
                        pass
                    except OSError:
                        s.close()
                        socks[i] = None
        for s in socks:
            if s is not None:
                s.close()

    def one() -> None:
        for payload in junk:
            with socket.create_connection((host, int(port)), timeout=5) as s:
                s.sendall(payload)
                s.recv(4096)

    def run(stop: threading.Event) -> None:
        holder = threading.Thread(target=hold, args=(stop,), daemon=True)
        holder.start()
        _threads(n, stop, lambda: forever(stop, one, pause_s))
        holder.join(10)

    return run


class RogueKVServer(socketserver.ThreadingTCPServer):
    """Answers every pull with a 3 GB announcement (and nothing after it)."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self) -> None:
        class H(socketserver.StreamRequestHandler):
            def handle(self) -> None:
                self.rfile.readline()
                self.wfile.write(b'{"ok": true, "nbytes": 3000000000}\n')
                self.wfile.flush()
                time.sleep(2)

        super().__init__(("127.0.0.1", 0), H)
        threading.Thread(target=self.serve_forever, daemon=True).start()


def kv_layout(cfg: FarmConfig) -> dict[str, Any]:
    c = json.loads((model_dir(cfg, cfg.model(cfg.default_model)) / "config.json").read_text())
    heads = c["num_attention_heads"]
    return {"num_layers": c["num_hidden_layers"], "num_kv_heads": c.get("num_key_value_heads", heads),
            "head_dim": c.get("head_dim") or c["hidden_size"] // heads, "block_size": cfg.block_size(cfg.default_model),
            "dtype": "float32"}


def transfer_rogue_server(cfg: FarmConfig, celery, n: int, pause_s: float = 1.0) -> Attack:  # noqa: ANN001
    """Item 10 (rogue server): decode tasks with signed handles pointing at a server announcing 3 GB."""
    r = connect(cfg.redis)
    secret = farm_secret(cfg)
    layout = kv_layout(cfg)
    model = cfg.default_model

    def one(endpoint: str) -> None:
        rid = "attack-" + uuid.uuid4().hex
        prompt = list(range(100, 133))  # the same each time: after the first, all but one token is cached
        reader = "attack-reader-" + uuid.uuid4().hex  # its own reply stream, no lease (never orphaned)
        req = GenerationRequest(rid, model, prompt, SamplingParams(max_tokens=1, temperature=0), reply_to=reader)
        handle = sign_handle({
            "request_id": rid, "worker_id": "rogue", "endpoint": endpoint, "host_id": "elsewhere", "transport": "tcp",
            "block_ids": list(range(3)), "block_hashes": [], "num_tokens": len(prompt), "first_token": 1,
            "cached_tokens": 0, "layout": layout, "checksum": "0", "expires_at": time.time() + 60}, secret)
        celery.send_task(TASK_DECODE, args=[req.to_dict(), handle], queue=queue_name(model, "decode"))
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # until the worker finished it (it prefills locally instead)
            batches = [decode_reply(f[EVENT_FIELD.encode()]) for _, f in r.xrange(reply_stream_key(reader))]
            if any(ev.type in ("done", "error") for b in batches for ev in b.events.get(rid, [])):
                return
            time.sleep(0.05)

    def run(stop: threading.Event) -> None:
        rogue = RogueKVServer()
        endpoint = f"127.0.0.1:{rogue.server_address[1]}"
        try:
            _threads(n, stop, lambda: forever(stop, lambda: one(endpoint), pause_s))
        finally:
            rogue.shutdown()
            rogue.server_close()

    return run


def _threads(n: int, stop: threading.Event, target: Callable[[], None]) -> None:
    ts = [threading.Thread(target=target, daemon=True) for _ in range(n)]
    for t in ts:
        t.start()
    stop.wait()
    for t in ts:
        t.join(70)


# -- one phase ------------------------------------------------------------------------------------------
def run_phase(name: str, attack: Attack | None, url: str, model: str, groups: dict[str, list[int]],
              seconds: float) -> dict[str, Any]:
    """The attack runs in a process of its own (forked): its client threads must not take the GIL from the
    normal user's, or the user's latency would measure this process rather than the farm."""
    fork = multiprocessing.get_context("fork")
    stop_attack, stop_user = fork.Event(), threading.Event()
    user: dict[str, list] = {"ttft": [], "total": [], "errors": []}
    samples: dict[str, list] = {f"{g}_{k}": [] for g in groups for k in ("rss_mb", "threads")}
    attacker = fork.Process(target=attack, args=(stop_attack,), daemon=True) if attack else None
    before = {g: usage(p) for g, p in groups.items()}
    if attacker is not None:
        attacker.start()
        time.sleep(BUILD_UP_S)
    watcher = threading.Thread(target=sampler, args=(groups, stop_user, samples), daemon=True)
    prober = threading.Thread(target=user_loop, args=(url, model, stop_user, user), daemon=True)
    watcher.start()
    prober.start()
    time.sleep(seconds)
    stop_user.set()
    prober.join(USER_TIMEOUT_S + 15)
    watcher.join(5)
    stop_attack.set()
    if attacker is not None:
        attacker.join(90)
        if attacker.is_alive():
            attacker.kill()
    time.sleep(SETTLE_S)
    after = {g: usage(p) for g, p in groups.items()}
    out: dict[str, Any] = {"phase": name, "requests": len(user["ttft"]), "errors": len(user["errors"]),
                           "error_samples": user["errors"][:5],
                           "ttft_median_s": statistics.median(user["ttft"]) if user["ttft"] else None,
                           "ttft_p90_s": percentile(user["ttft"], 0.9), "ttft_s": user["ttft"]}
    for g in groups:
        out[f"{g}_rss_mb_before"], out[f"{g}_threads_before"] = before[g]
        out[f"{g}_rss_mb_max"] = max(samples[f"{g}_rss_mb"], default=None)
        out[f"{g}_threads_max"] = max(samples[f"{g}_threads"], default=None)
        out[f"{g}_rss_mb_after"], out[f"{g}_threads_after"] = after[g]
    print(f"  {name}: {out['requests']} requests, {out['errors']} errors, TTFT median "
          f"{out['ttft_median_s'] or float('nan'):.3f} s; API {out['api_rss_mb_max']:.0f} MB / "
          f"{out['api_threads_max']} threads, worker {out['worker_rss_mb_max']:.0f} MB / "
          f"{out['worker_threads_max']} threads", flush=True)
    return out


PHASES = ("baseline", "slowloris", "abandoned_non_streaming", "huge_prompts", "transfer_port_flood",
          "transfer_rogue_server")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=20.0, help="user requests measured per phase")
    ap.add_argument("--only", default=",".join(PHASES), help=f"comma-separated phases of {PHASES}")
    ap.add_argument("--out", default="bench/out/attacks.json")
    args = ap.parse_args()
    phases = [p for p in args.only.split(",") if p]
    unknown = set(phases) - set(PHASES)
    if unknown:
        ap.error(f"unknown phases {sorted(unknown)}")
    if "baseline" not in phases:
        phases.insert(0, "baseline")
    with bench_farm(both=1, api=True) as farm:
        cfg = farm.cfg
        model = cfg.default_model
        url = f"http://127.0.0.1:{farm.api_port}/v1/chat/completions"
        groups = {"api": [p.pid for p in farm.procs if p.role == "api"],
                  "worker": [p.pid for p in farm.procs if p.role == "both"]}
        [worker] = registry.live_workers(connect(cfg.redis))
        transfer = worker.transfer_endpoint
        for _ in range(3):
            user_request(url, model)  # warm: the semantic layer, the tokenizer, the engine
        from farm.infra.broker import make_celery

        celery = make_celery(cfg)
        attacks: dict[str, Attack | None] = {
            "baseline": None,
            "slowloris": slowloris("127.0.0.1", farm.api_port, SLOWLORIS_CONNECTIONS),
            "abandoned_non_streaming": abandoned_non_streaming(url, model, 4),
            "huge_prompts": huge_prompts(url, model, 4),
            "transfer_port_flood": transfer_port_flood(transfer, IDLE_TRANSFER_CONNECTIONS, 4),
            "transfer_rogue_server": transfer_rogue_server(cfg, celery, 4),
        }
        server = " ".join(farm.api_command()[1:])
        print(f"farm: API `{server}`, worker {transfer}; {args.seconds:.0f} s per phase", flush=True)
        results = [run_phase(p, attacks[p], url, model, groups, args.seconds) for p in phases]
    base = results[0]["ttft_median_s"]
    rows, goals = [], []
    for r in results:
        ratio = r["ttft_median_s"] / base if r["ttft_median_s"] and base else None
        r["ttft_vs_baseline"] = ratio
        rows.append([r["phase"], r["requests"], r["errors"], r["ttft_median_s"], r["ttft_p90_s"], ratio,
                     r["api_rss_mb_max"], r["api_threads_max"], r["worker_rss_mb_max"], r["worker_threads_max"]])
        if r["phase"] != "baseline":
            goals.append(goal(f"{r['phase']} median TTFT / baseline", ratio if ratio is not None else float("inf"),
                              2.0, higher_is_better=False))
    print()
    print(table(["phase", "requests", "errors", "TTFT median s", "TTFT p90 s", "x baseline", "API MB max",
                 "API threads max", "worker MB max", "worker threads max"], rows, 2))
    finish(Path(args.out), {"seconds_per_phase": args.seconds, "api_command": server, "phases": results}, goals)


if __name__ == "__main__":
    main()
