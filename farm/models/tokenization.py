"""Tokenizers and chat templates, loaded once per process from the model's own directory."""

from __future__ import annotations

import re
import threading
from functools import lru_cache
from pathlib import Path
from typing import Any

from farm.config import FarmConfig
from farm.models.directories import require_model_dir
from farm.protocol import MAX_BAD_WORDS, MAX_BAD_WORDS_TOTAL_TOKENS

# One process-wide lock around first-time `transformers` loads (tokenizers here, the semantic layer's
# embedder): transformers resolves its classes through lazy submodule imports that are not safe to run
# from two threads at once ("cannot import name 'AutoTokenizer'" while the API's warm-up thread loads
# the embedder and a request thread loads a tokenizer). Loads happen once per process, so this costs nothing.
HF_LOAD_LOCK = threading.RLock()


@lru_cache(maxsize=16)
def _load(path: str, chat_template: str | None = None, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code) if trust_remote_code \
        else AutoTokenizer.from_pretrained(path)
    if chat_template is not None:
        tok.chat_template = chat_template  # models[].chat_template (vLLM's --chat-template) replaces the model's
    return tok


def get_tokenizer(cfg: FarmConfig, model_name: str):
    """The model's tokenizer (fast, with its chat template, or the entry's `chat_template`); raises
    ModelNotFoundError if absent."""
    m = cfg.model(model_name)
    d: Path = require_model_dir(cfg, m)
    with HF_LOAD_LOCK:
        return _load(str(d), m.chat_template, m.trust_remote_code)


_LONGEST_TOKEN: dict[int, tuple[Any, int]] = {}


def max_token_chars(tokenizer) -> int:
    """Characters of the longest vocabulary entry: no token covers more of a text than that, so a text of
    more than `n * max_token_chars` characters has more than n tokens (for byte-level BPE each entry's
    characters are its bytes, and a character is at least one byte; for other vocabularies the bound is
    looser, unless a normalizer deletes characters, which api.max_chars_per_token then overrides).
    Computed once per tokenizer."""
    key = id(tokenizer)
    hit = _LONGEST_TOKEN.get(key)
    if hit is None or hit[0] is not tokenizer:
        hit = (tokenizer, max((len(t) for t in tokenizer.get_vocab()), default=1))
        _LONGEST_TOKEN[key] = hit
    return max(1, hit[1])


_TURN_TOKENS: dict[int, tuple[Any, int]] = {}


def turn_tokens(tokenizer) -> int:
    """The fewest tokens the chat template spends on a user or an assistant turn besides its content (its role
    header and end), less one for a merge at its edges; 0 when the template will not say (it refuses the
    probe). Probed once per tokenizer on empty turns: [user, assistant] grown by a user turn, then by an
    assistant one."""
    key = id(tokenizer)
    hit = _TURN_TOKENS.get(key)
    if hit is None or hit[0] is not tokenizer:
        turn = [{"role": "user", "content": ""}, {"role": "assistant", "content": ""}]
        try:
            n2, n3, n4 = (len(chat_prompt_ids(tokenizer, (turn * 2)[:k], add_generation_prompt=False))
                          for k in (2, 3, 4))
            fewest = max(0, min(n3 - n2, n4 - n3) - 1)
        except Exception:  # noqa: BLE001 - a template that refuses empty or repeated turns: no floor from turns
            fewest = 0
        hit = (tokenizer, fewest)
        _TURN_TOKENS[key] = hit
    return hit[1]


def prompt_tokens_at_least(tokenizer, messages: list[dict[str, Any]]) -> int:
    """A floor under a chat prompt's token count, found without rendering the template: the tokens of each
    message's content (of an assistant's, what follows its last `</think>`: a reasoning template drops an earlier
    answer's reasoning), one fewer each for a merge at its edges, and turn_tokens for every user or assistant
    turn. A prompt over the model's context by this floor is refused before the semantic layer, the template or
    the tokenizer pays for all of it (a few hundred thousand characters, or tens of thousands of turns, cost
    seconds there; an assistant turn left out of the floor reached the layer's PII pass whole)."""
    texts = [m["content"].rsplit("</think>", 1)[-1] if m.get("role") == "assistant" else m["content"]
             for m in messages if m.get("content")]
    texts = [t for t in texts if t]
    counted = sum(max(0, len(ids) - 1) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]) \
        if texts else 0
    return counted + chat_turns(messages) * turn_tokens(tokenizer)


