"""Noise-aware bag of words from a token-embedding gradient: every row read along its own embedding.

Spec: DESIGN §6.3. Row ``v`` of ``∂L/∂E`` is ``Σ_{t: x_t = v} δ_t`` (input side) plus, with a tied LM head,
``(1/N) Σ_t (p_tv − 1[y_t = v]) h_t`` (output side). Logits are ``h E^T``, so a hidden state that predicts ``v``
points along ``e_v``: a target token's row has a component along ``−e_v`` of size about ``(1 − p) |h|``, which a
row outside the batch (``Σ_t p_tv h_t``, ``p_tv`` small) lacks. Under a rows flood of per-entry noise ``σ`` that
projection carries noise ``σ``, not the ``σ sqrt(d)`` of the row's norm that :mod:`embedding_norm`'s outlier test
reads, so it is the attacker's matched filter for one token's presence.

Two statistics per row, each standardised against the whole vocabulary (median and MAD: the noise, whatever
its level, sets the scale, so no public parameter is needed and an exact gradient is read the same way):

* the projection ``<G_v, e_v> / |e_v|`` (two-sided: the input side's sign is unknown);
* the row energy ``|G_v|^2`` (every direction: an input-side ``δ`` need not lie along ``e_v``).

A token is read when either robust z passes the Bonferroni level for ``2 V`` tests at a family-wise 0.5, so
pure noise yields under one token on average. Output as :func:`aegis.attacks.embedding_norm`: each of the
``batch_size`` slots holds the recovered bag (strongest first); ``[]`` when the channel is closed or nothing
passes.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from .embedding_norm import bag_slots, embedding_param_names
from .spectral import robust_z

__all__ = ["embedding_projection", "embedding_projection_scores"]

FAMILY_ERRORS = 0.5  # expected false tokens on a gradient that holds nothing


def embedding_projection_scores(model: nn.Module, grads: dict) -> Tensor | None:
    """Per vocabulary row, the larger of the two robust z-scores; None when the channel is closed."""
    name = next((n for n in embedding_param_names(model)["embedding"] if n in grads), None)
    if name is None or not bool(torch.isfinite(grads[name]).all()) or not bool(grads[name].any()):
        return None
    g = grads[name].detach().double()
    e = dict(model.named_parameters(remove_duplicate=False))[name].detach().to(g.device, torch.float64)
    proj = (g * e).sum(1) / e.norm(dim=1).clamp_min(1e-30)
    energy = g.pow(2).sum(1)
    return torch.maximum(robust_z(proj, proj).abs(), robust_z(energy, energy))


def embedding_projection(model: nn.Module, grads: dict, tokenizer, batch_size: int) -> list[str]:
    """The recovered bag in each of the ``batch_size`` slots, or ``[]``."""
    z = embedding_projection_scores(model, grads)
    if z is None:
        return []
    level = -float(torch.special.ndtri(torch.tensor(FAMILY_ERRORS / (2 * z.numel()), dtype=torch.float64)))
    return bag_slots(torch.argsort(z, descending=True)[: int((z > level).sum())].tolist(), tokenizer, batch_size)
