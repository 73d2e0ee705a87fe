"""The engine on real and tiny models: parity with transformers, prefix reuse, batching, lifecycle."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from farm.config import EngineConfig
from farm.engine.contract import RequestOutput
from farm.engine.engine import Engine
from farm.engine.scheduler import KVImport
from farm.models.tokenization import bad_words_token_ids, chat_prompt_ids
from farm.protocol import SamplingParams


class Collector:
    def __init__(self):
        self.outs: list[RequestOutput] = []
        self.done = threading.Event()

    def __call__(self, out: RequestOutput) -> None:
        self.outs.append(out)
        if out.finished:
            self.done.set()

    def wait(self, timeout=120) -> Collector:
        assert self.done.wait(timeout), "request did not finish"
        return self

    @property
    def text(self) -> str:
        return "".join(o.text for o in self.outs)

    @property
    def token_ids(self) -> list[int]:
        return [t for o in self.outs for t in o.token_ids]

    @property
    def last(self) -> RequestOutput:
        return self.outs[-1]


def run(engine: Engine, prompt, params, **kw) -> Collector:
    c = Collector()
    engine.submit(f"r{time.monotonic_ns()}", prompt, params, c, **kw)
    return c.wait()


GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def real_engine(real_model_dir):
    eng = Engine(real_model_dir, EngineConfig(kv_cache_mb=128), max_model_len=2048).start()
    yield eng
    eng.stop()


@pytest.fixture(scope="module")
def hf_model(real_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(real_model_dir).eval()


def hf_greedy(model, prompt, n):
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0][len(prompt):].tolist()


def test_answers_what_is_2_plus_2(real_engine):
    ids = chat_prompt_ids(real_engine.tokenizer, [{"role": "user", "content": "What is 2+2?"}])
    c = run(real_engine, ids, SamplingParams(max_tokens=40, temperature=0))
    assert "4" in c.text
    assert c.last.finish_reason == "stop"  # stopped on the chat template's end token
    assert c.last.prompt_tokens == len(ids)


def test_greedy_matches_transformers_and_prefix_reuse_is_identical(real_engine, hf_model):
    tok = real_engine.tokenizer
    long = chat_prompt_ids(tok, [{"role": "system", "content": "You are a careful historian. " * 12},
                                 {"role": "user", "content": "Tell me about the Roman empire."}])
    expected = hf_greedy(hf_model, long, 24)
    cold = run(real_engine, long, GREEDY)
    warm = run(real_engine, long, GREEDY)
    assert cold.token_ids == expected
    assert warm.token_ids == expected
    assert cold.last.cached_tokens == 0
    assert warm.last.cached_tokens == (len(long) - 1) // 16 * 16 > 0


def test_shared_prefix_different_suffix_reuses_blocks(real_engine, hf_model):
    tok = real_engine.tokenizer
    sys_msg = {"role": "system", "content": "Answer in one short sentence. Be precise and friendly. " * 6}
    a = chat_prompt_ids(tok, [sys_msg, {"role": "user", "content": "Name a red fruit."}])
    b = chat_prompt_ids(tok, [sys_msg, {"role": "user", "content": "Name a large ocean."}])
    run(real_engine, a, GREEDY)
    second = run(real_engine, b, GREEDY)
    common = next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
    assert second.last.cached_tokens == common // 16 * 16
    assert second.token_ids == hf_greedy(hf_model, b, 24)


def test_concurrent_requests_batch_and_match_sequential(real_engine, hf_model):
    tok = real_engine.tokenizer
    prompts = [chat_prompt_ids(tok, [{"role": "user", "content": f"Count from {i} to {i + 5}."}]) for i in range(6)]
    collectors = [Collector() for _ in prompts]
    steps0 = real_engine.steps
    for i, (p, c) in enumerate(zip(prompts, collectors, strict=True)):
        real_engine.submit(f"batch-{i}", p, GREEDY, c)
    for c in collectors:
        c.wait()
    # 6 requests x 24 tokens decoded in far fewer than 6*24 steps: they shared decode steps
    assert real_engine.steps - steps0 < 6 * 24 * 0.6
    for p, c in zip(prompts[:2], collectors[:2], strict=True):
        assert c.token_ids == hf_greedy(hf_model, p, 24)


def test_stop_strings_max_tokens_and_seed(real_engine):
    ids = chat_prompt_ids(real_engine.tokenizer, [{"role": "user", "content": "What is 2+2?"}])
    full = run(real_engine, ids, SamplingParams(max_tokens=40, temperature=0)).text
    word = full.split()[2]
    stopped = run(real_engine, ids, SamplingParams(max_tokens=40, temperature=0, stop=[word]))
    assert stopped.text == full[: full.index(word)] and stopped.last.finish_reason == "stop"
    capped = run(real_engine, ids, SamplingParams(max_tokens=3, temperature=0))
    assert capped.last.completion_tokens == 3 and capped.last.finish_reason == "length"
    p = SamplingParams(max_tokens=16, temperature=0.9, seed=1234, ignore_eos=True)
    assert run(real_engine, ids, p).token_ids == run(real_engine, ids, p).token_ids


# --- mechanics on a tiny random model --------------------------------------------------------------
@pytest.fixture
def tiny_engine(tiny_model_dir):
    def make(**kw):
        cfg = EngineConfig(block_size=kw.pop("block_size", 4), max_num_batched_tokens=kw.pop("budget", 64))
        return Engine(tiny_model_dir, cfg, max_model_len=512, max_num_blocks=kw.pop("blocks", None), **kw).start()
    engines = []
    yield lambda **kw: engines.append(make(**kw)) or engines[-1]
    for e in engines:
        e.stop()


def test_chunked_prefill_equals_single_shot(tiny_engine):
    prompt = list(range(1000, 1150))
    one = tiny_engine(budget=1024)
    chunked = tiny_engine(budget=32)
    a = run(one, prompt, GREEDY)
    b = run(chunked, prompt, GREEDY)
    assert a.token_ids == b.token_ids
    assert chunked.steps >= 150 // 32


def test_prompt_logprobs_are_the_models_own_over_chunks_and_a_warm_prefix_cache(tiny_engine, tiny_model_dir):
    """vLLM's prompt_logprobs (a completion's echo with logprobs: lm-eval's log-likelihoods): each prompt token's
    log-probability given the tokens before it, and the k most likely there, equal to a whole-prompt forward of
    the same weights, when the prompt is computed in chunks and when its prefix is already cached (the whole
    prompt is computed again: a cached block has no logits). They come once, with the first token."""
    from transformers import LlamaForCausalLM

    prompt = list(range(3000, 3050))
    eng = tiny_engine(budget=16)  # 50 tokens: four chunks
    warm = run(eng, prompt, GREEDY)
    assert warm.outs[0].prompt_logprobs is None  # not asked: not computed
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, prompt_logprobs=2)
    got = run(eng, prompt, params)
    lps = got.outs[0].prompt_logprobs
    assert got.last.cached_tokens == 0 and all(o.prompt_logprobs is None for o in got.outs[1:])
    assert len(lps) == len(prompt) and lps[0] is None
    hf = LlamaForCausalLM.from_pretrained(tiny_model_dir).eval()
    with torch.inference_mode():
        ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), -1)
    for pos in range(1, len(prompt)):
        assert abs(lps[pos].logprob - float(ref[pos - 1, prompt[pos]])) < 1e-3, pos
        top = ref[pos - 1].topk(2)
        assert [t for t, _ in lps[pos].top] == top.indices.tolist(), pos
        # its rank among the whole vocabulary, as vLLM's prompt_logprobs show it (a random model: rarely 1)
        own = ref[pos - 1, prompt[pos]]  # tokens within 1e-4 of it may fall either side in another forward
        assert 1 + int((ref[pos - 1] > own + 1e-4).sum()) <= lps[pos].rank <= int((ref[pos - 1] >= own - 1e-4).sum())
    assert len({lp.rank for lp in lps[1:]}) > 5  # ranks that differ: not a constant
    assert run(eng, prompt, params).token_ids == got.token_ids == warm.token_ids[:3]


def test_allowed_token_ids_hold_every_token_greedy_or_sampled(tiny_engine):
    """vLLM's allowed_token_ids through the engine (prefill's first token and the batched decode): every token is
    one of them, where the free answer's are not."""
    eng = tiny_engine()
    allowed = [101, 202, 303]
    prompt = list(range(700, 720))
    for params in (SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, allowed_token_ids=allowed),
                   SamplingParams(max_tokens=8, temperature=1.0, seed=2, ignore_eos=True, allowed_token_ids=allowed)):
        assert set(run(eng, prompt, params).token_ids) <= set(allowed)
    assert not set(run(eng, prompt, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)).token_ids) <= \
        set(allowed)


