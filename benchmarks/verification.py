"""Candidate verification, repeated exposure and the label channel against the presets.

For each model (default decoder, LLaMA-architecture decoder, MiniLM encoder) and each setting (the two
presets at one export, at their exposure budget and past it with the budget switched off, and settings
that must leak: no noise (rho 1, lam 0, no clip; attention still frozen), the paper's batch calibration,
the paper's original rows rho = 0.3), the server
runs, for every N of ``--candidates`` (10, 40, 1000) and every B of ``--batch-sizes`` (1, 4, 8):

* ``secret``: which of N PINs completes "my pin is ____" (B = 1; B > 1 with B - 1 known sentences);
* ``sentence``: which of N candidate batches (B corpus sentences each) the client trained on;
  both with every ``aegis.attacks.fingerprint`` variant on the mean of K exports (``attacks.repeated``),
  scored by ``attacks.candidates.Verifier`` (candidates streamed in batched chunks, any N);
* ``labels`` (encoder): the label multiset from the head gradient at B = 1, 2, 8 (``attacks.labels``).

Each attack's null is its score on an export that carries nothing of the batch (``no signal: rho 0``):
the label attack's guesses are not uniform (its counts avoid repeats), so its chance level differs from
uniform guessing's (``null`` in the label rows). Chance of a 1-of-N guess is 1/N.

    python benchmarks/verification.py                   # on CUDA: the Triton floods, the real cipher
    python benchmarks/verification.py --fast-noise      # CPU: keyed torch.randn instead of ChaCha
    python benchmarks/verification.py --models llama --batch-sizes 8 --settings "verification K=" \
        --exposures 2 --repeats 6 --skip-labels         # K = 1, 2, 4 of verification; six fresh-key runs per cell

    python benchmarks/verification.py --settings "verification K=4,past budget" --drift 1e-3 --skip-labels
                                                        # the K exports from K rounds of a moving model

A weak leak shows in the pool of many trials before any cell of 40 crosses its bar: ``--repeats`` measures
every cell again with fresh keys (the candidates and targets stay those of the cell).

Writes verification-<card>.json to --out (default benchmarks/results); ``--append`` merges into it,
replacing only the cells (model, setting, B, N) this run measures.
"""
from __future__ import annotations

import argparse
import copy
import itertools
import json
import math
import platform
import time
from pathlib import Path

import torch

import aegis
from aegis import AegisConfig, Calibration, ExportMode, ExposurePolicy, Treatment
from aegis.attacks import shared_gradient
from aegis.attacks.candidates import Candidate, Verifier, score_accuracy, verification_accuracy
from aegis.attacks.fingerprint import VARIANTS
from aegis.attacks.labels import label_accuracy, label_leak, label_null
from aegis.attacks.repeated import averaged_export, joint_scores
from aegis.config import Preset
from aegis.data import LABELS, load_corpus
from aegis.models import default_decoder, default_encoder

ROOT = Path(__file__).resolve().parents[1]

PINS = [f"{(7919 * i + 1234) % 10000:04d}" for i in range(10000)]  # distinct: 7919 is prime to 10^4
ROWS = ("token_embedding", "position_embedding", "lm_head", "token_embedding_lora", "head")
# the step-mode presets that promise something (not ``paper``; delta mode exports one delta a round: frontier_delta)
PRESETS = tuple(p for p in Preset if p.promise.stops and p.promise.export is ExportMode.STEP)


