"""The matrix flood (docs/design.md §1.1) of a tensor of any shape, and of many tensors in place:

    out = rho min(1, clip / ||G||_F) G + sigma Z

Two passes over 16384-element tiles:
  pass 1 (``_matrix_sum_tile``)    per-tile sum x^2 and non-finite flag;
  ``matrix_stats_kernel``          per tensor ||G||_F and s = rho min(1, clip / ||G||_F), fixed order;
  pass 2 (``_matrix_flood_tile``)  out = s G + sigma Z (G is not read when s is 0).
``matrix_pipe_kernel`` runs pass 2 of one set of tiles interleaved with pass 1 of another, so
memory-bound reads overlap the arithmetic-bound noise. A set of tiles is one tensor (pointer as an
argument: what the Triton interpreter can run) or, GROUPED, a tile range of a device address table
(tables.py) over many tensors: a whole in-place ``flood_`` in a few launches, CUDA only.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from .. import reference as ref
from .launch import SPAN, STATS_BLOCK, Backend, cdiv
from .stream import FLT_MAX, add_noise, load_key, noise_only, noise_tile, tile_lanes, to_out
from .tables import GroupTables, group_tables


@triton.jit(do_not_specialize=["ntiles", "t_first"])
def matrix_stats_kernel(
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
def group_sumsq_kernel(like_ptr, part_ptr, tile_tensor_ptr, meta_ptr, T, SUM_BLOCK: tl.constexpr,
                       SUM_ITERS: tl.constexpr, SUM_UNROLL: tl.constexpr, VEC: tl.constexpr):
    """Pass 1 alone over a grouped address table, one program per tile (nothing is written to the tensors)."""
    tile = tl.program_id(0)
    t = tl.load(tile_tensor_ptr + tile)
    local = tile - tl.load(meta_ptr + 3 * T + t)
    x_ptr = tl.load(meta_ptr + t).to(like_ptr.dtype)
    numel = tl.load(meta_ptr + T + t)
    if VEC:
        x_ptr = tl.multiple_of(x_ptr, 16)
        numel = tl.multiple_of(numel, 16)
    _matrix_sum_tile(x_ptr, numel, local, part_ptr, tile, SUM_BLOCK, SUM_ITERS, SUM_UNROLL)


@triton.jit
def _matrix_sum_noise_tile(g_ptr, numel, local, part_ptr, slot, sigma, bbase, k0, k1, k2, k3, k4, k5, k6, k7,
                           BLOCK: tl.constexpr, ITERS: tl.constexpr, PER: tl.constexpr, FAST: tl.constexpr):
    """Pass 1 and pass 2 of a rho-0 tile in place: part[slot] = [sum x^2, any non-finite] of G, and
    G := sigma Z. Each thread stores exactly the elements it loaded (one layout), so the in-place
    write needs no barrier."""
    L: tl.constexpr = 16 // PER
    start = local.to(tl.int64) * (BLOCK * ITERS)
    offs = tile_lanes(BLOCK // L, L)
    acc = tl.zeros([BLOCK // L, L], tl.float32)
    bad = tl.zeros([BLOCK // L, L], tl.float32)
    n_iter = tl.minimum(tl.cdiv(numel - start, BLOCK), ITERS)
    for i in range(0, n_iter):
        e0 = start + i * BLOCK
        m = offs < numel - e0
        x = tl.load(g_ptr + e0 + offs, mask=m, other=0.0).to(tl.float32)
        acc += x * x
        bad = tl.maximum(bad, tl.where(tl.abs(x) <= FLT_MAX, 0.0, 1.0))
        za, zb = noise_tile(k0, k1, k2, k3, k4, k5, k6, k7, bbase + e0 // L, BLOCK // L, PER, FAST)
        tl.store(g_ptr + e0 + offs, to_out(noise_only(sigma, za, zb, PER), g_ptr), mask=m)
    tl.store(part_ptr + 2 * slot, tl.sum(tl.sum(acc, axis=1), axis=0))
    tl.store(part_ptr + 2 * slot + 1, tl.max(tl.max(bad, axis=1), axis=0))


@triton.jit
def _matrix_flood_tile(g_ptr, out_ptr, numel, local, s, sigma, bbase, k0, k1, k2, k3, k4, k5, k6, k7,
                       BLOCK: tl.constexpr, ITERS: tl.constexpr, PER: tl.constexpr, FAST: tl.constexpr):
    """Pass 2 on one tile: out = s G + sigma Z; G is not read at all when s == 0."""
    L: tl.constexpr = 16 // PER
    start = local.to(tl.int64) * (BLOCK * ITERS)
    offs = tile_lanes(BLOCK // L, L)
    read = s != 0.0
    n_iter = tl.minimum(tl.cdiv(numel - start, BLOCK), ITERS)
    for i in range(0, n_iter):
        e0 = start + i * BLOCK
        za, zb = noise_tile(k0, k1, k2, k3, k4, k5, k6, k7, bbase + e0 // L, BLOCK // L, PER, FAST)
        if e0 + BLOCK <= numel:  # full block: no element mask
            if read:
                out = add_noise(s * tl.load(g_ptr + e0 + offs).to(tl.float32), sigma, za, zb, PER)
            else:
                out = noise_only(sigma, za, zb, PER)
            tl.store(out_ptr + e0 + offs, to_out(out, out_ptr))
        else:
            m = offs < numel - e0
            g = tl.load(g_ptr + e0 + offs, mask=m & ((offs * 0 + read.to(tl.int32)) != 0), other=0.0).to(tl.float32)
            tl.store(out_ptr + e0 + offs, to_out(add_noise(s * g, sigma, za, zb, PER), out_ptr), mask=m)


@triton.jit(do_not_specialize=["a_bbase", "a_first", "b_first", "a_tiles", "b_tiles", "a_numel", "b_numel"])
def matrix_pipe_kernel(
    a_ptr, a_out_ptr, a_numel, a_bbase, a_tiles, a_first, b_ptr, b_numel, b_tiles, b_first,
    part_ptr, stats_ptr, params_ptr, key_ptr, tile_tensor_ptr, meta_ptr, T,
    SUM_BLOCK: tl.constexpr, SUM_ITERS: tl.constexpr, SUM_UNROLL: tl.constexpr, FLOOD_BLOCK: tl.constexpr,
    FLOOD_ITERS: tl.constexpr, GROUPED: tl.constexpr, VEC: tl.constexpr, PER: tl.constexpr, FAST: tl.constexpr,
):
    """Pass 2 (flood) of tile set A together with pass 1 (sum x^2) of tile set B, interleaved.

    Pass 1 is bound by memory and pass 2 by arithmetic (the cipher and Box-Muller). Alternating
    their tiles in one grid puts both kinds of program on every SM, so the next chunk's reads
    overlap this chunk's noise. A or B may be empty (first and last stage).
    GROUPED: A and B are tile ranges [first, first + tiles) of the address table (in-place flood);
    else single tensors (a_out_ptr may differ from a_ptr; stats_ptr is that tensor's stats).
    GROUPED tensors with rho = 0 (params_ptr, [rho, sigma, clip, thr] per tensor) take one pass over
    memory: their pass 1 writes the noise as it reads G, and their pass 2 runs only on a non-finite G.
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
        k0, k1, k2, k3, k4, k5, k6, k7 = load_key(key_ptr)
        if GROUPED:
            tile = a_first + j
            t = tl.load(tile_tensor_ptr + tile)
            local = tile - tl.load(meta_ptr + 3 * T + t)
            g_ptr = tl.load(meta_ptr + t).to(a_ptr.dtype)
            numel = tl.load(meta_ptr + T + t)
            if VEC:  # host checked: 16-byte aligned, numel % 16 == 0 -> vector accesses
                g_ptr = tl.multiple_of(g_ptr, 16)
                numel = tl.multiple_of(numel, 16)
            sigma = tl.load(stats_ptr + 3 * t)
            # rho 0: pass 1 wrote the noise already; the flood pass only poisons a non-finite tensor
            if (tl.load(params_ptr + 4 * t) != 0.0) | (sigma != sigma):
                _matrix_flood_tile(g_ptr, g_ptr, numel, local, tl.load(stats_ptr + 3 * t + 2), sigma,
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
            if tl.load(params_ptr + 4 * t) == 0.0:  # rho 0: the noise needs no norm, write it now
                k0, k1, k2, k3, k4, k5, k6, k7 = load_key(key_ptr)
                _matrix_sum_noise_tile(x_ptr, numel, local, part_ptr, tile, tl.load(params_ptr + 4 * t + 1),
                                       tl.load(meta_ptr + 2 * T + t), k0, k1, k2, k3, k4, k5, k6, k7,
                                       FLOOD_BLOCK, FLOOD_ITERS, PER, FAST)
            else:
                _matrix_sum_tile(x_ptr, numel, local, part_ptr, tile, SUM_BLOCK, SUM_ITERS, SUM_UNROLL)
        else:
            _matrix_sum_tile(b_ptr, b_numel, j, part_ptr, j, SUM_BLOCK, SUM_ITERS, SUM_UNROLL)


# ----------------------------------------------------------------------------- launchers
class FloodTiles(NamedTuple):
    """Pass 2 of one tensor: ``out`` = flood of ``g`` (may be ``g``) from keystream block ``bbase``."""

    g: Tensor
    out: Tensor
    numel: int
    bbase: int
    tiles: int


class SumTiles(NamedTuple):
    """Pass 1 of one tensor."""

    x: Tensor
    numel: int
    tiles: int


class TileRange(NamedTuple):
    """Tiles [first, first + tiles) of a grouped address table (either pass)."""

    first: int
    tiles: int


class GroupArgs(NamedTuple):
    meta: Tensor
    tile_tensor: Tensor
    like: Tensor  # any of the group's tensors: gives the kernel its pointer type


def pipe(K: Backend, a, b, part, stats, key, per: int, group: GroupArgs | None = None, vec: bool = False,
         params: Tensor | None = None) -> None:
    """One pipeline stage: pass 2 of A (or nothing) interleaved with pass 1 of B (or nothing).

    Per-tensor form: a FloodTiles, b SumTiles. Grouped form (``group`` given): a, b TileRanges."""
    a_tiles = 0 if a is None else a.tiles
    b_tiles = 0 if b is None else b.tiles
    if a_tiles + b_tiles == 0:
        return
    if group is None:
        dummy = b.x if a is None else a.g
        ag, aout, an, abb = (dummy, dummy, 0, 0) if a is None else (a.g, a.out, a.numel, a.bbase)
        bx, bn = (dummy, 0) if b is None else (b.x, b.numel)
        part = stats if part is None else part  # unused pointer arguments get any tensor
        args = (ag, aout, an, abb, a_tiles, 0, bx, bn, b_tiles, 0, part, stats, part, key, part, part, 1)
    else:
        x0 = group.like
        args = (x0, x0, 0, 0, a_tiles, 0 if a is None else a.first, x0, 0, b_tiles, 0 if b is None else b.first,
                part, stats, params, key, group.tile_tensor, group.meta, group.meta.shape[0] // 4)
    cfg = K.config
    K.matrix.matrix_pipe_kernel[(a_tiles + b_tiles,)](
        *args, SUM_BLOCK=cfg.sum_block, SUM_ITERS=cfg.sum_iters, SUM_UNROLL=cfg.sum_unroll,
        FLOOD_BLOCK=cfg.flood_block, FLOOD_ITERS=cfg.flood_iters, GROUPED=group is not None, VEC=vec, PER=per,
        FAST=cfg.fast_math, num_warps=cfg.pipe_warps,
    )


def _tensor_stats(K: Backend, part, stats, tiles, params) -> None:
    K.matrix.matrix_stats_kernel[(1,)](part, stats, tiles, params, part, 1, 0, BLOCK=STATS_BLOCK, GROUPED=False)


def flood_matrix(K: Backend, g: Tensor, out: Tensor, params: Tensor, key: Tensor, bbase: int, stats=None) -> Tensor:
    """Matrix flood of a flat contiguous ``g`` into ``out`` (may be ``g``); returns stats [sigma, ||G||, s]."""
    n = g.numel()
    if stats is None:
        stats = torch.empty(3, dtype=torch.float32, device=g.device)
    if n == 0:
        stats.copy_(torch.stack((params[1], params.new_zeros(()), params[0])))
        return stats
    per = ref.words_per_element(g.dtype)
    tiles = cdiv(n, SPAN)
    part = torch.empty(tiles, 2, dtype=torch.float32, device=g.device)
    pipe(K, None, SumTiles(g, n, tiles), part, stats, key, per)
    _tensor_stats(K, part, stats, tiles, params)
    pipe(K, FloodTiles(g, out, n, bbase, tiles), None, part, stats, key, per)
    return stats


class _Pending(NamedTuple):
    """A tensor summed and reduced, its pass 2 not launched yet."""

    tiles: FloodTiles
    stats: Tensor
    per: int


def flood_matrix_chain(K: Backend, flats: list[Tensor], params: list[Tensor], bbases, key) -> None:
    """Per-tensor in-place matrix floods, pipelined: pass 2 of tensor k runs with pass 1 of k + 1."""
    prev = None
    for g, p, bb in zip(flats, params, bbases):
        n = g.numel()
        tiles = cdiv(n, SPAN)
        part = torch.empty(tiles, 2, dtype=torch.float32, device=g.device)
        stats = torch.empty(3, dtype=torch.float32, device=g.device)
        per = ref.words_per_element(g.dtype)
        # one launch: pass 2 of the previous tensor (its own words per element) with pass 1 of this one
        if prev is None:
            pipe(K, None, SumTiles(g, n, tiles), part, stats, key, per)
        else:
            pipe(K, prev.tiles, SumTiles(g, n, tiles), part, prev.stats, key, prev.per)
        _tensor_stats(K, part, stats, tiles, p)
        prev = _Pending(FloodTiles(g, g, n, bb, tiles), stats, per)
    if prev is not None:
        pipe(K, prev.tiles, None, None, prev.stats, key, prev.per)


def flood_matrix_grouped(K: Backend, grads: list[Tensor], params: Tensor, bbases, key, vec: bool,
                         tables: GroupTables | None = None) -> Tensor:
    """In-place matrix flood of same-dtype contiguous tensors from one address table (``tables``: given, the
    tensors are wherever its addresses point when the launches run; ``grads`` then need only their dtype).

    Chunks c_0..c_m-1 of whole tensors: stage k floods c_k-1 while it sums c_k (2m + 1 launches,
    counting the per-chunk stats), so the arithmetic-bound floods overlap memory-bound sums.
    """
    tables = group_tables(grads, bbases, K.config) if tables is None else tables
    first = tables.first
    T = len(tables.first) - 1
    dev = grads[0].device
    per = ref.words_per_element(grads[0].dtype)
    part = torch.empty(first[-1], 2, dtype=torch.float32, device=dev)
    stats = torch.empty(T, 3, dtype=torch.float32, device=dev)
    group = GroupArgs(tables.meta, tables.tile_tensor, grads[0])
    prev = None
    for t0, t1 in tables.chunks:
        cur = TileRange(first[t0], first[t1] - first[t0])
        pipe(K, prev, cur, part, stats, key, per, group, vec, params)
        K.matrix.matrix_stats_kernel[(t1 - t0,)](
            part, stats, 0, params, tables.meta, T, t0, BLOCK=STATS_BLOCK, GROUPED=True,
        )
        prev = cur
    pipe(K, prev, None, part, stats, key, per, group, vec, params)
    return stats


def grouped_norms(K: Backend, tensors: list[Tensor], vec: bool, tables: GroupTables | None = None) -> Tensor:
    """Per-tensor ||x||_2 (fp32, NaN for a non-finite tensor) of same-dtype contiguous tensors of one device,
    from one address table in two launches: pass 1 and the fixed-order per-tensor reduction, so the same
    tensors give the same bits on every call (``tables``: as in flood_matrix_grouped)."""
    T = len(tensors) if tables is None else len(tables.first) - 1
    tables = group_tables(tensors, [0] * T, K.config) if tables is None else tables
    dev = tensors[0].device
    part = torch.empty(tables.first[-1], 2, dtype=torch.float32, device=dev)
    stats = torch.empty(T, 3, dtype=torch.float32, device=dev)
    cfg = K.config
    K.matrix.group_sumsq_kernel[(tables.first[-1],)](
        tensors[0], part, tables.tile_tensor, tables.meta, T, SUM_BLOCK=cfg.sum_block, SUM_ITERS=cfg.sum_iters,
        SUM_UNROLL=cfg.sum_unroll, VEC=vec, num_warps=cfg.pipe_warps,
    )
    K.matrix.matrix_stats_kernel[(T,)](part, stats, 0, _zero_params(T, dev), tables.meta, T, 0, BLOCK=STATS_BLOCK,
                                       GROUPED=True)
    return stats[:, 1]


_ZEROS: dict[tuple, Tensor] = {}


def _zero_params(T: int, device: torch.device) -> Tensor:
    """A (T, 4) zero parameter table: the stats kernel's s is then 0 and only its norm column is read."""
    key = (T, device)
    if key not in _ZEROS:
        _ZEROS[key] = torch.zeros(T, 4, dtype=torch.float32, device=device)
    return _ZEROS[key]
