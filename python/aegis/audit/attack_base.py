"""What every audit attack is built on: the shared gradient it reads (:class:`Target`), the model it attacks
(:class:`ModelContext`), its interface (:class:`AuditAttack`) and the progress cost of its work (:data:`COST`).

The attacks themselves live in :mod:`aegis.audit.attacks` (text and fingerprint),
:mod:`aegis.audit.label_attack` and :mod:`aegis.audit.loss_attack`; they all import this module and none
imports another.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from ..data import Example
from ..registry import DefenceSpec
from .options import AuditConfig
from .records import AttackRecord, NullBaseline, Reconstruction

MAX_LENGTH = 64  # tokens per sentence the clients train on (a public setting of the federation)

# Rough cost of one unit of work in seconds on 2 quiet cores (the quick audit's decoder): progress
# advances by these, so the ETA is about right from the start.
COST = {
    "text": 1.5,
    "label": 0.3,
    "candidate": 0.12,
    "trial": 1.5,
    "null": 1.5,
    "load": 8.0,  # a model, its batches, its untrained utility and the clean gradient the nulls read
    "round": 1.0,
    "masked": 1.2,
    "oracle": 0.01,
    "export": 0.01,  # one fresh head export of the label attack
}


@dataclass
class Target:
    """One shared gradient as the server received it, with the ground truth it is scored against."""

    server_round: int
    client: int
    grads: dict[str, Tensor]
    batch: Mapping[str, Tensor]  # the client's batch (never sent)
    examples: list[Example]
    references: list[str]  # the batch's sentences as the tokenizer sees them (decoded, truncated)
    metrics: dict[str, float] = field(default_factory=dict)  # the reply's MetricRecord, as received


@dataclass
class ModelContext:
    """One model of the audit: its initial state, tokenizer, data and the one batch builder."""

    kind: str  # "decoder" or "encoder"
    model: nn.Module  # the initial global model (round 1 starts here); never trained in place
    tokenizer: Any  # a Hugging Face tokenizer
    config: AuditConfig
    build: Callable[[Sequence[Example]], dict[str, Tensor]]  # THE batch builder (clients, eval, candidates)
    label_ids: dict[str, int]
    decoys: list[Example]  # sentences no client trains on: the fingerprint's decoy batches

    @property
    def alignment(self) -> str:
        return "greedy" if self.kind == "decoder" else "hungarian"

    def references(self, batch: Mapping[str, Tensor]) -> list[str]:
        return [
            self.tokenizer.decode(ids[mask.bool()], skip_special_tokens=True)
            for ids, mask in zip(batch["input_ids"], batch["attention_mask"])
        ]

    def clean_gradient(self, batch: dict[str, Tensor]) -> dict[str, Tensor]:
        """The undefended gradient of ``batch`` on the initial model (eval mode, as the clients)."""
        model = self.model
        was = model.training
        model.eval()
        model.zero_grad(set_to_none=True)
        try:
            model(**batch).loss.backward()
            return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
        finally:
            model.zero_grad(set_to_none=True)
            model.train(was)


def server_copy(model: nn.Module, state: dict[str, Tensor] | None = None) -> nn.Module:
    """The server's copy of a round's global model (what the attacker holds)."""
    server = copy.deepcopy(model)
    if state:
        with torch.no_grad():
            params = dict(server.named_parameters())
            for name, value in state.items():
                params[name].copy_(value)
    return server.eval()




class AuditAttack:
    name = ""
    metric = "rouge1"

    def applies(self, kind: str, defence: DefenceSpec) -> bool:
        return True

    def null(self, ctx: ModelContext, first: Target) -> NullBaseline:
        raise NotImplementedError

    def run(
        self,
        ctx: ModelContext,
        defence: DefenceSpec,
        targets: list[Target],
        models: list[nn.Module],
        null: NullBaseline,
        tick: Callable[[float], None],
    ) -> tuple[AttackRecord, list[Reconstruction]]:
        raise NotImplementedError

    unit = "text"

    def units(self, config: AuditConfig, targets: int) -> float:
        """The (rough) cost this attack takes per defence: what its ticks add up to."""
        return targets * COST[self.unit]
