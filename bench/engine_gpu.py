"""Engine on the GPU (issue 6 part 1): decode step and prefill speed beside naive `generate` and the
bandwidth floor, on random weights of real Llama shapes.

    .venv/bin/python -m bench.engine_gpu                 # CUDA: Llama-3.2-1B and Llama-3.1-8B shapes
    .venv/bin/python -m bench.engine_gpu --small         # CPU check of the whole benchmark: tiny shapes

What is measured, per shape, in one process and one run:
- decode: ms per step at batch 1, 8, 32, 64, every sequence at `--context` tokens, for our engine's
  decode (static buffers, CUDA graphs on CUDA; graph-less on CPU), our eager decode (exact shapes, no
  graphs), and transformers' `generate` on the same model object (greedy; step time = (time for
  steps+1 new tokens - time for 1) / steps, so its prefill is left out). A step includes the argmax and
  the copy of the tokens to the host, as in the engine loop.
- the floor: bytes one step must read (every weight once, the embedding only for the rows looked up,
  plus each row's KV) divided by the device copy bandwidth measured here (a `copy_` of a large buffer:
  bytes read + written / time).
- prefill: tokens/s for one prompt of 512 and 4,096 tokens through our prefill in chunks of `--chunk`
  (the engine's max_num_batched_tokens), beside `generate(max_new_tokens=1)`.
Goals (issue 6): batch-1 step <= 1.5x the floor on the 8B shape; batch-32 tokens/s >= 10x naive
`generate` at batch 32. Random weights cannot change the speed of any of this; no download is needed.
"""

from __future__ import annotations

import argparse
import gc
import math
from pathlib import Path
from typing import Any

import torch

from bench.common import OUT_DIR, finish, goal, machine_info, now, summarize, table

SHAPES: dict[str, dict[str, Any]] = {
    # meta-llama/Llama-3.2-1B and Llama-3.1-8B config.json (rope scaling left out: no effect on speed)
    "llama-1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=64, tie_word_embeddings=True,
                     rope_theta=500000.0),
    "llama-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False,
                     rope_theta=500000.0),
    "tiny": dict(vocab_size=8192, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                 num_attention_heads=8, num_key_value_heads=2, head_dim=32, tie_word_embeddings=True),
}
GOAL_FLOOR = 1.5  # batch-1 step / floor, 8B shape
GOAL_NAIVE = 10.0  # batch-32 tokens/s, ours / generate


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build_model(shape: str, device: torch.device, dtype: torch.dtype, max_len: int):
    """A randomly initialised LlamaForCausalLM of the shape, built directly on the device."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**SHAPES[shape], max_position_embeddings=max_len, bos_token_id=1, eos_token_id=2)
    cfg._attn_implementation = "sdpa"
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(prev)
    return model.eval()


def copy_bandwidth(device: torch.device, nbytes: int, reps: int = 10) -> float:
    """Bytes/s of a device-to-device copy (read + write counted), the memory system's practical rate."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    for _ in range(2):
        dst.copy_(src)
    sync(device)
    t = now()
    for _ in range(reps):
        dst.copy_(src)
    sync(device)
    s = now() - t
    del src, dst
    return 2 * nbytes * reps / s


def step_bytes(model, batch: int, ctx: float, kv_bytes_per_token: int) -> int:
    """Bytes one decode step must read: each weight once (the input embedding only for `batch` rows
    unless it is tied to the output head), plus every row's KV."""
    emb = model.model.embed_tokens.weight
    total = sum(p.numel() * p.element_size() for p in model.parameters())  # tied weights counted once
    if model.lm_head.weight.data_ptr() != emb.data_ptr():
        total -= emb.numel() * emb.element_size() - batch * emb.shape[1] * emb.element_size()
    return int(total + batch * ctx * kv_bytes_per_token)


def time_ours(runner, batch: int, ctx: int, steps: int, eager: bool) -> float:
    """Seconds per decode step for `batch` sequences at `ctx` tokens (KV contents do not affect speed)."""
    bs = runner.block_size
    per = math.ceil((ctx + steps + 1) / bs)
    tables = [list(range(i * per, (i + 1) * per)) for i in range(batch)]
    fn = runner.decode_eager if eager else runner.decode
    ids = [1] * batch
    with torch.inference_mode():
        for pos in (ctx, ctx, ctx + steps - 1):  # warm up (and capture any graph the run will use)
            fn(ids, [pos] * batch, tables).argmax(-1).tolist()
        sync(runner.device)
        t = now()
        for s in range(steps):
            ids = fn(ids, [ctx + s] * batch, tables).argmax(-1).tolist()
        sync(runner.device)
    return (now() - t) / steps


