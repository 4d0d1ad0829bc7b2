"""What a server running SecAgg+ can attack: the round sum, in the realistic and the worst case.

A secure FedSGD round gives the server ``S = sum_i rho clip(G_i) + noise`` over the survivors, the
noise of every flooded tensor at least one full flood (``sigma``) when the survivors are at least the
clients' pin (:mod:`aegis.fl.secure.client`). :func:`aggregate_views` turns a round of
:func:`~aegis.fl.secure.rounds.run_secure_rounds` into what candidate verification
(:class:`aegis.attacks.candidates.Verifier`) scores, as an export of the target client:

* ``"realistic"``: the sum itself; the other clients' updates are unknown and act as interference;
* ``"worst"``: the sum less the other clients' bare signals ``rho clip(G_j)``, as a server that knows
  their data (or colludes with them) computes them: the target's signal plus the full noise, exactly
  one export of the full flood when the survivors equal the pin.

The candidates' scores rank the same for any common noise scale, so a Verifier built with the full
flood's configuration scores these views as it scores one export. FedSGD only: a FedAvg update is a
sum of E local steps, which the Verifier's single-export likelihood does not model.
"""
from __future__ import annotations

import copy
from collections.abc import Mapping

import torch
from torch import Tensor, nn

from ...config import AegisConfig
from ...defence import Batch, LossFn, lm_loss
from ...exposure import ExposurePolicy
from ...shield import protect
from .client import noise_share
from .rounds import SecureRun


def bare_signal(model: nn.Module, batch: Batch, config: AegisConfig, loss_fn: LossFn = lm_loss) -> dict[str, Tensor]:
    """``rho clip(G)`` of ``batch`` at ``model``: a client's update as its shield exports it, without
    noise (the server's prediction when it knows the client's data). The model is copied and nothing
    is counted against the exposure budget: this is the attacker's computation, not an export."""
    local = copy.deepcopy(model)
    shield = protect(local, None, config.replace(exposure=ExposurePolicy.OFF, seed=None))
    for p in local.parameters():
        p.grad = None
    loss_fn(local, batch).backward()
    with noise_share(shield, 0.0):
        shield.mask_()
    return {k: v.double() for k, v in shield.export().items()}


def aggregate_views(run: SecureRun, model: nn.Module, *, server_round: int, target: int,
                    loss_fn: LossFn = lm_loss) -> dict[str, dict[str, Tensor]]:
    """``{"realistic": sum, "worst": sum - the others' bare signals}`` of round ``server_round`` for
    client ``target``; ``model`` is the global model that round started from. FedSGD rounds only."""
    if run.strategy.algorithm != "fedsgd":
        raise ValueError("aggregate_views: the verifier models one masked gradient; run FedSGD rounds")
    if server_round not in run.sums:
        raise ValueError(f"round {server_round} produced no sum (rounds with one: {sorted(run.sums)})")
    total = run.sums[server_round]
    worst = {k: v.clone() for k, v in total.items()}
    for j, trainer in enumerate(run.trainers):
        if j == target or server_round not in trainer.batches_used:
            continue  # the target, or a client that dropped out before sending
        (batch,) = trainer.batches_used[server_round]
        for k, v in bare_signal(model, batch, trainer.shield.config, loss_fn).items():
            worst[k] -= v
    return {"realistic": _float(total), "worst": _float(worst)}


def _float(views: Mapping[str, Tensor]) -> dict[str, Tensor]:
    return {k: v.to(torch.float32) for k, v in views.items()}
