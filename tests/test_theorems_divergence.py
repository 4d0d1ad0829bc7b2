"""Twins of ``proofs/Aegis/Divergence.lean`` and of the KL lemmas of ``Model.lean``: what the
paper's "indistinguishable rows" can mean. The log-likelihood ratios are computed with scipy's
normal densities (an implementation independent of the Lean formula) on the shipped rows flood.

For out = a + sigma z (z ~ N(0, I)), LLR(out) = sum_i log N(out_i; a_i, sigma^2) / N(out_i; b_i, sigma^2)
= (||a - b||^2 + 2 sigma <a - b, z>) / (2 sigma^2): mean ||a - b||^2 / (2 sigma^2), variance
||a - b||^2 / sigma^2 exactly."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy import integrate, stats

from aegis_kernels import reference as ref
from test_theorems import Z_TOL, assert_mean_close, flood_draws, grad_rows
from test_theorems_mechanism import batch_rows, row_coef

K = 400
V, D = 12, 16


def llr(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, sigma: float) -> torch.Tensor:
    """Per draw and row: sum_i log N(out_i; a_i, sigma^2) - log N(out_i; b_i, sigma^2) (scipy)."""
    x = out.numpy()
    diff = stats.norm.logpdf(x, a.numpy(), sigma) - stats.norm.logpdf(x, b.numpy(), sigma)
    return torch.from_numpy(diff.sum(-1))


@pytest.mark.parametrize(("a", "b", "v"), [(0.0, 1.0, 1.0), (0.3, -0.2, 0.05), (2.0, 2.0, 3.0), (-1.5, 0.5, 7.0)])
def test_gaussian_kl_from_the_densities(a, b, v):
    """gaussLogLR_eq: log(p_a(x) / p_b(x)) = ((x - b)^2 - (x - a)^2) / (2v) pointwise;
    kl_gaussianReal_same_var: the integral of p_a log(p_a / p_b) (quadrature) is (a - b)^2 / (2v);
    kl_gaussianReal_sum and the product step it stands for: for N(a, v I) vs N(b, v I) the joint
    densities (scipy's multivariate normal) give ||a - b||^2 / (2v), estimated by Monte Carlo within
    6 SE (variance ||a - b||^2 / v). Control: the same data rejects ||a - b||^2 / (2 v d)."""
    s = math.sqrt(v)
    x = np.linspace(a - 8 * s, a + 8 * s, 101)
    lhs = stats.norm.logpdf(x, a, s) - stats.norm.logpdf(x, b, s)
    assert np.allclose(lhs, ((x - b) ** 2 - (x - a) ** 2) / (2 * v), rtol=1e-10, atol=1e-10)

    def integrand(t: float) -> float:
        return stats.norm.pdf(t, a, s) * (stats.norm.logpdf(t, a, s) - stats.norm.logpdf(t, b, s))

    kl, _ = integrate.quad(integrand, a - 40 * s, a + 40 * s, points=[a], limit=200)
    assert kl == pytest.approx((a - b) ** 2 / (2 * v), rel=1e-7, abs=1e-10)

    d, n = 8, 20000
    rng = np.random.default_rng(11)
    av = a + rng.standard_normal(d)
    bv = b + rng.standard_normal(d)
    per_coord = [integrate.quad(lambda t, ai=ai, bi=bi: stats.norm.pdf(t, ai, s)
                                * (stats.norm.logpdf(t, ai, s) - stats.norm.logpdf(t, bi, s)),
                                ai - 40 * s, ai + 40 * s, points=[ai], limit=200)[0] for ai, bi in zip(av, bv)]
    exact = float(((av - bv) ** 2).sum() / (2 * v))
    assert sum(per_coord) == pytest.approx(exact, rel=1e-7)
    xs = rng.multivariate_normal(av, v * np.eye(d), size=n)
    joint = (stats.multivariate_normal.logpdf(xs, av, v * np.eye(d))
             - stats.multivariate_normal.logpdf(xs, bv, v * np.eye(d)))
    se = math.sqrt(float(((av - bv) ** 2).sum()) / v / n)
    assert abs(joint.mean() - exact) <= Z_TOL * se + 1e-9
    assert abs(joint.mean() - exact / d) > Z_TOL * se  # no 1/d


@pytest.mark.parametrize("calibration", ["public", "batch"])
def test_row_llr_against_absent_row(calibration):
    """channel2_row_kl_absent_public / _batch: on the shipped rows flood, the expected LLR of "row v
    carries k g_v" against "row v is pure noise" is k^2 ||g_v||^2 / (2 sigma^2), with k the row's
    coefficient (0 on inactive rows, where the LLR is exactly 0). Control: the d-scaled value
    k^2 ||g_v||^2 / (2 d sigma^2) that Theorem 2's ratio would suggest is rejected."""
    g = grad_rows(V, D, seed=3, zero_rows=3)
    g64 = g.double()
    n = torch.linalg.vector_norm(g64, dim=1)
    rho = 0.3
    if calibration == "public":
        sigma, c, thr = 0.05 * n.max().item(), 0.6 * n.max().item(), 0.05 * n.max().item()
        params, coef = [rho, sigma, c, thr], row_coef(rho, c, thr, g64)
    else:
        lam, tau = 0.25, 0.01
        active, _, mbar = batch_rows(g64, tau)
        params, coef, sigma = ref.batch_params(g, "rows", rho, lam, tau), torch.where(active, rho, 0.0), lam * mbar
    a = coef[:, None] * g64
    scores = llr(flood_draws(g, "rows", params, K), a, torch.zeros_like(a), sigma)
    signal = coef**2 * n**2
    assert_mean_close(scores, signal / (2 * sigma**2), signal / sigma**2, "row LLR against absent")
    assert bool((scores[:, coef == 0] == 0).all())
    strong = signal / (2 * sigma**2) > 1.0
    assert bool(strong.any())
    with pytest.raises(AssertionError):
        assert_mean_close(scores[:, strong], signal[strong] / (2 * D * sigma**2), signal[strong] / sigma**2, "1/d")


def test_row_llr_between_candidates():
    """row_expected_llr: a server comparing the flooded rows of the true gradient g against those of
    another candidate g' (both unclipped, every row active) scores ||rho (g_v - g'_v)||^2 / (2 sigma^2)
    per row on average; the reversed test scores the negative (the control)."""
    g = grad_rows(V, D, seed=6)
    g_other = grad_rows(V, D, seed=7)
    rho, sigma = 0.3, 0.2
    a, b = rho * g.double(), rho * g_other.double()
    out = flood_draws(g, "rows", [rho, sigma, math.inf, 0.0], K)
    sep = (a - b).pow(2).sum(-1)
    assert_mean_close(llr(out, a, b, sigma), sep / (2 * sigma**2), sep / sigma**2, "LLR g vs g'")
    with pytest.raises(AssertionError):
        assert_mean_close(llr(out, b, a, sigma), sep / (2 * sigma**2), sep / sigma**2, "reversed")
