"""The shield: freezes attention, floods every other trainable gradient, exports only masked ones."""
from __future__ import annotations

import contextlib
import gc
import math
import os
import warnings
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import Tensor, nn

import aegis_kernels  # noqa: F401  (registers torch.ops.aegis)
import aegis_kernels.reference as ref
from aegis_kernels.cuda_graph import GraphedFlood

from . import ranks
from .accounting import DELTA, PrivacyStatement, noise_multiplier, statement
from .calibration import PublicLoss, public_statistics, synthetic_loss
from .config import AegisConfig, Calibration, ExportMode
from .exposure import ExposurePolicy, ExposureTracker, input_embeddings
from .policy import ParamPlan, plan, rows_view


@dataclass(frozen=True)
class ReportRow:
    name: str
    role: str
    action: str
    lam: float | None
    rho: float | None
    shape: tuple[int, ...]
    numel: int
    # rho * clip / sigma of the public calibration: the largest exported signal of one row (rows flood) or
    # of the tensor (matrix flood) over the per-entry noise, i.e. the matched-filter SNR an attacker who
    # knows the candidate's gradient gets from one export (None before the first calibration, or BATCH)
    snr: float | None = None
    snr_cap: float | None = None  # Treatment.snr of a flood (None: uncapped, or not flooded)


