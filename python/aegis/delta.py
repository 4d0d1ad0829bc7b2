"""Delta export (FedAvg): a client trains locally on its clean gradients and exports ONE flooded weight delta
per round (docs/design.md §8).

    shield = aegis.protect(model, optimizer, AegisConfig(preset=..., export=ExportMode.DELTA),
                           calibration_loss=aegis.delta.PublicBatches(model, tokenizer, public_texts, 8, 64))
    with shield.round() as rnd:          # snapshot of every trainable tensor
        for batch in local_epochs:       # ordinary training: no step is flooded, nothing leaves
            model(**batch).loss.backward(); optimizer.step(); optimizer.zero_grad()
    send(rnd.delta)                      # {name: rho * clip(delta) + sigma Z}, one fresh key

At the round's end, before anything leaves, the same local training (as many optimizer steps, the same
optimizer class, the hyper-parameters each step had, a fresh optimizer state) runs again from the
round's snapshot on PUBLIC batches (``calibration_loss``, one batch per step). Its delta sets each
tensor's (rho, sigma, clip, thr) as the public gradient does in step mode: clip = treatment.clip x its
norm (Frobenius; rows: the largest row), and sigma the larger of lam x its mean |entry| and
rho x clip / treatment.snr, so that the exported signal of a tensor over its per-entry noise is at most
``snr`` (the per-tensor cap S). Nothing in the table depends on the private data; the number of
optimizer steps in a round is public (it shapes the table). Every example the round's forwards read is
counted once against the exposure budget, however many epochs saw it.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

import aegis_kernels  # noqa: F401  (registers torch.ops.aegis)
import aegis_kernels.reference as ref

from .accounting import DELTA, PrivacyStatement, noise_multiplier, statement
from .calibration import PublicLoss, delta_table
from .config import AegisConfig, Calibration, ExportMode
from .exposure import ExposurePolicy, ExposureTracker
from .policy import ParamPlan, plan, rows_view


class PublicBatches:
    """A public loss that walks ``texts`` in a fixed order, ``batch_size`` texts of at most ``max_length``
    tokens per call (wrapping around), padded like a private batch (pads masked with -100). The public round
    calls ``reset()`` first, so its delta is a function of the snapshot and these texts alone."""

    def __init__(self, model: nn.Module, tokenizer, texts: Sequence[str], batch_size: int, max_length: int):
        texts = [t for t in texts if isinstance(t, str) and t.strip()]
        if not texts:
            raise ValueError("PublicBatches(texts=...): no public text given; pass sentences the client may "
                             "publish (e.g. aegis.data.corpora.public_texts)")
        if batch_size < 1 or max_length < 2:
            raise ValueError(f"PublicBatches(batch_size={batch_size}, max_length={max_length}): batch_size >= 1 "
                             "and max_length >= 2 (the private batches' shape)")
        self.model, self.tokenizer, self.texts = model, tokenizer, texts
        self.batch_size, self.max_length = batch_size, max_length
        self._next = 0

    def reset(self) -> None:
        self._next = 0

    def __call__(self) -> Tensor:
        n = len(self.texts)
        chosen = [self.texts[(self._next + i) % n] for i in range(self.batch_size)]
        self._next = (self._next + self.batch_size) % n
        enc = self.tokenizer(chosen, padding=True, truncation=True, max_length=self.max_length, return_tensors="pt")
        device = next(self.model.parameters()).device
        ids, mask = enc["input_ids"].to(device), enc["attention_mask"].to(device)
        return self.model(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)).loss


def _flood(tensors: list[Tensor], modes: str, table: Tensor, key: Tensor) -> None:
    """The one flood of a round (a module function so tests can count the calls)."""
    torch.ops.aegis.flood_(tensors, modes, table, key)


@dataclass(frozen=True)
class DeltaRow:
    name: str
    role: str
    action: str
    shape: tuple[int, ...]
    numel: int
    rho: float | None = None  # the last export's public parameters (None: not flooded, or no export yet)
    sigma: float | None = None
    clip: float | None = None
    snr: float | None = None  # rho * clip / sigma: the largest exported signal over the per-entry noise


@dataclass(frozen=True)
class DeltaReport:
    rows: list[DeltaRow]
    rounds: int  # rounds exported
    steps: int  # optimizer steps of the last exported round (public: they shape the table)
    exposure_budget: int
    exposure: ExposurePolicy
    max_exposure: int
    silenced_rounds: int  # rounds exported as pure noise (ExposurePolicy.SILENCE past the budget)
    noise_multiplier: float | None  # z of one export under the last table; 0 with a clean tensor; None before
    export: ExportMode = ExportMode.DELTA

    def privacy(self, delta: float = DELTA) -> PrivacyStatement | None:
        """(epsilon, delta) per example when each is in at most ``exposure_budget`` rounds."""
        if self.noise_multiplier is None:
            return None
        return statement(self.noise_multiplier, self.exposure_budget, delta=delta)

    @property
    def flooded(self) -> list[DeltaRow]:
        return [r for r in self.rows if r.action.endswith("flood")]


@dataclass
class Round:
    """What ``DeltaShield.round()`` yields: ``delta`` holds the export once the block ends without error."""

    delta: dict[str, Tensor] = field(default_factory=dict)


class DeltaShield:
    """Created by :func:`aegis.protect` with ``AegisConfig(export=ExportMode.DELTA)``: no step is flooded;
    ``export()`` ends a round with one flooded delta per trainable tensor (module docstring)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None, config: AegisConfig,
                 calibration_loss: PublicLoss | None = None):
        if config.export is not ExportMode.DELTA:
            raise ValueError(f"DeltaShield needs AegisConfig(export=ExportMode.DELTA), got {config.export}")
        if optimizer is None:
            raise ValueError("protect(optimizer=None) in delta mode: pass the local optimizer; the public round "
                             "replays its class and per-step settings, and its steps mark the round")
        if calibration_loss is None:
            raise ValueError("delta mode needs calibration_loss=aegis.delta.PublicBatches(model, tokenizer, texts, "
                             "batch_size, max_length): the public round trains on it to size the noise")
        if config.calibration is not Calibration.PUBLIC:
            raise ValueError("delta mode calibrates on a public round only: Calibration.BATCH would size the noise "
                             "from the private delta itself")
        if config.device_seed:  # cuda_graph (a per-step replay) has nothing to replay here
            raise ValueError("device_seed is a step-mode option (a captured per-step flood); delta mode floods once "
                             "per round: leave it False")
        self.model, self.optimizer, self.config = model, optimizer, config
        plans = plan(model, config)
        frozen = [p.param for p in plans if p.treatment.kind == "frozen"]
        for param in frozen:
            param.requires_grad_(False)
            param.grad = None
        ids = {id(p) for p in frozen}
        for group in optimizer.param_groups:
            group["params"] = [p for p in group["params"] if id(p) not in ids]
        self.plans = [ParamPlan(p.name, p.param, p.role, p.treatment, p.param.requires_grad, p.clean) for p in plans]
        self._flooded = [p for p in self.plans if p.flooded]
        self._exported = [p for p in self.plans if p.flooded or (p.trainable and p.clean)]
        self._modes = [p.flood_mode for p in self._flooded]
        self._transposed = [p.transposed for p in self._flooded]
        self._loss = calibration_loss
        self._fixed_key = ref.key_from_int(config.seed) if config.seed is not None else None
        self._exposure: ExposureTracker | None = None
        if config.exposure is not ExposurePolicy.OFF and self._flooded:
            self._exposure = ExposureTracker(model, config.exposures, lambda: [p.param.grad for p in self._flooded],
                                             config.exposure_state)
        self._holding = contextlib.ExitStack()  # inside a round the pending forwards survive zero_grad
        self._snapshot: dict[str, Tensor] | None = None
        self._steps: list[list[dict]] = []  # per optimizer step: every group's settings (lr schedules)
        self._table: Tensor | None = None
        self._rounds = self._silenced = self._last_steps = 0
        self._hook = optimizer.register_step_pre_hook(self._on_step)

    # -- the round -------------------------------------------------------------------------------------
    @property
    def in_round(self) -> bool:
        return self._snapshot is not None

    def begin_round(self) -> None:
        """Snapshot every exported tensor and start counting; the optimizer state starts fresh (it would
        carry earlier rounds' private data into this round's delta and public round)."""
        if self.in_round:
            raise RuntimeError("begin_round(): a round is already in progress; end it with export() (or drop it "
                               "with abort_round())")
        self._drop_local_state()
        self._snapshot = {p.name: p.param.detach().clone() for p in self._exported}
        self._steps = []
        if self._exposure is not None:
            self._exposure.discard()  # forwards before the round are in no delta
            self._holding.enter_context(self._exposure.hold())  # every forward of the round is in its delta

    @contextlib.contextmanager
    def round(self) -> Iterator[Round]:
        """``with shield.round() as rnd: <local training>``; then ``rnd.delta`` is the export. An exception in
        the block aborts the round: nothing exported, nothing counted, the snapshot restored."""
        self.begin_round()
        out = Round()
        try:
            yield out
        except BaseException:
            self.abort_round()
            raise
        out.delta = self.export()

    def abort_round(self) -> None:
        """Drop the round: the snapshot comes back, nothing is exported or counted."""
        if self._snapshot is not None:
            self._load(self._snapshot)
        self._end_round()

    def _on_step(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        if not self.in_round:
            raise RuntimeError("optimizer.step() outside a round: call shield.begin_round() (or train inside "
                               "`with shield.round():`) first; a step outside a round trains on data no export "
                               "counts")
        self._steps.append([{k: copy.copy(v) for k, v in g.items() if k != "params"} for g in optimizer.param_groups])

    # -- the export ------------------------------------------------------------------------------------
    def export(self) -> dict[str, Tensor]:
        """End the round: {name: rho * clip(delta) + sigma Z} of every flooded tensor (allow-listed ones
        clean), one flood under a fresh key. The model is left at snapshot + export (what the server
        holds), its gradients and the optimizer state dropped. Refused (the round aborted) past the
        exposure budget under ExposurePolicy.REFUSE; pure noise under SILENCE."""
        if self._snapshot is None:
            raise RuntimeError("export(): no round in progress. Call begin_round() (or use `with shield.round():`) "
                               "before training; each round exports once")
        if not self._steps:
            raise RuntimeError("export(): no optimizer step in this round, nothing to export; train first (or "
                               "abort_round())")
        snapshot = self._snapshot
        try:
            deltas = {p.name: (p.param.detach() - snapshot[p.name]).contiguous() for p in self._exported}
            bad = [n for n, d in deltas.items() if not bool(torch.isfinite(d).all())]
            if bad:
                raise RuntimeError(f"export() refused: non-finite weights after the round in {', '.join(bad[:5])}; "
                                   "the round was aborted (snapshot restored), nothing exported")
            table = self._public_table()
            silenced = self._decide()
        except BaseException:
            self.abort_round()
            raise
        if silenced:
            table[:, 0] = 0.0  # rho = 0: pure noise, nothing of the round leaves
        flooded = [deltas[p.name] for p in self._flooded]
        if flooded:
            views = [rows_view(d, t) if m == "rows" else d for d, m, t in zip(flooded, self._modes, self._transposed)]
            key = (ref.derive_key(self._fixed_key, self._rounds) if self._fixed_key is not None else ref.new_key())
            _flood(views, ",".join(self._modes), table.to(views[0].device), key.to(views[0].device))
        self._load({n: snapshot[n] + d for n, d in deltas.items()})
        self._table, self._last_steps = table, len(self._steps)
        self._rounds += 1
        self._silenced += silenced
        self._end_round()
        return {n: d.detach().clone() for n, d in deltas.items()}

    def _decide(self) -> bool:
        """Count the round's examples (one call: all or none); True when the round must be silenced."""
        if self._exposure is None:
            return False
        over = self._exposure.decide()
        if not over:
            return False
        self._exposure.discard()
        if self.config.exposure is ExposurePolicy.REFUSE:
            raise RuntimeError(
                f"export() refused: {over} example(s) of this round hold text already in "
                f"{self._exposure.budget} exported round(s), the exposure budget (noise averages out over "
                "repeated exports). The round was aborted (snapshot restored): train the next round on fresh "
                "examples, or pass AegisConfig(exposure=ExposurePolicy.SILENCE) to export pure noise instead")
        return True

    def _public_table(self) -> Tensor:
        """(T, 4) public parameters from the same local training on public batches from the snapshot."""
        assert self._snapshot is not None
        if not self._flooded:
            return torch.zeros(0, 4)
        trained = {p.name: p.param.detach().clone() for p in self._exported}
        self._load(self._snapshot)
        groups = [{**s, "params": g["params"]} for s, g in zip(self._steps[0], self.optimizer.param_groups)]
        factory: Any = type(self.optimizer)
        try:
            public_opt = factory(groups)
        except TypeError as err:
            raise TypeError(f"delta mode rebuilds the optimizer for the public round as "
                            f"{type(self.optimizer).__name__}(param_groups) and that failed ({err}); use a "
                            "torch.optim optimizer") from None
        reset = getattr(self._loss, "reset", None)
        if callable(reset):
            reset()
        paused = self._exposure.paused() if self._exposure is not None else contextlib.nullcontext()
        try:
            with paused, torch.enable_grad():
                for settings in self._steps:
                    for group, s in zip(public_opt.param_groups, settings):
                        group.update(copy.copy(s))
                    public_opt.zero_grad(set_to_none=True)
                    assert self._loss is not None
                    loss = self._loss()
                    if not isinstance(loss, Tensor) or loss.dim() != 0 or not loss.requires_grad:
                        raise ValueError("calibration_loss must return a scalar loss tensor that depends on the "
                                         "model's parameters")
                    loss.backward()
                    public_opt.step()
            deltas = [(p.param.detach() - self._snapshot[p.name]).float() for p in self._flooded]
            table = delta_table(self._flooded, deltas, self.config.rel_threshold)
        finally:
            self._load(trained)
            for p in self._exported:
                p.param.grad = None
        return table.values

    # -- state -----------------------------------------------------------------------------------------
    def _load(self, values: dict[str, Tensor]) -> None:
        with torch.no_grad():
            for p in self._exported:
                p.param.copy_(values[p.name])

    def _drop_local_state(self) -> None:
        """Gradients and optimizer state hold the round's private data: they never outlive it."""
        for p in self.plans:
            p.param.grad = None
        self.optimizer.state.clear()

    def _end_round(self) -> None:
        self._drop_local_state()
        self._snapshot, self._steps = None, []
        self._holding.close()
        if self._exposure is not None:
            self._exposure.discard()

    # -- reporting -------------------------------------------------------------------------------------
    def public_params(self) -> dict[str, tuple[float, float, float, float]]:
        """{name: (rho, sigma, clip, thr)} of the last export's flooded tensors ({} before the first)."""
        if self._table is None:
            return {}
        return {p.name: tuple(row) for p, row in zip(self._flooded, self._table.double().cpu().tolist())}

    def report(self) -> DeltaReport:
        table = self.public_params()
        rows = []
        for p in self.plans:
            row = DeltaRow(p.name, p.role, p.action, tuple(p.param.shape), p.param.numel())
            if p.name in table:
                rho, sigma, clip, _ = table[p.name]
                snr = rho * clip / sigma if sigma > 0 else (0.0 if rho * clip == 0 else math.inf)
                row = dataclasses.replace(row, rho=rho, sigma=sigma, clip=clip, snr=snr)
            rows.append(row)
        z: float | None = None
        if any(p.trainable and p.clean for p in self.plans):
            z = 0.0
        elif table or not self._flooded:
            shapes = {r.name: r.shape for r in rows}
            z = noise_multiplier(table, shapes, {p.name: m for p, m in zip(self._flooded, self._modes)})
        seen = self._exposure.max_exposure if self._exposure is not None else 0
        return DeltaReport(rows, self._rounds, self._last_steps, self.config.exposures, self.config.exposure, seen,
                           self._silenced, z)

    def remove(self) -> None:
        """Detach the optimizer hook and the exposure counter (frozen parameters stay frozen)."""
        if self.in_round:
            self.abort_round()
        self._hook.remove()
        if self._exposure is not None:
            self._exposure.remove()
            self._exposure = None
