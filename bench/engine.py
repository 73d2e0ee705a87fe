"""Engine benchmark (issue 2): continuous batching vs sequential `generate`, and prefix-cache TTFT.

    .venv/bin/python -m bench.engine [--quick] [--out bench/out/engine.json]

Why these two measurements:
1. Throughput. A naive server answers concurrent requests one after another with transformers'
   `model.generate`. The farm engine batches every running sequence into one decode step, so on the
   same model, prompts and token count its output tokens/s should grow with concurrency while the
   sequential baseline stays flat. Goal: >= 4x the sequential tokens/s at 16 concurrent requests.
2. Time to first token with a long shared prefix. The engine caches full KV blocks by prefix hash;
   a second request with the same ~1,000-token system prompt should only compute its short question.
   Goal: cached-prefix TTFT <= 0.2x the cold TTFT.

Fairness: one process, one torch thread count for both sides (the default unless the engine config sets
one), the same device and dtype, both warmed up first (one short generation each), every request greedy
with a fixed number of new tokens (`ignore_eos` in the engine, `min_new_tokens` in transformers), and the
prompts of each concurrency level are distinct from each other and from other levels (each starts with a
different system persona inside the first KV block), so the prefix cache does not help the throughput
figures. `cached_tokens` is recorded to show it.
"""

from __future__ import annotations

import argparse
import random
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from bench.common import (
    OUT_DIR,
    CpuShare,
    goal,
    goal_line,
    load_average,
    machine_info,
    now,
    summarize,
    table,
    write_json,
)

THROUGHPUT_GOAL = 4.0  # engine / sequential tokens/s at 16 concurrent
TTFT_GOAL = 0.2  # cached / cold TTFT

