"""Utility against clients per round (issue 28): SmolLM2-135M-Instruct fine-tuned on the mean of N secure
FedSGD clients per round, for N up to 10 000, with (epsilon, delta) per example.

A secure FedSGD round of N clients at one global model is, in distribution, one batch of N x B examples
with clip and threshold times N and noise sigma * sqrt(N / t) (:func:`aegis.fl.secure.shortcut.shortcut_sum`; t is
the survivor pin, here ``ceil(--survivors x N)``, at least 2; N = 1 is one client's own export, t = 1). The
server steps AdamW (lr 2e-4, linear warm-up over 10 % of the rounds, then constant) on the round mean
(the sum / N; tensors the public table marks as pure noise, rho = 0, are skipped: a server knows them)
for ``--rounds`` rounds; validation perplexity every ``--eval-every`` rounds, best = early
stopping. Per preset (verification, sentences) and N, the ratio is to the undefended run at the same
examples per round, measured in the same run (undefended: the plain mean gradient of the same batches).

The round's examples. The shipped train split has 320 sentences, and N x B reaches 80 000: each round's
batch is a Poisson sample of the split at rate q = min(N x B, --max-examples) / 320 (every sentence in
independently with probability q; q = 1 would be the whole split), and its mean gradient stands for the
mean over the N x B examples of the N clients (shortcut_sum scales it by N). The cap (default 64 sentences
a round: q = 0.2 from N = 8 up) bounds the cost; above it, a larger N changes only the noise relative to the
signal, not the sampling noise of the gradient. The same seed draws the same batches for every point at
one rate (undefended included).

epsilon per example: ``--rounds`` Poisson-sampled Gaussian mechanisms at rate q composed
(:mod:`aegis.accounting`, delta 1e-5: Opacus's PRV where affordable, else the smaller of its RDP bound and
the exact unsampled composition; RDP always as the cross-check; add/remove adjacency), with the noise
multiplier z of one export of the preset's public table (the sum at the pin: n >= t survivors carry at
least the full flood; every row of a rows flood counted), the smallest over the calibrations at the start
and at every evaluation. z does not depend on N: a client's sensitivity and the sum's noise are both one
flood's; N buys signal, not privacy. Also given at the best round (the early-stopped model's rounds).

N* = the smallest N where `verification` reaches best perplexity <= 1.1x undefended.

    python benchmarks/clients_curve.py --quick                        # CPU, a tiny LLaMA, seconds (tests)
    # GPU: 8 processes sharing one H200 (19 points, cost-balanced shards; 160 rounds, not the default 320,
    # so the slowest shard ends in about 6 minutes, estimated from the frontier's SmolLM2 timings):
    for i in 0 1 2 3 4 5 6 7; do python benchmarks/clients_curve.py --device cuda --cipher --rounds 160 \
        --eval-every 10 --shard $i/8 --out /tmp/cc > /tmp/cc-$i.log 2>&1 & done; wait
    python benchmarks/clients_curve.py --merge /tmp/cc --out benchmarks/results   # JSON + PNG

CPU floods draw keyed torch.randn (:mod:`aegis_kernels.testing`: the cipher's law, no secret stream; the caller
sets AEGIS_ALLOW_FAST_NOISE=1) unless ``--cipher``; CUDA floods always run the Triton cipher (hence --cipher
on the GPU: no opt-in needed, same noise).
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from frontier import card_tag  # a sibling script: Python looks in a script's own folder first
from frontier_points import ROOT, Frontier
from torch import Tensor

from aegis import AegisConfig, ExposurePolicy, Preset, protect
from aegis.accounting import statement
from aegis.defence import LossFn
from aegis.fl.secure import SurvivorPin
from aegis.fl.secure.shortcut import shortcut_sum
from aegis_kernels import testing  # keyed randn for CPU floods (benchmarks only; opt-in by environment)

PRESETS = ("verification", "sentences")
CLIENTS = (1, 4, 16, 64, 256, 1024, 4096, 10000)
BAR = 1.1  # N*: verification's best perplexity at most this times undefended
STEP_COST = 60.0  # examples a round's fixed latency is worth (SmolLM2 on an H200: B = 8 vs 32 in the frontier)
DELTA = 1e-5


@dataclass(frozen=True)
class Alone:
    """The pin of N = 1: one client's own export with its full flood (a SurvivorPin needs t >= 2)."""

    min_survivors: int = 1


