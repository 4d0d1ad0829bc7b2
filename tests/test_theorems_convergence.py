"""Twins of ``proofs/Aegis/Convergence.lean`` (Proposition 1) with the shipped matrix flood of a
gradient vector, on a quadratic f(x) = 1/2 sum_i a_i x_i^2 (exactly L-smooth with L = max a_i,
minimum f* = 0)."""
from __future__ import annotations

import math

import pytest
import torch

from aegis_kernels import reference as ref
from test_theorems import KEY, Z_TOL, assert_mean_close, flood_draws

D = 16
A = torch.linspace(0.2, 2.0, D, dtype=torch.float64)  # curvatures
L = A.max().item()


def f(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * (A * x.pow(2)).sum(-1)


def grad(x: torch.Tensor) -> torch.Tensor:
    return A * x


def coef(rho: float, c: float, g: torch.Tensor) -> float:
    """k = rho min(1, c/||g||), the flood's signal coefficient."""
    n = torch.linalg.vector_norm(g).item()
    return rho * (1.0 if n <= c else c / n)


def test_quadratic_satisfies_the_smoothness_hypothesis():
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(2, 500, D, generator=gen, dtype=torch.float64)
    rhs = f(x) + (grad(x) * (y - x)).sum(-1) + L / 2 * (y - x).pow(2).sum(-1)
    assert bool((f(y) <= rhs + 1e-12).all())


@pytest.mark.parametrize("clip", [0.5, math.inf])
def test_biased_gradient_decomposition(clip):
    """E out = k g (SE sigma / sqrt K per coordinate), bias (k - 1) g, ||E out - g|| = (1 - k)||g||."""
    gen = torch.Generator().manual_seed(1)
    g = torch.randn(D, generator=gen)
    g64 = g.double()
    rho, sigma = 0.3, 0.2
    c = clip * torch.linalg.vector_norm(g64).item()
    k = coef(rho, c, g64)
    out = flood_draws(g, "matrix", [rho, sigma, c, 0.0], 400)
    assert_mean_close(out, k * g64, torch.full_like(g64, sigma**2), "E out = k g")
    bias = k * g64 - g64
    assert torch.linalg.vector_norm(bias).item() == pytest.approx((1 - k) * torch.linalg.vector_norm(g64).item(),
                                                                  rel=1e-12)
    if clip < 1:  # can fail: the unclipped mean rho g is rejected
        with pytest.raises(AssertionError):
            assert_mean_close(out, rho * g64, torch.full_like(g64, sigma**2), "E out = rho g")


@pytest.mark.parametrize("clip", [0.4, math.inf])
def test_descent_step_on_a_quadratic(clip):
    """biased_sgd_descent_step: E f(x - eta out) <= f x - eta k ||g||^2 + L/2 eta^2 (k^2 ||g||^2
    + d sigma^2). For the quadratic E f(x - eta out) = 1/2 sum a_i (b_i^2 + eta^2 sigma^2),
    b = x - eta k g; the shipped flood's sample mean matches it within 6 SE
    (Var = sum a_i^2 (b_i^2 eta^2 sigma^2 + eta^4 sigma^4 / 2)), and it satisfies the bound."""
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(D, generator=gen, dtype=torch.float64)
    g = grad(x)
    rho, sigma, eta = 0.3, 0.3, 0.5
    c = clip * torch.linalg.vector_norm(g).item()
    k = coef(rho, c, g)
    out = flood_draws(g.float(), "matrix", [rho, sigma, c, 0.0], 400)
    y = f(x - eta * out)
    b = x - eta * k * g
    exact = 0.5 * (A * (b.pow(2) + eta**2 * sigma**2)).sum().item()
    var = (A.pow(2) * (b.pow(2) * eta**2 * sigma**2 + eta**4 * sigma**4 / 2)).sum().item()
    assert_mean_close(y, exact, var, "E f(x - eta out)")
    gsq = g.pow(2).sum().item()
    bound = f(x).item() - eta * k * gsq + L / 2 * eta**2 * (k**2 * gsq + D * sigma**2)
    assert exact <= bound + 1e-12
    # can fail: at a stationary point the noise term is what the bound needs
    x0 = torch.zeros(D, dtype=torch.float64)
    assert 0.5 * (A * eta**2 * sigma**2).sum().item() > f(x0).item()


def run_sgd(x0: torch.Tensor, rho: float, sigma: float, c: float, eta: float, steps: int, chains: int):
    """`chains` independent SGD runs on the flooded gradient (fresh shipped noise every step):
    per chain, eta/2 sum_t k_t ||grad f(x_t)||^2."""
    zs = torch.ops.aegis.noise([steps, chains, D], KEY, 0, torch.float32, torch.device("cpu"))
    params = torch.tensor([rho, sigma, c, 0.0])
    x = x0.repeat(chains, 1)
    lhs = torch.zeros(chains, dtype=torch.float64)
    for t in range(steps):
        for j in range(chains):
            g = grad(x[j])
            out, _ = ref.flood(g.float(), "matrix", params, z=zs[t, j])
            lhs[j] += eta / 2 * coef(rho, c, g) * g.pow(2).sum()
            x[j] = x[j] - eta * out.double()
    return lhs


@pytest.mark.parametrize("start", ["far", "optimum"])
def test_telescoped_descent_on_a_quadratic(start):
    """telescope_assumed_expected_descent: eta/2 sum_{t<T} k_t E||grad f(x_t)||^2 <= f(x_0) - f*
    + T L/2 eta^2 d sigma^2 (L eta k_t <= 1). The Lean lemma assumes the per-step recursion; this
    twin runs the shipped flood, where the recursion holds, and checks the telescoped conclusion:
    the mean over chains is below the bound + 6 SE.
    Starting at the optimum, the left side is positive while f(x_0) - f* = 0: the noise term of
    the bound is needed (the control)."""
    rho, sigma, steps, chains = 0.5, 0.3, 20, 48
    eta = 1.0 / (L * rho)
    x0 = torch.full((D,), 2.0, dtype=torch.float64) if start == "far" else torch.zeros(D, dtype=torch.float64)
    c = 4.0
    lhs = run_sgd(x0, rho, sigma, c, eta, steps, chains)
    bound = f(x0).item() + steps * L / 2 * eta**2 * D * sigma**2
    se = lhs.std().item() / math.sqrt(chains)
    assert lhs.mean().item() <= bound + Z_TOL * se
    if start == "optimum":
        assert lhs.mean().item() > Z_TOL * se  # > f(x_0) - f* = 0
