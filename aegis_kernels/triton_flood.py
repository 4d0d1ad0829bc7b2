"""Fused Triton kernels for the AEGIS floods (DESIGN §1-2) and their CUDA registration.

Raw ``@triton.jit`` kernels plus thin launchers (Liger-Kernel style). Judged against
``aegis_kernels.reference``; the noise stream is the one documented there (Philox4x32-10 keyed
by the seed, counter (offset + i) // 8, eight Box-Muller normals per counter), written here with
our own uint32 helpers so it does not depend on the Triton version.

Rows flood of a V x d gradient, three launches, no host sync:
  1. ``_rows_norms_kernel``   row norms (fp32) + per-block max and non-finite flag (reads G once);
  2. ``_rows_stats_kernel``   M, then the active set's partial sums and counts (reads V norms); its
                              last program reduces them to m_bar, sigma, |S|, M in a fixed order;
  3. ``_rows_flood_kernel``   out = rho*G (active rows only: masked loads) + sigma*Z.
Matrix flood (any shape, and the grouped in-place ``flood_``):
  ``_matrix_pipe_kernel``  pass 1 (per-tile sum |G| + non-finite flag) of one set of tiles
                           interleaved with pass 2 (out = rho*G + sigma*Z; G is not read at all
                           when rho == 0) of another, so memory-bound reads overlap the noise;
  ``_matrix_stats_kernel`` per-tensor m_bar, sigma (deterministic: fixed-order partials).
  One tensor: pipe(-, G), stats, pipe(G, -). Many: pipe(-, c0), stats, pipe(c0, c1), stats, ...

Grouped launches read tensor addresses from a device table, which the Triton interpreter cannot
do; every kernel also has a per-tensor form (GROUPED=False, pointer as an argument) that it can.

The launchers accept CUDA tensors, and CPU tensors through the Triton interpreter: kernels for
CPU tensors come from a second copy of this module compiled with TRITON_INTERPRET=1, so callers
(tests, CI) need no environment set before importing triton.
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
else:  # the interpreter maps no CUDA libdevice calls; FAST is always off there
    _libdevice = None

# Philox4x32-10 and Box-Muller constants, bit for bit those of reference.py.
PHILOX_KEY_A = tl.constexpr(0x9E3779B9)
PHILOX_KEY_B = tl.constexpr(0xBB67AE85)
PHILOX_ROUND_A = tl.constexpr(0xD2511F53)
PHILOX_ROUND_B = tl.constexpr(0xCD9E8D57)
LANES = tl.constexpr(ref.LANES)  # normals per Philox counter
ANGLE_BITS = tl.constexpr(ref.ANGLE_BITS)
ANGLE_MASK = tl.constexpr((1 << ref.ANGLE_BITS) - 1)
RADIUS_STEP = tl.constexpr(ref.RADIUS_STEP)
RADIUS_HALF = tl.constexpr(ref.RADIUS_STEP / 2)
ANGLE_STEP = tl.constexpr(ref.ANGLE_STEP)
SQRT_2LN2 = tl.constexpr(1.1774100225154747)
FLT_MAX = tl.constexpr(3.4028234663852886e38)
SEED_HI_MASK = tl.constexpr(0x3FFFFFFF)  # derive_seed keeps 62 bits

# On the GPU, log/sin/cos are the hardware approximations (MUFU lg2/sin/cos.approx): Z stays the
# reference stream (same Philox words, same lanes) within 2^-16 + 2^-22/r. libdevice's accurate
# versions triple Box-Muller's instructions; measured on an H100 the rows flood then takes
# 0.403 ms instead of 0.261 (32000 x 4096 bf16). AEGIS_ACCURATE_NOISE=1 selects them. The noise
# op runs the same code, so flood == reference(G, Z) to fp32 rounding with Z from that op.
FAST_MATH = not INTERPRETED and os.environ.get("AEGIS_ACCURATE_NOISE", "0") != "1"


# ----------------------------------------------------------------------------- jit helpers
@triton.jit
def _seed_words(seed):
    """Philox key (lo, hi) from a 64-bit seed (int32 or int64 scalar)."""
    s = seed.to(tl.int64).to(tl.uint64, bitcast=True)
    return s.to(tl.uint32), (s >> 32).to(tl.uint32)


@triton.jit
def _philox(k0, k1, c0, c1, c2, c3):
    """Philox4x32-10 on uint32 words (Salmon et al. 2011), as reference.philox4x32."""
    for _ in tl.static_range(10):
        # one 32x32->64 product gives both words (a single IMAD.WIDE.U32 on the GPU)
        pb = c2.to(tl.uint64) * PHILOX_ROUND_B
        pa = c0.to(tl.uint64) * PHILOX_ROUND_A
        c0 = (pb >> 32).to(tl.uint32) ^ c1 ^ k0
        c2 = (pa >> 32).to(tl.uint32) ^ c3 ^ k1
        c1 = pb.to(tl.uint32)
        c3 = pa.to(tl.uint32)
        k0 = k0 + PHILOX_KEY_A
        k1 = k1 + PHILOX_KEY_B
    return c0, c1, c2, c3


@triton.jit
def _uniform(w):
    """Radius uniform of a Philox word, as reference._uniform: its high 20 bits, (k + 1/2) 2^-20.

    Exact in fp32 (21 significant bits): one I2F and one FMA, no rounding, never 0."""
    return (w >> ANGLE_BITS).to(tl.float32) * RADIUS_STEP + RADIUS_HALF


@triton.jit
def _box_muller(w, scale, FAST: tl.constexpr):
    """scale * (r cos th, r sin th) from one Philox word: radius from its high 20 bits, angle from
    its low 12 (reference._box_muller).

    Exact form: the reference's sigma * Z bit for bit (with the platform's log/sin/cos). FAST form:
    hardware lg2/sqrt/sin/cos with the constants folded (r = sqrt(-lg2 u) * sqrt(2 ln 2) scale, the
    product a per-program scalar): same stream, each value within the approximations' error.
    |lg2 u| keeps a rounding of lg2 near u = 1 from ever giving a NaN.
    """
    u = _uniform(w)
    th = (w & ANGLE_MASK).to(tl.float32) * ANGLE_STEP
    if FAST:
        r = tl.sqrt(tl.abs(_libdevice.fast_log2f(u))) * (scale * SQRT_2LN2)
        return r * _libdevice.fast_cosf(th), r * _libdevice.fast_sinf(th)
    else:
        r = tl.sqrt(-2.0 * tl.log(u))
        return scale * (r * tl.cos(th)), scale * (r * tl.sin(th))


@triton.jit
def _normals_of_words(x0, x1, x2, x3, scale, FAST: tl.constexpr):
    """The eight lanes of a counter from its four words: word k gives lanes 2k and 2k + 1."""
    z0, z1 = _box_muller(x0, scale, FAST)
    z2, z3 = _box_muller(x1, scale, FAST)
    z4, z5 = _box_muller(x2, scale, FAST)
    z6, z7 = _box_muller(x3, scale, FAST)
    return z0, z1, z2, z3, z4, z5, z6, z7


@triton.jit
def _normals(k0, k1, c, scale, FAST: tl.constexpr):
    """scale * the eight standard normals of each int64 counter c (any shape): lanes 0..7."""
    cu = c.to(tl.uint64, bitcast=True)
    zero = tl.zeros(c.shape, tl.uint32)
    x0, x1, x2, x3 = _philox(k0, k1, cu.to(tl.uint32), (cu >> 32).to(tl.uint32), zero, zero)
    return _normals_of_words(x0, x1, x2, x3, scale, FAST)


@triton.jit
def _interleave(z0, z1, z2, z3, z4, z5, z6, z7):
    """[..., n] x8 -> [..., n, 8] (lane minor): element 8q + l takes lane l of counter q.

    Nested joins put the leaf at path (outer o, middle m, inner i) at position 4i + 2m + o. Tiles
    keep this [..., 8] shape for their loads and stores too, so each thread's eight values stay in
    its registers (one 16-byte store per counter for 16-bit dtypes, no shared-memory shuffle).
    """
    a = tl.join(tl.join(tl.join(z0, z4), tl.join(z2, z6)), tl.join(tl.join(z1, z5), tl.join(z3, z7)))
    return tl.reshape(a, a.shape[:-3] + [8])


@triton.jit
def _lanes(Q: tl.constexpr):
    """[Q, 8] element offsets 8q + l of a flat 8-aligned tile."""
    return LANES * tl.arange(0, Q)[:, None] + tl.arange(0, LANES)[None, :]


@triton.jit
def _noise_tile(k0, k1, c_start, scale, Q: tl.constexpr, FAST: tl.constexpr):
    """scale * Z as [Q, 8] for 8Q consecutive elements whose first element opens counter c_start.

    Counters (lo, hi, 0, 0): when no low word of the tile wraps, hi is the tile's, a scalar, and so
    are Philox's first-round key word and second-round product (one IMAD.WIDE and a few 64-bit adds
    fewer per counter, on the integer pipe that bounds the flood). Same words either way."""
    cu = c_start.to(tl.uint64, bitcast=True)
    lo0 = cu.to(tl.uint32)
    if lo0 <= 0xFFFFFFFF - (Q - 1):
        zero = tl.full([], 0, tl.uint32)
        lo = lo0 + tl.arange(0, Q).to(tl.uint32)
        x0, x1, x2, x3 = _philox(k0, k1, lo, (cu >> 32).to(tl.uint32), zero, zero)
        z0, z1, z2, z3, z4, z5, z6, z7 = _normals_of_words(x0, x1, x2, x3, scale, FAST)
    else:
        z0, z1, z2, z3, z4, z5, z6, z7 = _normals(k0, k1, c_start + tl.arange(0, Q), scale, FAST)
    return _interleave(z0, z1, z2, z3, z4, z5, z6, z7)


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


@triton.jit
def _load_seed(seed_ptr, seed, SEED_FROM_PTR: tl.constexpr):
    if SEED_FROM_PTR:  # flood_seeded_: derived on device by _derive_seed_kernel
        s = tl.load(seed_ptr)
    else:
        s = seed
    return _seed_words(s)


# ----------------------------------------------------------------------------- noise / seeds
@triton.jit(do_not_specialize=["seed", "cbase"])
def _noise_kernel(out_ptr, n, seed, cbase, BLOCK: tl.constexpr, FAST: tl.constexpr):
    start = tl.program_id(0).to(tl.int64) * BLOCK
    k0, k1 = _seed_words(seed)
    z = _noise_tile(k0, k1, cbase + start // LANES, 1.0, BLOCK // LANES, FAST)
    offs = _lanes(BLOCK // LANES)
    tl.store(out_ptr + start + offs, z, mask=offs < n - start)


@triton.jit(do_not_specialize=["seed"])
def _philox_kernel(c_ptr, out_ptr, n, seed, BLOCK: tl.constexpr):
    """Raw Philox words for n counters given as int64 [c0, c1, c2, c3] rows (for exactness tests)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    k0, k1 = _seed_words(seed)
    c0 = tl.load(c_ptr + 4 * offs, mask=m, other=0).to(tl.uint32)
    c1 = tl.load(c_ptr + 4 * offs + 1, mask=m, other=0).to(tl.uint32)
    c2 = tl.load(c_ptr + 4 * offs + 2, mask=m, other=0).to(tl.uint32)
    c3 = tl.load(c_ptr + 4 * offs + 3, mask=m, other=0).to(tl.uint32)
    x0, x1, x2, x3 = _philox(k0, k1, c0, c1, c2, c3)
    tl.store(out_ptr + 4 * offs, x0.to(tl.int64), mask=m)
    tl.store(out_ptr + 4 * offs + 1, x1.to(tl.int64), mask=m)
    tl.store(out_ptr + 4 * offs + 2, x2.to(tl.int64), mask=m)
    tl.store(out_ptr + 4 * offs + 3, x3.to(tl.int64), mask=m)


