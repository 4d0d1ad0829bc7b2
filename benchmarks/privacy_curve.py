"""Privacy curve (issue 15): every attack against the flood scale lambda at rho 0 and rho 0.3, and
against K exports of one batch averaged under each preset, each with its null baseline.

Attacks (the server holds the model and the public defence configuration, never the noise key):

* text (decoder, ROUGE-1 F of the reconstruction): ``dager``, ``embedding_norm``, ``mlp_span``,
  ``spectral`` (given the shield's public noise levels and K); null: the same attack on a random
  gradient of matched per-tensor norms (``aegis.metrics.null_baseline``);
* ``labels`` (MiniLM encoder, label-multiset accuracy from the head gradient, the head's public rho as
  gain); null: the attack's own guesses scored against the other batches' labels, with the permutation
  p-value (``aegis.attacks.labels.label_test``; needs two label batches at least);
* ``fingerprint`` (decoder, the likelihood variant of 1-of-N verification of "my pin is ____",
  ``aegis.attacks.candidates``); null: 1/N.

The lambda curves flood every rows tensor (embeddings, LM head, classifier) and the MLP with the same
(lambda, rho) and no snr cap, norms and biases as in ``paper``; the K curves run the presets that protect
with the exposure budget off (the shield would refuse past it), K = 1 .. 64 averaged exports
(``attacks.repeated.averaged_export``). The noise is keyed torch.randn unless ``--cipher`` (same law; the
attacks never see the key).

    python benchmarks/privacy_curve.py --quick                    # CPU, small sizes (see --quick)
    python benchmarks/privacy_curve.py --device cuda --resume     # 7 lambdas x 2 rhos, K to 64, 4 sentences
    python benchmarks/privacy_curve.py --rescore benchmarks/results/privacy-curve-h100.json   # where rouge-score is

Writes privacy-curve-<cpu|h100|...>.json to --out (default benchmarks/results) after every point, and the
.png once every point is in; ``--resume`` keeps the points of an earlier run with the same sizes.
"""
from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

import aegis
from aegis import AegisConfig, ExposurePolicy, Treatment
from aegis.attacks import shared_gradient, text_attacks
from aegis.attacks.candidates import Verifier, secret_candidates, verification_accuracy
from aegis.attacks.labels import label_leak, label_test
from aegis.attacks.repeated import averaged_export
from aegis.config import Preset
from aegis.data import LABELS, load_corpus
from aegis.metrics import null_gradient, rouge
from aegis.models import default_decoder, default_encoder

ROOT = Path(__file__).resolve().parents[1]

LAMS = (0.0, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0)
QUICK_LAMS = (0.0, 1.0, 4.0)
CONTROL_LAMS = (0.0, 1.0)  # --presets-only: rho 0.3 there shows each attack reading the signal
RHOS = (0.0, 0.3)
EXPOSURES = (1, 4, 16, 64, 256)
QUICK_EXPOSURES = (1, 4)
TEXT_ATTACKS = text_attacks(("dager", "embedding_norm", "mlp_span", "spectral"))
ATTACKS = (*TEXT_ATTACKS, "labels", "fingerprint")
ROWS = ("token_embedding", "position_embedding", "lm_head", "head", "token_embedding_lora")
PINS = [f"{(7919 * i + 1234) % 10000:04d}" for i in range(10000)]
CURVE_PRESETS = (Preset.VERIFICATION, Preset.SENTENCES)  # the K curves (``paper`` is the lambda curves)


def uniform(lam: float, rho: float) -> AegisConfig:
    """``paper`` with every rows flood and the MLP at (lam, rho), no snr cap: the curves' x axis."""
    rows, mlp = Treatment("rows", lam=lam, rho=rho), Treatment("matrix", lam=lam, rho=rho)
    overrides = {**{r: rows for r in ROWS}, "mlp": mlp}
    return AegisConfig(preset=Preset.PAPER, overrides=overrides, exposure=ExposurePolicy.OFF)