def settings(sweep: tuple[float, ...] = (), exposures: tuple[int, ...] = ()) -> dict[str, tuple[AegisConfig, int]]:
    """name -> (config, exports averaged). Exposure tracking is off: the attacker is handed K exports.
    ``sweep``: the verification preset with every rows flood (embeddings, LM head, classifier) capped at these snr.
    ``exposures``: further K within each preset's budget (K = 1 and the budget itself are always there)."""
    base = dict(exposure=ExposurePolicy.OFF)
    out = {}
    for preset in PRESETS:
        budget = preset.promise.exposures
        for k in sorted({1, budget, *(k for k in exposures if k <= budget)}):
            out[f"{preset.value} K={k}"] = (AegisConfig(preset=preset, **base), k)
        for k in (4 * budget, 16 * budget):  # past the promise: the shield would refuse these exports
            out[f"past budget: {preset.value} K={k}"] = (AegisConfig(preset=preset, **base), k)
    # the controls: the verification preset with one thing weakened
    v = Preset.VERIFICATION
    weak = Treatment("rows", lam=1.0, rho=0.3)
    out["weak: batch calibration"] = (AegisConfig(preset=v, calibration=Calibration.BATCH, **base), 1)
    out["weak: rows rho 0.3"] = (AegisConfig(preset=v, overrides={r: weak for r in ROWS}, **base), 1)
    bare = {role: Treatment(t.kind, lam=0.0, rho=1.0, clip=math.inf)  # the attack's ceiling: no noise, no clip
            for role, t in AegisConfig(preset=v).treatments.items() if t.kind != "frozen"}
    out["no noise: rho 1 lam 0"] = (AegisConfig(preset=v, overrides=bare, **base), 1)
    silent = Treatment("rows", lam=1.0, rho=0.0)  # the attacks' empirical null: nothing of the batch leaves
    out["no signal: rho 0"] = (AegisConfig(preset=v, overrides={r: silent for r in ROWS}, **base), 1)
    for snr in sweep:
        capped = Treatment("rows", lam=1.0, rho=0.3, snr=snr)
        for k in (1, 4):  # K = 4: the positive control of the moving-model rounds (--drift)
            out[f"rows snr {snr} K={k}"] = (AegisConfig(preset=v, overrides={r: capped for r in ROWS}, **base), k)
    return out


def build(name: str):
    if name == "decoder":
        return default_decoder()
    if name in ("gpt2", "llama"):
        return default_decoder(arch=name)
    if name == "encoder":
        return default_encoder(num_labels=len(LABELS))
    raise ValueError(f"model {name!r}: use decoder, gpt2, llama or encoder")


def tasks(batch_size: int, n: int, pool: list, filler: list) -> dict[str, list[Candidate]]:
    """task -> N candidate batches (with their labels, for the encoder). Sentence candidates are disjoint
    chunks of the pool while it lasts, else distinct seeded random draws of B sentences from it; no
    sentence task where the pool has fewer than N distinct batches (B = 1, N = 1000)."""
    known = filler[: batch_size - 1]
    secret = [Candidate((f"my pin is {v}", *(e.text for e in known)), (0, *(LABELS.index(e.label) for e in known)))
              for v in PINS[:n]]
    if math.comb(len(pool), batch_size) < n:
        return {"secret": secret}
    if n * batch_size <= len(pool):
        picks = [list(range(i * batch_size, (i + 1) * batch_size)) for i in range(n)]
    else:
        gen, seen, picks = torch.Generator().manual_seed(n * 100 + batch_size), set(), []
        while len(picks) < n:
            pick = torch.randperm(len(pool), generator=gen)[:batch_size].tolist()
            if frozenset(pick) not in seen:
                seen.add(frozenset(pick))
                picks.append(pick)
    sentence = [Candidate(tuple(pool[i].text for i in p), tuple(LABELS.index(pool[i].label) for i in p))
                for p in picks]
    return {"secret": secret, "sentence": sentence}


