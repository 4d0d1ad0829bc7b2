"""The privacy-utility frontier on a real pretrained LM (issue 27): SmolLM2-135M-Instruct fine-tuned by one
client stepping on its masked gradient, and every reconstruction attack on that client's exports, per setting.

Each setting fixes a treatment per role group (attention; embedding/head rows; MLP; norms and biases): frozen,
clean (exported unflooded) or flooded with a per-export signal cap ``snr`` (``Treatment(kind, lam=1, rho=1,
snr=s)``: the matched-filter signal of a row (rows) or tensor (matrix) over the per-entry noise). For each:

* utility: AdamW on the masked gradient (batch B x at most 64 tokens, pad = EOS masked with -100), linear
  warm-up over the first 10 % of the steps then constant, validation perplexity (shipped corpus, validation
  split, token-weighted) every ``--eval-every`` steps; best (early stopping) and final are reported;
* privacy, on the exports of the pretrained model (the client's first round) for train-split batches of B,
  for each exposure count K (the mean of K exports of one batch): ``dager``, ``embedding_norm`` (bag of
  words: ROUGE-1 and token recall), ``mlp_span``, ``spectral`` (full vocabulary, given the public noise levels
  and K), each with its null (the same attack on a random gradient of matched per-tensor norms); and 1-of-40
  candidate verification ("my pin is ____" batched with B - 1 known sentences; null 1/40). Verification
  models only flooded tensors, so clean groups (and the undefended export) are measured there as near-exact
  floods (lam 1e-3): the positive control.

The undefended and attention-frozen settings are the positive controls, measured in the same run.

    python benchmarks/frontier.py --model tiny --quick                 # CPU, a tiny LLaMA, seconds (tests)
    python benchmarks/frontier.py --device cuda --shard 0/6 --out DIR   # one of 6 processes sharing a GPU
    python benchmarks/frontier.py --merge DIR                           # the shards -> one JSON (no ROUGE)
    python benchmarks/frontier.py --rescore benchmarks/results/frontier-h100-smollm2.json   # ROUGE + PNG

The noise is keyed torch.randn (``aegis_kernels.testing``: the cipher's law, no secret stream; the caller sets
AEGIS_ALLOW_FAST_NOISE=1) unless ``--cipher``.
"""
from __future__ import annotations

import argparse
import json
import platform
import time
from dataclasses import replace
from pathlib import Path

import torch
from frontier_points import GROUPS, ROOT, TEXT_ATTACKS, Frontier, grid, mean

from aegis.metrics import rouge  # noqa: E402


def _verification(point: dict) -> str:
    v = point.get("verification")
    return "not run" if v is None else f"{v['score']:.2f} / {v['null']:.3f}"


def score(rows: list[dict]) -> bool:
    """ROUGE-1 F (DAGER's greedy alignment, mean over batches) of every text attack and its null; False where
    rouge-score is not installed (the GPU machine): score later with --rescore."""
    try:
        import rouge_score  # noqa: F401
    except ImportError:
        return False
    for row in rows:
        for point in row.get("attacks", {}).values():
            for name in TEXT_ATTACKS:
                if name not in point:  # a run cut short
                    continue
                p = point[name]
                refs = p["references"]
                p["score"] = mean([rouge(x, r)["rouge1"] for x, r in zip(p["predictions"], refs)])
                p["null"] = mean([rouge(x, r)["rouge1"] for x, r in zip(p["null_predictions"], refs)])
    return True


def card_tag(card: str) -> str:
    return "h100" if "H100" in card else "h200" if "H200" in card else "cpu" if card == "cpu" else "gpu"


