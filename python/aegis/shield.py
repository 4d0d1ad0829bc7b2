"""The shield: freezes attention, floods every other trainable gradient, exports only masked ones."""
from __future__ import annotations

import secrets
import weakref
from dataclasses import dataclass

import torch
from torch import Tensor, nn

import aegis_kernels

from .config import AegisConfig
from .flood_graph import GraphedFlood
from .policy import ParamPlan, plan


@dataclass(frozen=True)
class ReportRow:
    name: str
    role: str
    action: str
    lam: float | None
    rho: float | None
    shape: tuple[int, ...]
    numel: int


@dataclass(frozen=True)
class CoverageReport:
    rows: list[ReportRow]

    def count(self, action: str) -> int:
        return sum(r.action == action for r in self.rows)

    @property
    def frozen_share(self) -> float:
        total = sum(r.numel for r in self.rows)
        return sum(r.numel for r in self.rows if r.action == "frozen") / total if total else 0.0

    @property
    def flooded(self) -> list[ReportRow]:
        return [r for r in self.rows if r.action.endswith("flood")]

    @property
    def clean(self) -> list[ReportRow]:
        return [r for r in self.rows if r.action.startswith("CLEAN")]


class Shield:
    """Created by :func:`aegis.protect`. ``mask_()`` floods gradients in place; ``export()`` shares them."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None, config: AegisConfig):
        self.model, self.config = model, config
        self.plans = plan(model, config)
        frozen = [p.param for p in self.plans if p.treatment.kind == "frozen"]
        for param in frozen:
            param.requires_grad_(False)
            param.grad = None
        # Re-plan: trainability changed for the frozen parameters.
        self.plans = [
            ParamPlan(p.name, p.param, p.role, p.treatment, p.param.requires_grad, p.clean) for p in self.plans
        ]
        self._flooded = [p for p in self.plans if p.flooded]
        self._step = 0
        self._masked: list[tuple[weakref.ref | None, int]] | None = None
        self._state: Tensor | None = None
        self._batches: dict[tuple[bool, ...], tuple[str, list[float], list[float]]] = {}
        self._graphed: GraphedFlood | None = None
        self._hook = None
        if optimizer is not None:
            _drop_from_optimizer(optimizer, frozen)
            self._hook = optimizer.register_step_pre_hook(lambda *_: self.ensure_masked())

    # -- masking -------------------------------------------------------------------------
    def mask_(self) -> None:
        """Flood every trainable gradient in place, one grouped ``flood_`` call (fresh secret seed)."""
        grads = [p.param.grad for p in self._flooded]
        tensors, modes, rhos, lams = self._batch(grads)
        args = (tensors, modes, rhos, lams, self.config.rel_threshold)
        if self.config.device_seed:
            torch.ops.aegis.flood_seeded_(*args, self._device_state(tensors))
        elif self._graphable(tensors):
            key = self.config.seed if self.config.seed is not None else secrets.randbits(aegis_kernels.reference.SEED_BITS)
            self._graphed(*args, key, self._step)  # seed derive_seed(key, step), as _next_seed for a fixed seed
        else:
            torch.ops.aegis.flood_(*args, self._next_seed())
        self._step += 1
        self._masked = [(None, 0) if g is None else (weakref.ref(g), g._version) for g in grads]

    def _batch(self, grads: list[Tensor | None]) -> tuple[list[Tensor], str, list[float], list[float]]:
        """The flood_ arguments for the gradients present (cached per pattern of missing ones)."""
        tensors = [g for g in grads if g is not None]
        for g in tensors:
            if g.layout != torch.strided:
                name = next(p.name for p, q in zip(self._flooded, grads) if q is g)
                raise ValueError(
                    f"{name} has a sparse gradient: AEGIS floods dense gradients only; build the "
                    "embedding with sparse=False (a sparse gradient would reveal the tokens it touches)"
                )
        pattern = tuple(g is not None for g in grads)
        cached = self._batches.get(pattern)
        if cached is None:
            present = [p for p, g in zip(self._flooded, grads) if g is not None]
            cached = (",".join(p.treatment.kind for p in present), [p.treatment.rho for p in present],
                      [p.treatment.lam for p in present])
            self._batches[pattern] = cached
        return (tensors, *cached)

    def _graphable(self, tensors: list[Tensor]) -> bool:
        """CUDA-graph replay of the flood: on (config.cuda_graph), all on one GPU, not inside a capture."""
        if not (self.config.cuda_graph and tensors and tensors[0].is_cuda):
            return False
        device = tensors[0].device
        if any(t.device != device for t in tensors) or torch.cuda.is_current_stream_capturing():
            return False
        if self._graphed is None or self._graphed.state.device != device:
            self._graphed = GraphedFlood(device)
        return True

    def _next_seed(self) -> int:
        if self.config.seed is None:
            return secrets.randbits(aegis_kernels.reference.SEED_BITS)
        return int(aegis_kernels.derive_seed(self.config.seed, self._step))

    def _device_state(self, tensors: list[Tensor]) -> Tensor:
        """[key, step] on the gradients' device, advanced by the op itself (CUDA-graph replay)."""
        if self._state is None:
            key = self.config.seed if self.config.seed is not None else secrets.randbits(aegis_kernels.reference.SEED_BITS)
            device = tensors[0].device if tensors else "cpu"
            self._state = torch.tensor([key, self._step], dtype=torch.int64, device=device)
        return self._state

    @property
    def is_masked(self) -> bool:
        """True when every gradient is exactly what the last ``mask_()`` left (no backward since)."""
        if self._masked is None:
            return False
        for p, (ref, version) in zip(self._flooded, self._masked):
            grad = p.param.grad
            if ref is None:
                if grad is not None:
                    return False
            elif grad is None or ref() is not grad or grad._version != version:
                return False
        return True

    def ensure_masked(self) -> None:
        """Mask unless already masked: the optimizer hook and Trainer callback call this."""
        if not self.is_masked:
            self.mask_()

    # -- sharing -------------------------------------------------------------------------
    def export(self, include_frozen: bool = False) -> dict[str, Tensor]:
        """{name: masked gradient} of trainable parameters; fails closed if not masked."""
        if not self.is_masked:
            raise RuntimeError(
                "export() refused: the gradients are not masked (call shield.mask_() after backward(), "
                "or export before optimizer.zero_grad())"
            )
        out = {}
        for p in self.plans:
            grad = p.param.grad
            if p.flooded or (p.trainable and p.clean):
                out[p.name] = torch.zeros_like(p.param) if grad is None else grad.detach().clone()
            elif include_frozen and p.treatment.kind == "frozen":
                out[p.name] = torch.zeros_like(p.param)
        return out

    def report(self) -> CoverageReport:
        rows = []
        for p in self.plans:
            flooded = p.action.endswith("flood")
            rows.append(
                ReportRow(
                    name=p.name,
                    role=p.role,
                    action=p.action,
                    lam=p.treatment.lam if flooded else None,
                    rho=p.treatment.rho if flooded else None,
                    shape=tuple(p.param.shape),
                    numel=p.param.numel(),
                )
            )
        return CoverageReport(rows)

    def trainer_callback(self):
        """A ``transformers.TrainerCallback`` that masks right before each optimizer step."""
        from .hf import AegisCallback

        return AegisCallback(self)

    def remove(self) -> None:
        """Detach the optimizer hook (parameters stay frozen)."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None


def _drop_from_optimizer(optimizer: torch.optim.Optimizer, frozen: list[nn.Parameter]) -> None:
    """Frozen parameters leave the optimizer so weight decay or momentum cannot move them."""
    ids = {id(p) for p in frozen}
    for group in optimizer.param_groups:
        group["params"] = [p for p in group["params"] if id(p) not in ids]
    for p in frozen:
        optimizer.state.pop(p, None)


def protect(
    model: nn.Module, optimizer: torch.optim.Optimizer | None = None, config: AegisConfig | None = None
) -> Shield:
    """Apply AEGIS to ``model``: freeze attention now; flood before every optimizer step."""
    return Shield(model, optimizer, config or AegisConfig())
