"""Flood-level fingerprinting: which of N candidate batches did the client train on?

The paper's batch calibration (``Calibration.BATCH``) sets each flooded tensor's noise level from the
private gradient G itself:

    rows:    sigma = lam * mean_{v in S} ||G[v]||,  S = {v : ||G[v]|| > tau max_u ||G[u]||}
    matrix:  sigma = lam * mean |G|

The exported tensor is ``rho * G (active rows) + sigma Z``; its mean square is sigma^2 plus rho^2 times
the signal's, readable to ~1/sqrt(2n) (0.03 % on a 30522 x 384 embedding) from that one tensor. The ~10-40
per-tensor levels of a model fingerprint the batch. The server, who holds the model and knows the public
defence configuration (Kerckhoffs: never the noise key), predicts the levels of any candidate batch with
one forward/backward and the public formulas (``aegis_kernels.reference.batch_params``), and picks the
candidate whose predicted levels are closest to the observed ones: a 1-of-N membership / completion test
("my pin is ____" over N same-format values; which of a pool of sentences was trained on).

Under ``Calibration.PUBLIC`` (the default) sigma comes from a public batch, so the predicted levels are the
same for every candidate and the ``"level"`` attack is at chance by construction. What still depends on the
batch is the clipped signal ``rho * clip(G)``; two stronger variants read it:

* ``"energy"``: the observed per-tensor mean square against the candidate's predicted
  ``(rho^2 ||clip(G)||^2 + sigma^2 n) / n``;
* ``"likelihood"``: the exact Gaussian log-likelihood of the exported tensors given the candidate,
  ``sum_k n_k ln sigma_k + ||out_k - rho clip(G_k)||^2 / (2 sigma_k^2)`` (the Neyman-Pearson test; under
  PUBLIC it is the matched filter ``<out, rho clip(G)>`` of the candidate's own signal).

Scores are "lower = more likely". Entry points: :func:`flood_levels`, :func:`predicted_levels`,
:func:`verify`, :func:`secret_completion`, :func:`identify_sentence`, :func:`fingerprint_accuracy`.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ..calibration import PublicLoss, batch_table, public_table, synthetic_loss
from ..config import AegisConfig, Calibration
from ..models import is_decoder
from ..policy import ParamPlan, plan, rows_view
from .gradients import shared_gradient, tokenize

__all__ = [
    "VARIANTS",
    "FingerprintAttack",
    "FingerprintResult",
    "Guess",
    "fingerprint_accuracy",
    "fingerprint_accuracies",
    "fingerprint_null",
    "flood_levels",
    "identify_sentence",
    "lm_batch",
    "predicted_levels",
    "rank_of_truth",
    "secret_completion",
    "top_share",
    "verify",
]

VARIANTS = ("level", "energy", "likelihood")
Batch = Mapping[str, Tensor]  # keyword arguments of model(**batch) whose .loss is the client's loss

_ROW_BAND = 8.0  # rows whose mean square lies this many standard deviations above the median carry signal
_TRIM = 6.0  # elements beyond this many (robust) standard deviations are signal, not noise
_MAD = 1.482602218505602  # sigma / median|x| of a centred normal
_SAMPLE = 1 << 20


# ----------------------------------------------------------------------------- observation
def _truncated_second_moment(k: float) -> float:
    """E[z^2 | |z| <= k] for a standard normal (the trimmed mean square's bias factor)."""
    phi = math.exp(-k * k / 2) / math.sqrt(2 * math.pi)
    return 1.0 - 2 * k * phi / math.erf(k / math.sqrt(2))


def _level(x: Tensor) -> tuple[float, int]:
    """Robust noise level of one exported tensor and the number of elements it rests on.

    Rows (first axis) whose mean square lies far above the median row's carry signal and are set aside;
    of the rest, elements beyond _TRIM robust standard deviations too; the trimmed RMS, corrected for the
    trimming, estimates sigma (on pure noise its relative error is ~1/sqrt(2n), as the plain RMS's)."""
    x = x.detach().float()
    if not torch.isfinite(x).all() or not x.any():
        return 0.0, 0
    x = x.reshape(x.shape[0], -1) if x.dim() >= 2 else x.reshape(1, -1)
    if x.shape[0] >= 8 and x.shape[1] >= 8:
        ms = x.pow(2).mean(dim=1)
        x = x[ms <= ms.median() * (1 + _ROW_BAND * math.sqrt(2 / x.shape[1]))]
    flat = x.reshape(-1)
    step = max(1, flat.numel() // _SAMPLE)  # the trim threshold needs no more than a subsample
    s0 = _MAD * flat[::step].abs().median().item()
    if s0 == 0.0:  # more than half the entries are exact zeros: not a flood
        return 0.0, 0
    inside = flat.abs() <= _TRIM * s0
    kept = int(inside.sum())
    total = torch.sum(torch.where(inside, flat * flat, 0.0), dtype=torch.float64).item()
    return math.sqrt(total / kept / _truncated_second_moment(_TRIM)), kept


def flood_levels(grads: Mapping[str, Tensor]) -> dict[str, float]:
    """The attacker's estimate of each exported tensor's noise level sigma (robust trimmed RMS: rows and
    elements that look like signal are set aside). 0.0 for an all-zero or non-finite tensor (closed)."""
    return {name: _level(g)[0] for name, g in grads.items()}


# ----------------------------------------------------------------------------- the defence, rebuilt
@dataclass(frozen=True)
class _Flooded:
    """One flooded tensor as the attack reads it (from the shield's own plan)."""

    plan: ParamPlan

    @property
    def name(self) -> str:
        return self.plan.name

    @property
    def param(self) -> nn.Parameter:
        return self.plan.param

    @property
    def mode(self) -> str:
        return self.plan.flood_mode

    @property
    def transposed(self) -> bool:
        return self.plan.transposed

    @property
    def rho(self) -> float:
        return self.plan.treatment.rho

    @property
    def lam(self) -> float:
        return self.plan.treatment.lam


@dataclass(frozen=True)
class _Observed:
    """One exported flooded tensor as the scoring variants read it."""

    level: float  # robust noise level (``_level``)
    kept: int  # elements that level rests on
    n: int  # elements
    sq: float  # sum of squares
    x: Tensor  # the tensor (the flood's rows view)


@dataclass
class _Prediction:
    """What the defence does to one candidate's gradient, tensor by tensor (the shield's order)."""

    sigma: list[float]  # the noise level it would use
    signal_energy: list[float]  # ||rho clip(G)||^2 of what survives as signal
    signal: list[tuple[Tensor | None, Tensor] | None] | None  # (row index or None, signal) for "likelihood"


def lm_batch(tokenizer, texts: Sequence[str], model: nn.Module,
             labels: Sequence[int] | None = None) -> dict[str, Tensor]:
    """The batch ``shared_gradient`` builds for ``texts``: right-padded ids and mask, and the causal-LM
    targets (pads -100) or the classification ``labels``."""
    enc = tokenize(tokenizer, texts, model)
    if labels is not None:
        target = torch.as_tensor(list(labels), device=enc["input_ids"].device)
    elif is_decoder(model):
        target = enc["input_ids"].masked_fill(enc["attention_mask"] == 0, -100)
    else:
        raise ValueError("an encoder needs classification labels: pass labels=[...] (one per text)")
    return {**enc, "labels": target}


class FingerprintAttack:
    """The server's copy of the client's defence: which tensors are flooded, with which public treatment,
    and the sigma / clip / threshold it would use for any gradient (never the noise key).

    ``calibration_loss``: the public loss the client calibrates on (``Calibration.PUBLIC``); None means
    the shield's default synthetic batch, which is public by construction."""

    def __init__(self, model: nn.Module, config: AegisConfig, calibration_loss: PublicLoss | None = None):
        self.model, self.config = model, config
        self._loss = calibration_loss
        self._public: Tensor | None = None
        self.tensors = [_Flooded(p) for p in plan(model, config) if p.flooded]

    # -- calibration ---------------------------------------------------------------------------------
    def _public_table(self) -> Tensor:
        """The PUBLIC calibration's (rho, sigma, clip, thr) per flooded tensor, as ``Shield.calibrate``."""
        if self._public is None:
            loss = self._loss if self._loss is not None else synthetic_loss(self.model)
            with _eval(self.model):
                table = public_table([t.plan for t in self.tensors], loss, self.config.rel_threshold)
            self._public = table.values.cpu()
        return self._public

    def params(self, grads: Sequence[Tensor]) -> Tensor:
        """(n, 4) (rho, sigma, clip, thr) the defence would use for these (rows-view) gradients."""
        if self.config.calibration is Calibration.BATCH:
            return batch_table([t.plan for t in self.tensors], grads, self.config.rel_threshold).values.cpu()
        return self._public_table()

    # -- one candidate -------------------------------------------------------------------------------
    def gradients(self, batch: Batch) -> list[Tensor]:
        """The clean gradient of every flooded tensor for ``batch`` (the flood's rows view), leaving
        ``.grad`` untouched."""
        params = [t.param for t in self.tensors]
        with _eval(self.model), torch.enable_grad():
            loss = self.model(**batch).loss
            grads = torch.autograd.grad(loss, params, allow_unused=True)
        out = []
        for g, t in zip(grads, self.tensors):
            g = torch.zeros_like(t.param) if g is None else g.detach()
            out.append(rows_view(g, t.transposed) if t.mode == "rows" else g)
        return out

    def predict(self, batch: Batch, keep_signal: bool = False) -> _Prediction:
        grads = self.gradients(batch)
        table = self.params(grads)
        sigma, energy, signal = [], [], []
        for g, t, (rho, s, clip, thr) in zip(grads, self.tensors, table.tolist()):
            sigma.append(s)
            if t.mode == "rows":
                norms = torch.linalg.vector_norm(g.float(), dim=1)  # as the flood computes them (fp32)
                idx = (norms > thr).nonzero().flatten()
                rows = g[idx].double()
                n_v = norms[idx].double()
                rows = rho * torch.where(n_v > clip, clip / n_v.clamp_min(1e-300), torch.ones_like(n_v))[:, None] * rows
                energy.append(rows.pow(2).sum().item())
                signal.append((idx.cpu(), rows.cpu()) if keep_signal and rho > 0 and idx.numel() else None)
            else:
                norm = torch.linalg.vector_norm(g.float()).item()
                scale = rho * (clip / norm if norm > clip else 1.0)
                energy.append(scale * scale * norm * norm)
                signal.append((None, (scale * g.double()).cpu()) if keep_signal and scale > 0 and norm > 0 else None)
        return _Prediction(sigma, energy, signal if keep_signal else None)

    # -- scoring -------------------------------------------------------------------------------------
    def observe(self, exported: Mapping[str, Tensor]) -> list[_Observed | None]:
        """Per flooded tensor: the statistics every variant reads (None: absent or closed)."""
        obs: list[_Observed | None] = []
        for t in self.tensors:
            x = exported.get(t.name)
            if x is None:
                obs.append(None)
                continue
            x = x.detach()
            x = rows_view(x, t.transposed) if t.mode == "rows" else x
            level, kept = _level(x)
            if level == 0.0:
                obs.append(None)
                continue
            sq = torch.sum(x.float() * x.float(), dtype=torch.float64).item()
            obs.append(_Observed(level, kept, x.numel(), sq, x))
        return obs

    def score(self, obs: list[_Observed | None], pred: _Prediction, variant: str = "level") -> float:
        """Lower = more likely.

        level:      sum_k 2 n_k (ln sigma_obs - ln sigma_pred)^2, each term a squared z-score (the log level
                    is read to 1/sqrt(2 n)), over the tensors whose noise can be read apart from the signal:
                    rows floods (the signal sits in a few rows) and rho = 0 matrix floods;
        energy:     sum_k (n_k / 2) (ln ms_obs - ln ms_pred)^2, ms_pred = (||rho clip(G)||^2 + sigma^2 n) / n;
        likelihood: the Gaussian negative log-likelihood of the exported tensors (up to a constant)."""
        if variant not in VARIANTS:
            raise ValueError(f"variant={variant!r}: use one of {VARIANTS}")
        total = 0.0
        for k, o in enumerate(obs):
            if o is None:
                continue
            s = max(pred.sigma[k], 1e-300)
            n = o.n
            if variant == "level":
                if self.tensors[k].mode == "matrix" and self.tensors[k].rho > 0:
                    continue  # signal spread over the whole tensor: its level is not the noise's alone
                total += 2 * o.kept * (math.log(o.level) - math.log(s)) ** 2
            elif variant == "energy":
                expected = (pred.signal_energy[k] + s * s * n) / n
                total += n / 2 * (math.log(o.sq / n) - math.log(expected)) ** 2
            else:
                assert pred.signal is not None, "predict(..., keep_signal=True) for the likelihood variant"
                cross = 0.0
                kept_signal = pred.signal[k]
                if kept_signal is not None:
                    idx, sig = kept_signal
                    part = o.x if idx is None else o.x.index_select(0, idx.to(o.x.device))
                    cross = (part.double().cpu() * sig).sum().item()
                residual = o.sq - 2 * cross + pred.signal_energy[k]
                total += n * math.log(s) + residual / (2 * s * s)
        return total


class _eval:
    """Run the model in eval mode (as ``shared_gradient`` does), restoring its mode afterwards."""

    def __init__(self, model: nn.Module):
        self.model = model

    def __enter__(self):
        self.was = self.model.training
        self.model.eval()

    def __exit__(self, *exc):
        self.model.train(self.was)


# ----------------------------------------------------------------------------- public API
def predicted_levels(model: nn.Module, candidate_batch: Batch, config: AegisConfig,
                     calibration_loss: PublicLoss | None = None) -> dict[str, float]:
    """{name: sigma} the defence would use if the client's batch were ``candidate_batch`` (a dict of
    ``model(**batch)`` arguments with labels: :func:`lm_batch`). Under ``Calibration.PUBLIC`` it does not
    depend on the candidate, which is the point of that calibration."""
    attack = FingerprintAttack(model, config, calibration_loss)
    pred = attack.predict(candidate_batch)
    return {t.name: s for t, s in zip(attack.tensors, pred.sigma)}


def verify(model: nn.Module, exported: Mapping[str, Tensor], candidates: Sequence, config: AegisConfig,
           make_batch: Callable[[object], Batch], *, variant: str = "level",
           calibration_loss: PublicLoss | None = None) -> list[float]:
    """One score per candidate (lower = more likely the client's batch); ``make_batch(candidate)`` gives
    the ``model(**batch)`` arguments of that candidate (e.g. ``lambda texts: lm_batch(tok, texts, model)``)."""
    attack = FingerprintAttack(model, config, calibration_loss)
    obs = attack.observe(exported)
    keep = variant == "likelihood"
    return [attack.score(obs, attack.predict(make_batch(c), keep), variant) for c in candidates]


def rank_of_truth(scores: Sequence[float], truth: int) -> float:
    """1-based rank of candidate ``truth`` (lower score ranks higher); ties count half (the expected rank
    under a random tie-break)."""
    s = scores[truth]
    tol = 1e-12 * max(1.0, abs(s))
    better = sum(x < s - tol for x in scores)
    tied = sum(abs(x - s) <= tol for x in scores) - 1
    return 1.0 + better + tied / 2


def top_share(scores: Sequence[float], truth: int) -> float:
    """Probability that ``truth`` is picked first (a random tie-break among equal best scores)."""
    s = scores[truth]
    tol = 1e-12 * max(1.0, abs(s))
    if any(x < s - tol for x in scores):
        return 0.0
    return 1.0 / sum(abs(x - s) <= tol for x in scores)


def fingerprint_null(n_candidates: int) -> float:
    """The chance rate of a 1-of-N guess."""
    return 1.0 / n_candidates


@dataclass(frozen=True)
class Guess:
    """A 1-of-N verdict: the chosen candidate, its index, and every candidate's score (lower = likelier)."""

    choice: object
    index: int
    scores: list[float]


def _guess(candidates: Sequence, scores: list[float]) -> Guess:
    best = min(range(len(scores)), key=scores.__getitem__)
    return Guess(candidates[best], best, scores)


def _per_text_scores(model, tokenizer, exported, texts: Sequence[str], config, variant, labels, calibration_loss):
    """Scores of single-sentence candidates; an encoder without labels takes the best label of each."""
    if labels is not None or is_decoder(model):
        pairs = [(t, None if labels is None else labels[i]) for i, t in enumerate(texts)]
        make = lambda c: lm_batch(tokenizer, [c[0]], model, None if c[1] is None else [c[1]])  # noqa: E731
        return verify(model, exported, pairs, config, make, variant=variant, calibration_loss=calibration_loss)
    k = int(getattr(model.config, "num_labels", 2))
    pairs = [(t, y) for t in texts for y in range(k)]
    make = lambda c: lm_batch(tokenizer, [c[0]], model, [c[1]])  # noqa: E731
    flat = verify(model, exported, pairs, config, make, variant=variant, calibration_loss=calibration_loss)
    return [min(flat[i * k : (i + 1) * k]) for i in range(len(texts))]


def secret_completion(model: nn.Module, tokenizer, exported: Mapping[str, Tensor], template: str,
                      values: Sequence[str], config: AegisConfig, *, variant: str = "level",
                      label: int | None = None, calibration_loss: PublicLoss | None = None) -> Guess:
    """Which of ``values`` completes ``template`` ("my pin is {}") in the client's (B = 1) batch."""
    texts = [template.format(v) for v in values]
    labels = None if label is None else [label] * len(texts)
    scores = _per_text_scores(model, tokenizer, exported, texts, config, variant, labels, calibration_loss)
    return _guess(list(values), scores)


def identify_sentence(model: nn.Module, tokenizer, exported: Mapping[str, Tensor], pool: Sequence[str],
                      config: AegisConfig, *, variant: str = "level", labels: Sequence[int] | None = None,
                      calibration_loss: PublicLoss | None = None) -> Guess:
    """Which sentence of ``pool`` the client's (B = 1) batch was; an encoder's label, when not given, is
    taken as the best-scoring one for each sentence."""
    scores = _per_text_scores(model, tokenizer, exported, pool, config, variant, labels, calibration_loss)
    return _guess(list(pool), scores)


@dataclass(frozen=True)
class FingerprintResult:
    """How often the truth ranked first over the trials, against the 1/N null."""

    accuracy: float  # mean over trials of P(truth picked first), ties broken at random
    null: float  # 1 / N
    ranks: list[float]  # the truth's rank per trial (1 = first)
    candidates: int
    variant: str

    @property
    def trials(self) -> int:
        return len(self.ranks)

    @property
    def mean_rank(self) -> float:
        return sum(self.ranks) / len(self.ranks)


def fingerprint_accuracy(model: nn.Module, tokenizer, config: AegisConfig, candidates: Sequence[Sequence[str]],
                         truths: Sequence[int], *, variant: str = "level",
                         labels: Sequence[Sequence[int]] | None = None,
                         export: Callable[[int], Mapping[str, Tensor]] | None = None,
                         calibration_loss: PublicLoss | None = None) -> FingerprintResult:
    """Run the 1-of-N attack once per entry of ``truths``: the client trains on ``candidates[truth]`` (a
    batch of texts; ``labels[truth]`` for an encoder) and the server scores every candidate.

    ``export(truth)`` gives the client's exported gradient dict; None protects ``model`` with ``config``
    (``aegis.protect`` freezes its attention in place) and uses ``shared_gradient`` through that shield.
    The candidates' predictions are computed once and reused across trials."""
    return fingerprint_accuracies(model, tokenizer, config, candidates, truths, variants=(variant,), labels=labels,
                                  export=export, calibration_loss=calibration_loss)[variant]


def fingerprint_accuracies(model: nn.Module, tokenizer, config: AegisConfig, candidates: Sequence[Sequence[str]],
                           truths: Sequence[int], *, variants: Sequence[str] = VARIANTS,
                           labels: Sequence[Sequence[int]] | None = None,
                           export: Callable[[int], Mapping[str, Tensor]] | None = None,
                           calibration_loss: PublicLoss | None = None) -> dict[str, FingerprintResult]:
    """:func:`fingerprint_accuracy` for several variants on the same trials (one export per trial)."""
    for variant in variants:
        if variant not in VARIANTS:
            raise ValueError(f"variant={variant!r}: use one of {VARIANTS}")
    if len(candidates) < 2:
        raise ValueError(f"{len(candidates)} candidate(s): a 1-of-N test needs at least 2")
    if export is None:
        from ..exposure import IN_MEMORY
        from ..shield import protect

        if config.exposure_state is None:  # the attack's own exports: nothing to persist
            config = config.replace(exposure_state=IN_MEMORY)
        config = config.replace(allow_outside_promise=True)  # the attack measures any batch size
        shield = protect(model, config=config, calibration_loss=calibration_loss)

        def export(i: int) -> Mapping[str, Tensor]:
            return shared_gradient(model, candidates[i], tokenizer, shield=shield,
                                   labels=None if labels is None else labels[i])

    attack = FingerprintAttack(model, config, calibration_loss)
    keep = "likelihood" in variants
    preds = [attack.predict(lm_batch(tokenizer, c, model, None if labels is None else labels[i]), keep)
             for i, c in enumerate(candidates)]
    shares: dict[str, list[float]] = {v: [] for v in variants}
    ranks: dict[str, list[float]] = {v: [] for v in variants}
    for truth in truths:
        obs = attack.observe(export(truth))
        for v in variants:
            scores = [attack.score(obs, p, v) for p in preds]
            shares[v].append(top_share(scores, truth))
            ranks[v].append(rank_of_truth(scores, truth))
    null = fingerprint_null(len(candidates))
    return {v: FingerprintResult(sum(shares[v]) / len(shares[v]), null, ranks[v], len(candidates), v)
            for v in variants}