def chat_turns(messages: list[dict[str, Any]]) -> int:
    """The user and assistant turns of a conversation: those `turn_tokens` is a floor for."""
    return sum(1 for m in messages if m.get("role") in ("user", "assistant"))


class PromptTooLong(ValueError):
    """A rendered prompt longer than the caller allowed (`chars` characters), found before tokenizing it."""

    def __init__(self, chars: int, limit: int):
        super().__init__(f"the prompt has {chars} characters, more than {limit}")
        self.chars = chars


def chat_prompt_ids(tokenizer, messages: list[dict[str, Any]], template_kwargs: dict[str, Any] | None = None, *,
                    add_generation_prompt: bool = True, continue_final_message: bool = False,
                    tools: list[dict[str, Any]] | None = None, max_chars: int | None = None,
                    add_special_tokens: bool = False) -> list[int]:
    """Apply the model's chat template and return token ids. `template_kwargs` are variables the template may
    read (vLLM's `chat_template_kwargs`, e.g. Qwen3's `enable_thinking`); `add_generation_prompt` appends the
    header that opens the assistant's turn, `continue_final_message` leaves the last message open for the model
    to continue (vLLM's fields of the same names: at most one of them). With `max_chars`, the rendered text is
    measured before it is tokenized (PromptTooLong): template variables can make a prompt longer than its
    messages. `tools` (OpenAI's function tools) reach a template that reads them. `add_special_tokens` (vLLM's
    chat field, off by default because the template writes its own) adds the tokenizer's special tokens, such as
    a BOS, on top of the rendered template."""
    kwargs = {**(template_kwargs or {}), "add_generation_prompt": add_generation_prompt,
              "continue_final_message": continue_final_message}
    if tools is not None:
        kwargs["tools"] = tools
    if max_chars is not None or add_special_tokens:
        text = tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
        if max_chars is not None and len(text) > max_chars:
            raise PromptTooLong(len(text), max_chars)
        return text_prompt_ids(tokenizer, text, add_special_tokens)
    out = tokenizer.apply_chat_template(messages, tokenize=True, **kwargs)
    if isinstance(out, dict) or hasattr(out, "keys"):
        out = out["input_ids"]
    return [int(t) for t in out]


def template_reads(tokenizer, variable: str) -> bool:
    """Whether the model's chat template uses `variable` (e.g. `enable_thinking`): passing a variable the
    template never reads changes nothing, and the caller should say so instead of claiming it applied."""
    tpl = getattr(tokenizer, "chat_template", None)
    texts = tpl.values() if isinstance(tpl, dict) else [tpl]
    return any(isinstance(t, str) and re.search(rf"\b{re.escape(variable)}\b", t) for t in texts)


def text_prompt_ids(tokenizer, prompt: str, add_special_tokens: bool = True) -> list[int]:
    return [int(t) for t in tokenizer(prompt, add_special_tokens=add_special_tokens)["input_ids"]]


def bad_words_token_ids(tokenizer, words: list[str]) -> list[list[int]]:
    """vLLM's `bad_words` as token sequences, as vLLM tokenizes them (SamplingParams.update_from_tokenizer): each word
    without and with a leading space (a word at the start of the text and one in the middle), the second kept when
    it is another word token of the same length. ValueError for a word that makes no token."""
    out: list[list[int]] = []
    for word in dict.fromkeys(words):  # repeated words once, as vLLM
        for space in ("", " "):
            ids = text_prompt_ids(tokenizer, space + word.lstrip(), False)
            if not ids:
                if not space:
                    raise ValueError(f"{word!r} makes no token")
                continue
            if not space or (ids[0] != out[-1][0] and len(ids) == len(out[-1])):
                out.append(ids)
    return out