PERSONAS = [
    "a patient mathematics tutor", "a ship's navigator", "a museum curator", "a pastry chef",
    "a retired airline pilot", "a botanist who studies ferns", "a train dispatcher", "a jazz pianist",
    "a forensic accountant", "a mountain rescue volunteer", "a beekeeper", "a lighthouse keeper",
    "a chess coach", "a marine biologist", "a librarian in a small town", "a bicycle mechanic",
    "a volcanologist", "a radio host", "a carpenter", "a planetarium guide", "a translator of old letters",
    "a tea merchant", "a wildlife photographer", "a city bus driver",
]
QUESTIONS = [
    "Explain how a lever lets a small force lift a heavy load.",
    "Describe how sailors found their position before satellites existed.",
    "Why do old paintings crack, and how are they restored?",
    "What makes bread rise, and why does kneading matter?",
    "How does an aeroplane wing produce lift at takeoff?",
    "How do ferns reproduce without producing any seeds?",
    "How are two trains kept apart on a single railway track?",
    "What is a chord progression, and why do some sound sad?",
    "How would you spot invented numbers in a company's books?",
    "What should hikers carry when walking in high mountains?",
    "How do honey bees tell each other where flowers are?",
    "Why were lighthouses painted with stripes of different colours?",
    "What are the first three principles a chess beginner should learn?",
    "How do whales communicate across hundreds of kilometres?",
    "How should a small library decide which books to keep?",
    "Why does a bicycle chain wear out, and when should it be replaced?",
    "What warning signs come before a volcano erupts?",
    "How is a live radio show planned from minute to minute?",
    "Why does wood warp, and how do carpenters prevent it?",
    "Why do the stars appear to move across the night sky?",
    "What clues help date a handwritten letter with no date?",
    "How is green tea processed differently from black tea?",
    "How do you photograph shy animals without disturbing them?",
    "How is a city bus timetable designed for rush hour?",
]
# Sentences for the ~1,000-token shared prefix (a long system prompt); shuffled per repetition.
PREFIX_SENTENCES = [
    "Always answer in clear, plain English and define any technical term the first time it appears.",
    "When a question is ambiguous, state the interpretation you chose before answering it.",
    "Prefer short paragraphs, and use numbered steps for any procedure with more than two steps.",
    "Never invent citations, statistics, phone numbers or addresses; say when you do not know.",
    "If the user writes in another language, answer in that language unless asked otherwise.",
    "Keep a friendly but professional tone, and avoid slang, sarcasm and exclamation marks.",
    "For arithmetic, show the intermediate results so the user can check each step.",
    "When giving measurements, use metric units first and imperial units in parentheses.",
    "Do not give medical, legal or financial advice beyond general, widely known information.",
    "Summaries should lead with the conclusion and follow with the two or three strongest reasons.",
    "If the user shares code, point out bugs before suggesting stylistic improvements.",
    "Our company sells garden tools, seeds and irrigation kits through a web shop and three stores.",
    "The stores are in Lyon, Porto and Tampere, and each opens at nine in the morning on weekdays.",
    "Orders above fifty euros ship free within the European Union; smaller orders cost five euros.",
    "Returns are accepted within thirty days if the item is unused and in its original packaging.",
    "Seeds cannot be returned once the packet is opened, for plant health regulations.",
    "The loyalty programme gives one point per euro spent, and one hundred points are worth five euros.",
    "Irrigation kits come with a two-year warranty that covers pumps, timers and valves.",
    "Customers can book a free garden consultation by phone or in any store, lasting thirty minutes.",
    "Gift cards are valid for two years and can be used online or in the stores.",
    "The spring catalogue lists tomatoes, beans, courgettes, lettuce, herbs and twelve kinds of flowers.",
    "Delivery usually takes three working days to France and Portugal and five to Finland.",
    "During heat waves, advise customers to water early in the morning and to mulch their beds.",
    "Pruning shears should be cleaned after each use and oiled once a month to prevent rust.",
    "Compost needs a balance of green material, such as grass cuttings, and brown material, such as leaves.",
    "Raised beds warm up faster in spring and drain better after heavy rain.",
    "Slugs can be kept away with copper tape, beer traps or by watering in the morning.",
    "Fruit trees are best planted in late autumn when the soil is still warm and moist.",
    "A drip irrigation line uses about half the water of a sprinkler for the same bed.",
    "Tell customers that the web shop is closed for maintenance every first Sunday of the month.",
    "Staff may offer a ten percent discount on damaged packaging if the product itself is intact.",
    "Escalate complaints about late deliveries to the logistics team after seven working days.",
    "Never ask customers for their full card number; payments are handled by the payment provider.",
    "Explain the difference between annual plants, which live one season, and perennials.",
    "Recommend hand tools with wooden handles for customers who prefer repairable products.",
    "The company plants one tree for every irrigation kit sold, in partnership with a forestry charity.",
    "Workshops on balcony gardening take place in each store on the last Saturday of every month.",
    "Children under twelve may join workshops for free when accompanied by an adult.",
    "Answer questions about competitors' products politely and without criticising them.",
    "If a question is outside gardening and the shop, answer briefly and offer to help with the garden.",
]
TTFT_QUESTIONS = [
    "Which store is closest to Spain?", "Can I return an opened seed packet?", "How do I stop slugs?",
    "When should I plant an apple tree?", "How long is the pump warranty?", "Do kids pay for workshops?",
    "Is delivery to Finland slow?", "How much are 300 points worth?", "What is a perennial plant?",
    "When is the web shop closed?", "How often should shears be oiled?", "Why use raised beds?",
]


@dataclass
class Tracker:
    """Collects one request's outputs on the engine thread; timestamps use bench.common.now()."""

    submitted: float = 0.0
    first_at: float | None = None
    done_at: float | None = None
    token_ids: list[int] = field(default_factory=list)
    completion_tokens: int = 0
    cached_tokens: int = 0
    finish_reason: str | None = None
    done: threading.Event = field(default_factory=threading.Event)
    on_done: Any = None

    def __call__(self, out) -> None:
        t = now()
        if self.first_at is None:
            self.first_at = t
        self.token_ids.extend(out.token_ids)
        if out.finished:
            self.done_at = t
            self.completion_tokens = out.completion_tokens
            self.cached_tokens = out.cached_tokens
            self.finish_reason = out.finish_reason
            self.done.set()
            if self.on_done is not None:
                self.on_done()


