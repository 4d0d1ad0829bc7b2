"""(epsilon, delta) per example for secure rounds: the aggregate as a Gaussian mechanism, composed.

Under SecAgg+ the server sees, per round, ``sum_i rho clip(G_i) + noise`` where the noise of every
flooded tensor k has standard deviation at least ``sigma_k`` (n >= t survivors, each adding a
``sigma_k / sqrt(t)`` share; see :mod:`aegis.fl.secure`). Replacing one example of a client's batch
moves that client's ``rho_k clip(G_k)`` by at most ``2 rho_k clip_k`` per clipped unit: the whole
tensor for a matrix flood, each of its R_k rows for a rows flood (R_k: the rows one example can
change; by default every row, the rigorous bound). Whitening each tensor by its noise gives one
Gaussian mechanism with noise multiplier

    z = 1 / sqrt( sum_k R_k (2 rho_k clip_k / sigma_k)^2 )        (replace-one, per export)

and an example exported K times (the exposure budget) is K such mechanisms composed, each sampled
with the rate actually used (1.0 for the deterministic passes of :func:`~aegis.fl.secure_rounds.run_secure_rounds`).
Epsilon comes from Opacus's PRV accountant, with its RDP accountant as an upper cross-check; with no
sampling the composition is exactly a Gaussian mechanism of parameter sqrt(K)/z, so
:func:`gaussian_epsilon` gives the exact value both must bracket.
"""
from __future__ import annotations

import math
import warnings
from collections.abc import Mapping
from dataclasses import dataclass

Table = Mapping[str, tuple[float, float, float, float]]  # name -> public (rho, sigma, clip, thr)


@dataclass(frozen=True)
class PrivacyStatement:
    """What a run promises each example, against a server that sees only the round sums."""

    noise_multiplier: float  # z per export (replace-one, sensitivity-whitened), at n = t survivors
    compositions: int  # exports of the most-exported example (the exposure count)
    sample_rate: float  # the probability an example is in a round's batch (1.0: no amplification)
    delta: float
    epsilon: float  # PRV accountant (Opacus)
    epsilon_rdp: float  # RDP accountant (Opacus): an upper bound, the cross-check

    def line(self) -> str:
        return (f"(epsilon = {self.epsilon:.3g}, delta = {self.delta:g}) per example: {self.compositions} export(s) "
                f"at noise multiplier {self.noise_multiplier:.3g}, sampling {self.sample_rate:g} "
                f"(RDP bound {self.epsilon_rdp:.3g})")


def noise_multiplier(table: Table, shapes: Mapping[str, tuple[int, ...]], modes: Mapping[str, str],
                     rows: Mapping[str, int] | None = None) -> float:
    """z of one export of the full flood (the aggregate at the pin) under the public ``table``.

    ``modes[name]`` is "rows" or "matrix"; ``rows[name]`` the rows one example can change in a rows
    flood (default: the tensor's largest dimension, which bounds its row count)."""
    total = 0.0
    for name, (rho, sigma, clip, _thr) in table.items():
        if rho == 0.0:
            continue  # pure noise: nothing of the batch leaves through this tensor
        if not sigma > 0.0:
            return 0.0  # signal without noise: no finite epsilon
        units = 1
        if modes[name] == "rows":
            units = int((rows or {}).get(name, max(shapes[name])))
        total += units * (2.0 * rho * clip / sigma) ** 2
    return math.inf if total == 0.0 else 1.0 / math.sqrt(total)


def epsilons(z: float, compositions: int, sample_rate: float, delta: float) -> tuple[float, float]:
    """(PRV epsilon, RDP epsilon) of ``compositions`` Gaussian mechanisms of multiplier z, each
    sampled at ``sample_rate``."""
    if not 0.0 < delta < 1.0:
        raise ValueError(f"delta={delta}: choose 0 < delta < 1 (e.g. 1e-5, below 1 / the number of examples)")
    if not 0.0 < sample_rate <= 1.0:
        raise ValueError(f"sample_rate={sample_rate}: the per-round sampling probability is in (0, 1]")
    if compositions < 0:
        raise ValueError(f"compositions={compositions}: count exports per example (>= 0)")
    if compositions == 0 or math.isinf(z):
        return 0.0, 0.0
    if z <= 0.0:
        return math.inf, math.inf
    from opacus.accountants import PRVAccountant, RDPAccountant

    values = []
    for acc in (PRVAccountant(), RDPAccountant()):
        acc.history = [(z, sample_rate, compositions)]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # Opacus's log of 0 at sample_rate 1
            values.append(float(acc.get_epsilon(delta)))
    return values[0], values[1]


def gaussian_epsilon(mu: float, delta: float) -> float:
    """Exact epsilon at ``delta`` of a Gaussian mechanism with sensitivity / noise = mu (Balle and
    Wang 2018): the smallest eps with Phi(-eps/mu + mu/2) - e^eps Phi(-eps/mu - mu/2) <= delta."""

    def phi(x: float) -> float:
        return 0.5 * math.erfc(-x / math.sqrt(2.0))

    def excess(eps: float) -> float:
        return phi(-eps / mu + mu / 2) - math.exp(eps) * phi(-eps / mu - mu / 2) - delta

    if excess(0.0) <= 0.0:
        return 0.0
    lo, hi = 0.0, 1.0
    while excess(hi) > 0.0:
        lo, hi = hi, 2 * hi
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if excess(mid) > 0.0 else (lo, mid)
    return hi


def statement(z: float, compositions: int, *, sample_rate: float = 1.0, delta: float = 1e-5) -> PrivacyStatement:
    """The :class:`PrivacyStatement` of ``compositions`` exports at noise multiplier z."""
    prv, rdp = epsilons(z, compositions, sample_rate, delta)
    return PrivacyStatement(z, compositions, sample_rate, delta, prv, rdp)
