"""The rows flood (docs/design.md §1.1) of a V x d gradient whose rows are indexed by token id:

    n_v = ||G[v]||,  S = {v : n_v > thr},  out[v] = rho min(1, clip / n_v) G[v] [v in S] + sigma Z[v]

Long rows (d >= row_split, whole keystream blocks), one pass over memory:
  ``rows_onepass_kernel``  one row per program: its norm, then its flood (the public parameters need
                           no other row); per-row parts [active, clipped, n_v, non-finite];
  ``rows_reduce_kernel``   the parts -> stats [sigma, |S|, clipped, M] and a non-finite flag;
  ``rows_poison_kernel``   on that flag, NaN over the whole output (a step never goes out half clean).
Short rows, three launches, no host sync:
  ``rows_norms_kernel``    row norms (fp32) + per-block max and non-finite flag (reads G once);
  ``rows_stats_kernel``    |S|, clipped rows, M and the non-finite flag -> stats (sigma or NaN);
  ``rows_flood_kernel``    out = rho min(1, clip/n_v) G (rows of S only: masked loads) + sigma Z,
                           or ``rows_flood_flat_kernel`` when d is not a whole number of blocks.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .. import reference as ref
from .launch import Backend, cdiv, rows_tiling
from .stream import FLT_MAX, add_noise, block_normals, load_key, noise_only, noise_tile, tile_lanes, to_out


@triton.jit
def rows_norms_kernel(g_ptr, norms_ptr, part_ptr, count_ptr, V, D, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
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
def rows_stats_kernel(
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
    """rho min(1, clip / n_v) on S, 0 elsewhere (reference.clip_scale)."""
    return tl.where(n > thr, rho * tl.where(n > clip, clip / tl.maximum(n, 1.1754943508222875e-38), 1.0), 0.0)


@triton.jit(do_not_specialize=["bbase"])
def rows_flood_kernel(
    g_ptr, out_ptr, norms_ptr, stats_ptr, params_ptr, key_ptr, bbase, V, D,
    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, PER: tl.constexpr, FAST: tl.constexpr,
):
    """Pass 2 of short rows, D % (16 / PER) == 0 (every row opens a block): [BLOCK_R, BLOCK_D] tiles
    (long rows take rows_onepass_kernel)."""
    L: tl.constexpr = 16 // PER
    # Reverse block order: pass 1 finished with the last rows, so their re-reads may hit L2.
    pid = tl.num_programs(0) - 1 - tl.program_id(0)
    sigma = tl.load(stats_ptr)
    rho = tl.load(params_ptr)
    clip = tl.load(params_ptr + 2)
    thr = tl.load(params_ptr + 3)
    k0, k1, k2, k3, k4, k5, k6, k7 = load_key(key_ptr)
    row0 = pid.to(tl.int64) * BLOCK_R
    base = row0 * D
    gp = g_ptr + base
    op = out_ptr + base
    lanes = tile_lanes(BLOCK_D // L, L)  # [BLOCK_D / L, L] column offsets
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
        za, zb = block_normals(k0, k1, k2, k3, k4, k5, k6, k7, b, PER, FAST)
        tl.store(op + offs, to_out(add_noise(s[:, None, None] * g, sigma, za, zb, PER), out_ptr), mask=m)


@triton.jit(do_not_specialize=["bbase", "slot"])
def rows_onepass_kernel(
    g_ptr, out_ptr, part_ptr, count_ptr, params_ptr, key_ptr, bbase, D, addr_ptr, slot,
    BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr, PER: tl.constexpr, FAST: tl.constexpr, ADDR: tl.constexpr,
):
    """One row per program, one pass over memory (D % (16 / PER) == 0, long rows): the row's norm,
    then out = rho min(1, clip/n) G[v] [n > thr] + sigma Z[v] (the public parameters need no other
    row); the re-read of a row in S hits the lines this program just loaded. part[v] = [active,
    clipped, n_v, non-finite] (no atomics: tens of thousands on four addresses serialise);
    rows_reduce_kernel turns them into stats and rows_poison_kernel, on a non-finite input, the
    whole output into NaN. ADDR: in place at the address in addr[slot] (g and out give the pointer type
    only), so a captured CUDA graph floods a gradient that moved."""
    L: tl.constexpr = 16 // PER
    if ADDR:  # 16-byte aligned (host-checked), as a pointer argument is: the same layouts, the same bits
        g_ptr = tl.multiple_of(tl.load(addr_ptr + slot).to(g_ptr.dtype), 16)
        out_ptr = g_ptr
    row = tl.program_id(0).to(tl.int64)
    if row == 0:  # the reduce pass's completion counter (stream order: before that pass starts)
        tl.store(count_ptr, 0)
    base = row * D
    gp = g_ptr + base
    op = out_ptr + base
    lanes = tile_lanes(BLOCK_D // L, L)
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
    k0, k1, k2, k3, k4, k5, k6, k7 = load_key(key_ptr)
    b_row = bbase + base // L
    tl.debug_barrier()  # in place (out is g): every thread's reads of the row before any write
    for d0 in range(0, D, BLOCK_D):
        offs = d0 + lanes
        za, zb = noise_tile(k0, k1, k2, k3, k4, k5, k6, k7, b_row + d0 // L, BLOCK_D // L, PER, FAST)
        if EVEN_D:
            if read:
                out = add_noise(s * tl.load(gp + offs).to(tl.float32), sigma, za, zb, PER)
            else:
                out = noise_only(sigma, za, zb, PER)
            tl.store(op + offs, to_out(out, out_ptr))
        else:
            m = offs < D
            g = tl.load(gp + offs, mask=m & ((offs * 0 + read.to(tl.int32)) != 0), other=0.0).to(tl.float32)
            tl.store(op + offs, to_out(add_noise(s * g, sigma, za, zb, PER), out_ptr), mask=m)
    active = (n > thr).to(tl.float32)
    tl.store(part_ptr + 4 * row, active)
    tl.store(part_ptr + 4 * row + 1, active * (n > clip).to(tl.float32))
    tl.store(part_ptr + 4 * row + 2, n)
    tl.store(part_ptr + 4 * row + 3, tl.max(tl.max(bad, axis=1), axis=0))


@triton.jit
def rows_reduce_kernel(part_ptr, part2_ptr, count_ptr, stats_ptr, params_ptr, V, CHUNK: tl.constexpr,
                       FIN: tl.constexpr):
    """stats = [sigma, |S|, clipped, M] from the per-row parts; all NaN and stats[4] = 1 when the input
    had a non-finite element. Program j reduces rows [j CHUNK, (j+1) CHUNK) into part2[j] (one
    program walking every row waits on one load latency per step); the last program to finish
    (completion counter, zeroed by the one-pass kernel) reduces part2 in a fixed order."""
    j = tl.program_id(0)
    v = j.to(tl.int64) * CHUNK + tl.arange(0, CHUNK)
    m = v < V
    p = part_ptr + 4 * v
    tl.store(part2_ptr + 4 * j, tl.sum(tl.load(p, mask=m, other=0.0), axis=0))
    tl.store(part2_ptr + 4 * j + 1, tl.sum(tl.load(p + 1, mask=m, other=0.0), axis=0))
    tl.store(part2_ptr + 4 * j + 2, tl.max(tl.load(p + 2, mask=m, other=0.0), axis=0))
    tl.store(part2_ptr + 4 * j + 3, tl.max(tl.load(p + 3, mask=m, other=0.0), axis=0))
    # Release this program's partials (every thread's stores, then one gpu-scope acq_rel atomic).
    tl.debug_barrier()
    P = tl.num_programs(0)
    if tl.atomic_add(count_ptr, 1, sem="acq_rel") == P - 1:
        f = tl.arange(0, FIN)
        q = part2_ptr + 4 * f
        fm = f < P
        nan = tl.max(tl.load(q + 3, mask=fm, other=0.0, cache_modifier=".cg"), axis=0) > 0.0
        tl.store(stats_ptr, tl.where(nan, float("nan"), tl.load(params_ptr + 1)))
        tl.store(stats_ptr + 1, tl.where(nan, float("nan"),
                                         tl.sum(tl.load(q, mask=fm, other=0.0, cache_modifier=".cg"), axis=0)))
        tl.store(stats_ptr + 2, tl.where(nan, float("nan"),
                                         tl.sum(tl.load(q + 1, mask=fm, other=0.0, cache_modifier=".cg"), axis=0)))
        tl.store(stats_ptr + 3, tl.where(nan, float("nan"),
                                         tl.max(tl.load(q + 2, mask=fm, other=0.0, cache_modifier=".cg"), axis=0)))
        tl.store(stats_ptr + 4, nan.to(tl.float32))


@triton.jit(do_not_specialize=["slot"])
def rows_poison_kernel(out_ptr, stats_ptr, N, addr_ptr, slot, BLOCK: tl.constexpr, ADDR: tl.constexpr):
    """NaN over the whole output when rows_reduce_kernel flagged a non-finite input (stats[4]):
    a step never goes out half clean. A clean step costs one load per program. ADDR: the output is at
    the address in addr[slot]."""
    pid = tl.program_id(0)
    if tl.load(stats_ptr + 4) > 0.0:
        if ADDR:
            out_ptr = tl.load(addr_ptr + slot).to(out_ptr.dtype)
        offs = tl.arange(0, BLOCK)
        fill = tl.full([BLOCK], float("nan"), tl.float32)
        for start in range(pid.to(tl.int64) * BLOCK, N, tl.num_programs(0) * BLOCK):
            tl.store(out_ptr + start + offs, to_out(fill, out_ptr), mask=offs < N - start)


@triton.jit(do_not_specialize=["bbase"])
def rows_flood_flat_kernel(
    g_ptr, out_ptr, norms_ptr, stats_ptr, params_ptr, key_ptr, bbase, N, D,
    Q: tl.constexpr, PER: tl.constexpr, FAST: tl.constexpr,
):
    """Pass 2 for any D: flat block-aligned tiles, row = e // D per element."""
    L: tl.constexpr = 16 // PER
    pid = tl.num_programs(0) - 1 - tl.program_id(0)
    sigma = tl.load(stats_ptr)
    start = pid.to(tl.int64) * (Q * L)
    offs = tile_lanes(Q, L)
    m = offs < N - start
    n = tl.load(norms_ptr + (start + offs) // D, mask=m, other=0.0)
    s = _row_scale(n, tl.load(params_ptr), tl.load(params_ptr + 2), tl.load(params_ptr + 3))
    g = tl.load(g_ptr + start + offs, mask=m & (s != 0.0), other=0.0).to(tl.float32)
    k0, k1, k2, k3, k4, k5, k6, k7 = load_key(key_ptr)
    za, zb = noise_tile(k0, k1, k2, k3, k4, k5, k6, k7, bbase + start // L, Q, PER, FAST)
    tl.store(out_ptr + start + offs, to_out(add_noise(s * g, sigma, za, zb, PER), out_ptr), mask=m)


# ----------------------------------------------------------------------------- launchers
def rows_onepass(K: Backend, V: int, D: int, dtype: torch.dtype) -> bool:
    """Whether a V x D rows flood of ``dtype`` takes the one-pass kernels (long rows of whole blocks)."""
    per = ref.words_per_element(dtype)
    return V > 0 and D > 0 and rows_tiling(K.config, V, D, per)[1].rows == 1 and D % (ref.BLOCK_WORDS // per) == 0


def _flood_onepass(K: Backend, V: int, D: int, g: Tensor, out: Tensor, params: Tensor, key: Tensor, bbase: int,
                   addr: tuple[Tensor, int] | None) -> Tensor:
    """The one-pass rows flood's three launches; its stats [sigma, |S|, clipped, M, non-finite] (a scratch
    view). ``addr`` = (table, slot): in place at the address table[slot], ``g`` giving the pointer type."""
    cfg, R = K.config, K.rows
    per = ref.words_per_element(g.dtype)
    flood_tile = rows_tiling(cfg, V, D, per)[1]
    P = cdiv(V, cfg.reduce_chunk)
    # per-row parts [V, 4], per-chunk partials [P, 4], the stats + non-finite flag [5], the counter
    part = torch.empty(4 * V + 4 * P + 5 + 1, dtype=torch.float32, device=g.device)
    part2, flag = part[4 * V : 4 * V + 4 * P], part[4 * V + 4 * P : 4 * V + 4 * P + 5]
    count = part[4 * V + 4 * P + 5 :].view(torch.int32)
    table, slot = (part, 0) if addr is None else addr  # without ADDR the table argument is never read
    bd = flood_tile.cols
    R.rows_onepass_kernel[(V,)](
        g, out, part, count, params, key, bbase, D, table, slot, BLOCK_D=bd, EVEN_D=D % bd == 0, PER=per,
        FAST=cfg.fast_math, ADDR=addr is not None, num_warps=flood_tile.warps,
    )
    R.rows_reduce_kernel[(P,)](
        part, part2, count, flag, params, V, CHUNK=cfg.reduce_chunk, FIN=max(2, 1 << (P - 1).bit_length()),
        num_warps=4,
    )
    R.rows_poison_kernel[(min(cdiv(V * D, 4096), 1024),)](out, flag, V * D, table, slot, BLOCK=4096,
                                                            ADDR=addr is not None)
    return flag


def flood_rows_at(K: Backend, shape: tuple[int, int], like: Tensor, table: Tensor, slot: int, params: Tensor,
                  key: Tensor, bbase: int) -> None:
    """The in-place one-pass rows flood of the V x D tensor whose address is table[slot] (``like``: any tensor
    of its dtype and device). A CUDA graph of it floods the tensor found there at each replay."""
    V, D = shape
    if not rows_onepass(K, V, D, like.dtype):
        raise ValueError(f"flood_rows_at: a {V} x {D} {like.dtype} rows flood does not take the one-pass kernels")
    _flood_onepass(K, V, D, like, like, params, key, bbase, (table, slot))


def flood_rows(K: Backend, g: Tensor, out: Tensor, params: Tensor, key: Tensor, bbase: int, stats=None, *,
               keep_stats: bool = True) -> Tensor:
    """Rows flood of a contiguous V x D ``g`` into ``out`` (may be ``g``) from keystream block
    ``bbase``; returns stats [sigma, |S|, clipped, M] (``keep_stats=False``, the in-place ``flood_``:
    possibly a view of a scratch buffer, spared a copy)."""
    V, D = g.shape
    dev = g.device
    per = ref.words_per_element(g.dtype)
    cfg, R = K.config, K.rows
    norms_tile, flood_tile = rows_tiling(cfg, V, D, per)
    onepass = rows_onepass(K, V, D, g.dtype)
    if stats is None and (keep_stats or not onepass):
        stats = torch.empty(4, dtype=torch.float32, device=dev)
    if V == 0 or D == 0:  # nothing to flood: S empty
        stats.copy_(torch.stack((params[1], *params.new_zeros(3))))
        return stats
    if onepass:  # long rows: one pass over memory
        flag = _flood_onepass(K, V, D, g, out, params, key, bbase, None)
        if not keep_stats:
            return flag[:4]
        stats.copy_(flag[:4])
        return stats
    P1 = cdiv(V, norms_tile.rows)
    chunk = max(1024, 1 << (cdiv(V, 256) - 1).bit_length())
    P2 = cdiv(V, chunk)
    norms = torch.empty(V, dtype=torch.float32, device=dev)
    part = torch.empty(2 * P1 + 2 * P2 + 1, dtype=torch.float32, device=dev)  # pass 1, stats partials, counter
    part2, count = part[2 * P1 : 2 * P1 + 2 * P2], part[2 * P1 + 2 * P2 :].view(torch.int32)
    R.rows_norms_kernel[(P1,)](
        g, norms, part, count, V, D, BLOCK_R=norms_tile.rows, BLOCK_D=norms_tile.cols, num_warps=norms_tile.warps,
    )
    R.rows_stats_kernel[(P2,)](
        norms, part, part2, count, stats, params, V, P1, CHUNK=chunk, BLOCK=4096,
        FIN=max(2, 1 << (P2 - 1).bit_length()), num_warps=8,
    )
    if D % (ref.BLOCK_WORDS // per) == 0:
        R.rows_flood_kernel[(cdiv(V, flood_tile.rows),)](
            g, out, norms, stats, params, key, bbase, V, D,
            BLOCK_R=flood_tile.rows, BLOCK_D=flood_tile.cols, PER=per, FAST=cfg.fast_math, num_warps=flood_tile.warps,
        )
    else:
        n = V * D
        R.rows_flood_flat_kernel[(cdiv(n, cfg.flat_block),)](
            g, out, norms, stats, params, key, bbase, n, D,
            Q=cfg.flat_block * per // ref.BLOCK_WORDS, PER=per, FAST=cfg.fast_math, num_warps=4,
        )
    return stats
