"""Property tests of every identity the floods promise (DESIGN §1; Theorems 2-3, Proposition 1).

Statistical checks use 6-sigma bounds computed from the exact variance of the estimator under
Gaussian noise, with fixed seeds; deterministic checks use fp32 rounding bounds.
"""
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import aegis_kernels
from aegis_kernels import reference as ref

EPS32 = torch.finfo(torch.float32).eps
SETTINGS = settings(max_examples=25, deadline=None, derandomize=True)


def _grad(v: int, d: int, seed: int, zero_rows: int = 0) -> torch.Tensor:
    g = torch.randn(v, d, generator=torch.Generator().manual_seed(seed))
    g[:zero_rows] = 0  # rows of tokens absent from the batch
    return g


shapes = st.tuples(st.integers(1, 40), st.integers(1, 24))
params = st.tuples(
    st.floats(0.0, 1.0), st.floats(0.05, 8.0), st.sampled_from([0.0, 0.01, 0.2]), st.integers(0, 2**62 - 1)
)


@SETTINGS
@given(shapes, params, st.integers(0, 5))
def test_rows_fixed_noise_identity(shape, p, zero_rows):
    """out - sigma Z == rho G on active rows, out == sigma Z elsewhere (exact up to fp32 rounding)."""
    rho, lam, tau, seed = p
    g = _grad(*shape, seed=seed % 1000, zero_rows=min(zero_rows, shape[0]))
    z = ref.noise(shape, seed, 0)
    out, stats = ref.flood(g, "rows", rho, lam, tau, z=z)
    m_bar, sigma, count, peak = stats
    norms = g.norm(dim=1)
    active = norms > tau * norms.max()
    assert int(count) == int(active.sum())
    assert torch.isclose(peak, norms.max())
    assert torch.isclose(m_bar, norms[active].mean() if active.any() else torch.tensor(0.0))
    assert sigma == lam * m_bar
    noise_part = sigma * z
    assert torch.equal(out[~active], noise_part[~active])
    bound = 2 * EPS32 * (rho * g.abs() + noise_part.abs())
    assert ((out - noise_part - rho * g)[active].abs() <= bound[active]).all()


@SETTINGS
@given(shapes, params)
def test_matrix_fixed_noise_identity(shape, p):
    rho, lam, _, seed = p
    g = _grad(*shape, seed=seed % 1000)
    z = ref.noise(shape, seed, 0)
    out, (m_bar, sigma) = ref.flood(g, "matrix", rho, lam, 0.0, z=z)
    assert torch.isclose(m_bar, g.abs().mean())
    assert sigma == lam * m_bar
    assert ((out - sigma * z - rho * g).abs() <= 2 * EPS32 * (rho * g.abs() + (sigma * z).abs())).all()


@SETTINGS
@given(shapes, params, st.integers(0, 5))
def test_all_rows_nonzero(shape, p, zero_rows):
    """With sigma > 0 every row of the rows flood is non-zero (Theorem 2)."""
    rho, lam, tau, seed = p
    g = _grad(*shape, seed=seed % 1000, zero_rows=min(zero_rows, shape[0] - 1))
    out, stats = torch.ops.aegis.flood(g, "rows", rho, lam, tau, seed, 0)
    assert stats[1] > 0
    assert (out != 0).any(dim=1).all()


def _draws(g, mode, rho, lam, tau, k):
    outs = [torch.ops.aegis.flood(g, mode, rho, lam, tau, 1000 + i, 0)[0] for i in range(k)]
    return torch.stack(outs).double()


@pytest.mark.parametrize("rho,lam", [(0.3, 1.0), (0.0, 8.0), (1.0, 0.5)])
def test_rows_second_moment(rho, lam):
    """E||out_v||^2 = rho^2 ||g_v||^2 [v in S] + d lam^2 m_bar^2, per row, 6 sigma from the exact variance."""
    g = _grad(12, 16, seed=3, zero_rows=4)
    k, d = 400, g.shape[1]
    outs = _draws(g, "rows", rho, lam, 0.01, k)
    _, stats = ref.flood(g, "rows", rho, lam, 0.01, z=torch.zeros_like(g))
    sigma = float(stats[1])
    signal = (rho**2 * g.double().pow(2).sum(1)) * (g.norm(dim=1) > 0.01 * g.norm(dim=1).max()).double()
    expected = signal + d * sigma**2
    # Var ||a + s z||^2 = 4 s^2 ||a||^2 + 2 d s^4 for z ~ N(0, I_d)
    var = 4 * sigma**2 * signal + 2 * d * sigma**4
    estimate = outs.pow(2).sum(-1).mean(0)
    assert ((estimate - expected).abs() <= 6 * (var / k).sqrt()).all()


