"""(epsilon, delta) per example: each export (or each secure round's sum) as a Gaussian mechanism, composed.

Flower-free, so :meth:`aegis.Shield.report` states epsilon on a plain install (Opacus, for the RDP
cross-check and for sampling, is imported only when it is installed or needed).

A single client's export carries, per flooded tensor k, ``rho_k clip(G_k)`` plus noise of standard
deviation ``sigma_k``. Under SecAgg+ the server sees ``sum_i rho clip(G_i) + noise`` where every
flooded tensor's noise has standard deviation at least ``sigma_k`` (n >= t survivors, each adding a
``sigma_k / sqrt(t)`` share; see :mod:`aegis.fl.secure`): the same per-example mechanism. Replacing
one example of a client's batch moves that client's ``rho_k clip(G_k)`` by at most
``2 rho_k clip_k`` per clipped unit (so does adding or removing one: both sides are clipped): the
whole tensor for a matrix flood, each of its R_k rows for a rows flood (R_k: the rows one example can
change; by default every row, the rigorous bound). Whitening each tensor by its noise gives one
Gaussian mechanism with noise multiplier

    z = 1 / sqrt( sum_k R_k (2 rho_k clip_k / sigma_k)^2 )        (per export; 0 if a tensor is clean)

(with 1 in place of 2 for a user whose whole clipped delta is added or removed: user-level accounting in
delta mode, :mod:`aegis.fl.secure.delta_rounds`; :func:`calibrate_noise_multiplier` inverts the statement)

and an example exported K times (the exposure budget, or the rounds it is in) is K such mechanisms
composed. Without sampling the composition is exactly one Gaussian mechanism of parameter sqrt(K)/z and
:func:`gaussian_epsilon` gives epsilon exactly (replace-one and add/remove alike). With Poisson
sampling at rate q (add/remove adjacency), Opacus's PRV accountant gives it where its grid is
affordable (RDP epsilon <= :data:`PRV_LIMIT`: beyond, the grid spans a privacy-loss range that needs
gigabytes and amplification is negligible) and otherwise the smaller of Opacus's RDP bound and the exact
unsampled composition (sampling never hurts). The RDP bound is the upper cross-check in every statement.
"""
from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass

Table = Mapping[str, tuple[float, float, float, float]]  # name -> public (rho, sigma, clip, thr)
DELTA = 1e-5  # the delta statements use unless told (below 1 / the examples of a typical fine-tuning set)
PRV_LIMIT = 100.0  # PRV only where the RDP epsilon is at most this (its memory grows as z shrinks)


@dataclass(frozen=True)
class PrivacyStatement:
    """What a run promises each example, against a server that sees the exports (or only the round sums)."""

    noise_multiplier: float  # z per export (sensitivity-whitened), at n = t survivors for a secure round
    compositions: int  # exports of the most-exported example (the exposure count, or the rounds)
    sample_rate: float  # the probability an example is in a round's batch (1.0: no amplification)
    delta: float
    epsilon: float  # exact (no sampling) or Opacus's PRV accountant (see method)
    epsilon_rdp: float  # Opacus's RDP accountant: an upper bound, the cross-check (nan: Opacus not installed)
    method: str  # "exact"; with sampling "prv", "rdp" (beyond PRV_LIMIT) or "unsampled" (below the RDP bound)

    def line(self) -> str:
        rdp = "" if math.isnan(self.epsilon_rdp) else f"; RDP bound {self.epsilon_rdp:.3g}"
        return (f"(epsilon = {self.epsilon:.3g}, delta = {self.delta:g}) per example: {self.compositions} export(s) "
                f"at noise multiplier {self.noise_multiplier:.3g}, sampling {self.sample_rate:g} "
                f"({self.method}{rdp})")


def noise_multiplier(table: Table, shapes: Mapping[str, tuple[int, ...]], modes: Mapping[str, str],
                     rows: Mapping[str, int] | None = None, *, sensitivity: float = 2.0) -> float:
    """z of one export of the full flood (the aggregate at the pin) under the public ``table``.

    ``modes[name]`` is "rows" or "matrix"; ``rows[name]`` the rows one example can change in a rows
    flood (default: the tensor's largest dimension, which bounds its row count). ``sensitivity`` is the
    most one neighbour moves a clipped unit, in units of ``rho clip``: 2 for an example of a client's
    batch (replaced, added or removed, the batch's clipped sum moves by at most two clips), 1 for a user
    whose whole contribution is added or removed (user-level accounting in delta mode)."""
    if not sensitivity > 0.0:
        raise ValueError(f"sensitivity={sensitivity}: the clipped units one neighbour moves, > 0 (2: an example, "
                         "1: a whole user's delta)")
    total = 0.0
    for name, (rho, sigma, clip, _thr) in table.items():
        if rho == 0.0 or clip == 0.0:
            continue  # pure noise, or clipped to nothing: nothing of the batch leaves through this tensor
        if not sigma > 0.0:
            return 0.0  # signal without noise: no finite epsilon
        units = 1
        if modes[name] == "rows":
            units = int((rows or {}).get(name, max(shapes[name])))
        total += units * (sensitivity * rho * clip / sigma) ** 2
    return math.inf if total == 0.0 else 1.0 / math.sqrt(total)


