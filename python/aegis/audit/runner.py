"""The main job: federate -> attack -> score, defence by defence, over typed records.

For each model (the embedded decoder and encoder unless named otherwise): the null baseline of every
attack is computed first, on the clean gradient of client 0's first batch (so no row waits for it);
then, for each defence, the clients run FedSGD rounds through Flower's Message API
(``aegis.fl.run_rounds``), the honest-but-curious server keeps every gradient it receives, the attacks
read those of the first ``attack_rounds`` rounds (all with 0) with the server's copy of that round's
global model, and utility is the global model's validation perplexity (decoder) or accuracy and
macro-F1 (encoder) after the last round.

A (model, defence) row enters the report whole, with its verdict, and the report so far goes to ``sink``
(the CLI writes it to disk): an interrupted or failed run keeps every finished row, and ``resume=`` runs
only the rows an earlier report lacks. Each row draws from a seed of its own, so it does not depend on
the rows that ran before it.
"""

from __future__ import annotations

import contextlib
import random
import time
import warnings
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from ..data import Example
from ..errors import UsageError
from ..harness.evaluate import chance_accuracy, metric_of
from ..harness.evaluate import evaluator as shared_evaluator
from ..registry import DefenceSpec
from . import attacks as audit_attacks
from .attacks import COST, MAX_LENGTH, ModelContext, Target, server_copy
from .costs import Stage, StageCosts
from .dataset import AuditData, load
from .options import EMBEDDED_DECODERS, AuditConfig, resolve_defence
from .progress import Progress
from .records import AuditReport, RoundsRecord, UtilityRecord, verdicts

# -- models and batches --------------------------------------------------------------------------------------------


def load_model(kind: str, config: AuditConfig, num_labels: int):
    """The audit's decoder or encoder, with the loss named so transformers does not warn about it."""
    from ..models import DecoderArch, default_decoder, default_encoder

    if kind == "decoder":
        if config.decoder in EMBEDDED_DECODERS:
            model, tok = default_decoder(arch=DecoderArch(EMBEDDED_DECODERS[config.decoder]), seed=config.seed)
        else:
            model, tok = default_decoder(name=config.decoder, seed=config.seed)
        loss = "ForCausalLM"
    else:
        model, tok = default_encoder(num_labels=num_labels, name=config.encoder, seed=config.seed)
        loss = "ForSequenceClassification"
    if getattr(model, "loss_type", None) is None:
        model.loss_type = loss  # transformers warns "loss_type=None ... unrecognized" on every model otherwise
    return model, tok


def batch_builder(kind: str, tokenizer, label_ids: dict[str, int]) -> Callable[[Sequence[Example]], dict]:
    """The one batch builder: client batches, evaluation, null baselines and fingerprint candidates."""

    def build(examples: Sequence[Example]) -> dict[str, torch.Tensor]:
        enc = tokenizer(
            [e.text for e in examples], padding=True, truncation=True, max_length=MAX_LENGTH, return_tensors="pt"
        )
        batch = {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}
        if kind == "decoder":
            batch["labels"] = enc["input_ids"].masked_fill(enc["attention_mask"] == 0, -100)
        else:
            batch["labels"] = torch.tensor([label_ids[_label(e)] for e in examples])
        return batch

    return build


def _label(example: Example) -> str:
    if example.label is None:
        raise UsageError("--label-field", f"{example.text[:40]!r} has no label: the encoder needs one per sentence")
    return example.label


def client_examples(data: AuditData, config: AuditConfig) -> list[list[list[Example]]]:
    """Disjoint private batches: ``[client][round]``, drawn with the audit's seed."""
    pool = list(data.train)
    random.Random(config.seed).shuffle(pool)
    out: list[list[list[Example]]] = [[] for _ in range(config.clients)]
    for r in range(config.rounds):
        for c in range(config.clients):
            start = (r * config.clients + c) * config.batch_size
            out[c].append(pool[start : start + config.batch_size])
    return out


