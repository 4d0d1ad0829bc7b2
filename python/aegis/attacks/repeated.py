"""Repeated exposure: any attack on the mean of K exports of one batch, and candidate verification
over rounds of a moving model.

Every export floods under a fresh key, so the mean of K exports of the same batch keeps the signal
``rho * clip(G)`` and divides the noise by sqrt(K): local epochs over one batch, rounds over the same
client data while the model barely moves, or a server that resends one model all hand an attacker
this mean. When the model moves between rounds the server still knows every model it sent, so it
predicts each round's candidate gradients at that round's model: given the models the exports are
independent Gaussians, and their log-likelihoods add (:func:`joint_scores`). At one model the sum
ranks candidates exactly as the mean of the K exports does. ``AegisConfig.exposure_budget`` is the
shield's answer; this is the attacker's side.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from torch import Tensor

from .candidates import Candidate, Observation, Verifier
from .fingerprint import VARIANTS

Export = Mapping[str, Tensor]


def averaged_export(export: Callable[[], Export], exposures: int) -> dict[str, Tensor]:
    """The elementwise mean of ``exposures`` calls of ``export()`` (each a fresh masked export)."""
    if exposures < 1:
        raise ValueError(f"exposures={exposures}: need at least one export")
    total: dict[str, Tensor] = {}
    for _ in range(exposures):
        for name, value in export().items():
            value = value.detach().double()
            total[name] = total[name] + value if name in total else value.clone()
    return {name: (value / exposures).float() for name, value in total.items()}


def joint_scores(rounds: Sequence[tuple[Verifier, Sequence[Observation]]], candidates: Sequence[Candidate],
                 variants: Sequence[str] = VARIANTS) -> dict[str, Tensor]:
    """{variant: (trials, N) scores} of one export per round and trial, summed over the rounds.

    ``rounds``: per round, a Verifier built on that round's model (exposures=1) and its observations of
    the same trials, in the same order. The likelihood variant's sum is the joint negative log-likelihood
    of the rounds' exports (lower = likelier); level and energy add their per-round statistics."""
    if not rounds:
        raise ValueError("rounds=[]: give at least one (verifier, observations) round")
    trials = {len(obs) for _, obs in rounds}
    if len(trials) != 1:
        raise ValueError(f"rounds observe {sorted(trials)} trials: every round must observe the same trials")
    total: dict[str, Tensor] = {}
    for verifier, observations in rounds:
        if verifier.exposures != 1:
            raise ValueError(f"a round's Verifier has exposures={verifier.exposures}: each round is one export")
        for v, s in verifier.scores(observations, candidates, variants).items():
            total[v] = total[v] + s if v in total else s.clone()
    return total