def verification(model_name: str, arch: str, device: torch.device, trials: int, chosen: dict, sizes, batch_sizes,
                 log, rows: list[dict], save, done: frozenset = frozenset(), repeats: int = 1,
                 drift: float | None = None) -> None:
    """Every cell of one model, appended to ``rows`` and saved as it completes (a cut-off run keeps them);
    cells in ``done`` (model, its class name, setting, B, N, task, repeat) are skipped. A repeat measures the
    same cell again with fresh keys (the candidates and targets are fixed by the cell). ``drift``: the K
    exports come from K rounds of a moving model instead (settings with K > 1 only, named "... moving")."""
    corpus = load_corpus("train")
    built, tok = build(model_name)
    built.to(device)
    for setting, (config, k) in chosen.items():
        if drift is not None:
            if k == 1:
                continue
            setting = f"{setting} moving"
        for n in sizes:
            for batch_size in batch_sizes:
                for (task, cands), repeat in itertools.product(tasks(batch_size, n, corpus[:160], corpus[200:]).items(),
                                                              range(repeats)):
                    if (model_name, arch, setting, batch_size, n, task, repeat) in done:
                        continue
                    model = copy.deepcopy(built)  # a fresh, unshielded model per cell
                    if model_name != "encoder":
                        cands = [Candidate(c.texts) for c in cands]
                    shield = aegis.protect(model, config=config)
                    truths = [round(i * n / trials) for i in range(min(trials, n))]
                    start = time.time()
                    if drift is None:
                        verifier = Verifier(model, tok, config, exposures=k)
                        observations = [verifier.observe(_export(model, tok, shield, cands[t], k)) for t in truths]
                        exported = time.time() - start
                        results = verification_accuracy(verifier, observations, truths, cands)
                    else:
                        rounds = _moving_rounds(model, tok, shield, config, cands, truths, k, drift, repeat)
                        exported = time.time() - start
                        results = score_accuracy(joint_scores(rounds, cands), truths)
                    for variant, r in results.items():
                        rows.append(dict(model=model_name, arch=arch, setting=setting, task=task, batch_size=batch_size,
                                         candidates=n, exports=k, variant=variant, accuracy=r.accuracy, null=r.null,
                                         mean_rank=r.mean_rank, trials=r.trials, repeat=repeat))
                    scored = time.time() - start - exported
                    log(f"{model_name:8s} {setting:26s} {task:8s} N={n:<5d} B={batch_size} K={k} #{repeat}: "
                        + " ".join(f"{v} {r.accuracy:.3f}" for v, r in results.items())
                        + f" (null {1 / n:.3f}; exports {exported:.0f} s, scores {scored:.0f} s)")
                    save()


def _moving_rounds(model, tok, shield, config, cands, truths, k: int, drift: float, seed: int) -> list:
    """K rounds: each truth's batch exported once per round and observed by a Verifier on that round's
    model (the server knows every model it sent); between rounds every trainable parameter moves by
    ``drift`` times its RMS in a seeded random direction (the other clients' updates)."""
    gen = torch.Generator().manual_seed(seed)
    rounds = []
    for _ in range(k):
        verifier = Verifier(model, tok, config)
        rounds.append((verifier, [verifier.observe(_export(model, tok, shield, cands[t], 1)) for t in truths]))
        with torch.no_grad():
            for p in model.parameters():
                if p.requires_grad:
                    p.add_(drift * p.pow(2).mean().sqrt() * torch.randn(p.shape, generator=gen).to(p.device))
    return rounds


def _export(model, tok, shield, candidate: Candidate, k: int) -> dict:
    """The mean of K masked exports of the client's batch ``candidate``."""
    labels = None if candidate.labels is None else list(candidate.labels)
    return averaged_export(lambda: shared_gradient(model, list(candidate.texts), tok, shield=shield, labels=labels), k)