def evaluator(ctx: ModelContext, validation: list[Example]):
    """The held-out evaluator (:mod:`aegis.harness.evaluate`, the utility study's too) on the first
    ``max_eval`` validation sentences, and the classifier's chance accuracy on them."""
    examples = validation[: ctx.config.max_eval]
    evaluate = shared_evaluator(ctx.kind, ctx.build, examples, max(2, len(ctx.label_ids)))
    return evaluate, chance_accuracy(ctx.kind, examples)


# -- federate ------------------------------------------------------------------------------------------------------


@dataclass
class Federation:
    """One defence's federated run as the server saw it."""

    targets: list[Target]  # the attacked rounds' shared gradients
    models: list[nn.Module]  # the server's global model of each attacked round
    utility: UtilityRecord
    rounds: RoundsRecord


def federate(
    ctx: ModelContext,
    defence: DefenceSpec,
    batches: list[list[dict]],
    examples,
    evaluate,
    before: dict,
    chance: float | None,
    on_round: Callable[[int], None],
) -> Federation:
    from ..fl import run_rounds

    config = ctx.config
    attack_rounds = config.attack_rounds or config.rounds
    states: list[dict[str, torch.Tensor]] = []

    def evaluate_and_keep(global_model: nn.Module) -> dict[str, float]:
        # Called before round 1 and after each round: state r is the model round r + 1 starts from.
        r = len(states)
        if 0 < r < attack_rounds:
            states.append({n: p.detach().clone() for n, p in global_model.named_parameters() if p.requires_grad})
        else:
            states.append({})
        return dict(before) if r == 0 else evaluate(global_model)  # round 0: the shared initial model

    lr = config.decoder_lr if ctx.kind == "decoder" else config.encoder_lr
    run = run_rounds(
        ctx.model,
        batches,
        rounds=config.rounds,
        defence=defence.run_as,
        optimizer=config.optimizer,
        lr=lr,
        eval_fn=evaluate_and_keep,
        on_round=on_round,
    )
    models = [server_copy(ctx.model, states[r]) if r else server_copy(ctx.model) for r in range(attack_rounds)]
    targets = []
    for shared in run.captured[:attack_rounds]:
        for sg in shared:
            targets.append(
                Target(
                    sg.server_round,
                    sg.client,
                    sg.grads,
                    sg.batch,
                    examples[sg.client][sg.server_round - 1],
                    ctx.references(sg.batch),
                    dict(sg.metrics),
                )
            )
    final = run.utility[-1] if run.utility else {}
    metric = metric_of(ctx.kind)
    eps = [r["epsilon"] for r in run.reports if "epsilon" in r]
    delta = next((r["delta"] for r in run.reports if "delta" in r), None)
    if not eps and defence.aegis is not None:  # AEGIS clients run inside Flower's mod: ask the shield
        epsilon, delta = aegis_privacy(ctx, defence, batches[0][0])
        eps = [epsilon] if epsilon is not None else []
    utility = UtilityRecord(
        ctx.kind,
        defence.name,
        config.rounds,
        metric,
        final.get(metric, float("nan")),
        final.get("val_loss", float("nan")),
        before[metric],
        final.get("f1"),
        chance,
        max(eps) if eps else None,
        delta,
    )
    return Federation(targets, models, utility, RoundsRecord(ctx.kind, defence.name, run.rounds))


def aegis_privacy(ctx: ModelContext, defence: DefenceSpec, batch: dict) -> tuple[float | None, float | None]:
    """An AEGIS defence's (epsilon, delta) per example on this model: the shield's own statement
    (:meth:`aegis.shield.CoverageReport.privacy`) once its public calibration ran, i.e. after one step (on
    ``batch``: the public noise level does not depend on it). (None, None) for a baseline, or where no
    noise level is public (the paper's batch calibration)."""
    if defence.aegis is None:
        return None, None
    from ..defence import Aegis

    shield = Aegis(defence.aegis).attach(server_copy(ctx.model))
    try:
        shield.step(batch)
        found = shield.report()
    finally:
        shield.detach()
    return found.get("epsilon"), found.get("delta")


