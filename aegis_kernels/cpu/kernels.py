"""numba kernels of the CPU flood (aegis_kernels.cpu.flood drives them; aegis_kernels.reference is the spec).

The loops run over consecutive blocks or elements with straight-line bodies and one array per
stream, which is what lets LLVM vectorise them (a loop that stores into many rows of one 2-D
array, or indexes a tuple by a loop variable, stays scalar). numba widens integer arithmetic to
64 bits; the cipher's additions and rotations are two small LLVM intrinsics on uint32 instead, so
its lanes stay 32-bit (16 blocks per AVX-512 register).

Every float step is the reference's, in the same precision and order: fp32 operations stay fp32
(numba computes float32 op float32 in float32), nothing is contracted into an FMA (numba allows
it only with fastmath), and the fused multiply-adds go through fp64 as reference.fma does.
log, cos, sin and sqrt are not here: the driver takes them from torch, the functions the reference
calls (torch's fp32 sqrt is not the correctly rounded one), so the exported values match it bit for bit.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from .. import reference as ref

C0, C1, C2, C3 = (np.uint32(c) for c in ref.SIGMA_CONSTANTS)
LOW31 = np.uint32(0x7FFFFFFF)
SIGN = np.uint32(0x80000000)
WORD_SCALE = np.float32(2.0**-32)
WORD_HALF = np.float32(2.0**-33)
ONE = np.float32(1.0)
HALF = np.float32(0.5)
TWO = np.float32(2.0)
ANGLE_STEP = np.float32(ref.ANGLE_STEP)
ANGLE_HALF = np.float32(ref.ANGLE_STEP / 2)
RADIUS_SERIES = np.float32(ref.RADIUS_SERIES)
PAIRS = ref.BLOCK_WORDS // 2  # Box-Muller pairs per block
assert ref.ROUNDS == 8, "_block writes out ChaCha8's four double rounds"

_inline = njit(nogil=True, cache=True, inline="always")
_kernel = njit(nogil=True, cache=True)


# ----------------------------------------------------------------------------- ChaCha8
# numba's stub types a call of an @intrinsic with its typing function's signature (typingctx first)
# and as returning Never, which would hide the rest of each jitted function from mypy; jitted code
# calls it without typingctx, so the two intrinsics are bound under that call signature.
def _add32_typing(typingctx, a, b):
    """a + b mod 2^32 on uint32 (numba's own + widens to 64 bits, halving the vector lanes)."""

    def codegen(context, builder, signature, args):
        return builder.add(args[0], args[1])

    return types.uint32(types.uint32, types.uint32), codegen


_add32 = cast(Callable[[Any, Any], Any], intrinsic(_add32_typing))


def _xor_rotl32_typing(typingctx, a, b, n):
    """rotl(a ^ b, n) on uint32: LLVM's funnel shift, one vprold on AVX-512."""

    def codegen(context, builder, signature, args):
        i32 = ir.IntType(32)
        x = builder.xor(args[0], args[1])
        fshl = builder.module.declare_intrinsic("llvm.fshl", [i32], ir.FunctionType(i32, [i32, i32, i32]))
        return builder.call(fshl, [x, x, builder.trunc(args[2], i32)])

    return types.uint32(types.uint32, types.uint32, types.intp), codegen


_xor_rotl32 = cast(Callable[[Any, Any, Any], Any], intrinsic(_xor_rotl32_typing))


@_inline
def _quarter(a, b, c, d):
    a = _add32(a, b)
    d = _xor_rotl32(d, a, 16)
    c = _add32(c, d)
    b = _xor_rotl32(b, c, 12)
    a = _add32(a, b)
    d = _xor_rotl32(d, a, 8)
    c = _add32(c, d)
    b = _xor_rotl32(b, c, 7)
    return a, b, c, d


@_inline
def _double_round(x):
    x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15 = x
    x0, x4, x8, x12 = _quarter(x0, x4, x8, x12)
    x1, x5, x9, x13 = _quarter(x1, x5, x9, x13)
    x2, x6, x10, x14 = _quarter(x2, x6, x10, x14)
    x3, x7, x11, x15 = _quarter(x3, x7, x11, x15)
    x0, x5, x10, x15 = _quarter(x0, x5, x10, x15)
    x1, x6, x11, x12 = _quarter(x1, x6, x11, x12)
    x2, x7, x8, x13 = _quarter(x2, x7, x8, x13)
    x3, x4, x9, x14 = _quarter(x3, x4, x9, x14)
    return x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15


@_kernel
def words(key, block0, domain, w):
    """w[j, i] = word j of the block with 64-bit counter ``block0 + i`` (reference.keystream), ``key``
    the 8 words (uint32 array), ``w`` a C-contiguous (16, n) uint32 array."""
    k0, k1, k2, k3, k4, k5, k6, k7 = key[0], key[1], key[2], key[3], key[4], key[5], key[6], key[7]
    dom, zero = np.uint32(domain), np.uint32(0)
    w0, w1, w2, w3, w4, w5, w6, w7 = w[0], w[1], w[2], w[3], w[4], w[5], w[6], w[7]
    w8, w9, w10, w11, w12, w13, w14, w15 = w[8], w[9], w[10], w[11], w[12], w[13], w[14], w[15]
    for i in range(w.shape[1]):
        counter = np.uint64(block0) + np.uint64(i)
        lo, hi = np.uint32(counter & np.uint64(0xFFFFFFFF)), np.uint32(counter >> np.uint64(32))
        x = (C0, C1, C2, C3, k0, k1, k2, k3, k4, k5, k6, k7, lo, hi, dom, zero)
        x = _double_round(x)  # ROUNDS = 8, written out: the loop over blocks stays the innermost
        x = _double_round(x)
        x = _double_round(x)
        x = _double_round(x)
        w0[i], w1[i], w2[i], w3[i] = _add32(x[0], C0), _add32(x[1], C1), _add32(x[2], C2), _add32(x[3], C3)
        w4[i], w5[i], w6[i], w7[i] = _add32(x[4], k0), _add32(x[5], k1), _add32(x[6], k2), _add32(x[7], k3)
        w8[i], w9[i], w10[i], w11[i] = _add32(x[8], k4), _add32(x[9], k5), _add32(x[10], k6), _add32(x[11], k7)
        w12[i], w13[i], w14[i], w15[i] = _add32(x[12], lo), _add32(x[13], hi), _add32(x[14], dom), x[15]


# ----------------------------------------------------------------------------- Box-Muller
@_kernel
def operands(w, x, theta, sv):
    """Pair j = words (2j, 2j + 1) of each block (reference.normal_pair up to log / cos / sin):
    x[j] = the log's argument (v, or 1 - v), theta[j] the angle, sv[j] = v with the radius branch as
    its sign (> 0: the 1 - v branch, where the series replaces the log below 2^-10)."""
    for j in range(PAIRS):
        a_, b_, x_, t_, s_ = w[2 * j], w[2 * j + 1], x[j], theta[j], sv[j]
        for i in range(a_.shape[0]):
            a, b = a_[i], b_[i]
            v = np.float32(a & LOW31) * WORD_SCALE + WORD_HALF
            tail = a >= SIGN
            x_[i] = v if tail else ONE - v
            s_[i] = -v if tail else v
            t_[i] = np.float32(np.int32(b)) * ANGLE_STEP + ANGLE_HALF


@_kernel
def radius_square(logx, sv):
    """In place: log(x) -> 2 t, t = -log(x), or v (1 + v / 2) on the series branch (r = sqrt of it)."""
    for i in range(logx.shape[0]):
        t = -logx[i]
        s = sv[i]
        if s > 0 and s < RADIUS_SERIES:
            t = s * (ONE + s * HALF)
        logx[i] = TWO * t


@_kernel
def polar(r, cos, sin):
    """In place: cos -> r cos, sin -> r sin (the pair's two normals)."""
    for i in range(r.shape[0]):
        cos[i] = r[i] * cos[i]
        sin[i] = r[i] * sin[i]


# ----------------------------------------------------------------------------- the flood
@_kernel
def signal(sig, g, first, scale, d):
    """sig[e] = scale[row] g[e], row = (first + e) // d (reference: scale[:, None] * g, or scale * g
    with d = numel). Returns 1 if any g[e] is not finite (the flood then fails closed), else 0."""
    bad = 0
    pos, end = first, first + g.shape[0]
    while pos < end:
        row = pos // d
        stop = min(end, (row + 1) * d)
        sc = scale[row]
        for e in range(pos - first, stop - first):
            x = g[e]
            bad |= (x - x) != 0
            sig[e] = sc * x
        pos = stop
    return bad


@_inline
def _fma(wd, z, s):
    """reference.fma: fp32(fp64 w * fp64 z + fp64 s), the product exact in fp64."""
    return np.float32(wd * np.float64(z) + np.float64(s))


@_inline
def _summands(z0, z1, e, per):
    """Element e of a chunk (block-major): its normal (per 1), or its two summands (per 2)."""
    i, q = divmod(e, 16 // per)
    if per == 1:
        j, c = divmod(q, 2)
        return (z0[j, i] if c == 0 else z1[j, i]), np.float32(0)
    m, c = divmod(q, 2)
    if c == 0:
        return z0[2 * m, i], z0[2 * m + 1, i]
    return z1[2 * m, i], z1[2 * m + 1, i]


@_kernel
def add_noise(out, sig, z0, z1, w, per):
    """out[e] = reference.add_noise(sig[e], ...) for the chunk's elements: per 1 fma(w, z, s) with w = sigma,
    z = component c of pair j for element 16 i + 2 j + c; per 2 fma(w, za, fma(w, zb, s)) with
    w = fp32(sigma / sqrt 2), za / zb = component c of pairs 2 m / 2 m + 1 for element 8 i + 2 m + c.
    z0 / z1 are the pairs' (8, blocks) cos / sin components."""
    wd = np.float64(w)
    n = out.shape[0]
    per_block = 16 // per
    full = n // per_block
    if per == 1:
        for i in range(full):
            for j in range(PAIRS):
                e = 16 * i + 2 * j
                out[e] = _fma(wd, z0[j, i], sig[e])
                out[e + 1] = _fma(wd, z1[j, i], sig[e + 1])
    else:
        for i in range(full):
            for m in range(PAIRS // 2):
                e = 8 * i + 2 * m
                out[e] = _fma(wd, z0[2 * m, i], _fma(wd, z0[2 * m + 1, i], sig[e]))
                out[e + 1] = _fma(wd, z1[2 * m, i], _fma(wd, z1[2 * m + 1, i], sig[e + 1]))
    for e in range(full * per_block, n):  # a last, partial block
        za, zb = _summands(z0, z1, e, per)
        out[e] = _fma(wd, za, sig[e]) if per == 1 else _fma(wd, za, _fma(wd, zb, sig[e]))