def chat_ids(tok, system: str, user: str) -> list[int]:
    from farm.models.tokenization import chat_prompt_ids

    return chat_prompt_ids(tok, [{"role": "system", "content": system}, {"role": "user", "content": user}])


def throughput_prompts(tok, count: int) -> list[list[int]]:
    """Distinct prompts of similar length: persona i with question i (the persona differs in block 0)."""
    return [chat_ids(tok, f"You are {PERSONAS[i]}. Answer in a few clear sentences.", QUESTIONS[i])
            for i in range(count)]


def long_prefix(tok, rep: int, target_tokens: int) -> str:
    """A ~target_tokens system prompt; `rep` changes the first sentence and order, so no block is shared."""
    rng = random.Random(1000 + rep)
    head = f"Conversation {rep * 7919 + 101}: you are the assistant of a garden shop."
    parts = [head]
    while True:
        sents = PREFIX_SENTENCES[:]
        rng.shuffle(sents)
        for s in sents:
            parts.append(s)
            if len(tok(" ".join(parts), add_special_tokens=False)["input_ids"]) >= target_tokens:
                return " ".join(parts)


def engine_generate(eng, prompts: list[list[int]], max_tokens: int, tag: str) -> dict[str, Any]:
    """Submit all prompts at once; wall time from the first submit to the last finished request."""
    from farm.protocol import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    remaining = [len(prompts)]
    all_done = threading.Event()
    lock = threading.Lock()

    def one_done() -> None:
        with lock:
            remaining[0] -= 1
            if remaining[0] == 0:
                all_done.set()

    trackers = [Tracker(on_done=one_done) for _ in prompts]
    steps0 = eng.stats()["steps"]
    t0 = now()
    for i, (p, tr) in enumerate(zip(prompts, trackers, strict=True)):
        tr.submitted = now()
        eng.submit(f"{tag}-{i}", p, params, tr)
    if not all_done.wait(timeout=600):
        raise RuntimeError(f"engine run {tag}: requests did not finish within 600 s")
    elapsed = max(tr.done_at for tr in trackers) - t0
    st = eng.stats()
    bad = [tr.finish_reason for tr in trackers if tr.finish_reason != "length"]
    if bad:
        raise RuntimeError(f"engine run {tag}: unexpected finish reasons {bad}")
    tokens = sum(tr.completion_tokens for tr in trackers)
    return {
        "elapsed_s": elapsed,
        "tokens": tokens,
        "tokens_per_s": tokens / elapsed,
        "ttft_s": [tr.first_at - tr.submitted for tr in trackers],
        "cached_tokens": [tr.cached_tokens for tr in trackers],
        "steps": st["steps"] - steps0,
        "ms_per_step": elapsed / max(1, st["steps"] - steps0) * 1000.0,
        "preemptions": st["preemptions"],
        "token_ids": [tr.token_ids for tr in trackers],
    }


def hf_generate_one(model, ids: list[int], n: int, pad_id: int) -> list[int]:
    x = torch.tensor([ids], device=model.device)
    with torch.inference_mode():
        out = model.generate(input_ids=x, attention_mask=torch.ones_like(x), do_sample=False,
                             max_new_tokens=n, min_new_tokens=n, pad_token_id=pad_id)
    return out[0][len(ids):].tolist()