def labels(device: torch.device, chosen: dict, log, rows: list[dict], save) -> None:
    """The label attack on the encoder head: undefended and every setting, B = 1, 2, 8 (appended to ``rows``)."""
    examples = load_corpus("train")
    for setting, (config, k) in {"none K=1": (None, 1), **chosen}.items():
        for batch_size, count in ((1, 120), (2, 60), (8, 40)):
            model, tok = build("encoder")
            model.to(device)
            shield = None if config is None else aegis.protect(model, config=config)
            gain = 1.0 if shield is None else _head_rho(model, tok, shield)
            scores = {"naive": 0.0, "adaptive": 0.0}
            for i in range(count):
                batch = examples[i * batch_size : (i + 1) * batch_size]
                texts, truth = [e.text for e in batch], [LABELS.index(e.label) for e in batch]
                grads = averaged_export(lambda: shared_gradient(model, texts, tok, shield=shield, labels=truth),  # noqa: B023
                                        k)  # called at once, in this iteration
                for name, g in (("naive", 1.0), ("adaptive", gain)):
                    scores[name] += label_accuracy(label_leak(model, grads, batch_size, gain=g).labels, truth) / count
            null = label_null(len(LABELS), batch_size)
            rows.append(dict(model="encoder", setting=setting, batch_size=batch_size, exports=k, trials=count,
                             null=null, **scores))
            log(f"labels   {setting:26s} B={batch_size} K={k}: naive {scores['naive']:.3f} "
                f"adaptive {scores['adaptive']:.3f} (null {null:.3f})")
            save()


def pooled(rows: list[dict]) -> list[dict]:
    """Per setting, N and variant, the hits over every cell against 1/N: one cell of 40 trials puts a
    chance-level attacker at >= 4 hits of 1/40 (0.10) 2 % of the time, so a leak shows in the pool first.
    ``p_value``: one-sided binomial, P(>= hits | chance), hits rounded (a tie among all N candidates
    counts 1/N of a hit: a random tie-break's expectation)."""
    from scipy.stats import binom

    out = []
    for setting in dict.fromkeys(r["setting"] for r in rows):
        for n in sorted({r.get("candidates", 40) for r in rows if r["setting"] == setting}):
            for variant in VARIANTS:
                cells = [r for r in rows if r["setting"] == setting and r["variant"] == variant
                         and r.get("candidates", 40) == n]
                if not cells:
                    continue
                hits = round(sum(r["accuracy"] * r["trials"] for r in cells), 3)
                trials = sum(r["trials"] for r in cells)
                out.append(dict(setting=setting, candidates=n, variant=variant, cells=len(cells), trials=trials,
                                accuracy=hits / trials, null=1 / n, bar=1 / n + 0.05,
                                worst_cell=max(r["accuracy"] for r in cells),
                                p_value=float(binom.sf(round(hits) - 1, trials, 1 / n))))
    return out


