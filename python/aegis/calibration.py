"""Public calibration: each tensor's noise level from a batch the server could compute itself.

The paper sets sigma = lam * m_bar(G) on the private gradient G, so the exported noise level
(readable to 0.1 % from any large tensor's mean square) fingerprints the batch. Here the statistic
[m_bar, M] of every flooded tensor comes from the gradient of a *public* loss instead (text the
user declares public, or synthetic tokens), and the private gradient is clipped to clip * M
(per row for the rows flood, Frobenius for the matrix flood): what leaves the client depends on
the private batch only through rho * clip(G). docs/design.md §1.3 argues the choice.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

import aegis_kernels.reference as ref

from .config import Treatment
from .policy import ParamPlan, rows_view

PublicLoss = Callable[[], Tensor]
CALIBRATION_SHAPE = (8, 64)  # (batch, tokens) of the default synthetic batch
_PUBLIC_SEED = 20240917  # public: the synthetic batch is no secret


def synthetic_loss(model: nn.Module, shape: tuple[int, int] = CALIBRATION_SHAPE) -> PublicLoss:
    """Loss of a Hugging Face model on uniformly random token ids (a fixed public generator):
    language-model heads predict the ids themselves, classifiers a random label."""
    getter = getattr(model, "get_input_embeddings", None)
    embeddings = getter() if callable(getter) else None
    base = getattr(embeddings, "base_layer", embeddings)  # an adapter (peft) wraps the table
    if not isinstance(base, nn.Embedding):
        raise ValueError(
            "no calibration_loss given and the model has no get_input_embeddings(): pass "
            "aegis.protect(model, ..., calibration_loss=fn) where fn() returns a loss on public data"
        )
    generator = torch.Generator().manual_seed(_PUBLIC_SEED)
    batch, length = shape
    limit = getattr(getattr(model, "config", None), "max_position_embeddings", None) or length
    length = min(length, int(limit) - 2)  # RoBERTa-style positions start after the padding index
    ids = torch.randint(base.num_embeddings, (batch, length), generator=generator)
    classifier = type(model).__name__.endswith("ForSequenceClassification")
    num_labels = int(getattr(getattr(model, "config", None), "num_labels", 2))
    labels = torch.randint(num_labels, (batch,), generator=generator) if classifier else ids

    def loss() -> Tensor:
        device = base.weight.device
        return model(input_ids=ids.to(device), labels=labels.to(device)).loss

    return loss


def text_loss(
    model: nn.Module, tokenizer, texts: Sequence[str], shape: tuple[int, int] = CALIBRATION_SHAPE
) -> PublicLoss:
    """Language-model loss on text the user declares public, tokenized to the fixed calibration shape."""
    batch, length = shape
    if not texts:
        raise ValueError("text_loss: texts is empty; pass public sentences (or use the default synthetic batch)")
    chosen = [texts[i % len(texts)] for i in range(batch)]
    enc = tokenizer(chosen, padding="max_length", truncation=True, max_length=length, return_tensors="pt")
    labels = enc["input_ids"].masked_fill(enc["attention_mask"] == 0, -100)

    def loss() -> Tensor:
        device = next(model.parameters()).device
        return model(input_ids=enc["input_ids"].to(device), attention_mask=enc["attention_mask"].to(device),
                     labels=labels.to(device)).loss

    return loss


def public_statistics(params: Sequence[nn.Parameter], modes: Sequence[str], loss_fn: PublicLoss, tau: float,
                      transposed: Sequence[bool] | None = None) -> Tensor:
    """[m_bar, M] per parameter from the public loss's gradient (never touching ``.grad``): (n, 2);
    ``transposed[k]``: parameter k's rows are its columns (token ids index its second axis)."""
    with torch.enable_grad():
        loss = loss_fn()
        if not isinstance(loss, Tensor) or loss.dim() != 0 or not loss.requires_grad:
            raise ValueError("calibration_loss must return a scalar loss tensor that depends on the model's parameters")
        grads = torch.autograd.grad(loss, list(params), allow_unused=True)
    transposed = transposed or [False] * len(params)
    stats = []
    for p, g, mode, t in zip(params, grads, modes, transposed):
        g = g if g is not None else torch.zeros_like(p)
        stats.append(ref.statistic(rows_view(g, t) if mode == "rows" else g, mode, tau, nonzero=True))
    return torch.stack(stats)


