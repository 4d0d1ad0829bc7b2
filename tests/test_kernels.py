"""Fused Triton flood kernels (issue 3): exact against the reference on shared noise.

CPU (CI): the launchers in ``aegis_kernels.triton_flood`` run CPU tensors through the Triton
interpreter (a copy of the kernel module decorated under TRITON_INTERPRET=1), so nothing needs to
be set before triton is imported. The interpreter does no fused multiply-add, so with
Z = the kernels' own noise the flood must equal ``where(S, rho*G, 0) + sigma*Z`` bit for bit.

GPU (``-m gpu``): the same checks through ``torch.ops.aegis`` on CUDA, where the compiler may fuse
rho*G + sigma*Z into one FMA (one rounding fewer, so the bound is one rounding of each term);
plus the grouped launch, which only runs there (it loads tensor addresses from a device table,
which the interpreter cannot do), and CUDA-graph capture and replay.
"""
from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("triton")

import aegis_kernels  # noqa: E402  (registers the CUDA kernels)
from aegis_kernels import reference as ref  # noqa: E402
from aegis_kernels import triton_flood as TF  # noqa: E402

CPU = torch.device("cpu")
U32 = 2.0**-24  # unit roundoff of fp32
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SHAPES = [(1, 1), (3, 5), (257, 129), (1000, 384), (40, 4096)]
EMPTY = [(0, 5), (5, 0), (0, 0)]
HAS_CUDA = torch.cuda.is_available()
gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")


def _grad(shape, dtype, device=CPU, seed=0):
    """Rows of very different norms: some far under tau*M (dropped), one dominant row."""
    gen = torch.Generator().manual_seed(seed)
    g = torch.randn(shape, generator=gen)
    if g.dim() == 2 and g.shape[0] > 1:
        scale = torch.exp(2.0 * torch.randn(g.shape[0], 1, generator=gen))
        scale[::3] = 1e-4
        g = g * scale
    return g.to(dtype).to(device)


def _kernel_flood(g, mode, rho, lam, tau, seed, offset):
    """(out, stats, Z) from the kernels: launchers on CPU, torch.ops.aegis on CUDA."""
    if g.is_cuda:
        out, stats = torch.ops.aegis.flood(g, mode, rho, lam, tau, seed, offset)
        z = torch.ops.aegis.noise(list(g.shape), seed, offset, g.device)
    else:
        out, stats = TF.flood(g, mode, rho, lam, tau, seed, offset)
        z = TF.noise(g.shape, seed, offset, g.device)
    return out, stats, z


def _within(value, truth, terms):
    """|value - truth| <= terms * u * |truth|: any fp32 sum of `terms` nonnegative terms (and a few
    more roundings, counted in `terms`) is that close to the exact sum."""
    return abs(value - truth) <= terms * U32 * abs(truth)


def _assert_flood_exact(g, mode, rho, lam, tau, out, stats, z, in_place=False):
    """out == where(S, rho*G, 0) + sigma*Z with the kernel's own sigma; stats checked against fp64."""
    assert out.shape == g.shape and out.dtype == g.dtype and (in_place or out.is_contiguous())
    g32, g64 = g.float(), g.double()
    ref_out, ref_stats = ref.flood(g, mode, rho, lam, tau, z=z)
    if mode == "rows":
        m_bar, sigma, count, peak = stats.tolist()
        d = g.shape[1]
        norms64 = torch.linalg.vector_norm(g64, dim=1)
        # the kernel's S is the reference's S (test data keeps norms away from tau*M)
        active = norms64 > tau * norms64.max()
        assert count == int(active.sum()) == ref_stats[2].item()
        assert _within(peak, norms64.max().item(), d + 2)
        truth = norms64[active].mean().item() if count else 0.0
        assert _within(m_bar, truth, d + count + 4) and _within(ref_stats[0].item(), truth, d + count + 4)
        expect = torch.where(active.to(g.device)[:, None], rho * g32, 0.0) + stats[1] * z
    else:
        m_bar, sigma = stats.tolist()
        n = g.numel()
        truth = g64.abs().mean().item() if n else 0.0
        # the kernel sums along a fixed tree: depth <= log2(n) + 8 sequential adds per lane
        assert _within(m_bar, truth, math.ceil(math.log2(max(n, 2))) + 8)
        assert _within(ref_stats[0].item(), truth, n + 2)
        expect = rho * g32 + stats[1] * z
    assert sigma == (torch.tensor(lam, dtype=torch.float32) * torch.tensor(m_bar, dtype=torch.float32)).item()
    if out.is_cuda:
        # The GPU folds sigma into Box-Muller's radius and may fuse rho*G + sigma*Z into one FMA:
        # each term then carries at most four roundings instead of two, the sum one.
        tol = 4 * U32 * ((rho * g32).abs() + (stats[1] * z).abs()) + 2 * U32 * expect.abs()
        if g.dtype != torch.float32:
            tol = tol + torch.finfo(g.dtype).eps * expect.abs()
        assert ((out.float() - expect.to(g.dtype).float()).abs() <= tol).all()
    else:
        assert torch.equal(out, expect.to(g.dtype))


