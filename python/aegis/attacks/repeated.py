"""Repeated exposure: any attack on the mean of K exports of one batch.

Every export floods under a fresh key, so the mean of K exports of the same batch keeps the signal
``rho * clip(G)`` and divides the noise by sqrt(K): local epochs over one batch, rounds over the same
client data while the model barely moves, or a server that resends one model all hand an attacker
this mean. ``AegisConfig.exposure_budget`` is the shield's answer; this is the attacker's side.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping

from torch import Tensor

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
