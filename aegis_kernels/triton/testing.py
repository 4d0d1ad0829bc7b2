"""Kernel-level helpers for tests and benchmarks only (no op uses them): the raw keystream words of
chosen block counters, and the two summands of each element's normal."""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .. import reference as ref
from .launch import backend, cdiv, on_device
from .stream import chacha, device_key, join8, launch_noise, load_key, noise


@triton.jit(do_not_specialize=["domain"])
def keystream_kernel(blocks_ptr, out_ptr, n, key_ptr, domain, BLOCK: tl.constexpr):
    """Raw ChaCha words of n int64 block counters: out[i, w] (int64 holding uint32), for exactness tests."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    k0, k1, k2, k3, k4, k5, k6, k7 = load_key(key_ptr)
    bu = tl.load(blocks_ptr + offs, mask=m, other=0).to(tl.uint64, bitcast=True)
    x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15 = chacha(
        k0, k1, k2, k3, k4, k5, k6, k7, bu.to(tl.uint32), (bu >> 32).to(tl.uint32), domain.to(tl.uint32))
    w = tl.join(join8(x0, x2, x4, x6, x8, x10, x12, x14), join8(x1, x3, x5, x7, x9, x11, x13, x15))
    w = tl.reshape(w, [BLOCK, 16])
    tl.store(out_ptr + 16 * offs[:, None] + tl.arange(0, 16)[None, :], w.to(tl.int64), mask=m[:, None])


def keystream(key: Tensor, blocks: Tensor, domain: int = ref.NOISE_DOMAIN) -> Tensor:
    """ChaCha words (n, 16) (int64 holding uint32) of int64 block counters, as reference.keystream."""
    b = blocks.to(torch.int64).contiguous()
    out = torch.empty(b.numel(), 16, dtype=torch.int64, device=b.device)
    n = b.numel()
    if n:
        kernels = backend(b.device).module("testing")
        with on_device(b.device):
            kernels.keystream_kernel[(cdiv(n, 256),)](b, out, n, device_key(key, b.device), domain, BLOCK=256)
    return out


def noise_parts(shape, key: Tensor, offset: int = 0, dtype: torch.dtype = torch.float32, device=None):
    """The exact normals a flood with output ``dtype`` uses: (z, None) for bf16, the two summands
    (z_a, z_b) for fp16 / fp32 (reference.flood(..., z=z_a, zb=z_b) is then the kernels' flood)."""
    if ref.words_per_element(dtype) == 1:
        return noise(shape, key, offset, dtype, device), None
    return launch_noise(shape, key, offset, dtype, device, parts=True)