def test_bad_words_are_never_completed(tiny_engine):
    """vLLM's bad_words through the engine: a word of one token never appears; a word of two tokens never has its
    second after its first; the answer is the free one up to where the word would have begun."""
    eng = tiny_engine()
    tok = eng.tokenizer
    prompt = list(range(700, 720))
    free = run(eng, prompt, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)).token_ids

    def word(ids: list[int]) -> str | None:  # a text that tokenizes back to exactly these ids
        text = tok.decode(ids)
        return text if bad_words_token_ids(tok, [text])[0] == ids else None

    i = next(i for i in range(1, len(free)) if word([free[i]]))
    j = next(j for j in range(1, len(free) - 1) if word(free[j:j + 2]) and free[j] != free[j + 1])
    for at, ids in ((i, [free[i]]), (j, free[j:j + 2])):
        banned = bad_words_token_ids(tok, [word(ids)])
        got = run(eng, prompt, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True,
                                              bad_words=[word(ids)])).token_ids
        first = min(k for k in range(len(free)) if any(free[k:k + len(b)] == b for b in banned))
        assert got[:first + len(ids) - 1] == free[:first + len(ids) - 1] and got != free
        assert not any(got[k:k + len(b)] == b for b in banned for k in range(len(got)))
        assert first <= at


