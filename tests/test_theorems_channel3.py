"""Twins of ``proofs/Aegis/Channel3.lean`` (Theorem 3) on the shipped matrix flood
(``torch.ops.aegis.flood``, fixed key, K independent draws at disjoint stream offsets)."""
from __future__ import annotations

import math

import pytest
import torch

from aegis_kernels import reference as ref
from test_theorems import Z_TOL, assert_mean_close, flood_draws, grad_rows
from test_theorems_mechanism import mean_abs

K = 400
M, N = 9, 11


def _grad(seed: int) -> torch.Tensor:
    return grad_rows(M, N, seed, zero_rows=2)


@pytest.mark.parametrize("calibration", ["public", "batch"])
def test_matrix_decomposition(calibration):
    """channel3_decomposition (_batch): E[out] - G = (rho min(1, c/||G||_F) - 1) G entrywise
    (batch: (rho - 1) G); the SE of each entry's mean is sigma / sqrt K."""
    g = _grad(1)
    g64 = g.double()
    fro = torch.linalg.vector_norm(g64).item()
    rho, lam = 0.3, 1.0
    if calibration == "public":
        sigma, c = 0.5, 0.5 * fro
        params, k = [rho, sigma, c, 0.0], rho * min(1.0, c / fro)
    else:
        params, k = ref.batch_params(g, "matrix", rho, lam, 0.01), rho
        sigma = lam * mean_abs(g64)
    out = flood_draws(g, "matrix", params, K)
    var = torch.full_like(g64, sigma**2)
    assert_mean_close(out - g64, (k - 1) * g64, var, "bias")
    if calibration == "public":  # can fail: the unclipped bias (rho - 1) G is rejected
        with pytest.raises(AssertionError):
            assert_mean_close(out - g64, (rho - 1) * g64, var, "unclipped bias")


@pytest.mark.parametrize("seed", [0, 3])
def test_matrix_frobenius_second_moment(seed):
    """channel3_frobenius_second_moment (_batch): E||out||_F^2 = k^2 ||G||_F^2 + m n sigma^2 with
    k = rho min(1, c/||G||_F), sigma public; batch: rho^2 ||G||_F^2 + m n lam^2 m_bar^2.
    Var ||a + sigma z||_F^2 = 4 sigma^2 ||a||^2 + 2 m n sigma^4."""
    g = _grad(seed)
    g64 = g.double()
    fro2 = g64.pow(2).sum().item()
    mn = g.numel()
    rho, lam = 0.3, 8.0
    for params, k, sigma in (
        ([rho, 0.2, 0.7 * math.sqrt(fro2), 0.0], rho * 0.7, 0.2),
        (ref.batch_params(g, "matrix", rho, lam, 0.01), rho, lam * mean_abs(g64)),
    ):
        y = flood_draws(g, "matrix", params, K).pow(2).sum((1, 2))
        mean = k**2 * fro2 + mn * sigma**2
        var = 4 * sigma**2 * k**2 * fro2 + 2 * mn * sigma**4
        assert_mean_close(y, mean, var, "Frobenius second moment")


@pytest.mark.parametrize("calibration", ["public", "batch"])
def test_matrix_bias_frobenius(calibration):
    """channel3_bias_frobenius_batch (Theorem 3 (1)): ||E out - G||_F = (1 - rho) ||G||_F; with the
    clip (channel3_bias_frobenius): (1 - rho min(1, c/||G||_F)) ||G||_F. The mean of K draws has
    E||mean - G||_F^2 = (1 - k)^2 ||G||_F^2 + m n sigma^2 / K, and ||a + s z||^2 (s = sigma/sqrt K)
    has variance 4 s^2 ||a||^2 + 2 m n s^4. Control: rho ||G||_F in place of (1 - rho) ||G||_F."""
    g = _grad(5)
    g64 = g.double()
    fro2 = g64.pow(2).sum().item()
    mn, rho, lam = g.numel(), 0.3, 1.0
    if calibration == "public":
        sigma, c = 0.5, 0.5 * math.sqrt(fro2)
        params, k = [rho, sigma, c, 0.0], rho * 0.5
    else:
        params, k = ref.batch_params(g, "matrix", rho, lam, 0.01), rho
        sigma = lam * mean_abs(g64)
    out = flood_draws(g, "matrix", params, K)
    bias2 = (out.mean(0) - g64).pow(2).sum().item() - mn * sigma**2 / K
    s2 = sigma**2 / K
    se = math.sqrt(4 * s2 * (1 - k) ** 2 * fro2 + 2 * mn * s2**2)
    assert abs(bias2 - (1 - k) ** 2 * fro2) <= Z_TOL * se + 1e-9 * fro2
    assert abs(bias2 - k**2 * fro2) > Z_TOL * se  # the control is rejected