@dataclass(frozen=True)
class Point:
    """One run: a preset ("undefended" or a Preset value) at N clients per round of B examples each."""

    preset: str
    clients: int

    @property
    def key(self) -> str:
        return f"{self.preset} N={self.clients}"


def rate(clients: int, batch: int, cap: int, train: int) -> float:
    """The Poisson rate of a round's batch (module docstring)."""
    return min(clients * batch, cap, train) / train


def survivors(clients: int, fraction: float) -> int:
    return 1 if clients == 1 else max(2, math.ceil(fraction * clients))


def grid(args) -> list[Point]:
    """Undefended once per distinct rate (at its smallest N), then the presets, larger N first."""
    clients = args.clients
    seen: dict[float, int] = {}
    for n in clients:
        seen.setdefault(rate(n, args.batch, args.max_examples, args.train_size), n)
    return ([Point("undefended", n) for n in seen.values()]
            + [Point(p, n) for n in sorted(clients, reverse=True) for p in PRESETS])


def shard(points: list[Point], args, index: int, count: int) -> list[Point]:
    """Shard ``index`` of ``count`` balanced by estimated cost (longest first, each to the least loaded shard):
    a round costs its expected examples plus STEP_COST (a B = 8 step's latency, in examples) for the backward,
    and another for the shortcut's calibration on defended points."""
    def cost(p: Point) -> float:
        examples = rate(p.clients, args.batch, args.max_examples, args.train_size) * args.train_size
        return examples + STEP_COST * (1 if p.preset == "undefended" else 2)

    loads, owner = [0.0] * count, {}
    for p in sorted(points, key=cost, reverse=True):
        i = loads.index(min(loads))
        loads[i] += cost(p)
        owner[p] = i
    return [p for p in points if owner[p] == index]


def micro_loss(micro: int) -> LossFn:
    """A loss function that backpropagates the token-mean LM loss of its batch in micro-batches of ``micro``
    sentences (each weighted by its share of the predicted tokens, trimmed to its longest sentence), so any
    batch fits. It returns a leaf with no graph: shortcut_sum's ``backward()`` on it adds nothing more."""

    def loss(model, batch) -> Tensor:
        labels = batch["labels"]
        tokens = (labels[:, 1:] != -100).sum(1)
        total = int(tokens.sum())
        for i in range(0, len(labels), micro):
            part = {k: v[i : i + micro] for k, v in batch.items()}
            keep = part["attention_mask"].any(0) if "attention_mask" in part else slice(None)
            n = int(tokens[i : i + micro].sum())
            if n:
                (model(**{k: v[:, keep] for k, v in part.items()}).loss * (n / total)).backward()
        return torch.zeros((), requires_grad=True)

    return loss


def server_mean(model, batch, clients: int, t: int, config: AegisConfig | None, loss_fn: LossFn) -> dict[str, Tensor]:
    """The round's mean update: the plain mean gradient of ``batch`` (undefended, config None), or the secure
    sum of ``clients`` clients with pin t (:func:`shortcut_sum`) over their number. ``batch`` holds the round's
    examples of all clients; the other N - 1 client batches are empty (shortcut_sum only concatenates them and
    scales by their count)."""
    if config is None:
        loss_fn(model, batch)
        return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    pin = Alone() if clients == 1 else SurvivorPin(t)
    empty = {k: v[:0] for k, v in batch.items()}
    total = shortcut_sum(model, [batch] + [empty] * (clients - 1), config, pin, loss_fn=loss_fn)
    return {n: g.div_(clients) for n, g in total.items()}


