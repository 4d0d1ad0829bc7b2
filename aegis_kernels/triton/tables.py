"""Device tables of grouped matrix launches, and their caches.

A grouped launch floods many tensors in a few launches by reading their addresses, sizes and
keystream bases from a device table (``meta``) and the owner of each tile from another
(``tile_tensor``). Both are cached:

- by layout (sizes and keystream bases, not addresses): training with ``zero_grad(set_to_none=True)``
  moves gradients every step, and then only the address part of the table is rebuilt;
- by addresses: the same gradients next step cost nothing.

A captured CUDA graph keeps reading the tables it was captured with, by address, after they leave
these caches. During a capture each table used is handed to ``aegis_kernels.cuda_graph.keep_alive``,
which ties it to the graph that reads it (see that module).
"""
from __future__ import annotations

import collections
from typing import NamedTuple

import torch
from torch import Tensor

from .. import cuda_graph
from .launch import CACHE_MAX, PROCESS, SPAN, LaunchConfig, cdiv


class GroupLayout(NamedTuple):
    """What a grouped launch needs that does not depend on the tensors' addresses."""

    static: Tensor  # int64 [numel x T, bbase x T, first tile x (T + 1)] on the device
    tile_tensor: Tensor  # int32: the tensor of each tile
    first: list[int]  # first tile of each tensor, and the total
    chunks: list[tuple[int, int]]  # pipeline stages: [t0, t1) ranges of whole tensors
    hosts: tuple  # pinned host sources of the copies above (alive until the copies ran)


class GroupTables(NamedTuple):
    """The device tables of one set of tensors: meta = [addresses, numels, bbases, first tiles]."""

    meta: Tensor
    tile_tensor: Tensor
    first: list[int]
    chunks: list[tuple[int, int]]
    hosts: tuple


_TABLES: collections.OrderedDict[tuple, GroupTables] = collections.OrderedDict()
_LAYOUTS: collections.OrderedDict[tuple, GroupLayout] = collections.OrderedDict()


def _pinned_to(values: list, dtype: torch.dtype, device: torch.device):
    """(device tensor, host source): pinned + non_blocking on CUDA; the source must outlive the copy."""
    host = torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True), host


def group_layout(
    device: torch.device, itemsize: int, numels: tuple, bbases, cfg: LaunchConfig = PROCESS
) -> GroupLayout:
    """The address-free part of a grouped launch, cached by layout."""
    key = (device, itemsize, numels, tuple(bbases))
    hit = _LAYOUTS.get(key)
    if hit is not None:
        _LAYOUTS.move_to_end(key)
        return hit
    T = len(numels)
    tiles = [cdiv(n, SPAN) for n in numels]
    first = [0]
    for n in tiles:
        first.append(first[-1] + n)
    static, s_host = _pinned_to(list(numels) + list(bbases) + first, torch.int64, device)
    tile_host = torch.repeat_interleave(torch.arange(T, dtype=torch.int32), torch.tensor(tiles))
    tile_tensor, t_host = _pinned_to(tile_host.tolist(), torch.int32, device)
    # pipeline chunks: whole tensors, ~equal bytes, each stage big enough to hide its launch
    total = sum(numels)
    m = max(1, min(cfg.pipe_chunks, total * itemsize // cfg.pipe_min_bytes))
    chunks: list[tuple[int, int]] = []
    start, acc = 0, 0
    for i, n in enumerate(numels):
        acc += n
        if acc * m >= total * (len(chunks) + 1) or i == T - 1:
            chunks.append((start, i + 1))
            start = i + 1
    entry = GroupLayout(static, tile_tensor, first, chunks, (s_host, t_host))
    _LAYOUTS[key] = entry
    while len(_LAYOUTS) > CACHE_MAX:
        _LAYOUTS.popitem(last=False)
    return entry


def group_tables(grads: list[Tensor], bbases, cfg: LaunchConfig = PROCESS) -> GroupTables:
    """Device tables of a grouped launch over ``grads`` (flooded from keystream blocks ``bbases``).

    A new set of addresses costs one small host->device copy plus one device copy of the layout part.
    During a CUDA-graph capture the tables must already be cached (a capture cannot copy from the
    host), and they are kept alive for the graph being captured."""
    device = grads[0].device
    numels = tuple(g.numel() for g in grads)
    ptrs = tuple(g.data_ptr() for g in grads)
    key = (device, ptrs, numels, tuple(bbases))
    capturing = cuda_graph.is_capturing(device)
    hit = _TABLES.get(key)
    if hit is not None:
        _TABLES.move_to_end(key)
        if capturing:  # the graph keeps reading these tables by address
            cuda_graph.keep_alive(hit)
        return hit
    if capturing:
        raise RuntimeError(
            "aegis flood_: this set of gradients was not seen before the CUDA-graph capture; run one "
            "eager (warm-up) step first so the grouped launch tables are cached"
        )
    layout = group_layout(device, grads[0].element_size(), numels, bbases, cfg)
    addresses, a_host = _pinned_to(list(ptrs), torch.int64, device)
    meta = torch.cat([addresses, layout.static])
    entry = GroupTables(meta, layout.tile_tensor, layout.first, layout.chunks, (a_host, layout.hosts))
    _TABLES[key] = entry
    while len(_TABLES) > CACHE_MAX:
        _TABLES.popitem(last=False)
    return entry


def addressed_tables(device: torch.device, itemsize: int, numels: tuple, bbases,
                     cfg: LaunchConfig = PROCESS) -> GroupTables:
    """Tables of their own, in no cache, whose address part (``meta[:T]``, zero here) the caller writes on the
    device before each launch: a captured CUDA graph that writes it first floods tensors that moved."""
    layout = group_layout(device, itemsize, numels, bbases, cfg)
    meta = torch.cat([torch.zeros(len(numels), dtype=torch.int64, device=device), layout.static])
    return GroupTables(meta, layout.tile_tensor, layout.first, layout.chunks, layout.hosts)


def clear_caches() -> None:
    """Forget every cached table and layout (tables a captured graph still reads stay alive with it)."""
    _TABLES.clear()
    _LAYOUTS.clear()