def test_a_bad_word_begun_before_a_migration_is_not_completed_after_it(tiny_engine):
    """A migrated request carries the tokens it generated as prompt tokens (`generated`): a two-token bad word whose
    first token came out on the lost worker may not be completed on this one."""
    eng = tiny_engine()
    tok = eng.tokenizer
    prompt = list(range(700, 720))
    free = run(eng, prompt, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)).token_ids
    j = next(j for j in range(len(free) - 1) if bad_words_token_ids(tok, [tok.decode(free[j:j + 2])])[0] == free[j:j + 2]
             and free[j] != free[j + 1])
    word = tok.decode(free[j:j + 2])
    resumed = prompt + free[:j + 1]  # the first token of the word came out before the migration
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, bad_words=[word])
    assert run(eng, resumed, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)).token_ids[0] == free[j + 1]
    assert run(eng, resumed, params, generated=j + 1).token_ids[0] != free[j + 1]


def test_logprob_token_ids_give_those_tokens_at_every_position(tiny_engine):
    """vLLM's logprob_token_ids: at each generated position the sampled token's log-probability, then the asked
    tokens' in the asked order (the sampled one once), the same values the 20 most likely show where they
    overlap; prefill's first token and the batched decode alike."""
    eng = tiny_engine()
    prompt = list(range(700, 720))
    wide = run(eng, prompt, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=20))
    lps = [lp for o in wide.outs for lp in (o.logprobs or [])]
    asked = [lps[0].top[5][0], lps[0].top[2][0], wide.token_ids[1]]  # two of the first position's best, and a later token
    got = run(eng, prompt, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=0,
                                          logprob_token_ids=asked))
    assert got.token_ids == wide.token_ids
    for tok, lp, ref in zip(got.token_ids, [lp for o in got.outs for lp in (o.logprobs or [])], lps, strict=True):
        assert [t for t, _ in lp.top] == list(dict.fromkeys([tok, *asked]))
        known = dict(ref.top)
        assert all(abs(v - known[t]) < 1e-5 for t, v in lp.top if t in known) and lp.logprob == lp.top[0][1]