class Curve:
    """The models, data and sizes every point is measured with."""

    def __init__(self, args, device: torch.device):
        kw = {} if args.arch is None else {"arch": args.arch}
        kw |= {} if args.n_layer is None else {"n_layer": args.n_layer}
        self.decoder, self.tok = default_decoder(**kw)
        self.encoder, self.etok = default_encoder(num_labels=len(LABELS))
        self.decoder.to(device), self.encoder.to(device)
        text = [e.text for e in load_corpus("validation")]
        b = args.batch_size
        self.batch_size = b
        self.texts = [text[i * b : (i + 1) * b] for i in range(args.sentences)]
        examples = load_corpus("train")
        self.label_batches = [examples[i * b : (i + 1) * b] for i in range(args.label_batches)]
        self.candidates = secret_candidates("my pin is {}", PINS[: args.candidates])
        self.truths = [round(i * args.candidates / args.trials) for i in range(args.trials)]
        self.seed = args.seed

    def point(self, config: AegisConfig, exposures: int) -> dict[str, dict[str, float]]:
        """{attack: {"score", "null"}} at one configuration and K."""
        out = self._text(config, exposures)
        out["labels"] = self._labels(config, exposures)
        out["fingerprint"] = self._fingerprint(config, exposures)
        return out

    def _text(self, config, k):
        """Each text attack's reconstructions of every batch and of its null gradient; ROUGE is computed
        from them by :func:`score_text` (rouge-score may be absent where the attacks run)."""
        model, tok = self.decoder, self.tok
        shield = aegis.protect(model, config=config)
        public = shield.public_params()
        out = {name: {"references": self.texts, "predictions": [], "null_predictions": []} for name in TEXT_ATTACKS}
        for batch in self.texts:
            grads = averaged_export(lambda b=batch: shared_gradient(model, b, tok, shield=shield), k)
            null = null_gradient(grads, self.seed)
            for name, attack in TEXT_ATTACKS.items():
                kw = {"public": public, "exposures": k} if name == "spectral" else {}
                out[name]["predictions"].append(attack(model, grads, tok, self.batch_size, **kw))
                out[name]["null_predictions"].append(attack(model, null, tok, self.batch_size, **kw))
        return out

    def _labels(self, config, k):
        model, tok = self.encoder, self.etok
        shield = aegis.protect(model, config=config)
        head = shield.public_params().get("classifier.weight")  # the adaptive attacker's gain: the head's rho
        gain = 1.0 if head is None else max(head[0], 1e-6)
        preds, truths = [], []
        for batch in self.label_batches:
            texts, truth = [e.text for e in batch], [LABELS.index(e.label) for e in batch]
            grads = averaged_export(lambda t=texts, y=truth: shared_gradient(model, t, tok, shield=shield, labels=y), k)
            preds.append(label_leak(model, grads, len(batch), gain=gain).labels)
            truths.append(truth)
        test = label_test(preds, truths, len(LABELS))
        return {"score": test.accuracy, "null": test.null, "p_value": test.p_value}

    def _fingerprint(self, config, k):
        model, tok = self.decoder, self.tok
        shield = aegis.protect(model, config=config)
        verifier = Verifier(model, tok, config, exposures=k)
        obs = [verifier.observe(averaged_export(
            lambda c=self.candidates[t]: shared_gradient(model, list(c.texts), tok, shield=shield), k))
            for t in self.truths]
        result = verification_accuracy(verifier, obs, self.truths, self.candidates, ("likelihood",))["likelihood"]
        return {"score": result.accuracy, "null": result.null}


def score_text(points: dict) -> bool:
    """Fill in ROUGE-1 F (mean over batches; greedy alignment, DAGER's for decoders) of every text attack's
    stored reconstructions and null reconstructions; False where rouge-score is not installed."""
    try:
        import rouge_score  # noqa: F401
    except ImportError:
        return False
    for point in points.values():
        for name in TEXT_ATTACKS:
            p = point[name]
            if "score" in p:
                continue
            refs = p["references"]
            p["score"] = sum(rouge(x, r)["rouge1"] for x, r in zip(p["predictions"], refs)) / len(refs)
            p["null"] = sum(rouge(x, r)["rouge1"] for x, r in zip(p["null_predictions"], refs)) / len(refs)
    return True


def plan(lams, exposures) -> dict[str, tuple[AegisConfig, int]]:
    """point key -> (configuration, K): the lambda curves at K = 1, then each preset's K curve."""
    out = {f"rho {rho} lam {lam}": (uniform(lam, rho), 1) for rho in RHOS for lam in lams}
    for preset in CURVE_PRESETS:
        for k in exposures:
            out[f"{preset.value} K={k}"] = (AegisConfig(preset=preset, exposure=ExposurePolicy.OFF), k)
    return out