def _head_rho(model, tok, shield) -> float:
    """The classifier's public signal weight (after the snr cap): the adaptive attacker's gain."""
    flooded = {row.name for row in shield.report().flooded}
    if "classifier.weight" not in flooded:
        return 1.0
    if shield.config.calibration is Calibration.BATCH:  # rho as configured
        return max(shield.config.treatments["head"].rho, 1e-6)
    rho, _sigma, _clip, _thr = shield.public_params()["classifier.weight"]
    return max(rho, 1e-6)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="decoder,llama,encoder")
    parser.add_argument("--trials", type=int, default=40, help="trials (exports) per cell, at most N")
    parser.add_argument("--candidates", default="40", help="comma-separated N of the 1-of-N tests, e.g. 10,40,1000")
    parser.add_argument("--batch-sizes", default="1,4", help="comma-separated client batch sizes B, e.g. 1,4,8")
    parser.add_argument("--fast-noise", action="store_true", help="keyed torch.randn instead of the cipher (CPU)")
    parser.add_argument("--skip-labels", action="store_true")
    parser.add_argument("--snr-sweep", default="", help="comma-separated rows snr caps to add as settings")
    parser.add_argument("--exposures", default="", help="comma-separated K within the presets' budgets to add")
    parser.add_argument("--repeats", type=int, default=1, help="independent runs (fresh keys) of every cell")
    parser.add_argument("--drift", type=float, default=None,
                        help="K > 1 settings only: the K exports come from K rounds of a model moving by this "
                             "share of each parameter's RMS per round, scored jointly (attacks.repeated.joint_scores)")
    parser.add_argument("--settings", default="",
                        help="comma-separated name prefixes to run (default: all), e.g. 'verification,past budget'")
    parser.add_argument("--append", action="store_true", help="merge into an existing result file in --out")
    parser.add_argument("--resume", action="store_true",
                        help="with --append: keep the file's cells and measure only the missing ones")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args()
    if args.fast_noise:
        from aegis_kernels import testing as fast_noise

        fast_noise.install()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    card = torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu"
    sizes = [int(x) for x in args.candidates.split(",")]
    batch_sizes = [int(x) for x in args.batch_sizes.split(",")]
    if min(sizes) < 2 or min(batch_sizes) < 1 or args.trials < 1 or args.repeats < 1:
        parser.error("--candidates N >= 2, --batch-sizes B >= 1, --trials >= 1 and --repeats >= 1")
    if args.drift is not None and not args.drift > 0:
        parser.error(f"--drift {args.drift}: a positive share of each parameter's RMS per round, e.g. 1e-3")
    if args.resume and not args.append:
        parser.error("--resume continues a result file: pass --append too")
    args.out.mkdir(parents=True, exist_ok=True)
    tag = "h100" if "H100" in card else "h200" if "H200" in card else "cpu"
    path = args.out / f"verification-{tag}.json"
    progress = args.out / f"verification-{tag}.log"
    progress.write_text(f"{card}\n")

    def log(line: str) -> None:
        print(line, flush=True)
        with progress.open("a") as f:
            f.write(line + "\n")

    chosen = settings(tuple(float(x) for x in args.snr_sweep.split(",") if x),
                      tuple(int(x) for x in args.exposures.split(",") if x))
    if args.settings:
        prefixes = tuple(args.settings.split(","))
        chosen = {k: v for k, v in chosen.items() if k.startswith(prefixes)}
    old = json.loads(path.read_text()) if args.append and path.exists() else {"verification": [], "labels": []}
    models = args.models.split(",")
    archs = {m: type(build(m)[0]).__name__ for m in models}  # a cell measured on another class is not done
    named = [f"{s} moving" for s, (_, k) in chosen.items() if k > 1] if args.drift is not None else list(chosen)
    measured = {(m, s, b, n) for m in models for s in named for b in batch_sizes for n in sizes}
    rows = [r for r in old["verification"]
            if (r["model"], r["setting"], r["batch_size"], r.get("candidates", 40)) not in measured
            or args.resume and r.get("arch") == archs[r["model"]]]
    done = frozenset((r["model"], r.get("arch"), r["setting"], r["batch_size"], r.get("candidates", 40), r["task"],
                      r.get("repeat", 0)) for r in rows) if args.resume else frozenset()
    label_rows = [
        r for r in old["labels"] if r["setting"] not in chosen and (r["setting"] != "none K=1" or args.skip_labels)
    ]

    def save() -> None:  # after every cell: a late failure or a time limit loses one cell at most
        tmp = path.with_suffix(".tmp")  # then renamed: a kill mid-write leaves the last complete file
        tmp.write_text(json.dumps(dict(card=card, torch=torch.__version__, fast_noise=args.fast_noise,
                                       pooled=pooled(rows), verification=rows, labels=label_rows), indent=1))
        tmp.replace(path)

    for name in models:
        verification(name, archs[name], device, args.trials, chosen, sizes, batch_sizes, log, rows, save, done,
                     args.repeats, args.drift)
    if not args.skip_labels:
        labels(device, chosen, log, label_rows, save)
    for p in pooled(rows):
        if p["variant"] == "likelihood":
            print(f"{p['setting']:28s} N={p['candidates']:<5d} pooled {p['accuracy']:.3f} over {p['trials']} trials "
                  f"(null {p['null']:.3f}, "
                  f"p = {p['p_value']:.3f}), worst cell {p['worst_cell']:.3f}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