@pytest.mark.parametrize("seed", [0, 2])
def test_matrix_relative_inflation_general_c(seed):
    """channel3_relative_inflation (the paper's Theorem 3 (3)): ||G||_F <= C m_bar gives
    0 <= (E||out||_F^2 - m n sigma^2) / (m n sigma^2) <= rho^2 C^2 / (m n lam^2). With the smallest
    C = ||G||_F / m_bar the bound is an equality, so the estimate from the shipped flood lies within
    6 SE of it (both sides), and a smaller C (0.8 C*) is violated by the same data."""
    g = _grad(seed)
    g64 = g.double()
    mn, rho, lam = g.numel(), 0.3, 0.5
    fro2 = g64.pow(2).sum().item()
    mbar = mean_abs(g64)
    sigma = lam * mbar
    c_star = math.sqrt(fro2) / mbar
    bound = rho**2 * c_star**2 / (mn * lam**2)
    assert rho**2 * fro2 / (mn * sigma**2) == pytest.approx(bound, rel=1e-12)
    y = flood_draws(g, "matrix", ref.batch_params(g, "matrix", rho, lam, 0.01), K).pow(2).sum((1, 2))
    var = 4 * sigma**2 * rho**2 * fro2 + 2 * mn * sigma**4
    estimate = (y.mean().item() - mn * sigma**2) / (mn * sigma**2)
    tol = Z_TOL * math.sqrt(var / K) / (mn * sigma**2) + 1e-5
    assert -tol <= estimate <= bound + tol and abs(estimate - bound) <= tol
    assert estimate > rho**2 * (0.8 * c_star) ** 2 / (mn * lam**2) + tol


@pytest.mark.parametrize("seed", [0, 2])
def test_matrix_relative_inflation(seed):
    """channel3_relative_inflation_mn (corollary, C = m n): ratio <= rho^2 (m n)^2 / (m n lam^2); a one-entry
    matrix attains it (C = m n is the mechanism's constant). channel3_relative_inflation_public: ratio
    <= (rho c)^2 / (m n sigma^2). Both exactly and as estimated from the shipped flood (6 SE)."""
    g = _grad(seed)
    g64 = g.double()
    mn, rho, lam = g.numel(), 0.3, 1.0
    fro2 = g64.pow(2).sum().item()
    sigma = lam * mean_abs(g64)
    bound = rho**2 * mn**2 / (mn * lam**2)
    assert rho**2 * fro2 / (mn * sigma**2) <= bound
    y = flood_draws(g, "matrix", ref.batch_params(g, "matrix", rho, lam, 0.01), K).pow(2).sum((1, 2))
    var = 4 * sigma**2 * rho**2 * fro2 + 2 * mn * sigma**4
    estimate = (y.mean().item() - mn * sigma**2) / (mn * sigma**2)
    assert estimate <= bound + Z_TOL * math.sqrt(var / K) / (mn * sigma**2)
    one = torch.zeros(M, N, dtype=torch.float64)
    one[4, 5] = 2.0
    ratio_one = rho**2 * 4.0 / (mn * (lam * mean_abs(one)) ** 2)
    assert ratio_one == pytest.approx(bound, rel=1e-12)  # attained: no smaller C

    sigma, c = 0.2, 0.4 * math.sqrt(fro2)
    k = rho * min(1.0, c / math.sqrt(fro2))
    bound = (rho * c) ** 2 / (mn * sigma**2)
    assert k**2 * fro2 / (mn * sigma**2) <= bound * (1 + 1e-12)
    y = flood_draws(g, "matrix", [rho, sigma, c, 0.0], K).pow(2).sum((1, 2))
    var = 4 * sigma**2 * k**2 * fro2 + 2 * mn * sigma**4
    estimate = (y.mean().item() - mn * sigma**2) / (mn * sigma**2)
    assert estimate <= bound + Z_TOL * math.sqrt(var / K) / (mn * sigma**2)
    assert rho**2 * fro2 / (mn * sigma**2) > bound  # unclipped: the public bound would fail
