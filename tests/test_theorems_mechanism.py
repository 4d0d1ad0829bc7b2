"""Twins of ``proofs/Aegis/Mechanism.lean``: its definitions are the shipped floods, and the
batch calibration gives the constants the paper assumed (``C = 1/tau`` rows, ``C = m n`` matrix),
the public one ``||rho clip(g)|| <= rho c``."""
from __future__ import annotations

import math

import pytest
import torch

from aegis_kernels import reference as ref
from test_theorems import KEY, grad_rows

F32 = 2.0**-24


# ----------------------------------------------------------------------------- the Lean definitions in float64
def clip_scale(c: float, r: torch.Tensor) -> torch.Tensor:
    """Mechanism.clipScale: 1 if r <= c else c / r."""
    return torch.where(r <= c, torch.ones_like(r), c / r.clamp_min(1e-300))


def row_coef(rho: float, c: float, thr: float, g: torch.Tensor) -> torch.Tensor:
    """Mechanism.rowCoef for every row of g."""
    n = torch.linalg.vector_norm(g, dim=1)
    return torch.where(thr < n, rho * clip_scale(c, n), torch.zeros_like(n))


def batch_rows(g: torch.Tensor, tau: float) -> tuple[torch.Tensor, float, float]:
    """Mechanism.peak, active, mbarRows: (S mask, M, m_bar)."""
    n = torch.linalg.vector_norm(g, dim=1)
    peak = n.max().item() if n.numel() else 0.0
    active = tau * peak < n
    mbar = n[active].sum().item() / active.sum().item() if active.any() else 0.0
    return active, peak, mbar


def mean_abs(g: torch.Tensor) -> float:
    """Mechanism.meanAbs."""
    return g.abs().sum().item() / g.numel()


# ----------------------------------------------------------------------------- definitions = shipped floods
@pytest.mark.parametrize("seed", range(4))
def test_lean_floods_are_the_shipped_floods(seed):
    """floodRows / floodMatrix (public) and floodRowsBatch / floodMatrixBatch (batch) computed from
    the Lean definitions equal ``reference.flood`` with the same noise, to fp32 rounding."""
    g = grad_rows(20, 12, seed, zero_rows=3)
    g64 = g.double()
    z = ref.noise(g.shape, KEY, 0, torch.bfloat16)  # one normal per element: flood(z=z) adds sigma z
    z64 = z.double()
    n = torch.linalg.vector_norm(g64, dim=1)
    rho, sigma, c, thr = 0.3, 0.7, 0.8 * n.max().item(), 0.05 * n.max().item()
    out, _ = ref.flood(g, "rows", [rho, sigma, c, thr], z=z)
    lean = row_coef(rho, c, thr, g64)[:, None] * g64 + sigma * z64
    assert torch.allclose(out.double(), lean, atol=8 * F32 * (lean.abs().max().item() + 1), rtol=0)

    lam, tau = 2.0, 0.1
    active, _, mbar = batch_rows(g64, tau)
    out, _ = ref.flood(g, "rows", ref.batch_params(g, "rows", rho, lam, tau), z=z)
    lean = torch.where(active, rho, 0.0)[:, None] * g64 + lam * mbar * z64
    assert torch.allclose(out.double(), lean, atol=16 * F32 * (lean.abs().max().item() + 1), rtol=0)

    fro = torch.linalg.vector_norm(g64).item()
    c = 0.5 * fro
    out, _ = ref.flood(g, "matrix", [rho, sigma, c, 0.0], z=z)
    lean = rho * min(1.0, c / fro) * g64 + sigma * z64
    assert torch.allclose(out.double(), lean, atol=8 * F32 * (lean.abs().max().item() + 1), rtol=0)

    out, _ = ref.flood(g, "matrix", ref.batch_params(g, "matrix", rho, lam, tau), z=z)
    lean = rho * g64 + lam * mean_abs(g64) * z64
    assert torch.allclose(out.double(), lean, atol=16 * F32 * (lean.abs().max().item() + 1), rtol=0)


# ----------------------------------------------------------------------------- batch constants
@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("tau", [0.01, 0.3, 0.9])
def test_batch_calibration_constants(seed, tau):
    """mbarRows_pos (0 < m_bar when G != 0, tau < 1), norm_le_mbar_div_tau (||G v|| <= m_bar / tau,
    every row) and froNorm_le_mn_meanAbs (||G||_F <= m n mean|G|), on the shipped statistic."""
    g = grad_rows(16, 10, seed, zero_rows=seed % 4)
    g64 = g.double()
    m_bar_shipped, peak_shipped = ref.statistic(g, "rows", tau).double().tolist()
    _, peak, mbar = batch_rows(g64, tau)
    assert m_bar_shipped == pytest.approx(mbar, rel=1e-5) and peak_shipped == pytest.approx(peak, rel=1e-5)
    assert mbar > 0
    norms = torch.linalg.vector_norm(g64, dim=1)
    assert bool((tau * norms <= mbar * (1 + 1e-12)).all())
    assert bool((norms <= m_bar_shipped / tau * (1 + 1e-5)).all())
    m, n = g.shape
    mean_shipped = ref.statistic(g, "matrix", tau)[0].item()
    assert mean_shipped == pytest.approx(mean_abs(g64), rel=1e-5)
    assert torch.linalg.vector_norm(g64).item() <= m * n * mean_shipped * (1 + 1e-5)


def test_batch_constants_need_their_hypotheses():
    """Controls: tau >= 1 empties S (m_bar = 0, the row bound fails); a one-entry matrix attains
    C = m n, so no smaller constant holds."""
    g = grad_rows(8, 6, seed=3)
    active, _, mbar = batch_rows(g.double(), 1.0)
    assert not bool(active.any()) and mbar == 0.0
    assert ref.statistic(g, "rows", 1.0)[0].item() == 0.0
    one = torch.zeros(5, 7)
    one[2, 3] = -1.5
    fro, mn_mean = torch.linalg.vector_norm(one).item(), 35 * mean_abs(one.double())
    assert fro == pytest.approx(mn_mean, rel=1e-12)
    assert fro > 0.99 * mn_mean


# ----------------------------------------------------------------------------- public constants
@pytest.mark.parametrize("seed", range(4))
def test_clipped_signal_norm_is_public(seed):
    """clipped_norm_le: the signal the flood exports (sigma = 0 isolates it) has row norms
    <= rho c (rows) and Frobenius norm <= rho c (matrix); without the clip it would not."""
    g = grad_rows(24, 16, seed, zero_rows=2, spread=5.0)
    n = torch.linalg.vector_norm(g.double(), dim=1)
    rho, c = 0.3, 0.25 * n.max().item()
    signal, _ = ref.flood(g, "rows", [rho, 0.0, c, 0.0], KEY)
    assert bool((torch.linalg.vector_norm(signal.double(), dim=1) <= rho * c * (1 + 1e-6)).all())
    signal, _ = ref.flood(g, "matrix", [rho, 0.0, c, 0.0], KEY)
    assert torch.linalg.vector_norm(signal.double()).item() <= rho * c * (1 + 1e-6)
    unclipped, _ = ref.flood(g, "rows", [rho, 0.0, math.inf, 0.0], KEY)
    assert torch.linalg.vector_norm(unclipped.double(), dim=1).max().item() > rho * c
