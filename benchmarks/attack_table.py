"""The attack table of issue 4: every span attack and embedding_norm, undefended and under the
verification preset, on every setting the issue names, with the null baseline. CPU, a few minutes (TAG is left to
its slow tests: minutes per sentence).

    python benchmarks/attack_table.py [--out benchmarks/results]

Batches are consecutive validation sentences (5-30 tokens); undefended numbers average over
`--batches` batches, defended ones over three flood seeds of the first batch.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

import aegis
from aegis.attacks import shared_gradient, text_attacks
from aegis.attacks.embedding_norm import embedding_norm_leak
from aegis.data import LABELS, load_corpus
from aegis.metrics import null_baseline, rouge, token_recall
from aegis.models import attack_settings

ROOT = Path(__file__).resolve().parents[1]

SETTINGS = attack_settings()
ATTACKS = text_attacks(("dager", "mlp_span", "spectral", "embedding_norm"))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--batches", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(2)
    examples = load_corpus("validation")
    rows = []
    for setting, (build, size) in SETTINGS.items():
        model, tok = build()
        encoder = setting.startswith("encoder")
        alignment = "hungarian" if encoder else "greedy"
        batches = [examples[i * size : (i + 1) * size] for i in range(args.batches)]
        undefended = {name: [] for name in ATTACKS}
        seconds = []
        for batch in batches:
            texts = [e.text for e in batch]
            labels = [LABELS.index(e.label) for e in batch] if encoder else None
            grads = shared_gradient(model, texts, tok, labels=labels)
            for name, attack in ATTACKS.items():
                start = time.perf_counter()
                out = attack(model, grads, tok, size)
                if name == "dager":
                    seconds.append(time.perf_counter() - start)
                scores = {**rouge(out, texts, alignment), "token_recall": token_recall(out, texts, tok)}
                if name == "embedding_norm":  # the bag itself, before it is rendered as text and re-tokenised
                    found = embedding_norm_leak(model, grads, size).tokens
                    enc = tok(texts, padding=True)
                    true = {
                        i for row, mask in zip(enc["input_ids"], enc["attention_mask"]) for i, m in zip(row, mask) if m
                    }
                    scores["token_id_recall"] = len(set(found) & true) / len(true)
                undefended[name].append(scores)
        texts = [e.text for e in batches[0]]
        labels = [LABELS.index(e.label) for e in batches[0]] if encoder else None
        defended = {name: [] for name in ATTACKS}
        for seed in range(3):  # three exports, each under fresh secret keys; the seed drives the null baseline
            shield = aegis.protect(model, config=aegis.AegisConfig(preset=aegis.Preset.VERIFICATION))
            grads = shared_gradient(model, texts, tok, shield=shield, labels=labels)
            for name, attack in ATTACKS.items():
                got = rouge(attack(model, grads, tok, size), texts, alignment)["rouge1"]
                null = null_baseline(attack, model, grads, tok, size, texts, alignment=alignment, seed=seed)["rouge1"]
                defended[name].append((got, null))
            for p in model.parameters():  # the next seed's shield starts from a trainable model
                p.requires_grad_(True)
        for name in ATTACKS:
            mean = {k: statistics.mean(r[k] for r in undefended[name]) for k in undefended[name][0]}
            got = statistics.mean(g for g, _ in defended[name])
            null = statistics.mean(n for _, n in defended[name])
            row = {"setting": setting, "attack": name, "undefended": mean, "paper_rouge1": got, "null_rouge1": null,
                   "broken": got <= max(0.05, null + 0.05)}
            if name == "dager":
                row["dager_seconds_max"] = max(seconds)
            rows.append(row)
            ids = f" (ids {mean['token_id_recall']:.3f})" if "token_id_recall" in mean else ""
            print(f"{setting:22s} {name:15s} undefended R1 {mean['rouge1']:.3f} R2 {mean['rouge2']:.3f} "
                  f"recall {mean['token_recall']:.3f}{ids}   paper R1 {got:.3f} (null {null:.3f})", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "attacks.json"
    path.write_text(json.dumps({"batches": args.batches, "torch_threads": 2, "rows": rows}, indent=1))
    print("wrote", path)


if __name__ == "__main__":
    main()
