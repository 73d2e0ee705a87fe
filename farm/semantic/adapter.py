"""An adapter on the embedding model for one head: low-rank updates (LoRA) to MiniLM's top layers.

Why: a linear head over the frozen sentence embedding is the ceiling of what a head learns from these
features (issue 29: category 0.60 on exam questions of unseen subjects, jailbreak TPR 0.36 on unseen attack
families). Fine-tuning the top layers for a head lifts it, but the custom categories, the semantic cache,
/v1/embeddings and the other head need the embedding as it is. So the adapted head gets its own branch: the
lower layers run once for both, then the top `len(layers)` layers run twice, as shipped and with the adapter's
updates merged in (W + B @ A). The branch's vector costs those layers again (a third of the encoder for two of
six), not a second model; the adapter ships as float16 matrices of rank `rank` in heads.npz (about 0.2 MB),
beside the name of the head that reads it (`head`: "cat" or "jb"; one branch, so one adapted head).

What ships is chosen on the development split by `python -m tools.semantic.train` (bench/RESULTS.md): the
category head's adapter. The jailbreak guard's (`--guard-adapter`) caught more unseen attacks but refused too
many everyday questions on the final split, so it does not ship.
"""

from __future__ import annotations

import copy
import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from farm.semantic.heads import HEADS_PATH

# the linear maps of a BertLayer that carry an update, by their attribute path
TARGETS = ("attention.self.query", "attention.self.key", "attention.self.value", "attention.output.dense",
           "intermediate.dense", "output.dense")
PREFIX = "adapter."


HEADS = ("cat", "jb")  # the heads an adapter can serve: the category head, the jailbreak guard's


@dataclass
class HeadAdapter:
    """Low-rank updates to the encoder layers from `first_layer` up: `updates[(layer, target)] = (A, B)`,
    A of shape (rank, in), B of shape (out, rank); `head` names the head that reads the branch's vector."""

    first_layer: int
    rank: int
    updates: dict[tuple[int, str], tuple[np.ndarray, np.ndarray]]
    head: str = "jb"

    def __post_init__(self) -> None:
        if self.head not in HEADS:
            raise ValueError(f"an adapter serves one of {HEADS}, not {self.head!r}")

    def digest(self) -> str:
        """sha256 of the updates as shipped (float16): the branch's vectors, whichever head reads them."""
        h = hashlib.sha256(f"{self.first_layer} {self.rank}".encode())
        for key in sorted(self.updates):
            a, b = self.updates[key]
            h.update(f"{key}".encode())
            h.update(a.astype(np.float16).tobytes())
            h.update(b.astype(np.float16).tobytes())
        return h.hexdigest()

    def branch(self, model) -> Any:
        """The branch's top layers: copies of `model`'s (a transformers BertModel) with the updates merged."""
        import torch

        layers = torch.nn.ModuleList(copy.deepcopy(model.encoder.layer[i])
                                     for i in range(self.first_layer, len(model.encoder.layer)))
        with torch.no_grad():
            for (i, target), (a, b) in self.updates.items():
                lin = submodule(layers[i - self.first_layer], target)
                lin.weight += torch.from_numpy(b.astype(np.float32)) @ torch.from_numpy(a.astype(np.float32))
        return layers.eval()

    def arrays(self) -> dict[str, np.ndarray]:
        """The adapter as named arrays, to be saved beside the heads (`save_heads(..., extra=...)`)."""
        out = {f"{PREFIX}first_layer": np.array(self.first_layer), f"{PREFIX}rank": np.array(self.rank),
               f"{PREFIX}head": np.array(self.head)}
        for (i, target), (a, b) in self.updates.items():
            out[f"{PREFIX}{i}.{target}.A"] = a.astype(np.float16)
            out[f"{PREFIX}{i}.{target}.B"] = b.astype(np.float16)
        return out


def submodule(layer, path: str):
    """The module at a dotted attribute path ("attention.self.query") inside `layer`."""
    for part in path.split("."):
        layer = getattr(layer, part)
    return layer


def run_branch(layers, hidden, attention_mask):
    """The branch's layers over the hidden states entering them (torch tensors; mask 1 = token, 0 = padding)."""
    import torch

    mask = (1.0 - attention_mask[:, None, None, :].to(hidden.dtype)) * torch.finfo(hidden.dtype).min
    for layer in layers:
        out = layer(hidden, attention_mask=mask)
        hidden = out[0] if isinstance(out, tuple) else out
    return hidden


def load_adapter(path: Path = HEADS_PATH) -> HeadAdapter | None:
    """The shipped adapter, or None when the heads file carries none (a file without `adapter.head` was written
    for the jailbreak guard, the only head an adapter served before)."""
    with np.load(path) as z:
        if f"{PREFIX}rank" not in z.files:
            return None
        updates: dict[tuple[int, str], list] = {}
        for name in z.files:
            if name.startswith(PREFIX) and name.endswith((".A", ".B")):
                layer, rest = name[len(PREFIX):].split(".", 1)
                target, which = rest.rsplit(".", 1)
                updates.setdefault((int(layer), target), [None, None])["AB".index(which)] = z[name]
        head = str(z[f"{PREFIX}head"]) if f"{PREFIX}head" in z.files else "jb"
        return HeadAdapter(int(z[f"{PREFIX}first_layer"]), int(z[f"{PREFIX}rank"]),
                           {k: (v[0], v[1]) for k, v in updates.items()}, head)


def adapter_for(head: str, path: Path = HEADS_PATH) -> HeadAdapter | None:
    """The shipped adapter when it serves `head` (its vectors are what that head reads), else None."""
    adapter = load_adapter(path)
    return adapter if adapter is not None and adapter.head == head else None
