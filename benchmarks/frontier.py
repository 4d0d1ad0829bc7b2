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
import copy
import json
import math
import platform
import re
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "python"), str(ROOT)]

import aegis  # noqa: E402
from aegis import AegisConfig, ExposurePolicy, Treatment  # noqa: E402
from aegis.attacks import dager, embedding_norm, mlp_span, shared_gradient, spectral  # noqa: E402
from aegis.attacks.candidates import Verifier, secret_candidates, verification_accuracy  # noqa: E402
from aegis.attacks.repeated import averaged_export  # noqa: E402
from aegis.calibration import text_loss  # noqa: E402
from aegis.config import FROZEN, ROLES  # noqa: E402
from aegis.data import load_corpus  # noqa: E402
from aegis.metrics import null_gradient, rouge, token_recall  # noqa: E402

TEXT_ATTACKS = {"dager": dager, "embedding_norm": embedding_norm, "mlp_span": mlp_span, "spectral": spectral}
# role groups: roles, flood kind, the allow_clean pattern that exports the group unflooded
GROUPS = {
    "emb": (("token_embedding", "token_embedding_lora", "position_embedding", "lm_head"), "rows",
            r"embed|lm_head|wte|wpe"),
    "mlp": (("mlp",), "matrix", r"\.mlp\."),
    "norm": (("norm", "bias"), "matrix", r"norm|\.bias$"),
}
NEAR_EXACT = 1e-3  # lam of the floods standing in for clean tensors in candidate verification
# the public calibration batch: generic text the client declares public (none of it is in the corpus)
PUBLIC_TEXTS = (
    "The weather today is mild with a light breeze from the west.",
    "Please remember to bring your notes to the meeting on Monday.",
    "The library opens at nine in the morning and closes at six.",
    "She planted tomatoes and basil in the small garden behind the house.",
    "The train to the city leaves every half hour from platform two.",
    "He read the instructions twice before assembling the new shelf.",
    "Our team finished the project a week ahead of schedule.",
    "The museum has a new exhibition about the history of maps.",
)
PINS = [f"{(7919 * i + 1234) % 10000:04d}" for i in range(10000)]


@dataclass(frozen=True)
class Setting:
    """One point: a treatment per group ('frozen', 'clean' or an snr cap), batch, learning rate, and the
    exposure counts K the attacks are scored at."""

    attention: str = "frozen"  # 'frozen' or 'clean' (clean: no shield at all, every group must be clean)
    emb: str | float = "clean"
    mlp: str | float = "clean"
    norm: str | float = "clean"
    batch: int = 8
    lr: float = 2e-4
    exposures: tuple[int, ...] = (1,)
    verify: bool = False  # run candidate verification at K = 1

    @property
    def key(self) -> str:
        def show(v):
            return f"snr{v:g}" if isinstance(v, (int, float)) else v

        groups = "undefended" if self.attention == "clean" else (
            f"attn=frozen emb={show(self.emb)} mlp={show(self.mlp)} norm={show(self.norm)}")
        return f"B={self.batch} lr={self.lr:g} {groups}"

    @property
    def undefended(self) -> bool:
        return self.attention == "clean"


def config_of(s: Setting, names: Sequence[str], verification: bool = False) -> AegisConfig | None:
    """The shield's configuration for a model with parameters ``names`` (None: undefended).

    Per group: 'frozen'; 'clean' (allow_clean lists the group's parameters by exact name); 'uncapped'
    (``Treatment(kind, lam=1, rho=1)``, no snr cap); or an snr cap. ``verification``: clean groups become
    near-exact floods, which the verifier models (it reads flooded tensors only)."""
    if s.undefended and not verification:
        return None
    treatments = dict.fromkeys(ROLES, FROZEN)
    clean: list[str] = []
    groups = {"attention": (("attention",), "matrix", None)} if s.undefended else {}
    specs = {"attention": "clean", **{g: getattr(s, g) for g in GROUPS}}
    for group, (roles, kind, pattern) in {**groups, **GROUPS}.items():
        spec = specs[group]
        if spec == "frozen":
            continue
        if spec == "clean" and verification:
            t = Treatment(kind, lam=NEAR_EXACT, rho=1.0)
        elif spec in ("clean", "uncapped"):
            t = Treatment(kind, lam=1.0, rho=1.0)
            if spec == "clean":  # exported unflooded
                clean += [n for n in names if re.search(pattern, n)]  # exact names, as the policy requires
        else:
            t = Treatment(kind, lam=1.0, rho=1.0, snr=float(spec))
        treatments.update(dict.fromkeys(roles, t))
    return AegisConfig(preset=treatments, allow_clean=tuple(clean), exposure=ExposurePolicy.OFF)