@dataclass(frozen=True)
class CoverageReport:
    rows: list[ReportRow]
    calibration: Calibration = Calibration.PUBLIC
    exposure_budget: int = 1  # exports per example the configuration's strength covers
    exposure: ExposurePolicy = ExposurePolicy.REFUSE  # OFF: nothing enforces the budget
    max_exposure: int = 0  # the most exports any one fingerprint has had so far
    silenced_steps: int = 0  # steps exported as pure noise (ExposurePolicy.SILENCE past the budget)
    skipped_steps: int = 0  # steps with a non-finite gradient: nothing exported, no optimizer step
    # z of one export under the public table (aegis.accounting.noise_multiplier, every row of a rows flood
    # counted): also a secure round's sum at the pin (n >= t shares of sigma / sqrt(t) add to the full flood).
    # 0 with a clean export (no finite epsilon); None before the first calibration or under BATCH.
    noise_multiplier: float | None = None

    def privacy(self, delta: float = DELTA) -> PrivacyStatement | None:
        """(epsilon, delta) per example when each is exported at most ``exposure_budget`` times (a secure
        round counts one export of the examples in its batch); None where no noise multiplier is public.
        The budget is enforced unless ``exposure`` is OFF; then the statement covers the budget only."""
        if self.noise_multiplier is None:
            return None
        return statement(self.noise_multiplier, self.exposure_budget, delta=delta)

    @property
    def leaks_flood_level(self) -> bool:
        """The paper's batch calibration: the exported noise level fingerprints the private batch."""
        return self.calibration is Calibration.BATCH and bool(self.flooded)

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

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None, config: AegisConfig,
                 calibration_loss: PublicLoss | None = None):
        self.model, self.config = model, config
        _refuse_second_shield(model, optimizer)
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
        # a rows treatment floods rows along the token axis; a factor with none gets the matrix flood
        self._modes = [p.treatment.kind if p.treatment.kind == "matrix" or p.rows_axis is not None else "matrix"
                       for p in self._flooded]
        self._transposed = [p.treatment.kind == "rows" and p.rows_axis == 1 for p in self._flooded]
        self._loss = calibration_loss
        self._params: Tensor | None = None  # public (rho, sigma, clip, thr) per flooded tensor, updated in place
        self._calibrated_step = -1
        self._fixed_key = ref.key_from_int(config.seed) if config.seed is not None else None
        self._step = 0
        self._masked: list[tuple[weakref.ref | None, int]] | None = None
        self._checksum: Tensor | None = None
        self._mode_string = ",".join(self._modes)
        self._graphed: GraphedFlood | None = None
        self._hook = None
        self._skipped: list[str] = []  # non-finite gradients of the last mask_() (a skipped step)
        self._skipped_steps = self._silenced_steps = 0
        self._grad_arrived = False  # a backward reached a trainable parameter since the last mask_()
        self._exposure: ExposureTracker | None = None  # counts exposures, or (OFF) only the rows of a step
        counting = config.exposure is not ExposurePolicy.OFF
        if self._flooded and (counting or input_embeddings(model) is not None):
            self._exposure = ExposureTracker(model, config.exposures, _weakly(self._flooded_grads),
                                             config.exposure_state, counting=counting)
        # The model's hooks hold the shield weakly: a shield nobody holds (and no optimizer hooks) is collected,
        # its hooks go with it, and the model may be protected again. The optimizer hook holds it strongly.
        handles = [p.param.register_post_accumulate_grad_hook(_weakly(self._on_gradient))
                   for p in self.plans if p.trainable and p.treatment.kind != "frozen"]
        handles += self._exposure.handles if self._exposure is not None else []
        self._detach = weakref.finalize(self, _remove_all, handles)
        if optimizer is not None:
            _drop_from_optimizer(optimizer, frozen)
            self._hook = optimizer.register_step_pre_hook(lambda *_: self.ensure_masked())
        _register(self, model, optimizer)

    # -- calibration ---------------------------------------------------------------------
    def calibrate(self) -> None:
        """Recompute every flooded tensor's public (rho, sigma, clip, thr) from the public loss."""
        if not self._flooded:
            return
        if self._loss is None:
            self._loss = synthetic_loss(self.model)
        tau = self.config.rel_threshold
        with self._untracked():
            stats = public_statistics([p.param for p in self._flooded], self._modes, self._loss, tau, self._transposed)
        table = torch.stack([
            ref.public_params(stat, mode, p.treatment.rho, p.treatment.lam, tau, p.treatment.clip, p.treatment.snr)
            for stat, mode, p in zip(stats, self._modes, self._flooded)
        ])
        if self._params is None or self._params.device != table.device:
            self._params = table
        else:
            self._params.copy_(table)  # in place: a captured graph reads this address
        self._calibrated_step = self._step

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
        if self._params is None or self._step - self._calibrated_step >= self.config.refresh_every:
            self.calibrate()
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
        return {p.name: tuple(row) for p, row in zip(self._flooded, table)}

    def _untracked(self):
        """Forwards on the public calibration batch are not exposures of the client's examples."""
        return self._exposure.paused() if self._exposure is not None else contextlib.nullcontext()

    def _step_params(self, tensors: list[Tensor]) -> Tensor:
        """The (n, 4) parameter table of this step."""
        if self.config.calibration is Calibration.BATCH:
            tau = self.config.rel_threshold
            return torch.stack([ref.batch_params(g, mode, p.treatment.rho, p.treatment.lam, tau)
                                for g, p, mode in zip(tensors, self._flooded, self._modes)])
        if self._params is None or self._step - self._calibrated_step >= self.config.refresh_every:
            self.calibrate()
        assert self._params is not None
        return self._params

    # -- masking -------------------------------------------------------------------------
    def mask_(self) -> None:
        """Flood every trainable gradient in place, one grouped ``flood_`` call under a fresh secret key.

        A flooded parameter the backward did not reach is flooded as a zero gradient (an exact zero would
        tell which modules the batch used). A non-finite gradient skips the step: every gradient is
        dropped (the optimizer step changes nothing), ``export()`` refuses, a warning names the tensors."""
        if self.is_masked:
            raise RuntimeError(
                "mask_() called twice on the same gradients: they are already masked (a second flood "
                "would add noise twice). Call backward() again first, or use ensure_masked()"
            )
        capturing = torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
        if capturing and not self.config.device_seed:
            raise RuntimeError(
                "mask_() inside a CUDA-graph capture needs AegisConfig(device_seed=True): with a host key the graph "
                "replays one key on every step, and the difference of two exports is noise-free"
                + ("" if not self._counting else " (and exposure=ExposurePolicy.OFF: a replay counts nothing)")
            )
        if capturing and self._counting:
            raise RuntimeError(
                "mask_() inside a CUDA-graph capture cannot count exposures (a replay runs no Python hook and "
                "the token ids stay on the device): pass AegisConfig(exposure=ExposurePolicy.OFF) and keep "
                "each example within the preset's exposure budget yourself"
            )
        if not self._grad_arrived:
            raise RuntimeError(
                "mask_() with no gradient since the last step: call loss.backward() first (flooding zeros would "
                "export and step on noise alone)"
            )
        silenced = self._decide()  # the budget decision, committed before anything is flooded
        grads: list[Tensor] = []
        for p in self._flooded:
            if p.param.grad is None:
                p.param.grad = torch.zeros_like(p.param)
            grads.append(p.param.grad)
        tensors, modes = self._views(grads)
        if tensors:
            params = self._step_params(tensors)
            if silenced:
                params = params.clone()
                params[:, 0] = 0.0  # rho = 0: pure noise, nothing of this batch leaves
                torch.ops.aegis.flood_(tensors, modes, params, self._step_key(tensors[0].device))
            elif self.config.device_seed:
                torch.ops.aegis.flood_keyed_(tensors, modes, params, self._device_state(tensors[0].device))
            elif self._graphable(tensors) and self._graphed is not None:
                self._graphed(tensors, modes, params, self._master_words(), self._step)
            else:
                torch.ops.aegis.flood_(tensors, modes, params, self._step_key(tensors[0].device))
        self._step += 1
        norms = _norms(tensors)
        # a NaN or inf anywhere in a gradient makes its flooded tensor non-finite (the clip scale and the
        # rows' norms carry it), so the norms the export check needs anyway find it; a capture cannot sync
        if norms is not None and not capturing and not bool(torch.isfinite(norms).all()):
            self._skip(norms)
            return
        if self._exposure is not None:
            self._exposure.discard()
        self._silenced_steps += silenced
        self._grad_arrived = False
        self._skipped = []
        self._masked = [(weakref.ref(g), g._version) for g in grads]
        self._checksum = None if norms is None else norms.view(torch.int32)

    def _skip(self, norms: Tensor) -> None:
        bad = torch.isfinite(norms).logical_not().nonzero().flatten().tolist()
        self._skipped = [self._flooded[i].name for i in bad]
        for p in self.plans:
            if p.trainable:
                p.param.grad = None
        if self._exposure is not None:
            self._exposure.discard()
        self._skipped_steps += 1
        self._grad_arrived = False
        self._masked = None
        shown = ", ".join(self._skipped[:5]) + (f" and {len(self._skipped) - 5} more" if len(self._skipped) > 5 else "")
        warnings.warn(f"AEGIS skipped this step: non-finite gradient in {shown}. Nothing is exported and the optimizer "
                      "step changes nothing (every gradient was dropped); with torch.amp.GradScaler let "
                      "scaler.step(optimizer) run the shield's optimizer hook after unscaling", stacklevel=3)

    def track_examples(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> None:
        """Count this step's examples from their ids when the forward received ``inputs_embeds``."""
        if self._exposure is None or not self._exposure.counting:
            raise RuntimeError("track_examples(): exposure tracking is off (ExposurePolicy.OFF or nothing flooded)")
        self._exposure.track(input_ids, attention_mask)

    @property
    def _counting(self) -> bool:
        return self._exposure is not None and self._exposure.counting

    def _on_gradient(self, param: Tensor) -> None:
        self._grad_arrived = True
        if self._exposure is not None:
            self._exposure.note_backward()

    def _flooded_grads(self) -> list[Tensor | None]:
        return [p.param.grad for p in self._flooded]

    def _decide(self) -> bool:
        """The exposure decision of this step (one store transaction): True when it must be silenced;
        raises under ExposurePolicy.REFUSE."""
        if self._exposure is None:
            return False
        if self._exposure.rows_pending:
            self.config.check_batch(self._exposure.rows_pending)  # the promise's batch sizes, unless opted out
        if not self._exposure.counting:
            return False
        over = self._exposure.decide()
        if not over:
            return False
        if self.config.exposure is ExposurePolicy.REFUSE:
            # the examples stay pending: a retry (mask_(), the optimizer hook, a Trainer callback) is
            # refused again until the gradients are dropped (not merely changed) and a fresh batch runs
            self._exposure.refuse(self._flooded_grads())
            store = self._exposure.store
            assert store is not None
            raise RuntimeError(
                f"mask_() refused: {over} example(s) of this batch hold text already exported "
                f"{self._exposure.budget} time(s), the exposure budget of this configuration (noise averages "
                f"out over repeated exports), counted in {store.path or 'memory (IN_MEMORY)'} "
                f"({store.exports_here} export(s) of it by this process). Drop these gradients "
                "(optimizer.zero_grad()) and skip the batch, raise lam by sqrt(K/budget) and set "
                "AegisConfig(exposure_budget=K), or AegisConfig(exposure=ExposurePolicy.SILENCE) to export pure "
                "noise for such steps"
            )
        return True

    def _views(self, grads: list[Tensor]) -> tuple[list[Tensor], str]:
        """The gradients as the flood sees them (rows floods on the ids x width view) and their modes."""
        for p, g in zip(self._flooded, grads):
            if g.layout != torch.strided:
                raise ValueError(
                    f"{p.name} has a sparse gradient: AEGIS floods dense gradients only; build the "
                    "embedding with sparse=False (a sparse gradient would reveal the tokens it touches)"
                )
        views = [rows_view(g, t) if m == "rows" else g for g, m, t in zip(grads, self._modes, self._transposed)]
        return views, self._mode_string

    def _graphable(self, tensors: list[Tensor]) -> bool:
        """CUDA-graph replay of the flood: on (config.cuda_graph), public calibration, all on one GPU,
        not inside a capture."""
        if not (self.config.cuda_graph and tensors and tensors[0].is_cuda):
            return False
        if self.config.calibration is not Calibration.PUBLIC:
            return False
        device = tensors[0].device
        if any(t.device != device for t in tensors) or torch.cuda.is_current_stream_capturing():
            return False
        if self._graphed is None or self._graphed.state.device != device:
            self._graphed = GraphedFlood(device)
        return True

    def _step_key(self, device: torch.device) -> Tensor:
        """A fresh 256-bit key per step (or, in tests, the fixed key's step key) on ``device``. A CUDA
        copy leaves from pinned memory without blocking: a blocking copy waits for the backward."""
        key = ref.derive_key(self._fixed_key, self._step) if self._fixed_key is not None else ref.new_key()
        key = ranks.shared_key(key)
        if device.type != "cuda":
            return key.to(device)
        return key.pin_memory().to(device, non_blocking=True)

    def _master_words(self) -> list[int]:
        """The graph derives the step key from this and the step (a fixed test key: as eagerly)."""
        return ranks.shared_key(self._fixed_key if self._fixed_key is not None else ref.new_key()).tolist()

    def _device_state(self, device: torch.device) -> Tensor:
        """[master key x 8, step] on the gradients' device, advanced by the op itself (CUDA-graph
        replay); redrawn in a forked child so two processes never share a key."""
        if ranks.distributed():
            raise RuntimeError("AegisConfig(device_seed=True) under torch.distributed: each rank would draw its own "
                               "master key and the replicas would drift apart; use device_seed=False (rank 0's "
                               "host key is shared with every rank)")
        held = _DEVICE_STATES.get(self)
        if held is None or held[1] != os.getpid() or held[0].device != device:
            fresh = self._fixed_key is None
            master = ref.new_key() if self._fixed_key is None else self._fixed_key
            held = _DEVICE_STATES[self] = (torch.cat([master, torch.tensor([self._step])]).to(device), os.getpid())
            if fresh:
                master.zero_()  # the host copy; the key lives on in the device state only
        return held[0]

    @property
    def flood_graph_counts(self) -> dict[str, int]:
        """{"replays": n, "captures": n} of the CUDA-graph flood (``config.cuda_graph``); {} before one exists."""
        graphed = self._graphed
        return {} if graphed is None else {"replays": graphed.replays, "captures": graphed.captures}

    @property
    def silenced_steps(self) -> int:
        """Steps exported as pure noise because their text was past the exposure budget (SILENCE)."""
        return self._silenced_steps

    @property
    def skipped_steps(self) -> int:
        """Steps with a non-finite gradient: nothing exported, the optimizer step a no-op."""
        return self._skipped_steps

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
                "nothing to export. Run backward() on a fresh batch and mask_() again"
            )
        if not self.is_masked:
            raise RuntimeError(
                "export() refused: the gradients are not masked (call shield.mask_() after backward(), "
                "or export before optimizer.zero_grad())"
            )
        if self._exposure is not None:
            self._exposure.wait_durable()  # the reservation survives a power loss before anything leaves
        current = _norms([g for g in (p.param.grad for p in self._flooded) if g is not None])
        if self._checksum is not None and (current is None or not torch.equal(current.view(torch.int32),
                                                                              self._checksum)):
            raise RuntimeError(
                "export() refused: a gradient changed after mask_() without a version bump (a write through "
                ".data?); call backward() and mask_() again"
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
        snr = {}
        if self._params is not None and self.config.calibration is Calibration.PUBLIC:
            table = self._params.detach().double().cpu()
            snr = {p.name: float(rho * clip / sigma) if sigma > 0 else float("inf")
                   for p, (rho, sigma, clip, _) in zip(self._flooded, table.tolist())}
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
                    snr=snr.get(p.name),
                    snr_cap=p.treatment.snr if flooded and math.isfinite(p.treatment.snr) else None,
                )
            )
        seen = self._exposure.max_exposure if self._exposure is not None else 0
        z = None
        if any(r.action.startswith("CLEAN") for r in rows):
            z = 0.0
        elif snr or not self._flooded:
            z = noise_multiplier(self.public_params() if self._flooded else {}, {r.name: r.shape for r in rows},
                                 {p.name: m for p, m in zip(self._flooded, self._modes)})
        return CoverageReport(rows, self.config.calibration, self.config.exposures, self.config.exposure, seen,
                              self._silenced_steps, self._skipped_steps, z)

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
        _unregister(self)
        self._exposure = None


