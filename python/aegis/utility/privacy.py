"""The audit's attacks on what a client exported during a utility run (``aegis.audit.attacks``), one
record per attacked round (the first, middle and last).

Which attacks run:
* the text attacks (dager, embedding_norm, mlp_span, spectral) are scored with ROUGE (``rouge-score``):
  they run where it is installed (CPU machines) and are listed as skipped elsewhere;
* ``labels`` reads a classification head (encoder only);
* ``fingerprint_pool`` rebuilds AEGIS's public flood level, so it applies to AEGIS rows, and to FedSGD
  only: its likelihood models one masked gradient, not a FedAvg model delta after E optimizer steps.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Sequence
from dataclasses import asdict

from torch import Tensor, nn

from ..attacks.registry import STUDY_DEFAULT, TEXT
from ..audit import attacks as audit_attacks
from ..audit.attacks import ModelContext, Target
from ..audit.options import AuditConfig, resolve_defence
from ..data import Example
from .config import Algorithm, UtilityConfig
from .federation import Capture

DEFAULT_ATTACKS = STUDY_DEFAULT


def unavailable(name: str) -> str | None:
    """Why ``name`` cannot run on this machine (None: it can)."""
    if name in TEXT and importlib.util.find_spec("rouge_score") is None:
        return "needs rouge-score (runs on CPU machines)"
    return None


def applicable(name: str, kind: str, defence: str, algorithm: Algorithm) -> str | None:
    """Why ``name`` does not apply to this run (None: it does)."""
    if name == "labels" and kind != "encoder":
        return "reads a classification head (encoder only)"
    if name == "fingerprint_pool":
        if not defence.startswith("aegis-"):
            return "reads AEGIS's flood level (AEGIS rows only)"
        if algorithm is Algorithm.FEDAVG:
            return "models one masked gradient, not a FedAvg delta"
    return unavailable(name)


def context(
    kind: str,
    model: nn.Module,
    tokenizer,
    build: Callable[[Sequence[Example]], dict[str, Tensor]],
    label_ids: dict[str, int],
    decoys: list[Example],
    config: UtilityConfig,
) -> ModelContext:
    """The audit's view of one model: its initial state on the CPU, THE batch builder, decoy sentences."""
    audit_config = AuditConfig(
        models=(kind,), defences=("none",), clients=config.clients, rounds=1, candidates=config.candidates,
        seed=config.seed,
    )
    return ModelContext(kind, model.cpu().eval(), tokenizer, audit_config, build, label_ids, decoys)


def nulls(ctx: ModelContext, names: Sequence[str], first: list[Example]) -> dict[str, dict]:
    """Each attack's null baseline on the clean gradient of ``first`` (a client's first batch)."""
    batch = ctx.build(first)
    target = Target(1, 0, ctx.clean_gradient(batch), batch, first, ctx.references(batch))
    return {name: asdict(audit_attacks.make(name).null(ctx, target)) for name in names}


def attack_run(
    ctx: ModelContext,
    defence: str,
    algorithm: Algorithm,
    captures: list[Capture],
    models: dict[int, nn.Module],
    names: Sequence[str],
    null_rows: dict[str, dict],
) -> list[dict]:
    """One row per attack and attacked round; rows of attacks that do not apply say why."""
    from ..audit.records import NullBaseline

    spec = resolve_defence(defence)
    rows = []
    for name in names:
        why = applicable(name, ctx.kind, defence, algorithm)
        if why is not None:
            rows.append({"attack": name, "skipped": why})
            continue
        attack = audit_attacks.make(name)
        null = NullBaseline(**null_rows[name])
        for r in sorted(models):
            here = [c for c in captures if c.round == r]
            if not here:
                continue
            targets = []
            for cap in here:
                batch = ctx.build(cap.examples)
                targets.append(Target(1, cap.client, cap.grads, batch, cap.examples, ctx.references(batch)))
            record, _ = attack.run(ctx, spec, targets, [models[r]], null, lambda cost: None)
            row = asdict(record)
            row.update(round=r, leaks=record.leaks, above_bar=record.above_bar, privacy=record.privacy,
                       excess=record.excess)
            rows.append(row)
    return rows