def epsilons(z: float, compositions: int, sample_rate: float, delta: float) -> tuple[float, float, str]:
    """(epsilon, RDP epsilon, method) of ``compositions`` Gaussian mechanisms of multiplier z, each
    sampled at ``sample_rate``; method "exact" (no sampling), "prv", "rdp" (beyond PRV_LIMIT) or "unsampled"
    (the exact composition without amplification, where it is below the RDP bound)."""
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
    if sample_rate == 1.0:
        try:
            rdp = _opacus("rdp", z, compositions, sample_rate, delta)
        except ImportError:  # the exact value needs no accountant; only its cross-check does
            rdp = math.nan
        return gaussian_epsilon(math.sqrt(compositions) / z, delta), rdp, "exact"
    rdp = _opacus("rdp", z, compositions, sample_rate, delta)
    # sampling only helps (each sampled round is a mixture dominated by the unsampled one), so the exact
    # unsampled composition bounds it too: where amplification is negligible it beats the RDP bound
    unsampled = gaussian_epsilon(math.sqrt(compositions) / z, delta)
    if not rdp <= PRV_LIMIT:
        return (rdp, rdp, "rdp") if rdp <= unsampled else (unsampled, rdp, "unsampled")
    prv = _opacus("prv", z, compositions, sample_rate, delta)
    return (prv, rdp, "prv") if prv <= rdp else (rdp, rdp, "rdp")  # PRV is the tighter: never above RDP


def prv_epsilon(z: float, compositions: int, sample_rate: float, delta: float) -> float:
    """Opacus's PRV accountant alone (the cross-check of :func:`gaussian_epsilon` at sample_rate 1)."""
    return _opacus("prv", z, compositions, sample_rate, delta)


def _opacus(kind: str, z: float, compositions: int, sample_rate: float, delta: float) -> float:
    try:
        from opacus.accountants import PRVAccountant, RDPAccountant
    except ImportError as err:
        raise ImportError(f"epsilon with sampling {sample_rate:g} needs Opacus's accountants: pip install opacus "
                          "(or aegis-flood[fl])") from err

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


def calibrate_noise_multiplier(epsilon: float, compositions: int, *, sample_rate: float = 1.0,
                               delta: float = DELTA, tolerance: float = 1e-3) -> float:
    """The smallest noise multiplier z (within a relative ``tolerance``, rounded up) at which ``compositions``
    Gaussian mechanisms, each sampled at ``sample_rate``, give at most ``epsilon`` at ``delta`` by
    :func:`epsilons` (its epsilon decreases as z grows). Without sampling z = sqrt(compositions) / mu with
    mu the exact Gaussian parameter of ``epsilon`` (:func:`gaussian_epsilon` inverted)."""
    if not (epsilon > 0.0 and math.isfinite(epsilon)):
        raise ValueError(f"epsilon={epsilon}: the target is a finite epsilon > 0 (e.g. 8)")
    if compositions < 1:
        raise ValueError(f"compositions={compositions}: calibrate for at least one round (export)")
    if not 0.0 < tolerance < 1.0:
        raise ValueError(f"tolerance={tolerance}: a relative precision in (0, 1), e.g. 1e-3")

    def exact(z: float) -> bool:
        return gaussian_epsilon(math.sqrt(compositions) / z, delta) > epsilon

    def stated(z: float) -> bool:
        return epsilons(z, compositions, sample_rate, delta)[0] > epsilon

    unsampled = _smallest(exact, 1.0, tolerance)
    # sampling never raises epsilon, so the unsampled z suffices: the costlier search starts there
    return unsampled if sample_rate == 1.0 else _smallest(stated, unsampled, tolerance)


def _smallest(too_weak: Callable[[float], bool], z: float, tolerance: float) -> float:
    """The smallest z (to a relative ``tolerance``, rounded up) at which ``too_weak`` turns False, searched
    from ``z``: up by doubling, down by halving from z / 1.5, then bisected in log z."""
    hi = z
    while too_weak(hi):
        hi *= 2.0
    lo = hi / 1.5
    while not too_weak(lo) and lo > 1e-6:
        lo, hi = lo / 2.0, lo
    while hi / lo > 1.0 + tolerance:  # too_weak(lo), not too_weak(hi)
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if too_weak(mid) else (lo, mid)
    return hi


def statement(z: float, compositions: int, *, sample_rate: float = 1.0, delta: float = DELTA) -> PrivacyStatement:
    """The :class:`PrivacyStatement` of ``compositions`` exports at noise multiplier z."""
    eps, rdp, method = epsilons(z, compositions, sample_rate, delta)
    return PrivacyStatement(z, compositions, sample_rate, delta, eps, rdp, method)