def run(curve: Curve, points: dict, lams, exposures, log, save) -> None:
    """Measure every point of ``plan`` missing from ``points`` (key -> {attack: {score, null}}), saving
    after each one (a run cut off by a time limit resumes where it stopped)."""
    for key, (config, k) in plan(lams, exposures).items():
        if key in points:
            continue
        start = time.perf_counter()
        points[key] = curve.point(config, k)
        score_text({key: points[key]})
        log(f"{key:<18} " + _line(points[key]) + f"  ({time.perf_counter() - start:.0f} s)")
        save()


def curves(points: dict, lams, exposures) -> dict:
    """The lambda curves per rho and the K curves per preset, from the measured points."""
    def series(keys):
        return {a: {m: [points[key][a][m] for key in keys] for m in ("score", "null")} for a in ATTACKS}

    return {"lam_curves": {str(rho): series([f"rho {rho} lam {lam}" for lam in lams]) for rho in RHOS} if lams else {},
            "exposure_curves": {p.value: series([f"{p.value} K={k}" for k in exposures]) for p in CURVE_PRESETS}}


def _line(point: dict) -> str:
    return "  ".join(f"{a} {v['score']:.2f}/{v['null']:.2f}" if "score" in v else f"{a} (unscored)"
                     for a, v in point.items())