def grid(quick: bool) -> list[Setting]:
    """The settings measured (module docstring); the undefended and attention-frozen controls first."""
    if quick:
        return [Setting(attention="clean", batch=1, verify=True),
                Setting(emb="frozen", mlp=1000.0, norm=1000.0, batch=1, exposures=(1, 2), verify=True),
                Setting(emb="frozen", mlp=10.0, norm=10.0, batch=2)]
    def capped(v, **kw):  # attention and embedding frozen, MLP and norms capped at v
        return Setting(emb="frozen", mlp=v, norm=v, **kw)

    # in order of priority: shards take every n-th, so a run cut short keeps the first ones of each shard.
    # Verification (minutes per point on SmolLM2) runs where marked: it is won at every trainable cap.
    return [
        Setting(attention="clean"), Setting(), Setting(emb="frozen"),
        capped(10000.0, exposures=(1, 4)), capped(3000.0, verify=True), capped(1000.0), capped(30000.0),
        capped(300.0, verify=True),
        Setting(emb=10000.0, mlp=10000.0, norm=10000.0), Setting(emb=1000.0),
        Setting(attention="clean", batch=32), capped(10000.0, batch=32),
        Setting(attention="clean", batch=1), capped(10000.0, batch=1),
        capped(100.0, verify=True), capped(10000.0, lr=5e-5), Setting(emb="frozen", mlp=10000.0),
        Setting(emb="frozen", norm=1000.0), Setting(attention="clean", lr=5e-5), capped(30.0),
        # MLP frozen too: spectral and mlp_span have nothing to read; does the embedding (tied head) train?
        Setting(mlp="frozen"), Setting(emb=10000.0, mlp="frozen", norm=10000.0),
        Setting(emb=1000.0, mlp="frozen", norm=1000.0),
    ]


