"""Executable specification of the AEGIS floods (DESIGN §1) in plain PyTorch.

Every kernel is judged against this file. Equation tags refer to the paper:
(E1) row norms, (E2) active set, (E3) norm-mean calibration, (E4) rows flood,
(E5) matrix flood. All statistics are accumulated in fp32; outputs keep the
gradient's dtype; nothing here synchronises with the host.

The noise stream (shared with the Triton kernels, bit for bit up to the last
ulp of the transcendental functions):

    element i of a tensor flooded at ``offset`` has global index e = offset + i;
    counter  c = e // 8   (64 bit, split into two 32-bit words)
    (x0, x1, x2, x3) = Philox4x32-10(key = (seed_lo, seed_hi), counter = (c_lo, c_hi, 0, 0))
    word x_k gives lanes 2k and 2k + 1 (Box-Muller):
        u = (x_k >> 12) 2^-20 + 2^-21          (its high 20 bits, a cell midpoint: exact, never 0)
        theta = (x_k & 0xFFF) * fp32(2 pi / 4096)   (its low 12 bits)
        (r cos theta, r sin theta),  r = sqrt(-2 ln u)
    Z[i] = lane e % 8 of counter c

Eight normals per Philox call: the call (20 32x32-bit products) is what bounds the GPU flood, and
at four normals per call the bf16 rows flood could not reach the memory floor. The 12-bit angle
lattice is exact for the moments: the mean of cos^k over 4096 equally spaced angles is the
continuous one for every k < 4096, so E[z^2] = E[r^2] / 2 = 1 - 3.3e-7 (the radius's midpoint rule);
the 20-bit radius caps |z| at sqrt(42 ln 2) ~ 5.40 (mass beyond: 7e-8).
Offsets must be multiples of 8 so every tensor starts on a counter boundary.
"""
from __future__ import annotations

import math
import os

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
DERIVE_DOMAIN = 1  # third counter word of the per-step seed derivation


def _mulhilo(a: Tensor, b: int) -> tuple[Tensor, Tensor]:
    """(hi, lo) 32-bit words of a * b for uint32 values held in int64, without int64 overflow."""
    b_hi, b_lo = b >> 16, b & 0xFFFF
    t_lo = a * b_lo  # < 2^48
    t_hi = a * b_hi  # < 2^48
    return (t_hi + (t_lo >> 16)) >> 16, (((t_hi & 0xFFFF) << 16) + t_lo) & MASK32