STYLE = {"dager": ("tab:blue", "o"), "embedding_norm": ("tab:orange", "v"), "mlp_span": ("tab:green", "^"),
         "spectral": ("tab:red", "s"), "labels": ("tab:purple", "D"), "fingerprint": ("k", "*")}


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("lam", rho) for rho in result["lam_curves"]] + [("K", p) for p in result["exposure_curves"]]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 4.2), sharey=True, squeeze=False)
    axes = axes[0]
    for ax, (kind, key) in zip(axes, panels):
        curves = result["lam_curves"][key] if kind == "lam" else result["exposure_curves"][key]
        xs = result["lams"] if kind == "lam" else result["exposures"]
        for attack, c in curves.items():
            color, marker = STYLE[attack]
            ax.plot(xs, c["score"], color=color, marker=marker, label=attack)
            ax.plot(xs, c["null"], color=color, linestyle=":", alpha=0.6)
        ax.axhline(0.05, color="grey", linestyle="--", linewidth=0.8)
        if kind == "lam":
            ax.set_xscale("symlog", linthresh=0.25)
            ax.set_xticks(xs, [f"{x:g}" for x in xs], fontsize=7)
            ax.set_xlabel("lambda of every rows flood and the MLP (no snr cap)")
            ax.set_title(f"rho = {key}, K = 1", fontsize=10)
        else:
            ax.set_xscale("log", base=2)
            ax.set_xticks(xs, [str(x) for x in xs])
            ax.set_xlabel("exports of one batch averaged (K)")
            ax.set_title(f"preset {key} (budget {result['budgets'][key]}), budget off", fontsize=10)
    axes[0].set_ylabel("ROUGE-1 (text) / accuracy (labels, 1-of-N)")
    axes[0].set_ylim(-0.03, 1.03)
    axes[0].legend(fontsize=7)
    fig.suptitle(f"Every attack vs the flood and vs K ({result['decoder']}; B = {result['batch_size']}, "
                 f"{result['sentences']} sentences, {result['label_batches']} label batches, 1-of-"
                 f"{result['candidates']} over {result['trials']} trials; dotted: null; dashed: 0.05)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="lambda 0, 1, 4; K 1, 4; 1 sentence, 2 label batches, 1-of-10 over 2 trials")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--sentences", type=int, help="text batches per point (default 4, quick 1)")
    parser.add_argument("--label-batches", type=int, help="encoder batches per point (default 8, quick 2)")
    parser.add_argument("--candidates", type=int, help="N of the 1-of-N secret (default 40, quick 10)")
    parser.add_argument("--trials", type=int, help="1-of-N trials per point (default 10, quick 2)")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--presets-only", action="store_true",
                        help="the presets' K points and, as the attacks' positive controls, lambda 0 and 1 "
                             "(other models and batch sizes)")
    parser.add_argument("--exposures", help="comma-separated K of the preset points (default 1,4,16,64,256)")
    parser.add_argument("--arch", help="decoder architecture for aegis.models.default_decoder (default: its own)")
    parser.add_argument("--n-layer", type=int, help="decoder blocks (default: the architecture's)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the null baselines (floods draw fresh keys)")
    parser.add_argument("--cipher", action="store_true", help="the reference cipher instead of keyed randn")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (LAPACK thrashes on shared cores)")
    parser.add_argument("--resume", action="store_true", help="keep the points already in the result file")
    parser.add_argument("--rescore", type=Path,
                        help="score (ROUGE) and plot a result file measured where rouge-score was absent; no models")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args(argv)
    if args.rescore is not None:
        rescore(args.rescore)
        return
    quick = args.quick
    args.sentences = args.sentences or (1 if quick else 4)
    args.label_batches = args.label_batches or (2 if quick else 8)
    args.candidates = args.candidates or (10 if quick else 40)
    args.trials = min(args.trials or (2 if quick else 10), args.candidates)
    if min(args.sentences, args.trials, args.batch_size) < 1 or args.label_batches < 2 or args.candidates < 2:
        parser.error("--sentences, --trials, --batch-size >= 1, --label-batches >= 2 (the label null pairs "
                     "guesses with other batches) and --candidates >= 2")
    device = torch.device(args.device)
    if not args.cipher:
        from aegis_kernels import testing as fast_noise

        fast_noise.install()
    torch.set_num_threads(args.threads)
    card = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    tag = "h100" if "H100" in card else "h200" if "H200" in card else "cpu" if card == "cpu" else "gpu"
    lams, exposures = (QUICK_LAMS, QUICK_EXPOSURES) if quick else (LAMS, EXPOSURES)
    if args.presets_only:
        lams = CONTROL_LAMS
    if args.exposures:
        exposures = tuple(int(k) for k in args.exposures.split(","))
    args.out.mkdir(parents=True, exist_ok=True)
    variant = "".join(f"-{part}" for part in (args.arch, None if args.batch_size == 1 else f"b{args.batch_size}",
                                              "presets" if args.presets_only else None) if part)
    path = args.out / f"privacy-curve-{tag}{variant}.json"
    settings = {
        "card": card,
        "decoder": f"default_decoder({args.arch or ''}{'' if args.n_layer is None else f', n_layer={args.n_layer}'})",
        "encoder": "default_encoder (MiniLM)",
        "data": "aegis.data corpus: validation split (text), train split (labels), in file order",
        "noise": "reference cipher" if args.cipher else "keyed torch.randn (same law as the cipher)",
        "batch_size": args.batch_size, "sentences": args.sentences, "label_batches": args.label_batches,
        "candidates": args.candidates, "trials": args.trials, "quick": quick, "seed": args.seed,
        "lams": list(lams), "rhos": list(RHOS), "exposures": list(exposures),
        "budgets": {p.value: p.promise.exposures for p in CURVE_PRESETS},
        "metric": {a: "rouge1" for a in TEXT_ATTACKS} | {"labels": "accuracy", "fingerprint": "accuracy"},
        "label_null": "the attack's guesses against the other batches' labels (label_test)",
    }
    old = json.loads(path.read_text()) if args.resume and path.exists() else {}
    same = all(old.get(k) == v for k, v in settings.items() if k not in ("card", "budgets"))
    points = dict(old.get("points", {})) if same else {}
    elapsed = old.get("elapsed_s", 0.0) if same else 0.0
    start = time.perf_counter()

    def save(final: bool = False) -> None:
        result = {**settings, "points": points, "complete": final,
                  **(curves(points, lams, exposures) if final else {}),
                  "elapsed_s": round(elapsed + time.perf_counter() - start, 1),
                  "machine": {"cpu_threads": torch.get_num_threads(), "python": platform.python_version(),
                              "torch": torch.__version__}}
        tmp = path.with_suffix(".tmp")  # then renamed: a kill mid-write leaves the last complete file
        tmp.write_text(json.dumps(result, indent=1) + "\n")
        tmp.replace(path)
        if final:
            plot(result, path.with_suffix(".png"))

    if len(points) < len(plan(lams, exposures)):
        run(Curve(args, device), points, lams, exposures, lambda line: print(line, flush=True), save)
    if not score_text(points):
        save()
        print(f"wrote {path}; rouge-score is not installed here: score and plot it with --rescore {path.name}")
        return
    save(final=True)
    print(f"wrote {path} and .png ({round(elapsed + time.perf_counter() - start, 1)} s of measurement)")


def rescore(path: Path) -> None:
    result = json.loads(path.read_text())
    if not score_text(result["points"]):
        raise SystemExit("--rescore needs rouge-score: pip install rouge-score")
    result.update(curves(result["points"], result["lams"], result["exposures"]), complete=True)
    path.write_text(json.dumps(result, indent=1) + "\n")
    plot(result, path.with_suffix(".png"))
    print(f"scored {path} and wrote its .png")


if __name__ == "__main__":
    main()