def hf_sequential(model, prompts: list[list[int]], max_tokens: int, pad_id: int) -> dict[str, Any]:
    """The naive server: one `generate` after another over the same prompts."""
    per, outs = [], []
    t0 = now()
    for p in prompts:
        s = now()
        outs.append(hf_generate_one(model, p, max_tokens, pad_id))
        per.append(now() - s)
    elapsed = now() - t0
    tokens = sum(len(o) for o in outs)
    return {"elapsed_s": elapsed, "tokens": tokens, "tokens_per_s": tokens / elapsed, "per_request_s": per,
            "ms_per_token": elapsed / max(1, tokens) * 1000.0,
            "token_ids": outs}


def parity(engine_ids: list[list[int]], hf_ids: list[list[int]], eos_ids: set[int]) -> dict[str, Any]:
    """How many greedy outputs agree token for token (a sanity check that both did the same work).

    transformers' `min_new_tokens` forbids EOS while the engine's `ignore_eos` only keeps going after
    it, so a divergence exactly at an EOS token is expected and counted separately.
    """
    exact, at_eos, other = 0, 0, []
    for i, (a, b) in enumerate(zip(engine_ids, hf_ids, strict=True)):
        if a == b:
            exact += 1
            continue
        k = next((j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
        if k < len(a) and a[k] in eos_ids:
            at_eos += 1
        else:
            other.append({"prompt": i, "first_diff": k})
    return {"exact": exact, "diverged_at_eos": at_eos, "diverged_other": other, "n": len(engine_ids)}


def engine_ttft(eng, ids: list[int], tag: str) -> tuple[float, int]:
    """Submit one request (max_tokens=1) on an idle engine; (seconds to first output, cached tokens)."""
    from farm.protocol import SamplingParams

    tr = Tracker()
    tr.submitted = now()
    eng.submit(tag, ids, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True), tr)
    if not tr.done.wait(timeout=300):
        raise RuntimeError(f"TTFT request {tag} did not finish")
    return tr.first_at - tr.submitted, tr.cached_tokens


def hf_ttft(model, ids: list[int], pad_id: int) -> float:
    s = now()
    hf_generate_one(model, ids, 1, pad_id)
    return now() - s


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer tokens and repetitions (~1 minute)")
    ap.add_argument("--out", default=str(OUT_DIR / "engine.json"), help="JSON output path")
    ap.add_argument("--device", default=None, help="override engine.device (cpu|cuda|auto)")
    args = ap.parse_args(argv)

    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from farm.config import get_config
    from farm.engine.engine import Engine
    from farm.models.directories import require_model_dir

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()

    max_tokens = 32 if args.quick else 64
    levels = [1, 4, 16]
    ttft_reps = 2 if args.quick else 5
    hf_ttft_reps = 1 if args.quick else 3
    prefix_tokens = 1000

    cfg = get_config()
    mcfg = cfg.model(cfg.default_model)
    mdir = require_model_dir(cfg, mcfg)
    ecfg = cfg.engine.model_copy(update={"device": args.device} if args.device else {})
    info = machine_info()
    info["load_average_start"] = info.pop("load_average")
    print(f"model {mcfg.name} ({mdir}); torch {info['torch']}, {torch.get_num_threads()} threads, "
          f"{info['cpu_affinity']} usable cores; load {info['load_average_start']}")

    t_load = now()
    eng = Engine(mdir, ecfg, mcfg.max_model_len).start()
    device, dtype = eng.runner.device, eng.runner.dtype
    hf = AutoModelForCausalLM.from_pretrained(mdir, dtype=dtype).to(device).eval()
    tok = eng.tokenizer
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else min(eng.eos_ids)
    load_s = now() - t_load
    threads = torch.get_num_threads()
    print(f"loaded engine + HF model on {device}/{dtype} in {load_s:.1f}s; torch threads = {threads} (both)")

    try:
        # -- warm-up: one short generation each (persona/question pairs not used below) ------------------
        warm = chat_ids(tok, f"You are {PERSONAS[-1]}.", QUESTIONS[-1])
        engine_generate(eng, [warm], 8, "warmup")
        hf_generate_one(hf, warm, 8, pad_id)

        # -- 1. throughput ---------------------------------------------------------------------------------
        prompts = throughput_prompts(tok, sum(levels))
        tput: list[dict[str, Any]] = []
        off = 0
        for n in levels:
            ps = prompts[off:off + n]
            off += n
            with CpuShare() as ce:
                e = engine_generate(eng, ps, max_tokens, f"tput{n}")
            with CpuShare() as ch:
                h = hf_sequential(hf, ps, max_tokens, pad_id)
            for d, c in ((e, ce), (h, ch)):
                d["cpu_share"], d["cpu_s"], d["tokens_per_cpu_s"] = c.share, c.cpu_s, d["tokens"] / c.cpu_s
            par = parity(e.pop("token_ids"), h.pop("token_ids"), eng.eos_ids)
            row = {"concurrency": n, "max_tokens": max_tokens, "prompt_tokens": [len(p) for p in ps],
                   "engine": e, "sequential": h, "ratio": e["tokens_per_s"] / h["tokens_per_s"],
                   "ratio_per_cpu_s": e["tokens_per_cpu_s"] / h["tokens_per_cpu_s"],
                   "parity": par, "load_average": load_average()}
            tput.append(row)
            print(f"  N={n:2d}: engine {e['tokens_per_s']:7.1f} tok/s ({e['elapsed_s']:.2f}s, {e['steps']} steps), "
                  f"sequential {h['tokens_per_s']:7.1f} tok/s ({h['elapsed_s']:.2f}s), "
                  f"ratio {row['ratio']:.2f}x; greedy parity {par['exact']}/{par['n']}; "
                  f"cpu share {ce.share:.2f}/{ch.share:.2f}", flush=True)

        # -- 2. TTFT with and without a cached ~1,000-token prefix ----------------------------------------
        cold, warmt, cached, prefix_lens, prompt_lens, shares = [], [], [], [], [], []
        for r in range(ttft_reps):
            system = long_prefix(tok, r, prefix_tokens)
            q_cold, q_warm = TTFT_QUESTIONS[(2 * r) % len(TTFT_QUESTIONS)], TTFT_QUESTIONS[(2 * r + 1) % len(TTFT_QUESTIONS)]
            ids_cold, ids_warm = chat_ids(tok, system, q_cold), chat_ids(tok, system, q_warm)
            shared = next((j for j, (a, b) in enumerate(zip(ids_cold, ids_warm, strict=False)) if a != b),
                          min(len(ids_cold), len(ids_warm)))
            prefix_lens.append(shared)
            with CpuShare() as cc:
                c_s, c_cached = engine_ttft(eng, ids_cold, f"cold{r}")
            w_s, w_cached = engine_ttft(eng, ids_warm, f"warm{r}")
            shares.append(cc.share)
            if c_cached:
                print(f"  warning: cold request {r} reported {c_cached} cached tokens")
            cold.append(c_s)
            warmt.append(w_s)
            cached.append(w_cached)
            prompt_lens.append([len(ids_cold), len(ids_warm)])
            print(f"  TTFT rep {r}: prompt {len(ids_cold)} tok, cold {c_s * 1000:.0f} ms, cached {w_s * 1000:.0f} ms "
                  f"({w_cached} cached tokens); cpu share (cold) {cc.share:.2f}", flush=True)
        hf_cold = []
        for r in range(hf_ttft_reps):
            ids = chat_ids(tok, long_prefix(tok, r, prefix_tokens), TTFT_QUESTIONS[(2 * r) % len(TTFT_QUESTIONS)])
            hf_cold.append(hf_ttft(hf, ids, pad_id))
        ttft = {
            "engine_cold_s": summarize(cold), "engine_cached_s": summarize(warmt),
            "ratio_cached_over_cold": (summarize(warmt)["median"] / summarize(cold)["median"]),
            "cached_tokens": cached, "shared_prefix_tokens": prefix_lens, "prompt_tokens": prompt_lens, "hf_generate_cold_s": summarize(hf_cold),
            "cold_cpu_share": shares,
        }
        engine_stats = eng.stats()
    finally:
        eng.stop()

    # -- report ---------------------------------------------------------------------------------------------
    last = tput[-1]
    goals = [goal("throughput engine/sequential at 16 concurrent", last["ratio"], THROUGHPUT_GOAL),
             goal("TTFT cached/cold (~1,000-token prefix)", ttft["ratio_cached_over_cold"], TTFT_GOAL,
                  higher_is_better=False)]
    rows = [[r["concurrency"], r["max_tokens"], f"{min(r['prompt_tokens'])}-{max(r['prompt_tokens'])}",
             r["engine"]["tokens_per_s"], r["sequential"]["tokens_per_s"], f"{r['ratio']:.2f}x",
             r["engine"]["ms_per_step"], r["sequential"]["ms_per_token"], f"{r['ratio_per_cpu_s']:.2f}x",
             f"{r['engine']['cpu_share']:.2f}/{r['sequential']['cpu_share']:.2f}",
             f"{r['parity']['exact']}/{r['parity']['n']}", sum(r["engine"]["cached_tokens"])] for r in tput]
    t1 = table(["concurrent", "new tok/req", "prompt tok", "engine tok/s", "sequential tok/s",
                "engine/seq", "engine ms/step", "seq ms/tok",
                "engine/seq per CPU-s", "CPU share e/s", "greedy parity", "cached tok"], rows, digits=1)
    ms = 1000.0
    t2 = table(["TTFT (~1,000-token prefix)", "median ms", "min ms", "max ms", "runs"], [
        ["engine, cold (prefix never seen)", ttft["engine_cold_s"]["median"] * ms, ttft["engine_cold_s"]["min"] * ms,
         ttft["engine_cold_s"]["max"] * ms, ttft["engine_cold_s"]["n"]],
        ["engine, cached prefix", ttft["engine_cached_s"]["median"] * ms, ttft["engine_cached_s"]["min"] * ms,
         ttft["engine_cached_s"]["max"] * ms, ttft["engine_cached_s"]["n"]],
        ["HF generate(max_new_tokens=1), cold", ttft["hf_generate_cold_s"]["median"] * ms,
         ttft["hf_generate_cold_s"]["min"] * ms, ttft["hf_generate_cold_s"]["max"] * ms,
         ttft["hf_generate_cold_s"]["n"]],
    ], digits=0)
    info["load_average_end"] = load_average()
    legend = ("engine/seq per CPU-s: the same ratio over CPU seconds used (less sensitive to other load); "
              "CPU share: this process's CPU time / (wall x cores); greedy parity: outputs identical to HF; "
              "cached tok: prefix-cache hits (0 = the throughput prompts shared nothing)")
    print()
    print(t1)
    print(legend)
    print()
    print(t2)
    print(f"cached/cold = {ttft['ratio_cached_over_cold']:.3f}; cached tokens per cached request: {cached}; "
          f"shared prefix tokens: {prefix_lens}; prompt tokens: {[p[1] for p in prompt_lens]}")
    print()
    for g in goals:
        print(goal_line(g))
    print(f"load average start {info['load_average_start']} end {info['load_average_end']}; "
          f"torch threads {threads}; device {device}/{dtype}")

    data = {"benchmark": "engine", "quick": args.quick, "model": mcfg.name, "model_dir": str(mdir),
            "device": str(device), "dtype": str(dtype), "torch_threads": threads, "engine_config": ecfg.model_dump(),
            "load_s": load_s, "machine": info, "throughput": tput, "ttft": ttft, "goals": goals,
            "engine_stats_end": engine_stats, "tables": {"throughput": t1, "ttft": t2, "legend": legend}}
    path = write_json(Path(args.out), data)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
