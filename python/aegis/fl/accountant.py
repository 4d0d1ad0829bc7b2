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
With no sampling the composition is exactly one Gaussian mechanism of parameter sqrt(K)/z and
:func:`gaussian_epsilon` gives epsilon exactly; with sampling, Opacus's PRV accountant does (falling
back to its RDP bound where z is so small that the PRV grid would not fit in memory). Opacus's RDP
accountant is the upper cross-check in every statement.
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
    epsilon: float  # exact (no sampling) or Opacus's PRV accountant (see method)
    epsilon_rdp: float  # Opacus's RDP accountant: an upper bound, the cross-check
    method: str  # "exact", "prv" or "rdp" (PRV out of memory: the RDP bound stands)

    def line(self) -> str:
        return (f"(epsilon = {self.epsilon:.3g}, delta = {self.delta:g}) per example: {self.compositions} export(s) "
                f"at noise multiplier {self.noise_multiplier:.3g}, sampling {self.sample_rate:g} "
                f"({self.method}; RDP bound {self.epsilon_rdp:.3g})")


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


def epsilons(z: float, compositions: int, sample_rate: float, delta: float) -> tuple[float, float, str]:
    """(epsilon, RDP epsilon, method) of ``compositions`` Gaussian mechanisms of multiplier z, each
    sampled at ``sample_rate``; method "exact" (no sampling), "prv" or "rdp" (the PRV fallback)."""
    if not 0.0 < delta < 1.0:
        raise ValueError(f"delta={delta}: choose 0 < delta < 1 (e.g. 1e-5, below 1 / the number of examples)")
    if not 0.0 < sample_rate <= 1.0:
        raise ValueError(f"sample_rate={sample_rate}: the per-round sampling probability is in (0, 1]")
    if compositions < 0:
        raise ValueError(f"compositions={compositions}: count exports per example (>= 0)")
    if compositions == 0 or math.isinf(z):
        return 0.0, 0.0, "exact"
    if z <= 0.0:
        return math.inf, math.inf, "exact"
    rdp = _opacus("rdp", z, compositions, sample_rate, delta)
    if sample_rate == 1.0:
        return gaussian_epsilon(math.sqrt(compositions) / z, delta), rdp, "exact"
    try:
        return _opacus("prv", z, compositions, sample_rate, delta), rdp, "prv"
    except MemoryError:  # the PRV grid spans the privacy-loss range, which explodes as z -> 0
        return rdp, rdp, "rdp"


def prv_epsilon(z: float, compositions: int, sample_rate: float, delta: float) -> float:
    """Opacus's PRV accountant alone (the cross-check of :func:`gaussian_epsilon` at sample_rate 1)."""
    return _opacus("prv", z, compositions, sample_rate, delta)


def _opacus(kind: str, z: float, compositions: int, sample_rate: float, delta: float) -> float:
    from opacus.accountants import PRVAccountant, RDPAccountant

    acc = PRVAccountant() if kind == "prv" else RDPAccountant()
    acc.history = [(z, sample_rate, compositions)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # Opacus's log of 0 at sample_rate 1
        warnings.simplefilter("ignore", UserWarning)  # its note that the best order is its smallest alpha
        return float(acc.get_epsilon(delta))


def gaussian_epsilon(mu: float, delta: float) -> float:
    """Exact epsilon at ``delta`` of a Gaussian mechanism with sensitivity / noise = mu (Balle and
    Wang 2018): the smallest eps with Phi(-eps/mu + mu/2) - e^eps Phi(-eps/mu - mu/2) <= delta
    (the second term in log space: for large mu, e^eps overflows while Phi underflows)."""

    def excess(eps: float) -> float:
        second = math.exp(min(eps + _log_phi(-eps / mu - mu / 2), 700.0))
        return 0.5 * math.erfc((eps / mu - mu / 2) / math.sqrt(2.0)) - second - delta

    if excess(0.0) <= 0.0:
        return 0.0
    lo, hi = 0.0, 1.0
    while excess(hi) > 0.0:
        lo, hi = hi, 2 * hi
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if excess(mid) > 0.0 else (lo, mid)
    return hi


def _log_phi(x: float) -> float:
    """log Phi(x), with the asymptotic series below x = -30 (where erfc underflows)."""
    if x > -30.0:
        return math.log(0.5 * math.erfc(-x / math.sqrt(2.0)))
    return -x * x / 2 - math.log(-x) - 0.5 * math.log(2 * math.pi) + math.log1p(-1 / x**2 + 3 / x**4)


def statement(z: float, compositions: int, *, sample_rate: float = 1.0, delta: float = 1e-5) -> PrivacyStatement:
    """The :class:`PrivacyStatement` of ``compositions`` exports at noise multiplier z."""
    eps, rdp, method = epsilons(z, compositions, sample_rate, delta)
    return PrivacyStatement(z, compositions, sample_rate, delta, eps, rdp, method)
