"""The shield: freezes attention, floods every other trainable gradient, exports only masked ones.

``mask_()`` reads as named steps, like an Opacus optimizer's ``pre_step``: ``_check`` (a fresh gradient to mask),
``_decide`` (the exposure budget: one store transaction, mostly taken already at the backward's first gradient),
``_table`` (the public table), the flood under a fresh key (``aegis.flood.Flood``), ``_commit`` (the state
``export()`` verifies)."""
from __future__ import annotations

import contextlib
import warnings
import weakref
from collections.abc import Iterator
from concurrent.futures import Future

import torch
from torch import Tensor, nn

from .calibration import PublicLoss, batch_table, public_table, synthetic_loss
from .config import AegisConfig, Calibration, ExportMode, NonFinite
from .coverage import CoverageReport, coverage_report
from .exposure import ExposurePolicy, ExposureTracker, input_embeddings
from .flood import Flood, norms
from .guard import drop_from_optimizer, refuse_second_shield, register, remove_all, unregister, weakly
from .policy import ParamPlan, plan, rows_view

Snapshot = list[tuple[weakref.ref | None, int]]  # each gradient's identity and version


class Shield:
    """Created by :func:`aegis.protect`. ``mask_()`` floods gradients in place; ``export()`` shares them."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None, config: AegisConfig,
                 calibration_loss: PublicLoss | None = None):
        self.model, self.config = model, config
        refuse_second_shield(model, optimizer)
        planned = plan(model, config)
        frozen = [p.param for p in planned if p.treatment.kind == "frozen"]
        for param in frozen:
            param.requires_grad_(False)
            param.grad = None
        # Re-plan: trainability changed for the frozen parameters.
        self.plans = [ParamPlan(p.name, p.param, p.role, p.treatment, p.param.requires_grad, p.clean) for p in planned]
        self._flooded = [p for p in self.plans if p.flooded]
        self._mode_string = ",".join(p.flood_mode for p in self._flooded)
        self._loss = calibration_loss
        self._params: Tensor | None = None  # the public table's values, updated in place (a graph reads them)
        self._calibrated_step = -1
        self._flood = Flood(config)
        self._masked: Snapshot | None = None
        self._checksum: Tensor | None = None
        self._hook = None
        self._skipped: list[str] = []  # non-finite gradients of the last mask_() (a skipped step)
        self._skipped_steps = self._silenced_steps = 0
        self._grad_arrived = False  # a backward reached a trainable parameter since the last mask_()
        self._exposure: ExposureTracker | None = None  # counts exposures, or (OFF) only the rows of a step
        counting = config.exposure is not ExposurePolicy.OFF
        if self._flooded and (counting or input_embeddings(model) is not None):
            self._exposure = ExposureTracker(model, config.exposures, weakly(self._flooded_grads),
                                             config.exposure_state, counting=counting, precheck=config.check_batch)
        # The model's hooks hold the shield weakly: a shield nobody holds (and no optimizer hooks) is collected,
        # its hooks go with it, and the model may be protected again. The optimizer hook holds it strongly.
        handles = [p.param.register_post_accumulate_grad_hook(weakly(self._on_gradient))
                   for p in self.plans if p.trainable and p.treatment.kind != "frozen"]
        handles += self._exposure.handles if self._exposure is not None else []
        self._detach = weakref.finalize(self, remove_all, handles)
        if optimizer is not None:
            drop_from_optimizer(optimizer, frozen)
            self._hook = optimizer.register_step_pre_hook(lambda *_: self.ensure_masked())
        register(self, [p.param for p in self.plans if p.trainable], optimizer)

    # -- calibration ---------------------------------------------------------------------
    def calibrate(self) -> None:
        """Recompute every flooded tensor's public (rho, sigma, clip, thr) from the public loss."""
        if not self._flooded:
            return
        if self._loss is None:
            self._loss = synthetic_loss(self.model)
        with self._untracked():
            table = public_table(self._flooded, self._loss, self.config.rel_threshold).values
        if self._params is None or self._params.device != table.device:
            self._params = table
        else:
            self._params.copy_(table)  # in place: a captured graph reads this address
        self._calibrated_step = self._flood.step

    def _calibrate_if_due(self) -> None:
        if self._params is None or self._flood.step - self._calibrated_step >= self.config.refresh_every:
            self.calibrate()

    @contextlib.contextmanager
    def scaled_table(self, *, sigma: float = 1.0, clip: float = 1.0) -> Iterator[Tensor]:
        """For the ``mask_()`` calls in the block: the public table with sigma times ``sigma`` and clip and
        threshold times ``clip`` (a secure-aggregation share floods with sigma / sqrt(t)); restored after.
        Calibrates first when due, so no recalibration overwrites the scaled table in the block. Yields a copy
        of the table the floods use."""
        if self.config.calibration is not Calibration.PUBLIC:
            raise ValueError("scaled_table() needs AegisConfig(calibration=Calibration.PUBLIC): the batch "
                             "calibration's sigma depends on the private batch, so no share of it can be sized")
        if not (sigma >= 0 and clip > 0):
            raise ValueError(f"scaled_table(sigma={sigma}, clip={clip}): sigma >= 0 and clip > 0")
        self._calibrate_if_due()
        table = self._params
        if table is None:  # nothing flooded
            yield torch.zeros(0, 4)
            return
        saved = table.clone()
        table[:, 1] *= sigma
        table[:, 2:] *= clip
        try:
            yield table.detach().cpu().clone()
        finally:
            table.copy_(saved)

    def public_params(self) -> dict[str, tuple[float, float, float, float]]:
        """{name: (rho, sigma, clip, thr)} of every flooded tensor under the public calibration (computed
        now if it has not run yet): public constants, what a server may know (never the key)."""
        if self.config.calibration is not Calibration.PUBLIC:
            raise ValueError("public_params(): Calibration.BATCH computes them from each private batch")
        if self._params is None:
            self.calibrate()
        table = [] if self._params is None else self._params.detach().double().cpu().tolist()
        return {p.name: (r[0], r[1], r[2], r[3]) for p, r in zip(self._flooded, table)}

    def _untracked(self):
        """Forwards on the public calibration batch are not exposures of the client's examples."""
        return self._exposure.paused() if self._exposure is not None else contextlib.nullcontext()

    # -- masking: check -> decide -> table -> flood -> commit ----------------------------
    def mask_(self) -> None:
        """Flood every trainable gradient in place, one grouped ``flood_`` call under a fresh secret key.

        A flooded parameter the backward did not reach is flooded as a zero gradient (an exact zero would
        tell which modules the batch used). A non-finite gradient: ``export()`` refuses the step; with
        ``NonFinite.SKIP`` every gradient is dropped here (the optimizer step changes nothing) and a warning
        names the tensors (``config.non_finite``)."""
        capturing = self._check()
        decision = self._decide()
        grads = [_gradient(p.param) for p in self._flooded]
        views = self._views(grads)
        checks = None  # the checksum: the norms of the flooded gradients (a CUDA graph takes them with the flood)
        if views:  # launched while the decision's transaction runs; nothing steps or leaves before it is in
            checks = self._flood(views, self._mode_string, self._table(views))
        if checks is None:
            checks = norms(grads)
        silenced = self._settle(decision)
        if silenced and views:  # over the budget: the flood is replaced by pure noise (rho = 0)
            self._flood(views, self._mode_string, self._table(views), pure_noise=True)
            checks = norms(grads)
        self._flood.step += 1
        self._commit(grads, checks, silenced, capturing)

    def _check(self) -> bool:
        """Refuse what cannot be masked; True inside a CUDA-graph capture."""
        if self.is_masked:
            raise RuntimeError("mask_() called twice on the same gradients: they are already masked (a second flood "
                               "would add noise twice). Call backward() again first, or use ensure_masked()")
        if not self._grad_arrived:
            raise RuntimeError("mask_() with no gradient since the last step: call loss.backward() first (flooding "
                               "zeros would export and step on noise alone)")
        return self._flood.capturing(counting=self._counting)

    def _decide(self) -> Future[int] | None:
        """This step's exposure decision (one store transaction in the decider, mostly started at the backward's
        first gradient); refuse at once a batch outside the preset's promise or one whose examples cannot be
        counted."""
        if self._exposure is None:
            return None
        if self._exposure.rows_pending:
            self.config.check_batch(self._exposure.rows_pending)  # the promise's batch sizes, unless opted out
        return self._exposure.decide_async() if self._exposure.counting else None

    def _settle(self, decision: Future[int] | None) -> bool:
        """Join the decision: True when the step must be silenced; raises under ExposurePolicy.REFUSE."""
        if decision is None or self._exposure is None:
            return False
        over = decision.result()
        if not over:
            return False
        if self.config.exposure is ExposurePolicy.REFUSE:
            # the examples stay pending: a retry (mask_(), the optimizer hook, a Trainer callback) is
            # refused again until the gradients are dropped (not merely changed) and a fresh batch runs
            raise self._exposure.refuse(over, self._flooded_grads())
        return True

    def _views(self, grads: list[Tensor]) -> list[Tensor]:
        """The gradients as the flood sees them (rows floods on the ids x width view)."""
        for p, g in zip(self._flooded, grads):
            if g.layout != torch.strided:
                raise ValueError(f"{p.name} has a sparse gradient: AEGIS floods dense gradients only; build the "
                                 "embedding with sparse=False (a sparse gradient would reveal the tokens it touches)")
        return [rows_view(g, p.transposed) if p.flood_mode == "rows" else g for g, p in zip(grads, self._flooded)]

    def _table(self, views: list[Tensor]) -> Tensor:
        """The (n, 4) parameter table of this step: the public one, or the paper's from the batch."""
        if self.config.calibration is Calibration.BATCH:
            return batch_table(self._flooded, views, self.config.rel_threshold).values
        self._calibrate_if_due()
        assert self._params is not None
        return self._params

    def _commit(self, grads: list[Tensor], checks: Tensor | None, silenced: bool, capturing: bool) -> None:
        """Record the masked state export() checks; under NonFinite.SKIP a non-finite gradient skips the step
        instead (a NaN or inf makes its flooded tensor non-finite, so the checksum's norms find it). Only SKIP
        waits for the device here; a capture cannot."""
        if (checks is not None and not capturing and self.config.non_finite is NonFinite.SKIP
                and not bool(torch.isfinite(checks).all())):
            self._skip(checks)
            return
        if self._exposure is not None:
            self._exposure.discard()
        self._silenced_steps += silenced
        self._grad_arrived = False
        self._skipped = []
        self._masked = [(weakref.ref(g), g._version) for g in grads]
        self._checksum = None if checks is None else checks.view(torch.int32)

    def _non_finite(self, checks: Tensor) -> list[str]:
        return [self._flooded[i].name for i in torch.isfinite(checks).logical_not().nonzero().flatten().tolist()]

    def _skip(self, checks: Tensor) -> None:
        self._skipped = self._non_finite(checks)
        for p in self.plans:
            if p.trainable:
                p.param.grad = None
        if self._exposure is not None:
            self._exposure.discard()
        self._skipped_steps += 1
        self._grad_arrived = False
        self._masked = None
        warnings.warn(f"AEGIS skipped this step: non-finite gradient in {_shown(self._skipped)}. Nothing is exported "
                      "and the optimizer step changes nothing (every gradient was dropped); with torch.amp.GradScaler "
                      "let scaler.step(optimizer) run the shield's optimizer hook after unscaling", stacklevel=3)

    def track_examples(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> None:
        """Count this step's examples from their ids when the forward received ``inputs_embeds``."""
        if self._exposure is None or not self._exposure.counting:
            raise RuntimeError("track_examples(): exposure tracking is off (ExposurePolicy.OFF or nothing flooded)")
        self._exposure.track(input_ids, attention_mask)

    _counting = property(lambda self: self._exposure is not None and self._exposure.counting)

    def _on_gradient(self, param: Tensor) -> None:
        self._grad_arrived = True
        if self._exposure is not None:
            self._exposure.note_backward()

    def _flooded_grads(self) -> list[Tensor | None]:
        return [p.param.grad for p in self._flooded]

    @property
    def flood_graph_counts(self) -> dict[str, int]:
        """{"replays": n, "captures": n} of the CUDA-graph flood (``config.cuda_graph``); {} before one exists."""
        g = self._flood.graphed
        return {} if g is None else {"replays": g.replays, "captures": g.captures}

    # steps exported as pure noise (their text past the budget, SILENCE); steps skipped (non-finite gradient)
    silenced_steps = property(lambda self: self._silenced_steps)
    skipped_steps = property(lambda self: self._skipped_steps)

    @property
    def is_masked(self) -> bool:
        """True when every gradient is exactly what the last ``mask_()`` left (no backward since: a shield whose
        trainable tensors are all exported clean has no flooded gradient to compare)."""
        return (self._masked is not None and not self._grad_arrived
                and _unchanged(self._masked, [p.param.grad for p in self._flooded]))

    def ensure_masked(self) -> None:
        """Mask unless already masked: the optimizer hook and Trainer callback call this. After a skipped
        step (non-finite gradient) with no gradient since, there is nothing to mask: the step is a no-op."""
        if self.is_masked or (self._skipped and not self._grad_arrived):
            return
        self.mask_()

    # -- sharing -------------------------------------------------------------------------
    def export(self, include_frozen: bool = False) -> dict[str, Tensor]:
        """{name: masked gradient} of trainable parameters; fails closed unless the gradients are
        exactly what ``mask_()`` produced (same tensors, versions and checksum)."""
        if self._skipped and not self.is_masked:
            raise RuntimeError(
                f"export() refused: the last step was skipped (non-finite gradient in {', '.join(self._skipped)}); "
                "nothing to export. Run backward() on a fresh batch and mask_() again")
        if not self.is_masked:
            raise RuntimeError("export() refused: the gradients are not masked (call shield.mask_() after backward(), "
                               "or export before optimizer.zero_grad())")
        if self._exposure is not None:
            self._exposure.wait_durable()  # the reservation survives a power loss before anything leaves
        current = norms([g for g in (p.param.grad for p in self._flooded) if g is not None])
        if self._checksum is not None and (current is None or not torch.equal(current.view(torch.int32),
                                                                              self._checksum)):
            raise RuntimeError("export() refused: a gradient changed after mask_() without a version bump (a write "
                               "through .data?); call backward() and mask_() again")
        if current is not None and not bool(torch.isfinite(current).all()):  # NonFinite.STEP: found here
            raise RuntimeError(
                f"export() refused: non-finite gradient in {_shown(self._non_finite(current))} (its flood is NaN): "
                "nothing of this step leaves. The optimizer steps on it as it would without AEGIS unless "
                "torch.amp.GradScaler skipped it; AegisConfig(non_finite=NonFinite.SKIP) drops such steps in mask_() "
                "(one device sync per step)")
        out = {}
        for p in self.plans:
            grad = p.param.grad
            if p.flooded or (p.trainable and p.clean):
                out[p.name] = torch.zeros_like(p.param) if grad is None else grad.detach().clone()
            elif include_frozen and p.treatment.kind == "frozen":
                out[p.name] = torch.zeros_like(p.param)
        return out

    def report(self) -> CoverageReport:
        public = (self.public_params() if self._params is not None and self.config.calibration is Calibration.PUBLIC
                  else None)
        seen = self._exposure.max_exposure if self._exposure is not None else 0
        return coverage_report(self.plans, public, self.config, seen, self._silenced_steps, self._skipped_steps)

    def trainer_callback(self):
        """A ``transformers.TrainerCallback`` that masks right before each optimizer step."""
        from .hf import AegisCallback
        return AegisCallback(self)

    def remove(self) -> None:
        """Detach the optimizer hook, the gradient hooks and the exposure counter (parameters stay frozen);
        the model and optimizer may then be protected again."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        self._detach()
        unregister(self)
        self._exposure = None


def _shown(names: list[str]) -> str:
    return ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")


def _gradient(param: nn.Parameter) -> Tensor:
    if param.grad is None:
        param.grad = torch.zeros_like(param)
    return param.grad


def _unchanged(snapshot: Snapshot, grads: list[Tensor | None]) -> bool:
    """Whether every gradient is the very tensor, at the very version, of ``snapshot``."""
    for (ref_, version), grad in zip(snapshot, grads):
        if ref_ is None:
            if grad is not None:
                return False
            continue
        if grad is None or grad._version != version or ref_() is not grad:
            return False
    return True


def protect(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    config: AegisConfig | None = None,
    calibration_loss: PublicLoss | None = None,
) -> Shield:
    """Apply AEGIS to ``model``: freeze attention now; flood before every optimizer step.

    ``calibration_loss()``: a scalar loss on PUBLIC data (e.g. ``aegis.calibration.text_loss``) that
    sets every tensor's noise level and clip bound; None uses synthetic tokens of a fixed shape."""
    config = config or AegisConfig()
    if config.export is ExportMode.DELTA:
        from .delta import DeltaShield

        return DeltaShield(model, optimizer, config, calibration_loss)  # type: ignore[return-value]
    return Shield(model, optimizer, config, calibration_loss)
