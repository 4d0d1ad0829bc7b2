"""An attacker's test battery against the flood's noise stream: can the stored bits of an exported
rows-flood tensor tell pure-noise rows (v outside S: out[v] = sigma Z[v]) from signal-carrying rows
(out[v] = s_v G[v] + sigma Z[v]) when the norms carry nothing (sigma >> ||s_v G[v]||)?

Threat model: the server holds every exported tensor (its dtype and stored bits), the model, this code,
the flood formulas and the public sigma; not the key. Any per-row statistic whose law differs between
the two kinds of row tells it which rows (tokens) were in the private batch.

Feature families (each ``f(x, sigma) -> (V, k)`` float64 features of a V x d exported tensor ``x``):

    angle      lattices of lane-pair angles: theta = atan2(x_j, x_i) for pairs (i, i + s), strides
               s = 1..16 (pairs (2k, 2k+1), the streams' own Box-Muller pairing, and (2k+1, 2k+2));
               at resolutions 2^8 .. 2^20 per turn: mean cos / sin of the phase 2^b theta (any lattice,
               any offset) and the fraction of pairs on the lattice within the dtype's angle precision
    radius     radius lattices: u = exp(-(x_i^2 + x_j^2) / (2 sigma^2)) (the Box-Muller uniform) on
               k 2^-b grids, b = 8..24, pairs at strides 1, 2, 4, 8, 16 (and (2k+1, 2k+2)): phase
               cos / sin and the fraction on-grid within u's precision
    mantissa   low mantissa bits of the stored values: per-bit frequencies, the low-4-bit histogram,
               trailing zeros, the top-3-bit histogram
    collision  exact zeros, -0, values repeated within the row, |values| repeated within the row,
               values (and lane pairs) that occur in other rows
    tail       max |x| / sigma, tail fractions beyond 2..6 sigma, the second and fourth moments
    image      fp32 rounding images: the fraction of stored values no fp32 z can produce as fl(c z) for
               the public multipliers c the code applies last (sigma; sigma after INV_SQRT2; the
               kernels' folded sigma INV_SQRT2). A pure-noise row ends in such a product; a signal
               row adds s_v G[v] before the last rounding and lands anywhere. (This breaks the
               ChaCha stream's fp32 outputs: z -> fl(c z) misses a share 1 - 1/m of the fp32 values
               in the part of each binade above c's mantissa m, so ~10-20% of a signal row's values
               are impossible for pure noise; 16-bit outputs round far coarser and are not affected.)

``distinguish(features, labels)``: two-fold cross-fitted held-out AUC (train on one half of the rows,
score the other, swap, average) of an L2 logistic regression on standardized features, per family and
all together. Needs torch (and nothing else): LBFGS fit, Mann-Whitney AUC.

``old_lattice_statistic(x)``: the statistic that broke the old Philox stream (12-bit angle lattice of
the lane pairs (2k, 2k+1)).
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence

import torch
from torch import Tensor

TWO_PI = 2 * math.pi
INV_SQRT2 = 0.7071067811865476
STRIDES = tuple(range(1, 17))
ANGLE_BITS = tuple(range(8, 21))
RADIUS_BITS = tuple(range(8, 25))
RADIUS_STRIDES = (1, 2, 4, 8, 16)
OLD_ANGLE_BITS = 12
OLD_TOLERANCE = 2e-6  # rad: 4 x the old stream's own fp32 angle error (max 4.7e-7 measured), 1/770 of a 2^12 cell
TAIL_LEVELS = (2.0, 3.0, 4.0, 5.0, 6.0)

__all__ = [
    "FAMILIES", "pairings", "angle_features", "radius_features", "mantissa_features", "collision_features",
    "tail_features", "image_features", "unreachable", "extract", "distinguish", "battery", "auc", "auc_null_sd",
    "old_lattice_statistic", "image_multipliers", "STRIDES", "ANGLE_BITS", "RADIUS_BITS", "RADIUS_STRIDES",
]


# ----------------------------------------------------------------------------- helpers
def pairings(d: int, strides: Iterable[int] = STRIDES) -> list[tuple[str, Tensor, Tensor]]:
    """Disjoint lane pairs (i, i + s) per stride: i in the first half of each block of 2s lanes (s = 1:
    (2k, 2k+1), the streams' own pairing), plus the shifted pairing (2k+1, 2k+2). Strides with no full
    block in d are left out."""
    out = []
    for s in strides:
        blocks = d // (2 * s)
        if blocks == 0:
            continue
        i = (torch.arange(blocks)[:, None] * 2 * s + torch.arange(s)[None, :]).reshape(-1)
        out.append((f"s{s}", i, i + s))
    if d >= 3:
        i = torch.arange(1, d - 1, 2)
        out.append(("s1+1", i, i + 1))
    return out


def _eps(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps if dtype.is_floating_point else torch.finfo(torch.float32).eps


def _as64(x: Tensor, sigma: float | Tensor) -> Tensor:
    s = float(sigma)
    return x.double() / (s if s > 0 else 1.0)


def _doubling_phases(c: Tensor, s: Tensor, count: int):
    """Yield (cos, sin) of 2^k phi for k = 0 .. count - 1 from (cos phi, sin phi) by repeated squaring
    (fp64: each squaring doubles the relative error, ~2^24 eps after 24 steps, far below any use here)."""
    for k in range(count):
        yield c, s
        if k + 1 < count:
            c, s = (c - s) * (c + s), 2 * c * s


def angle_features(x: Tensor, sigma: float | Tensor, strides: Iterable[int] = STRIDES,
                   bits: Sequence[int] = ANGLE_BITS) -> Tensor:
    """(a) Angle lattices: per pairing and resolution 2^b per turn, [mean cos, mean sin of the phase
    2^b theta, fraction of pairs within the dtype's angle precision of a lattice angle j 2 pi / 2^b].
    The phase's mean cos / sin detect a lattice of any offset (the half-offset one gives cos -> -1)."""
    bits = _consecutive(bits)
    x64 = _as64(x, sigma)
    tol = 8 * _eps(x.dtype)  # rad: a few roundings of each coordinate
    feats = []
    for _, i, j in pairings(x.shape[1], strides):
        i, j = i.to(x.device), j.to(x.device)
        a, b = x64[:, i], x64[:, j]
        r = torch.sqrt(a * a + b * b)
        zero = r == 0
        r = torch.where(zero, 1.0, r)
        c, s = torch.where(zero, 1.0, a / r), b / r  # e^{i theta}
        for _ in range(bits[0]):  # e^{i 2^b0 theta}
            c, s = (c - s) * (c + s), 2 * c * s
        for n, (cos, sin) in enumerate(_doubling_phases(c, s, len(bits))):
            # on the lattice within tol <=> the phase 2^b theta within 2^b tol of 0 (mod 2 pi)
            cut = math.cos(min(2.0 ** (bits[0] + n) * tol, math.pi))
            feats += [cos.mean(1), sin.mean(1), (cos >= cut).double().mean(1)]
    return _stack(feats, x)


def radius_features(x: Tensor, sigma: float | Tensor, strides: Iterable[int] = RADIUS_STRIDES,
                    bits: Sequence[int] = RADIUS_BITS) -> Tensor:
    """(b) Radius lattices: u = exp(-r^2 / 2), r^2 = (x_i^2 + x_j^2) / sigma^2 (the Box-Muller uniform
    when (i, j) is a pair); per pairing and grid k 2^-b, [mean cos, mean sin of 2 pi 2^b u, fraction
    within u's precision of the grid]."""
    bits = _consecutive(bits)
    x64 = _as64(x, sigma)
    eps = _eps(x.dtype)
    feats = []
    for _, i, j in pairings(x.shape[1], strides):
        i, j = i.to(x.device), j.to(x.device)
        r2 = x64[:, i] ** 2 + x64[:, j] ** 2
        u = torch.exp(-r2 / 2)
        tol = 4 * eps * u * (1 + r2)  # du from a relative error ~eps in each coordinate
        half_phi2 = 0.5 * (TWO_PI * 2.0 ** bits[0] * tol) ** 2  # (phase tolerance)^2 / 2 at the first grid
        t0 = u * 2.0 ** bits[0]
        phase = TWO_PI * (t0 - torch.round(t0))
        for n, (c, s) in enumerate(_doubling_phases(torch.cos(phase), torch.sin(phase), len(bits))):
            # on the grid within tol <=> |phase| <= 2 pi 2^b tol; 1 - cos(phase) <= phase^2 / 2
            tight = (1 - c) <= half_phi2 * 4.0**n
            feats += [c.mean(1), s.mean(1), tight.double().mean(1)]
    return _stack(feats, x)


def _consecutive(bits: Sequence[int]) -> list[int]:
    bits = sorted(int(b) for b in bits)
    if not bits or bits != list(range(bits[0], bits[0] + len(bits))):
        raise ValueError(f"bits must be consecutive integers, got {bits}")
    return bits


def _bits(x: Tensor) -> tuple[Tensor, int]:
    """Stored bits as int64 (sign included) and the mantissa width."""
    if x.dtype == torch.float32:
        return x.view(torch.int32).to(torch.int64) & 0xFFFFFFFF, 23
    if x.dtype == torch.float16:
        return x.view(torch.int16).to(torch.int64) & 0xFFFF, 10
    if x.dtype == torch.bfloat16:
        return x.view(torch.int16).to(torch.int64) & 0xFFFF, 7
    raise TypeError(f"unsupported dtype {x.dtype}: the battery reads fp32, fp16 and bf16 exports")


def mantissa_features(x: Tensor, sigma: float | Tensor = 1.0) -> Tensor:
    """(c) Low mantissa bits: frequency of each of the low 8 bits, histogram of the low 4 bits, mean
    trailing zeros of the mantissa, histogram of the top 3 mantissa bits, exponent parity."""
    w, mbits = _bits(x)
    mant = w & ((1 << mbits) - 1)
    feats = [((mant >> k) & 1).double().mean(1) for k in range(min(8, mbits))]
    low = mant & 15
    feats += [(low == v).double().mean(1) for v in range(16)]
    tz = torch.zeros_like(mant, dtype=torch.float64)
    for k in range(mbits):
        tz += ((mant & ((1 << (k + 1)) - 1)) == 0).double()
    feats.append(tz.mean(1))
    top = mant >> (mbits - 3)
    feats += [(top == v).double().mean(1) for v in range(8)]
    feats.append(((w >> mbits) & 1).double().mean(1))
    return _stack(feats, x)


def _repeat_fractions(keys: Tensor) -> tuple[Tensor, Tensor]:
    """Per row of (V, m) int64 keys: fraction that repeat within the row, fraction that occur in another row."""
    V, m = keys.shape
    _, inv, cnt = torch.unique(keys.reshape(-1), return_inverse=True, return_counts=True)
    glob = cnt[inv].reshape(V, m)
    row = torch.arange(V, device=keys.device, dtype=torch.int64)[:, None]
    _, inv_r, cnt_r = torch.unique(row * cnt.numel() + inv.reshape(V, m), return_inverse=True, return_counts=True)
    within = cnt_r[inv_r].reshape(V, m)
    return (within > 1).double().mean(1), (glob > within).double().mean(1)


def collision_features(x: Tensor, sigma: float | Tensor = 1.0) -> Tensor:
    """(d) Collisions: exact zeros, negative zeros, values / |values| repeated within the row, values
    and adjacent lane pairs (2k, 2k+1) that occur in other rows, mean log global multiplicity."""
    w, mbits = _bits(x)
    sign = 1 << (31 if mbits == 23 else 15)
    mag = w & (sign - 1)
    feats = [(mag == 0).double().mean(1), (w == sign).double().mean(1)]
    feats += list(_repeat_fractions(w))
    feats += list(_repeat_fractions(mag))
    if x.shape[1] >= 2:
        pairs = w[:, 0 : x.shape[1] // 2 * 2].reshape(x.shape[0], -1, 2)
        shift = 16 if mbits < 23 else 32
        feats += list(_repeat_fractions((pairs[..., 0] << shift) | pairs[..., 1]))
    _, inv, cnt = torch.unique(w.reshape(-1), return_inverse=True, return_counts=True)
    feats.append(torch.log(cnt[inv].double()).reshape(w.shape).mean(1))
    return _stack(feats, x)


def tail_features(x: Tensor, sigma: float | Tensor) -> Tensor:
    """(e) Tails: max |x| / sigma, mean of the 4 largest, fractions beyond 2..6 sigma, near-zero
    fraction, mean (x / sigma)^2 and the kurtosis ratio m4 / m2^2."""
    a = _as64(x, sigma).abs()
    top = a.topk(min(4, a.shape[1]), dim=1).values
    m2 = (a**2).mean(1)
    feats = [top[:, 0], top.mean(1)] + [(a > t).double().mean(1) for t in TAIL_LEVELS]
    feats += [(a < 1e-3).double().mean(1), m2, (a**4).mean(1) / m2.clamp_min(1e-300) ** 2]
    return _stack(feats, x)


def _step(z: Tensor, k: int) -> Tensor:
    """fp32 z moved k ulps in magnitude (its bit pattern plus k; finite nonzero z, either sign)."""
    return (z.view(torch.int32) + k).view(torch.float32) if k else z


def _preimages(y: Tensor, c: Tensor, reach: int = 2) -> list[tuple[Tensor, Tensor]]:
    """Candidates z (fp32) around y / c with the mask fl(c z) == y: every fp32 preimage of y under
    z -> fl(c z) lies within a couple of ulps of fl(y / c)."""
    z0 = y / c
    return [(z, (z * c) == y) for z in (_step(z0, k) for k in range(-reach, reach + 1))]


def unreachable(y: Tensor, *multipliers: float | Tensor) -> Tensor:
    """Mask of fp32 values y that no fp32 z produces as fl(c_1 fl(c_2 ... fl(c_n z))) (left to right:
    c_1 is the last multiply). A pure-noise fp32 output ending in such products is never unreachable."""
    y = y.float()
    cs = [torch.as_tensor(c, dtype=torch.float32, device=y.device) for c in multipliers]
    ok = torch.zeros_like(y, dtype=torch.bool)
    if len(cs) == 1:
        for _, m in _preimages(y, cs[0]):
            ok |= m
    else:
        for z, m in _preimages(y, cs[0]):
            ok |= m & ~unreachable(z, *cs[1:])
    return ~ok


def image_multipliers(sigma: float | Tensor) -> dict[str, tuple[Tensor, ...]]:
    """The public last multiplies of the fp32 noise paths: the reference's fl(sigma fl(INV_SQRT2 s)),
    its outer sigma alone, and the kernels' fl(s fl(sigma INV_SQRT2))."""
    s = torch.as_tensor(float(sigma), dtype=torch.float32)
    inv = torch.tensor(INV_SQRT2, dtype=torch.float32)
    return {"sigma": (s,), "sigma.inv_sqrt2": (s, inv), "folded": (s * inv,)}


def image_features(x: Tensor, sigma: float | Tensor) -> Tensor:
    """(f) fp32 rounding images: per public multiplier chain, the fraction of the row's stored values
    (as fp32) that the chain cannot produce."""
    y = x.float()
    feats = [unreachable(y, *[c.to(x.device) for c in cs]).double().mean(1) for cs in image_multipliers(sigma).values()]
    return _stack(feats, x)


def _stack(feats: list[Tensor], x: Tensor) -> Tensor:
    if not feats:
        return torch.zeros(x.shape[0], 0, dtype=torch.float64)
    return torch.stack(feats, 1).cpu()


FAMILIES: dict[str, Callable[[Tensor, float], Tensor]] = {
    "angle": angle_features,
    "radius": radius_features,
    "mantissa": mantissa_features,
    "collision": collision_features,
    "tail": tail_features,
    "image": image_features,
}


def extract(x: Tensor, sigma: float | Tensor, families: Iterable[str] | None = None) -> dict[str, Tensor]:
    """Every (or the named) family's (V, k) features of an exported rows-flood tensor."""
    if x.dim() != 2:
        raise ValueError(f"rows-flood tensors are V x d, got shape {tuple(x.shape)}")
    names = list(FAMILIES) if families is None else list(families)
    return {name: FAMILIES[name](x, float(sigma)) for name in names}


# ----------------------------------------------------------------------------- classifier
def auc(scores: Tensor, labels: Tensor) -> float:
    """Mann-Whitney AUC = P(score of a positive > score of a negative) + P(tie) / 2."""
    scores = scores.double().cpu().reshape(-1)
    labels = labels.bool().cpu().reshape(-1)
    n1 = int(labels.sum())
    n0 = labels.numel() - n1
    if n1 == 0 or n0 == 0:
        raise ValueError("auc needs both classes")
    uniq, inv, cnt = torch.unique(scores, return_inverse=True, return_counts=True)
    ends = torch.cumsum(cnt, 0).double()
    mid = ends - (cnt.double() - 1) / 2  # average rank of each tie group (1-based)
    rank_sum = mid[inv][labels].sum().item()
    return (rank_sum - n1 * (n1 + 1) / 2) / (n1 * n0)


def auc_null_sd(n_pos: int, n_neg: int, folds: int = 1) -> float:
    """Standard deviation of a held-out AUC under "no structure" (Mann-Whitney null) when the rows
    (n_pos signal, n_neg noise) are dealt into ``folds`` test folds: the sd of ONE fold's AUC. That is
    also the figure for ``distinguish``'s mean over cross-fitted folds: under the null the fold AUCs
    are strongly correlated (each classifier learns its training half's chance direction, and both
    score high when the two halves' chance directions agree; measured: correlation 0.65, sd of the
    mean 0.019 vs 0.020 for one fold, 3000 x 128 rows, 500 signal), so averaging buys little."""
    p, n = n_pos / folds, n_neg / folds
    return math.sqrt((p + n + 1) / (12 * p * n))


def _fit_logistic(X: Tensor, y: Tensor, alpha: float, max_iter: int) -> Tensor:
    """Class-balanced L2 logistic regression by LBFGS: weights (k + 1,), the last one the bias."""
    n, k = X.shape
    pos = y.sum().clamp_min(1)
    wts = torch.where(y > 0.5, 0.5 / pos, 0.5 / (n - pos).clamp_min(1))
    w = torch.zeros(k + 1, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([w], lr=1.0, max_iter=max_iter, tolerance_grad=1e-7, tolerance_change=1e-10,
                            history_size=20, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        logit = X @ w[:-1] + w[-1]
        loss = (wts * torch.nn.functional.binary_cross_entropy_with_logits(logit, y, reduction="none")).sum()
        loss = loss + 0.5 * alpha * (w[:-1] ** 2).sum()
        loss.backward()
        return loss

    opt.step(closure)
    return w.detach()


def _standardize(train: Tensor, test: Tensor, clip: float = 8.0) -> tuple[Tensor, Tensor]:
    train = torch.nan_to_num(train, nan=0.0, posinf=1e300, neginf=-1e300)
    test = torch.nan_to_num(test, nan=0.0, posinf=1e300, neginf=-1e300)
    mu, sd = train.mean(0), train.std(0)
    keep = sd > 1e-12 * (1 + mu.abs())
    z = lambda a: ((a[:, keep] - mu[keep]) / sd[keep]).clamp(-clip, clip)  # noqa: E731
    return z(train), z(test)


def _folds(labels: Tensor, folds: int, seed: int) -> Tensor:
    """Stratified fold index per row: each class shuffled, then dealt round-robin."""
    gen = torch.Generator().manual_seed(seed)
    fold = torch.empty(labels.numel(), dtype=torch.int64)
    for cls in (False, True):
        idx = torch.nonzero(labels == cls).reshape(-1)
        idx = idx[torch.randperm(idx.numel(), generator=gen)]
        fold[idx] = torch.arange(idx.numel()) % folds
    return fold


def distinguish(features: Mapping[str, Tensor] | Tensor, labels: Tensor, *, folds: int = 2, seed: int = 0,
                alpha: float = 1e-2, max_iter: int = 60, together: bool = True) -> dict[str, float]:
    """Held-out AUC of a classifier of ``labels`` (True: signal rows) from each family's features.

    Per fold: an L2 logistic regression on the other folds' rows (features standardized on them,
    constant ones dropped), scored on this fold's rows; the AUC is the mean over folds (folds=2: train
    on half, test on the other half, and swap). ``together``: also the family "all" (features
    concatenated). A family with no usable feature scores 0.5."""
    if isinstance(features, Tensor):
        features = {"features": features}
    labels = labels.bool().cpu().reshape(-1)
    fams = {k: v.double().cpu().reshape(labels.numel(), -1) for k, v in features.items()}
    if together and len(fams) > 1:
        fams["all"] = torch.cat(list(fams.values()), 1)
    fold = _folds(labels, folds, seed)
    out = {}
    for name, X in fams.items():
        aucs = []
        for f in range(folds):
            tr, te = fold != f, fold == f
            Xtr, Xte = _standardize(X[tr], X[te])
            if Xtr.shape[1] == 0:
                aucs.append(0.5)
                continue
            w = _fit_logistic(Xtr, labels[tr].double(), alpha, max_iter)
            aucs.append(auc(Xte @ w[:-1] + w[-1], labels[te]))
        out[name] = sum(aucs) / len(aucs)
    return out


def battery(x: Tensor, sigma: float | Tensor, labels: Tensor, families: Iterable[str] | None = None,
            **kwargs) -> dict[str, float]:
    """extract + distinguish: family -> held-out AUC (and "all")."""
    return distinguish(extract(x, sigma, families), labels, **kwargs)


# ----------------------------------------------------------------------------- the old break
def old_lattice_statistic(x: Tensor, tol: float = OLD_TOLERANCE, bits: int = OLD_ANGLE_BITS) -> Tensor:
    """Per row: how many lane pairs (2k, 2k+1) have atan2(x[2k+1], x[2k]) within ``tol`` radians of
    j 2 pi / 2^bits. The old stream drew each pair as r (cos theta, sin theta) with theta on the 2^12
    lattice, so a pure-noise fp32 row had (almost) every pair on it and a signal row (almost) none."""
    x64 = x.double()
    m = x.shape[1] // 2
    theta = torch.atan2(x64[:, 1 : 2 * m : 2], x64[:, 0 : 2 * m : 2])
    u = theta * (2.0**bits / TWO_PI)
    return (((u - torch.round(u)).abs() * (TWO_PI / 2.0**bits)) <= tol).sum(1).cpu()
