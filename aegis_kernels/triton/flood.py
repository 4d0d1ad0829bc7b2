"""The floods as callable functions (what ``aegis_kernels.ops`` registers for CUDA): ``flood``,
``flood_`` and ``flood_keyed_``. They check their arguments, pick the kernels for the device
(launch.backend) and hand each tensor to the rows or matrix launchers. ``norms``: the per-tensor norms
of many gradients from one address table (the shield's checksum of what it flooded)."""
from __future__ import annotations

import torch
from torch import Tensor

from .. import cuda_graph
from .. import reference as ref
from .launch import INTERPRETED, ChainStep, GroupStep, RowsStep, backend, flood_plan, on_device
from .matrix import flood_matrix, flood_matrix_chain, flood_matrix_grouped, grouped_norms
from .rows import flood_rows
from .stream import derive_key, device_key


def flood(grad: Tensor, mode: str, params: Tensor, key: Tensor, offset: int = 0):
    """Functional flood -> (out, stats)."""
    ref.check_grad(grad, mode)
    ref.check_offset(offset)
    g = grad.contiguous()  # non-contiguous input: one copy, then the contiguous kernels
    params = ref.as_params(params, g.device).contiguous()
    key = device_key(key, g.device)
    out = torch.empty_like(g, memory_format=torch.contiguous_format)
    K = backend(g.device)
    with on_device(g.device):
        if mode == "rows":
            stats = flood_rows(K, g, out, params, key, offset // ref.BLOCK_WORDS)
        else:
            stats = flood_matrix(K, g.view(-1), out.view(-1), params, key, offset // ref.BLOCK_WORDS)
    return out, stats


def flood_(grads: list[Tensor], modes, params: Tensor, key: Tensor, *, grouped: bool | None = None) -> None:
    """In-place flood of many tensors under one key; tensor k at ref.stream_offsets(...)[k].

    ``params``: float32 (T, 4) device table (rho, sigma, clip, thr); ``key``: 8 int64 words on the
    device (a captured graph reads both by address). Matrix-mode tensors of one (device, dtype,
    alignment) are flooded from one address table in a few pipelined launches (CUDA only: the
    interpreter cannot load through the table); ``grouped=False`` pipelines them tensor by tensor
    with the same kernels. Rows-mode tensors get their own launches each. The validated launch
    plan is cached per set of tensors (launch.flood_plan), so a training loop pays the Python work once.
    """
    modes = modes if isinstance(modes, str) else ",".join(modes)
    plan = flood_plan(grads, modes, grouped)
    ref.check_params_table(params, len(grads))
    copies = {i: grads[i].contiguous() for i in plan.copies}  # non-contiguous: flood a copy
    work = [copies.get(i, g) for i, g in enumerate(grads)]
    on: dict[torch.device, tuple] = {}  # per device: kernels, key, parameter table
    for step in plan.steps:
        device = step.device
        if device not in on:
            on[device] = (backend(device), device_key(key, device), params.to(device, non_blocking=True))
        K, dkey, dparams = on[device]
        with on_device(device):
            if type(step) is RowsStep:
                i = step.tensor
                flood_rows(K, work[i], work[i], dparams[i], dkey, step.bbase, keep_stats=False)
            elif type(step) is GroupStep:
                if cuda_graph.is_capturing(device):  # the graph reads the cached index by address
                    cuda_graph.keep_alive(step.index_tensor)
                flood_matrix_grouped(K, [work[i] for i in step.indices], dparams.index_select(0, step.index_tensor),
                                     step.bbases, dkey, step.vec)
            else:
                assert type(step) is ChainStep
                flood_matrix_chain(K, [work[i].view(-1) for i in step.indices], [dparams[i] for i in step.indices],
                                   step.bbases, dkey)
    for i, c in copies.items():
        grads[i].copy_(c)


def flood_keyed_(grads: list[Tensor], modes, params: Tensor, state: Tensor, *, grouped: bool | None = None) -> None:
    """flood_ with the step key derived on the device from state = [master, step]; step += 1."""
    flood_(grads, modes, params, derive_key(state), grouped=grouped)


def norms(tensors: list[Tensor]) -> Tensor | None:
    """Per-tensor fp32 L2 norms (NaN for a non-finite tensor) of contiguous same-dtype CUDA tensors of one
    device, in two launches from one address table; None where that does not apply (other devices, mixed
    dtypes, a non-contiguous tensor, the interpreter, a CUDA-graph capture): use ``torch._foreach_norm``."""
    if not tensors or INTERPRETED:
        return None
    first = tensors[0]
    device, dtype = first.device, first.dtype
    if device.type != "cuda" or cuda_graph.is_capturing(device):
        return None
    vec = True
    for t in tensors:
        if t.device != device or t.dtype != dtype or not t.is_contiguous():
            return None
        vec = vec and t.data_ptr() % 16 == 0 and t.numel() % 16 == 0
    if sum(t.numel() for t in tensors) == 0:
        return None
    with on_device(device):
        return grouped_norms(backend(device), tensors, vec)