@triton.jit
def _uniform_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    """The uniforms of n Philox words (int64 holding uint32), for exactness tests."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    tl.store(out_ptr + offs, _uniform(tl.load(x_ptr + offs, mask=m, other=0).to(tl.uint32)), mask=m)


@triton.jit
def _derive_seed_kernel(state_ptr, seed_out_ptr):
    """seed = PRF(key, step) as reference.derive_seed; then step += 1 (graph-replay safe)."""
    key = tl.load(state_ptr)
    step = tl.load(state_ptr + 1)
    k0, k1 = _seed_words(key)
    su = step.to(tl.uint64, bitcast=True)
    c0 = su.to(tl.uint32)
    c1 = (su >> 32).to(tl.uint32)
    x0, x1, _, _ = _philox(k0, k1, c0, c1, c0 * 0 + 1, c0 * 0)
    seed = x0.to(tl.int64) | ((x1 & SEED_HI_MASK).to(tl.int64) << 32)
    tl.store(seed_out_ptr, seed)
    tl.store(state_ptr + 1, step + 1)


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
    norms_ptr, part_ptr, part2_ptr, count_ptr, stats_ptr, V, P, tau, lam, CHUNK: tl.constexpr, BLOCK: tl.constexpr,
    FIN: tl.constexpr,
):
    """Program j: M and the non-finite flag from pass 1's partials, then the active sum and count
    of norms [j CHUNK, (j+1) CHUNK) with S = {n > tau M}. Many programs: one alone waits on its
    loads one after another (latency-bound: ~50 us at V = 50257 on an H200).

    The last program to finish (completion counter) reduces the partials in a fixed order into
    [m_bar, sigma, |S|, M]: deterministic, and no extra launch. NaN iff the input had one."""
    j = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mx = tl.zeros([BLOCK], tl.float32)
    bad = tl.zeros([BLOCK], tl.float32)
    for p0 in range(0, P, BLOCK):
        pm = offs < P - p0
        mx = tl.maximum(mx, tl.load(part_ptr + 2 * (p0 + offs), mask=pm, other=0.0))
        bad = tl.maximum(bad, tl.load(part_ptr + 2 * (p0 + offs) + 1, mask=pm, other=0.0))
    peak = tl.max(mx, axis=0)
    bad = tl.max(bad, axis=0)
    v = j * CHUNK + tl.arange(0, CHUNK)
    n = tl.load(norms_ptr + v, mask=v < V, other=0.0)
    act = n > tau * peak
    tl.store(part2_ptr + 2 * j, tl.sum(tl.where(act, n, 0.0), axis=0))
    tl.store(part2_ptr + 2 * j + 1, tl.sum(act.to(tl.int32), axis=0).to(tl.float32))
    # Release this program's partials (every thread's stores, then one gpu-scope acq_rel atomic).
    tl.debug_barrier()
    P2 = tl.num_programs(0)
    if tl.atomic_add(count_ptr, 1, sem="acq_rel") == P2 - 1:
        f = tl.arange(0, FIN)
        fm = f < P2
        total = tl.sum(tl.load(part2_ptr + 2 * f, mask=fm, other=0.0, cache_modifier=".cg"), axis=0)
        count = tl.sum(tl.load(part2_ptr + 2 * f + 1, mask=fm, other=0.0, cache_modifier=".cg"), axis=0)
        nan = bad > 0.0
        m_bar = tl.where(nan, float("nan"), total / tl.maximum(count, 1.0))
        tl.store(stats_ptr + 0, m_bar)
        tl.store(stats_ptr + 1, lam * m_bar)
        tl.store(stats_ptr + 2, tl.where(nan, float("nan"), count))
        tl.store(stats_ptr + 3, tl.where(nan, float("nan"), peak))


@triton.jit(do_not_specialize=["seed", "cbase"])
def _rows_flood_kernel(
    g_ptr, out_ptr, norms_ptr, stats_ptr, seed_ptr, seed, cbase, V, D, rho, tau,
    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr, SEED_FROM_PTR: tl.constexpr,
    FAST: tl.constexpr,
):
    """Pass 2 for D % 8 == 0 (every row opens a counter): [BLOCK_R, BLOCK_D] tiles, no division.

    BLOCK_R == 1 (long rows): a branch per row, so inactive rows skip the load and the multiply-add.
    """
    # Reverse block order: pass 1 finished with the last rows, so their re-reads may hit L2.
    pid = tl.num_programs(0) - 1 - tl.program_id(0)
    sigma = tl.load(stats_ptr + 1)
    thr = tau * tl.load(stats_ptr + 3)
    k0, k1 = _load_seed(seed_ptr, seed, SEED_FROM_PTR)
    row0 = pid.to(tl.int64) * BLOCK_R
    base = row0 * D
    gp = g_ptr + base
    op = out_ptr + base
    lanes = _lanes(BLOCK_D // LANES)  # [BLOCK_D / 8, 8] column offsets
    if BLOCK_R == 1:
        read = (tl.load(norms_ptr + row0) > thr) & (rho != 0.0)  # inactive rows are never re-read
        c_row = cbase + base // LANES
        for d0 in range(0, D, BLOCK_D):
            offs = d0 + lanes
            sz = _noise_tile(k0, k1, c_row + d0 // LANES, sigma, BLOCK_D // LANES, FAST)
            if EVEN_D:
                if read:
                    out = rho * tl.load(gp + offs).to(tl.float32) + sz
                else:
                    out = sz
                tl.store(op + offs, _to_out(out, out_ptr))
            else:
                m = offs < D
                # (splat through int32: the interpreter turns a splatted bool scalar into fp32)
                g = tl.load(gp + offs, mask=m & ((offs * 0 + read.to(tl.int32)) != 0), other=0.0).to(tl.float32)
                tl.store(op + offs, _to_out(rho * g + sz, out_ptr), mask=m)
    else:
        rows = tl.arange(0, BLOCK_R)
        rmask = rows < V - row0
        n = tl.load(norms_ptr + row0 + rows, mask=rmask, other=0.0)
        read_row = rmask & (n > thr) & (rho != 0.0)
        c_row = cbase + base // LANES + rows * (D // LANES)
        for d0 in range(0, D, BLOCK_D):
            cols = d0 + lanes
            m = rmask[:, None, None] & (cols < D)[None, :, :]
            offs = rows[:, None, None] * D + cols[None, :, :]
            g = tl.load(gp + offs, mask=m & read_row[:, None, None], other=0.0).to(tl.float32)
            c = c_row[:, None] + (tl.arange(0, BLOCK_D // LANES) + d0 // LANES)[None, :]
            z0, z1, z2, z3, z4, z5, z6, z7 = _normals(k0, k1, c, sigma, FAST)
            out = rho * g + _interleave(z0, z1, z2, z3, z4, z5, z6, z7)
            tl.store(op + offs, _to_out(out, out_ptr), mask=m)


@triton.jit(do_not_specialize=["seed", "cbase"])
def _rows_flood_flat_kernel(
    g_ptr, out_ptr, norms_ptr, stats_ptr, seed_ptr, seed, cbase, N, D, rho, tau,
    BLOCK: tl.constexpr, SEED_FROM_PTR: tl.constexpr, FAST: tl.constexpr,
):
    """Pass 2 for any D: flat 4-aligned tiles, row = e // D per element."""
    pid = tl.num_programs(0) - 1 - tl.program_id(0)
    sigma = tl.load(stats_ptr + 1)
    peak = tl.load(stats_ptr + 3)
    start = pid.to(tl.int64) * BLOCK
    offs = _lanes(BLOCK // LANES)
    m = offs < N - start
    n = tl.load(norms_ptr + (start + offs) // D, mask=m, other=0.0)
    g = tl.load(g_ptr + start + offs, mask=m & (n > tau * peak) & (rho != 0.0), other=0.0).to(tl.float32)
    k0, k1 = _load_seed(seed_ptr, seed, SEED_FROM_PTR)
    sz = _noise_tile(k0, k1, cbase + start // LANES, sigma, BLOCK // LANES, FAST)
    tl.store(out_ptr + start + offs, _to_out(rho * g + sz, out_ptr), mask=m)


# ----------------------------------------------------------------------------- matrix mode
@triton.jit(do_not_specialize=["numel", "ntiles", "t_first"])
def _matrix_stats_kernel(
    part_ptr, stats_ptr, numel, ntiles, lam, meta_ptr, params_ptr, T, t_first, BLOCK: tl.constexpr,
    GROUPED: tl.constexpr,
):
    """One program per tensor: m_bar = sum|x| / numel over its tiles in a fixed order; sigma = lam m_bar."""
    t = t_first + tl.program_id(0)
    if GROUPED:  # meta (int64): [ptr x T, numel x T, cbase x T, first tile x (T + 1)]
        numel = tl.load(meta_ptr + T + t)
        first = tl.load(meta_ptr + 3 * T + t)
        last = tl.load(meta_ptr + 3 * T + t + 1)
        lam = tl.load(params_ptr + T + t)
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
    m_bar = tl.sum(acc, axis=0) / numel.to(tl.float32)
    sigma = lam * m_bar
    nan = tl.max(bad, axis=0) > 0.0
    tl.store(stats_ptr + 2 * t, tl.where(nan, float("nan"), m_bar))
    tl.store(stats_ptr + 2 * t + 1, tl.where(nan, float("nan"), sigma))


@triton.jit
def _matrix_sum_tile(x_ptr, numel, local, part_ptr, slot, BLOCK: tl.constexpr, ITERS: tl.constexpr,
                     UNROLL: tl.constexpr):
    """Pass 1 on one tile: part[slot] = [sum |x| (fp32), any non-finite]."""
    start = local.to(tl.int64) * (BLOCK * ITERS)
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], tl.float32)
    bad = tl.zeros([BLOCK], tl.float32)
    for i in range(0, ITERS, UNROLL):
        for u in tl.static_range(UNROLL):  # UNROLL independent loads in flight, few registers
            e = (i + u) * BLOCK
            x = tl.load(x_ptr + start + e + offs, mask=offs < numel - start - e, other=0.0).to(tl.float32)
            acc += tl.abs(x)
            bad = tl.maximum(bad, tl.where(tl.abs(x) <= FLT_MAX, 0.0, 1.0))
    tl.store(part_ptr + 2 * slot, tl.sum(acc, axis=0))
    tl.store(part_ptr + 2 * slot + 1, tl.max(bad, axis=0))


@triton.jit
def _matrix_flood_tile(g_ptr, out_ptr, numel, local, rho, sigma, cbase, k0, k1,
                       BLOCK: tl.constexpr, ITERS: tl.constexpr, FAST: tl.constexpr):
    """Pass 2 on one tile: out = rho*G + sigma*Z; G is not read at all when rho == 0."""
    start = local.to(tl.int64) * (BLOCK * ITERS)
    offs = _lanes(BLOCK // LANES)
    read = rho != 0.0
    n_iter = tl.minimum(tl.cdiv(numel - start, BLOCK), ITERS)
    for i in range(0, n_iter):
        s = start + i * BLOCK
        sz = _noise_tile(k0, k1, cbase + s // LANES, sigma, BLOCK // LANES, FAST)
        if s + BLOCK <= numel:  # full block: no element mask
            if read:
                out = rho * tl.load(g_ptr + s + offs).to(tl.float32) + sz
            else:
                out = sz
            tl.store(out_ptr + s + offs, _to_out(out, out_ptr))
        else:
            m = offs < numel - s
            g = tl.load(g_ptr + s + offs, mask=m & read, other=0.0).to(tl.float32)
            tl.store(out_ptr + s + offs, _to_out(rho * g + sz, out_ptr), mask=m)


@triton.jit(do_not_specialize=["seed", "a_cbase", "a_first", "b_first", "a_tiles", "b_tiles", "a_numel", "b_numel"])
def _matrix_pipe_kernel(
    a_ptr, a_out_ptr, a_numel, a_rho, a_cbase, a_tiles, a_first, b_ptr, b_numel, b_tiles, b_first,
    part_ptr, stats_ptr, seed_ptr, seed, tile_tensor_ptr, meta_ptr, params_ptr, T,
    SUM_BLOCK: tl.constexpr, SUM_ITERS: tl.constexpr, SUM_UNROLL: tl.constexpr, FLOOD_BLOCK: tl.constexpr,
    FLOOD_ITERS: tl.constexpr, GROUPED: tl.constexpr, VEC: tl.constexpr, SEED_FROM_PTR: tl.constexpr, FAST: tl.constexpr,
):
    """Pass 2 (flood) of tile set A together with pass 1 (sum |x|) of tile set B, interleaved.

    Pass 1 is bound by memory and pass 2 by arithmetic (10 Philox rounds + Box-Muller per four
    elements). Alternating their tiles in one grid puts both kinds of program on every SM, so the
    next chunk's reads overlap this chunk's noise. A or B may be empty (first and last stage).
    GROUPED: A and B are tile ranges [first, first + tiles) of the address table (in-place flood);
    else single tensors (a_out_ptr may differ from a_ptr).
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
        if GROUPED:
            tile = a_first + j
            t = tl.load(tile_tensor_ptr + tile)
            local = tile - tl.load(meta_ptr + 3 * T + t)
            g_ptr = tl.load(meta_ptr + t).to(a_ptr.dtype)
            numel = tl.load(meta_ptr + T + t)
            if VEC:  # host checked: 16-byte aligned, numel % 16 == 0 -> vector accesses
                g_ptr = tl.multiple_of(g_ptr, 16)
                numel = tl.multiple_of(numel, 16)
            k0, k1 = _load_seed(seed_ptr, seed, SEED_FROM_PTR)
            _matrix_flood_tile(g_ptr, g_ptr, numel, local, tl.load(params_ptr + t), tl.load(stats_ptr + 2 * t + 1),
                               tl.load(meta_ptr + 2 * T + t), k0, k1, FLOOD_BLOCK, FLOOD_ITERS, FAST)
        else:
            k0, k1 = _load_seed(seed_ptr, seed, SEED_FROM_PTR)
            _matrix_flood_tile(a_ptr, a_out_ptr, a_numel, j, a_rho, tl.load(stats_ptr + 1), a_cbase, k0, k1,
                               FLOOD_BLOCK, FLOOD_ITERS, FAST)
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
_NOISE_BLOCK = 16384 if INTERPRETED else 2048
_FLAT_BLOCK = 8192 if INTERPRETED else 2048
_ROWS_TILE1 = 16384 if INTERPRETED else 2048  # elements per [BLOCK_R, BLOCK_D] tile, rows pass 1
_ROWS_WARPS1 = 4
_ROWS_TILE2 = 16384 if INTERPRETED else 2048  # rows pass 2, short rows (several per program)
_ROWS_WARPS = 4
_ROW_SPLIT = 512  # rows pass 2 takes one row per program from this row length on
_ROWS_BD2 = 16384 if INTERPRETED else 2048  # its column block (at most)
_ROWS_WARPS2 = None  # None: block / 1024 (32 elements per thread; 16 from 512 down)
_PIPE_WARPS = 4
_PIPE_CHUNKS = 4  # pipeline stages of a grouped matrix flood (at most; 4 beat 1 and 8 on H100 and H200)
_PIPE_MIN_BYTES = 0 if INTERPRETED else 128 << 20  # bytes of gradient per stage (at least)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _pow2_floor(n: int) -> int:
    return 1 << (max(int(n), 1).bit_length() - 1)


def _seed_arg(seed: int) -> int:
    """The 64 key bits of a Python int seed as a signed int64 kernel argument."""
    s = int(seed) & 0xFFFFFFFFFFFFFFFF
    return s - (1 << 64) if s >= 1 << 63 else s


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
    The interpreter's integer-overflow sanitizer (a check per uint32 Philox multiply, where
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
def _block_d(D: int, cap: int) -> int:
    """Largest power of two <= cap whose padding wastes at most 1/8 of a row (16 at least)."""
    for b in (4096, 2048, 1024, 512, 256, 128, 64, 32, 16):
        if b <= cap and (_cdiv(D, b) * b - D) * 8 <= D:
            return b
    return 16


def _rows_configs(K, V: int, D: int):
    """(pass 1 [BLOCK_R, BLOCK_D, warps], pass 2 [BLOCK_R, BLOCK_D, warps]).

    Measured on an H200: ~16 elements per thread in pass 1; pass 2 takes whole rows of >= 512
    elements one per program (inactive rows branch past their loads and multiply-adds), with
    32 elements per thread (H100, 32000 x 4096 bf16: 129 vs 132 us at 16; a persistent grid was
    slower at every size tried, benchmarks/results/rows-flood-profile-h100.txt)."""
    bd1 = _block_d(D, 1024)
    br1 = max(1, min(K._ROWS_TILE1 // bd1, _pow2_floor(V)))
    if D % ref.LANES == 0 and D >= K._ROW_SPLIT:
        bd2 = next((b for b in (2048, 1024, 512, 256, 128) if b <= K._ROWS_BD2 and D % b == 0), None)
        bd2 = bd2 or _block_d(D, K._ROWS_BD2)
        return (br1, bd1, K._ROWS_WARPS1), (1, bd2, K._ROWS_WARPS2 or max(1, min(8, bd2 // 1024)))
    bd2 = _block_d(D, 1024)
    return (br1, bd1, K._ROWS_WARPS1), (max(1, min(K._ROWS_TILE2 // bd2, _pow2_floor(V))), bd2, K._ROWS_WARPS)


def _seed_args(seed, seed_buf, dummy):
    """(seed pointer, seed value, SEED_FROM_PTR)."""
    return (seed_buf, 0, True) if seed_buf is not None else (dummy, seed, False)


# ----------------------------------------------------------------------------- launches
def _rows(K, g: Tensor, out: Tensor, rho, lam, tau, seed, seed_buf, cbase, stats=None):
    """Rows flood of a contiguous V x D ``g`` into ``out`` (may be ``g``); returns (stats, norms)."""
    V, D = g.shape
    dev = g.device
    if stats is None:
        stats = torch.empty(4, dtype=torch.float32, device=dev)
    if V == 0 or D == 0:  # reference: no rows / zero norms -> S empty, all stats 0
        stats.zero_()
        return stats, torch.zeros(V, dtype=torch.float32, device=dev)
    (br1, bd1, w1), (br2, bd2, w2) = _rows_configs(K, V, D)
    P1 = _cdiv(V, br1)
    chunk = max(1024, 1 << (_cdiv(V, 256) - 1).bit_length())
    P2 = _cdiv(V, chunk)
    norms = torch.empty(V, dtype=torch.float32, device=dev)
    part = torch.empty(2 * P1 + 2 * P2 + 1, dtype=torch.float32, device=dev)  # pass 1, stats partials, counter
    part2, count = part[2 * P1 : 2 * P1 + 2 * P2], part[2 * P1 + 2 * P2 :].view(torch.int32)
    K._rows_norms_kernel[(P1,)](g, norms, part, count, V, D, BLOCK_R=br1, BLOCK_D=bd1, num_warps=w1)
    K._rows_stats_kernel[(P2,)](
        norms, part, part2, count, stats, V, P1, tau, lam, CHUNK=chunk, BLOCK=4096,
        FIN=max(2, 1 << (P2 - 1).bit_length()), num_warps=8,
    )
    seed_ptr, seed_val, from_ptr = _seed_args(seed, seed_buf, stats)
    if D % ref.LANES == 0:
        K._rows_flood_kernel[(_cdiv(V, br2),)](
            g, out, norms, stats, seed_ptr, seed_val, cbase, V, D, rho, tau,
            BLOCK_R=br2, BLOCK_D=bd2, EVEN_D=D % bd2 == 0, SEED_FROM_PTR=from_ptr, FAST=K.FAST_MATH,
            num_warps=w2,
        )
    else:
        n = V * D
        K._rows_flood_flat_kernel[(_cdiv(n, K._FLAT_BLOCK),)](
            g, out, norms, stats, seed_ptr, seed_val, cbase, n, D, rho, tau,
            BLOCK=K._FLAT_BLOCK, SEED_FROM_PTR=from_ptr, FAST=K.FAST_MATH, num_warps=4,
        )
    return stats, norms


def _pipe(K, a, b, part, stats, seed, seed_buf, tables=None, vec=False):
    """One pipeline stage: pass 2 of A (or nothing) interleaved with pass 1 of B (or nothing).

    Per-tensor form: a = (g, out, numel, rho, cbase, tiles), b = (x, numel, tiles).
    Grouped form (tables given): a, b = (first tile, tiles) ranges of the address table.
    """
    a_tiles = 0 if a is None else a[-1]
    b_tiles = 0 if b is None else b[-1]
    if a_tiles + b_tiles == 0:
        return
    seed_ptr, seed_val, from_ptr = _seed_args(seed, seed_buf, stats)
    if tables is None:
        dummy = b[0] if a is None else a[0]
        ag, aout, an, arho, acb = (dummy, dummy, 0, 0.0, 0) if a is None else a[:5]
        bx, bn = (dummy, 0) if b is None else b[:2]
        part = stats if part is None else part  # unused pointer arguments get any tensor
        args = (ag, aout, an, arho, acb, a_tiles, 0, bx, bn, b_tiles, 0,
                part, stats, seed_ptr, seed_val, part, part, part, 1)
        grouped = False
    else:
        meta, params, tile_tensor, x0 = tables
        args = (x0, x0, 0, 0.0, 0, a_tiles, 0 if a is None else a[0], x0, 0, b_tiles, 0 if b is None else b[0],
                part, stats, seed_ptr, seed_val, tile_tensor, meta, params, meta.shape[0] // 4)
        grouped = True
    K._matrix_pipe_kernel[(a_tiles + b_tiles,)](
        *args, SUM_BLOCK=K._SUM_BLOCK, SUM_ITERS=K._SUM_ITERS, SUM_UNROLL=K._SUM_UNROLL, FLOOD_BLOCK=K._FLOOD_BLOCK,
        FLOOD_ITERS=K._FLOOD_ITERS, GROUPED=grouped, VEC=vec, SEED_FROM_PTR=from_ptr, FAST=K.FAST_MATH,
        num_warps=K._PIPE_WARPS,
    )


def _matrix_stats(K, part, stats, numel, tiles, lam):
    K._matrix_stats_kernel[(1,)](part, stats, numel, tiles, lam, part, part, 1, 0, BLOCK=_STATS_BLOCK, GROUPED=False)


def _matrix(K, g: Tensor, out: Tensor, rho, lam, seed, seed_buf, cbase, stats=None):
    """Matrix flood of a flat contiguous ``g`` into ``out`` (may be ``g``); returns stats."""
    n = g.numel()
    if stats is None:
        stats = torch.empty(2, dtype=torch.float32, device=g.device)
    if n == 0:
        stats.zero_()
        return stats
    tiles = _cdiv(n, _SPAN)
    part = torch.empty(tiles, 2, dtype=torch.float32, device=g.device)
    _pipe(K, None, (g, n, tiles), part, stats, seed, seed_buf)
    _matrix_stats(K, part, stats, n, tiles, lam)
    _pipe(K, (g, out, n, rho, cbase, tiles), None, part, stats, seed, seed_buf)
    return stats


def _matrix_chain(K, flats: list[Tensor], rhos, lams, cbases, seed, seed_buf):
    """Per-tensor in-place matrix floods, pipelined: pass 2 of tensor k runs with pass 1 of k + 1."""
    prev = None
    for g, rho, lam, cb in zip(flats, rhos, lams, cbases):
        n = g.numel()
        tiles = _cdiv(n, _SPAN)
        part = torch.empty(tiles, 2, dtype=torch.float32, device=g.device)
        stats = torch.empty(2, dtype=torch.float32, device=g.device)
        _pipe(K, prev[0] if prev else None, (g, n, tiles), part, prev[1] if prev else stats, seed, seed_buf)
        _matrix_stats(K, part, stats, n, tiles, lam)
        prev = ((g, g, n, rho, cb, tiles), stats)
    if prev is not None:
        _pipe(K, prev[0], None, None, prev[1], seed, seed_buf)


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


def _group_layout(device: torch.device, itemsize: int, numels: tuple, rhos, lams, cbases):
    """What a grouped launch needs that does not depend on the tensors' addresses, cached by layout:
    training with zero_grad(set_to_none=True) moves gradients every step, and then only the address
    part of the table is rebuilt."""
    key = (device, itemsize, numels, tuple(rhos), tuple(lams), tuple(cbases))
    hit = _LAYOUTS.get(key)
    if hit is not None:
        _LAYOUTS.move_to_end(key)
        return hit
    T = len(numels)
    tiles = [_cdiv(n, _SPAN) for n in numels]
    first = [0]
    for n in tiles:
        first.append(first[-1] + n)
    static, s_host = _pinned_to(list(numels) + list(cbases) + first, torch.int64, device)
    params, p_host = _pinned_to(list(rhos) + list(lams), torch.float32, device)
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
    entry = (static, params, tile_tensor, first, chunks, (s_host, p_host, t_host))
    _LAYOUTS[key] = entry
    while len(_LAYOUTS) > _TABLES_MAX:
        _LAYOUTS.popitem(last=False)
    return entry


def _group_tables(grads: list[Tensor], rhos, lams, cbases):
    """Device tables of a grouped launch: meta = [addresses, numels, cbases, first tiles] per tensor.

    Cached by addresses (a captured CUDA graph keeps reading its table: those are never evicted);
    a new set of addresses costs one small host->device copy plus one device copy of the layout part.
    """
    device = grads[0].device
    numels = tuple(g.numel() for g in grads)
    ptrs = tuple(g.data_ptr() for g in grads)
    key = (device, ptrs, numels, tuple(rhos), tuple(lams), tuple(cbases))
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
    layout = _group_layout(device, grads[0].element_size(), numels, rhos, lams, cbases)
    static, params, tile_tensor, first, chunks, layout_hosts = layout
    addresses, a_host = _pinned_to(list(ptrs), torch.int64, device)
    meta = torch.cat([addresses, static])
    entry = (meta, params, tile_tensor, first, chunks, (a_host, layout_hosts))  # hosts: pinned sources stay alive
    _TABLES[key] = entry
    while len(_TABLES) > _TABLES_MAX:
        _TABLES.popitem(last=False)
    return entry


def _matrix_grouped(K, grads: list[Tensor], rhos, lams, cbases, seed, seed_buf, vec: bool):
    """In-place matrix flood of same-dtype contiguous tensors from one address table.

    Chunks c_0..c_m-1 of whole tensors: stage k floods c_k-1 while it sums c_k (2m + 1 launches,
    counting the per-chunk stats), so the arithmetic-bound floods overlap memory-bound sums.
    """
    meta, params, tile_tensor, first, chunks, _ = _group_tables(grads, rhos, lams, cbases)
    T = len(grads)
    dev = grads[0].device
    part = torch.empty(first[-1], 2, dtype=torch.float32, device=dev)
    stats = torch.empty(T, 2, dtype=torch.float32, device=dev)
    tables = (meta, params, tile_tensor, grads[0])
    prev = None
    for t0, t1 in chunks:
        cur = (first[t0], first[t1] - first[t0])
        _pipe(K, prev, cur, part, stats, seed, seed_buf, tables, vec)
        K._matrix_stats_kernel[(t1 - t0,)](
            part, stats, 0, 0, 0.0, meta, params, T, t0, BLOCK=_STATS_BLOCK, GROUPED=True
        )
        prev = cur
    _pipe(K, prev, None, part, stats, seed, seed_buf, tables, vec)
    return stats


# ----------------------------------------------------------------------------- public launchers
def noise(shape, seed: int, offset: int = 0, device=None) -> Tensor:
    """The exact Z that the flood kernels add (fp32), from the (seed, offset) stream."""
    ref.check_offset(offset)
    device = torch.device("cpu" if device is None else device)
    out = torch.empty(tuple(int(s) for s in shape), dtype=torch.float32, device=device)
    n = out.numel()
    if n:
        K = _kernels(device)
        with _on(device):
            K._noise_kernel[(_cdiv(n, K._NOISE_BLOCK),)](
                out, n, _seed_arg(seed), offset // ref.LANES, BLOCK=K._NOISE_BLOCK, FAST=K.FAST_MATH, num_warps=4
            )
    return out


def flood(grad: Tensor, mode: str, rho: float, lam: float, rel_threshold: float, seed: int, offset: int = 0,
          *, return_norms: bool = False):
    """Functional flood -> (out, stats) (+ row norms for mode 'rows' with return_norms)."""
    ref.check_params(grad, mode, rho, lam, rel_threshold)
    ref.check_offset(offset)
    g = grad.contiguous()  # non-contiguous input: one copy, then the contiguous kernels
    out = torch.empty_like(g, memory_format=torch.contiguous_format)
    K = _kernels(g.device)
    with _on(g.device):
        if mode == "rows":
            stats, norms = _rows(K, g, out, rho, lam, rel_threshold, _seed_arg(seed), None, offset // ref.LANES)
        else:
            stats = _matrix(K, g.view(-1), out.view(-1), rho, lam, _seed_arg(seed), None, offset // ref.LANES)
            norms = None
    return (out, stats, norms) if return_norms else (out, stats)


def flood_(grads: list[Tensor], modes, rhos, lams, rel_threshold: float, seed, *, grouped: bool | None = None) -> None:
    """In-place flood of many tensors under one seed; tensor k at ref.stream_offsets(...)[k].

    ``seed``: an int, or a 1-element int64 device tensor read by the kernels (graph replay).
    Matrix-mode tensors of one (device, dtype, alignment) are flooded from one address table in
    a few pipelined launches (CUDA only: the interpreter cannot load through the table);
    ``grouped=False`` pipelines them tensor by tensor with the same kernels. Rows-mode tensors
    get their own three launches each. The validated launch plan is cached per set of tensors, so
    a training loop pays the Python work once.
    """
    modes = modes if isinstance(modes, str) else ",".join(modes)
    try:
        # alignment, not the address: the plan holds no pointers, and gradients move between steps
        sig = (modes, tuple(rhos), tuple(lams), rel_threshold, grouped,
               tuple((g.data_ptr() % 16, g.dtype, g.device, tuple(g.shape), g.is_contiguous()) for g in grads))
    except Exception:  # e.g. a sparse gradient: let the full checks below explain
        sig = None
    plan = _PLANS.get(sig) if sig is not None else None
    if plan is None:
        plan = _plan(grads, ref.split_modes(modes), list(rhos), list(lams), rel_threshold, grouped)
        if sig is not None:
            _PLANS[sig] = plan
            while len(_PLANS) > _TABLES_MAX:
                _PLANS.popitem(last=False)
    else:
        _PLANS.move_to_end(sig)
    seed_buf = seed if isinstance(seed, Tensor) else None
    seed_val = 0 if seed_buf is not None else _seed_arg(seed)
    copies = {i: grads[i].contiguous() for i in plan.copies}  # non-contiguous: flood a copy
    work = [copies.get(i, g) for i, g in enumerate(grads)]
    for kind, device, args in plan.steps:
        K = _kernels(device)
        with _on(device):
            if kind == "rows":
                i, rho, lam, cb = args
                _rows(K, work[i], work[i], rho, lam, rel_threshold, seed_val, seed_buf, cb)
            elif kind == "group":
                idx, rs, ls, cbs, vec = args
                _matrix_grouped(K, [work[i] for i in idx], rs, ls, cbs, seed_val, seed_buf, vec)
            else:
                idx, rs, ls, cbs = args
                _matrix_chain(K, [work[i].view(-1) for i in idx], rs, ls, cbs, seed_val, seed_buf)
    for i, c in copies.items():
        grads[i].copy_(c)


class _Plan:
    def __init__(self, steps, copies):
        self.steps, self.copies = steps, copies


_PLANS: "collections.OrderedDict[tuple, _Plan]" = collections.OrderedDict()


def _plan(grads, modes, rhos, lams, rel_threshold, grouped) -> _Plan:
    """Validate, assign stream offsets, and split into rows floods, grouped tables and chains."""
    if not (len(grads) == len(modes) == len(rhos) == len(lams)):
        raise ValueError("flood_: grads, modes, rhos and lams must have the same length")
    for g, mode, rho, lam in zip(grads, modes, rhos, lams):
        ref.check_params(g, mode, rho, lam, rel_threshold)
    offsets = ref.stream_offsets([g.numel() for g in grads])
    copies = [i for i, g in enumerate(grads) if not g.is_contiguous()]
    steps, groups, chain = [], {}, {}
    for i, (g, mode) in enumerate(zip(grads, modes)):
        if g.numel() == 0:
            continue
        if mode == "rows":
            steps.append(("rows", g.device, (i, float(rhos[i]), float(lams[i]), offsets[i] // ref.LANES)))
            continue
        use_grouped = (g.device.type == "cuda" and not INTERPRETED) if grouped is None else grouped
        if use_grouped and i not in copies:
            # (temporary copies get new addresses every call: they stay out of the cached tables)
            vec = g.data_ptr() % 16 == 0 and g.numel() % 16 == 0
            groups.setdefault((g.device, g.dtype, vec), []).append(i)
        else:
            chain.setdefault(g.device, []).append(i)
    for (device, _, vec), idx in groups.items():
        steps.append(("group", device, (idx, [float(rhos[i]) for i in idx], [float(lams[i]) for i in idx],
                                        [offsets[i] // ref.LANES for i in idx], vec)))
    for device, idx in chain.items():
        steps.append(("chain", device, (idx, [float(rhos[i]) for i in idx], [float(lams[i]) for i in idx],
                                        [offsets[i] // ref.LANES for i in idx])))
    return _Plan(steps, copies)


def philox4x32(seed: int, counters: Tensor) -> Tensor:
    """Philox4x32-10 words (int64 holding uint32) of int64 counters [n, 4] (words < 2^32)."""
    c = counters.to(torch.int64).contiguous()
    out = torch.empty_like(c)
    n = c.shape[0]
    if n:
        K = _kernels(c.device)
        with _on(c.device):
            K._philox_kernel[(_cdiv(n, 1024),)](c, out, n, _seed_arg(seed), BLOCK=1024)
    return out


def uniform(words: Tensor) -> Tensor:
    """The kernels' [0, 1) uniforms of Philox words (int64 tensor holding uint32 values)."""
    x = words.to(torch.int64).contiguous()
    out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    n = x.numel()
    if n:
        K = _kernels(x.device)
        with _on(x.device):
            K._uniform_kernel[(_cdiv(n, 1024),)](x, out, n, BLOCK=1024)
    return out


def _check_state(state: Tensor) -> None:
    if state.dtype != torch.int64 or state.shape != (2,) or not state.is_contiguous():
        raise ValueError(f"state must be a contiguous int64 tensor [key, step], got {state.dtype} {tuple(state.shape)}")


def derive_seed(state: Tensor) -> Tensor:
    """seed = reference.derive_seed(key, step) on device (1-element int64) and step += 1."""
    _check_state(state)
    seed_buf = torch.empty(1, dtype=torch.int64, device=state.device)
    K = _kernels(state.device)
    with _on(state.device):
        K._derive_seed_kernel[(1,)](state, seed_buf)
    return seed_buf


def flood_seeded_(grads: list[Tensor], modes, rhos, lams, rel_threshold: float, state: Tensor,
                  *, grouped: bool | None = None) -> None:
    """flood_ with seed = derive_seed(state[0], state[1]) computed on device; state[1] += 1."""
    seed_buf = derive_seed(state)
    flood_(grads, modes, rhos, lams, rel_threshold, seed_buf, grouped=grouped)


# ----------------------------------------------------------------------------- registration
_LIB = None


def register() -> None:
    """Make the kernels the CUDA implementations of torch.ops.aegis.* (CPU keeps the reference).

    flood, flood_ and flood_seeded_ go on the dispatcher's CUDA key directly: custom_op's
    register_kernel wraps every call in a Python aliasing check that measured ~80 us per call on an
    H100 host (207 vs 129 us), more than a rows flood's own launches. flood never returns a view
    of its input (a fresh output), the in-place ops return nothing."""
    global _LIB
    from . import ops

    def _flood_cuda(grad, mode, rho, lam, rel_threshold, seed, offset):
        return flood(grad, mode, rho, lam, rel_threshold, seed, offset)

    def _flood__cuda(grads, modes, rhos, lams, rel_threshold, seed):
        flood_(grads, modes, rhos, lams, rel_threshold, seed)

    def _flood_seeded__cuda(grads, modes, rhos, lams, rel_threshold, state):
        ops.check_state(state)
        flood_seeded_(grads, modes, rhos, lams, rel_threshold, state)

    if _LIB is None:
        _LIB = torch.library.Library("aegis", "IMPL")
        _LIB.impl("flood", _flood_cuda, "CUDA")
        _LIB.impl("flood_", _flood__cuda, "CUDA")
        _LIB.impl("flood_seeded_", _flood_seeded__cuda, "CUDA")

    # noise has no tensor input: once a device kernel is registered, torch dispatches it on its
    # ``device`` argument, to registered devices only, so the CPU reference is registered too, in
    # the same call (torch 2.11 installs that dispatcher once per call and refuses a second).
    @ops.noise.register_kernel(("cpu", "cuda"))
    def _noise_cpu_cuda(shape, seed, offset, device):
        if torch.device(device).type == "cuda":
            return noise(shape, seed, offset, device=device)
        return ref.noise(tuple(shape), seed, offset, device=device)
