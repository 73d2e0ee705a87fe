"""KV transfer bandwidth per transport, beside a plain copy of the same bytes, in one run.

    python -m bench.transfer [--sizes-mb 1,16,128,1024] [--repeat 3] [--out bench/out/transfer.json]

For each size, a KV cache holding that many bytes of blocks is served by a real TransferServer (the
one every worker runs) and pulled with the real client, through shared memory (same host) and TCP on
loopback; the reference is a `torch` gather of the same blocks (what a local copy costs) and a plain
`clone` (memcpy). Each pull includes handle verification, the server gather, the move and the
checksum check. Goals (issue 4): shared memory >= 50% of the copy, TCP on loopback >= 25%.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench.common import finish, goal, table
from farm.engine.model_runner import gather_blocks
from farm.transfer.handle import sign_handle
from farm.transfer.shm import host_id
from farm.transfer.staging import StagingPool
from farm.transfer.tcp import TransferServer, checksum, fetch_blocks

SECRET = b"bench-secret"
BLOCK = (16, 8, 64)  # block_size, kv_heads, head_dim: 32 KiB per plane in float32, 64 KiB per block


def run_size(mb: int, repeat: int) -> dict:
    block_bytes = 2 * BLOCK[0] * BLOCK[1] * BLOCK[2] * 4
    n = max(1, mb * 1024 * 1024 // block_bytes)
    kv = torch.randn(1, 2, n + 8, *BLOCK)
    ids = list(range(4, n + 4))
    data = gather_blocks(kv, ids)
    nbytes = data.numel() * 4
    digest = checksum(data)
    server = TransferServer("bench", SECRET, lambda h: None, lambda b, out=None: gather_blocks(kv, b, out),
                            lambda rid: None, "127.0.0.1").start()
    layout = {"num_layers": 1, "num_kv_heads": BLOCK[1], "head_dim": BLOCK[2], "block_size": BLOCK[0],
              "dtype": "float32"}

    def handle(transport: str) -> dict:
        return sign_handle({
            "request_id": "r", "worker_id": "bench", "endpoint": f"127.0.0.1:{server.port}",
            "host_id": host_id(), "transport": transport, "block_ids": ids, "block_hashes": [], "num_tokens": 0,
            "first_token": 0, "cached_tokens": 0, "layout": layout, "checksum": digest,
            "expires_at": time.time() + 600}, SECRET)

    def timed(fn) -> float:
        times = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            out = fn()
            times.append(time.perf_counter() - t0)
            del out
        return statistics.median(times)

    res = {"mb": nbytes / 2**20, "blocks": n}
    res["clone_s"] = timed(lambda: data.clone())
    res["gather_s"] = timed(lambda: gather_blocks(kv, ids))
    staging = StagingPool()  # a decode worker reuses its receive buffers (see farm/transfer/staging.py)
    for transport in ("shm", "tcp"):
        info: dict = {}
        h = handle("tcp,shm" if transport == "shm" else "tcp")

        def pull(h=h, info=info) -> torch.Tensor:
            out = fetch_blocks(h, SECRET, info=info, staging=staging)
            if info["transport"] == "tcp":
                staging.release(out)
            return out

        res[f"{transport}_s"] = timed(pull)
        assert info["transport"] == transport, info
    server.stop()
    for k in ("clone", "gather", "shm", "tcp"):
        res[f"{k}_gbps"] = nbytes / res[f"{k}_s"] / 1e9
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes-mb", default="1,16,128,1024")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", default="bench/out/transfer.json")
    args = ap.parse_args()
    results = [run_size(int(s), args.repeat) for s in args.sizes_mb.split(",")]
    rows = [[f"{r['mb']:.0f} MB", r["clone_gbps"], r["gather_gbps"], r["shm_gbps"], r["tcp_gbps"],
             r["shm_gbps"] / r["gather_gbps"], r["tcp_gbps"] / r["gather_gbps"]] for r in results]
    print(table(["size", "clone GB/s", "gather GB/s", "shm GB/s", "tcp GB/s", "shm/gather", "tcp/gather"], rows))
    big = results[-1]
    goals = [goal(f"shm / copy at {big['mb']:.0f} MB", big["shm_gbps"] / big["gather_gbps"], 0.5),
             goal(f"tcp / copy at {big['mb']:.0f} MB", big["tcp_gbps"] / big["gather_gbps"], 0.25)]
    finish(args.out, {"results": results}, goals)


if __name__ == "__main__":
    main()