def philox4x32(
    key: int | Tensor, c0: Tensor, c1: Tensor, c2: Tensor, c3: Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Philox4x32-10 (Salmon et al. 2011) on uint32 words stored in int64 tensors."""
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


def check_offset(offset: int) -> None:
    if offset < 0 or offset % LANES:
        raise ValueError(
            f"offset={offset}: noise offsets must be non-negative multiples of {LANES} "
            "(use aegis_kernels.stream_offsets to partition the stream)"
        )


def _normals(counters: Tensor, key: Tensor) -> Tensor:
    """The eight normals of each 64-bit counter: shape (n, 8), fp32; word k gives lanes 2k, 2k + 1."""
    zero = torch.zeros_like(counters)
    words = philox4x32(key, counters & MASK32, (counters >> 32) & MASK32, zero, zero)
    return torch.stack([z for x in words for z in _box_muller(x)], dim=1)


_fused_normals = None


def _normals_fn(device: torch.device):
    """On CPU, _normals compiled by Inductor into one vectorised loop (~10x faster than eager's
    hundred passes); AEGIS_REFERENCE_COMPILE=0 or a failed compile falls back to eager."""
    global _fused_normals
    if device.type != "cpu" or os.environ.get("AEGIS_REFERENCE_COMPILE", "1") == "0":
        return _normals
    if _fused_normals is None:
        try:
            compiled = torch.compile(_normals, dynamic=True)
            compiled(torch.arange(8, dtype=torch.int64), torch.tensor(1))
            _fused_normals = compiled
        except Exception:  # no C++ toolchain, unsupported platform: stay correct, just slower
            _fused_normals = _normals
    return _fused_normals


def noise(shape: tuple[int, ...] | list[int], seed: int | Tensor, offset: int, device=None) -> Tensor:
    """Standard normal Z of ``shape`` (fp32) drawn from the (seed, offset) stream above."""
    check_offset(offset)
    n = math.prod(shape)
    device = torch.device(device or "cpu")
    key = torch.as_tensor(seed, dtype=torch.int64, device=device)
    counters = torch.arange((n + LANES - 1) // LANES, dtype=torch.int64, device=device) + offset // LANES
    return _normals_fn(device)(counters, key).reshape(-1)[:n].reshape(shape)


def derive_seed(key: int | Tensor, step: int | Tensor) -> Tensor:
    """Per-step seed PRF(key, step): what a captured CUDA graph computes on device.

    Philox keyed by the shield's secret with counter (step_lo, step_hi, 1, 0); the third
    word separates this use from the noise stream. Returns a 62-bit int64 tensor.
    """
    step = torch.as_tensor(step, dtype=torch.int64)
    device = step.device
    key = key.to(device) if isinstance(key, Tensor) else key
    zero = torch.zeros_like(step)
    x0, x1, _, _ = philox4x32(key, step & MASK32, (step >> 32) & MASK32, zero + DERIVE_DOMAIN, zero)
    return x0 | ((x1 & (2 ** (SEED_BITS - 32) - 1)) << 32)


def _finish(out32: Tensor, stats: Tensor, grad: Tensor) -> tuple[Tensor, Tensor]:
    """Fail closed: any non-finite input element turns the whole output and stats to NaN."""
    finite = torch.isfinite(grad).all()
    nan = torch.tensor(float("nan"), dtype=torch.float32, device=grad.device)
    out32 = torch.where(finite, out32, nan)
    stats = torch.where(finite, stats, nan)
    return out32.to(grad.dtype), stats


def flood_rows(grad: Tensor, rho: float, lam: float, rel_threshold: float, z: Tensor) -> tuple[Tensor, Tensor]:
    """Rows flood of a V x d gradient with explicit noise ``z``; stats = [m_bar, sigma, |S|, M]."""
    g = grad.float()
    norms = torch.linalg.vector_norm(g, dim=1)  # (E1) n_v = ||G[v,:]||
    peak = norms.amax() if norms.numel() else norms.new_zeros(())  # M
    active = norms > rel_threshold * peak  # (E2) S = {v : n_v > tau M}
    count = active.sum().to(torch.float32)
    m_bar = (norms * active).sum() / count.clamp(min=1.0)  # (E3) mean over S (0 if S empty)
    sigma = lam * m_bar
    out = torch.where(active[:, None], rho * g, 0.0) + sigma * z  # (E4)
    return _finish(out, torch.stack((m_bar, sigma, count, peak)), grad)


def flood_matrix(grad: Tensor, rho: float, lam: float, z: Tensor) -> tuple[Tensor, Tensor]:
    """Matrix flood of any gradient with explicit noise ``z``; stats = [m_bar, sigma]."""
    g = grad.float()
    m_bar = g.abs().mean() if g.numel() else g.new_zeros(())  # (E3) mean |G|
    sigma = lam * m_bar
    out = rho * g + sigma * z  # (E5)
    return _finish(out, torch.stack((m_bar, sigma)), grad)


def flood(
    grad: Tensor,
    mode: str,
    rho: float,
    lam: float,
    rel_threshold: float,
    seed: int | Tensor | None = None,
    offset: int = 0,
    z: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Either an explicit noise tensor ``z`` or the (seed, offset) stream."""
    check_params(grad, mode, rho, lam, rel_threshold)
    if z is None:
        if seed is None:
            raise ValueError("flood: pass either z (explicit noise) or seed (and offset)")
        z = noise(tuple(grad.shape), seed, offset, device=grad.device)
    elif z.shape != grad.shape:
        raise ValueError(f"z has shape {tuple(z.shape)} but grad has {tuple(grad.shape)}")
    z = z.to(device=grad.device, dtype=torch.float32)
    if mode == "rows":
        return flood_rows(grad, rho, lam, rel_threshold, z)
    return flood_matrix(grad, rho, lam, z)


MODES = ("rows", "matrix")


def check_params(grad: Tensor, mode: str, rho: float, lam: float, rel_threshold: float) -> None:
    """Reject inputs that would silently weaken the flood."""
    if grad.layout != torch.strided:
        raise ValueError(
            f"grad has layout {grad.layout}: AEGIS floods dense gradients only; densify it with "
            "grad.to_dense() or build the embedding with sparse=False"
        )
    if not grad.is_floating_point():
        raise TypeError(f"grad has dtype {grad.dtype}: floods need a floating-point gradient")
    if mode not in MODES:
        raise ValueError(f"mode={mode!r}: must be one of {MODES}")
    if mode == "rows" and grad.dim() != 2:
        raise ValueError(f"mode='rows' needs a 2-D (rows x dim) gradient, got shape {tuple(grad.shape)}; use mode='matrix'")
    for name, value in (("rho", rho), ("lam", lam)):
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"{name}={value}: must be a finite number >= 0")
    if not 0.0 <= rel_threshold < 1.0:
        raise ValueError(f"rel_threshold={rel_threshold}: must lie in [0, 1)")


def split_modes(modes: str) -> list[str]:
    """Parse the comma-separated per-tensor modes of flood_ ("" means no tensors)."""
    return [m.strip() for m in modes.split(",")] if modes else []


def stream_offsets(numels: list[int]) -> list[int]:
    """Disjoint, 8-aligned offsets (counter boundaries) for tensors flooded under one seed (flood_ uses these)."""
    offsets, cursor = [], 0
    for n in numels:
        offsets.append(cursor)
        cursor += (n + LANES - 1) // LANES * LANES
    return offsets


def flood_many_(
    grads: list[Tensor], modes: list[str], rhos: list[float], lams: list[float], rel_threshold: float, seed: int | Tensor
) -> None:
    """In-place flood of many tensors under one seed, tensor k at stream_offsets(...)[k]."""
    if not (len(grads) == len(modes) == len(rhos) == len(lams)):
        raise ValueError("flood_: grads, modes, rhos and lams must have the same length")
    offsets = stream_offsets([g.numel() for g in grads])
    for g, mode, rho, lam, offset in zip(grads, modes, rhos, lams, offsets):
        out, _ = flood(g, mode, rho, lam, rel_threshold, seed, offset)
        g.copy_(out)