# -- the audit ---------------------------------------------------------------------------------------------------


def meta(config: AuditConfig, data: AuditData) -> dict:
    return {
        "config": config.as_dict(),
        "data": {
            "source": data.source,
            "validation": data.split,
            "train": len(data.train),
            "validation_size": len(data.validation),
        },
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "seconds": 0.0,
        "cpu_seconds": 0.0,
        "stages": {},  # CPU seconds of every finished stage, by its key (aegis.audit.costs)
    }


def plan(config: AuditConfig, report: AuditReport) -> list[Stage]:
    """Every stage still to run, in order: per model with rows left, loading it, the null baselines not yet in
    ``report``, then per defence without a verdict its federation and its attacks."""
    specs = [resolve_defence(d) for d in config.defences]
    targets = config.clients * (config.attack_rounds or config.rounds)
    done = {(v.model, v.defence) for v in report.verdicts}
    have_null = {(n.model, n.attack) for n in report.nulls}
    stages = []
    for kind in config.models:
        todo = [spec for spec in specs if (kind, spec.name) not in done]
        if not todo:
            continue
        attacks = [audit_attacks.make(name) for name in config.attacks_for(kind)]
        b = config.batch_size
        stages.append(Stage(kind, b, "model", "load", COST["load"]))
        stages += [Stage(kind, b, "null", f"null-{a.name}", COST["null"])
                   for a in attacks if (kind, a.name) not in have_null]
        for spec in todo:
            rounds = config.rounds * (COST["round"] + (config.clients * COST["masked"] if spec.aegis else 0.0))
            stages.append(Stage(kind, b, spec.name, "federate", rounds))
            stages += [Stage(kind, b, spec.name, a.name, a.units(config, targets))
                       for a in attacks if a.applies(kind, spec)]
    return stages


def seed_for(*parts: object) -> int:
    """A seed of its own for each row (a model's nulls, a defence's federation): a row is the same whether
    it runs in a fresh audit or a resumed one, whatever ran before it (AEGIS's keys stay fresh: no seed)."""
    return zlib.crc32("/".join(map(str, parts)).encode())


class _Stages:
    """Starts and finishes stages: the progress hooks, their CPU time in the report, the cost history."""

    def __init__(self, progress: Progress, costs: StageCosts, report: AuditReport) -> None:
        self.progress, self.costs, self.report = progress, costs, report
        self.report.meta.setdefault("stages", {})

    @contextlib.contextmanager
    def run(self, stage: Stage):
        self.progress.start(stage)
        cpu = time.process_time()
        yield
        spent = time.process_time() - cpu
        self.report.meta["stages"][stage.key] = round(spent, 2)
        self.costs.record(stage, spent)
        self.progress.finish(stage, spent)


def _counter(progress: Progress) -> Callable[[float], None]:
    """An attack's ``tick``: each piece of its work (a gradient, a candidate) shows as the next step."""
    count = iter(range(1, 1 << 30))
    return lambda cost: progress.step(f"step {next(count)}")


def run_audit(
    config: AuditConfig,
    progress: Progress | None = None,
    *,
    data: AuditData | None = None,
    sink: Callable[[AuditReport], object] | None = None,
    resume: AuditReport | None = None,
    costs: StageCosts | None = None,
) -> AuditReport:
    """Run everything and return the report; ``sink(report)`` after each (model, defence) row and at the end.
    ``resume``: a report of an earlier, unfinished run of the same ``config``: its rows are kept, the rest run."""
    with warnings.catch_warnings():
        # a preset's warning (the paper's: it protects nothing) comes again with every copy of its configuration
        # the federation makes; the verdict states what each preset promises instead
        warnings.filterwarnings("ignore", message=r"preset '[\w-]+' ", category=UserWarning)
        return _audit(config, progress, data, sink, resume, costs)


