"""The interface every defence implements, and AEGIS behind it.

A :class:`Defence` is attached to one model (and optionally its optimizer) and then drives one training
step in three calls, so that a benchmark can time each part and a federated client can share what it
exports::

    defence = Aegis(AegisConfig(preset=Preset.SENTENCES)).attach(model, optimizer)
    loss = defence.backward(batch, loss_fn)   # forward + backward
    defence.defend_()                          # rewrite p.grad in place
    shared = defence.export()                  # {name: gradient} of trainable parameters (what leaves)
    optimizer.step()

``defence.step(batch, loss_fn)`` does zero-grad, backward, defend and export in one go.
``loss_fn(model, batch) -> scalar`` defaults to :func:`lm_loss` (``model(**batch).loss``, mean reduction).

This module is the product path's view of a defence (``aegis.fl`` uses it): :class:`NoDefence` and
:class:`Aegis` only. The comparators (DP-SGD, pruning, Soteria, DAGER's noise) live in
:mod:`aegis.baselines`, which builds on this module and is never imported by it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from .config import AegisConfig, Preset
from .exposure import ExposurePolicy
from .registry import DefenceKind, DefenceSpec, parse_defence
from .shield import Shield, protect

Batch = Mapping[str, Any]
LossFn = Callable[[nn.Module, Batch], Tensor]


def lm_loss(model: nn.Module, batch: Batch) -> Tensor:
    """The model's own loss (HF models return ``.loss`` when the batch has ``labels``)."""
    return model(**batch).loss


def trainable_gradients(model: nn.Module) -> dict[str, Tensor]:
    """{name: gradient copy} of every trainable parameter (zeros where backward left none)."""
    return {
        name: torch.zeros_like(p) if p.grad is None else p.grad.detach().clone()
        for name, p in model.named_parameters()
        if p.requires_grad
    }


class Defence:
    """Base class: no defence. Subclasses override ``_setup``, ``backward`` and/or ``defend_``."""

    name = "none"

    def __init__(self) -> None:
        self.model: nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None

    def attach(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> Defence:
        """Bind to ``model`` (one model per defence object: state such as DP accounting is per client)."""
        if self.model is not None:
            if self.model is model:
                return self
            raise RuntimeError(f"{self.name}: already attached to another model; create one defence per model")
        self.model, self.optimizer = model, optimizer
        self._setup()
        return self

    def _setup(self) -> None:
        pass

    def _bound(self) -> nn.Module:
        if self.model is None:
            raise RuntimeError(f"{self.name}: call attach(model) first")
        return self.model

    def backward(self, batch: Batch, loss_fn: LossFn = lm_loss) -> Tensor:
        """Forward and backward on ``batch``; returns the detached loss."""
        loss = loss_fn(self._bound(), batch)
        loss.backward()
        return loss.detach()

    def defend_(self) -> None:
        """Rewrite the gradients in place (after ``backward``, before the optimizer step)."""

    def export(self) -> dict[str, Tensor]:
        """What the client shares: {name: gradient} of the trainable parameters."""
        return trainable_gradients(self._bound())

    def step(self, batch: Batch, loss_fn: LossFn = lm_loss) -> tuple[Tensor, dict[str, Tensor]]:
        """zero-grad, backward, defend, export: one client's shared gradient for ``batch``."""
        for p in self._bound().parameters():
            p.grad = None
        loss = self.backward(batch, loss_fn)
        self.defend_()
        return loss, self.export()

    def report(self) -> dict[str, float]:
        """Numbers worth printing next to the results (e.g. DP-SGD's ε)."""
        return {}

    def detach(self) -> None:
        """Remove hooks this defence installed (parameters frozen by AEGIS stay frozen)."""

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name}>"


class NoDefence(Defence):
    """The undefended baseline: the plain gradient is shared."""


class Aegis(Defence):
    """AEGIS through the common interface: ``protect`` at attach, ``mask_`` as the defence, masked export."""

    def __init__(self, config: AegisConfig | None = None) -> None:
        super().__init__()
        self.config = config or AegisConfig()
        self.name = f"aegis-{self.config.preset.value}" if isinstance(self.config.preset, Preset) else "aegis"
        self.shield: Shield | None = None

    def _setup(self) -> None:
        self.shield = protect(self._bound(), self.optimizer, self.config)

    def _shield(self) -> Shield:
        if self.shield is None:
            raise RuntimeError(f"{self.name}: call attach(model) first")
        return self.shield

    def defend_(self) -> None:
        self._shield().mask_()

    def export(self) -> dict[str, Tensor]:
        return self._shield().export()

    def report(self) -> dict[str, float]:
        """The flood graphs' counts and, where the public calibration defines it, (epsilon, delta) per example
        at the exposure budget (:meth:`aegis.shield.CoverageReport.privacy`; infinite with the budget off)."""
        out = {f"flood_graph_{k}": float(v) for k, v in self._shield().flood_graph_counts.items()}
        report = self._shield().report()
        privacy = report.privacy()
        if privacy is not None:  # with the budget off nothing bounds the exports: no finite epsilon
            eps = math.inf if report.exposure is ExposurePolicy.OFF else privacy.epsilon
            out |= {"epsilon": eps, "delta": privacy.delta, "noise_multiplier": privacy.noise_multiplier,
                    "compositions": float(privacy.compositions)}
        return out

    def detach(self) -> None:
        if self.shield is not None:
            self.shield.remove()


def core_defence(spec: str | DefenceSpec) -> Defence | None:
    """The product's defence a name stands for (:func:`aegis.registry.parse_defence`: ``none``, ``aegis``,
    ``aegis-PRESET[-batch]``); None for a comparator (:func:`aegis.baselines.make_defence` builds those).
    A name of no defence raises :class:`~aegis.errors.UsageError`."""
    parsed = parse_defence(spec) if isinstance(spec, str) else spec
    if parsed.kind is DefenceKind.NONE:
        return NoDefence()
    if parsed.aegis is not None:
        return Aegis(parsed.aegis)
    return None