COLUMNS = ("rho", "sigma", "clip", "thr")  # the flood's per-tensor parameters, in the kernels' column order


@dataclass(frozen=True)
class FloodTable:
    """(rho, sigma, clip, thr) per flooded tensor: ``values`` is the (T, 4) tensor the kernels read (columns
    in ``COLUMNS`` order), ``names`` the tensors' parameter names."""

    names: tuple[str, ...]
    values: Tensor

    def column(self, name: str) -> Tensor:
        return self.values[:, COLUMNS.index(name)]

    def as_dict(self) -> dict[str, tuple[float, float, float, float]]:
        rows = self.values.detach().double().cpu().tolist()
        return {n: (r[0], r[1], r[2], r[3]) for n, r in zip(self.names, rows)}


def public_table(plans: Sequence[ParamPlan], loss_fn: PublicLoss, tau: float) -> FloodTable:
    """The public calibration's table of the flooded ``plans``: the one builder the shield, the fingerprint
    attack and the secure trainer use (per tensor, ``aegis_kernels.reference.public_params``)."""
    params = [p.param for p in plans]
    stats = public_statistics(params, [p.flood_mode for p in plans], loss_fn, tau, [p.transposed for p in plans])
    values = torch.stack([
        ref.public_params(stat, p.flood_mode, p.treatment.rho, p.treatment.lam, tau, p.treatment.clip,
                          p.treatment.snr)
        for stat, p in zip(stats, plans)
    ]) if plans else torch.zeros(0, len(COLUMNS))
    return FloodTable(tuple(p.name for p in plans), values)


def batch_table(plans: Sequence[ParamPlan], views: Sequence[Tensor], tau: float) -> FloodTable:
    """The paper's calibration on the private gradients (their flood views): leaks the flood level."""
    values = torch.stack([ref.batch_params(g, p.flood_mode, p.treatment.rho, p.treatment.lam, tau)
                          for g, p in zip(views, plans)])
    return FloodTable(tuple(p.name for p in plans), values)


def delta_params(stat: Tensor, mode: str, treatment: Treatment, tau: float) -> Tensor:
    """(rho, sigma, clip, thr) of one tensor from its PUBLIC delta's statistic [m_bar, M]: clip =
    treatment.clip x M, sigma = max(lam x m_bar, rho x clip / snr), thr = tau x M (rows). Step mode lowers
    rho to meet the cap; here sigma rises instead, so the delta keeps its scale."""
    m_bar, peak = stat.float().unbind()
    clip = treatment.clip * peak
    rho = torch.full_like(m_bar, treatment.rho)
    sigma = treatment.lam * m_bar
    if treatment.snr == 0:
        rho = torch.zeros_like(m_bar)  # nothing of the delta may leave this tensor
    elif math.isfinite(treatment.snr):
        sigma = torch.maximum(sigma, rho * clip / treatment.snr)
    thr = tau * peak if mode == "rows" else torch.zeros_like(peak)
    return torch.stack((rho, sigma, clip, thr))


def delta_table(plans: Sequence[ParamPlan], deltas: Sequence[Tensor], tau: float) -> FloodTable:
    """Delta mode's table from the PUBLIC round's deltas (one per flooded plan): ``delta_params`` per tensor."""
    values = torch.stack([
        delta_params(ref.statistic(rows_view(d, p.transposed) if p.flood_mode == "rows" else d, p.flood_mode, tau,
                                   nonzero=True), p.flood_mode, p.treatment, tau)
        for d, p in zip(deltas, plans)
    ]).float()
    return FloodTable(tuple(p.name for p in plans), values)
