"""Fused Triton kernels for the AEGIS floods (docs/design.md §1-2) and their CUDA registration.

Raw ``@triton.jit`` kernels plus thin launchers (Liger-Kernel style), judged against
``aegis_kernels.reference``: the same ChaCha keystream words bit for bit, the same normals up to
the last ulp of log / sqrt, the same flood formulas.

Each tensor's public parameters (rho, sigma, clip, thr) live in a device table and the key in a
device buffer, so a captured CUDA graph replays with new keys and new calibrations.

Rows flood of a V x d gradient, three launches, no host sync:
  1. ``_rows_norms_kernel``   row norms (fp32) + per-block max and non-finite flag (reads G once);
  2. ``_rows_stats_kernel``   |S|, clipped rows, M and the non-finite flag -> stats (sigma or NaN);
  3. ``_rows_flood_kernel``   out = rho min(1, clip/n_v) G (rows of S only: masked loads) + sigma Z.
Matrix flood (any shape, and the grouped in-place ``flood_``):
  ``_matrix_pipe_kernel``  pass 1 (per-tile sum x^2 + non-finite flag) of one set of tiles
                           interleaved with pass 2 (out = s G + sigma Z; G is not read when the
                           signal scale s is 0) of another, so memory-bound reads overlap the noise;
  ``_matrix_stats_kernel`` per tensor ||G||_F and s = rho min(1, clip / ||G||_F), fixed order.

Grouped launches read tensor addresses from a device table, which the Triton interpreter cannot
do; every kernel also has a per-tensor form (GROUPED=False, pointer as an argument) that it can.
The launchers accept CUDA tensors, and CPU tensors through the Triton interpreter (a second copy
of this module compiled with TRITON_INTERPRET=1), so callers need no environment set.
"""
from __future__ import annotations

import collections
import importlib.util
import os
import sys
import threading

import torch
import triton
import triton.language as tl
from torch import Tensor

from . import reference as ref

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"

if not INTERPRETED:
    from triton.language.extra.cuda import libdevice as _libdevice
else:  # the interpreter maps no CUDA libdevice calls
    _libdevice = None

C0 = tl.constexpr(ref.SIGMA_CONSTANTS[0])
C1 = tl.constexpr(ref.SIGMA_CONSTANTS[1])
C2 = tl.constexpr(ref.SIGMA_CONSTANTS[2])
C3 = tl.constexpr(ref.SIGMA_CONSTANTS[3])
ROUNDS = tl.constexpr(ref.ROUNDS)
BLOCK_WORDS = tl.constexpr(ref.BLOCK_WORDS)
ANGLE_STEP = tl.constexpr(ref.ANGLE_STEP)
RADIUS_SERIES = tl.constexpr(ref.RADIUS_SERIES)
INV_SQRT2 = tl.constexpr(ref.INV_SQRT2)
LN2 = tl.constexpr(0.6931471805599453)
FLT_MAX = tl.constexpr(3.4028234663852886e38)
DERIVE_DOMAIN = tl.constexpr(ref.DERIVE_DOMAIN)

# On the GPU, log / sin / cos are the hardware approximations (MUFU lg2, sin, cos: absolute error
# ~2^-21): the same words and formulas as the reference, each normal within ~1e-6 of it. Any
# fp32-level structure they add to a pair is far below bf16's rounding, and the sum of two pairs
# (fp16 / fp32 outputs) convolves it away (docs/design.md §1.2).
FAST_MATH = not INTERPRETED


# ----------------------------------------------------------------------------- keystream
@triton.jit
def _rotl(x, n: tl.constexpr):
    return (x << n) | (x >> (32 - n))


@triton.jit
def _quarter(a, b, c, d):
    a = a + b
    d = _rotl(d ^ a, 16)
    c = c + d
    b = _rotl(b ^ c, 12)
    a = a + b
    d = _rotl(d ^ a, 8)
    c = c + d
    b = _rotl(b ^ c, 7)
    return a, b, c, d


