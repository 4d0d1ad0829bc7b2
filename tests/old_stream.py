"""The OLD AEGIS noise stream and rows flood (commit 4d4065b, ``aegis_kernels/reference.py``), kept
in pure PyTorch as the regression target of tests/test_noise_battery.py: the attack battery must
break it.

    element i of a tensor flooded at ``offset`` has global index e = offset + i;
    counter  c = e // 8   (64 bit, split into two 32-bit words)
    (x0, x1, x2, x3) = Philox4x32-10(key = (seed_lo, seed_hi), counter = (c_lo, c_hi, 0, 0))
    word x_k gives lanes 2k and 2k + 1 (Box-Muller):
        u = (x_k >> 12) 2^-20 + 2^-21               (its high 20 bits, a cell midpoint)
        theta = (x_k & 0xFFF) * fp32(2 pi / 4096)   (its low 12 bits)
        (r cos theta, r sin theta),  r = sqrt(-2 ln u)
    Z[i] = lane e % 8 of counter c

    rows flood (G in R^{V x d}):  n_v = ||G[v]||, M = max_v n_v, S = {v : n_v > tau M},
                                  sigma = lam mean_{v in S} n_v,
                                  out = where(S, rho G, 0) + sigma Z          (fp32, cast to G's dtype)

A copy of the old code, eager only: bit-identical to the old reference run with
AEGIS_REFERENCE_COMPILE=0 (checked against ``git show 4d4065b:aegis_kernels/reference.py``); the old
CPU default (Inductor-compiled ``_normals``) differs in the last ulp of cos / sin / log (a third of the
values, relative error <= 3e-7), which moves no angle off its 2^12 lattice. Philox matches the
Random123 known-answer vectors. Nothing here is used by the library.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

MASK32 = 0xFFFFFFFF
SEED_BITS = 62
PHILOX_KEY_A = 0x9E3779B9
PHILOX_KEY_B = 0xBB67AE85
PHILOX_ROUND_A = 0xD2511F53
PHILOX_ROUND_B = 0xCD9E8D57
PHILOX_ROUNDS = 10
LANES = 8  # normals per Philox counter: two per 32-bit word
ANGLE_BITS = 12  # low bits of a word: the angle; the high 20: the radius
RADIUS_STEP = 2.0 ** (ANGLE_BITS - 32)
ANGLE_STEP = 2 * math.pi / (1 << ANGLE_BITS)  # used as fp32: theta = k * fp32(2 pi / 4096), one rounding


def _mulhilo(a: Tensor, b: int) -> tuple[Tensor, Tensor]:
    """(hi, lo) 32-bit words of a * b for uint32 values held in int64, without int64 overflow."""
    b_hi, b_lo = b >> 16, b & 0xFFFF
    t_lo = a * b_lo  # < 2^48
    t_hi = a * b_hi  # < 2^48
    return (t_hi + (t_lo >> 16)) >> 16, (((t_hi & 0xFFFF) << 16) + t_lo) & MASK32


def philox4x32(
    key: int | Tensor, c0: Tensor, c1: Tensor, c2: Tensor, c3: Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Philox4x32-10 (Salmon et al. 2011) on uint32 words stored in int64 tensors; key = k0 | k1 << 32."""
    k0 = key & MASK32
    k1 = (key >> 32) & MASK32
    for _ in range(PHILOX_ROUNDS):
        hi_b, lo_b = _mulhilo(c2, PHILOX_ROUND_B)
        hi_a, lo_a = _mulhilo(c0, PHILOX_ROUND_A)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0 = (k0 + PHILOX_KEY_A) & MASK32
        k1 = (k1 + PHILOX_KEY_B) & MASK32
    return c0, c1, c2, c3


def _uniform(x: Tensor) -> Tensor:
    """Radius uniform of a 32-bit word: its high 20 bits k as (k + 1/2) 2^-20, exact in fp32, in (0, 1)."""
    return (x >> ANGLE_BITS).to(torch.float32) * RADIUS_STEP + RADIUS_STEP / 2


def _box_muller(x: Tensor) -> tuple[Tensor, Tensor]:
    """Two normals from one word: r = sqrt(-2 ln u) from the high 20 bits, theta from the low 12."""
    theta = (x & ((1 << ANGLE_BITS) - 1)).to(torch.float32) * torch.tensor(ANGLE_STEP, dtype=torch.float32)
    r = torch.sqrt(-2.0 * torch.log(_uniform(x)))
    return r * torch.cos(theta), r * torch.sin(theta)


def _normals(counters: Tensor, key: Tensor) -> Tensor:
    """The eight normals of each 64-bit counter: shape (n, 8), fp32; word k gives lanes 2k, 2k + 1."""
    zero = torch.zeros_like(counters)
    words = philox4x32(key, counters & MASK32, (counters >> 32) & MASK32, zero, zero)
    return torch.stack([z for x in words for z in _box_muller(x)], dim=1)


def check_offset(offset: int) -> None:
    if offset < 0 or offset % LANES:
        raise ValueError(f"offset={offset}: noise offsets must be non-negative multiples of {LANES}")


def noise(shape, seed: int | Tensor, offset: int = 0, device=None) -> Tensor:
    """Standard normal Z of ``shape`` (fp32) drawn from the old (seed, offset) stream."""
    check_offset(offset)
    n = math.prod(shape)
    device = torch.device(device or "cpu")
    key = torch.as_tensor(seed, dtype=torch.int64, device=device)
    counters = torch.arange((n + LANES - 1) // LANES, dtype=torch.int64, device=device) + offset // LANES
    return _normals(counters, key).reshape(-1)[:n].reshape(tuple(shape))


def _finish(out32: Tensor, stats: Tensor, grad: Tensor) -> tuple[Tensor, Tensor]:
    finite = torch.isfinite(grad).all()
    nan = torch.tensor(float("nan"), dtype=torch.float32, device=grad.device)
    return torch.where(finite, out32, nan).to(grad.dtype), torch.where(finite, stats, nan)


def flood_rows(grad: Tensor, rho: float, lam: float, rel_threshold: float, z: Tensor) -> tuple[Tensor, Tensor]:
    """Old rows flood with explicit noise ``z``; stats = [m_bar, sigma, |S|, M]."""
    g = grad.float()
    norms = torch.linalg.vector_norm(g, dim=1)  # (E1)
    peak = norms.amax() if norms.numel() else norms.new_zeros(())  # M
    active = norms > rel_threshold * peak  # (E2) S = {v : n_v > tau M}
    count = active.sum().to(torch.float32)
    m_bar = (norms * active).sum() / count.clamp(min=1.0)  # (E3) mean over S
    sigma = lam * m_bar
    out = torch.where(active[:, None], rho * g, 0.0) + sigma * z  # (E4)
    return _finish(out, torch.stack((m_bar, sigma, count, peak)), grad)


def flood(grad: Tensor, mode: str, rho: float, lam: float, rel_threshold: float, seed: int | Tensor | None = None,
          offset: int = 0, z: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Old rows flood from the (seed, offset) stream (or an explicit ``z``); stats = [m_bar, sigma, |S|, M]."""
    if mode != "rows":
        raise ValueError("old_stream keeps the rows flood only")
    if grad.dim() != 2:
        raise ValueError("rows flood needs a 2-D gradient")
    if z is None:
        z = noise(tuple(grad.shape), seed, offset, device=grad.device)
    return flood_rows(grad, rho, lam, rel_threshold, z.to(device=grad.device, dtype=torch.float32))