@pytest.mark.parametrize("rho,lam", [(0.3, 1.0), (0.0, 8.0)])
def test_matrix_second_moment(rho, lam):
    """E||out||_F^2 = rho^2 ||G||_F^2 + n lam^2 m_bar^2 (n entries)."""
    g = _grad(9, 11, seed=5)
    k, n = 400, g.numel()
    outs = _draws(g, "matrix", rho, lam, 0.0, k)
    sigma = lam * float(g.abs().mean())
    signal = rho**2 * float(g.double().pow(2).sum())
    expected = signal + n * sigma**2
    var = 4 * sigma**2 * signal + 2 * n * sigma**4
    estimate = float(outs.pow(2).sum((1, 2)).mean())
    assert abs(estimate - expected) <= 6 * math.sqrt(var / k)


@pytest.mark.parametrize("mode", ["rows", "matrix"])
def test_bias_decomposition(mode):
    """E[out] - G = (rho - 1) G (on active rows for rows mode) and ||(rho-1)G|| = (1-rho)||G||."""
    rho, lam, k = 0.3, 1.0, 400
    g = _grad(10, 12, seed=9)
    outs = _draws(g, mode, rho, lam, 0.0, k)
    sigma = float(torch.ops.aegis.flood(g, mode, rho, lam, 0.0, 0, 0)[1][1])
    bias = outs.mean(0) - g.double()
    assert ((bias - (rho - 1) * g.double()).abs() <= 6 * sigma / math.sqrt(k)).all()
    assert math.isclose(float(((rho - 1) * g.double()).norm()), (1 - rho) * float(g.double().norm()), rel_tol=1e-12)


@SETTINGS
@given(shapes, params)
def test_relative_inflation_bound(shape, p):
    """rho^2 ||g_v||^2 / (d sigma^2) <= rho^2 C^2 / (d lam^2) whenever ||g_v|| <= C m_bar."""
    rho, lam, tau, seed = p
    g = _grad(*shape, seed=seed % 1000)
    _, (m_bar, sigma, _, peak) = ref.flood(g, "rows", rho, lam, tau, z=torch.zeros_like(g))
    d = shape[1]
    c = float(peak / m_bar)  # the tightest C for this gradient
    ratio = rho**2 * g.double().pow(2).sum(1) / (d * float(sigma) ** 2)
    assert (ratio <= rho**2 * c**2 / (d * lam**2) * (1 + 1e-5)).all()


def test_noise_is_standard_normal():
    n = 200_000
    z = torch.ops.aegis.noise([n], 12345, 0, torch.device("cpu")).double()
    assert abs(float(z.mean())) <= 6 / math.sqrt(n)
    assert abs(float(z.var()) - 1) <= 6 * math.sqrt(2 / n)
    assert float(z.abs().max()) <= math.sqrt(-2 * math.log(2.0**-21)) + 1e-4  # the 20-bit radius's floor


def test_noise_offsets_address_one_stream():
    """Element i at offset o is element o + i of the stream: tensors at disjoint offsets share nothing."""
    whole = ref.noise((64,), 77, 0)
    assert torch.equal(ref.noise((20,), 77, 24), whole[24:44])
    assert aegis_kernels.stream_offsets([5, 3, 0, 8]) == [0, 8, 16, 16]


def test_fresh_seeds_are_independent():
    """Two calls with fresh secret seeds: sample correlation within 6 sigma (1/sqrt(n-1)) of 0."""
    import secrets

    n = 100_000
    a, b = (torch.ops.aegis.noise([n], secrets.randbits(62), 0, torch.device("cpu")).double() for _ in range(2))
    r = float(torch.corrcoef(torch.stack((a, b)))[0, 1])
    assert abs(r) <= 6 / math.sqrt(n - 1)


@pytest.mark.parametrize("mode", ["rows", "matrix"])
def test_same_seed_reproduces_bitwise(mode):
    g = _grad(7, 5, seed=1)
    a = torch.ops.aegis.flood(g, mode, 0.3, 1.0, 0.01, 99, 8)
    b = torch.ops.aegis.flood(g, mode, 0.3, 1.0, 0.01, 99, 8)
    c = torch.ops.aegis.flood(g, mode, 0.3, 1.0, 0.01, 100, 8)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], c[0])


# -- edge cases of DESIGN §1 ---------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["rows", "matrix"])
def test_all_zero_gradient(mode):
    out, stats = torch.ops.aegis.flood(torch.zeros(6, 4), mode, 0.3, 1.0, 0.01, 5, 0)
    assert torch.equal(out, torch.zeros(6, 4))
    assert torch.equal(stats, torch.zeros_like(stats))