# ------------------------------------------------------------------------------ noise stream
def test_philox_words_are_bit_exact():
    gen = torch.Generator().manual_seed(1)
    c = torch.randint(0, 2**32, (257, 4), generator=gen, dtype=torch.int64)
    for seed in (0, 5, 2**62 - 1, 2**63 + 7, -3):
        words = TF.philox4x32(seed, c)
        expect = torch.stack(ref.philox4x32(seed & (2**64 - 1), *c.unbind(1)), 1)
        assert torch.equal(words, expect)


def _uniform_edge_words():
    """Words at both ends of every radius cell's range and of the angle bits, plus random words."""
    ks = [0, 1, 2, 2**19, 2**20 - 2, 2**20 - 1]
    words = [(k << 12) | a for k in ks for a in (0, 1, 0x7FF, 0xFFF)]
    gen = torch.Generator().manual_seed(3)
    return torch.cat([torch.tensor(words, dtype=torch.int64), torch.randint(0, 2**32, (4099,), generator=gen, dtype=torch.int64)])


def test_uniforms_are_exact_cell_midpoints():
    """The radius uniform is (k + 1/2) 2^-20 of the word's high 20 bits k, exactly (21 bits fit fp32):
    never 0 or 1, whatever the low 12 (angle) bits; kernels and reference agree bit for bit."""
    words = _uniform_edge_words()
    u = TF.uniform(words)
    assert torch.equal(u, ref._uniform(words))
    assert torch.equal(u.double(), ((words >> 12).double() + 0.5) * 2.0**-20)
    assert u.min().item() == 2.0**-21 and u.max().item() == 1 - 2.0**-21


@pytest.mark.parametrize("offset", [0, 8, 8 * (2**32 - 3), 2**40 + 8])
def test_noise_matches_reference_stream(offset):
    """Same Philox words and lanes; numpy's and torch's fp32 log/sin/cos differ by <= 2 ulp."""
    for shape in [(1,), (3, 5), (257, 129)]:
        z = TF.noise(shape, 1234567, offset)
        zr = ref.noise(shape, 1234567, offset)
        assert z.shape == zr.shape and z.dtype == torch.float32
        assert ((z - zr).abs() <= 4 * 2 * U32 * zr.abs().clamp(min=1.0)).all()


def test_derive_seed_kernel_matches_reference_and_advances():
    for key, step in [(5, 0), (2**61 + 5, 7), (-(2**60) - 12345, 2**33 + 7)]:
        state = torch.tensor([key, step])
        seed = TF.derive_seed(state)
        assert seed.item() == ref.derive_seed(key, step).item()
        assert state.tolist() == [key, step + 1]


