"""Fused Triton kernels (aegis_kernels.triton) against the PyTorch reference.

CPU (default selection): the launchers run CPU tensors through the Triton interpreter (a copy of the
kernel module made under TRITON_INTERPRET=1), so these tests run the real kernels. Keystream words
and step keys must be the reference's bit for bit; the noise within 1e-6 (the interpreter's numpy
log against torch's); a flood must be ``s G + sigma Z`` with the kernel's own row / matrix scale s
and its own noise Z: exact for 16-bit outputs, within fp32 rounding for fp32 (the kernel folds sigma
into the 1/sqrt 2 of a sum of two normals), and the reference flood on that Z within fp32 rounding
(16-bit: exact or one ulp).

GPU (``-m gpu``): the same comparisons on CUDA at realistic sizes, where the log is the hardware lg2
(noise within 2e-6 of the reference) and the compiler may fuse multiply-adds; plus the grouped
launch (address tables) against the per-tensor one bit for bit, opcheck / torch.compile on CUDA,
and CUDA-graph capture of flood_keyed_ replaying with a fresh key every replay.
"""
from __future__ import annotations

import copy
import math
import os
import types

import pytest
import torch

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

import aegis_kernels  # noqa: E402  (registers the CUDA kernels)
from aegis_kernels import reference as ref  # noqa: E402
from aegis_kernels import triton as TF  # noqa: E402
from aegis_kernels.triton import interpret, stream, tables  # noqa: E402
from aegis_kernels.triton import testing as TT  # noqa: E402

CPU = torch.device("cpu")
U32 = 2.0**-24  # unit roundoff of fp32
TINY = torch.finfo(torch.float32).tiny
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
KEY = aegis_kernels.key_from_int(0xB7E151628AED2A6ABF7158809CF4F3C762E7160F38B4DA56A784D9045190CFEF)
HAS_CUDA = torch.cuda.is_available()
gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")


# ----------------------------------------------------------------------------- helpers
def _grad(shape, dtype=torch.float32, device=CPU, seed=0, mode="rows", exact=True):
    """Test gradients. Rows (2-D, several rows): every third row far below 1% of the largest (outside
    S at thr = 1% of the max), the others of very different norms (some above the clip, some below).

    exact=True: small integers times a power of two per row (rows mode) or one power of two for the
    whole tensor (matrix mode), so every sum of squares is exact in fp32 in any order: the kernels'
    norms then equal torch's bit for bit and so do the scales rho min(1, clip / n). exact=False:
    log-normal fp32 data, norms equal to rounding only."""
    gen = torch.Generator().manual_seed(seed)
    rows = len(shape) == 2 and shape[0] > 1
    if exact:
        n = math.prod(shape)
        top = 1 if n > (1 << 20) else 4  # 16 n (or n) < 2^24: every partial sum exact
        g = torch.randint(-top, top + 1, tuple(shape), generator=gen).float()
        if rows and mode == "rows":
            scale = 2.0 ** torch.randint(-5, 6, (shape[0], 1), generator=gen).float()
            scale[::3] = 2.0**-14
            g = g * scale
        else:
            g = g * 2.0 ** torch.randint(-5, 6, (), generator=gen).item()
    else:
        g = torch.randn(tuple(shape), generator=gen)
        if rows:
            scale = torch.exp(1.5 * torch.randn(shape[0], 1, generator=gen))
            scale[::3] = 1e-4
            g = g * scale
    return g.to(dtype).to(device)


def _params(g, mode, rho=0.3, sigma=1.5, clip_factor=0.7, thr_factor=0.01):
    """(rho, sigma, clip, thr): rows thr = thr_factor x the largest row norm, clip = clip_factor x the
    median norm of the rows above thr; matrix clip = clip_factor x ||G||_F (inf: no clip)."""
    g64 = g.detach().double().cpu()
    if mode == "rows" and g.numel():
        n = torch.linalg.vector_norm(g64, dim=1)
        thr = thr_factor * n.max().item()
        clip = clip_factor * n[n > thr].median().item() if (n > thr).any() else 1.0
    else:
        clip, thr = clip_factor * torch.linalg.vector_norm(g64).item(), 0.0
    return torch.tensor([rho, sigma, clip, thr], dtype=torch.float32, device=g.device)


def _kernel_flood(g, mode, params, key=KEY, offset=16 * 5):
    """(out, stats, the kernels' own Z for this tensor), all from the kernels on g's device."""
    out, stats = TF.flood(g, mode, params, key, offset)
    return out, stats, TT.noise_parts(g.shape, key, offset, g.dtype, device=g.device)


def _noise_term(parts, sigma=1.0, signal=None) -> torch.Tensor:
    """signal + sigma Z exactly as the kernels add it, from their own normals (reference.add_noise)."""
    za, zb = parts
    base = torch.zeros_like(za) if signal is None else signal.to(za.device, torch.float32)
    return ref.add_noise(base, torch.tensor(sigma, dtype=torch.float32, device=za.device), za, zb)


def _norm_tol(n: int) -> float:
    """Relative error bound of a fp32 norm summed in tiles and trees (depth ~ log2 n + a few) vs fp64."""
    return (math.log2(max(n, 2)) + n / 4096 + 24) * U32