class Curve:
    """The pretrained model, the tokenised train split and the server's rounds."""

    def __init__(self, args, device: torch.device):
        self.frontier = Frontier(args, device)
        if args.quick:
            self.frontier.validation = self.frontier.validation[:16]
        self.args = args
        self.data = self.frontier.batch(self.frontier.train)  # every train sentence, padded once
        self.pretrained = self.frontier.perplexity(self.frontier.model)
        self.initial: dict[str, tuple[float, set[str]]] = {}  # preset -> public() at the pretrained model

    def rows(self, index: Tensor) -> dict[str, Tensor]:
        return {k: v[index.to(v.device)] for k, v in self.data.items()}

    def config(self, preset: str) -> AegisConfig:
        # the budget counts exports per example; here the rounds are composed by the accountant instead
        return AegisConfig(preset=Preset(preset), exposure=ExposurePolicy.OFF, allow_outside_promise=True)

    def public(self, model, config: AegisConfig) -> tuple[float, set[str]]:
        """z of one export under the public calibration at ``model`` (a copy: protect freezes attention), and
        the tensors that carry signal (rho > 0): the server knows the rest are pure noise and skips them."""
        shield = protect(copy.deepcopy(model), None, config)
        shield.calibrate()
        report = shield.report()
        assert report.noise_multiplier is not None  # the public calibration has run
        return report.noise_multiplier, {r.name for r in report.rows if r.rho or r.action.startswith("CLEAN")}

    def run(self, p: Point) -> dict:
        args = self.args
        q = rate(p.clients, args.batch, args.max_examples, args.train_size)
        t = survivors(p.clients, args.survivors)
        config = None if p.preset == "undefended" else self.config(p.preset)
        model = copy.deepcopy(self.frontier.model)
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
        warm = max(1, round(0.1 * args.rounds))
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warm))
        gen = torch.Generator().manual_seed(args.seed)
        curve, zs, sizes = [(0, self.pretrained)], [], []
        if config is not None:  # at the pretrained model: the same for every N
            if p.preset not in self.initial:
                self.initial[p.preset] = self.public(model, config)
            z, signal = self.initial[p.preset]
            zs.append(z)
        start = time.perf_counter()
        for r in range(1, args.rounds + 1):
            draw = torch.rand(args.train_size, generator=gen)
            index = torch.arange(args.train_size) if q == 1.0 else torch.nonzero(draw < q).flatten()
            sizes.append(len(index))
            model.train()
            opt.zero_grad(set_to_none=True)
            update = server_mean(model, self.rows(index), p.clients, t, config, micro_loss(args.micro))
            for name, param in model.named_parameters():
                param.grad = update[name].to(param.dtype) if name in update and (config is None or name in signal) \
                    else None
            opt.step()
            sched.step()
            if r % args.eval_every == 0 or r == args.rounds:
                curve.append((r, self.frontier.perplexity(model)))
                if config is not None:
                    zs.append(self.public(model, config)[0])
        best = min(curve[1:], key=lambda c: c[1])
        row = {"key": p.key, "point": asdict(p), "survivors": t, "sample_rate": q,
               "examples_per_round": sum(sizes) / len(sizes), "best": best[1], "best_round": best[0],
               "final": curve[-1][1], "curve": curve, "train_seconds": round(time.perf_counter() - start, 1)}
        if zs:
            z = min(zs)
            row["noise_multipliers"] = zs  # at the start and at each evaluation; the statements use the smallest
            row["privacy"] = {"run": asdict(statement(z, args.rounds, sample_rate=q, delta=DELTA)),
                              "at_best": asdict(statement(z, best[0], sample_rate=q, delta=DELTA))}
        return row


def summarise(result: dict) -> None:
    """Ratios to undefended at the same rate, and N*."""
    base = {r["sample_rate"]: r["best"] for r in result["rows"] if r["point"]["preset"] == "undefended"}
    for r in result["rows"]:
        b = base.get(r["sample_rate"])
        r["ratio"] = None if b is None else r["best"] / b
    reached = sorted(r["point"]["clients"] for r in result["rows"]
                     if r["point"]["preset"] == "verification" and r["ratio"] is not None and r["ratio"] <= BAR)
    n_max = max((r["point"]["clients"] for r in result["rows"]), default=0)
    result["n_star"] = reached[0] if reached else f"not reached up to N = {n_max}"
    star = [r for r in result["rows"] if r["key"] == f"verification N={reached[0]}"] if reached else []
    result["epsilon_at_n_star"] = star[0]["privacy"]["run"]["epsilon"] if star else None


