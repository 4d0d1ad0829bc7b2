"""(epsilon, delta) per example for secure rounds: :mod:`aegis.accounting` (Flower-free, so that
:meth:`aegis.Shield.report` states it too), named here for the secure-round code that reads it."""
from ...accounting import (
    DELTA,
    PrivacyStatement,
    Table,
    epsilons,
    gaussian_epsilon,
    noise_multiplier,
    prv_epsilon,
    statement,
)

__all__ = ["DELTA", "PrivacyStatement", "Table", "epsilons", "gaussian_epsilon", "noise_multiplier", "prv_epsilon",
           "statement"]
