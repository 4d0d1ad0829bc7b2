"""The audit's ``labels`` row: the label attack (``aegis.attacks.labels``) on enough exports to decide.

The federated rounds export a handful of batches, too few to tell a label attack from chance. The server
holds the attacked model, so the row also attacks fresh exports: batches of B = 1, 2 and 8 sentences no
client trains on (:data:`LABEL_BATCHES` of each), each exported K times through the defence at the first
attacked round's global model, K = the defence's exposure budget (``AegisConfig.exposures``, 1 for a
baseline), the attack reading the mean of the K exports (the noise averages as sqrt(K): the strongest use of
what the promise allows). It decides with a permutation test (:func:`aegis.attacks.labels.label_test`) per
variant — a batch size, and at B > 1 the naive and the adaptive gain (the head's public rho) — with
Bonferroni over the variants. The row reports the variant the verdict rests on: it leaks when its accuracy
exceeds its chance level by more than the margin *and* the adjusted p-value is below ``ALPHA``.

Sample size: a preset's head flood exports rho * clip(G) by design, capped at a small snr, so its excess over
chance is small but not zero (B = 2, one export: 0.004 ± 0.001, measured over 40 000 batches). The permutation
test's null is "no signal at all", so it is the margin that separates a leak from that designed trace, and
the margin must be many standard errors of the accuracy: with 160 batches at B = 2 it was 2.4, and chance
alone put a row above it with p < ALPHA in about 1 % of runs. :data:`LABEL_BATCHES` puts it at >= 4 standard
errors at every batch size; when the fresh sentences run out, later batches are drawn from reshuffled
passes over them (a sentence recurs across batches, never within one; each batch is attacked on its own).

Chance level: the same guesses scored against batches they were not made from (``LabelTest.null``), i.e.
the accuracy of this very attack on this defence's exports when they carry nothing of the labels. Uniform
guessing (``label_null``) is not it: the attack's counts rarely repeat a class, which scores higher at B > 1.

Cost: only the head's gradient is read, and it is ``(1/B) Σ_b (p_b − y_b) h_bᵀ`` (and ``p − y`` for the
bias), a function of the head's input ``h_b`` per example. The body runs once per attacked model over the
fresh sentences (:func:`head_features`); each export then runs the defence's own code on a client copy of
the model whose only trainable tensors are the head's (:func:`head_defence`). That is the defence's export
exactly for per-tensor defences (AEGIS's calibration and flood are per tensor, so are the Gaussian noise
and pruning baselines); Soteria leaves the head unchanged; DP-SGD's per-example clip is computed on the
head's norm alone, at most the whole gradient's, so its row is an upper bound of what the head carries
(``AttackRecord.upper_bound``: above the bar it is suspect, never a leak).
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import random
import time
from collections import OrderedDict
from collections.abc import Sequence

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from ..attacks.labels import (
    LabelTest,
    find_head,
    infer_labels,
    infer_many,
    label_accuracy,
    label_null,
    label_test,
)
from ..baselines import make_defence
from ..data import Example
from ..defence import Aegis, Defence, NoDefence
from ..exposure import ExposurePolicy
from ..registry import DefenceKind, DefenceSpec
from .attack_base import COST, AuditAttack, ModelContext
from .records import ALPHA, MARGIN, AttackRecord, NullBaseline

# batch size -> fresh batches per defence: one batch's accuracy has a standard deviation of ~0.43 / 0.26 / 0.12
# at B = 1 / 2 / 8 (measured on the audit's encoder), so the accuracy's standard error is ~0.012 / 0.010 / 0.010
# and the 0.05 margin is >= 4 of them (chance passes it with probability < 1e-4 per variant)
LABEL_BATCHES = {1: 1280, 2: 640, 8: 160}
PERMUTATIONS = 9999  # p-values resolve down to 1e-4, below ALPHA after Bonferroni over the variants
_FEATURE_CHUNK = 32
_FEATURES: OrderedDict[tuple, tuple[Tensor, Tensor]] = OrderedDict()  # the last two attacked models' features


def _digest(model: nn.Module) -> str:
    h = hashlib.sha1()
    for name, p in model.named_parameters():
        h.update(name.encode())
        h.update(p.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


@torch.no_grad()
def head_features(model: nn.Module, build, examples: Sequence[Example]) -> tuple[Tensor, Tensor]:
    """(the head's input per example (n, d), the labels (n,)) at ``model`` in eval mode, cached per model
    state and example set (the body is the costly part; every defence of the audit reads the same model)."""
    key = (_digest(model), tuple(e.text for e in examples), tuple(e.label for e in examples))
    if key in _FEATURES:
        _FEATURES.move_to_end(key)
        return _FEATURES[key]
    head = find_head(model)
    seen: list[Tensor] = []
    handle = head.module.register_forward_hook(lambda _m, args, _out: seen.append(args[0].detach().float()))
    was = model.training
    model.eval()
    labels = []
    try:
        for start in range(0, len(examples), _FEATURE_CHUNK):
            batch = build(examples[start : start + _FEATURE_CHUNK])
            labels.append(batch.pop("labels"))
            model(**batch)
    finally:
        handle.remove()
        model.train(was)
    features = torch.cat(seen)
    if features.dim() != 2 or features.shape[0] != len(examples):
        raise ValueError(
            f"the head {head.path!r} reads {tuple(features.shape)} for {len(examples)} examples: the label "
            "attack's fresh exports need one input vector per example (a pooled head); leave labels out of --attacks"
        )
    _FEATURES[key] = (features, torch.cat(labels))
    while len(_FEATURES) > 2:
        _FEATURES.popitem(last=False)
    return _FEATURES[key]


def head_defence(defence: DefenceSpec) -> tuple[Defence, str, bool]:
    """The defence to run on the head-only client, what the row must say about it, and whether the exports
    are an upper bound of the real ones (then the row cannot establish a leak)."""
    if defence.aegis is not None:
        # the head-only client runs no token through the model, so an exposure tracker has nothing to count
        # (and would write its state at every export): the K exports per batch are set by the caller
        return Aegis(dataclasses.replace(defence.aegis, exposure=ExposurePolicy.OFF)), "", False
    if defence.kind is DefenceKind.SOTERIA:
        return NoDefence(), "soteria prunes the first MLP layer's gradient only: the head's passes unchanged", False
    made = make_defence(defence)
    if defence.kind is DefenceKind.DP_SGD:
        return made, "DP-SGD clipped on the head's per-example norm alone: an upper bound of the head's signal", True
    return made, "", False


def head_client(model: nn.Module) -> nn.Module:
    """A client copy of ``model`` whose only trainable tensors are the classification head's."""
    client = copy.deepcopy(model).eval()
    head = find_head(client)
    names = set(head.weight + head.bias)
    for name, p in client.named_parameters():
        p.requires_grad_(name in names)
        p.grad = None
    return client


def public_gain(defence: Defence, model: nn.Module) -> float:
    """The factor the defence is publicly known to scale the head weight's gradient by (Kerckhoffs): an AEGIS
    flood's rho after its SNR cap; 1 for anything else."""
    if not isinstance(defence, Aegis) or defence.shield is None:
        return 1.0
    names = find_head(model).weight
    from ..config import Calibration

    if defence.config.calibration is Calibration.PUBLIC:
        params = defence.shield.public_params()
        rho = next((params[n][0] for n in names if n in params), 1.0)
    else:
        rho = next((p.treatment.rho for p in defence.shield.plans if p.name in names and p.flooded), 1.0)
    return float(rho) if rho > 0 else 1.0


def fresh_batches(ctx: ModelContext, sizes: dict[int, int]) -> tuple[list[Example], dict[int, list[list[int]]]]:
    """Sentences no client trains on (seeded order) and, per batch size, the batches as index lists into them:
    consecutive slices of the seeded order, then of seeded reshuffles of it when one pass does not hold ``n``
    batches (a sentence recurs across batches, never within one). Sizes with fewer than 2 batches are left out."""
    pool = list(ctx.decoys)
    rng = random.Random(ctx.config.seed * 1000 + 7)
    rng.shuffle(pool)
    batches: dict[int, list[list[int]]] = {}
    for b, n in sizes.items():
        per_pass = len(pool) // b
        if per_pass == 0 or len(pool) < 2:  # one sentence makes no two different batches
            continue
        order, out = list(range(len(pool))), list[list[int]]()
        while len(out) < n:
            out += [order[i * b : (i + 1) * b] for i in range(min(per_pass, n - len(out)))]
            order = rng.sample(range(len(pool)), len(pool))
        if len(out) >= 2:
            batches[b] = out
    used = max((max(i for idx in v for i in idx) + 1 for v in batches.values()), default=0)
    return pool[:used], batches


def clean_head_gradient(head, features: Tensor, labels: Tensor) -> dict[str, Tensor]:
    """The undefended gradient of the head's tensors (every alias) for one batch, from its cached inputs."""
    weight = head.module.weight.detach().clone().requires_grad_()
    bias = None if head.module.bias is None else head.module.bias.detach().clone().requires_grad_()
    with torch.enable_grad():
        loss = F.cross_entropy(F.linear(features, weight, bias), labels)
        grads = torch.autograd.grad(loss, [weight] + ([bias] if bias is not None else []))
    out = {n: grads[0] for n in head.weight}
    if bias is not None:
        out.update({n: grads[1] for n in head.bias})
    return out


def _loss(head: nn.Linear):
    """The model's own classification loss (mean cross-entropy) from the cached head inputs."""
    return lambda _model, batch: F.cross_entropy(head(batch["features"]), batch["labels"])


def _variants(size: int, gain: float) -> list[tuple[str, float]]:
    """(name, gain) of the attack variants at one batch size: the naive counts, and at B > 1 the counts with
    the public gain undone (B = 1 reads the argmin, which no positive gain changes)."""
    if size == 1 or gain == 1.0:
        return [(f"B={size}", 1.0)]
    return [(f"B={size}", 1.0), (f"B={size} gain {gain:.3g}", gain)]


def exposures(defence: DefenceSpec) -> int:
    """K: how many exports of one batch the defence's promise covers (its exposure budget; 1 for a baseline)."""
    return int(defence.aegis.exposures) if defence.aegis is not None else 1


def evaluate(
    ctx: ModelContext, defence: DefenceSpec, model: nn.Module, sizes: dict[int, int], seed: int, k: int = 1
) -> tuple[dict[str, LabelTest], float, str, bool]:
    """Per variant, the label attack over fresh batches of ``defence`` at ``model``, each exported ``k`` times
    and read from the mean of its exports, against its chance level; the public gain used, the defence's caveat
    and whether the exports bound the real ones from above."""
    if k < 1:
        raise ValueError(f"k={k}: exports per batch must be >= 1")
    examples, batches = fresh_batches(ctx, sizes)
    if not batches:
        raise ValueError(
            f"--dataset: {len(ctx.decoys)} sentences outside the clients' batches, and the label attack exports at "
            "least 2 fresh ones: use a larger dataset or fewer --clients / --rounds, or leave labels out of --attacks"
        )
    features, labels = head_features(model, ctx.build, examples)
    client = head_client(model)
    guard, caveat, bound = head_defence(defence)
    guard.attach(client)
    head = find_head(client).module
    gain = public_gain(guard, client)
    loss = _loss(head)
    tests: dict[str, LabelTest] = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # head-sized tensors: a thread pool's synchronisation costs more than the work
    try:
        for b, index_lists in batches.items():
            exports, truths = [], []
            for idx in index_lists:
                batch = {"features": features[idx], "labels": labels[idx]}
                shared = [guard.step(batch, loss)[1] for _ in range(k)]
                exports.append({n: torch.stack([s[n] for s in shared]).mean(0) for n in shared[0]})
                truths.append(labels[idx].tolist())
            for name, g in _variants(b, gain):
                preds = infer_many(model, exports, b, gain=g)
                tests[name] = label_test(preds, truths, head.out_features, permutations=PERMUTATIONS, seed=seed)
    finally:
        torch.set_num_threads(threads)
        guard.detach()
    return tests, gain, caveat, bound


def verdict_variant(tests: dict[str, LabelTest]) -> tuple[str, float]:
    """The variant the row reports and its Bonferroni-adjusted p: the most-above-chance variant among those
    that leak (above the margin, adjusted p < ALPHA), else among those above the margin, else the first
    (B = 1, whose chance level is the null row's)."""
    m = len(tests)

    def adjusted(v: str) -> float:
        return min(1.0, m * tests[v].p_value)

    def excess(v: str) -> float:
        return tests[v].accuracy - tests[v].null

    above = [v for v in tests if excess(v) > MARGIN]
    leaking = [v for v in above if adjusted(v) < ALPHA]
    best = max(leaking or above, key=excess) if above else next(iter(tests))
    return best, adjusted(best)


class LabelAttack(AuditAttack):
    name, metric, unit = "labels", "accuracy", "label"

    def __init__(self, batches: dict[int, int] | None = None) -> None:
        self.batches = dict(LABEL_BATCHES if batches is None else batches)

    def applies(self, kind, defence):
        return kind == "encoder"

    def units(self, config, targets):
        return sum(self.batches.values()) * COST["export"]

    def null(self, ctx, first):
        """The attack on no-signal exports (each fresh batch's head gradient replaced by a Gaussian of matched
        per-tensor norms), its guesses scored against the other batches, at every batch size."""
        from ..metrics import null_gradient

        examples, batches = fresh_batches(ctx, self.batches)
        features, labels = head_features(ctx.model, ctx.build, examples)
        head = find_head(ctx.model)
        parts = []
        for b, index_lists in batches.items():
            preds, truths = [], []
            for i, idx in enumerate(index_lists):
                clean = clean_head_gradient(head, features[idx], labels[idx])
                preds.append(infer_labels(ctx.model, null_gradient(clean, seed=i), b))
                truths.append(labels[idx].tolist())
            test = label_test(preds, truths, head.num_labels, permutations=1, seed=ctx.config.seed)
            parts.append((b, test))
        uniform = "/".join(f"{label_null(head.num_labels, b):.2f}" for b, _ in parts)
        return NullBaseline(
            ctx.kind,
            self.name,
            round(parts[0][1].null, 4),
            how=(
                "the attack on a Gaussian head gradient of matched norms, scored against the batches its guesses "
                f"were not made from, B = {'/'.join(str(b) for b, _ in parts)}: "
                f"{'/'.join(f'{t.null:.2f}' for _, t in parts)} (uniform guessing {uniform}); each row is "
                "tested against its own guesses' chance level"
            ),
        )

    def run(self, ctx, defence, targets, models, null, tick):
        t0 = time.perf_counter()
        k = exposures(defence)
        tests, gain, caveat, bound = evaluate(ctx, defence, models[0], self.batches, ctx.config.seed, k)
        tick(self.units(ctx.config, len(targets)))
        best, p = verdict_variant(tests)
        chosen = tests[best]
        per = "; ".join(
            f"{v} {t.accuracy:.2f} (chance {t.null:.2f}, p {t.p_value:.2g}, n {t.n})" for v, t in tests.items()
        )
        captured = [
            label_accuracy(
                infer_labels(models[t.server_round - 1], t.grads, len(t.references), gain=gain),
                t.batch["labels"].tolist(),
            )
            for t in targets
        ]
        each = f", {k} exports each (their mean attacked)" if k > 1 else ""
        note = (
            f"rests on {best}: {chosen.n} fresh batches{each} at the attacked model, permutation p {p:.2g} "
            f"(Bonferroni over {len(tests)} variant{'s' if len(tests) > 1 else ''}); {per}"
        )
        if captured:
            note += f"; the rounds' {len(captured)} gradients: {sum(captured) / len(captured):.2f}"
        if caveat:
            note += f"; {caveat}"
        return AttackRecord(
            ctx.kind,
            defence.name,
            self.name,
            "accuracy",
            round(chosen.accuracy, 4),
            round(chosen.null, 4),
            chosen.n,
            round(time.perf_counter() - t0, 2),
            variants={v: round(t.accuracy, 4) for v, t in tests.items()},
            note=note,
            exposures=k,
            p_value=round(p, 6),
            upper_bound=bound,
        ), []