@pytest.mark.parametrize("mode", ["rows", "matrix"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_poisons_everything(mode, bad):
    g = _grad(6, 4, seed=2)
    g[3, 1] = bad
    out, stats = torch.ops.aegis.flood(g, mode, 0.3, 1.0, 0.01, 5, 0)
    assert out.isnan().all() and stats.isnan().all()


@pytest.mark.parametrize("mode", ["rows", "matrix"])
@pytest.mark.parametrize("shape", [(0, 4), (4, 0), (0, 0)])
def test_empty(mode, shape):
    out, stats = torch.ops.aegis.flood(torch.zeros(shape), mode, 0.3, 1.0, 0.01, 5, 0)
    assert out.shape == shape and torch.equal(stats, torch.zeros_like(stats))


@pytest.mark.parametrize("mode", ["rows", "matrix"])
def test_non_contiguous_matches_contiguous(mode):
    g = _grad(9, 7, seed=4)
    t = g.t()
    out, stats = torch.ops.aegis.flood(t, mode, 0.3, 1.0, 0.01, 5, 0)
    out2, stats2 = torch.ops.aegis.flood(t.contiguous(), mode, 0.3, 1.0, 0.01, 5, 0)
    assert torch.equal(out, out2) and torch.equal(stats, stats2)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("mode", ["rows", "matrix"])
def test_low_precision_keeps_dtype_and_accumulates_in_fp32(dtype, mode):
    g = _grad(9, 7, seed=6).to(dtype)
    out, stats = torch.ops.aegis.flood(g, mode, 0.3, 1.0, 0.01, 5, 0)
    expect, expect_stats = ref.flood(g.float(), mode, 0.3, 1.0, 0.01, 5, 0)
    assert out.dtype == dtype and stats.dtype == torch.float32
    assert torch.equal(out, expect.to(dtype)) and torch.equal(stats, expect_stats)


def test_tied_head_small_dense_rows_are_dropped():
    """Rows below tau * max (a tied head's dense softmax rows) carry no signal: pure noise there."""
    g = torch.full((8, 4), 1e-4)
    g[2] = 1.0
    z = ref.noise((8, 4), 3, 0)
    out, stats = ref.flood(g, "rows", 0.3, 1.0, 0.01, z=z)
    assert int(stats[2]) == 1
    assert torch.equal(out[3], stats[1] * z[3])


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(mode="cols"), "mode"),
        (dict(rho=-0.1), "rho"),
        (dict(lam=float("nan")), "lam"),
        (dict(rel_threshold=1.0), "rel_threshold"),
        (dict(offset=4), "multiples of 8"),
    ],
)
def test_bad_parameters_are_named(kwargs, match):
    args = dict(mode="rows", rho=0.3, lam=1.0, rel_threshold=0.01, seed=1, offset=0) | kwargs
    with pytest.raises(ValueError, match=match):
        torch.ops.aegis.flood(torch.ones(3, 3), **args)


def test_rows_needs_a_matrix_and_sparse_is_rejected():
    with pytest.raises(ValueError, match="mode='matrix'"):
        torch.ops.aegis.flood(torch.ones(3), "rows", 0.3, 1.0, 0.01, 1, 0)
    with pytest.raises(ValueError, match="sparse=False"):
        ref.flood(torch.ones(3, 3).to_sparse(), "rows", 0.3, 1.0, 0.01, 1, 0)


def test_discrete_stream_law_has_the_normal_moments():
    """Over all 2^32 values of a word (radius cells x angles, taken exactly in float64), one lane of
    the stream has mean 0, variance 1 - 3.3e-7 and fourth moment 3 - 1.6e-5: the 12-bit angle lattice
    averages cos^2 and cos^4 exactly, the 20-bit radius is a midpoint rule of E[r^2] and E[r^4]."""
    k = torch.arange(1 << (32 - ref.ANGLE_BITS), dtype=torch.float64)
    r2 = -2.0 * torch.log((k + 0.5) * ref.RADIUS_STEP)
    theta = torch.arange(1 << ref.ANGLE_BITS, dtype=torch.float64) * ref.ANGLE_STEP
    cos = torch.cos(theta)
    assert abs(float(cos.mean())) < 1e-12
    m2 = float(r2.mean()) * float((cos**2).mean())
    m4 = float((r2**2).mean()) * float((cos**4).mean())
    assert abs(m2 - 1) < 1e-6 and abs(m4 - 3) < 5e-5