def _weakly(method: Callable) -> Callable:
    """``method`` called through a weak reference to its object (None once that is collected)."""
    ref = weakref.WeakMethod(method)

    def call(*args: object) -> object:
        bound = ref()
        return None if bound is None else bound(*args)

    return call


def _remove_all(handles: list) -> None:
    for handle in handles:
        handle.remove()


def _norms(tensors: list[Tensor]) -> Tensor | None:
    """Per-tensor fp32 L2 norms on the device: their bits are export()'s checksum against mask_()'s."""
    if not tensors:
        return None
    return torch.stack([n.to(tensors[0].device) for n in torch._foreach_norm(tensors, 2, dtype=torch.float32)])


def _unchanged(snapshot: list[tuple[weakref.ref | None, int]], grads: list[Tensor | None]) -> bool:
    """Whether every gradient is the very tensor, at the very version, of ``snapshot``."""
    for (ref_, version), grad in zip(snapshot, grads):
        if ref_ is None:
            if grad is not None:
                return False
            continue
        if grad is None:
            return False
        if grad._version != version or ref_() is not grad:
            return False
    return True


# The device-seed state [master key x 8, step] of each shield, kept off the shield object so that its
# attributes, vars(), gc.get_referents() and pickling never reach the key; gone with the shield.
_DEVICE_STATES: weakref.WeakKeyDictionary[Shield, tuple[Tensor, int]] = weakref.WeakKeyDictionary()