class Frontier:
    """The pretrained model, its tokenizer, the data and the sizes every setting is measured with."""

    def __init__(self, args, device: torch.device):
        if args.model == "tiny":
            from aegis.models import default_decoder

            self.model, self.tok = default_decoder(arch="llama", n_layer=2)
        else:
            from aegis.smollm2 import load_smollm2

            self.model, self.tok = load_smollm2(args.gguf)
        self.model.to(device)
        self.names = [n for n, _ in self.model.named_parameters()]
        self.device, self.args = device, args
        self.train = [e.text for e in load_corpus("train")]
        self.validation = [e.text for e in load_corpus("validation")]

    def batch(self, texts) -> dict[str, torch.Tensor]:
        enc = self.tok(list(texts), padding=True, truncation=True, max_length=self.args.tokens, return_tensors="pt")
        enc = {k: enc[k].to(self.device) for k in ("input_ids", "attention_mask")}
        return {**enc, "labels": enc["input_ids"].masked_fill(enc["attention_mask"] == 0, -100)}

    @torch.no_grad()
    def perplexity(self, model) -> float:
        model.eval()
        nll, count = 0.0, 0
        for i in range(0, len(self.validation), 16):
            b = self.batch(self.validation[i : i + 16])
            n = int((b["labels"][:, 1:] != -100).sum())  # the loss is a mean over predicted tokens
            nll += float(model(**b).loss) * n
            count += n
        return math.exp(nll / count)

    def fine_tune(self, s: Setting, seed: int = 0) -> dict:
        """Validation perplexity along ``--steps`` AdamW steps on the masked gradient."""
        model = copy.deepcopy(self.model)
        config = config_of(s, self.names)
        params = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=s.lr)
        shield = None if config is None else aegis.protect(model, opt, config, self._calibration(model))
        steps, warm = self.args.steps, max(1, round(0.1 * self.args.steps))
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: min(1.0, (t + 1) / warm))
        gen = torch.Generator().manual_seed(seed)
        order: list[int] = []
        curve = [(0, self.perplexity(model))]
        start = time.perf_counter()
        for step in range(1, steps + 1):
            if len(order) < s.batch:
                order += torch.randperm(len(self.train), generator=gen).tolist()
            idx, order = order[: s.batch], order[s.batch :]
            model.train()
            opt.zero_grad(set_to_none=True)
            model(**self.batch([self.train[i] for i in idx])).loss.backward()
            if shield is not None:
                shield.mask_()
            opt.step()
            sched.step()
            if step % self.args.eval_every == 0 or step == steps:
                curve.append((step, self.perplexity(model)))
        best = min(curve[1:], key=lambda c: c[1])
        return {"best": best[1], "best_step": best[0], "final": curve[-1][1], "pretrained": curve[0][1],
                "curve": curve, "train_seconds": round(time.perf_counter() - start, 1)}

    def _calibration(self, model):
        return text_loss(model, self.tok, PUBLIC_TEXTS, shape=(8, 64))

    def attack(self, s: Setting, k: int, out: dict, save) -> None:
        """Every attack on the mean of ``k`` exports of the pretrained model, with its null, into ``out``:
        one attack at a time (cheapest first), ``save()``d after each, so a run cut short keeps the finished
        ones."""
        b = s.batch
        n = min(4, max(1, -(-self.args.attack_texts // b)))
        batches = [self.train[i * b : (i + 1) * b] for i in range(n)]
        model = copy.deepcopy(self.model)
        # the attacker knows the batch's shape (at most --tokens tokens): the decoders read their length limit
        # from max_position_embeddings (8192 for SmolLM2), and RoPE does not depend on it
        model.config.max_position_embeddings = self.args.tokens
        config = config_of(s, self.names)
        shield = None if config is None else aegis.protect(model, config=config,
                                                           calibration_loss=self._calibration(model))
        public = {} if shield is None else shield.public_params()
        exports = [averaged_export(lambda t=texts: shared_gradient(model, t, self.tok, shield=shield), k)
                   for texts in batches]
        nulls = [null_gradient(g, self.args.seed + j) for j, g in enumerate(exports)]
        for name, attack in TEXT_ATTACKS.items():
            kw = {"public": public, "exposures": k} if name == "spectral" else {}
            t0 = time.perf_counter()
            point = {"references": batches,
                     "predictions": [attack(model, g, self.tok, b, **kw) for g in exports],
                     "null_predictions": [attack(model, g, self.tok, b, **kw) for g in nulls]}
            point["seconds"] = round(time.perf_counter() - t0, 2)
            # bag of words: the share of the batch's distinct tokens recovered
            point["token_recall"] = _mean([token_recall(p, r, self.tok) for p, r in zip(point["predictions"], batches)])
            point["null_token_recall"] = _mean([token_recall(p, r, self.tok)
                                                for p, r in zip(point["null_predictions"], batches)])
            out[name] = point
            save()
        if s.verify and k == 1:
            out["verification"] = self._verify(s, k)
            save()

    def _verify(self, s: Setting, k: int) -> dict:
        """1-of-N "my pin is ____" (with B - 1 known train sentences), over ``--trials`` exports."""
        t0 = time.perf_counter()
        model = copy.deepcopy(self.model)
        config = config_of(s, self.names, verification=True)
        shield = aegis.protect(model, config=config, calibration_loss=self._calibration(model))
        n, trials = self.args.candidates, self.args.trials
        candidates = secret_candidates("my pin is {}", PINS[:n], self.train[-(s.batch - 1):] if s.batch > 1 else ())
        truths = [round(i * n / trials) for i in range(trials)]
        verifier = Verifier(model, self.tok, config, exposures=k, calibration_loss=self._calibration(model))
        obs = [verifier.observe(averaged_export(
            lambda c=candidates[t]: shared_gradient(model, list(c.texts), self.tok, shield=shield), k))
            for t in truths]
        result = verification_accuracy(verifier, obs, truths, candidates, ("likelihood",))["likelihood"]
        return {"score": result.accuracy, "null": result.null, "candidates": n, "trials": trials,
                "near_exact_groups": [g for g in ("attention", *GROUPS) if getattr(s, g) == "clean"],
                "seconds": round(time.perf_counter() - t0, 1)}

    def measure(self, s: Setting, parts: tuple[str, ...], save) -> dict:
        """The setting's row: its fine-tuning and/or its attacks, ``save()``d after each part."""
        start = time.perf_counter()
        row: dict = {"key": s.key, "setting": asdict(s), "run": self.args.label}
        if "train" in parts:
            row["perplexity"] = self.fine_tune(s)
            save(row)
        if "attack" in parts:
            row["attacks"] = {}
            for k in s.exposures:
                out = row["attacks"][f"K={k}"] = {}
                self.attack(s, k, out, lambda: save(row))
        row["seconds"] = round(time.perf_counter() - start, 1)
        save(row)
        return row


def _verification(point: dict) -> str:
    v = point.get("verification")
    return "not run" if v is None else f"{v['score']:.2f} / {v['null']:.3f}"


def _mean(xs):
    return sum(xs) / len(xs)


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
                p["score"] = _mean([rouge(x, r)["rouge1"] for x, r in zip(p["predictions"], refs)])
                p["null"] = _mean([rouge(x, r)["rouge1"] for x, r in zip(p["null_predictions"], refs)])
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
