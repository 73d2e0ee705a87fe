"""Train the category and jailbreak heads from the in-repo training splits and save `data/heads.npz`.

    python -m farm.semantic.train

Only `*_train.jsonl` is read: the held-out `*_test.jsonl` files are for the benchmark and the tests.
The file records the SHA-256 of the training data it came from; a test fails if they drift apart.
"""

from __future__ import annotations

import hashlib
import tempfile
import time
from pathlib import Path

import numpy as np

from farm.semantic.datagen import DATA_DIR, read_jsonl
from farm.semantic.embeddings import get_embedder
from farm.semantic.heads import LinearHead, train_softmax

HEADS_PATH = DATA_DIR / "heads.npz"
TRAIN_FILES = ("categories_train.jsonl", "jailbreak_train.jsonl")
JAILBREAK_NGRAM_DIM = 4096
JAILBREAK_NGRAM_WEIGHT = 0.5


def training_data_sha() -> str:
    h = hashlib.sha256()
    for name in TRAIN_FILES:
        h.update((DATA_DIR / name).read_bytes())
    return h.hexdigest()


def _fit(rows: list[dict], labels: list[str], emb: np.ndarray, ngram_dim: int, ngram_weight: float,
         l2: float, balanced: bool) -> LinearHead:
    head = LinearHead(np.zeros(0), np.zeros(0), labels, ngram_dim, ngram_weight)
    X = head.features(emb, [r["text"] for r in rows])
    y = np.array([labels.index(r["label"]) for r in rows])
    cw = None
    if balanced:
        counts = np.bincount(y, minlength=len(labels)).astype(np.float64)
        cw = counts.sum() / (len(labels) * np.maximum(counts, 1))
    head.W, head.b = train_softmax(X, y, len(labels), l2=l2, class_weight=cw)
    return head


def main() -> None:
    t0 = time.time()
    emb = get_embedder(threads=2)
    cat_rows = read_jsonl("categories_train.jsonl")
    jb_rows = read_jsonl("jailbreak_train.jsonl")
    # embeddings of this exact training data are kept in the temp dir so re-fitting the heads is quick
    cache = Path(tempfile.gettempdir()) / f"farm-semantic-train-{training_data_sha()[:16]}.npz"
    if cache.exists():
        z = np.load(cache)
        cat_emb, jb_emb = z["cat"], z["jb"]
    else:
        cat_emb = emb.encode([r["text"] for r in cat_rows])
        jb_emb = emb.encode([r["text"] for r in jb_rows])
        np.savez(cache, cat=cat_emb, jb=jb_emb)
    print(f"embedded {len(cat_rows) + len(jb_rows)} texts in {time.time() - t0:.1f}s")
    cat_labels = sorted({r["label"] for r in cat_rows})
    cat = _fit(cat_rows, cat_labels, cat_emb, 0, 0.0, l2=1e-4, balanced=False)
    jb_labels = ["benign", "instruction_override", "roleplay", "prompt_extraction"]
    jb = _fit(jb_rows, jb_labels, jb_emb, JAILBREAK_NGRAM_DIM, JAILBREAK_NGRAM_WEIGHT, l2=1e-4, balanced=True)
    np.savez_compressed(
        HEADS_PATH, data_sha=np.array(training_data_sha()),
        cat_W=cat.W.astype(np.float16), cat_b=cat.b, cat_labels=np.array(cat.labels),
        jb_W=jb.W.astype(np.float16), jb_b=jb.b, jb_labels=np.array(jb.labels),
        jb_ngram_dim=np.array(jb.ngram_dim), jb_ngram_weight=np.array(jb.ngram_weight))
    print(f"wrote {HEADS_PATH} ({HEADS_PATH.stat().st_size // 1024} KiB) in {time.time() - t0:.1f}s")


def load_heads() -> tuple[LinearHead, LinearHead]:
    """(category head, jailbreak head) from data/heads.npz."""
    z = np.load(HEADS_PATH)
    cat = LinearHead(z["cat_W"].astype(np.float32), z["cat_b"], [str(x) for x in z["cat_labels"]])
    jb = LinearHead(z["jb_W"].astype(np.float32), z["jb_b"], [str(x) for x in z["jb_labels"]],
                    int(z["jb_ngram_dim"]), float(z["jb_ngram_weight"]))
    return cat, jb


if __name__ == "__main__":
    main()