# Live shields by id of the parameters and optimizers they guard (a second shield would flood twice); each
# entry keeps weak references to the object and its shield, so a copy of a model is not guarded.
_GUARDED: dict[int, tuple[weakref.ref, weakref.ref[Shield]]] = {}


def _guard_of(obj: object) -> Shield | None:
    entry = _GUARDED.get(id(obj))
    if entry is None or entry[0]() is not obj:
        return None
    return entry[1]()


def _refuse_second_shield(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
    if any(_guard_of(obj) is not None for obj in [*model.parameters(), optimizer] if obj is not None):
        gc.collect()  # a shield nobody holds may still sit in a reference cycle
    for obj, what in [*((p, f"parameter {n}") for n, p in model.named_parameters()), (optimizer, "optimizer")]:
        shield = _guard_of(obj) if obj is not None else None
        if shield is not None:
            raise ValueError(
                f"protect(): the {what} is already protected by {shield!r} (its optimizer hook would flood "
                "the gradients a second time): use that shield, or call its remove() before protecting again"
            )


def _register(shield: Shield, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
    for key, entry in list(_GUARDED.items()):  # forget collected objects
        if entry[0]() is None or entry[1]() is None:
            del _GUARDED[key]
    held = weakref.ref(shield)
    for obj in [*(p.param for p in shield.plans if p.trainable), *([optimizer] if optimizer is not None else [])]:
        _GUARDED[id(obj)] = (weakref.ref(obj), held)


def _unregister(shield: Shield) -> None:
    for key, entry in list(_GUARDED.items()):
        if entry[1]() is shield:
            del _GUARDED[key]


def _drop_from_optimizer(optimizer: torch.optim.Optimizer, frozen: list[nn.Parameter]) -> None:
    """Frozen parameters leave the optimizer so weight decay or momentum cannot move them."""
    ids = {id(p) for p in frozen}
    for group in optimizer.param_groups:
        group["params"] = [p for p in group["params"] if id(p) not in ids]
    for p in frozen:
        optimizer.state.pop(p, None)


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
