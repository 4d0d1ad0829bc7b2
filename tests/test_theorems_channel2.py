"""Twins of ``proofs/Aegis/Channel2.lean`` (Theorem 2) on the shipped rows flood
(``torch.ops.aegis.flood``, fixed key, K independent draws at disjoint stream offsets).

Exact variance of ||a + sigma z||^2 for z ~ N(0, I_d): 4 sigma^2 ||a||^2 + 2 d sigma^4."""
from __future__ import annotations

import math

import pytest
import torch

from aegis_kernels import reference as ref
from test_theorems import KEY, Z_TOL, assert_mean_close, flood_draws, grad_rows
from test_theorems_mechanism import batch_rows, row_coef

K = 400
V, D = 12, 16


def row_moments(coef: torch.Tensor, g: torch.Tensor, sigma: float) -> tuple[torch.Tensor, torch.Tensor]:
    """E and Var of ||out_v||^2 for out_v = coef_v g_v + sigma z_v (the theorem and its variance)."""
    signal = coef**2 * g.pow(2).sum(1)
    d = g.shape[1]
    return signal + d * sigma**2, 4 * sigma**2 * signal + 2 * d * sigma**4


@pytest.mark.parametrize("seed", [0, 1])
def test_rows_second_moment_public(seed):
    """channel2_second_moment_active / _inactive: E||out_v||^2 = (rho min(1, c/||g_v||))^2 ||g_v||^2
    + d sigma^2 on active rows, d sigma^2 on inactive ones (public rho, sigma, c, thr)."""
    g = grad_rows(V, D, seed, zero_rows=3)
    g64 = g.double()
    n = torch.linalg.vector_norm(g64, dim=1)
    rho, sigma, c, thr = 0.3, 0.05 * n.max().item(), 0.6 * n.max().item(), 0.05 * n.max().item()
    coef = row_coef(rho, c, thr, g64)
    assert bool((coef == 0).any()) and bool((thr < n).any()) and bool((n > c).any())  # all three cases occur
    y = flood_draws(g, "rows", [rho, sigma, c, thr], K).pow(2).sum(-1)
    mean, var = row_moments(coef, g64, sigma)
    assert_mean_close(y, mean, var, "rows second moment")
    # can fail: the unclipped formula rho^2 ||g||^2 + d sigma^2 is rejected on clipped rows
    clipped = n > c
    wrong, _ = row_moments(torch.where(thr < n, rho, 0.0), g64, sigma)
    with pytest.raises(AssertionError):
        assert_mean_close(y[:, clipped], wrong[clipped], var[clipped], "unclipped formula")


@pytest.mark.parametrize("tau", [0.01, 0.3])
def test_rows_second_moment_batch(tau):
    """channel2_second_moment_batch: E||out_v||^2 = rho^2 [v in S] ||g_v||^2 + d (lam m_bar)^2."""
    g = grad_rows(V, D, seed=2, zero_rows=3)
    g64 = g.double()
    rho, lam = 0.3, 1.0
    active, _, mbar = batch_rows(g64, tau)
    y = flood_draws(g, "rows", ref.batch_params(g, "rows", rho, lam, tau), K).pow(2).sum(-1)
    mean, var = row_moments(torch.where(active, rho, 0.0), g64, lam * mbar)
    assert_mean_close(y, mean, var, "batch rows second moment")


@pytest.mark.parametrize("tau", [0.0, 0.2])
def test_rows_relative_inflation_general_c(tau):
    """channel2_relative_inflation (the paper's Theorem 2 (3)): with Assumption 1 for a constant C
    (||g_u|| <= C m_bar on S), 0 <= (E||out_v||^2 - d sigma^2) / (d sigma^2) <= rho^2 C^2 / (d lam^2)
    for every row, tau = 0 included. C* = max_S ||g_u|| / m_bar is the smallest C the gradient
    satisfies; the bound is attained at the largest row, so every C < C* fails (the control).
    Exactly, and as estimated from the shipped flood (6 SE on both sides)."""
    g = grad_rows(V, D, seed=4, zero_rows=2, spread=4.0)
    g64 = g.double()
    rho, lam = 0.3, 0.5
    active, _, mbar = batch_rows(g64, tau)
    n = torch.linalg.vector_norm(g64, dim=1)
    if tau == 0.0:  # tau = 0: exactly the non-zero rows are active
        assert bool((active == (n > 0)).all())
    sigma = lam * mbar
    c_star = (n[active] / mbar).max().item()
    coef = active.double() * rho  # float64: the equality below is checked to 1e-12
    exact_ratio = coef**2 * n**2 / (D * sigma**2)
    bound = rho**2 * c_star**2 / (D * lam**2)
    assert bool((exact_ratio >= 0).all()) and bool((exact_ratio <= bound * (1 + 1e-12)).all())
    assert exact_ratio.max().item() == pytest.approx(bound, rel=1e-12)  # attained
    assert exact_ratio.max().item() > rho**2 * (0.99 * c_star) ** 2 / (D * lam**2)  # smaller C fails
    y = flood_draws(g, "rows", ref.batch_params(g, "rows", rho, lam, tau), K).pow(2).sum(-1)
    _, var = row_moments(coef, g64, sigma)
    estimate = (y.mean(0) - D * sigma**2) / (D * sigma**2)
    tol = Z_TOL * (var / K).sqrt() / (D * sigma**2) + 1e-5
    assert bool((estimate <= bound + tol).all()) and bool((estimate >= -tol).all())


