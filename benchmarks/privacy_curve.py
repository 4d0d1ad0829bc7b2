"""Privacy curve (issue 4): how much the adaptive MLP attacks recover as the MLP flood grows.

AEGIS paper preset (attention frozen, embeddings / norms / biases flooded as usual) with the MLP
treatment overridden to ``matrix`` flood at scale lambda and signal weight rho; ``mlp_span`` (exact span of
the first block's c_fc gradient) and ``spectral`` (Marchenko–Pastur denoised span) attack each shared
gradient of the default decoder, on batches of the shipped corpus. Each point also has the null baseline
(the same attack on a random gradient of matched per-tensor norms). ROUGE-1/2 F, mean over batches.

    python benchmarks/privacy_curve.py            # 9 lambdas x rho in {0, 0.3}, 8 batches of B = 1
    python benchmarks/privacy_curve.py --quick    # 5 lambdas, 2 batches (a few minutes on 2 CPU cores)

Writes privacy-curve.json and privacy-curve.png to --out (default benchmarks/results).
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "python")]

import aegis  # noqa: E402
from aegis.attacks import mlp_span, shared_gradient, spectral  # noqa: E402
from aegis.data import load_corpus  # noqa: E402
from aegis.metrics import null_baseline, rouge  # noqa: E402
from aegis.models import default_decoder  # noqa: E402

LAMS = (0.0, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 4.0, 8.0)
QUICK_LAMS = (0.0, 0.5, 1.0, 2.0, 8.0)
RHOS = (0.0, 0.3)
ATTACKS = {"mlp_span": mlp_span, "spectral": spectral}


def run(lams, batches: int, batch_size: int, seed: int) -> dict:
    model, tok = default_decoder()
    corpus = [e.text for e in load_corpus("validation")]
    texts = [corpus[i * batch_size : (i + 1) * batch_size] for i in range(batches)]
    curves = {name: {str(rho): {"rouge1": [], "rouge2": [], "null_rouge1": []} for rho in RHOS} for name in ATTACKS}
    for rho in RHOS:
        for lam in lams:
            # The shield freezes attention on first use; later shields only swap the MLP treatment.
            config = aegis.AegisConfig(preset="paper", overrides={"mlp": aegis.Treatment("matrix", lam=lam, rho=rho)})
            shield = aegis.protect(model, config=config)
            sums = {name: [0.0, 0.0, 0.0] for name in ATTACKS}
            for batch in texts:
                grads = shared_gradient(model, batch, tok, shield=shield)
                for name, attack in ATTACKS.items():
                    scores = rouge(attack(model, grads, tok, batch_size), batch)
                    null = null_baseline(attack, model, grads, tok, batch_size, batch, seed=seed)
                    for i, value in enumerate((scores["rouge1"], scores["rouge2"], null["rouge1"])):
                        sums[name][i] += value / len(texts)
            for name, (r1, r2, n1) in sums.items():
                point = curves[name][str(rho)]
                point["rouge1"].append(r1)
                point["rouge2"].append(r2)
                point["null_rouge1"].append(n1)
                print(
                    f"rho={rho:<4} lam={lam:<5} {name:<9} ROUGE-1 {r1:.3f}  ROUGE-2 {r2:.3f}  null {n1:.3f}", flush=True
                )
    return curves


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rhos = [str(rho) for rho in result["rhos"]]
    fig, axes = plt.subplots(1, len(rhos), figsize=(9, 3.8), sharey=True)
    styles = {"mlp_span": ("tab:blue", "o", "-"), "spectral": ("tab:red", "s", "--")}
    for ax, rho in zip(axes, rhos):
        for name, by_rho in result["curves"].items():
            color, marker, line = styles[name]
            ax.plot(result["lams"], by_rho[rho]["rouge1"], color=color, marker=marker, linestyle=line, label=name)
        ax.axhline(0.05, color="grey", linestyle=":", label="defended bar 0.05")
        ax.set_xscale("symlog", linthresh=0.25)
        ax.set_xlim(-0.03, result["lams"][-1] * 1.2)
        ax.set_xticks(result["lams"], [f"{lam:g}" for lam in result["lams"]], fontsize=7)
        ax.set_xlabel("MLP flood scale lambda (sigma = lambda * mean|G|)")
        ax.set_title(f"MLP signal weight rho = {rho}", fontsize=10)
    axes[0].set_ylabel("ROUGE-1 F of the reconstruction")
    axes[0].set_ylim(-0.03, 1.03)
    axes[-1].legend(fontsize=8)
    fig.suptitle(
        f"Adaptive MLP attacks vs the AEGIS MLP flood (default decoder, attention frozen, "
        f"B = {result['batch_size']}, {result['batches']} batches)",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=150)
    plt.close(fig)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="5 lambdas and 2 batches")
    parser.add_argument("--batches", type=int, help="batches per point (default 8, quick 2)")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument(
        "--seed", type=int, default=0, help="seed of the null baseline (the flood always draws fresh keys)"
    )
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args(argv)

    lams = QUICK_LAMS if args.quick else LAMS
    batches = args.batches or (2 if args.quick else 8)
    start = time.perf_counter()
    curves = run(lams, batches, args.batch_size, args.seed)
    result = {
        "model": "aegis.models.default_decoder(n_layer=4)",
        "data": "aegis.data corpus, validation split, in file order",
        "preset": "paper, mlp overridden to matrix flood (lam, rho)",
        "batch_size": args.batch_size,
        "batches": batches,
        "lams": list(lams),
        "rhos": list(RHOS),
        "quick": args.quick,
        "seed": args.seed,
        "curves": curves,
        "elapsed_s": round(time.perf_counter() - start, 1),
        "machine": {
            "cpu_threads": torch.get_num_threads(),
            "python": platform.python_version(),
            "torch": torch.__version__,
        },
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "privacy-curve.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result, args.out / "privacy-curve.png")
    print(f"wrote {args.out / 'privacy-curve.json'} and .png in {result['elapsed_s']} s")


if __name__ == "__main__":
    main()