def table(rows: list[dict]) -> str:
    """Markdown table: one line per setting and K."""
    base = {r["setting"]["batch"]: r["perplexity"]["best"] for r in rows
            if r["setting"]["attention"] == "clean" and r["setting"]["lr"] == 2e-4 and "perplexity" in r}
    head = ("| setting | best ppl (x undefended) | final | K | DAGER | emb. bag (recall) | mlp_span "
            "| spectral (recall) "
            "| verif. 1-of-40 |\n|---|---|---|---|---|---|---|---|---|")
    lines = [head]
    for r in rows:
        b = r["setting"]["batch"]
        ppl = r.get("perplexity")
        best = "not run" if ppl is None else f"{ppl['best']:.2f}" + (f" ({ppl['best'] / base[b]:.2f}x)" if b in base
                                                                    else "")
        final = "" if ppl is None else f"{ppl['final']:.2f}"
        for k, a in (r.get("attacks") or {"K=-": None}).items():
            if a is None:
                lines.append(f"| {r['key']} | {best} | {final} | | not run | | | | |")
                continue

            def cell(name, a=a, recall=False):
                p = a.get(name)
                if p is None:
                    return "not run"
                got = f"{p['score']:.2f} / {p['null']:.2f}" if "score" in p else "unscored"
                return got + (f" ({p['token_recall']:.2f} / {p['null_token_recall']:.2f})" if recall else "")

            lines.append(f"| {r['key']} | {best} | {final} | {k[2:]} | {cell('dager')} "
                         f"| {cell('embedding_norm', recall=True)} "
                         f"| {cell('mlp_span')} | {cell('spectral', recall=True)} "
                         f"| {_verification(a)} |")
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    """Left: best validation perplexity / undefended against the MLP + norm cap (attention and embedding
    frozen), per batch, with the controls as lines. Right: each attack's score (token recall for the text
    attacks, accuracy for verification) and its null against that ratio, at every attacked B = 8 point."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["rows"] if "perplexity" in r and r["setting"]["lr"] == 2e-4]
    base = {r["setting"]["batch"]: r["perplexity"]["best"] for r in rows if r["setting"]["attention"] == "clean"}
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for b, color in ((1, "tab:green"), (8, "tab:blue"), (32, "tab:purple")):
        pts = sorted((float(r["setting"]["mlp"]), r["perplexity"]["best"] / base[b]) for r in rows
                     if b in base and r["setting"]["batch"] == b and r["setting"]["emb"] == "frozen"
                     and r["setting"]["mlp"] == r["setting"]["norm"] and not isinstance(r["setting"]["mlp"], str))
        if pts:
            left.plot(*zip(*pts), marker="o", color=color, label=f"B = {b}: attention + embedding frozen, "
                                                                   "MLP + norms capped")
    for r in rows:
        st = r["setting"]
        if st["batch"] == 8 and st["attention"] == "frozen" and all(st[g] in ("clean", "uncapped", "frozen")
                                                                    for g in GROUPS):
            left.axhline(r["perplexity"]["best"] / base[8], color="grey", linestyle=":", linewidth=0.8)
            left.annotate(r["key"].split(" ", 2)[-1], (1e1, r["perplexity"]["best"] / base[8]), fontsize=6)
    left.axhline(1.5, color="red", linestyle="--", linewidth=0.8)
    left.axhline(1.25, color="orange", linestyle="--", linewidth=0.8)
    left.set_xscale("log")
    left.set_yscale("log")
    left.set_xlabel("per-export signal cap snr of every MLP and norm tensor")
    left.set_ylabel("best validation perplexity / undefended (same B)")
    left.legend(fontsize=7)
    attacks = [*TEXT_ATTACKS, "verification"]
    attacked = [r for r in rows if r["setting"]["batch"] == 8 and "K=1" in r.get("attacks", {}) and 8 in base]
    for n, name in enumerate(attacks):
        xs, ys, nulls = [], [], []
        for r in attacked:
            point = r["attacks"]["K=1"].get(name)
            if point is None:
                continue
            key = "score" if name == "verification" else "token_recall"
            xs.append(r["perplexity"]["best"] / base[8] * (1 + 0.01 * n))
            ys.append(point[key])
            nulls.append(point["null" if name == "verification" else "null_token_recall"])
        right.scatter(xs, ys, label=name, s=25)
        right.scatter(xs, nulls, marker="_", color="grey")
    right.axvline(1.5, color="red", linestyle="--", linewidth=0.8)
    right.axvline(1.25, color="orange", linestyle="--", linewidth=0.8)
    right.set_xlabel("best validation perplexity / undefended (B = 8)")
    right.set_ylabel("token recall (text attacks) / 1-of-40 accuracy; grey: null")
    right.set_ylim(-0.03, 1.05)
    right.legend(fontsize=7)
    fig.suptitle(f"{result['model']} on {result['card']}: {result['steps']} AdamW steps, lr 2e-4, K = 1", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def finish(result: dict, path: Path) -> None:
    """Score (where rouge-score is installed), write the JSON, and the PNG once scored."""
    scored = score(result["rows"])
    result["scored"] = scored
    if scored:
        result["table"] = table(result["rows"])
    path.write_text(json.dumps(result, indent=1) + "\n")
    if scored:
        plot(result, path.with_suffix(".png"))


def merge(folder: Path, primary: str, base: Path | None = None) -> Path:
    """One result from the shard files in ``folder`` and, if given, the merged result ``base`` (several runs:
    ``label``s). Per setting: the perplexity of run ``primary`` (where the baselines ran too) and the other
    runs' for comparison; per exposure count K, the attacks of run ``primary`` if it measured them, else of
    the last file that did."""
    shards = sorted(folder.glob("frontier-*.shard*.json"))
    if not shards:
        raise SystemExit(f"--merge: no frontier-*.shard*.json in {folder}")
    parts = [json.loads(p.read_text()) for p in shards]
    if base is not None:  # an earlier merged result: its rows are one more part (their runs keep their labels)
        parts.insert(0, json.loads(base.read_text()))
    order = {s.key: i for i, s in enumerate(grid(parts[0]["quick"]))}
    found: dict[str, list[dict]] = {}
    for part in parts:
        for r in part["rows"]:
            if "run" not in r and "perplexity_run" in r:  # a merged row: split back into its runs
                found.setdefault(r["key"], []).append({**r, "run": r["perplexity_run"], "attacks": {}})
                found[r["key"]] += [{"key": r["key"], "setting": r["setting"], "run": run, "perplexity": p}
                                    for run, p in r.get("perplexity_other_runs", {}).items()]
                for k, point in r.get("attacks", {}).items():
                    for name, p in point.items():
                        run = p.get("run", r.get("attacks_run", ""))
                        found[r["key"]].append({"key": r["key"], "setting": r["setting"], "run": run,
                                                "attacks": {k: {name: p}}})
                continue
            found.setdefault(r["key"], []).append(r)
    rows = []
    for key in sorted(found, key=lambda k: order.get(k, len(order))):
        runs = found[key]
        row = {"key": key, "setting": runs[0]["setting"]}
        trained = {r.get("run", ""): r["perplexity"] for r in runs if "perplexity" in r}
        if trained:
            label = primary if primary in trained else sorted(trained)[-1]
            row |= {"perplexity": trained[label], "perplexity_run": label,
                    "perplexity_other_runs": {k: {"best": v["best"], "final": v["final"]}
                                              for k, v in trained.items() if k != label}}
        attacks: dict = {}
        for r in sorted((r for r in runs if r.get("attacks")), key=lambda r: r.get("run", "") == primary):
            for k, point in r["attacks"].items():  # per K and attack: run ``primary`` wins, then the later file
                for name, p in point.items():
                    attacks.setdefault(k, {})[name] = {**p, "run": p.get("run", r.get("run", ""))}
        if attacks:
            row |= {"attacks": dict(sorted(attacks.items(), key=lambda kv: int(kv[0][2:]))),
                    "attacks_run": sorted({p["run"] for point in attacks.values() for p in point.values()})}
        rows.append(row)
    noise: dict[str, str] = {}
    for part in parts:  # which noise each run's exports carried
        if isinstance(part["noise"], dict):
            noise |= part["noise"]
        else:
            for run in part.get("runs") or sorted({r.get("run", "") for r in part["rows"]}):
                noise[run] = part["noise"]
    result = {**parts[0], "rows": rows, "shards": len(parts), "noise": noise,
              "runs": sorted({r.get("run", "") for rs in found.values() for r in rs}),
              "complete": all(p["complete"] for p in parts), "elapsed_s": sum(p.get("elapsed_s", 0) for p in parts)}
    path = base or folder / (shards[0].name.split(".shard")[0] + ".json")
    finish(result, path)
    return path


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=("smollm2", "tiny"), default="smollm2")
    parser.add_argument("--gguf", help="the SmolLM2 GGUF file (default: aegis.smollm2.find_gguf)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--quick", action="store_true", help="3 settings, few steps (the CPU test)")
    parser.add_argument("--steps", type=int, help="optimizer steps per setting (default 320; quick 4)")
    parser.add_argument("--eval-every", type=int, help="steps between validation perplexities (default 20; quick 2)")
    parser.add_argument("--tokens", type=int, default=64, help="tokens per sentence at most")
    parser.add_argument("--attack-texts", type=int, help="texts attacked per K (batches of B, 4 at most; default 8)")
    parser.add_argument("--candidates", type=int, help="N of the 1-of-N verification (default 40; quick 4)")
    parser.add_argument("--trials", type=int, help="verification trials (default 10; quick 2)")
    parser.add_argument("--shard", default="0/1", help="i/n: measure every n-th setting from the i-th")
    parser.add_argument("--indices", help="comma-separated grid indices to measure (instead of --shard)")
    parser.add_argument("--only", choices=("train", "attack"), help="measure only the fine-tuning or the attacks")
    parser.add_argument("--label", default="", help="a name for this run, kept in each row (merged runs)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cipher", action="store_true", help="the reference cipher instead of keyed randn")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--exposures", help="comma-separated K: the exposure counts attacked (instead of the grid's)")
    parser.add_argument("--merge", type=Path, help="merge the shard files in this folder, then exit")
    parser.add_argument("--into", type=Path, help="with --merge: fold the shards into this merged result file")
    parser.add_argument("--rescore", type=Path, help="score (ROUGE) and plot a merged result file, then exit")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args(argv)
    if args.merge is not None:
        print(f"wrote {merge(args.merge, args.label, args.into)}")
        return
    if args.rescore is not None:
        result = json.loads(args.rescore.read_text())
        finish(result, args.rescore)
        print(f"scored={result['scored']}: {args.rescore}")
        return
    q = args.quick
    args.steps = args.steps or (4 if q else 320)
    args.eval_every = args.eval_every or (2 if q else 20)
    args.attack_texts = args.attack_texts or (2 if q else 8)
    args.candidates = args.candidates or (4 if q else 40)
    args.trials = args.trials or (2 if q else 10)
    index, count = (int(x) for x in args.shard.split("/"))
    if not 0 <= index < count:
        parser.error(f"--shard {args.shard}: use i/n with 0 <= i < n")
    if not args.cipher:
        from aegis_kernels import testing as fast_noise

        fast_noise.install()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    card = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    settings = grid(q)[index::count]
    if args.indices:
        settings = [grid(q)[int(i)] for i in args.indices.split(",")]
        index, count = int(args.indices.split(",")[0]), 2  # one shard file per process, named by its first
        name_tag = f"-{args.only or 'all'}{args.indices.replace(',', '_')}"
    else:
        name_tag = ""
    if args.exposures:
        ks = tuple(int(k) for k in args.exposures.split(","))
        if min(ks) < 1:
            parser.error(f"--exposures {args.exposures}: every K must be >= 1")
        settings = [replace(s, exposures=ks) for s in settings]
        name_tag += f"-K{args.exposures.replace(',', '_')}"
        count = max(count, 2)
    parts = ("train", "attack") if args.only is None else (args.only,)
    args.out.mkdir(parents=True, exist_ok=True)
    name = f"frontier-{card_tag(card)}-{args.model}"
    path = args.out / (f"{name}.shard{index}{name_tag}.json" if count > 1 else f"{name}.json")
    frontier = Frontier(args, device)
    result = {
        "model": "SmolLM2-135M-Instruct (aegis.smollm2, GGUF Q4_1 de-quantised to fp32)" if args.model == "smollm2"
        else "tiny LLaMA (aegis.models.default_decoder(arch='llama', n_layer=2))",
        "card": card, "quick": q, "steps": args.steps, "eval_every": args.eval_every, "tokens": args.tokens,
        "optimizer": "AdamW (torch defaults), linear warm-up over 10 % of the steps, then constant",
        "data": "aegis.data shipped corpus: train split (training, attacked batches), validation split (perplexity)",
        "attacked_model": "the pretrained model (the client's first export)",
        "attack_texts": args.attack_texts, "candidates": args.candidates, "trials": args.trials,
        "noise": "reference cipher" if args.cipher else "keyed torch.randn (the cipher's law)",
        "calibration": "public: text_loss on 8 generic public sentences, shape (8, 64)",
        "metric": {a: "rouge1 F (greedy alignment)" for a in TEXT_ATTACKS}
        | {"embedding_norm_token_recall": "share of the batch's distinct token ids in the recovered bag",
           "verification": "1-of-N accuracy, likelihood variant; null 1/N"},
        "seed": args.seed, "rows": [], "complete": False,
        "machine": {"torch": torch.__version__, "python": platform.python_version(), "threads": args.threads},
    }
    start = time.perf_counter()

    def save(row: dict) -> None:
        if not result["rows"] or result["rows"][-1] is not row:
            result["rows"].append(row)
        result["elapsed_s"] = round(time.perf_counter() - start, 1)
        path.write_text(json.dumps(result, indent=1) + "\n")

    for s in settings:
        row = frontier.measure(s, parts, save)
        p = row.get("perplexity")
        ppl = f"ppl best {p['best']:.2f} final {p['final']:.2f} ({p['train_seconds']} s), " if p else ""
        print(f"[{result['elapsed_s']:6.0f}s] {row['key']}: {ppl}{row['seconds']} s in all", flush=True)
    result["complete"] = True
    result["elapsed_s"] = round(time.perf_counter() - start, 1)
    if count > 1:
        path.write_text(json.dumps(result, indent=1) + "\n")
    else:
        finish(result, path)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