def time_generate(model, batch: int, ctx: int, steps: int, device: torch.device) -> float:
    """Seconds per decode step of transformers' generate (greedy), its prefill subtracted."""
    g = torch.Generator().manual_seed(batch)
    ids = torch.randint(3, model.config.vocab_size, (batch, ctx), generator=g).to(device)
    mask = torch.ones_like(ids)

    def gen(n: int) -> float:
        sync(device)
        t = now()
        with torch.inference_mode():
            model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                           pad_token_id=0)
        sync(device)
        return now() - t

    gen(2)  # warm up
    one = min(gen(1) for _ in range(2))
    full = gen(steps + 1)
    return max(full - one, 1e-9) / steps


def time_prefill(runner, model, length: int, chunk: int, reps: int, device: torch.device) -> dict[str, Any]:
    from farm.engine.model_runner import PrefillChunk

    g = torch.Generator().manual_seed(length)
    ids = torch.randint(3, model.config.vocab_size, (length,), generator=g).tolist()
    table = list(range(math.ceil(length / runner.block_size)))

    def ours() -> float:
        sync(device)
        t = now()
        for start in range(0, length, chunk):
            runner.prefill([PrefillChunk(ids[start:start + chunk], start, table)]).argmax(-1).tolist()
        sync(device)
        return now() - t

    x = torch.tensor([ids], device=device)

    def naive() -> float:
        sync(device)
        t = now()
        with torch.inference_mode():
            model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=1, do_sample=False, pad_token_id=0)
        sync(device)
        return now() - t

    ours()
    naive()
    o = summarize([ours() for _ in range(reps)])
    n = summarize([naive() for _ in range(reps)])
    return {"tokens": length, "chunk": chunk, "ours_s": o, "generate_s": n,
            "ours_tok_s": length / o["median"], "generate_tok_s": length / n["median"]}