def _audit(config: AuditConfig, progress: Progress | None, data: AuditData | None,
           sink: Callable[[AuditReport], object] | None, resume: AuditReport | None,
           costs: StageCosts | None) -> AuditReport:
    progress = progress or Progress()
    sink = sink or (lambda report: None)
    costs = costs or StageCosts()
    data = data or load(config)
    report = resume if resume is not None else AuditReport(meta(config, data))
    report.complete = False
    stages = plan(config, report)
    progress.plan(stages, [costs.predict(s) for s in stages])
    tracked = _Stages(progress, costs, report)
    started, cpu_before = time.time() - report.meta.get("seconds", 0.0), report.meta.get("cpu_seconds", 0.0)
    cpu_started = time.process_time()

    def save() -> None:
        report.meta["seconds"] = round(time.time() - started, 1)
        report.meta["cpu_seconds"] = round(cpu_before + time.process_time() - cpu_started, 1)
        sink(report)

    label_ids = data.label_ids()
    for kind in config.models:
        todo = [s for s in stages if s.model == kind]
        if not todo:
            continue
        with tracked.run(todo[0]):
            model, tok = load_model(kind, config, num_labels=max(2, len(label_ids)))
            examples = client_examples(data, config)
            used = {id(e) for client in examples for batch in client for e in batch}
            decoys = [e for e in data.validation + data.train if id(e) not in used]
            ctx = ModelContext(kind, model, tok, config, batch_builder(kind, tok, label_ids), label_ids, decoys)
            batches = [[ctx.build(b) for b in client] for client in examples]
            evaluate, chance = evaluator(ctx, data.validation)
            before = evaluate(model)
            attacks = {a.name: a for a in (audit_attacks.make(name) for name in config.attacks_for(kind))}
            first_batch = batches[0][0]
            first = Target(1, 0, ctx.clean_gradient(first_batch), first_batch, examples[0][0],
                           ctx.references(first_batch))
        nulls = {n.attack: n for n in report.nulls if n.model == kind}
        for stage in (s for s in todo if s.defence == "null"):
            attack = attacks[stage.what.removeprefix("null-")]
            with tracked.run(stage):
                torch.manual_seed(seed_for(config.seed, kind, "null", attack.name))
                nulls[attack.name] = attack.null(ctx, first)
            report.nulls.append(nulls[attack.name])
        del first

        for spec in (resolve_defence(d) for d in config.defences):
            rows = [s for s in todo if s.defence == spec.name]
            if not rows:
                continue
            with tracked.run(rows[0]):
                torch.manual_seed(seed_for(config.seed, kind, spec.name))
                fed = federate(ctx, spec, batches, examples, evaluate, before, chance,
                               lambda r: progress.step(f"round {r}/{config.rounds}"))
            if not fed.targets:  # nothing to attack would read as "holds"
                raise RuntimeError(f"{kind} · {spec.name}: no client's reply reached the server in the attacked "
                                   f"rounds (per round: {fed.rounds.rounds}); the clients' log says why")
            results, recons = [], []
            for stage in rows[1:]:
                attack = attacks[stage.what]
                with tracked.run(stage):
                    record, recon = attack.run(ctx, spec, fed.targets, fed.models, nulls[attack.name],
                                               _counter(progress))
                results.append(record)
                recons += recon
            # a row enters the report whole, with its verdict: an interrupted row leaves nothing half-done
            report.utility.append(fed.utility)
            report.rounds.append(fed.rounds)
            report.results += results
            report.reconstructions += recons
            report.verdicts.append(
                verdicts(report.results, kind, spec.name, spec.calibration, spec.promise, config.batch_size)
            )
            save()
            del fed
    report.complete = True
    save()
    return report
