"""``flood_keyed_`` and the norms of what it flooded, every tensor's address read from one device table.

The shield's flood as one CUDA graph that replays over gradients that moved: ``zero_grad(set_to_none=True)``
gives each step new gradient tensors, and a graph captured with pointer arguments would flood the old ones.
Here every launch reads its tensors' addresses from ``inputs`` = int64 [master key x 8, step, address x T]
on the device, which the host rewrites before each replay (``aegis_kernels.cuda_graph.GraphedFlood``):

- rows floods: the one-pass kernels with ``ADDR`` (``rows.flood_rows_at``);
- matrix floods: the grouped launches, from tables of their own whose address part is gathered from
  ``inputs`` on the device first (``tables.addressed_tables``);
- the checksum: ``grouped_norms`` over every tensor, from a table filled the same way.

The tiles, keystream offsets and reduction order are those of ``flood_keyed_`` and ``norms``, so a launch
gives the bits they give. CUDA only: the interpreter cannot load through a table.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .. import reference as ref
from .launch import INTERPRETED, ChainStep, GroupStep, RowsStep, backend, flood_plan, on_device
from .matrix import flood_matrix_grouped, grouped_norms
from .rows import flood_rows_at, rows_onepass
from .stream import derive_key
from .tables import GroupTables, addressed_tables

STATE = ref.KEY_WORDS + 1  # inputs[:STATE] = [master key x 8, step]


def unaddressable(tensors: list[Tensor], modes: str) -> str | None:
    """Why ``tensors`` cannot be flooded from an address table, or None. Needs: one CUDA device and dtype,
    contiguous 16-byte aligned tensors, rows floods of long rows (the one-pass kernels), matrix floods
    grouped."""
    if not tensors:
        return "no tensors"
    first = tensors[0]
    if first.device.type != "cuda" or INTERPRETED:
        return "not on a CUDA device"
    if any(t.device != first.device or t.dtype != first.dtype for t in tensors):
        return "mixed devices or dtypes"
    if any(not t.is_contiguous() or t.data_ptr() % 16 for t in tensors):
        return "a non-contiguous or unaligned tensor"
    K = backend(first.device)
    for step in flood_plan(tensors, modes, None).steps:
        if type(step) is ChainStep:
            return "matrix floods that are not grouped"
        if type(step) is RowsStep:
            V, D = tensors[step.tensor].shape
            if not rows_onepass(K, V, D, first.dtype):
                return f"a rows flood of short rows ({V} x {D})"
    return None


class AddressedFlood:
    """The launches of one layout of tensors (shapes, dtype, modes) and one parameter table, reading the
    tensors' addresses and the key state from ``inputs``. Build it from the tensors of one step
    (``unaddressable`` must be None); ``launch()`` floods whatever tensors ``inputs`` then points at."""

    def __init__(self, tensors: list[Tensor], modes: str, params: Tensor, inputs: Tensor):
        why = unaddressable(tensors, modes)
        if why is not None:
            raise ValueError(f"AddressedFlood: {why}")
        ref.check_params_table(params, len(tensors))
        if inputs.dtype != torch.int64 or inputs.shape != (STATE + len(tensors),) or inputs.device != tensors[0].device:
            raise ValueError(f"inputs must be int64 [{STATE + len(tensors)}] on {tensors[0].device}")
        first = tensors[0]
        self.device, self.params, self.inputs = first.device, params, inputs
        self.like = torch.empty(16, dtype=first.dtype, device=self.device)  # the kernels' pointer type only
        self.size = len(tensors)
        itemsize = first.element_size()
        self.rows: list[tuple[int, tuple[int, int], int]] = []  # (slot, (V, D), keystream block)
        self.groups: list[tuple[Tensor, list[int], bool, GroupTables]] = []  # (index, bbases, vec, tables)
        for step in flood_plan(tensors, modes, None).steps:
            if type(step) is RowsStep:
                V, D = tensors[step.tensor].shape
                self.rows.append((step.tensor, (V, D), step.bbase))
            else:
                assert type(step) is GroupStep
                numels = tuple(tensors[i].numel() for i in step.indices)
                tables = addressed_tables(self.device, itemsize, numels, step.bbases)
                self.groups.append((step.index_tensor, step.bbases, step.vec, tables))
        numels = tuple(t.numel() for t in tensors)
        self.norm_tables = addressed_tables(self.device, itemsize, numels, [0] * len(tensors))
        self.norm_vec = all(n % 16 == 0 for n in numels)  # as ``norms``: every tensor is aligned here

    def launch(self) -> Tensor:
        """Flood in place under derive_key(master, step) (step += 1 on the device); the per-tensor fp32 norms
        of the flooded tensors (NaN for a non-finite one), in a buffer the next launch reuses."""
        K = backend(self.device)
        with on_device(self.device):
            key = derive_key(self.inputs[:STATE])
            addresses = self.inputs[STATE:]
            for slot, shape, bbase in self.rows:
                flood_rows_at(K, shape, self.like, addresses, slot, self.params[slot], key, bbase)
            for index, bbases, vec, tables in self.groups:
                torch.index_select(addresses, 0, index, out=tables.meta[: len(bbases)])
                flood_matrix_grouped(K, [self.like], self.params.index_select(0, index), bbases, key, vec, tables)
            self.norm_tables.meta[: self.size].copy_(addresses)
            return grouped_norms(K, [self.like], self.norm_vec, self.norm_tables)