def test_a_prompt_in_chunked_prefill_counts_as_running_not_waiting(tiny_model_dir):
    """vllm:num_requests_running / _waiting as vLLM counts them (the ops audit: a prompt being computed was
    exported as waiting for its whole prefill, and a prefill worker never showed running work). The engine is
    stepped by hand here: no thread."""
    eng = Engine(tiny_model_dir, EngineConfig(block_size=4, max_num_batched_tokens=16), max_model_len=512)
    eng.submit("long", list(range(4000, 4100)), GREEDY, Collector())
    eng.submit("next", list(range(5000, 5010)), GREEDY, Collector())
    eng._drain_inbox()  # noqa: SLF001 - what the engine's loop does first
    assert (eng.stats()["running"], eng.stats()["waiting"]) == (0, 2)
    eng.step()  # the first 16 of 100 prompt tokens: admitted, computing; the budget is spent, the next waits
    assert len(eng.scheduler.prefilling) == 1 and (eng.stats()["running"], eng.stats()["waiting"]) == (1, 1)


def test_prompts_scored_together_do_not_wait_for_each_others_blocks(tiny_model_dir):
    """The review: a request for its prompt's log-probabilities computes every block itself, yet waited while
    another request computed a block they share (lm-eval's contexts with several continuations)."""
    eng = Engine(tiny_model_dir, EngineConfig(block_size=4, max_num_batched_tokens=256), max_model_len=512)
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1)
    for rid in ("a", "b"):
        eng.submit(rid, list(range(6000, 6040)), params, Collector())
    eng._drain_inbox()  # noqa: SLF001 - stepped by hand: no engine thread
    eng.step()
    assert not eng.scheduler.waiting and not eng.scheduler.prefilling  # both prompts in the one step


def test_preemption_under_block_pressure_completes_all_and_frees_blocks(tiny_engine):
    eng = tiny_engine(blocks=24)  # 96 token slots for 4 requests needing ~50 each
    reference = tiny_engine()
    prompts = [list(range(2000 + 40 * i, 2000 + 40 * i + 20)) for i in range(4)]
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    cs = [Collector() for _ in prompts]
    for i, (p, c) in enumerate(zip(prompts, cs, strict=True)):
        eng.submit(f"p{i}", p, params, c)
    for c in cs:
        c.wait()
    assert eng.scheduler.preemptions > 0
    for p, c in zip(prompts, cs, strict=True):
        assert c.last.completion_tokens == 30
        assert c.token_ids == run(reference, p, params).token_ids
    assert eng.pool.num_free == eng.pool.num_blocks


def test_abort_frees_blocks_and_reports_abort(tiny_engine):
    eng = tiny_engine()
    c = Collector()
    eng.submit("long", list(range(3000, 3020)), SamplingParams(max_tokens=400, temperature=0, ignore_eos=True), c)
    while len(c.outs) < 3:
        time.sleep(0.01)
    eng.abort("long")
    c.wait()
    assert c.last.finish_reason == "abort" and c.last.completion_tokens < 400
    time.sleep(0.05)
    assert eng.pool.num_free == eng.pool.num_blocks


