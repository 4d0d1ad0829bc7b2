"""The label channel of the audit's encoder, per preset and batch size, at each preset's exposure budget.

Every step-mode preset whose promise stops reconstruction (the label attack is a reconstruction threat, ``THREATS`` in
``aegis.audit.records``) is measured at B = 1, 2, 8 with the audit's own label attack
(``aegis.audit.label_attack.evaluate``): fresh batches of sentences no client trains on, each exported K times
through the preset's own code at the audit's attacked model, K = the preset's exposure budget, the attack reading
the mean of the K exports, against the chance level of its own guesses with a permutation p-value per variant (the
naive counts and, at B > 1, the counts with the public gain undone). Bonferroni runs over every variant of every
preset cell of the study. Controls, which must read high: ``none`` (undefended) and ``no noise`` (the head's rows
flood at rho 0.3 without noise or snr cap, through AEGIS's code: what the noise hides).

A cell is at its null when its excess over chance is within the audit's margin (0.05) and its adjusted p is at
least ALPHA (0.01). Cells outside a preset's promise (``Promise.outside``: a batch size it is not stated for) are
measured and marked.

    python benchmarks/labels_study.py                    # seeds 0, 1, 2; 1280 / 640 / 320 batches at B = 1 / 2 / 8
    python benchmarks/labels_study.py --seeds 3 --out /tmp/labels-seed3.json

Each seed is the audit's ``--seed`` (the head's initialisation, the sentences' order, the permutations); the keys
are fresh in every run. Writes benchmarks/results/labels-cpu-encoder.json (the CPU named inside): one run per seed.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import time
from pathlib import Path

import torch

from aegis import AegisConfig, ExportMode, Treatment
from aegis.audit.attacks import ModelContext, server_copy
from aegis.audit.dataset import load
from aegis.audit.label_attack import evaluate, exposures
from aegis.audit.options import AuditConfig, resolve_defence
from aegis.audit.records import ALPHA, MARGIN, THREATS
from aegis.audit.runner import batch_builder, client_examples, load_model
from aegis.config import Preset
from aegis.registry import DefenceSpec

ROOT = Path(__file__).resolve().parents[1]

BATCHES = "1:1280,2:640,8:320"


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.partition(":")[2].strip()
    return platform.processor() or "cpu"


def encoder_context(seed: int) -> tuple[ModelContext, torch.nn.Module]:
    """The audit's encoder context (as ``aegis audit --models encoder --seed S`` builds it) and the model its label
    row attacks (the first round's global model)."""
    config = AuditConfig(models=("encoder",), defences=("none",), attacks=("labels",), seed=seed)
    data = load(config)
    label_ids = data.label_ids()
    model, tok = load_model("encoder", config, num_labels=max(2, len(label_ids)))
    used = {id(e) for client in client_examples(data, config) for batch in client for e in batch}
    decoys = [e for e in data.validation + data.train if id(e) not in used]
    ctx = ModelContext("encoder", model, tok, config, batch_builder("encoder", tok, label_ids), label_ids, decoys)
    return ctx, server_copy(model)


def settings() -> list[tuple[DefenceSpec, bool]]:
    """(defence, is a preset under test) for every preset that promises the labels, then the controls."""
    presets = [p for p in Preset if THREATS["labels"] in p.promise.stops and p.promise.export is ExportMode.STEP]
    out = [(resolve_defence(f"aegis-{p.value}"), True) for p in presets]
    no_noise = AegisConfig(preset=presets[0], overrides={"head": Treatment("rows", lam=0.0, rho=0.3)})
    out += [(resolve_defence("none"), False), (DefenceSpec("no noise (head rho 0.3, lam 0)", no_noise), False)]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", default="0,1,2", help="the audit's seeds, one run each (default %(default)s)")
    parser.add_argument("--batches", default=BATCHES, help="B:n,... fresh batches per cell (default %(default)s)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/labels-cpu-encoder.json")
    args = parser.parse_args()
    sizes = {int(b): int(n) for b, n in (item.split(":") for item in args.batches.split(","))}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    runs = [study(int(seed), sizes) for seed in args.seeds.split(",")]
    result = {
        "what": "the audit's label attack on its encoder (MiniLM, 4-class head) per preset and batch size, each "
        "fresh batch exported K = the preset's exposure budget times and the mean attacked; permutation p-values "
        "against the guesses' own chance level, Bonferroni over every variant of the presets' cells of a run",
        "device": f"CPU: {cpu_name()} ({os.cpu_count()} cores, shared; torch threads {torch.get_num_threads()})",
        "torch": torch.__version__,
        "commit": commit.strip(),
        "margin": MARGIN,
        "alpha": ALPHA,
        "all_presets_at_null": all(run["all_presets_at_null"] for run in runs),
        "controls_min_excess": min(run["controls_min_excess"] for run in runs),
        "runs": runs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"presets at their null in every run: {result['all_presets_at_null']}; controls' excess >= "
          f"{result['controls_min_excess']:.2f}; wrote {args.out}")


def study(seed: int, sizes: dict[int, int]) -> dict:
    """One run: every setting's cells at the audit's ``seed``."""
    torch.manual_seed(seed)
    ctx, model = encoder_context(seed)
    cells = []
    started = time.time()
    for spec, under_test in settings():
        k = exposures(spec)
        promise = spec.aegis.promise if spec.aegis is not None else None
        for b, n in sizes.items():
            t0 = time.perf_counter()
            tests = evaluate(ctx, spec, model, {b: n}, seed, k)[0]
            cell = {
                "defence": spec.name,
                "under_test": under_test,
                "batch_size": b,
                "exposures": k,
                "batches": n,
                "exports": n * k,
                "outside_promise": promise.outside(b) if promise is not None else None,
                "variants": {
                    v: {"accuracy": t.accuracy, "null": t.null, "excess": t.accuracy - t.null, "p": t.p_value}
                    for v, t in tests.items()
                },
                "seconds": round(time.perf_counter() - t0, 1),
            }
            cells.append(cell)
            best = max(tests.values(), key=lambda t: t.accuracy - t.null)
            print(f"{spec.name:32s} B={b} K={k} n={n}: {best.accuracy:.3f} vs {best.null:.3f} p {best.p_value:.2g}",
                  flush=True)
    return summarise(seed, len(ctx.decoys), cells, time.time() - started)


def summarise(seed: int, sentences: int, cells: list[dict], seconds: float) -> dict:
    """One run's record: Bonferroni over every variant of the presets' cells; a preset's cell is at its null when
    no variant has an adjusted p below ALPHA or an excess above MARGIN; a control's ``max_excess``: how high it read."""
    tested = sum(len(c["variants"]) for c in cells if c["under_test"])
    for c in cells:
        for v in c["variants"].values():
            v["p_bonferroni"] = min(1.0, tested * v["p"]) if c["under_test"] else None
        c["max_excess"] = max(v["excess"] for v in c["variants"].values())
        if c["under_test"]:
            c["min_p_bonferroni"] = min(v["p_bonferroni"] for v in c["variants"].values())
            c["at_null"] = c["min_p_bonferroni"] >= ALPHA and c["max_excess"] <= MARGIN
    return {
        "seed": seed,
        "sentences": sentences,
        "bonferroni_tests": tested,
        "all_presets_at_null": all(c["at_null"] for c in cells if c["under_test"]),
        "controls_min_excess": min(c["max_excess"] for c in cells if not c["under_test"]),
        "seconds": round(seconds, 1),
        "cells": cells,
    }


if __name__ == "__main__":
    main()