def bad_words_problem(tokenizer, words: list[str]) -> str | None:
    """What vLLM would refuse in these `bad_words` (None: nothing): a word that makes no token, more than
    MAX_BAD_WORDS token sequences, or more than MAX_BAD_WORDS_TOTAL_TOKENS tokens in all."""
    try:
        seqs = bad_words_token_ids(tokenizer, words)
    except ValueError as e:
        return str(e)
    if len(seqs) > MAX_BAD_WORDS:
        return f"they make {len(seqs)} token sequences, more than {MAX_BAD_WORDS}"
    if (total := sum(map(len, seqs))) > MAX_BAD_WORDS_TOTAL_TOKENS:
        return f"they make {total} tokens in all, more than {MAX_BAD_WORDS_TOTAL_TOKENS}"
    return None


def eos_token_ids(tokenizer, model_dir: Path | None = None) -> set[int]:
    """End-of-sequence ids: the tokenizer's plus the generation config's (which may be a list)."""
    ids: set[int] = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    if model_dir is not None:
        try:
            from transformers import GenerationConfig

            gc = GenerationConfig.from_pretrained(model_dir)
            e = gc.eos_token_id
            ids.update(int(x) for x in (e if isinstance(e, list) else [e]) if x is not None)
        except (OSError, ValueError):
            pass
    return ids


def partial_stop(text: str, stops: list[str], whole: bool = False) -> int:
    """The length of the longest end of `text` that begins one of `stops` without completing it (`whole`: or is
    all of one): the characters a stream holds back, since the next token may complete the stop string (which is
    then never sent). The engine's stop strings and the API's markers (a tool call's, the end of a model's
    thinking) alike. Only the places where a stop's first character stands are tried, longest first: trying
    every length cost time quadratic in the stop's length on every token (four stops of 1,024 characters)."""
    longest = 0
    for s in stops:
        n = min(len(s) - (0 if whole else 1), len(text))
        if n <= longest or not s:
            continue
        tail = text[len(text) - n:]
        i = tail.find(s[0])
        while i != -1 and n - i > longest:
            if s.startswith(tail[i:]):
                longest = n - i
                break
            i = tail.find(s[0], i + 1)
    return longest


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas, holding back incomplete UTF-8 pieces. Special tokens
    (end of turn, ...) are left out of the text unless `skip_special_tokens` is false (vLLM's parameter).

    Each token decodes a short window, as vLLM's detokenizer does: the ids from `_prefix` (a few tokens before the
    text already given) to the end, less the text of `_prefix`..`_read`, is the delta. Decoding the whole output
    each token cost time quadratic in its length (1.2 ms a token at 8,192 tokens). The window starts a few tokens
    back because a token's text can depend on the one before it (a leading space, a byte of a character)."""

    WINDOW_BACK = 5  # tokens before the new ones that the window decodes again

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.text = ""
        self._prefix = 0  # the window's first id
        self._read = 0  # ids before this are in `text`

    def resume(self, ids: list[int], text: str) -> None:
        """Carry on after `ids`, whose text is `text` (a request migrated with the tokens streamed so far)."""
        self.ids, self.text = list(ids), text
        self._read = len(self.ids)
        self._prefix = max(0, self._read - self.WINDOW_BACK)

    def add(self, token_ids: list[int]) -> str:
        self.ids.extend(token_ids)
        skip = self.skip_special_tokens
        done = self.tokenizer.decode(self.ids[self._prefix:self._read], skip_special_tokens=skip)
        now = self.tokenizer.decode(self.ids[self._prefix:], skip_special_tokens=skip)
        if now.endswith("\ufffd") or len(now) <= len(done):
            return ""  # a multi-byte character is not complete yet, or the new ids have no text (yet)
        delta = now[len(done):]
        self.text += delta
        self._prefix, self._read = max(self._prefix, self._read - self.WINDOW_BACK), len(self.ids)
        return delta