def test_prefill_only_holds_blocks_then_import_elsewhere_gives_same_tokens(tiny_engine):
    src, dst, ref = tiny_engine(), tiny_engine(), tiny_engine()
    prompt = list(range(4000, 4037))
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    held = run(src, prompt, params, prefill_only=True).last
    assert held.finish_reason == "prefilled" and len(held.held_blocks) == 10
    assert src.pool.num_free == src.pool.num_blocks - 10
    data = src.runner.read_blocks(held.held_blocks)
    src.release_held(held.request_id)
    out = run(dst, prompt, params, kv_import=KVImport(data, len(prompt), held.first_token))
    assert out.token_ids == run(ref, prompt, params).token_ids
    assert dst.steps == 11  # decode only: no prefill on the importing engine
    time.sleep(0.05)
    assert src.pool.num_free == src.pool.num_blocks and dst.pool.num_free == dst.pool.num_blocks


def test_held_blocks_expire(tiny_engine):
    eng = tiny_engine(handle_ttl_s=0.2)
    held = run(eng, list(range(50, 70)), GREEDY, prefill_only=True).last
    assert held.request_id in eng.held
    deadline = time.time() + 3
    while held.request_id in eng.held and time.time() < deadline:
        time.sleep(0.05)
    assert held.request_id not in eng.held and eng.pool.num_free == eng.pool.num_blocks


# -- vLLM's extra sampling parameters on the built-in engine --------------------------------------------------
def test_repetition_penalty_matches_transformers(real_engine, hf_model):
    """The same rule as transformers' (and vLLM's): seen tokens' positive logits divided, negative ones
    multiplied; greedy output token for token."""
    ids = chat_prompt_ids(real_engine.tokenizer, [{"role": "user", "content": "List the days of the week."}])
    c = run(real_engine, ids, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, repetition_penalty=1.3))
    with torch.inference_mode():
        ref = hf_model.generate(torch.tensor([ids]), max_new_tokens=24, min_new_tokens=24, do_sample=False,
                                repetition_penalty=1.3)[0][len(ids):].tolist()
    assert c.token_ids == ref
    assert c.token_ids != run(real_engine, ids, GREEDY).token_ids  # the penalty changed something


def test_min_tokens_holds_back_the_end_and_stop_token_ids_end_it(real_engine):
    ids = chat_prompt_ids(real_engine.tokenizer, [{"role": "user", "content": "What is 2+2?"}])
    plain = run(real_engine, ids, SamplingParams(max_tokens=60, temperature=0))
    assert plain.last.finish_reason == "stop" and len(plain.token_ids) < 30
    held = run(real_engine, ids, SamplingParams(max_tokens=60, temperature=0, min_tokens=30))
    assert len(held.token_ids) >= 30 and not set(held.token_ids[:30]) & set(real_engine.eos_ids)
    cut = plain.token_ids[4]
    first = plain.token_ids.index(cut)
    stopped = run(real_engine, ids, SamplingParams(max_tokens=60, temperature=0, stop_token_ids=[cut]))
    assert stopped.last.finish_reason == "stop" and stopped.token_ids[:first] == plain.token_ids[:first]
    assert stopped.text == real_engine.tokenizer.decode(plain.token_ids[:first])  # the stop token is not shown


def test_logprobs_of_each_token_match_the_model(real_engine, hf_model):
    ids = chat_prompt_ids(real_engine.tokenizer, [{"role": "user", "content": "Name a colour."}])
    c = run(real_engine, ids, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=3))
    lps = [lp for o in c.outs for lp in (o.logprobs or [])]
    assert len(lps) == len(c.token_ids) == 6
    for tok, lp in zip(c.token_ids, lps, strict=True):
        assert lp.top[0][0] == tok and lp.top[0][1] == lp.logprob and len(lp.top) == 3  # greedy: the best one
    with torch.inference_mode():
        ref = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0, -1].float(), -1)
    assert abs(lps[0].logprob - float(ref[c.token_ids[0]])) < 1e-3
    none = run(real_engine, ids, SamplingParams(max_tokens=3, temperature=0))
    assert all(o.logprobs is None for o in none.outs)