# ------------------------------------------------------------------------------ interpreter: floods
@pytest.mark.parametrize("mode", ["rows", "matrix"])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_flood_equals_reference_on_shared_noise(mode, shape, dtype):
    if shape in ((1000, 384), (40, 4096)) and dtype != torch.float32:
        pytest.skip("the big shape runs in fp32 only here (slow variant below)")
    g = _grad(shape, dtype)
    out, stats, z = _kernel_flood(g, mode, 0.3, 1.5, 0.01, 99, 16)
    _assert_flood_exact(g, mode, 0.3, 1.5, 0.01, out, stats, z)


@pytest.mark.parametrize("shape", [(7, 1024), (6, 1100), (3, 2052)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_long_rows_one_row_per_program(shape, dtype):
    """Long rows: pass 2 takes one row per program and branches (inactive rows skip the re-read)."""
    g = _grad(shape, dtype)
    out, stats, z = _kernel_flood(g, "rows", 0.3, 1.5, 0.01, 99, 16)
    _assert_flood_exact(g, "rows", 0.3, 1.5, 0.01, out, stats, z)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["rows", "matrix"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_flood_big_shape_16bit(mode, dtype):
    g = _grad((1000, 384), dtype)
    out, stats, z = _kernel_flood(g, mode, 0.3, 1.5, 0.01, 99, 16)
    _assert_flood_exact(g, mode, 0.3, 1.5, 0.01, out, stats, z)


@pytest.mark.parametrize("mode", ["rows", "matrix"])
@pytest.mark.parametrize("shape", EMPTY)
def test_empty(mode, shape):
    out, stats = TF.flood(torch.empty(shape), mode, 0.3, 1.0, 0.01, 1, 0)
    assert out.shape == shape and torch.equal(stats, torch.zeros(4 if mode == "rows" else 2))
    assert torch.equal(stats, ref.flood(torch.empty(shape), mode, 0.3, 1.0, 0.01, 1, 0)[1])


@pytest.mark.parametrize("mode", ["rows", "matrix"])
def test_all_zero_gradient_gives_zero_output_and_says_so(mode):
    out, stats = TF.flood(torch.zeros(9, 12), mode, 0.3, 1.0, 0.01, 3, 0)
    assert torch.equal(out, torch.zeros(9, 12))
    assert torch.equal(stats, torch.zeros(4 if mode == "rows" else 2))  # |S| = 0, sigma = 0


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("mode", ["rows", "matrix"])
@pytest.mark.parametrize("rho", [0.3, 0.0])
def test_non_finite_input_poisons_everything(bad, mode, rho):
    g = _grad((37, 20), torch.float32)
    g[5, 7] = bad
    out, stats = TF.flood(g, mode, rho, 1.0, 0.01, 3, 0)
    assert out.isnan().all() and stats.isnan().all()
    ref_out, ref_stats = ref.flood(g, mode, rho, 1.0, 0.01, 3, 0)
    assert ref_out.isnan().all() and ref_stats.isnan().all()


def test_rows_threshold_is_strict_and_ties_count():
    """Norms 2, 2 (tied maxima), 0.5 = tau*M exactly (dropped: S is n > tau*M), 0.5 + 2^-20 (kept),
    0.25 (small, dropped), 0; all sums exact in fp32, so the stats are exact."""
    g = torch.zeros(6, 8)
    g[0, 0] = 2.0
    g[1, 3] = -2.0
    g[2, 5] = 0.5
    g[3, 1] = 0.5 + 2**-20
    g[4, :4] = 0.125
    out, stats, z = _kernel_flood(g, "rows", 0.5, 1.0, 0.25, 11, 0)
    m_bar = (torch.tensor(4.5 + 2**-20) / 3).item()
    assert stats.tolist() == [m_bar, m_bar, 3.0, 2.0]
    keep = torch.tensor([1, 1, 0, 1, 0, 0], dtype=torch.bool)
    assert torch.equal(out, torch.where(keep[:, None], 0.5 * g, 0.0) + stats[1] * z)
    _assert_flood_exact(g, "rows", 0.5, 1.0, 0.25, out, stats, z)


@pytest.mark.parametrize("mode", ["rows", "matrix"])
def test_rho_zero_output_is_pure_noise(mode):
    g = _grad((65, 36), torch.float32)
    out, stats, z = _kernel_flood(g, mode, 0.0, 8.0, 0.01, 5, 40)
    assert torch.equal(out, stats[1] * z)
    _assert_flood_exact(g, mode, 0.0, 8.0, 0.01, out, stats, z)


@pytest.mark.parametrize("mode", ["rows", "matrix"])
def test_non_contiguous_input(mode):
    base = _grad((40, 66), torch.float32)
    for g in (base.t(), base[1::2, 3:47]):
        assert not g.is_contiguous()
        out, stats, z = _kernel_flood(g, mode, 0.3, 1.0, 0.01, 8, 8)
        _assert_flood_exact(g, mode, 0.3, 1.0, 0.01, out, stats, z)


@pytest.mark.parametrize("offset", [8 * (2**32 - 3), 2**40 + 8])
def test_counters_past_32_bits(offset):
    """Counters cross into / live in the high counter word."""
    g = _grad((33, 20), torch.float32)
    for mode in ("rows", "matrix"):
        out, stats, z = _kernel_flood(g, mode, 0.3, 1.0, 0.01, 2**62 - 1, offset)
        _assert_flood_exact(g, mode, 0.3, 1.0, 0.01, out, stats, z)


def test_matrix_mode_any_rank():
    for shape in [(7,), (3, 4, 5), (2, 3, 4, 5)]:
        g = _grad(shape, torch.float32)
        out, stats, z = _kernel_flood(g, "matrix", 0.3, 4.0, 0.01, 21, 8)
        _assert_flood_exact(g, "matrix", 0.3, 4.0, 0.01, out, stats, z)


# ------------------------------------------------------------------------------ interpreter: flood_
def _model_like(device=CPU):
    gen = torch.Generator().manual_seed(3)
    grads = [
        torch.randn(50, 16, generator=gen),  # token embedding (rows)
        torch.randn(16, 64, generator=gen),  # mlp (matrix, rho 0)
        torch.randn(64, generator=gen),  # bias
        torch.randn(0, 16),  # empty
        torch.randn(64, 16, generator=gen).t(),  # non-contiguous
        torch.randn(11, 3, generator=gen).to(torch.bfloat16),  # other dtype
        torch.randn(9, 7, generator=gen),  # rows, d % 8 != 0
    ]
    modes = ["rows", "matrix", "matrix", "matrix", "matrix", "matrix", "rows"]
    rhos = [0.3, 0.0, 0.0, 0.3, 0.3, 0.3, 0.3]
    lams = [1.0, 8.0, 4.0, 1.0, 1.0, 1.0, 1.0]
    return [g.to(device) for g in grads], modes, rhos, lams


def test_flood_inplace_per_tensor_path_equals_single_floods():
    """The interpreter path of flood_ (GROUPED=False): tensor k floods at stream_offsets[k]."""
    grads, modes, rhos, lams = _model_like()
    clean = [g.clone() for g in grads]
    TF.flood_(grads, ",".join(modes), rhos, lams, 0.01, 77, grouped=False)
    offsets = ref.stream_offsets([g.numel() for g in clean])
    for g, c, mode, rho, lam, off in zip(grads, clean, modes, rhos, lams, offsets):
        out, stats, z = _kernel_flood(c, mode, rho, lam, 0.01, 77, off)
        assert torch.equal(g, out)
        _assert_flood_exact(c, mode, rho, lam, 0.01, out, stats, z)


def test_flood_seeded_per_tensor_path():
    grads, modes, rhos, lams = _model_like()
    expect = [g.clone() for g in grads]
    state = torch.tensor([2**61 + 3, 41])
    TF.flood_seeded_(grads, modes, rhos, lams, 0.01, state, grouped=False)
    assert state.tolist() == [2**61 + 3, 42]
    TF.flood_(expect, modes, rhos, lams, 0.01, int(ref.derive_seed(2**61 + 3, 41)), grouped=False)
    assert all(torch.equal(a, b) for a, b in zip(grads, expect))


def test_cpu_ops_keep_the_reference():
    """Registering CUDA kernels leaves the CPU implementations (noise dispatches on `device`)."""
    assert torch.equal(torch.ops.aegis.noise([3, 5], 11, 8, CPU), ref.noise((3, 5), 11, 8))
    g = _grad((7, 8), torch.float32)
    out, stats = torch.ops.aegis.flood(g, "rows", 0.3, 1.0, 0.01, 4, 0)
    ref_out, ref_stats = ref.flood(g, "rows", 0.3, 1.0, 0.01, 4, 0)
    assert torch.equal(out, ref_out) and torch.equal(stats, ref_stats)


# ------------------------------------------------------------------------------ GPU
@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("mode", ["rows", "matrix"])
@pytest.mark.parametrize("shape", SHAPES + EMPTY)
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_flood_equals_reference_on_shared_noise(mode, shape, dtype):
    g = _grad(shape, dtype, "cuda")
    out, stats, z = _kernel_flood(g, mode, 0.3, 1.5, 0.01, 99, 16)
    if g.numel() == 0:
        assert torch.equal(stats.cpu(), ref.flood(g.cpu(), mode, 0.3, 1.5, 0.01, 99, 16)[1])
        return
    _assert_flood_exact(g, mode, 0.3, 1.5, 0.01, out, stats, z)


@pytest.mark.gpu
@gpu
def test_gpu_edge_cases():
    for mode in ("rows", "matrix"):
        assert torch.equal(torch.ops.aegis.flood(torch.zeros(9, 12, device="cuda"), mode, 0.3, 1.0, 0.01, 3, 0)[0],
                           torch.zeros(9, 12, device="cuda"))
        for bad in (float("nan"), float("inf")):
            for rho in (0.3, 0.0):
                g = _grad((37, 20), torch.float32, "cuda")
                g[5, 7] = bad
                out, stats = torch.ops.aegis.flood(g, mode, rho, 1.0, 0.01, 3, 0)
                assert out.isnan().all() and stats.isnan().all()
        base = _grad((40, 66), torch.float32, "cuda")
        g = base[1::2, 3:47]
        out, stats, z = _kernel_flood(g, mode, 0.3, 1.0, 0.01, 8, 8)
        _assert_flood_exact(g, mode, 0.3, 1.0, 0.01, out, stats, z)
        g = _grad((65, 36), torch.float32, "cuda")
        out, stats, z = _kernel_flood(g, mode, 0.0, 8.0, 0.01, 5, 40)
        _assert_flood_exact(g, mode, 0.0, 8.0, 0.01, out, stats, z)  # = sigma*Z to rounding
    g = torch.zeros(6, 8, device="cuda")
    g[0, 0], g[1, 3], g[2, 5], g[3, 1] = 2.0, -2.0, 0.5, 0.5 + 2**-20
    out, stats, z = _kernel_flood(g, "rows", 0.5, 1.0, 0.25, 11, 0)
    assert stats[2].item() == 3.0 and stats[3].item() == 2.0


@pytest.mark.gpu
@gpu
def test_gpu_uniforms_are_exact_cell_midpoints():
    """The compiled conversion (I2F of 20 bits, then an FMA: nothing rounds) is the reference's."""
    words = _uniform_edge_words()
    assert torch.equal(TF.uniform(words.cuda()).cpu(), ref._uniform(words))


@pytest.mark.gpu
@gpu
def test_gpu_noise_stream():
    """Philox words bit-exact. log, sin and cos are the hardware approximations: sin/cos within
    2^-20.5 absolute, times r <= 5.4; lg2 within ~2^-22 absolute, which moves r^2 = -2 ln2 lg2 u
    by 2^-22 and r by 2^-23 / r. So |dz| <= 2^-16 + 2^-22 / r, r the pair's reference radius."""
    gen = torch.Generator().manual_seed(1)
    c = torch.randint(0, 2**32, (4097, 4), generator=gen, dtype=torch.int64)
    assert torch.equal(TF.philox4x32(2**62 - 1, c.cuda()).cpu(), torch.stack(ref.philox4x32(2**62 - 1, *c.unbind(1)), 1))
    for offset in (0, 8 * (2**32 - 3)):
        z = torch.ops.aegis.noise([1000, 384], 1234567, offset, torch.device("cuda")).cpu().view(-1, 2)
        zr = ref.noise((1000, 384), 1234567, offset).view(-1, 2)
        r = zr.norm(dim=1, keepdim=True)
        assert ((z - zr).abs() <= 2.0**-16 + 2.0**-22 / r).all()
        assert (z - zr).abs().max().item() <= 2.0**-9  # and never far, whatever r
    state = torch.tensor([-(2**60) - 12345, 2**33 + 7], device="cuda")
    assert TF.derive_seed(state).item() == ref.derive_seed(-(2**60) - 12345, 2**33 + 7).item()
    assert state.tolist() == [-(2**60) - 12345, 2**33 + 8]


def _gpu_model_like():
    grads, modes, rhos, lams = _model_like("cuda")
    # a view 4 bytes into its buffer: not 16-byte aligned -> the unvectorized grouped variant
    buf = torch.randn(1 + 48 * 32, device="cuda")
    grads.append(buf[1:].view(48, 32))
    modes.append("matrix")
    rhos.append(0.3)
    lams.append(1.0)
    big = torch.randn(300, 1000, device="cuda")  # several tiles per tensor
    return grads + [big], modes + ["matrix"], rhos + [0.3], lams + [8.0]


@pytest.mark.gpu
@gpu
def test_gpu_grouped_flood_equals_single_floods():
    """The grouped launch (address table; GPU only) equals tensor-by-tensor floods bit for bit."""
    grads, modes, rhos, lams = _gpu_model_like()
    clean = [_same_layout(g) for g in grads]
    torch.ops.aegis.flood_(grads, ",".join(modes), rhos, lams, 0.01, 77)
    offsets = ref.stream_offsets([g.numel() for g in clean])
    for g, c, mode, rho, lam, off in zip(grads, clean, modes, rhos, lams, offsets):
        out, stats, z = _kernel_flood(c, mode, rho, lam, 0.01, 77, off)
        if c.numel():
            _assert_flood_exact(c, mode, rho, lam, 0.01, g, stats, z, in_place=True)
        # Bit for bit where the tensor is 16-byte aligned: a misaligned one compiles to scalar
        # loads, a different register layout and so a different (equally exact) summation order.
        if c.data_ptr() % 16 == 0 or c.numel() == 0:
            assert torch.equal(g, out), (mode, tuple(c.shape), c.dtype)
    per_tensor = [_same_layout(c) for c in clean]
    TF.flood_(per_tensor, modes, rhos, lams, 0.01, 77, grouped=False)
    for a, b, c in zip(grads, per_tensor, clean):
        assert torch.equal(a, b) or c.data_ptr() % 16 != 0
    # The same layout at new addresses (gradients re-allocated): cached plan and layout, new address table.
    moved = [_same_layout(c) for c in clean]
    torch.ops.aegis.flood_(moved, ",".join(modes), rhos, lams, 0.01, 77)
    for a, b in zip(grads, moved):
        assert torch.equal(a, b)


@pytest.mark.gpu
@gpu
def test_gpu_flood_seeded_and_opcheck():
    grads, modes, rhos, lams = _gpu_model_like()
    expect = [_same_layout(g) for g in grads]  # same alignment: same kernels, same bits
    state = torch.tensor([123, 4], device="cuda")
    torch.ops.aegis.flood_seeded_(grads, ",".join(modes), rhos, lams, 0.01, state)
    assert state.tolist() == [123, 5]
    torch.ops.aegis.flood_(expect, ",".join(modes), rhos, lams, 0.01, int(ref.derive_seed(123, 4)))
    assert all(torch.equal(a, b) for a, b in zip(grads, expect))
    g = _grad((33, 20), torch.float32, "cuda")
    torch.library.opcheck(torch.ops.aegis.flood.default, (g, "rows", 0.3, 1.0, 0.01, 42, 8))
    torch.library.opcheck(torch.ops.aegis.flood.default, (g.t(), "matrix", 0.0, 8.0, 0.01, 2**61, 0))
    torch.library.opcheck(torch.ops.aegis.noise.default, ([3, 5], 11, 8, torch.device("cuda")))
    small = [t.clone() for t in _model_like("cuda")[0]]
    torch.library.opcheck(torch.ops.aegis.flood_.default, (small, ",".join(_model_like()[1]), _model_like()[2], _model_like()[3], 0.01, 7))
    compiled = torch.compile(lambda x: torch.ops.aegis.flood(x, "rows", 0.3, 1.0, 0.01, 42, 8)[0] * 2, fullgraph=True)
    assert torch.equal(compiled(g), torch.ops.aegis.flood(g, "rows", 0.3, 1.0, 0.01, 42, 8)[0] * 2)


@pytest.mark.gpu
@gpu
def test_gpu_cuda_graph_replay_draws_fresh_noise_and_equals_eager():
    grads, modes, rhos, lams = _gpu_model_like()
    modes = ",".join(modes)
    clean = [_same_layout(g) for g in grads]
    state = torch.tensor([987654321, 0], device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up: compiles kernels, caches the grouped tables
        torch.ops.aegis.flood_seeded_(grads, modes, rhos, lams, 0.01, state)
    torch.cuda.current_stream().wait_stream(stream)
    state[1] = 10
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for g, c in zip(grads, clean):
            g.copy_(c)
        torch.ops.aegis.flood_seeded_(grads, modes, rhos, lams, 0.01, state)
    assert state[1].item() == 10  # capture does not run the work
    replays = []
    for k in range(3):
        graph.replay()
        replays.append([g.clone() for g in grads])
        assert state[1].item() == 11 + k
    for k, got in enumerate(replays):
        eager = [_same_layout(c) for c in clean]
        TF.flood_(eager, modes, rhos, lams, 0.01, int(ref.derive_seed(987654321, 10 + k)))
        bad = [(i, tuple(a.shape), a.dtype, (a.float() - b.float()).abs().max().item())
               for i, (a, b) in enumerate(zip(got, eager)) if not torch.equal(a, b)]
        assert not bad, f"replay {k} differs from eager: {bad}"
    assert not torch.equal(replays[0][1], replays[1][1])  # fresh noise on every replay


def _same_layout(t):
    """A copy of t with the same strides and 16-byte misalignment (so it groups the same way)."""
    pad = (t.data_ptr() % 16) // t.element_size()
    size = sum((s - 1) * st for s, st in zip(t.shape, t.stride())) + 1 if t.numel() else 0
    buf = torch.empty(pad + size, dtype=t.dtype, device=t.device)
    out = buf.as_strided(t.shape, t.stride(), pad)
    out.copy_(t)
    return out


@pytest.mark.gpu
@gpu
def test_gpu_shield_mask_is_graph_capturable():
    """shield.mask_() (device_seed mode) on a tiny GPT-2: replays advance the seed, equal eager."""
    transformers = pytest.importorskip("transformers")
    import aegis
    from aegis.config import AegisConfig

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=320, n_positions=32, n_embd=64, n_layer=2, n_head=2)
    model = transformers.GPT2LMHeadModel(cfg).cuda()
    shield = aegis.protect(model, config=AegisConfig(seed=12345, device_seed=True))
    ids = torch.randint(0, 320, (2, 16), device="cuda")
    model(input_ids=ids, labels=ids).loss.backward()
    params = [p for p in model.parameters() if p.grad is not None]
    clean = [p.grad.clone() for p in params]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        shield.mask_()  # warm-up
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for p, c in zip(params, clean):
            p.grad.copy_(c)
        shield.mask_()
    state = shield._state
    results, steps = [], []
    for _ in range(3):
        steps.append(state[1].item())
        graph.replay()
        results.append([p.grad.clone() for p in params])
    assert state[1].item() == steps[-1] + 1 and len(set(steps)) == 3
    assert not torch.equal(results[0][0], results[1][0])
    for step, got in zip(steps, results):
        for p, c in zip(params, clean):
            p.grad.copy_(c)
        state[1] = step
        shield.mask_()  # eager, same state
        assert all(torch.equal(p.grad, r) for p, r in zip(params, got))


def _tiny_gpt2_on_gpu():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=320, n_positions=32, n_embd=64, n_layer=2, n_head=2)
    model = transformers.GPT2LMHeadModel(cfg).cuda()
    return model, torch.randint(0, 320, (2, 16), device="cuda")


@pytest.mark.gpu
@gpu
def test_gpu_graphed_mask_equals_eager_and_replays():
    """cuda_graph=True: captured on the 2nd call with the same gradient addresses,
    replayed after; every export bitwise equal to the eager op path's under the same seed, also when
    the gradients move to new tensors and it falls back to eager, then recaptures."""
    import aegis
    from aegis.config import AegisConfig

    model, ids = _tiny_gpt2_on_gpu()
    graphed = aegis.protect(model, config=AegisConfig(seed=7, cuda_graph=True))
    eager = aegis.protect(model, config=AegisConfig(seed=7))
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
        for n, p in model.named_parameters():
            if n in clean:
                p.grad.copy_(clean[n])
        eager.mask_()
        want = eager.export()
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want), step
        exports.append(got)
        if step == 2:
            assert (graphed._graphed.captures, graphed._graphed.replays) == (1, 1)
    # eager 0, capture 1, replay 2 3, eager 4 (new addresses), capture 5, replay 6 7
    assert graphed._graphed.disabled is None and graphed._graphed.captures == 2 and graphed._graphed.replays == 4
    name = "transformer.h.0.mlp.c_fc.weight"
    assert not torch.equal(exports[2][name], exports[3][name])  # fresh noise on every replay


@pytest.mark.gpu
@gpu
def test_gpu_graphed_mask_secret_seed_is_fresh_per_replay():
    import aegis

    model, ids = _tiny_gpt2_on_gpu()
    shield = aegis.protect(model, config=aegis.AegisConfig(cuda_graph=True))
    model(input_ids=ids, labels=ids).loss.backward()
    clean = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    outs = []
    for _ in range(4):
        for n, p in model.named_parameters():
            if n in clean:
                p.grad.copy_(clean[n])
        shield.mask_()
        outs.append(shield.export()["transformer.wte.weight"])
    assert shield._graphed.replays == 2
    diffs = [(outs[i] - outs[j]).abs().max().item() for i in range(4) for j in range(i)]
    assert min(diffs) > 0  # no two steps share noise


def test_group_tables_rebuild_only_addresses_when_gradients_move():
    """zero_grad(set_to_none=True) moves gradients every step: the table's layout part is reused and
    its address part is new; the table reads [addresses, numels, stream counters, first tiles]."""
    a = [torch.zeros(3, 70000), torch.zeros(129)]
    b = [t.clone() for t in a]
    rhos, lams, cbases = [0.0, 0.3], [8.0, 4.0], [0, 52500]
    meta_a, params_a, tiles_a, first, chunks, _ = TF._group_tables(a, rhos, lams, cbases)
    meta_b, params_b, tiles_b, first_b, _, _ = TF._group_tables(b, rhos, lams, cbases)
    assert meta_a.tolist() == [t.data_ptr() for t in a] + [210000, 129] + cbases + first
    assert meta_b.tolist()[:2] == [t.data_ptr() for t in b] and meta_b.tolist()[2:] == meta_a.tolist()[2:]
    assert params_b is params_a and tiles_b is tiles_a and first_b == first  # layout shared, not rebuilt
    assert torch.equal(params_a, torch.tensor(rhos + lams))
    assert tiles_a.tolist() == [0] * (first[1] - first[0]) + [1] * (first[2] - first[1])
    assert chunks[0][0] == 0 and chunks[-1][1] == 2
    assert TF._group_tables(a, rhos, lams, cbases)[0] is meta_a  # same addresses: cached table
