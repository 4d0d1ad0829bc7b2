"""The noise stream on the GPU: ChaCha8 keystream words and Box-Muller normals (docs/design.md §1.2).

``@triton.jit`` helpers the flood kernels call, plus the kernels that expose the stream on its own:
``noise_kernel`` (the exact Z a flood adds, for ``torch.ops.aegis.noise``) and ``derive_key_kernel``
(the per-step key of a CUDA-graph-replayed flood). Judged against ``aegis_kernels.reference``: the
same keystream words bit for bit, the same normals up to the last ulp of log / sqrt.

On the GPU, log / sin / cos are the hardware approximations (MUFU lg2, sin, cos: absolute error
~2^-21): the same words and formulas as the reference, each normal within ~1e-6 of it. Any
fp32-level structure they add to a pair is far below bf16's rounding, and the sum of two pairs
(fp16 / fp32 outputs) convolves it away. The launch configuration's ``fast_math`` picks them.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .. import reference as ref
from .interpret import INTERPRETED, SOFT_BF16, SOFT_FMA
from .launch import backend, cdiv, on_device

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
def chacha(k0, k1, k2, k3, k4, k5, k6, k7, lo, hi, domain):
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
def load_key(key_ptr):
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
def normal_pair(a, b, FAST: tl.constexpr):
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
def _join4(a, b, c, d):
    """Four [...] tensors -> [..., 4] in order a, b, c, d (a join's outer index is the fastest)."""
    return tl.join(tl.join(a, c), tl.join(b, d))


@triton.jit
def join8(z0, z1, z2, z3, z4, z5, z6, z7):
    """Eight [...] tensors -> [..., 8] in order z0, ..., z7."""
    t = tl.join(_join4(z0, z2, z4, z6), _join4(z1, z3, z5, z7))
    return tl.reshape(t, t.shape[:-3] + [8])


@triton.jit
def _lanes_of_block(x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15,
                    PER: tl.constexpr, FAST: tl.constexpr):
    """The normals of a block's 16 words, element order: PER 1 -> (z, z) [..., 16]; PER 2 -> the two
    summands (z_a, z_b) [..., 8] of each element (reference._element_normals)."""
    a0, a1 = normal_pair(x0, x1, FAST)
    b0, b1 = normal_pair(x2, x3, FAST)
    c0, c1 = normal_pair(x4, x5, FAST)
    d0, d1 = normal_pair(x6, x7, FAST)
    e0, e1 = normal_pair(x8, x9, FAST)
    f0, f1 = normal_pair(x10, x11, FAST)
    g0, g1 = normal_pair(x12, x13, FAST)
    h0, h1 = normal_pair(x14, x15, FAST)
    if PER == 1:
        t = tl.join(join8(a0, b0, c0, d0, e0, f0, g0, h0), join8(a1, b1, c1, d1, e1, f1, g1, h1))
        z = tl.reshape(t, t.shape[:-2] + [16])  # [..., 8, 2]: element 2i + j at [i, j]
        return z, z
    else:
        return join8(a0, a1, c0, c1, e0, e1, g0, g1), join8(b0, b1, d0, d1, f0, f1, h0, h1)


@triton.jit
def _fma(x, y, z):
    if SOFT_FMA:
        return (x.to(tl.float64) * y.to(tl.float64) + z.to(tl.float64)).to(tl.float32)
    else:
        return tl.fma(x, y, z)


@triton.jit
def noise_only(sigma, za, zb, PER: tl.constexpr):
    """add_noise with a zero signal, bit for bit (fma(x, y, +0) rounds as x * y)."""
    if PER == 1:
        return sigma * za
    else:
        w = sigma * INV_SQRT2
        return _fma(w, za, w * zb)


@triton.jit
def add_noise(signal, sigma, za, zb, PER: tl.constexpr):
    """signal + sigma Z as fused multiply-adds (reference.add_noise): a product sigma Z rounded on
    its own takes only the values of a multiple of sigma, which signal-carrying elements leave."""
    if PER == 1:
        return _fma(sigma, za, signal)
    else:
        w = sigma * INV_SQRT2
        return _fma(w, za, _fma(w, zb, signal))


@triton.jit
def block_normals(k0, k1, k2, k3, k4, k5, k6, k7, blocks, PER: tl.constexpr, FAST: tl.constexpr):
    """The normals (z_a, z_b) of int64 block counters of any shape: [..., 16 / PER], element order."""
    bu = blocks.to(tl.uint64, bitcast=True)
    x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15 = chacha(
        k0, k1, k2, k3, k4, k5, k6, k7, bu.to(tl.uint32), (bu >> 32).to(tl.uint32), tl.full([], 0, tl.uint32))
    return _lanes_of_block(x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15, PER, FAST)


@triton.jit
def noise_tile(k0, k1, k2, k3, k4, k5, k6, k7, b_start, Q: tl.constexpr, PER: tl.constexpr, FAST: tl.constexpr):
    """The normals (z_a, z_b) as [Q, 16 / PER] of the Q consecutive blocks from b_start (int64 scalar).

    When no low counter word of the tile wraps, the high word is the tile's scalar, and so is most of
    ChaCha's first round. Same words either way."""
    bu = b_start.to(tl.uint64, bitcast=True)
    lo0 = bu.to(tl.uint32)
    if lo0 <= 0xFFFFFFFF - (Q - 1):
        lo = lo0 + tl.arange(0, Q).to(tl.uint32)
        x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15 = chacha(
            k0, k1, k2, k3, k4, k5, k6, k7, lo, (bu >> 32).to(tl.uint32), tl.full([], 0, tl.uint32))
        za, zb = _lanes_of_block(x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15, PER, FAST)
    else:
        za, zb = block_normals(k0, k1, k2, k3, k4, k5, k6, k7, b_start + tl.arange(0, Q), PER, FAST)
    return za, zb


@triton.jit
def tile_lanes(Q: tl.constexpr, L: tl.constexpr):
    """[Q, L] element offsets L q + l of a flat block-aligned tile."""
    return L * tl.arange(0, Q)[:, None] + tl.arange(0, L)[None, :]


@triton.jit
def to_out(x, out_ptr):
    """fp32 -> the output dtype, rounding to nearest even."""
    if SOFT_BF16 and out_ptr.dtype.element_ty == tl.bfloat16:
        b = x.to(tl.uint32, bitcast=True)
        r = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
        r = tl.where(x != x, 0x7FC0, r)  # keep NaN a NaN
        return r.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(out_ptr.dtype.element_ty)


# ----------------------------------------------------------------------------- kernels
@triton.jit(do_not_specialize=["bbase"])
def noise_kernel(out_ptr, out_b_ptr, n, key_ptr, bbase, Q: tl.constexpr, PER: tl.constexpr, FAST: tl.constexpr,
                 PARTS: tl.constexpr):
    """Z (PARTS False), or the summands z_a, z_b of each element (PARTS, PER 2) into out, out_b."""
    L: tl.constexpr = 16 // PER
    start = tl.program_id(0).to(tl.int64) * (Q * L)
    k0, k1, k2, k3, k4, k5, k6, k7 = load_key(key_ptr)
    za, zb = noise_tile(k0, k1, k2, k3, k4, k5, k6, k7, bbase + start // L, Q, PER, FAST)
    offs = tile_lanes(Q, L)
    m = offs < n - start
    if PARTS:
        tl.store(out_ptr + start + offs, za, mask=m)
        tl.store(out_b_ptr + start + offs, zb, mask=m)
    else:
        tl.store(out_ptr + start + offs, noise_only(1.0, za, zb, PER), mask=m)


@triton.jit
def derive_key_kernel(state_ptr, key_out_ptr):
    """key = reference.derive_key(master, step) for state = [master words x 8, step]; then step += 1."""
    k0, k1, k2, k3, k4, k5, k6, k7 = load_key(state_ptr)
    step = tl.load(state_ptr + 8)
    su = step.to(tl.uint64, bitcast=True)
    lo = su.to(tl.uint32) + tl.zeros([2], tl.uint32)
    x0, x1, x2, x3, x4, x5, x6, x7, _, _, _, _, _, _, _, _ = chacha(
        k0, k1, k2, k3, k4, k5, k6, k7, lo, (su >> 32).to(tl.uint32), tl.full([], DERIVE_DOMAIN, tl.uint32))
    w = join8(x0, x1, x2, x3, x4, x5, x6, x7)  # [2, 8], both rows equal
    offs = tl.arange(0, 2)[:, None] * 0 + tl.arange(0, 8)[None, :]
    tl.store(key_out_ptr + offs, w.to(tl.int64), mask=tl.arange(0, 2)[:, None] == 0)
    tl.store(state_ptr + 8, step + 1)


# ----------------------------------------------------------------------------- launchers
def device_key(key: Tensor, device: torch.device) -> Tensor:
    """The checked key as a contiguous tensor on ``device`` (no copy when it is already there)."""
    ref.check_key(key)
    return key.to(device, non_blocking=True).contiguous()


def launch_noise(shape, key: Tensor, offset: int, dtype: torch.dtype, device, parts: bool):
    """(Z, None), or the two summands (z_a, z_b) with ``parts`` (fp16 / fp32 outputs only)."""
    ref.check_offset(offset)
    device = torch.device("cpu" if device is None else device)
    key = device_key(key, device)
    out = torch.empty(tuple(int(s) for s in shape), dtype=torch.float32, device=device)
    out_b = torch.empty_like(out) if parts else out
    n = out.numel()
    if n:
        K = backend(device)
        per = ref.words_per_element(dtype)
        q = K.config.noise_block * per // ref.BLOCK_WORDS
        with on_device(device):
            K.stream.noise_kernel[(cdiv(n, q * ref.BLOCK_WORDS // per),)](
                out, out_b, n, key, offset // ref.BLOCK_WORDS, Q=q, PER=per, FAST=K.config.fast_math, PARTS=parts,
                num_warps=4,
            )
    return out, (out_b if parts else None)


def noise(shape, key: Tensor, offset: int = 0, dtype: torch.dtype = torch.float32, device=None) -> Tensor:
    """The Z (fp32) that a flood with output ``dtype`` adds, from the (key, offset) stream."""
    return launch_noise(shape, key, offset, dtype, device, parts=False)[0]


def check_state(state: Tensor) -> None:
    if state.dtype != torch.int64 or state.shape != (ref.KEY_WORDS + 1,) or not state.is_contiguous():
        raise ValueError(
            f"state must be a contiguous int64 tensor [master key words x {ref.KEY_WORDS}, step], "
            f"got {state.dtype} {tuple(state.shape)}"
        )


def derive_key(state: Tensor) -> Tensor:
    """key = reference.derive_key(master, step) on the device (8 int64 words), and step += 1."""
    check_state(state)
    key = torch.empty(ref.KEY_WORDS, dtype=torch.int64, device=state.device)
    K = backend(state.device)
    with on_device(state.device):
        K.stream.derive_key_kernel[(1,)](state, key)
    return key