@triton.jit
def _chacha(k0, k1, k2, k3, k4, k5, k6, k7, lo, hi, domain):
    """ChaCha block (reference.chacha_block) for block counters (lo, hi) under key k0..k7.

    Scalar inputs stay scalars until mixed with ``lo``: in the first column round three of the
    four quarter-rounds are per-program scalars, computed once per tile."""
    x0 = lo * 0 + C0
    x1, x2, x3 = C1, C2, C3
    x4, x5, x6, x7, x8, x9, x10, x11 = k0, k1, k2, k3, k4, k5, k6, k7
    x12, x13, x14, x15 = lo, hi, domain, domain * 0
    x0, x4, x8, x12 = _quarter(x0, x4, x8, x12)
    x1, x5, x9, x13 = _quarter(x1 + hi * 0, x5, x9, x13)
    x2, x6, x10, x14 = _quarter(x2 + hi * 0, x6, x10, x14)
    x3, x7, x11, x15 = _quarter(x3 + hi * 0, x7, x11, x15)
    x0, x5, x10, x15 = _quarter(x0, x5, x10, x15)
    x1, x6, x11, x12 = _quarter(x1, x6, x11, x12)
    x2, x7, x8, x13 = _quarter(x2, x7, x8, x13)
    x3, x4, x9, x14 = _quarter(x3, x4, x9, x14)
    for _ in tl.static_range(ROUNDS // 2 - 1):
        x0, x4, x8, x12 = _quarter(x0, x4, x8, x12)
        x1, x5, x9, x13 = _quarter(x1, x5, x9, x13)
        x2, x6, x10, x14 = _quarter(x2, x6, x10, x14)
        x3, x7, x11, x15 = _quarter(x3, x7, x11, x15)
        x0, x5, x10, x15 = _quarter(x0, x5, x10, x15)
        x1, x6, x11, x12 = _quarter(x1, x6, x11, x12)
        x2, x7, x8, x13 = _quarter(x2, x7, x8, x13)
        x3, x4, x9, x14 = _quarter(x3, x4, x9, x14)
    return (x0 + C0, x1 + C1, x2 + C2, x3 + C3, x4 + k0, x5 + k1, x6 + k2, x7 + k3,
            x8 + k4, x9 + k5, x10 + k6, x11 + k7, x12 + lo, x13 + hi, x14 + domain, x15)


@triton.jit
def _load_key(key_ptr):
    """The 8 key words (int64 holding uint32) as uint32 scalars."""
    return (tl.load(key_ptr).to(tl.uint32), tl.load(key_ptr + 1).to(tl.uint32), tl.load(key_ptr + 2).to(tl.uint32),
            tl.load(key_ptr + 3).to(tl.uint32), tl.load(key_ptr + 4).to(tl.uint32), tl.load(key_ptr + 5).to(tl.uint32),
            tl.load(key_ptr + 6).to(tl.uint32), tl.load(key_ptr + 7).to(tl.uint32))


# ----------------------------------------------------------------------------- normals
@triton.jit
def _log(x, FAST: tl.constexpr):
    if FAST:
        return _libdevice.fast_log2f(x) * LN2
    else:
        return tl.log(x)


@triton.jit
def _normal_pair(a, b, FAST: tl.constexpr):
    """reference.normal_pair: radius word a, angle word b -> (r cos theta, r sin theta)."""
    v = (a & 0x7FFFFFFF).to(tl.float32) * 2.3283064365386963e-10 + 1.1641532182693481e-10
    tail = (a >> 31) != 0
    t = -_log(tl.where(tail, v, 1.0 - v), FAST)
    t = tl.where(tail | (v >= RADIUS_SERIES), t, v * (1.0 + v * 0.5))
    r = tl.sqrt(2.0 * tl.abs(t))  # |t|: an approximate log of a value just below 1 may round above 0
    theta = b.to(tl.int32, bitcast=True).to(tl.float32) * ANGLE_STEP + ANGLE_STEP / 2
    if FAST:
        return r * _libdevice.fast_cosf(theta), r * _libdevice.fast_sinf(theta)
    else:
        return r * tl.cos(theta), r * tl.sin(theta)


@triton.jit
def _j4(a, b, c, d):
    """Four [...] tensors -> [..., 4] in order a, b, c, d (a join's outer index is the fastest)."""
    return tl.join(tl.join(a, c), tl.join(b, d))


@triton.jit
def _j8(z0, z1, z2, z3, z4, z5, z6, z7):
    t = tl.join(_j4(z0, z2, z4, z6), _j4(z1, z3, z5, z7))
    return tl.reshape(t, t.shape[:-3] + [8])


@triton.jit
def _lanes_of_block(x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15,
                    PER: tl.constexpr, FAST: tl.constexpr):
    """The normals of a block's 16 words, element order: PER 1 -> (z, z) [..., 16]; PER 2 -> the two
    summands (z_a, z_b) [..., 8] of each element (reference._element_normals)."""
    a0, a1 = _normal_pair(x0, x1, FAST)
    b0, b1 = _normal_pair(x2, x3, FAST)
    c0, c1 = _normal_pair(x4, x5, FAST)
    d0, d1 = _normal_pair(x6, x7, FAST)
    e0, e1 = _normal_pair(x8, x9, FAST)
    f0, f1 = _normal_pair(x10, x11, FAST)
    g0, g1 = _normal_pair(x12, x13, FAST)
    h0, h1 = _normal_pair(x14, x15, FAST)
    if PER == 1:
        t = tl.join(_j8(a0, b0, c0, d0, e0, f0, g0, h0), _j8(a1, b1, c1, d1, e1, f1, g1, h1))
        z = tl.reshape(t, t.shape[:-2] + [16])  # [..., 8, 2]: element 2i + j at [i, j]
        return z, z
    else:
        return _j8(a0, a1, c0, c1, e0, e1, g0, g1), _j8(b0, b1, d0, d1, f0, f1, h0, h1)


# The interpreter has no fused multiply-add; its copy emulates one through fp64 (exact product), as
# reference.fma does, so CPU tests see the GPU's single rounding.
SOFT_FMA = tl.constexpr(INTERPRETED)


@triton.jit
def _fma(x, y, z):
    if SOFT_FMA:
        return (x.to(tl.float64) * y.to(tl.float64) + z.to(tl.float64)).to(tl.float32)
    else:
        return tl.fma(x, y, z)


@triton.jit
def _noise_only(sigma, za, zb, PER: tl.constexpr):
    """_add_noise with a zero signal, bit for bit (fma(x, y, +0) rounds as x * y)."""
    if PER == 1:
        return sigma * za
    else:
        w = sigma * INV_SQRT2
        return _fma(w, za, w * zb)


@triton.jit
def _add_noise(signal, sigma, za, zb, PER: tl.constexpr):
    """signal + sigma Z as fused multiply-adds (reference.add_noise): a product sigma Z rounded on
    its own takes only the values of a multiple of sigma, which signal-carrying elements leave."""
    if PER == 1:
        return _fma(sigma, za, signal)
    else:
        w = sigma * INV_SQRT2
        return _fma(w, za, _fma(w, zb, signal))


@triton.jit
def _block_normals(k0, k1, k2, k3, k4, k5, k6, k7, blocks, PER: tl.constexpr, FAST: tl.constexpr):
    """The normals (z_a, z_b) of int64 block counters of any shape: [..., 16 / PER], element order."""
    bu = blocks.to(tl.uint64, bitcast=True)
    x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15 = _chacha(
        k0, k1, k2, k3, k4, k5, k6, k7, bu.to(tl.uint32), (bu >> 32).to(tl.uint32), tl.full([], 0, tl.uint32))
    return _lanes_of_block(x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15, PER, FAST)


@triton.jit
def _noise_tile(k0, k1, k2, k3, k4, k5, k6, k7, b_start, Q: tl.constexpr, PER: tl.constexpr, FAST: tl.constexpr):
    """The normals (z_a, z_b) as [Q, 16 / PER] of the Q consecutive blocks from b_start (int64 scalar).

    When no low counter word of the tile wraps, the high word is the tile's scalar, and so is most of
    ChaCha's first round. Same words either way."""
    bu = b_start.to(tl.uint64, bitcast=True)
    lo0 = bu.to(tl.uint32)
    if lo0 <= 0xFFFFFFFF - (Q - 1):
        lo = lo0 + tl.arange(0, Q).to(tl.uint32)
        x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15 = _chacha(
            k0, k1, k2, k3, k4, k5, k6, k7, lo, (bu >> 32).to(tl.uint32), tl.full([], 0, tl.uint32))
        za, zb = _lanes_of_block(x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15, PER, FAST)
    else:
        za, zb = _block_normals(k0, k1, k2, k3, k4, k5, k6, k7, b_start + tl.arange(0, Q), PER, FAST)
    return za, zb


@triton.jit
def _lanes(Q: tl.constexpr, L: tl.constexpr):
    """[Q, L] element offsets L q + l of a flat block-aligned tile."""
    return L * tl.arange(0, Q)[:, None] + tl.arange(0, L)[None, :]


# The interpreter converts fp32 -> bf16 by truncation; the GPU (and torch) round to nearest even.
# The interpreted copy rounds by hand so CPU tests see the GPU's bits.
SOFT_BF16 = tl.constexpr(INTERPRETED)


@triton.jit
def _to_out(x, out_ptr):
    """fp32 -> the output dtype, rounding to nearest even."""
    if SOFT_BF16 and out_ptr.dtype.element_ty == tl.bfloat16:
        b = x.to(tl.uint32, bitcast=True)
        r = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
        r = tl.where(x != x, 0x7FC0, r)  # keep NaN a NaN
        return r.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(out_ptr.dtype.element_ty)


# ----------------------------------------------------------------------------- noise / keys
@triton.jit(do_not_specialize=["bbase"])
def _noise_kernel(out_ptr, out_b_ptr, n, key_ptr, bbase, Q: tl.constexpr, PER: tl.constexpr, FAST: tl.constexpr,
                  PARTS: tl.constexpr):
    """Z (PARTS False), or the summands z_a, z_b of each element (PARTS, PER 2) into out, out_b."""
    L: tl.constexpr = 16 // PER
    start = tl.program_id(0).to(tl.int64) * (Q * L)
    k0, k1, k2, k3, k4, k5, k6, k7 = _load_key(key_ptr)
    za, zb = _noise_tile(k0, k1, k2, k3, k4, k5, k6, k7, bbase + start // L, Q, PER, FAST)
    offs = _lanes(Q, L)
    m = offs < n - start
    if PARTS:
        tl.store(out_ptr + start + offs, za, mask=m)
        tl.store(out_b_ptr + start + offs, zb, mask=m)
    else:
        tl.store(out_ptr + start + offs, _noise_only(1.0, za, zb, PER), mask=m)


@triton.jit(do_not_specialize=["domain"])
def _keystream_kernel(blocks_ptr, out_ptr, n, key_ptr, domain, BLOCK: tl.constexpr):
    """Raw ChaCha words of n int64 block counters: out[i, w] (int64 holding uint32), for exactness tests."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    k0, k1, k2, k3, k4, k5, k6, k7 = _load_key(key_ptr)
    bu = tl.load(blocks_ptr + offs, mask=m, other=0).to(tl.uint64, bitcast=True)
    x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15 = _chacha(
        k0, k1, k2, k3, k4, k5, k6, k7, bu.to(tl.uint32), (bu >> 32).to(tl.uint32), domain.to(tl.uint32))
    w = tl.join(_j8(x0, x2, x4, x6, x8, x10, x12, x14), _j8(x1, x3, x5, x7, x9, x11, x13, x15))
    w = tl.reshape(w, [BLOCK, 16])
    tl.store(out_ptr + 16 * offs[:, None] + tl.arange(0, 16)[None, :], w.to(tl.int64), mask=m[:, None])


@triton.jit
def _derive_key_kernel(state_ptr, key_out_ptr):
    """key = reference.derive_key(master, step) for state = [master words x 8, step]; then step += 1."""
    k0, k1, k2, k3, k4, k5, k6, k7 = _load_key(state_ptr)
    step = tl.load(state_ptr + 8)
    su = step.to(tl.uint64, bitcast=True)
    lo = su.to(tl.uint32) + tl.zeros([2], tl.uint32)
    x0, x1, x2, x3, x4, x5, x6, x7, _, _, _, _, _, _, _, _ = _chacha(
        k0, k1, k2, k3, k4, k5, k6, k7, lo, (su >> 32).to(tl.uint32), tl.full([], DERIVE_DOMAIN, tl.uint32))
    w = _j8(x0, x1, x2, x3, x4, x5, x6, x7)  # [2, 8], both rows equal
    offs = tl.arange(0, 2)[:, None] * 0 + tl.arange(0, 8)[None, :]
    tl.store(key_out_ptr + offs, w.to(tl.int64), mask=tl.arange(0, 2)[:, None] == 0)
    tl.store(state_ptr + 8, step + 1)


# ----------------------------------------------------------------------------- rows mode
@triton.jit
def _rows_norms_kernel(g_ptr, norms_ptr, part_ptr, count_ptr, V, D, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """Pass 1: n_v = ||G[v]|| (fp32), and per block [max n_v, any non-finite]. Program 0 also
    zeroes the stats pass's completion counter (stream order: before that pass starts)."""
    pid = tl.program_id(0)
    if pid == 0:
        tl.store(count_ptr, 0)
    row0 = pid.to(tl.int64) * BLOCK_R
    rows = tl.arange(0, BLOCK_R)
    rmask = rows < V - row0
    gp = g_ptr + row0 * D
    acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
    bad = tl.zeros([BLOCK_R], tl.float32)
    for d0 in range(0, D, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)
        m = rmask[:, None] & (cols < D)[None, :]
        x = tl.load(gp + rows[:, None] * D + cols[None, :], mask=m, other=0.0).to(tl.float32)
        acc += x * x
        # |x| <= FLT_MAX is false exactly for inf and NaN (reduced per block: no register tile)
        bad = tl.maximum(bad, tl.max(tl.where(tl.abs(x) <= FLT_MAX, 0.0, 1.0), axis=1))
    norms = tl.sqrt_rn(tl.sum(acc, axis=1))
    tl.store(norms_ptr + row0 + rows, norms, mask=rmask)
    tl.store(part_ptr + 2 * pid, tl.max(tl.where(rmask, norms, 0.0), axis=0))
    tl.store(part_ptr + 2 * pid + 1, tl.max(bad, axis=0))


@triton.jit
def _rows_stats_kernel(
    norms_ptr, part_ptr, part2_ptr, count_ptr, stats_ptr, params_ptr, V, P, CHUNK: tl.constexpr, BLOCK: tl.constexpr,
    FIN: tl.constexpr,
):
    """Program j: the active and clipped counts of norms [j CHUNK, (j+1) CHUNK). The last program to
    finish (completion counter) reduces them in a fixed order into [sigma, |S|, clipped, M]; every
    entry NaN iff the input had a non-finite element (the flood then writes NaN everywhere)."""
    j = tl.program_id(0)
    clip = tl.load(params_ptr + 2)
    thr = tl.load(params_ptr + 3)
    v = j * CHUNK + tl.arange(0, CHUNK)
    n = tl.load(norms_ptr + v, mask=v < V, other=0.0)
    act = n > thr
    tl.store(part2_ptr + 2 * j, tl.sum(act.to(tl.int32), axis=0).to(tl.float32))
    tl.store(part2_ptr + 2 * j + 1, tl.sum((act & (n > clip)).to(tl.int32), axis=0).to(tl.float32))
    # Release this program's partials (every thread's stores, then one gpu-scope acq_rel atomic).
    tl.debug_barrier()
    P2 = tl.num_programs(0)
    if tl.atomic_add(count_ptr, 1, sem="acq_rel") == P2 - 1:
        offs = tl.arange(0, BLOCK)
        mx = tl.zeros([BLOCK], tl.float32)
        bad = tl.zeros([BLOCK], tl.float32)
        for p0 in range(0, P, BLOCK):
            pm = offs < P - p0
            mx = tl.maximum(mx, tl.load(part_ptr + 2 * (p0 + offs), mask=pm, other=0.0))
            bad = tl.maximum(bad, tl.load(part_ptr + 2 * (p0 + offs) + 1, mask=pm, other=0.0))
        f = tl.arange(0, FIN)
        fm = f < P2
        count = tl.sum(tl.load(part2_ptr + 2 * f, mask=fm, other=0.0, cache_modifier=".cg"), axis=0)
        clipped = tl.sum(tl.load(part2_ptr + 2 * f + 1, mask=fm, other=0.0, cache_modifier=".cg"), axis=0)
        nan = tl.max(bad, axis=0) > 0.0
        tl.store(stats_ptr + 0, tl.where(nan, float("nan"), tl.load(params_ptr + 1)))
        tl.store(stats_ptr + 1, tl.where(nan, float("nan"), count))
        tl.store(stats_ptr + 2, tl.where(nan, float("nan"), clipped))
        tl.store(stats_ptr + 3, tl.where(nan, float("nan"), tl.max(mx, axis=0)))


@triton.jit
def _row_scale(n, rho, clip, thr):
    """rho min(1, clip / n_v) on S, 0 elsewhere (reference._clip_scale)."""
    return tl.where(n > thr, rho * tl.where(n > clip, clip / tl.maximum(n, 1.1754943508222875e-38), 1.0), 0.0)


@triton.jit(do_not_specialize=["bbase"])
def _rows_flood_kernel(
    g_ptr, out_ptr, norms_ptr, stats_ptr, params_ptr, key_ptr, bbase, V, D,
    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, PER: tl.constexpr, FAST: tl.constexpr,
):
    """Pass 2 of short rows, D % (16 / PER) == 0 (every row opens a block): [BLOCK_R, BLOCK_D] tiles
    (long rows take _rows_onepass_kernel)."""
    L: tl.constexpr = 16 // PER
    # Reverse block order: pass 1 finished with the last rows, so their re-reads may hit L2.
    pid = tl.num_programs(0) - 1 - tl.program_id(0)
    sigma = tl.load(stats_ptr)
    rho = tl.load(params_ptr)
    clip = tl.load(params_ptr + 2)
    thr = tl.load(params_ptr + 3)
    k0, k1, k2, k3, k4, k5, k6, k7 = _load_key(key_ptr)
    row0 = pid.to(tl.int64) * BLOCK_R
    base = row0 * D
    gp = g_ptr + base
    op = out_ptr + base
    lanes = _lanes(BLOCK_D // L, L)  # [BLOCK_D / L, L] column offsets
    rows = tl.arange(0, BLOCK_R)
    rmask = rows < V - row0
    n = tl.load(norms_ptr + row0 + rows, mask=rmask, other=0.0)
    s = _row_scale(n, rho, clip, thr)
    read_row = rmask & (s != 0.0)
    b_row = bbase + base // L + rows * (D // L)
    for d0 in range(0, D, BLOCK_D):
        cols = d0 + lanes
        m = rmask[:, None, None] & (cols < D)[None, :, :]
        offs = rows[:, None, None] * D + cols[None, :, :]
        g = tl.load(gp + offs, mask=m & read_row[:, None, None], other=0.0).to(tl.float32)
        b = b_row[:, None] + (tl.arange(0, BLOCK_D // L) + d0 // L)[None, :]
        za, zb = _block_normals(k0, k1, k2, k3, k4, k5, k6, k7, b, PER, FAST)
        tl.store(op + offs, _to_out(_add_noise(s[:, None, None] * g, sigma, za, zb, PER), out_ptr), mask=m)


@triton.jit(do_not_specialize=["bbase"])
def _rows_onepass_kernel(
    g_ptr, out_ptr, part_ptr, params_ptr, key_ptr, bbase, D,
    BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr, PER: tl.constexpr, FAST: tl.constexpr,
):
    """One row per program, one pass over memory (D % (16 / PER) == 0, long rows): the row's norm,
    then out = rho min(1, clip/n) G[v] [n > thr] + sigma Z[v] (the public parameters need no other
    row); the re-read of a row in S hits the lines this program just loaded. part[v] = [active,
    clipped, n_v, non-finite] (no atomics: tens of thousands on four addresses serialise);
    _rows_reduce_kernel turns them into stats and _rows_poison_kernel, on a non-finite input, the
    whole output into NaN."""
    L: tl.constexpr = 16 // PER
    row = tl.program_id(0).to(tl.int64)
    base = row * D
    gp = g_ptr + base
    op = out_ptr + base
    lanes = _lanes(BLOCK_D // L, L)
    sq = tl.zeros([BLOCK_D // L, L], tl.float32)
    bad = tl.zeros([BLOCK_D // L, L], tl.float32)
    for d0 in range(0, D, BLOCK_D):
        offs = d0 + lanes
        if EVEN_D:
            x = tl.load(gp + offs).to(tl.float32)
        else:
            x = tl.load(gp + offs, mask=offs < D, other=0.0).to(tl.float32)
        sq += x * x
        bad = tl.maximum(bad, tl.where(tl.abs(x) <= FLT_MAX, 0.0, 1.0))
    n = tl.sqrt_rn(tl.sum(tl.sum(sq, axis=1), axis=0))
    rho = tl.load(params_ptr)
    sigma = tl.load(params_ptr + 1)
    clip = tl.load(params_ptr + 2)
    thr = tl.load(params_ptr + 3)
    s = _row_scale(n, rho, clip, thr)
    read = s != 0.0
    k0, k1, k2, k3, k4, k5, k6, k7 = _load_key(key_ptr)
    b_row = bbase + base // L
    tl.debug_barrier()  # in place (out is g): every thread's reads of the row before any write
    for d0 in range(0, D, BLOCK_D):
        offs = d0 + lanes
        za, zb = _noise_tile(k0, k1, k2, k3, k4, k5, k6, k7, b_row + d0 // L, BLOCK_D // L, PER, FAST)
        if EVEN_D:
            if read:
                out = _add_noise(s * tl.load(gp + offs).to(tl.float32), sigma, za, zb, PER)
            else:
                out = _noise_only(sigma, za, zb, PER)
            tl.store(op + offs, _to_out(out, out_ptr))
        else:
            m = offs < D
            g = tl.load(gp + offs, mask=m & ((offs * 0 + read.to(tl.int32)) != 0), other=0.0).to(tl.float32)
            tl.store(op + offs, _to_out(_add_noise(s * g, sigma, za, zb, PER), out_ptr), mask=m)
    active = (n > thr).to(tl.float32)
    tl.store(part_ptr + 4 * row, active)
    tl.store(part_ptr + 4 * row + 1, active * (n > clip).to(tl.float32))
    tl.store(part_ptr + 4 * row + 2, n)
    tl.store(part_ptr + 4 * row + 3, tl.max(tl.max(bad, axis=1), axis=0))


@triton.jit
def _rows_reduce_kernel(part_ptr, stats_ptr, params_ptr, V, BLOCK: tl.constexpr):
    """stats = [sigma, |S|, clipped, M] from the per-row parts (fixed order); all NaN and stats[4]
    = 1 when the input had a non-finite element."""
    offs = tl.arange(0, BLOCK)
    active = tl.zeros([BLOCK], tl.float32)
    clipped = tl.zeros([BLOCK], tl.float32)
    peak = tl.zeros([BLOCK], tl.float32)
    bad = tl.zeros([BLOCK], tl.float32)
    for v0 in range(0, V, BLOCK):
        m = offs < V - v0
        p = part_ptr + 4 * (v0 + offs)
        active += tl.load(p, mask=m, other=0.0)
        clipped += tl.load(p + 1, mask=m, other=0.0)
        peak = tl.maximum(peak, tl.load(p + 2, mask=m, other=0.0))
        bad = tl.maximum(bad, tl.load(p + 3, mask=m, other=0.0))
    nan = tl.max(bad, axis=0) > 0.0
    tl.store(stats_ptr, tl.where(nan, float("nan"), tl.load(params_ptr + 1)))
    tl.store(stats_ptr + 1, tl.where(nan, float("nan"), tl.sum(active, axis=0)))
    tl.store(stats_ptr + 2, tl.where(nan, float("nan"), tl.sum(clipped, axis=0)))
    tl.store(stats_ptr + 3, tl.where(nan, float("nan"), tl.max(peak, axis=0)))
    tl.store(stats_ptr + 4, nan.to(tl.float32))


@triton.jit
def _rows_poison_kernel(out_ptr, stats_ptr, N, BLOCK: tl.constexpr):
    """NaN over the whole output when _rows_reduce_kernel flagged a non-finite input (stats[4]):
    a step never goes out half clean. A clean step costs one load per program."""
    pid = tl.program_id(0)
    if tl.load(stats_ptr + 4) > 0.0:
        offs = tl.arange(0, BLOCK)
        fill = tl.full([BLOCK], float("nan"), tl.float32)
        for start in range(pid.to(tl.int64) * BLOCK, N, tl.num_programs(0) * BLOCK):
            tl.store(out_ptr + start + offs, _to_out(fill, out_ptr), mask=offs < N - start)


@triton.jit(do_not_specialize=["bbase"])
def _rows_flood_flat_kernel(
    g_ptr, out_ptr, norms_ptr, stats_ptr, params_ptr, key_ptr, bbase, N, D,
    Q: tl.constexpr, PER: tl.constexpr, FAST: tl.constexpr,
):
    """Pass 2 for any D: flat block-aligned tiles, row = e // D per element."""
    L: tl.constexpr = 16 // PER
    pid = tl.num_programs(0) - 1 - tl.program_id(0)
    sigma = tl.load(stats_ptr)
    start = pid.to(tl.int64) * (Q * L)
    offs = _lanes(Q, L)
    m = offs < N - start
    n = tl.load(norms_ptr + (start + offs) // D, mask=m, other=0.0)
    s = _row_scale(n, tl.load(params_ptr), tl.load(params_ptr + 2), tl.load(params_ptr + 3))
    g = tl.load(g_ptr + start + offs, mask=m & (s != 0.0), other=0.0).to(tl.float32)
    k0, k1, k2, k3, k4, k5, k6, k7 = _load_key(key_ptr)
    za, zb = _noise_tile(k0, k1, k2, k3, k4, k5, k6, k7, bbase + start // L, Q, PER, FAST)
    tl.store(out_ptr + start + offs, _to_out(_add_noise(s * g, sigma, za, zb, PER), out_ptr), mask=m)


# ----------------------------------------------------------------------------- matrix mode
@triton.jit(do_not_specialize=["ntiles", "t_first"])
def _matrix_stats_kernel(
    part_ptr, stats_ptr, ntiles, params_ptr, meta_ptr, T, t_first, BLOCK: tl.constexpr, GROUPED: tl.constexpr,
):
    """One program per tensor: ||G||_F over its tiles in a fixed order; stats [sigma, ||G||_F, s]
    with s = rho min(1, clip / ||G||_F); all NaN on a non-finite input."""
    t = t_first + tl.program_id(0)
    if GROUPED:  # meta (int64): [ptr x T, numel x T, bbase x T, first tile x (T + 1)]
        first = tl.load(meta_ptr + 3 * T + t)
        last = tl.load(meta_ptr + 3 * T + t + 1)
    else:
        first = 0
        last = ntiles
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], tl.float32)
    bad = tl.zeros([BLOCK], tl.float32)
    for p0 in range(first, last, BLOCK):
        pm = offs < last - p0
        acc += tl.load(part_ptr + 2 * (p0 + offs), mask=pm, other=0.0)
        bad = tl.maximum(bad, tl.load(part_ptr + 2 * (p0 + offs) + 1, mask=pm, other=0.0))
    norm = tl.sqrt_rn(tl.sum(acc, axis=0))
    rho = tl.load(params_ptr + 4 * t)
    clip = tl.load(params_ptr + 4 * t + 2)
    s = rho * tl.where(norm > clip, clip / tl.maximum(norm, 1.1754943508222875e-38), 1.0)
    nan = tl.max(bad, axis=0) > 0.0
    tl.store(stats_ptr + 3 * t, tl.where(nan, float("nan"), tl.load(params_ptr + 4 * t + 1)))
    tl.store(stats_ptr + 3 * t + 1, tl.where(nan, float("nan"), norm))
    tl.store(stats_ptr + 3 * t + 2, tl.where(nan, float("nan"), s))


@triton.jit
def _matrix_sum_tile(x_ptr, numel, local, part_ptr, slot, BLOCK: tl.constexpr, ITERS: tl.constexpr,
                     UNROLL: tl.constexpr):
    """Pass 1 on one tile: part[slot] = [sum x^2 (fp32), any non-finite]."""
    start = local.to(tl.int64) * (BLOCK * ITERS)
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], tl.float32)
    bad = tl.zeros([BLOCK], tl.float32)
    for i in range(0, ITERS, UNROLL):
        for u in tl.static_range(UNROLL):  # UNROLL independent loads in flight, few registers
            e = (i + u) * BLOCK
            x = tl.load(x_ptr + start + e + offs, mask=offs < numel - start - e, other=0.0).to(tl.float32)
            acc += x * x
            bad = tl.maximum(bad, tl.where(tl.abs(x) <= FLT_MAX, 0.0, 1.0))
    tl.store(part_ptr + 2 * slot, tl.sum(acc, axis=0))
    tl.store(part_ptr + 2 * slot + 1, tl.max(bad, axis=0))


@triton.jit
def _matrix_flood_tile(g_ptr, out_ptr, numel, local, s, sigma, bbase, k0, k1, k2, k3, k4, k5, k6, k7,
                       BLOCK: tl.constexpr, ITERS: tl.constexpr, PER: tl.constexpr, FAST: tl.constexpr):
    """Pass 2 on one tile: out = s G + sigma Z; G is not read at all when s == 0."""
    L: tl.constexpr = 16 // PER
    start = local.to(tl.int64) * (BLOCK * ITERS)
    offs = _lanes(BLOCK // L, L)
    read = s != 0.0
    n_iter = tl.minimum(tl.cdiv(numel - start, BLOCK), ITERS)
    for i in range(0, n_iter):
        e0 = start + i * BLOCK
        za, zb = _noise_tile(k0, k1, k2, k3, k4, k5, k6, k7, bbase + e0 // L, BLOCK // L, PER, FAST)
        if e0 + BLOCK <= numel:  # full block: no element mask
            if read:
                out = _add_noise(s * tl.load(g_ptr + e0 + offs).to(tl.float32), sigma, za, zb, PER)
            else:
                out = _noise_only(sigma, za, zb, PER)
            tl.store(out_ptr + e0 + offs, _to_out(out, out_ptr))
        else:
            m = offs < numel - e0
            g = tl.load(g_ptr + e0 + offs, mask=m & ((offs * 0 + read.to(tl.int32)) != 0), other=0.0).to(tl.float32)
            tl.store(out_ptr + e0 + offs, _to_out(_add_noise(s * g, sigma, za, zb, PER), out_ptr), mask=m)


@triton.jit(do_not_specialize=["a_bbase", "a_first", "b_first", "a_tiles", "b_tiles", "a_numel", "b_numel"])
def _matrix_pipe_kernel(
    a_ptr, a_out_ptr, a_numel, a_bbase, a_tiles, a_first, b_ptr, b_numel, b_tiles, b_first,
    part_ptr, stats_ptr, key_ptr, tile_tensor_ptr, meta_ptr, T,
    SUM_BLOCK: tl.constexpr, SUM_ITERS: tl.constexpr, SUM_UNROLL: tl.constexpr, FLOOD_BLOCK: tl.constexpr,
    FLOOD_ITERS: tl.constexpr, GROUPED: tl.constexpr, VEC: tl.constexpr, PER: tl.constexpr, FAST: tl.constexpr,
):
    """Pass 2 (flood) of tile set A together with pass 1 (sum x^2) of tile set B, interleaved.

    Pass 1 is bound by memory and pass 2 by arithmetic (the cipher and Box-Muller). Alternating
    their tiles in one grid puts both kinds of program on every SM, so the next chunk's reads
    overlap this chunk's noise. A or B may be empty (first and last stage).
    GROUPED: A and B are tile ranges [first, first + tiles) of the address table (in-place flood);
    else single tensors (a_out_ptr may differ from a_ptr; stats_ptr is that tensor's stats).
    """
    pid = tl.program_id(0)
    both = tl.minimum(a_tiles, b_tiles)
    if pid < 2 * both:
        is_a = pid % 2 == 0
        j = pid // 2
    else:
        is_a = a_tiles > b_tiles
        j = pid - both
    if is_a:
        k0, k1, k2, k3, k4, k5, k6, k7 = _load_key(key_ptr)
        if GROUPED:
            tile = a_first + j
            t = tl.load(tile_tensor_ptr + tile)
            local = tile - tl.load(meta_ptr + 3 * T + t)
            g_ptr = tl.load(meta_ptr + t).to(a_ptr.dtype)
            numel = tl.load(meta_ptr + T + t)
            if VEC:  # host checked: 16-byte aligned, numel % 16 == 0 -> vector accesses
                g_ptr = tl.multiple_of(g_ptr, 16)
                numel = tl.multiple_of(numel, 16)
            _matrix_flood_tile(g_ptr, g_ptr, numel, local, tl.load(stats_ptr + 3 * t + 2), tl.load(stats_ptr + 3 * t),
                               tl.load(meta_ptr + 2 * T + t), k0, k1, k2, k3, k4, k5, k6, k7,
                               FLOOD_BLOCK, FLOOD_ITERS, PER, FAST)
        else:
            _matrix_flood_tile(a_ptr, a_out_ptr, a_numel, j, tl.load(stats_ptr + 2), tl.load(stats_ptr), a_bbase,
                               k0, k1, k2, k3, k4, k5, k6, k7, FLOOD_BLOCK, FLOOD_ITERS, PER, FAST)
    else:
        if GROUPED:
            tile = b_first + j
            t = tl.load(tile_tensor_ptr + tile)
            local = tile - tl.load(meta_ptr + 3 * T + t)
            x_ptr = tl.load(meta_ptr + t).to(b_ptr.dtype)
            numel = tl.load(meta_ptr + T + t)
            if VEC:
                x_ptr = tl.multiple_of(x_ptr, 16)
                numel = tl.multiple_of(numel, 16)
            _matrix_sum_tile(x_ptr, numel, local, part_ptr, tile, SUM_BLOCK, SUM_ITERS, SUM_UNROLL)
        else:
            _matrix_sum_tile(b_ptr, b_numel, j, part_ptr, j, SUM_BLOCK, SUM_ITERS, SUM_UNROLL)


# ============================================================================= host side
# Block sizes. The interpreter pays per operation, not per element: it gets bigger tiles.
_SPAN = 16384  # elements per matrix tile; pass 1 and pass 2 share the tile table
_SUM_BLOCK = 16384 if INTERPRETED else 2048
_SUM_ITERS = _SPAN // _SUM_BLOCK
_SUM_UNROLL = 1 if INTERPRETED else 2
_FLOOD_BLOCK = 8192 if INTERPRETED else 2048
_FLOOD_ITERS = _SPAN // _FLOOD_BLOCK
_STATS_BLOCK = 1024
_NOISE_BLOCK = 16384 if INTERPRETED else 2048  # elements per noise-kernel program
_FLAT_BLOCK = 8192 if INTERPRETED else 2048
_ROWS_TILE1 = 16384 if INTERPRETED else 2048  # elements per [BLOCK_R, BLOCK_D] tile, rows pass 1
_ROWS_WARPS1 = 4
_ROWS_TILE2 = 16384 if INTERPRETED else 2048  # rows pass 2, short rows (several per program)
_ROWS_WARPS = 4
_ROW_SPLIT = 512  # rows pass 2 takes one row per program from this row length on
_ROWS_BD2 = 16384 if INTERPRETED else 1024  # its column block (at most; / words per element squared)
_ROWS_WARPS2 = None  # None: one keystream block per thread (more threads would replicate ChaCha work)
_PIPE_WARPS = 4
_PIPE_CHUNKS = 4  # pipeline stages of a grouped matrix flood (at most; 4 beat 1 and 8 on H100 and H200)
_PIPE_MIN_BYTES = 1 if INTERPRETED else 128 << 20  # bytes of gradient per stage (at least)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _pow2_floor(n: int) -> int:
    return 1 << (max(int(n), 1).bit_length() - 1)


_interp_lock = threading.Lock()
_interp_module = None


def interpreter_module():
    """This module compiled under TRITON_INTERPRET=1: its kernels run on CPU tensors.

    triton.jit reads TRITON_INTERPRET when it decorates, so a second copy of the module,
    executed with the variable set, holds interpreted kernels next to the compiled ones.
    """
    global _interp_module
    if INTERPRETED:
        return sys.modules[__name__]
    with _interp_lock:
        if _interp_module is None:
            name = __name__ + "_interpreted"
            old = os.environ.get("TRITON_INTERPRET")
            os.environ["TRITON_INTERPRET"] = "1"
            try:
                spec = importlib.util.spec_from_file_location(name, __file__)
                mod = importlib.util.module_from_spec(spec)
                sys.modules[name] = mod
                spec.loader.exec_module(mod)
            finally:
                if old is None:
                    del os.environ["TRITON_INTERPRET"]
                else:
                    os.environ["TRITON_INTERPRET"] = old
            _interp_module = mod
    return _interp_module


class _InterpretedLaunch:
    """Runs an interpreted kernel with triton's own @jit helpers (tl.sum, tl.zeros, ...) callable.

    Those were decorated without TRITON_INTERPRET when triton was imported, so inside an
    interpreted kernel they are JITFunctions; for the launch they act as InterpretedFunctions.
    The interpreter's integer-overflow sanitizer (a check per uint32 cipher addition, where
    wrapping is the point) is switched off for the launch: it doubles the run time.
    """

    _lock = threading.RLock()
    _wrapped: dict = {}

    def __init__(self, kernel):
        self.kernel = kernel

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            import dataclasses

            from triton.runtime import interpreter
            from triton.runtime.jit import JITFunction

            wrapped = _InterpretedLaunch._wrapped

            def call(jit_fn, *a, **k):
                fn = wrapped.get(id(jit_fn))  # by id: hashing a JITFunction parses its source
                if fn is None:
                    fn = wrapped[id(jit_fn)] = interpreter.InterpretedFunction(jit_fn.fn)
                return fn(*a, **k)

            builder = interpreter.interpreter_builder
            with _InterpretedLaunch._lock:
                saved_call, saved_options = JITFunction.__call__, builder.options
                JITFunction.__call__ = call
                if "sanitize_overflow" in {f.name for f in dataclasses.fields(saved_options)}:
                    builder.options = dataclasses.replace(saved_options, sanitize_overflow=False)
                try:
                    return self.kernel[grid](*args, **kwargs)
                finally:
                    JITFunction.__call__ = saved_call
                    builder.options = saved_options

        return launch


class _InterpretedKernels:
    """The interpreted module copy, its kernels launched through _InterpretedLaunch."""

    def __init__(self, mod):
        self.mod = mod

    def __getattr__(self, name):
        from triton.runtime.interpreter import InterpretedFunction

        obj = getattr(self.mod, name)
        return _InterpretedLaunch(obj) if isinstance(obj, InterpretedFunction) else obj


_interp_kernels = None


def _kernels(device: torch.device):
    """Kernels (and their block sizes) for tensors on ``device``."""
    global _interp_kernels
    if device.type == "cuda" and not INTERPRETED:
        return sys.modules[__name__]
    if device.type in ("cpu", "cuda"):
        if _interp_kernels is None:
            _interp_kernels = _InterpretedKernels(interpreter_module())
        return _interp_kernels
    raise ValueError(f"aegis Triton kernels run on CUDA (or CPU through the interpreter), not {device}")


class _on:
    """Launch on the tensor's GPU (Triton launches on the current device)."""

    def __init__(self, device: torch.device):
        self.ctx = torch.cuda.device(device) if device.type == "cuda" else None

    def __enter__(self):
        if self.ctx is not None:
            self.ctx.__enter__()

    def __exit__(self, *exc):
        if self.ctx is not None:
            self.ctx.__exit__(*exc)


# ----------------------------------------------------------------------------- configs
def _per(dtype: torch.dtype) -> int:
    return ref.words_per_element(dtype)


def _block_d(D: int, cap: int) -> int:
    """Largest power of two <= cap whose padding wastes at most 1/8 of a row (16 at least)."""
    for b in (4096, 2048, 1024, 512, 256, 128, 64, 32, 16):
        if b <= cap and (_cdiv(D, b) * b - D) * 8 <= D:
            return b
    return 16


def _rows_configs(K, V: int, D: int, per: int):
    """(pass 1 [BLOCK_R, BLOCK_D, warps], pass 2 [BLOCK_R, BLOCK_D, warps]).

    Long rows (>= _ROW_SPLIT, whole keystream blocks): one row per program, one pass, one keystream
    block per thread; on an H100 a warp per 256 fp32 / two per 1024 bf16 elements measured best
    (more threads per row replicate the cipher; more elements per thread cost occupancy).
    Short rows: pass 1 ~16 elements per thread; pass 2 several rows per program."""
    bd1 = _block_d(D, 1024)
    br1 = max(1, min(K._ROWS_TILE1 // bd1, _pow2_floor(V)))
    lanes = ref.BLOCK_WORDS // per
    if D % ref.BLOCK_WORDS == 0 and D >= K._ROW_SPLIT:
        cap = K._ROWS_BD2 // (per * per)
        bd2 = next((b for b in (2048, 1024, 512, 256, 128) if b <= cap and D % b == 0), None)
        bd2 = bd2 or _block_d(D, cap)
        return (br1, bd1, K._ROWS_WARPS1), (1, bd2, K._ROWS_WARPS2 or max(1, bd2 // (32 * lanes)))
    bd2 = _block_d(D, 1024)
    return (br1, bd1, K._ROWS_WARPS1), (max(1, min(K._ROWS_TILE2 // bd2, _pow2_floor(V))), bd2, K._ROWS_WARPS)


# ----------------------------------------------------------------------------- launches
def _rows(K, g: Tensor, out: Tensor, params: Tensor, key: Tensor, bbase: int, stats=None):
    """Rows flood of a contiguous V x D ``g`` into ``out`` (may be ``g``); returns stats."""
    V, D = g.shape
    dev = g.device
    if stats is None:
        stats = torch.empty(4, dtype=torch.float32, device=dev)
    if V == 0 or D == 0:  # nothing to flood: S empty
        stats.copy_(torch.stack((params[1], *params.new_zeros(3))))
        return stats
    per = _per(g.dtype)
    (br1, bd1, w1), (br2, bd2, w2) = _rows_configs(K, V, D, per)
    if br2 == 1 and D % (ref.BLOCK_WORDS // per) == 0:  # long rows: one pass over memory
        part = torch.empty(V, 4, dtype=torch.float32, device=dev)
        flag = torch.empty(5, dtype=torch.float32, device=dev)  # stats + the non-finite flag
        K._rows_onepass_kernel[(V,)](
            g, out, part, params, key, bbase, D, BLOCK_D=bd2, EVEN_D=D % bd2 == 0, PER=per, FAST=K.FAST_MATH,
            num_warps=w2,
        )
        K._rows_reduce_kernel[(1,)](part, flag, params, V, BLOCK=2048, num_warps=8)
        K._rows_poison_kernel[(min(_cdiv(V * D, 4096), 1024),)](out, flag, V * D, BLOCK=4096)
        stats.copy_(flag[:4])
        return stats
    P1 = _cdiv(V, br1)
    chunk = max(1024, 1 << (_cdiv(V, 256) - 1).bit_length())
    P2 = _cdiv(V, chunk)
    norms = torch.empty(V, dtype=torch.float32, device=dev)
    part = torch.empty(2 * P1 + 2 * P2 + 1, dtype=torch.float32, device=dev)  # pass 1, stats partials, counter
    part2, count = part[2 * P1 : 2 * P1 + 2 * P2], part[2 * P1 + 2 * P2 :].view(torch.int32)
    K._rows_norms_kernel[(P1,)](g, norms, part, count, V, D, BLOCK_R=br1, BLOCK_D=bd1, num_warps=w1)
    K._rows_stats_kernel[(P2,)](
        norms, part, part2, count, stats, params, V, P1, CHUNK=chunk, BLOCK=4096,
        FIN=max(2, 1 << (P2 - 1).bit_length()), num_warps=8,
    )
    if D % (ref.BLOCK_WORDS // per) == 0:
        K._rows_flood_kernel[(_cdiv(V, br2),)](
            g, out, norms, stats, params, key, bbase, V, D,
            BLOCK_R=br2, BLOCK_D=bd2, PER=per, FAST=K.FAST_MATH, num_warps=w2,
        )
    else:
        n = V * D
        K._rows_flood_flat_kernel[(_cdiv(n, K._FLAT_BLOCK),)](
            g, out, norms, stats, params, key, bbase, n, D,
            Q=K._FLAT_BLOCK * per // ref.BLOCK_WORDS, PER=per, FAST=K.FAST_MATH, num_warps=4,
        )
    return stats


def _pipe(K, a, b, part, stats, key, per, tables=None, vec=False):
    """One pipeline stage: pass 2 of A (or nothing) interleaved with pass 1 of B (or nothing).

    Per-tensor form: a = (g, out, numel, bbase, tiles), b = (x, numel, tiles).
    Grouped form (tables given): a, b = (first tile, tiles) ranges of the address table.
    """
    a_tiles = 0 if a is None else a[-1]
    b_tiles = 0 if b is None else b[-1]
    if a_tiles + b_tiles == 0:
        return
    if tables is None:
        dummy = b[0] if a is None else a[0]
        ag, aout, an, abb = (dummy, dummy, 0, 0) if a is None else a[:4]
        bx, bn = (dummy, 0) if b is None else b[:2]
        part = stats if part is None else part  # unused pointer arguments get any tensor
        args = (ag, aout, an, abb, a_tiles, 0, bx, bn, b_tiles, 0, part, stats, key, part, part, 1)
        grouped = False
    else:
        meta, tile_tensor, x0 = tables
        args = (x0, x0, 0, 0, a_tiles, 0 if a is None else a[0], x0, 0, b_tiles, 0 if b is None else b[0],
                part, stats, key, tile_tensor, meta, meta.shape[0] // 4)
        grouped = True
    K._matrix_pipe_kernel[(a_tiles + b_tiles,)](
        *args, SUM_BLOCK=K._SUM_BLOCK, SUM_ITERS=K._SUM_ITERS, SUM_UNROLL=K._SUM_UNROLL, FLOOD_BLOCK=K._FLOOD_BLOCK,
        FLOOD_ITERS=K._FLOOD_ITERS, GROUPED=grouped, VEC=vec, PER=per, FAST=K.FAST_MATH, num_warps=K._PIPE_WARPS,
    )


def _matrix_stats(K, part, stats, tiles, params):
    K._matrix_stats_kernel[(1,)](part, stats, tiles, params, part, 1, 0, BLOCK=_STATS_BLOCK, GROUPED=False)


def _matrix(K, g: Tensor, out: Tensor, params: Tensor, key: Tensor, bbase: int, stats=None):
    """Matrix flood of a flat contiguous ``g`` into ``out`` (may be ``g``); returns stats [sigma, ||G||, s]."""
    n = g.numel()
    if stats is None:
        stats = torch.empty(3, dtype=torch.float32, device=g.device)
    if n == 0:
        stats.copy_(torch.stack((params[1], params.new_zeros(()), params[0])))
        return stats
    per = _per(g.dtype)
    tiles = _cdiv(n, _SPAN)
    part = torch.empty(tiles, 2, dtype=torch.float32, device=g.device)
    _pipe(K, None, (g, n, tiles), part, stats, key, per)
    _matrix_stats(K, part, stats, tiles, params)
    _pipe(K, (g, out, n, bbase, tiles), None, part, stats, key, per)
    return stats


def _matrix_chain(K, flats: list[Tensor], params: list[Tensor], bbases, key):
    """Per-tensor in-place matrix floods, pipelined: pass 2 of tensor k runs with pass 1 of k + 1."""
    prev = None
    for g, p, bb in zip(flats, params, bbases):
        n = g.numel()
        tiles = _cdiv(n, _SPAN)
        part = torch.empty(tiles, 2, dtype=torch.float32, device=g.device)
        stats = torch.empty(3, dtype=torch.float32, device=g.device)
        # one launch: pass 2 of the previous tensor (its own words per element) with pass 1 of this one
        _pipe(K, prev[0] if prev else None, (g, n, tiles), part, prev[1] if prev else stats, key,
              prev[2] if prev else _per(g.dtype))
        _matrix_stats(K, part, stats, tiles, p)
        prev = ((g, g, n, bb, tiles), stats, _per(g.dtype))
    if prev is not None:
        _pipe(K, prev[0], None, None, prev[1], key, prev[2])


_TABLES: "collections.OrderedDict[tuple, tuple]" = collections.OrderedDict()
_LAYOUTS: "collections.OrderedDict[tuple, tuple]" = collections.OrderedDict()
_TABLES_MAX = 32
_CAPTURED_TABLES: dict[tuple, tuple] = {}


def _pinned_to(values: list, dtype: torch.dtype, device: torch.device):
    """(device tensor, host source): pinned + non_blocking on CUDA; the source must outlive the copy."""
    host = torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True), host


def _group_layout(device: torch.device, itemsize: int, numels: tuple, bbases):
    """What a grouped launch needs that does not depend on the tensors' addresses, cached by layout:
    training with zero_grad(set_to_none=True) moves gradients every step, and then only the address
    part of the table is rebuilt."""
    key = (device, itemsize, numels, tuple(bbases))
    hit = _LAYOUTS.get(key)
    if hit is not None:
        _LAYOUTS.move_to_end(key)
        return hit
    T = len(numels)
    tiles = [_cdiv(n, _SPAN) for n in numels]
    first = [0]
    for n in tiles:
        first.append(first[-1] + n)
    static, s_host = _pinned_to(list(numels) + list(bbases) + first, torch.int64, device)
    tile_host = torch.repeat_interleave(torch.arange(T, dtype=torch.int32), torch.tensor(tiles))
    tile_tensor, t_host = _pinned_to(tile_host.tolist(), torch.int32, device)
    # pipeline chunks: whole tensors, ~equal bytes, each stage big enough to hide its launch
    total = sum(numels)
    m = max(1, min(_PIPE_CHUNKS, total * itemsize // _PIPE_MIN_BYTES))
    chunks, start, acc = [], 0, 0
    for i, n in enumerate(numels):
        acc += n
        if acc * m >= total * (len(chunks) + 1) or i == T - 1:
            chunks.append((start, i + 1))
            start = i + 1
    entry = (static, tile_tensor, first, chunks, (s_host, t_host))
    _LAYOUTS[key] = entry
    while len(_LAYOUTS) > _TABLES_MAX:
        _LAYOUTS.popitem(last=False)
    return entry


def _group_tables(grads: list[Tensor], bbases):
    """Device tables of a grouped launch: meta = [addresses, numels, bbases, first tiles] per tensor.

    Cached by addresses (a captured CUDA graph keeps reading its table: those are never evicted);
    a new set of addresses costs one small host->device copy plus one device copy of the layout part.
    """
    device = grads[0].device
    numels = tuple(g.numel() for g in grads)
    ptrs = tuple(g.data_ptr() for g in grads)
    key = (device, ptrs, numels, tuple(bbases))
    capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    hit = _TABLES.get(key)
    if hit is not None:
        _TABLES.move_to_end(key)
        if capturing:  # a captured graph keeps reading these tables: never evict them
            _CAPTURED_TABLES[key] = hit
        return hit
    if capturing:
        raise RuntimeError(
            "aegis flood_: this set of gradients was not seen before the CUDA-graph capture; run one "
            "eager (warm-up) step first so the grouped launch tables are cached"
        )
    static, tile_tensor, first, chunks, layout_hosts = _group_layout(device, grads[0].element_size(), numels, bbases)
    addresses, a_host = _pinned_to(list(ptrs), torch.int64, device)
    meta = torch.cat([addresses, static])
    entry = (meta, tile_tensor, first, chunks, (a_host, layout_hosts))  # hosts: pinned sources stay alive
    _TABLES[key] = entry
    while len(_TABLES) > _TABLES_MAX:
        _TABLES.popitem(last=False)
    return entry


def _matrix_grouped(K, grads: list[Tensor], params: Tensor, bbases, key, vec: bool):
    """In-place matrix flood of same-dtype contiguous tensors from one address table.

    Chunks c_0..c_m-1 of whole tensors: stage k floods c_k-1 while it sums c_k (2m + 1 launches,
    counting the per-chunk stats), so the arithmetic-bound floods overlap memory-bound sums.
    """
    meta, tile_tensor, first, chunks, _ = _group_tables(grads, bbases)
    T = len(grads)
    dev = grads[0].device
    per = _per(grads[0].dtype)
    part = torch.empty(first[-1], 2, dtype=torch.float32, device=dev)
    stats = torch.empty(T, 3, dtype=torch.float32, device=dev)
    tables = (meta, tile_tensor, grads[0])
    prev = None
    for t0, t1 in chunks:
        cur = (first[t0], first[t1] - first[t0])
        _pipe(K, prev, cur, part, stats, key, per, tables, vec)
        K._matrix_stats_kernel[(t1 - t0,)](part, stats, 0, params, meta, T, t0, BLOCK=_STATS_BLOCK, GROUPED=True)
        prev = cur
    _pipe(K, prev, None, part, stats, key, per, tables, vec)
    return stats


# ----------------------------------------------------------------------------- public launchers
def noise(shape, key: Tensor, offset: int = 0, dtype: torch.dtype = torch.float32, device=None) -> Tensor:
    """The Z (fp32) that a flood with output ``dtype`` adds, from the (key, offset) stream."""
    return _noise(shape, key, offset, dtype, device, parts=False)[0]


def noise_parts(shape, key: Tensor, offset: int = 0, dtype: torch.dtype = torch.float32, device=None):
    """The exact normals a flood with output ``dtype`` uses: (z, None) for bf16, the two summands
    (z_a, z_b) for fp16 / fp32 (reference.flood(..., z=z_a, zb=z_b) is then the kernels' flood)."""
    if _per(dtype) == 1:
        return noise(shape, key, offset, dtype, device), None
    return _noise(shape, key, offset, dtype, device, parts=True)


def _noise(shape, key, offset, dtype, device, parts: bool):
    ref.check_offset(offset)
    device = torch.device("cpu" if device is None else device)
    key = _device_key(key, device)
    out = torch.empty(tuple(int(s) for s in shape), dtype=torch.float32, device=device)
    out_b = torch.empty_like(out) if parts else out
    n = out.numel()
    if n:
        K = _kernels(device)
        per = _per(dtype)
        q = K._NOISE_BLOCK * per // ref.BLOCK_WORDS
        with _on(device):
            K._noise_kernel[(_cdiv(n, q * ref.BLOCK_WORDS // per),)](
                out, out_b, n, key, offset // ref.BLOCK_WORDS, Q=q, PER=per, FAST=K.FAST_MATH, PARTS=parts,
                num_warps=4,
            )
    return out, (out_b if parts else None)


def keystream(key: Tensor, blocks: Tensor, domain: int = ref.NOISE_DOMAIN) -> Tensor:
    """ChaCha words (n, 16) (int64 holding uint32) of int64 block counters, as reference.keystream."""
    b = blocks.to(torch.int64).contiguous()
    out = torch.empty(b.numel(), 16, dtype=torch.int64, device=b.device)
    n = b.numel()
    if n:
        K = _kernels(b.device)
        with _on(b.device):
            K._keystream_kernel[(_cdiv(n, 256),)](b, out, n, _device_key(key, b.device), domain, BLOCK=256)
    return out


def _device_key(key: Tensor, device: torch.device) -> Tensor:
    ref.check_key(key)
    return key.to(device, non_blocking=True).contiguous()


def flood(grad: Tensor, mode: str, params: Tensor, key: Tensor, offset: int = 0):
    """Functional flood -> (out, stats)."""
    ref.check_grad(grad, mode)
    ref.check_offset(offset)
    g = grad.contiguous()  # non-contiguous input: one copy, then the contiguous kernels
    params = ref.as_params(params, g.device).contiguous()
    key = _device_key(key, g.device)
    out = torch.empty_like(g, memory_format=torch.contiguous_format)
    K = _kernels(g.device)
    with _on(g.device):
        if mode == "rows":
            stats = _rows(K, g, out, params, key, offset // ref.BLOCK_WORDS)
        else:
            stats = _matrix(K, g.view(-1), out.view(-1), params, key, offset // ref.BLOCK_WORDS)
    return out, stats


def flood_(grads: list[Tensor], modes, params: Tensor, key: Tensor, *, grouped: bool | None = None) -> None:
    """In-place flood of many tensors under one key; tensor k at ref.stream_offsets(...)[k].

    ``params``: float32 (T, 4) device table (rho, sigma, clip, thr); ``key``: 8 int64 words on the
    device (a captured graph reads both by address). Matrix-mode tensors of one (device, dtype,
    alignment) are flooded from one address table in a few pipelined launches (CUDA only: the
    interpreter cannot load through the table); ``grouped=False`` pipelines them tensor by tensor
    with the same kernels. Rows-mode tensors get their own three launches each. The validated
    launch plan is cached per set of tensors, so a training loop pays the Python work once.
    """
    modes = modes if isinstance(modes, str) else ",".join(modes)
    try:
        # alignment, not the address: the plan holds no pointers, and gradients move between steps
        sig = (modes, grouped, tuple((g.data_ptr() % 16, g.dtype, g.device, tuple(g.shape), g.is_contiguous())
                                     for g in grads))
    except Exception:  # e.g. a sparse gradient: let the full checks below explain
        sig = None
    plan = _PLANS.get(sig) if sig is not None else None
    if plan is None:
        plan = _plan(grads, ref.split_modes(modes), grouped)
        if sig is not None:
            _PLANS[sig] = plan
            while len(_PLANS) > _TABLES_MAX:
                _PLANS.popitem(last=False)
    else:
        _PLANS.move_to_end(sig)
    ref.check_params_table(params, len(grads))
    copies = {i: grads[i].contiguous() for i in plan.copies}  # non-contiguous: flood a copy
    work = [copies.get(i, g) for i, g in enumerate(grads)]
    for kind, device, args in plan.steps:
        K = _kernels(device)
        dkey = _device_key(key, device)
        dparams = params.to(device, non_blocking=True)
        with _on(device):
            if kind == "rows":
                i, bb = args
                _rows(K, work[i], work[i], dparams[i], dkey, bb)
            elif kind == "group":
                idx, index, bbs, vec = args
                _matrix_grouped(K, [work[i] for i in idx], dparams.index_select(0, index), bbs, dkey, vec)
            else:
                idx, bbs = args
                _matrix_chain(K, [work[i].view(-1) for i in idx], [dparams[i] for i in idx], bbs, dkey)
    for i, c in copies.items():
        grads[i].copy_(c)


class _Plan:
    def __init__(self, steps, copies):
        self.steps, self.copies = steps, copies


_PLANS: "collections.OrderedDict[tuple, _Plan]" = collections.OrderedDict()


def _plan(grads, modes, grouped) -> _Plan:
    """Validate, assign stream offsets, and split into rows floods, grouped tables and chains."""
    if len(grads) != len(modes):
        raise ValueError("flood_: grads and modes must have the same length")
    for g, mode in zip(grads, modes):
        ref.check_grad(g, mode)
    offsets = ref.stream_offsets([(g.numel(), g.dtype) for g in grads])
    copies = [i for i, g in enumerate(grads) if not g.is_contiguous()]
    steps, groups, chain = [], {}, {}
    for i, (g, mode) in enumerate(zip(grads, modes)):
        if g.numel() == 0:
            continue
        if mode == "rows":
            steps.append(("rows", g.device, (i, offsets[i] // ref.BLOCK_WORDS)))
            continue
        use_grouped = (g.device.type == "cuda" and not INTERPRETED) if grouped is None else grouped
        if use_grouped and i not in copies:
            # (temporary copies get new addresses every call: they stay out of the cached tables)
            vec = g.data_ptr() % 16 == 0 and g.numel() % 16 == 0
            groups.setdefault((g.device, g.dtype, vec), []).append(i)
        else:
            chain.setdefault(g.device, []).append(i)
    for (device, _, vec), idx in groups.items():
        index = torch.tensor(idx, dtype=torch.int64, device=device)
        steps.append(("group", device, (idx, index, [offsets[i] // ref.BLOCK_WORDS for i in idx], vec)))
    for device, idx in chain.items():
        steps.append(("chain", device, (idx, [offsets[i] // ref.BLOCK_WORDS for i in idx])))
    return _Plan(steps, copies)


def _check_state(state: Tensor) -> None:
    if state.dtype != torch.int64 or state.shape != (ref.KEY_WORDS + 1,) or not state.is_contiguous():
        raise ValueError(
            f"state must be a contiguous int64 tensor [master key words x {ref.KEY_WORDS}, step], "
            f"got {state.dtype} {tuple(state.shape)}"
        )


def derive_key(state: Tensor) -> Tensor:
    """key = reference.derive_key(master, step) on the device (8 int64 words), and step += 1."""
    _check_state(state)
    key = torch.empty(ref.KEY_WORDS, dtype=torch.int64, device=state.device)
    K = _kernels(state.device)
    with _on(state.device):
        K._derive_key_kernel[(1,)](state, key)
    return key


def flood_keyed_(grads: list[Tensor], modes, params: Tensor, state: Tensor, *, grouped: bool | None = None) -> None:
    """flood_ with the step key derived on the device from state = [master, step]; step += 1."""
    flood_(grads, modes, params, derive_key(state), grouped=grouped)


# ----------------------------------------------------------------------------- registration
_LIB = None


def register() -> None:
    """Make the kernels the CUDA implementations of torch.ops.aegis.* (CPU keeps the reference).

    flood, flood_ and flood_keyed_ go on the dispatcher's CUDA key directly: custom_op's
    register_kernel wraps every call in a Python aliasing check that measured ~80 us per call on an
    H100 host, more than a rows flood's own launches. flood never returns a view of its input (a
    fresh output), the in-place ops return nothing."""
    global _LIB
    from . import ops

    def _flood_cuda(grad, mode, params, key, offset):
        return flood(grad, mode, params, key, offset)

    def _flood__cuda(grads, modes, params, key):
        flood_(grads, modes, params, key)

    def _flood_keyed__cuda(grads, modes, params, state):
        flood_keyed_(grads, modes, params, state)

    if _LIB is None:
        _LIB = torch.library.Library("aegis", "IMPL")
        _LIB.impl("flood", _flood_cuda, "CUDA")
        _LIB.impl("flood_", _flood__cuda, "CUDA")
        _LIB.impl("flood_keyed_", _flood_keyed__cuda, "CUDA")

    # noise has no tensor input but the key: it dispatches on the key's device (CPU keys are the
    # norm), so the CUDA case is chosen by the ``device`` argument inside one CPU/CUDA kernel.
    @ops.noise.register_kernel(("cpu", "cuda"))
    def _noise_cpu_cuda(shape, key, offset, dtype, device):
        if torch.device(device).type == "cuda":
            return noise(shape, key, offset, dtype, device=device)
        return ref.noise(tuple(shape), key, offset, dtype, device=device)
