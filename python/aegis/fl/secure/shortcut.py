"""The round sum of N clients without running the round: one batch of N x B examples and the full noise.

A secure FedSGD round at one global model gives the server ``sum_i rho clip(G_i) + noise`` with noise
``sigma * sqrt(N / t)`` per entry (:mod:`aegis.fl.secure.client`). When no client's clip or row threshold binds,
``sum_i rho clip(G_i) = rho * N * G`` with G the gradient of the N x B examples' mean loss (equal-length
batches: the mean over all tokens is the mean of the clients' means), so one backward pass and one
flood with sigma times sqrt(N / t) and clip and threshold times N give the same sum in distribution:
curves over N up to thousands cost one batch each. Where a client's clip binds, the two differ (the
shortcut clips the sum once, the clients each clip their own): ``tests/test_secure_fl.py`` checks the
equality to quantisation against real SecAgg+ rounds with clipping out of the way, and the gap with it.
"""
from __future__ import annotations

import copy
import math
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from ...config import AegisConfig
from ...defence import Batch, LossFn, lm_loss
from ...exposure import ExposurePolicy
from ...shield import protect
from .guard import SurvivorPin


def concat(batches: Sequence[Batch]) -> Batch:
    """The clients' batches as one (same keys and sequence length in every batch)."""
    keys = set(batches[0])
    if any(set(b) != keys for b in batches):
        raise ValueError("concat: every client batch needs the same keys")
    return {k: torch.cat([b[k] for b in batches]) for k in batches[0]}


def shortcut_sum(model: nn.Module, batches: Sequence[Batch], config: AegisConfig, pin: SurvivorPin, *,
                 loss_fn: LossFn = lm_loss) -> dict[str, Tensor]:
    """What the server's sum of ``len(batches)`` secure FedSGD clients at ``model`` is in distribution
    (exactly, where no clip or row threshold binds): ``rho clip_N(N G) + sigma sqrt(N / t) Z``."""
    n = len(batches)
    local = copy.deepcopy(model)
    # a simulation, not an export: one shield stands for every client, each of whose batches the promise covers
    shield = protect(local, None, config.replace(exposure=ExposurePolicy.OFF, allow_outside_promise=True))
    for p in local.parameters():
        p.grad = None
    loss_fn(local, concat(batches)).backward()
    with torch.no_grad():
        for p in local.parameters():
            if p.grad is not None:
                p.grad.mul_(n)
    with shield.scaled_table(sigma=math.sqrt(n / pin.min_survivors), clip=float(n)):
        shield.mask_()
    return {k: v.double() for k, v in shield.export().items()}
