"""The main job: federate -> attack -> score, defence by defence, over typed records.

For each model (the embedded decoder and encoder unless named otherwise): the null baseline of every
attack is computed first, on the clean gradient of client 0's first batch (so no row waits for it);
then, for each defence, the clients run FedSGD rounds through Flower's Message API
(``aegis.fl.run_rounds``), the honest-but-curious server keeps every gradient it receives, the attacks
read those of the first ``attack_rounds`` rounds (all with 0) with the server's copy of that round's
global model, and utility is the global model's validation perplexity (decoder) or accuracy and
macro-F1 (encoder) after the last round. After each defence the report so far goes to ``sink`` (the CLI
writes it to disk), so a late failure loses nothing that finished.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from ..data import Example
from ..errors import UsageError
from ..harness.evaluate import chance_accuracy, metric_of
from ..harness.evaluate import evaluator as shared_evaluator
from . import attacks as audit_attacks
from .attacks import COST, ModelContext, Target, server_copy
from .dataset import AuditData, load
from .options import (  # noqa: F401 (re-exported names)
    ATTACKS,
    DEFAULT_ATTACKS,
    DEFENCES,
    EMBEDDED_DECODERS,
    MODELS,
    QUICK_DEFENCES,
    AuditConfig,
    DefenceSpec,
    resolve_defence,
)
from .records import AuditReport, NullBaseline, RoundsRecord, UtilityRecord, verdicts

MAX_LENGTH = 64  # tokens per sentence the clients train on (a public setting of the federation)


@dataclass
class Progress:
    """Callbacks for progress output (no-ops by default): ``total(cost)``, then ``advance(label, cost)`` as
    work finishes (costs are rough seconds, :data:`aegis.audit.attacks.COST`)."""

    total: Callable[[float], None] = field(default=lambda cost: None)
    advance: Callable[..., None] = field(default=lambda label, cost=1.0: None)


# -- models and batches --------------------------------------------------------------------------------------------


def load_model(kind: str, config: AuditConfig, num_labels: int):
    """The audit's decoder or encoder, with the loss named so transformers does not warn about it."""
    from ..models import default_decoder, default_encoder

    if kind == "decoder":
        if config.decoder in EMBEDDED_DECODERS:
            model, tok = default_decoder(arch=EMBEDDED_DECODERS[config.decoder], seed=config.seed)
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


def _round_cost(config: AuditConfig, spec: DefenceSpec) -> float:
    return COST["round"] + (config.clients * COST["masked"] if spec.aegis is not None else 0.0)


# -- the audit -----------------------------------------------------------------------------------------------------


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
    }


def run_audit(
    config: AuditConfig,
    progress: Progress | None = None,
    *,
    data: AuditData | None = None,
    sink: Callable[[AuditReport], object] | None = None,
) -> AuditReport:
    """Run everything and return the report; ``sink(report)`` after each defence (and at the end)."""
    progress = progress or Progress()
    sink = sink or (lambda report: None)
    data = data or load(config)
    specs = [resolve_defence(d) for d in config.defences]
    attack_rounds = config.attack_rounds or config.rounds
    targets_per_defence = config.clients * attack_rounds
    units = 0.0
    for kind in config.models:
        names = config.attacks_for(kind)
        units += len(names) * COST["null"]
        for spec in specs:
            units += config.rounds * _round_cost(config, spec)
            for name in names:
                attack = audit_attacks.make(name)
                if attack.applies(kind, spec):
                    units += attack.units(config, targets_per_defence)
    progress.total(units)

    report = AuditReport(meta(config, data))
    started = time.time()
    label_ids = data.label_ids()
    for kind in config.models:
        model, tok = load_model(kind, config, num_labels=max(2, len(label_ids)))
        examples = client_examples(data, config)
        used = {id(e) for client in examples for batch in client for e in batch}
        decoys = [e for e in data.validation + data.train if id(e) not in used]
        ctx = ModelContext(kind, model, tok, config, batch_builder(kind, tok, label_ids), label_ids, decoys)
        batches = [[ctx.build(b) for b in client] for client in examples]
        evaluate, chance = evaluator(ctx, data.validation)
        before = evaluate(model)
        attacks = [audit_attacks.make(name) for name in config.attacks_for(kind)]

        first_batch = batches[0][0]
        first = Target(1, 0, ctx.clean_gradient(first_batch), first_batch, examples[0][0], ctx.references(first_batch))
        nulls: dict[str, NullBaseline] = {}
        for attack in attacks:
            nulls[attack.name] = attack.null(ctx, first)
            report.nulls.append(nulls[attack.name])
            progress.advance(f"{kind} · null · {attack.name}", COST["null"])
        del first

        for spec in specs:

            def on_round(r: int, spec=spec, kind=kind) -> None:
                progress.advance(f"{kind} · {spec.name} · round {r}/{config.rounds}", _round_cost(config, spec))

            fed = federate(ctx, spec, batches, examples, evaluate, before, chance, on_round)
            report.utility.append(fed.utility)
            report.rounds.append(fed.rounds)
            for attack in attacks:
                if not attack.applies(kind, spec):
                    continue

                def tick(cost: float, name=attack.name, spec=spec, kind=kind) -> None:
                    progress.advance(f"{kind} · {spec.name} · {name}", cost)

                record, recon = attack.run(ctx, spec, fed.targets, fed.models, nulls[attack.name], tick)
                report.results.append(record)
                report.reconstructions += recon
            report.verdicts.append(
                verdicts(report.results, kind, spec.name, spec.calibration, spec.promise, config.batch_size)
            )
            report.meta["seconds"] = round(time.time() - started, 1)
            sink(report)
            del fed
    report.complete = True
    report.meta["seconds"] = round(time.time() - started, 1)
    sink(report)
    return report