def run_shape(shape: str, args: argparse.Namespace, device: torch.device, dtype: torch.dtype,
              bandwidth: float) -> dict[str, Any]:
    from farm.engine.model_runner import ModelRunner

    max_len = max(max(args.prefill), args.context + args.steps + 8)
    t = now()
    model = build_model(shape, device, dtype, max_len)
    build_s = now() - t
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv_tok = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * head_dim * torch.empty((), dtype=dtype).element_size()
    blocks_needed = max(max(args.batches) * math.ceil((args.context + args.steps + 1) / args.block_size),
                        math.ceil(max(args.prefill) / args.block_size))
    kv_bytes = (blocks_needed + 2) * args.block_size * kv_tok
    t = now()
    runner = ModelRunner(None, args.block_size, kv_bytes, device=device.type, dtype=str(dtype).removeprefix("torch."),
                         max_model_len=max_len, graph_batch_sizes=args.graph_sizes,
                         decode_attention=args.attention, model=model)
    setup_s = now() - t
    params = sum(p.numel() for p in model.parameters())
    print(f"\n{shape}: {params / 1e9:.2f}B params on {device}/{dtype}; attention {runner.attention}; decode "
          f"{'CUDA graphs' if runner.static.use_graphs else 'static buffers, no graphs'}; built {build_s:.1f}s, "
          f"runner {setup_s:.1f}s (graphs captured: {len(runner.static.graphs)})", flush=True)

    rows = []
    for b in args.batches:
        ours = time_ours(runner, b, args.context, args.steps, eager=False)
        eager = time_ours(runner, b, args.context, args.steps, eager=True)
        naive = time_generate(model, b, args.context, args.steps, device)
        floor_bytes = step_bytes(model, b, args.context + args.steps / 2, kv_tok)
        floor = floor_bytes / bandwidth
        row = {"batch": b, "context": args.context, "ours_ms": ours * 1e3, "eager_ms": eager * 1e3,
               "generate_ms": naive * 1e3, "floor_ms": floor * 1e3, "bytes_per_step": floor_bytes,
               "ours_over_floor": ours / floor, "ours_tok_s": b / ours, "generate_tok_s": b / naive,
               "speedup_vs_generate": naive / ours, "graph_speedup": eager / ours}
        rows.append(row)
        print(f"  batch {b:3d}: ours {row['ours_ms']:8.2f} ms, eager {row['eager_ms']:8.2f} ms, generate "
              f"{row['generate_ms']:8.2f} ms, floor {row['floor_ms']:7.2f} ms -> {row['ours_over_floor']:.2f}x floor, "
              f"{row['speedup_vs_generate']:.1f}x generate", flush=True)
    prefill = []
    for n in args.prefill:
        p = time_prefill(runner, model, n, args.chunk, args.reps, device)
        prefill.append(p)
        print(f"  prefill {n:5d} tok: ours {p['ours_tok_s']:10.0f} tok/s, generate {p['generate_tok_s']:10.0f} tok/s",
              flush=True)
    out = {"shape": shape, "config": SHAPES[shape], "params": params, "kv_bytes_per_token": kv_tok,
           "attention": runner.attention, "graphs": runner.static.use_graphs,
           "graphs_captured": sorted(runner.static.graphs), "build_s": build_s, "runner_setup_s": setup_s,
           "decode": rows, "prefill": prefill}
    del runner, model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true", help="tiny shapes on CPU: checks the benchmark end to end")
    ap.add_argument("--shapes", default=None, help=f"comma list of {sorted(SHAPES)}")
    ap.add_argument("--device", default=None, help="cuda | cpu (default: cuda when available; cpu with --small)")
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--context", type=int, default=512, help="tokens already in each sequence at decode")
    ap.add_argument("--steps", type=int, default=None, help="decode steps timed (default 32; 8 with --small)")
    ap.add_argument("--prefill", default="512,4096", help="prompt lengths for prefill tokens/s")
    ap.add_argument("--chunk", type=int, default=2048, help="prefill chunk (engine max_num_batched_tokens)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--graph-sizes", default="1,2,4,8,16,32,64", help="captured decode batch sizes")
    ap.add_argument("--attention", default="auto", choices=["auto", "torch", "triton"])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default=str(OUT_DIR / "engine_gpu.json"))
    args = ap.parse_args(argv)

    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    device = torch.device(args.device or ("cpu" if args.small or not torch.cuda.is_available() else "cuda"))
    shapes = (args.shapes or ("tiny" if args.small else "llama-1b,llama-8b")).split(",")
    args.batches = [int(x) for x in args.batches.split(",")]
    args.prefill = [int(x) for x in args.prefill.split(",")]
    args.graph_sizes = [int(x) for x in args.graph_sizes.split(",")]
    args.steps = args.steps or (8 if args.small else 32)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if device.type == "cpu" and not args.small:
        print("note: no CUDA device; real shapes on CPU take long (use --small for a quick check)")

    info = machine_info()
    bandwidth = copy_bandwidth(device, (1 << 30) if device.type == "cuda" else (256 << 20))
    print(f"device {device} ({info.get('cuda') or info['platform']}), dtype {dtype}, torch {info['torch']}, "
          f"{info['torch_threads']} threads; measured copy bandwidth {bandwidth / 1e9:.1f} GB/s")
    results = [run_shape(s, args, device, dtype, bandwidth) for s in shapes]

    headers = ["shape", "batch", "ours ms/step", "eager ms/step", "generate ms/step", "floor ms",
               "ours/floor", "ours tok/s", "generate tok/s", "ours/generate", "eager/ours"]
    drows = [[r["shape"], d["batch"], d["ours_ms"], d["eager_ms"], d["generate_ms"], d["floor_ms"],
              f"{d['ours_over_floor']:.2f}x", d["ours_tok_s"], d["generate_tok_s"],
              f"{d['speedup_vs_generate']:.1f}x", f"{d['graph_speedup']:.2f}x"] for r in results for d in r["decode"]]
    prow = [[r["shape"], p["tokens"], p["ours_tok_s"], p["generate_tok_s"], f"{p['ours_tok_s'] / p['generate_tok_s']:.2f}x"]
            for r in results for p in r["prefill"]]
    t1 = table(headers, drows, digits=2)
    t2 = table(["shape", "prompt tokens", "ours tok/s", "generate tok/s", "ours/generate"], prow, digits=0)
    mode = "CUDA graphs" if device.type == "cuda" else "static buffers without graphs (CPU)"
    print(f"\nDecode, context {args.context} tokens, ours = {mode}; floor = bytes per step / "
          f"{bandwidth / 1e9:.1f} GB/s copy bandwidth")
    print(t1)
    print(f"\nPrefill, chunks of {args.chunk} tokens")
    print(t2)

    goals = []
    target = "llama-8b" if "llama-8b" in shapes else shapes[-1]
    r = next(x for x in results if x["shape"] == target)
    tag = "" if target == "llama-8b" else f" ({target} shape on {device}: a check, not the goal)"
    b1 = next((d for d in r["decode"] if d["batch"] == 1), None)
    b32 = next((d for d in r["decode"] if d["batch"] == 32), None)
    if b1:
        goals.append(goal(f"batch-1 decode step / bandwidth floor, {target}{tag}", b1["ours_over_floor"],
                          GOAL_FLOOR, higher_is_better=False))
    if b32:
        goals.append(goal(f"batch-32 tokens/s, ours / generate, {target}{tag}", b32["speedup_vs_generate"], GOAL_NAIVE))
    data = {"benchmark": "engine_gpu", "device": str(device), "dtype": str(dtype), "small": args.small,
            "args": {k: v for k, v in vars(args).items()}, "copy_bandwidth_bytes_s": bandwidth,
            "results": results, "tables": {"decode": t1, "prefill": t2}}
    finish(Path(args.out), data, goals)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
