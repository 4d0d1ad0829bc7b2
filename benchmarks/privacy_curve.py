"""Privacy curve (issues 4, 15): how much the adaptive MLP attacks recover as the MLP flood grows and as
exports of one batch are averaged.

AEGIS paper preset (attention frozen, embeddings / norms / biases flooded as usual) with the MLP
treatment overridden to ``matrix`` flood at scale lambda and signal weight rho; ``mlp_span`` (exact span of
the first block's c_fc gradient) and ``spectral`` (Marchenko–Pastur denoised span) attack each shared
gradient of the default decoder, on batches of the shipped corpus. Each point also has the null baseline
(the same attack on a random gradient of matched per-tensor norms). ROUGE-1/2 F, mean over batches.

``spectral`` is given the shield's public noise levels (``Shield.public_params()``) and the number of
averaged exports. The K sweep (1, 4, 16, 64 exports averaged, ``attacks.repeated.averaged_export``) runs at
the weak setting of the issue (MLP matrix flood lam 2, rho 0.3); the shipped presets ``paper`` and
``utility`` are reported at K = 1 as points. The noise comes from keyed torch.randn unless ``--cipher``
(the CPU reference cipher costs ~2 s per export; the attacks only know the noise law).

    python benchmarks/privacy_curve.py            # 9 lambdas x rho in {0, 0.3}, K sweep, 8 batches of B = 1
    python benchmarks/privacy_curve.py --quick    # 5 lambdas, same K sweep, 2 sentences (~10 min, 2 cores)

Writes privacy-curve-cpu.json and privacy-curve-cpu.png to --out (default benchmarks/results).
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
from aegis.attacks.repeated import averaged_export  # noqa: E402
from aegis.data import load_corpus  # noqa: E402
from aegis.metrics import null_baseline, rouge  # noqa: E402
from aegis.models import DecoderArch, default_decoder  # noqa: E402

LAMS = (0.0, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 4.0, 8.0)
QUICK_LAMS = (0.0, 0.5, 1.0, 2.0, 4.0)
RHOS = (0.0, 0.3)
EXPOSURES = (1, 4, 16, 64)
K_SETTING = (2.0, 0.3)  # (lam, rho) of the exposure sweep: the weak MLP flood
ATTACKS = {"mlp_span": mlp_span, "spectral": spectral}


def _fast_noise() -> None:
    """Keyed torch.randn in place of the CPU reference cipher (tests/fast_noise.py): same law, ~50x faster."""
    import hashlib

    import aegis_kernels.reference as ref

    def keyed_normals(n, key, offset, per, device):
        seed = int.from_bytes(hashlib.sha256(repr((key.tolist(), offset)).encode()).digest()[:8], "little")
        gen = torch.Generator().manual_seed(seed)
        za = torch.randn(n, generator=gen).to(device)
        return za, (torch.randn(n, generator=gen).to(device) if per == 2 else None)

    ref.noise_components = keyed_normals


def _point(model, tok, config, texts, batch_size, seed, exposures=1) -> dict:
    """Mean ROUGE-1/2 and null ROUGE-1 of every attack over the batches, at one setting."""
    shield = aegis.protect(model, config=config.replace(exposure="off"))
    public = shield.public_params()
    sums = {name: [0.0, 0.0, 0.0] for name in ATTACKS}
    for batch in texts:
        grads = averaged_export(lambda b=batch: shared_gradient(model, b, tok, shield=shield), exposures)
        for name, attack in ATTACKS.items():
            kw = {"public": public, "exposures": exposures} if name == "spectral" else {}
            scores = rouge(attack(model, grads, tok, batch_size, **kw), batch)
            null = null_baseline(attack, model, grads, tok, batch_size, batch, seed=seed, **kw)
            for i, value in enumerate((scores["rouge1"], scores["rouge2"], null["rouge1"])):
                sums[name][i] += value / len(texts)
    return {name: dict(zip(("rouge1", "rouge2", "null_rouge1"), v)) for name, v in sums.items()}


def run(lams, exposures, batches: int, batch_size: int, seed: int, n_layer: int) -> dict:
    model, tok = default_decoder(arch=DecoderArch.GPT2, n_layer=n_layer)
    corpus = [e.text for e in load_corpus("validation")]
    texts = [corpus[i * batch_size : (i + 1) * batch_size] for i in range(batches)]
    keys = ("rouge1", "rouge2", "null_rouge1")
    curves = {name: {str(rho): {k: [] for k in keys} for rho in RHOS} for name in ATTACKS}
    for rho in RHOS:
        for lam in lams:
            config = aegis.AegisConfig(preset="paper", overrides={"mlp": aegis.Treatment("matrix", lam=lam, rho=rho)})
            point = _point(model, tok, config, texts, batch_size, seed)
            for name, p in point.items():
                for k in keys:
                    curves[name][str(rho)][k].append(p[k])
                print(f"rho={rho:<4} lam={lam:<5} {name:<9} ROUGE-1 {p['rouge1']:.3f}  ROUGE-2 {p['rouge2']:.3f}  "
                      f"null {p['null_rouge1']:.3f}", flush=True)
    lam, rho = K_SETTING
    by_k = {name: {k: [] for k in keys} for name in ATTACKS}
    for k_exp in exposures:
        config = aegis.AegisConfig(preset="paper", overrides={"mlp": aegis.Treatment("matrix", lam=lam, rho=rho)})
        point = _point(model, tok, config, texts, batch_size, seed, exposures=k_exp)
        for name, p in point.items():
            for k in keys:
                by_k[name][k].append(p[k])
            print(f"K={k_exp:<3} (lam {lam}, rho {rho}) {name:<9} ROUGE-1 {p['rouge1']:.3f}  "
                  f"null {p['null_rouge1']:.3f}", flush=True)
    presets = {}
    for preset in ("paper", "utility"):
        presets[preset] = _point(model, tok, aegis.AegisConfig(preset=preset), texts, batch_size, seed)
        for name, p in presets[preset].items():
            print(f"preset {preset:<8} {name:<9} ROUGE-1 {p['rouge1']:.3f}  null {p['null_rouge1']:.3f}", flush=True)
    return {"curves": curves, "exposure_curve": by_k, "presets": presets}


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rhos = [str(rho) for rho in result["rhos"]]
    fig, axes = plt.subplots(1, len(rhos) + 1, figsize=(13, 4), sharey=True)
    styles = {"mlp_span": ("tab:blue", "o", "-"), "spectral": ("tab:red", "s", "--")}
    for ax, rho in zip(axes, rhos):
        for name, by_rho in result["curves"].items():
            color, marker, line = styles[name]
            ax.plot(result["lams"], by_rho[rho]["rouge1"], color=color, marker=marker, linestyle=line, label=name)
            ax.plot(result["lams"], by_rho[rho]["null_rouge1"], color=color, linestyle=":", alpha=0.6,
                    label=f"{name} null")
        ax.axhline(0.05, color="grey", linestyle=":", label="defended bar 0.05")
        ax.set_xscale("symlog", linthresh=0.25)
        ax.set_xlim(-0.03, result["lams"][-1] * 1.2)
        ax.set_xticks(result["lams"], [f"{lam:g}" for lam in result["lams"]], fontsize=7)
        ax.set_xlabel("MLP flood scale lambda (sigma = lambda * mean|G_pub|)")
        ax.set_title(f"MLP signal weight rho = {rho}, K = 1", fontsize=10)
    ax = axes[-1]
    lam, rho = result["exposure_setting"]
    for name, curve in result["exposure_curve"].items():
        color, marker, line = styles[name]
        ax.plot(result["exposures"], curve["rouge1"], color=color, marker=marker, linestyle=line, label=name)
        ax.plot(result["exposures"], curve["null_rouge1"], color=color, linestyle=":", alpha=0.6)
    for preset, mark in (("paper", "^"), ("utility", "v")):
        value = result["presets"][preset]["spectral"]["rouge1"]
        ax.scatter([1], [value], marker=mark, color="k", zorder=5, label=f"preset {preset} (spectral, K=1)")
    ax.axhline(0.05, color="grey", linestyle=":")
    ax.set_xscale("log", base=2)
    ax.set_xticks(result["exposures"], [str(k) for k in result["exposures"]])
    ax.set_xlabel("exports of one batch averaged (K)")
    ax.set_title(f"lam {lam:g}, rho {rho:g}: noise / sqrt(K)", fontsize=10)
    ax.legend(fontsize=7)
    axes[0].set_ylabel("ROUGE-1 F of the reconstruction")
    axes[0].set_ylim(-0.03, 1.03)
    axes[0].legend(fontsize=7)
    fig.suptitle(
        f"Adaptive MLP attacks vs the AEGIS MLP flood (default decoder, {result['n_layer']} blocks, attention "
        f"frozen, B = {result['batch_size']}, {result['batches']} sentences; dotted: null baselines)",
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
    parser.add_argument("--n-layer", type=int, help="decoder blocks (default 4)")
    parser.add_argument("--cipher", action="store_true", help="the CPU reference cipher instead of keyed randn")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (LAPACK thrashes on shared cores)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args(argv)

    lams = QUICK_LAMS if args.quick else LAMS
    batches = args.batches or (2 if args.quick else 8)
    n_layer = args.n_layer or 4
    if not args.cipher:
        _fast_noise()
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    out = run(lams, EXPOSURES, batches, args.batch_size, args.seed, n_layer)
    result = {
        "model": f"aegis.models.default_decoder(arch='gpt2', n_layer={n_layer})",
        "n_layer": n_layer,
        "data": "aegis.data corpus, validation split, in file order",
        "preset": "paper, mlp overridden to matrix flood (lam, rho); presets paper and utility as points",
        "noise": "CPU reference cipher" if args.cipher else "keyed torch.randn (same law as the cipher)",
        "batch_size": args.batch_size,
        "batches": batches,
        "lams": list(lams),
        "rhos": list(RHOS),
        "exposures": list(EXPOSURES),
        "exposure_setting": list(K_SETTING),
        "quick": args.quick,
        "seed": args.seed,
        **out,
        "elapsed_s": round(time.perf_counter() - start, 1),
        "machine": {
            "cpu_threads": torch.get_num_threads(),
            "python": platform.python_version(),
            "torch": torch.__version__,
        },
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "privacy-curve-cpu.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result, args.out / "privacy-curve-cpu.png")
    print(f"wrote {args.out / 'privacy-curve-cpu.json'} and .png in {result['elapsed_s']} s")


if __name__ == "__main__":
    main()