def plot(result: dict, path: Path) -> None:
    """Left: best perplexity / undefended vs N; right: epsilon per example (the run's rounds) vs N."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for preset, color in zip(PRESETS, ("tab:red", "tab:blue")):
        rows = sorted((r for r in result["rows"] if r["point"]["preset"] == preset and r["ratio"] is not None),
                      key=lambda r: r["point"]["clients"])
        xs = [r["point"]["clients"] for r in rows]
        left.plot(xs, [r["ratio"] for r in rows], marker="o", color=color, label=preset)
        right.plot(xs, [r["privacy"]["run"]["epsilon"] for r in rows], marker="o", color=color, label=preset)
    left.axhline(BAR, color="grey", linestyle="--", linewidth=0.8, label=f"{BAR}x undefended")
    for ax in (left, right):
        ax.set_xscale("log")
        ax.set_xlabel(f"clients per round N (B = {result['batch']} each)")
        ax.legend(fontsize=8)
    left.set_yscale("log")
    left.set_ylabel("best validation perplexity / undefended (same examples per round)")
    right.set_yscale("log")
    right.set_ylabel(f"epsilon per example (delta {DELTA:g}, {result['rounds']} rounds)")
    fig.suptitle(f"{result['model']} on {result['card']}: secure FedSGD rounds (shortcut), N* = {result['n_star']}",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def finish(result: dict, path: Path) -> None:
    summarise(result)
    path.write_text(json.dumps(result, indent=1) + "\n")
    plot(result, path.with_suffix(".png"))


def merge(folder: Path, out: Path) -> Path:
    shards = sorted(folder.glob("clients-curve-*.shard*.json"))
    if not shards:
        raise SystemExit(f"--merge: no clients-curve-*.shard*.json in {folder}")
    parts = [json.loads(p.read_text()) for p in shards]
    rows = {r["key"]: r for part in parts for r in part["rows"]}
    result = {**parts[0], "rows": list(rows.values()), "shards": len(parts),
              "complete": all(p["complete"] for p in parts), "elapsed_s": max(p["elapsed_s"] for p in parts)}
    out.mkdir(parents=True, exist_ok=True)
    path = out / (shards[0].name.split(".shard")[0] + ".json")
    finish(result, path)
    return path


def main(argv=None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=("smollm2", "tiny"), help="default smollm2 (quick: tiny)")
    parser.add_argument("--gguf", help="the SmolLM2 GGUF file (default: aegis.smollm2.find_gguf)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--quick", action="store_true",
                        help="a tiny LLaMA, N in 1, 4, 1 round, 16 validation sentences (the CPU test)")
    parser.add_argument("--clients", help=f"comma-separated N (default {','.join(map(str, CLIENTS))}; quick 1,4)")
    parser.add_argument("--survivors", type=float, default=1.0, help="pin t = ceil(this x N), >= 2 (default 1: t = N)")
    parser.add_argument("--batch", type=int, default=8, help="B, examples per client per round")
    parser.add_argument("--max-examples", type=int, help="cap on a round's examples (default 64; quick 16)")
    parser.add_argument("--micro", type=int, default=64, help="sentences per forward/backward (memory only)")
    parser.add_argument("--rounds", type=int, help="server steps (default 320; quick 1)")
    parser.add_argument("--eval-every", type=int, help="rounds between validation perplexities (default 20; quick 1)")
    parser.add_argument("--lr", type=float, default=2e-4)
    parser.add_argument("--tokens", type=int, default=64, help="tokens per sentence at most")
    parser.add_argument("--shard", default="0/1", help="i/n: the i-th of n cost-balanced shares of the points")
    parser.add_argument("--indices", help="comma-separated grid indices to measure (instead of --shard)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cipher", action="store_true", help="the reference cipher instead of keyed randn")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--merge", type=Path, help="merge the shard files in this folder into --out, then exit")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args(argv)
    if args.merge is not None:
        path = merge(args.merge, args.out)
        print(f"wrote {path}")
        return path
    q = args.quick
    args.model = args.model or ("tiny" if q else "smollm2")
    args.clients = [int(n) for n in args.clients.split(",")] if args.clients else list((1, 4) if q else CLIENTS)
    args.max_examples = args.max_examples or (16 if q else 64)
    args.rounds = args.rounds or (1 if q else 320)
    args.eval_every = args.eval_every or (1 if q else 20)
    if min(args.clients) < 1 or not 0.0 < args.survivors <= 1.0 or min(args.batch, args.max_examples, args.micro) < 1:
        parser.error("--clients >= 1, 0 < --survivors <= 1, --batch, --max-examples and --micro >= 1")
    index, count = (int(x) for x in args.shard.split("/"))
    if not 0 <= index < count:
        parser.error(f"--shard {args.shard}: use i/n with 0 <= i < n")
    if not args.cipher:
        testing.install()  # needs AEGIS_ALLOW_FAST_NOISE=1 from the caller
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    card = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    curve = Curve(args, device)
    args.train_size = len(curve.frontier.train)
    points = grid(args)
    chosen = [points[int(i)] for i in args.indices.split(",")] if args.indices else shard(points, args, index, count)
    if args.indices:
        index, count = int(args.indices.split(",")[0]), 2  # one shard file per process, named by its first
    args.out.mkdir(parents=True, exist_ok=True)
    name = f"clients-curve-{card_tag(card)}-{args.model}"
    path = args.out / (f"{name}.shard{index}.json" if count > 1 else f"{name}.json")
    result = {
        "model": "SmolLM2-135M-Instruct (aegis.smollm2, GGUF Q4_1 de-quantised to fp32)" if args.model == "smollm2"
        else "tiny LLaMA (aegis.models.default_decoder(arch='llama', n_layer=2))",
        "card": card, "quick": q, "rounds": args.rounds, "eval_every": args.eval_every, "batch": args.batch,
        "clients": args.clients, "survivors": f"t = ceil({args.survivors:g} N), at least 2 (N = 1: t = 1)",
        "train_size": args.train_size, "max_examples": args.max_examples, "tokens": args.tokens, "lr": args.lr,
        "sampling": f"each round a Poisson sample of the train split ({args.train_size} sentences) at rate "
                    f"q = min(N x B, {args.max_examples}) / {args.train_size}; its mean gradient stands for the "
                    "N x B examples' mean (shortcut_sum scales it by N); the same draws for every point at one rate",
        "optimizer": "server AdamW (torch defaults) on the round mean, linear warm-up over 10 % of the rounds",
        "round": "aegis.fl.secure.shortcut.shortcut_sum: rho clip_N(N G) + sigma sqrt(N / t) Z (public calibration)",
        "accountant": f"aegis.accounting: rounds x Poisson-sampled Gaussian at rate q, delta {DELTA:g}; z of one "
                      "export of the preset's public table (the smallest over the evaluations), every row counted",
        "pretrained_perplexity": curve.pretrained, "bar": BAR, "validation": len(curve.frontier.validation),
        "noise": "Triton cipher (CUDA)" if device.type == "cuda" else "keyed torch.randn (the cipher's law)"
        if testing.active() else "reference cipher (ChaCha)",
        "seed": args.seed, "rows": [], "complete": False,
        "machine": {"torch": torch.__version__, "python": platform.python_version(), "threads": args.threads},
    }
    start = time.perf_counter()
    for p in chosen:
        row = curve.run(p)
        result["rows"].append(row)
        result["elapsed_s"] = round(time.perf_counter() - start, 1)
        path.write_text(json.dumps(result, indent=1) + "\n")
        eps = row.get("privacy", {}).get("run", {}).get("epsilon")
        print(f"[{result['elapsed_s']:6.0f}s] {row['key']}: best {row['best']:.3f} (round {row['best_round']}), "
              f"final {row['final']:.3f}, q {row['sample_rate']:.3g}, epsilon {eps}", flush=True)
    result["complete"] = True
    result["elapsed_s"] = round(time.perf_counter() - start, 1)
    if count > 1:
        path.write_text(json.dumps(result, indent=1) + "\n")
    else:
        finish(result, path)
    print(f"wrote {path}")
    return path


if __name__ == "__main__":
    main()