@pytest.mark.parametrize("tau", [0.01, 0.2])
@pytest.mark.parametrize("lam", [0.5, 1.0])
def test_rows_relative_inflation_batch(tau, lam):
    """channel2_relative_inflation_tau (corollary, C = 1/tau): with sigma = lam m_bar,
    (E||out_v||^2 - d sigma^2) / (d sigma^2) <= rho^2 / (d lam^2 tau^2) for every row: exactly from the
    mechanism, and as estimated from the shipped flood (6 SE). Control: C = 1 in place of 1/tau is violated."""
    g = grad_rows(V, D, seed=4, zero_rows=2, spread=4.0)
    g64 = g.double()
    rho = 0.3
    active, peak, mbar = batch_rows(g64, tau)
    sigma = lam * mbar
    bound = rho**2 / (D * lam**2 * tau**2)
    coef = torch.where(active, rho, 0.0)
    exact_ratio = coef**2 * g64.pow(2).sum(1) / (D * sigma**2)
    assert bool((exact_ratio <= bound * (1 + 1e-12)).all())
    y = flood_draws(g, "rows", ref.batch_params(g, "rows", rho, lam, tau), K).pow(2).sum(-1)
    mean, var = row_moments(coef, g64, sigma)
    estimate = (y.mean(0) - D * sigma**2) / (D * sigma**2)
    assert bool((estimate <= bound + Z_TOL * (var / K).sqrt() / (D * sigma**2) + 1e-5).all())
    assert peak > mbar and exact_ratio.max().item() > rho**2 / (D * lam**2)  # C = 1 fails


@pytest.mark.parametrize("seed", [0, 5])
def test_rows_relative_inflation_public(seed):
    """channel2_relative_inflation_public: under public parameters the ratio is at most
    (rho c)^2 / (d sigma^2), whatever the private gradient; without the clip it is not."""
    g = grad_rows(V, D, seed, zero_rows=2, spread=5.0)
    g64 = g.double()
    n = torch.linalg.vector_norm(g64, dim=1)
    rho, sigma, c, thr = 0.3, 0.1 * n.max().item(), 0.3 * n.max().item(), 0.0
    bound = (rho * c) ** 2 / (D * sigma**2)
    coef = row_coef(rho, c, thr, g64)
    exact_ratio = coef**2 * n**2 / (D * sigma**2)
    assert bool((exact_ratio <= bound * (1 + 1e-12)).all())
    y = flood_draws(g, "rows", [rho, sigma, c, thr], K).pow(2).sum(-1)
    _, var = row_moments(coef, g64, sigma)
    estimate = (y.mean(0) - D * sigma**2) / (D * sigma**2)
    assert bool((estimate <= bound + Z_TOL * (var / K).sqrt() / (D * sigma**2) + 1e-5).all())
    unclipped = row_coef(rho, math.inf, thr, g64) ** 2 * n**2 / (D * sigma**2)
    assert unclipped.max().item() > bound


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_no_flooded_row_is_zero(dtype):
    """channel2_rows_nonzero_ae (and _batch): with sigma > 0 no row of the shipped flood is zero,
    active or not; with sigma = 0 the absent tokens' rows stay zero (the hypothesis is needed)."""
    gen = torch.Generator().manual_seed(7)
    g = torch.randn(256, D, generator=gen)
    g[torch.rand(256, generator=gen) < 0.6] = 0.0  # most tokens absent
    g = g.to(dtype)
    n = torch.linalg.vector_norm(g.float(), dim=1)
    for offset in (0, 1 << 20, 1 << 24):
        out, _ = torch.ops.aegis.flood(g, "rows", torch.tensor([0.3, 1e-3, 2.0, 0.01]), KEY, offset)
        assert not bool((out == 0).all(1).any()), "a flooded row is zero"
        out, _ = torch.ops.aegis.flood(g, "rows", ref.batch_params(g, "rows", 0.3, 1.0, 0.01), KEY, offset)
        assert not bool((out == 0).all(1).any()), "a batch-flooded row is zero"
    out, _ = torch.ops.aegis.flood(g, "rows", torch.tensor([0.3, 0.0, 2.0, 0.01]), KEY, 0)
    assert bool((out[n == 0] == 0).all())