def _check_flood(g, mode, params, out, stats, z, exact=True, in_place=False):
    """The flood contract on the kernels' outputs (any device), against reference.flood(G, z=z_a, zb=z_b)
    with the kernels' own normals (z, None for bf16; the two summands for fp16 / fp32):

    stats: sigma exact; rows |S| and clipped count equal; max n_v and ||G||_F exact on exact data
    (else within summation rounding of fp64); the matrix scale rho min(1, clip / ||G||_F).
    out: bf16 (one normal per element, s G + sigma Z in the reference's fp32 order) bit for bit on CPU
    exact data; fp32 / fp16 within fp32 rounding (the kernel folds sigma into the sum's 1/sqrt 2),
    then one fp16 ulp; plus the norm's rounding in s on inexact data, and the GPU's fused
    multiply-adds, approximate division and hardware log / sin / cos."""
    dev = out.device
    cuda = dev.type == "cuda"
    assert out.shape == g.shape and out.dtype == g.dtype and (in_place or out.is_contiguous())
    assert stats.device == dev and stats.dtype == torch.float32
    za, zb = z if isinstance(z, tuple) else (z, None)
    za, zb = za.cpu(), None if zb is None else zb.cpu()
    out, stats, gc, p = out.cpu(), stats.cpu(), g.cpu(), params.cpu()
    rho, sigma, clip, thr = p.tolist()
    g32, g64 = gc.float(), gc.double()
    ref_out, ref_stats = ref.flood(gc, mode, p, z=za, zb=zb)
    z = za if zb is None else (za + zb) * ref.INV_SQRT2
    assert stats[0].item() == sigma
    div_tol = 4 * U32 if cuda else 0.0  # Triton's fp32 division on the GPU is not correctly rounded
    if mode == "rows":
        assert stats.shape == (4,)
        d = g.shape[1]
        assert stats[1].item() == ref_stats[1].item() and stats[2].item() == ref_stats[2].item()
        if exact:
            assert stats[3].item() == ref_stats[3].item()
        else:
            peak = torch.linalg.vector_norm(g64, dim=1).max().item()
            assert abs(stats[3].item() - peak) <= _norm_tol(d) * peak
        n32 = torch.linalg.vector_norm(g32, dim=1)  # the reference's norms
        s = torch.where(n32 > thr, rho * torch.where(n32 > clip, clip / n32, 1.0), 0.0)[:, None]
        # the kernels' norm error (bounded above) plus the reference's own (measured against fp64)
        ref_err = ((n32.double() - torch.linalg.vector_norm(g64, dim=1)).abs() / n32.double().clamp_min(TINY))
        s_err = (0.0 if exact else _norm_tol(d) + ref_err[:, None].float()) + div_tol
    else:
        assert stats.shape == (3,)
        n = g.numel()
        norm64 = torch.linalg.vector_norm(g64).item()
        if exact:
            # exact sum of squares; sqrt correctly rounded (double then float rounding is innocuous for sqrt)
            assert stats[1].item() == ref_stats[1].item() == torch.tensor(norm64, dtype=torch.float32).item()
        else:
            assert abs(stats[1].item() - norm64) <= _norm_tol(n) * norm64
        # the kernels' norm error (bounded above) plus the reference's own: torch's fp32 norm on CPU
        # drifts with n (~1e-4 relative at 4M elements), measured here against fp64
        ref_err = abs(ref_stats[1].item() - norm64) / max(norm64, TINY)
        s_err = (0.0 if exact else _norm_tol(n) + ref_err) + div_tol
        assert abs(stats[2].item() - ref_stats[2].item()) <= s_err * ref_stats[2].item()
        s = ref_stats[2]
    # the noise's rounding scales with each summand (z_a, z_b may nearly cancel)
    sz = (p[1] * z).abs() if zb is None else p[1].abs() * (za.abs() + zb.abs()) * ref.INV_SQRT2
    sg = (s * g32).abs()
    tol = 4 * U32 * (sg + sz) + s_err * sg + 2.0**-126
    if cuda:
        tol = tol + 4 * U32 * (sg + sz) + 16 * U32 * sigma
    if g.dtype == torch.bfloat16 and exact and not cuda:
        assert torch.equal(out, ref_out)
    elif g.dtype in (torch.float32, torch.float64):
        assert ((out.float() - ref_out.float()).abs() <= tol).all()
    else:
        ulp = torch.finfo(g.dtype).eps * ref_out.float().abs() + torch.finfo(g.dtype).smallest_normal
        assert ((out.float() - ref_out.float()).abs() <= ulp + tol).all()
        if exact:  # the same scale: one-ulp differences only near rounding ties
            assert (out == ref_out).float().mean().item() >= 0.95


# ----------------------------------------------------------------------------- keystream
EDGE_BLOCKS = [0, 1, 2, 2**31 - 1, 2**31, 2**32 - 2, 2**32 - 1, 2**32, 2**32 + 1, 2**40 + 5, 2**62, 2**63 - 1,
               -(2**63), -1]  # int64: the last two are the 64-bit counters 2^63 and 2^64 - 1


def _blocks(n_random: int, seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    rand = torch.randint(-(2**63), 2**63 - 1, (n_random,), generator=gen, dtype=torch.int64)
    low = torch.randint(0, 2**32, (n_random,), generator=gen, dtype=torch.int64)
    return torch.cat([torch.tensor(EDGE_BLOCKS), rand, low])


@pytest.mark.parametrize("domain", [ref.NOISE_DOMAIN, ref.DERIVE_DOMAIN, 0xFFFFFFFF])
def test_keystream_words_are_bit_exact(domain):
    blocks = _blocks(150)
    for key in (KEY, aegis_kernels.key_from_int(0), aegis_kernels.key_from_int(2**256 - 1)):
        words = TT.keystream(key, blocks, domain)
        assert words.dtype == torch.int64 and words.shape == (len(blocks), 16)
        assert torch.equal(words, ref.keystream(key, blocks, domain))
    assert TT.keystream(KEY, torch.empty(0, dtype=torch.int64)).shape == (0, 16)


def test_derive_key_kernel_matches_reference_and_advances():
    for master, step in [(KEY, 0), (aegis_kernels.key_from_int(5), 7), (KEY, 2**32 - 1), (KEY, 2**32),
                         (aegis_kernels.key_from_int(2**256 - 1), 2**62 + 12345)]:
        state = torch.cat([master, torch.tensor([step])])
        key = TF.derive_key(state)
        assert key.dtype == torch.int64 and key.shape == (8,)
        assert torch.equal(key, ref.derive_key(master, step))
        assert state[:8].tolist() == master.tolist() and state[8].item() == step + 1
    assert not torch.equal(TF.derive_key(state), key)  # the next step, the next key


@pytest.mark.parametrize("bad", [torch.zeros(9, dtype=torch.int32), torch.zeros(8, dtype=torch.int64),
                                 torch.zeros(18, dtype=torch.int64)[::2]])
def test_derive_key_rejects_bad_state(bad):
    with pytest.raises(ValueError, match="state"):
        TF.derive_key(bad)


# ----------------------------------------------------------------------------- noise
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("offset", [0, 16 * 3, 16 * (2**32 - 5), 2**40 + 16 * 7])
def test_noise_matches_reference(dtype, offset):
    """Same words, same lanes; odd sizes; counters below, across and above 2^32 (a tile whose low
    counter word wraps takes the kernel's slow path)."""
    for shape in [(1,), (3, 5), (257, 129)]:
        z = TF.noise(shape, KEY, offset, dtype)
        zr = ref.noise(shape, KEY, offset, dtype)
        assert z.shape == zr.shape and z.dtype == torch.float32
        assert (z - zr).abs().max().item() <= 1e-6, shape


def test_noise_kernel_is_deterministic_and_keyed():
    a = TF.noise((300,), KEY, 16)
    assert torch.equal(a, TF.noise((300,), KEY.clone(), 16))
    other = KEY.clone()
    other[0] ^= 1
    assert not torch.isclose(a, TF.noise((300,), other, 16)).any()
    assert not torch.isclose(a, TF.noise((300,), KEY, 32)).any()
    assert TF.noise((0, 4), KEY, 0).shape == (0, 4)


@pytest.mark.parametrize("offset", [8, 1, -16])
def test_unaligned_offsets_are_rejected(offset):
    with pytest.raises(ValueError, match="stream_offsets"):
        TF.noise((4,), KEY, offset)
    with pytest.raises(ValueError, match="stream_offsets"):
        TF.flood(torch.ones(3, 3), "rows", torch.ones(4), KEY, offset)


def _pair_kernel(a_ptr, b_ptr, z0_ptr, z1_ptr, n, BLOCK: tl.constexpr, FAST: tl.constexpr):
    """Box-Muller of chosen words through the kernels' own _normal_pair (bound per build below)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    a = tl.load(a_ptr + offs, mask=m, other=0).to(tl.uint32)
    b = tl.load(b_ptr + offs, mask=m, other=0).to(tl.uint32)
    z0, z1 = _normal_pair(a, b, FAST)  # noqa: F821  (a global of the bound copy)
    tl.store(z0_ptr + offs, z0, mask=m)
    tl.store(z1_ptr + offs, z1, mask=m)


_PAIR_KERNELS: dict = {}


def _kernel_normal_pair(a: torch.Tensor, b: torch.Tensor):
    """z0, z1 = the kernels' _normal_pair(a, b): compiled on CUDA (hardware log), interpreted on CPU."""
    cuda = a.is_cuda
    if cuda not in _PAIR_KERNELS:
        mod = stream if cuda else interpret.interpreted_module("stream")
        fn = types.FunctionType(_pair_kernel.__code__, {**globals(), "_normal_pair": mod.normal_pair}, "_pair_kernel")
        fn.__module__, fn.__qualname__ = __name__, "_pair_kernel"
        fn.__annotations__ = dict(_pair_kernel.__annotations__)  # triton reads the tl.constexpr marks
        if cuda:
            _PAIR_KERNELS[cuda] = triton.jit(fn)
        else:
            old = os.environ.get("TRITON_INTERPRET")
            os.environ["TRITON_INTERPRET"] = "1"  # triton.jit reads it when it decorates
            try:
                _PAIR_KERNELS[cuda] = interpret.InterpretedLaunch(triton.jit(fn))
            finally:
                if old is None:
                    del os.environ["TRITON_INTERPRET"]
                else:
                    os.environ["TRITON_INTERPRET"] = old
    z0, z1 = torch.empty(a.shape, device=a.device), torch.empty(a.shape, device=a.device)
    _PAIR_KERNELS[cuda][(triton.cdiv(a.numel(), 1024),)](a, b, z0, z1, a.numel(), BLOCK=1024, FAST=cuda)
    return z0, z1


def _edge_words():
    """Radius words at both ends of both halves and of the series branch (v < 2^-10); angle words
    at the signed wrap, at zero, near +-2^24 and at every eighth of the circle; all pairs of those,
    plus random words."""
    radius = [0, 1, 2**21 - 1, 2**21, 2**21 + 1, 2**30, 2**31 - 2, 2**31 - 1, 2**31, 2**31 + 1, 2**31 + 2**21,
              2**32 - 2, 2**32 - 1]
    angle = sorted({o * 2**29 + d for o in range(8) for d in (0, 1, 2**24 - 1, 2**24 + 1)} | {2**32 - 1, 2**32 - 2})
    gen = torch.Generator().manual_seed(4)
    ra, rb = (torch.randint(0, 2**32, (8192,), generator=gen, dtype=torch.int64) for _ in range(2))
    a = torch.cat([torch.tensor(radius).repeat_interleave(len(angle)), ra])
    b = torch.cat([torch.tensor(angle).repeat(len(radius)), rb])
    return a, b


def test_kernel_box_muller_matches_reference_on_edge_words():
    """Both tails to the last cell (radius word 2^31: u = 2^-33, r = 6.76), the series branch's edge,
    the angle's signed wrap: the kernel's normals within a few ulps of r of the reference's (the
    interpreter's numpy log / cos / sin against torch's)."""
    a, b = _edge_words()
    z0, z1 = _kernel_normal_pair(a, b)
    r0, r1 = ref.normal_pair(a, b)
    r = torch.hypot(r0, r1)
    assert ((z0 - r0).abs() <= 4 * U32 * r + 2.0**-60).all()
    assert ((z1 - r1).abs() <= 4 * U32 * r + 2.0**-60).all()
    near_zero = (b < 2**20) | (b >= 2**32 - 2**20)  # sin(theta) resolved relatively: the half-step offset
    assert ((z1 - r1).abs() <= 8 * U32 * r1.abs())[near_zero].all()


# ----------------------------------------------------------------------------- floods (interpreter)
SHAPES = [
    (1, 1),
    (3, 5),  # tiny D
    (37, 48),  # D % 16 == 0, D < 512: several rows per program, V not a multiple of the block
    (33, 24),  # fp32 / fp16: several rows per program (24 % 8 == 0); bf16: flat kernel (24 % 16 != 0)
    (257, 129),  # flat rows kernel (D % 8 != 0); matrix over three tiles
    (3, 520),  # D >= 512 but D % 16 != 0: the two-pass kernels
    (3, 1024),  # D >= 512, D % 16 == 0: one pass over memory, one row per program
    (2, 1040),  # one pass, masked column tail
    (11, 1024),  # one pass over more rows than one reduce program takes (interpreter: 4)
    (2, 6144),  # one pass, several whole column chunks per row
    (1100, 3),  # more than 1024 rows: the stats pass reduces several programs' counts
]


@pytest.mark.parametrize("mode", ["rows", "matrix"])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_flood_equals_reference(mode, shape, dtype):
    g = _grad(shape, dtype, mode=mode)
    params = _params(g, mode)
    out, stats, z = _kernel_flood(g, mode, params)
    _check_flood(g, mode, params, out, stats, z)
    if mode == "rows" and shape[0] >= 6:  # the data really has dropped, clipped and unclipped kept rows
        assert 0 < stats[2].item() < stats[1].item() < shape[0]
    if mode == "matrix":
        assert 0 < stats[2].item() < params[0].item()  # clip active


@pytest.mark.parametrize("mode", ["rows", "matrix"])
@pytest.mark.parametrize("shape", [(37, 48), (257, 129), (3, 1024), (1100, 3)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_flood_equals_reference_on_inexact_data(mode, shape, dtype):
    """Log-normal data: the kernels' norms differ from torch's in the last bits (summation order)."""
    g = _grad(shape, dtype, mode=mode, exact=False, seed=5)
    params = _params(g, mode)
    out, stats, z = _kernel_flood(g, mode, params)
    _check_flood(g, mode, params, out, stats, z, exact=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "rho,clip_factor,thr_factor",
    [(0.3, math.inf, 0.0), (1.0, math.inf, 0.5), (0.5, 1e-3, 0.1), (0.5, 0.0, 0.0), (1.0, 2.0, 0.0)],
)
@pytest.mark.parametrize("shape", [(37, 48), (2, 1024), (33, 20)])
def test_flood_parameter_regimes(shape, rho, clip_factor, thr_factor, dtype):
    """No clip, clip of every row, clip 0 (nothing read but noise), thr keeping about half the rows."""
    for mode in ("rows", "matrix"):
        g = _grad(shape, dtype, seed=7, mode=mode)
        params = _params(g, mode, rho=rho, sigma=0.75, clip_factor=clip_factor, thr_factor=thr_factor)
        out, stats, z = _kernel_flood(g, mode, params, offset=16 * 11)
        _check_flood(g, mode, params, out, stats, z)
        if mode == "rows" and clip_factor == math.inf:
            assert stats[2].item() == 0


@pytest.mark.parametrize("shape,modes", [((65, 36), ("rows", "matrix")), ((2, 1024), ("rows", "matrix")),
                                         ((33, 20), ("rows",)), ((130, 131), ("matrix",))])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rho_zero_is_pure_noise(shape, modes, dtype):
    """rho = 0: out = sigma Z, G never enters (huge finite values); sigma 1 and 2 scale Z exactly.
    Every rows kernel; the matrix kernel's full and masked blocks over two tiles."""
    g = _grad(shape, dtype, exact=False) * (100 if dtype == torch.float16 else 1e4)
    for mode in modes:
        for sigma in (1.0, 2.0):
            out, stats, z = _kernel_flood(g, mode, torch.tensor([0.0, sigma, 1.0, 0.0]), offset=16 * 40)
            assert torch.equal(out, _noise_term(z, sigma).to(dtype)), (mode, sigma)
        params = torch.tensor([0.0, 1.7, 1.0, 0.0])
        out, stats, z = _kernel_flood(g, mode, params, offset=16 * 40)
        _check_flood(g, mode, params, out, stats, z, exact=False)


@pytest.mark.parametrize("offset", [16 * (2**32 - 3), 2**40 + 16])
@pytest.mark.parametrize("shape", [(33, 20), (2, 1024), (20, 48)])
def test_counters_past_32_bits(shape, offset):
    """Counters crossing into, and living in, the high counter word, in every rows kernel and the matrix one."""
    for dtype in (torch.float32, torch.bfloat16):
        for mode in ("rows", "matrix"):
            g = _grad(shape, dtype, seed=3, mode=mode)
            params = _params(g, mode)
            out, stats, z = _kernel_flood(g, mode, params, offset=offset)
            _check_flood(g, mode, params, out, stats, z)
            assert (_noise_term(z) - ref.noise(shape, KEY, offset, dtype)).abs().max().item() <= 1e-6


def test_matrix_mode_any_rank():
    for shape in [(), (7,), (3, 4, 5), (2, 3, 4, 5)]:
        for dtype in (torch.float32, torch.bfloat16):
            g = _grad(shape, dtype, seed=2, mode="matrix")
            params = _params(g, "matrix", clip_factor=0.5)
            out, stats, z = _kernel_flood(g, "matrix", params)
            _check_flood(g, "matrix", params, out, stats, z)


def test_fp64_gradients():
    """fp64 gradients: two words per element like fp32, arithmetic in fp32, output fp64."""
    for mode in ("rows", "matrix"):
        g = _grad((37, 24), torch.float64, mode=mode)
        params = _params(g, mode)
        out, stats, z = _kernel_flood(g, mode, params)
        assert out.dtype == torch.float64
        _check_flood(g, mode, params, out, stats, z)


def test_norms_and_counts_are_exact_on_tile_borders():
    """Non-zeros only at program / tile borders: every stat exact (a lost or twice-counted tile would show)."""
    g = torch.zeros(40000)
    g[[0, 16383, 16384, 32768, 39999]] = torch.tensor([1.0, -1.0, 3.0, 5.0, -8.0])  # ||G|| = 10
    params = torch.tensor([0.5, 1.0, 5.0, 0.0])
    out, stats, z = _kernel_flood(g, "matrix", params)
    assert stats.tolist() == [1.0, 10.0, 0.25]
    _check_flood(g, "matrix", params, out, stats, z)
    rows = torch.zeros(1100, 3)
    rows[0, 0], rows[1023, 2], rows[1024, 1], rows[1099, :] = 3.0, -4.0, 0.5, torch.tensor([2.0, 3.0, 6.0])
    params = torch.tensor([1.0, 1.0, 3.5, 0.5])
    out, stats, z = _kernel_flood(rows, "rows", params)
    assert stats.tolist() == [1.0, 3.0, 2.0, 7.0]  # rows 0, 1023, 1099 in S; 1023 and 1099 clipped
    _check_flood(rows, "rows", params, out, stats, z)
    long_rows = torch.zeros(5, 1040)
    long_rows[0, 0], long_rows[2, 1039], long_rows[4, 1023], long_rows[4, 1024] = 1.0, -2.0, 3.0, 4.0
    params = torch.tensor([1.0, 1.0, 4.0, 1.0])
    out, stats, z = _kernel_flood(long_rows, "rows", params)
    assert stats.tolist() == [1.0, 2.0, 1.0, 5.0]  # rows 2 and 4 in S; row 4 (n = 5) clipped
    _check_flood(long_rows, "rows", params, out, stats, z)


def test_rows_threshold_is_strict_and_ties_count():
    """Norms 2, 2 (tied maxima), 0.5 = thr exactly (dropped: S is n > thr), 0.5 + 2^-7 (kept; exact
    in every dtype), 0.25 (dropped), 0; clip 1 halves the two largest; all sums exact, so the stats are."""
    g = torch.zeros(6, 8)
    g[0, 0], g[1, 3], g[2, 5], g[3, 1] = 2.0, -2.0, 0.5, 0.5 + 2**-7
    g[4, :4] = 0.125
    params = torch.tensor([0.5, 1.5, 1.0, 0.5])
    keep = torch.tensor([0.25, 0.25, 0.0, 0.5, 0.0, 0.0])[:, None]
    for dtype in DTYPES:
        out, stats, z = _kernel_flood(g.to(dtype), "rows", params, offset=0)
        assert stats.tolist() == [1.5, 3.0, 2.0, 2.0]
        if dtype == torch.bfloat16:
            assert torch.equal(out, _noise_term(z, params[1].item(), keep * g).to(dtype))
        _check_flood(g.to(dtype), "rows", params, out, stats, z)


@pytest.mark.parametrize("mode", ["rows", "matrix"])
@pytest.mark.parametrize("shape", [(0, 5), (5, 0), (0, 0), (0, 1024)])
def test_empty(mode, shape):
    params = torch.tensor([0.25, 1.5, 1.0, 0.0])
    out, stats = TF.flood(torch.empty(shape), mode, params, KEY, 0)
    assert out.shape == shape
    assert stats.tolist() == ([1.5, 0.0, 0.0, 0.0] if mode == "rows" else [1.5, 0.0, 0.25])
    assert torch.equal(stats, ref.flood(torch.empty(shape), mode, params, KEY, 0)[1])


@pytest.mark.parametrize("mode", ["rows", "matrix"])
@pytest.mark.parametrize("shape", [(9, 16), (2, 1024)])
def test_zero_gradient(mode, shape):
    out, stats, z = _kernel_flood(torch.zeros(shape), mode, torch.tensor([0.25, 2.0, 1.0, 0.0]))
    assert torch.equal(out, _noise_term(z, 2.0))
    assert stats.tolist() == ([2.0, 0.0, 0.0, 0.0] if mode == "rows" else [2.0, 0.0, 0.25])
    out, stats = TF.flood(torch.zeros(shape), mode, torch.tensor([0.25, 0.0, 1.0, 0.0]), KEY, 0)
    assert torch.equal(out, torch.zeros(shape))  # sigma 0: nothing added


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("mode", ["rows", "matrix"])
@pytest.mark.parametrize("rho", [0.3, 0.0])
def test_non_finite_input_poisons_everything(bad, mode, rho):
    g = _grad((37, 20), torch.float32)
    g[5, 7] = bad
    out, stats = TF.flood(g, mode, torch.tensor([rho, 1.0, 1.0, 0.01]), KEY, 0)
    assert out.isnan().all() and stats.isnan().all()


@pytest.mark.parametrize("shape,where", [((3, 1024), (2, 1023)), ((2, 1040), (0, 0)), ((3, 520), (1, 5)),
                                         ((257, 129), (256, 128)), ((1100, 3), (0, 0)),
                                         ((11, 1024), (9, 3))])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_non_finite_in_every_kernel_path(shape, where, dtype):
    """A single inf anywhere, 16-bit, every rows kernel and the matrix tiles: NaN everywhere, dtype kept."""
    g = _grad(shape, dtype)
    g[where] = math.inf
    for mode in ("rows", "matrix"):
        for rho in (0.3, 0.0):
            out, stats = TF.flood(g, mode, torch.tensor([rho, 1.0, 1.0, 0.0]), KEY, 0)
            assert out.dtype == dtype and out.isnan().all() and stats.isnan().all(), (mode, rho)


@pytest.mark.parametrize("mode", ["rows", "matrix"])
def test_non_contiguous_input(mode):
    base = _grad((40, 66), torch.float32, exact=False)
    for g in (base.t(), base[1::2, 3:47]):
        assert not g.is_contiguous()
        params = _params(g, mode)
        out, stats, z = _kernel_flood(g, mode, params)
        _check_flood(g, mode, params, out, stats, z, exact=False)
        assert torch.equal(out, TF.flood(g.contiguous(), mode, params, KEY, 16 * 5)[0])


def test_flood_rejects_what_the_reference_rejects():
    with pytest.raises(ValueError, match="mode='matrix'"):
        TF.flood(torch.ones(4), "rows", torch.ones(4), KEY)
    with pytest.raises(ValueError, match="sparse=False"):
        TF.flood(torch.ones(3, 3).to_sparse(), "rows", torch.ones(4), KEY)
    with pytest.raises(ValueError, match="params must hold 4"):
        TF.flood(torch.ones(3, 3), "rows", torch.ones(3), KEY)
    with pytest.raises(ValueError, match="new_key"):
        TF.flood(torch.ones(3, 3), "rows", torch.ones(4), KEY.int())
    with pytest.raises(ValueError, match="mode"):
        TF.flood(torch.ones(3, 3), "cols", torch.ones(4), KEY)


# ----------------------------------------------------------------------------- flood_ (interpreter)
def _model_like(device=CPU):
    gen = torch.Generator().manual_seed(3)
    grads = [
        torch.randn(50, 16, generator=gen),  # token embedding (rows)
        torch.randn(16, 64, generator=gen),  # mlp (matrix, rho 0)
        torch.randn(64, generator=gen),  # bias
        torch.randn(0, 16),  # empty
        torch.randn(64, 16, generator=gen).t(),  # non-contiguous (a copy is flooded)
        torch.randn(11, 3, generator=gen).to(torch.bfloat16),  # other dtype, right after an fp32 matrix
        torch.randn(9, 7, generator=gen),  # rows, flat kernel
        torch.randn(20, 32, generator=gen).to(torch.float16),  # 16-bit rows
        torch.randn(130, 131, generator=gen),  # matrix over two tiles
        torch.randn(3, 1024, generator=gen).to(torch.bfloat16),  # long rows: one pass, in place
        torch.randn(5, 6, generator=gen).to(torch.float16),  # fp16 matrix after an fp32 one
    ]
    modes = ["rows", "matrix", "matrix", "rows", "matrix", "matrix", "rows", "rows", "matrix", "rows", "matrix"]
    rhos = [0.3, 0.0, 0.5, 0.3, 0.3, 0.3, 0.3, 1.0, 0.3, 0.3, 0.3]
    params = torch.stack([_params(g, m, rho=r, sigma=0.5 + i / 4)
                          for i, (g, m, r) in enumerate(zip(grads, modes, rhos))])
    return [g.to(device) for g in grads], modes, params.to(device)


def test_flood_inplace_per_tensor_path_equals_single_floods():
    """flood_ (grouped=False, the path the interpreter runs): tensor k floods at stream_offsets[k]
    with params[k], whatever dtype and mode its neighbours have."""
    grads, modes, params = _model_like()
    clean = [g.clone() for g in grads]
    TF.flood_(grads, ",".join(modes), params, KEY, grouped=False)
    offsets = ref.stream_offsets([(g.numel(), g.dtype) for g in clean])
    wrong = []
    for i, (g, c, mode, p, off) in enumerate(zip(grads, clean, modes, params, offsets)):
        assert g.dtype == c.dtype and g.stride() == c.stride()
        if not c.numel():
            continue
        out, stats, z = _kernel_flood(c, mode, p, offset=off)
        if not torch.equal(g, out):
            wrong.append((i, mode, tuple(c.shape), c.dtype))
            continue
        _check_flood(c, mode, p, g, stats, z, exact=False, in_place=True)
    assert not wrong, f"flood_ differs from the single floods at stream_offsets: {wrong}"
    # modes as a list, and the cached launch plan on a second set of tensors
    again = [c.clone() for c in clean]
    TF.flood_(again, modes, params, KEY, grouped=False)
    assert all(torch.equal(a, b) for a, b in zip(grads, again))


@pytest.mark.parametrize("dtypes", [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32),
                                    (torch.float16, torch.bfloat16)])
def test_flood_inplace_chain_of_mixed_dtypes(dtypes):
    """Two matrix tensors of different words-per-element in one per-tensor chain: each must get its
    own stream layout (a wrong one would also read the neighbour's words: shared noise)."""
    grads = [torch.zeros(64, dtype=dtypes[0]), torch.zeros(64, dtype=dtypes[1])]
    params = torch.tensor([[0.0, 1.0, 1.0, 0.0]] * 2)  # rho 0: the output is the noise alone
    TF.flood_(grads, "matrix,matrix", params, KEY, grouped=False)
    offsets = ref.stream_offsets([(64, dtypes[0]), (64, dtypes[1])])
    for g, off in zip(grads, offsets):
        z = ref.noise((64,), KEY, off, g.dtype)
        ulp = torch.finfo(g.dtype).eps * z.abs() + 1e-6
        assert ((g.float() - z).abs() <= ulp).all(), (g.dtype, off)


def test_flood_inplace_non_finite_poisons_only_its_tensor():
    grads, modes, params = _model_like()
    grads[8][100, 7] = math.nan
    grads[9][1, 1000] = math.inf  # long rows, in place: the finish pass fills the whole tensor
    clean = [g.clone() for g in grads]
    TF.flood_(grads, modes, params, KEY, grouped=False)
    offsets = ref.stream_offsets([(g.numel(), g.dtype) for g in clean])
    assert grads[8].isnan().all() and grads[9].isnan().all()
    for i in (0, 1, 2, 6, 7):
        assert torch.equal(grads[i], TF.flood(clean[i], modes[i], params[i], KEY, offsets[i])[0]), i
        assert not grads[i].isnan().any()


def test_flood_keyed_per_tensor_path():
    grads, modes, params = _model_like()
    expect = [g.clone() for g in grads]
    state = torch.cat([KEY, torch.tensor([41])])
    TF.flood_keyed_(grads, modes, params, state, grouped=False)
    assert state[:8].tolist() == KEY.tolist() and state[8].item() == 42
    TF.flood_(expect, modes, params, ref.derive_key(KEY, 41), grouped=False)
    assert all(torch.equal(a, b) for a, b in zip(grads, expect))


def test_flood_inplace_rejects_bad_input():
    grads, modes, params = _model_like()
    with pytest.raises(ValueError, match="same length"):
        TF.flood_(grads, modes[:-1], params, KEY, grouped=False)
    with pytest.raises(ValueError, match=r"\(11, 4\)"):
        TF.flood_(grads, modes, params[:10], KEY, grouped=False)
    with pytest.raises(ValueError, match="mode='matrix'"):
        TF.flood_(grads, ["rows"] * 11, params, KEY, grouped=False)
    with pytest.raises(ValueError, match="sparse=False"):
        TF.flood_([torch.ones(3, 3).to_sparse()], "rows", params[:1], KEY, grouped=False)
    with pytest.raises(ValueError, match="state"):
        TF.flood_keyed_(grads, modes, params, torch.zeros(8, dtype=torch.int64), grouped=False)


def test_group_tables_rebuild_only_addresses_when_gradients_move():
    """zero_grad(set_to_none=True) moves gradients every step: the table's layout part is reused and its
    address part is new; the table reads [addresses, numels, block bases, first tiles]."""
    a = [torch.zeros(3, 7000), torch.zeros(129), torch.zeros(40000)]
    b = [t.clone() for t in a]
    bbases = [0, 2625, 2642]
    meta_a, tiles_a, first, chunks, _ = tables.group_tables(a, bbases)
    meta_b, tiles_b, first_b, _, _ = tables.group_tables(b, bbases)
    numels = [21000, 129, 40000]
    assert first == [0, 2, 3, 6]  # 16384-element tiles per tensor
    assert meta_a.tolist() == [t.data_ptr() for t in a] + numels + bbases + first
    assert meta_b.tolist()[:3] == [t.data_ptr() for t in b] and meta_b.tolist()[3:] == meta_a.tolist()[3:]
    assert tiles_b is tiles_a and first_b is first  # layout shared, not rebuilt
    assert tiles_a.tolist() == [0, 0, 1, 2, 2, 2]
    assert chunks[0][0] == 0 and chunks[-1][1] == 3
    assert tables.group_tables(a, bbases)[0] is meta_a  # same addresses: the cached table


# ----------------------------------------------------------------------------- slow (interpreter, big)
@pytest.mark.slow
@pytest.mark.parametrize("mode", ["rows", "matrix"])
@pytest.mark.parametrize("shape", [(1000, 384), (40, 4096)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_flood_big_shapes_interpreted(mode, shape, dtype):
    for exact in (True, False):
        g = _grad(shape, dtype, mode=mode, exact=exact)
        params = _params(g, mode)
        out, stats, z = _kernel_flood(g, mode, params)
        _check_flood(g, mode, params, out, stats, z, exact=exact)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES)
def test_noise_big_interpreted(dtype):
    z = TF.noise((1 << 20,), KEY, 16 * (2**32 - 1000), dtype)
    assert (z - ref.noise((1 << 20,), KEY, 16 * (2**32 - 1000), dtype)).abs().max().item() <= 1e-6


# ----------------------------------------------------------------------------- GPU
GPU_SHAPES = [(1, 1), (1, 768), (5, 1), (3, 5), (257, 129), (3, 520), (7, 1040), (1100, 3), (4097, 64),
              (40, 4096), (2000, 768), (1024, 4096)]
CUDA = torch.device("cuda")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("domain", [0, 1, 5])
def test_gpu_keystream_and_derive_key_are_bit_exact(domain):
    blocks = _blocks(4000)
    assert torch.equal(TT.keystream(KEY.cuda(), blocks.cuda(), domain).cpu(), ref.keystream(KEY, blocks, domain))
    for step in (0, 1, 2**32 - 1, 2**62 + 3):
        state = torch.cat([KEY, torch.tensor([step])]).cuda()
        assert torch.equal(TF.derive_key(state).cpu(), ref.derive_key(KEY, step))
        assert state[8].item() == step + 1


GPU_NOISE_TOL = 2e-6  # hardware lg2 / sin / cos (absolute error ~2^-21 each, times r <= 6.76)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_noise_matches_reference(dtype):
    """Words exact; the hardware log / sin / cos move each normal by < 2e-6."""
    for offset in (0, 16 * (2**32 - 5), 2**40 + 16):
        for shape in [(1,), (3, 5), (257, 129), (2000, 768)]:
            z = torch.ops.aegis.noise(list(shape), KEY, offset, dtype, CUDA)
            assert z.is_cuda and z.dtype == torch.float32
            zr = ref.noise(shape, KEY, offset, dtype)
            assert (z.cpu() - zr).abs().max().item() <= GPU_NOISE_TOL, (shape, offset)
            assert torch.equal(z, TF.noise(shape, KEY, offset, dtype, device="cuda"))


@pytest.mark.gpu
@gpu
def test_gpu_box_muller_on_edge_words():
    a, b = _edge_words()
    z0, z1 = _kernel_normal_pair(a.cuda(), b.cuda())
    r0, r1 = ref.normal_pair(a, b)
    assert (z0.cpu() - r0).abs().max().item() <= GPU_NOISE_TOL
    assert (z1.cpu() - r1).abs().max().item() <= GPU_NOISE_TOL


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("mode", ["rows", "matrix"])
@pytest.mark.parametrize("shape", GPU_SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_flood_equals_reference(mode, shape, dtype):
    for exact in (True, False):
        g = _grad(shape, dtype, CUDA, mode=mode, exact=exact)
        params = _params(g, mode)
        out, stats, z = _kernel_flood(g, mode, params)
        _check_flood(g, mode, params, out, stats, z, exact=exact)
        op_out, op_stats = torch.ops.aegis.flood(g, mode, params, KEY, 16 * 5)  # the registered CUDA kernel
        assert torch.equal(op_out, out) and torch.equal(op_stats, stats)


@pytest.mark.gpu
@gpu
def test_gpu_edge_cases():
    for mode in ("rows", "matrix"):
        for shape in [(0, 5), (5, 0), (0, 0)]:
            out, stats = torch.ops.aegis.flood(torch.empty(shape, device=CUDA), mode,
                                               torch.tensor([0.25, 1.5, 1.0, 0.0], device=CUDA), KEY, 0)
            assert out.shape == shape
            assert stats.tolist() == ([1.5, 0.0, 0.0, 0.0] if mode == "rows" else [1.5, 0.0, 0.25])
        out, stats = torch.ops.aegis.flood(torch.zeros(9, 12, device=CUDA), mode,
                                           torch.tensor([0.3, 0.0, 1.0, 0.0], device=CUDA), KEY, 0)
        assert torch.equal(out, torch.zeros(9, 12, device=CUDA))
        for bad in (math.nan, math.inf, -math.inf):
            for rho in (0.3, 0.0):
                for shape, dtype in (((37, 20), torch.float32), ((3, 1024), torch.bfloat16),
                                     ((300, 1000), torch.float16), ((3, 520), torch.float32)):
                    g = _grad(shape, dtype, CUDA)
                    g[-1, -1] = bad
                    out, stats = torch.ops.aegis.flood(g, mode, torch.tensor([rho, 1.0, 1.0, 0.01], device=CUDA),
                                                       KEY, 0)
                    assert out.isnan().all() and stats.isnan().all(), (mode, shape, bad, rho)
        base = _grad((40, 66), torch.float32, CUDA, exact=False)
        for g in (base.t(), base[1::2, 3:47]):
            params = _params(g, mode)
            out, stats, z = _kernel_flood(g, mode, params)
            _check_flood(g, mode, params, out, stats, z, exact=False)
        for shape in [(65, 36), (3, 1024), (300, 1000)]:
            g = _grad(shape, torch.float32, CUDA, exact=False) * 1e4
            out, stats, z = _kernel_flood(g, mode, torch.tensor([0.0, 1.0, 1.0, 0.0], device=CUDA))
            assert ((out - _noise_term(z).to(out.device)).abs() <= 16 * U32).all()  # rho 0: sigma Z
    g = torch.zeros(6, 8, device=CUDA)
    g[0, 0], g[1, 3], g[2, 5], g[3, 1] = 2.0, -2.0, 0.5, 0.5 + 2**-20
    g[4, :4] = 0.125
    out, stats = torch.ops.aegis.flood(g, "rows", torch.tensor([0.5, 1.5, 1.0, 0.5], device=CUDA), KEY, 0)
    assert stats.tolist() == [1.5, 3.0, 2.0, 2.0]


def _same_layout(t):
    """A copy of t with the same strides and 16-byte misalignment (so it groups the same way)."""
    pad = (t.data_ptr() % 16) // t.element_size()
    size = sum((s - 1) * st for s, st in zip(t.shape, t.stride())) + 1 if t.numel() else 0
    buf = torch.empty(pad + size, dtype=t.dtype, device=t.device)
    out = buf.as_strided(t.shape, t.stride(), pad)
    out.copy_(t)
    return out


def _gpu_model_like():
    grads, modes, params = _model_like(CUDA)
    gen = torch.Generator().manual_seed(8)
    buf = torch.randn(1 + 48 * 32, generator=gen).cuda()  # a view 4 bytes into its buffer: unvectorized
    extra = [buf[1:].view(48, 32), torch.randn(300, 1000, generator=gen).cuda(),  # several tiles
             torch.randn(2000, 768, generator=gen).to(CUDA, torch.bfloat16),
             torch.randn(4096, 1024, generator=gen).cuda(),
             torch.randn(512, 2048, generator=gen).to(CUDA, torch.float16)]
    extra_modes = ["matrix", "matrix", "matrix", "matrix", "rows"]
    extra_params = torch.stack([_params(g, m, sigma=0.8) for g, m in zip(extra, extra_modes)])
    return grads + extra, modes + extra_modes, torch.cat([params, extra_params])


@pytest.mark.gpu
@gpu
def test_gpu_grouped_flood_equals_per_tensor_flood():
    """The grouped launch (address table, chunked pipeline) == grouped=False bit for bit, and each
    tensor == its single flood at its stream offset (to the flood contract)."""
    grads, modes, params = _gpu_model_like()
    clean = [_same_layout(g) for g in grads]
    TF.flood_(grads, modes, params, KEY, grouped=True)
    per_tensor = [_same_layout(c) for c in clean]
    TF.flood_(per_tensor, modes, params, KEY, grouped=False)
    offsets = ref.stream_offsets([(g.numel(), g.dtype) for g in clean])
    differ = [(i, modes[i], tuple(c.shape), c.dtype, c.data_ptr() % 16)
              for i, (a, b, c) in enumerate(zip(grads, per_tensor, clean)) if not torch.equal(a, b)]
    assert not differ, f"grouped != per-tensor: {differ}"
    for i, (a, c) in enumerate(zip(grads, clean)):
        if c.numel():
            out, stats, z = _kernel_flood(c, modes[i], params[i], offset=offsets[i])
            _check_flood(c, modes[i], params[i], a, stats, z, exact=False, in_place=True)
    # torch.ops.aegis.flood_ on CUDA is the grouped path; the same layout at new addresses reuses the plan
    for _ in range(2):
        moved = [_same_layout(c) for c in clean]
        torch.ops.aegis.flood_(moved, ",".join(modes), params, KEY)
        assert all(torch.equal(a, b) for a, b in zip(grads, moved))


@pytest.mark.gpu
@gpu
def test_gpu_flood_keyed_opcheck_and_compile():
    grads, modes, params = _gpu_model_like()
    modes_csv = ",".join(modes)
    expect = [_same_layout(g) for g in grads]
    state = torch.cat([KEY, torch.tensor([4])]).cuda()
    torch.ops.aegis.flood_keyed_(grads, modes_csv, params, state)
    assert state[8].item() == 5
    torch.ops.aegis.flood_(expect, modes_csv, params, ref.derive_key(KEY, 4).cuda())
    assert all(torch.equal(a, b) for a, b in zip(grads, expect))
    g = _grad((33, 20), torch.float32, CUDA)
    p = _params(g, "rows")
    torch.library.opcheck(torch.ops.aegis.flood.default, (g, "rows", p, KEY.cuda(), 16))
    torch.library.opcheck(torch.ops.aegis.flood.default, (g.t(), "matrix", p, KEY.cuda(), 0))
    torch.library.opcheck(torch.ops.aegis.noise.default, ([3, 5], KEY, 16, torch.bfloat16, CUDA))
    small, small_modes, small_params = _model_like(CUDA)
    torch.library.opcheck(torch.ops.aegis.flood_.default, (small, ",".join(small_modes), small_params, KEY.cuda()))
    small, _, _ = _model_like(CUDA)
    state = torch.cat([KEY, torch.tensor([0])]).cuda()
    torch.library.opcheck(torch.ops.aegis.flood_keyed_.default, (small, ",".join(small_modes), small_params, state))
    key = KEY.cuda()
    compiled = torch.compile(lambda x: torch.ops.aegis.flood(x, "rows", p, key, 16)[0] * 2, fullgraph=True)
    assert torch.equal(compiled(g), torch.ops.aegis.flood(g, "rows", p, key, 16)[0] * 2)


@pytest.mark.gpu
@gpu
def test_gpu_cuda_graph_replay_draws_a_fresh_key_and_equals_eager():
    grads, modes, params = _gpu_model_like()
    modes = ",".join(modes)
    clean = [_same_layout(g) for g in grads]
    state = torch.cat([KEY, torch.tensor([0])]).cuda()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up: compiles the kernels, caches the grouped tables
        torch.ops.aegis.flood_keyed_(grads, modes, params, state)
    torch.cuda.current_stream().wait_stream(stream)
    state[8] = 10
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for g, c in zip(grads, clean):
            g.copy_(c)
        torch.ops.aegis.flood_keyed_(grads, modes, params, state)
    assert state[8].item() == 10  # capture does not run the work
    replays = []
    for k in range(3):
        graph.replay()
        replays.append([g.clone() for g in grads])
        assert state[8].item() == 11 + k
    for k, got in enumerate(replays):
        eager = [_same_layout(c) for c in clean]
        TF.flood_(eager, modes, params, ref.derive_key(KEY, 10 + k).cuda())
        bad = [(i, tuple(a.shape), a.dtype) for i, (a, b) in enumerate(zip(got, eager)) if not torch.equal(a, b)]
        assert not bad, f"replay {k} differs from eager: {bad}"
    for i in range(len(grads)):
        if clean[i].numel():
            assert not torch.equal(replays[0][i], replays[1][i])  # fresh noise on every replay
    # new parameters reach the graph by address
    params[:, 1] *= 2
    graph.replay()
    eager = [_same_layout(c) for c in clean]
    TF.flood_(eager, modes, params, ref.derive_key(KEY, 13).cuda())
    assert all(torch.equal(a, b) for a, b in zip(grads, eager))


def _tiny_gpt2_on_gpu(n_embd=64):
    """n_embd >= 512: embedding rows long enough for the one-pass rows kernels (what the CUDA graph addresses)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=320, n_positions=32, n_embd=n_embd, n_layer=2, n_head=2)
    model = transformers.GPT2LMHeadModel(cfg).cuda().eval()  # no dropout: the same gradients every step
    return model, torch.randint(0, 320, (2, 16), device="cuda")


@pytest.mark.gpu
@gpu
def test_gpu_shield_mask_is_graph_capturable():
    """shield.mask_() with device_seed on a tiny GPT-2: replays advance the step, equal eager."""
    import aegis
    from aegis.config import AegisConfig

    model, ids = _tiny_gpt2_on_gpu()
    config = dict(seed=12345, device_seed=True, exposure=aegis.ExposurePolicy.OFF)  # a replay runs no hook
    with pytest.warns(UserWarning, match="FIXED"):
        shield = aegis.protect(model, config=AegisConfig(**config))
    model(input_ids=ids, labels=ids).loss.backward()
    params = [p for p in model.parameters() if p.grad is not None]
    clean = [p.grad.clone() for p in params]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        shield.mask_()  # warm-up (calibrates, compiles, caches the tables)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    model(input_ids=ids, labels=ids).loss.backward()  # mask_() needs a backward since the last step
    with torch.cuda.graph(graph):
        for p, c in zip(params, clean):
            p.grad.copy_(c)
        shield.mask_()
    state = aegis.flood.device_state_of(shield._flood)
    results, steps = [], []
    for _ in range(3):
        steps.append(state[8].item())
        graph.replay()
        results.append([p.grad.clone() for p in params])
    assert state[8].item() == steps[-1] + 1 and len(set(steps)) == 3
    assert not torch.equal(results[0][0], results[1][0])
    for step, got in zip(steps, results):
        model(input_ids=ids, labels=ids).loss.backward()
        for p, c in zip(params, clean):
            p.grad.copy_(c)
        state[8] = step
        shield.mask_()  # eager, same state
        assert all(torch.equal(p.grad, r) for p, r in zip(params, got))


@pytest.mark.gpu
@gpu
def test_gpu_capture_with_exposure_counting_is_refused():
    import aegis

    model, ids = _tiny_gpt2_on_gpu()
    shield = aegis.protect(model, config=aegis.AegisConfig(device_seed=True))
    model(input_ids=ids, labels=ids).loss.backward()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="ExposurePolicy.OFF"):
        with torch.cuda.graph(graph):
            shield.mask_()
    assert not shield.is_masked


@pytest.mark.gpu
@gpu
def test_gpu_graphed_mask_equals_eager_and_replays():
    """cuda_graph=True: captured on the 2nd call, replayed after wherever the gradients are; every export
    bitwise equal to the eager flood (cuda_graph=False) under the same fixed key, also when the gradients
    move to new tensors."""
    import aegis
    from aegis.config import AegisConfig

    model, ids = _tiny_gpt2_on_gpu(n_embd=512)
    twin = copy.deepcopy(model)  # one shield per model: the eager reference floods the twin's gradients
    with pytest.warns(UserWarning, match="FIXED"):
        config = AegisConfig(seed=7, cuda_graph=True, exposure=aegis.ExposurePolicy.OFF)  # one batch, 8 exports
        graphed = aegis.protect(model, config=config)
        eager = aegis.protect(twin, config=config.replace(cuda_graph=False))
    graphed.calibrate()
    eager.calibrate()
    eager._params.copy_(graphed._params)  # one public calibration (GPU autograd sums are not bitwise repeatable)
    exports, hold = [], []
    for step in range(8):
        model.zero_grad(set_to_none=False)  # gradients keep their addresses...
        model(input_ids=ids, labels=ids).loss.backward()
        if step == 4:  # ...except here: new tensors (the old ones kept alive, so addresses differ)
            for p in model.parameters():
                if p.grad is not None:
                    hold.append(p.grad)
                    p.grad = p.grad.clone()
        clean = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        graphed.mask_()
        got = graphed.export()
        twin.zero_grad(set_to_none=True)
        twin(input_ids=ids, labels=ids).loss.backward()
        for n, p in twin.named_parameters():
            if n in clean:
                p.grad.copy_(clean[n])
        eager.mask_()
        want = eager.export()
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want), step
        exports.append(got)
        if step == 2:
            assert (graphed._flood.graphed.captures, graphed._flood.graphed.replays) == (1, 1)
    # eager 0, capture 1, replay 2-7 (4: new addresses, the same graph)
    g = graphed._flood.graphed
    assert g.disabled is None and g.captures == 1 and g.replays == 6
    assert eager._flood.graphed is None
    name = "transformer.h.0.mlp.c_fc.weight"
    assert not torch.equal(exports[2][name], exports[3][name])  # fresh noise on every replay


@pytest.mark.gpu
@gpu
def test_gpu_graphed_mask_secret_key_is_fresh_per_replay():
    import aegis

    model, ids = _tiny_gpt2_on_gpu(n_embd=512)
    shield = aegis.protect(model, config=aegis.AegisConfig(cuda_graph=True))
    model(input_ids=ids, labels=ids).loss.backward()
    clean = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    outs = []
    for _ in range(4):
        model(input_ids=ids, labels=ids).loss.backward()
        for n, p in model.named_parameters():
            if n in clean:
                p.grad.copy_(clean[n])
        shield.mask_()
        outs.append(shield.export()["transformer.wte.weight"])
    assert shield._flood.graphed.replays == 2
    diffs = [(outs[i] - outs[j]).abs().max().item() for i in range(4) for j in range(i)]
    assert min(diffs) > 0  # no two steps share noise
