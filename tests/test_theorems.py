"""Python twins of the Lean statements in ``proofs/`` (Theorems 1-3 and Proposition 1).

The Lean proofs cannot be machine-checked on the project's machines (no Lean toolchain), so every
Lean statement has a twin here that *can fail*: a mis-stated theorem (as opposed to a broken
proof) is caught locally.

* exact identities are checked with sympy: expectations of polynomials in independent noise
  coordinates are taken symbolically from their raw moments (mean 0, second moment sigma^2, and
  *free symbols* for the higher moments, so an identity that secretly needs Gaussianity fails);
* inequalities are checked symbolically and in exact rational arithmetic (``fractions``);
* Monte-Carlo checks use fixed seeds / ``derandomize=True`` and a tolerance of 6 standard errors
  computed from the EXACT variance of the estimator (derived symbolically in
  ``test_flood_norm_variance_formula``), never a hand-tuned tolerance;
* static checks on the Lean sources: no ``sorry``/``admit``/``native_decide``/``axiom``, every
  required theorem name is declared, the toolchain matches the pinned Mathlib tag, and the
  README maps every theorem to its twins.

Only numpy, sympy, scipy and hypothesis are used (the ``aegis`` package is deliberately not
imported: these twins restate the mathematics independently of the implementation).
"""

from __future__ import annotations

import math
import re
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import sympy as sp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

ROOT = Path(__file__).resolve().parents[1]
PROOFS = ROOT / "proofs"

SETTINGS = settings(
    derandomize=True,
    max_examples=12,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)

# Number of standard errors allowed in Monte-Carlo checks (CLT two-sided tail ~ 2e-9).
Z_TOL = 6.0

# Lean theorem -> (file under proofs/Aegis, paper statement, twin tests in this module).
LEAN_THEOREMS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "channel1_exported_grad_zero": (
        "Channel1.lean",
        "Theorem 1",
        ("test_channel1_exported_grad_zero_twin",),
    ),
    "channel1_residual_eq_one": (
        "Channel1.lean",
        "Theorem 1",
        ("test_channel1_residual_eq_one_twin", "test_channel1_residual_control_can_fail"),
    ),
    "channel2_second_moment_inactive": (
        "Channel2.lean",
        "Theorem 2",
        ("test_channel2_second_moment_symbolic", "test_channel2_second_moment_monte_carlo",
         "test_channel2_design_rows_flood_monte_carlo"),
    ),
    "channel2_second_moment_active": (
        "Channel2.lean",
        "Theorem 2",
        ("test_channel2_second_moment_symbolic", "test_gaussian_coordinate_second_moment_sympy_stats",
         "test_channel2_second_moment_monte_carlo", "test_channel2_design_rows_flood_monte_carlo"),
    ),
    "channel2_relative_inflation": (
        "Channel2.lean",
        "Theorem 2",
        ("test_relative_inflation_symbolic", "test_channel2_relative_inflation_exact"),
    ),
    "channel2_rows_nonzero_ae": (
        "Channel2.lean",
        "Theorem 2",
        ("test_gaussian_singleton_probability_zero", "test_channel2_rows_nonzero_ae_twin"),
    ),
    "channel3_decomposition": (
        "Channel3.lean",
        "Theorem 3",
        ("test_channel3_decomposition_symbolic", "test_channel3_decomposition_monte_carlo"),
    ),
    "channel3_frobenius_second_moment": (
        "Channel3.lean",
        "Theorem 3",
        ("test_channel3_frobenius_symbolic", "test_channel3_frobenius_monte_carlo"),
    ),
    "channel3_relative_inflation": (
        "Channel3.lean",
        "Theorem 3",
        ("test_relative_inflation_symbolic", "test_channel3_relative_inflation_exact"),
    ),
    "biased_gradient_decomposition": (
        "Convergence.lean",
        "Proposition 1",
        ("test_biased_gradient_decomposition_symbolic", "test_biased_gradient_monte_carlo"),
    ),
}


# --------------------------------------------------------------------------------------------
# static checks on the Lean sources
# --------------------------------------------------------------------------------------------

FORBIDDEN_WORD = re.compile(r"\b(sorry|admit|native_decide)\b")
AXIOM_LINE = re.compile(r"^\s*(?:@\[[^\]]*\]\s*)?(?:private\s+|protected\s+|noncomputable\s+)*axiom\b")


def _lean_files() -> list[Path]:
    files = sorted(PROOFS.rglob("*.lean"))
    lakefile = ROOT / "lakefile.lean"
    if lakefile.exists():
        files.append(lakefile)
    return files


def forbidden_lean_tokens(text: str) -> list[str]:
    """Every `sorry` / `admit` / `native_decide` word and every line starting with `axiom`."""
    hits = []
    for lineno, line in enumerate(text.splitlines(), 1):
        for m in FORBIDDEN_WORD.finditer(line):
            hits.append(f"{lineno}: {m.group(1)}")
        if AXIOM_LINE.match(line):
            hits.append(f"{lineno}: axiom")
    return hits


def test_forbidden_token_scanner_can_fail():
    # the scanner itself must catch what it is meant to catch
    assert forbidden_lean_tokens("theorem x : 1 = 1 := by sorry")
    assert forbidden_lean_tokens("  exact by admit")
    assert forbidden_lean_tokens("example : 2 + 2 = 4 := by native_decide")
    assert forbidden_lean_tokens("axiom bad : False")
    assert forbidden_lean_tokens("private axiom bad : False")
    assert not forbidden_lean_tokens("theorem sorryless_name : True := trivial")


def test_lean_sources_have_no_forbidden_tokens():
    files = _lean_files()
    assert any(f.name == "Aegis.lean" for f in files), "proofs/Aegis.lean is missing"
    problems = {}
    for f in files:
        hits = forbidden_lean_tokens(f.read_text(encoding="utf-8"))
        if hits:
            problems[str(f.relative_to(ROOT))] = hits
    assert not problems, f"forbidden tokens in Lean sources: {problems}"


def test_lean_theorem_names_declared():
    for name, (fname, _, _) in LEAN_THEOREMS.items():
        path = PROOFS / "Aegis" / fname
        text = path.read_text(encoding="utf-8")
        assert re.search(r"^namespace Aegis\b", text, re.M), f"{fname}: no `namespace Aegis`"
        assert re.search(rf"^theorem {re.escape(name)}\b", text, re.M), (
            f"Aegis.{name} is not declared in proofs/Aegis/{fname}"
        )


def test_lean_root_module_imports_everything():
    text = (PROOFS / "Aegis.lean").read_text(encoding="utf-8")
    for module in ("Channel1", "Channel2", "Channel3", "Convergence"):
        assert re.search(rf"^import Aegis\.{module}\s*$", text, re.M), module
    for f in (PROOFS / "Aegis").glob("*.lean"):
        first = f.read_text(encoding="utf-8").lstrip().splitlines()[0]
        assert first.startswith("import "), f"{f.name} must start with its imports"


def test_lean_toolchain_matches_mathlib_tag():
    lakefile = (ROOT / "lakefile.lean").read_text(encoding="utf-8")
    tags = re.findall(r'require\s+"leanprover-community"\s*/\s*"mathlib"\s*@\s*git\s+"([^"]+)"', lakefile)
    assert len(tags) == 1, "exactly one pinned Mathlib require"
    tag = tags[0]
    assert re.fullmatch(r"v4\.\d+\.\d+", tag), f"pin a Mathlib release tag, got {tag!r}"
    assert int(tag.split(".")[1]) >= 21, "Mathlib >= v4.21.0 is needed (kernels_lean.md B5)"
    toolchain = (ROOT / "lean-toolchain").read_text(encoding="utf-8").strip()
    assert toolchain == f"leanprover/lean4:{tag}"
    assert re.search(r'srcDir\s*:=\s*"proofs"', lakefile)
    assert re.search(r"lean_lib\s+«?Aegis»?", lakefile)


def test_proofs_readme_maps_every_theorem():
    readme = (PROOFS / "README.md").read_text(encoding="utf-8")
    assert "not been machine-checked" in readme
    assert "lake exe cache get && lake build" in readme
    module_globals = globals()
    for name, (_, paper, twins) in LEAN_THEOREMS.items():
        rows = [line for line in readme.splitlines() if f"Aegis.{name}`" in line]
        assert rows, f"README has no table row for Aegis.{name}"
        assert any(paper in row for row in rows), f"README row for {name} lacks {paper}"
        for twin in twins:
            assert twin in module_globals and callable(module_globals[twin]), twin
            assert any(twin in row for row in rows), f"README row for {name} lacks twin {twin}"


# --------------------------------------------------------------------------------------------
# symbolic expectation of polynomials in independent noise coordinates
# --------------------------------------------------------------------------------------------

SIGMA = sp.Symbol("sigma", positive=True)
M3, M4 = sp.symbols("m3 m4", real=True)


def general_moments(k: int) -> sp.Expr:
    """Raw moments of a zero-mean law with second moment sigma^2 and *free* higher moments."""
    return {0: sp.Integer(1), 1: sp.Integer(0), 2: SIGMA**2, 3: M3, 4: M4}.get(k, sp.Symbol(f"m{k}"))


def gaussian_moments(k: int) -> sp.Expr:
    """Raw moments of N(0, sigma^2): 0 for odd k, (k-1)!! sigma^k for even k."""
    if k % 2:
        return sp.Integer(0)
    return sp.factorial2(k - 1) * SIGMA**k if k else sp.Integer(1)


def expect(expr: sp.Expr, noise: list[sp.Symbol], moments=general_moments) -> sp.Expr:
    """E[expr] for a polynomial in mutually independent noise symbols with the given moments."""
    poly = sp.Poly(sp.expand(expr), *noise)
    total = sp.Integer(0)
    for exps, coeff in poly.terms():
        term = coeff
        for e in exps:
            term *= moments(e)
        total += term
    return sp.expand(total)


def test_expectation_helper_can_fail():
    z = sp.Symbol("z")
    assert expect(z, [z]) == 0
    assert expect(z**2, [z]) == SIGMA**2
    assert expect(z**4, [z]) == M4  # NOT 3 sigma^4: identities needing Gaussianity fail
    assert expect(z**4, [z], gaussian_moments) == 3 * SIGMA**4


def test_gaussian_coordinate_second_moment_sympy_stats():
    """One coordinate of Theorem 2 with sympy.stats' own Gaussian: E[(rho g + sigma Z)^2]."""
    from sympy.stats import E, Normal

    rho, g = sp.symbols("rho g", real=True)
    Z = Normal("Z", 0, 1)
    assert [sp.simplify(E(Z**k)) for k in range(1, 5)] == [0, 1, 0, 3]
    assert sp.simplify(E((rho * g + SIGMA * Z) ** 2) - (rho**2 * g**2 + SIGMA**2)) == 0


@pytest.mark.parametrize("d", [1, 2, 3, 5])
def test_channel2_second_moment_symbolic(d):
    """Theorem 2: E||rho g + n||^2 = rho^2 ||g||^2 + d sigma^2 (active), E||n||^2 = d sigma^2."""
    rho = sp.Symbol("rho", real=True)
    g = sp.symbols(f"g0:{d}", real=True)
    n = list(sp.symbols(f"n0:{d}", real=True))
    gsq = sum(gi**2 for gi in g)
    active = expect(sum((rho * gi + ni) ** 2 for gi, ni in zip(g, n)), n)
    assert sp.expand(active - (rho**2 * gsq + d * SIGMA**2)) == 0
    inactive = expect(sum(ni**2 for ni in n), n)
    assert sp.expand(inactive - d * SIGMA**2) == 0
    # the twin can fail: a wrong statement (noise counted once, not d times) is rejected
    assert sp.expand(active - (rho**2 * gsq + SIGMA**2)) != 0 or d == 1


def test_flood_norm_variance_formula():
    """Exact variance of Y = ||a + n||^2 used for every Monte-Carlo tolerance below:
    Var Y = sum_i (4 a_i^2 sigma^2 + 4 a_i m3 + m4 - sigma^4); Gaussian: 4 sigma^2 ||a||^2 + 2 d sigma^4."""
    d = 3
    a = sp.symbols(f"a0:{d}", real=True)
    n = list(sp.symbols(f"n0:{d}", real=True))
    Y = sum((ai + ni) ** 2 for ai, ni in zip(a, n))
    var = expect(Y**2, n) - expect(Y, n) ** 2
    formula = sum(4 * ai**2 * SIGMA**2 + 4 * ai * M3 + M4 - SIGMA**4 for ai in a)
    assert sp.expand(var - formula) == 0
    var_g = expect(Y**2, n, gaussian_moments) - expect(Y, n, gaussian_moments) ** 2
    asq = sum(ai**2 for ai in a)
    assert sp.expand(var_g - (4 * SIGMA**2 * asq + 2 * d * SIGMA**4)) == 0


# --------------------------------------------------------------------------------------------
# Monte-Carlo machinery
# --------------------------------------------------------------------------------------------

NOISE_KINDS = ("gaussian", "rademacher", "uniform")


def sample_noise(rng: np.random.Generator, kind: str, sigma: float, shape) -> np.ndarray:
    """Zero-mean noise with second moment sigma^2 (all three laws are symmetric: m3 = 0)."""
    if kind == "gaussian":
        return sigma * rng.standard_normal(shape)
    if kind == "rademacher":
        return sigma * rng.choice(np.array([-1.0, 1.0]), size=shape)
    if kind == "uniform":
        return sigma * math.sqrt(3.0) * rng.uniform(-1.0, 1.0, size=shape)
    raise ValueError(kind)


def fourth_moment(kind: str, sigma: float) -> float:
    return {"gaussian": 3.0, "rademacher": 1.0, "uniform": 9.0 / 5.0}[kind] * sigma**4


def norm_sq_mean_and_var(a: np.ndarray, sigma: float, kind: str) -> tuple[float, float]:
    """Exact E and Var of ||a + n||^2 (formula of test_flood_norm_variance_formula, m3 = 0)."""
    a = np.asarray(a, dtype=np.float64)
    mean = float(np.sum(a**2) + a.size * sigma**2)
    var = float(np.sum(4.0 * a**2 * sigma**2 + fourth_moment(kind, sigma) - sigma**4))
    return mean, var


def assert_mean_close(samples: np.ndarray, exact_mean: float, exact_var: float, terms: int = 1) -> None:
    """|sample mean - exact mean| <= 6 exact standard errors + a floating-point error bound.

    The rounding term is the textbook bound for recursive summation, (N + terms) * eps * mean|y|
    (each sample is itself a sum of `terms` squares); it only matters when the exact variance is 0
    (e.g. Rademacher noise on an inactive row, where ||n||^2 = d sigma^2 for every sample)."""
    n = samples.shape[0]
    se = math.sqrt(exact_var / n)
    fp = (n + terms) * np.finfo(np.float64).eps * float(np.mean(np.abs(samples)))
    err = abs(float(samples.mean()) - exact_mean)
    tol = Z_TOL * se + fp
    assert err <= tol, f"|mean - exact| = {err:.4g} > {Z_TOL} * SE + fp = {tol:.4g}"


def test_monte_carlo_check_can_fail():
    rng = np.random.default_rng(0)
    a = np.array([1.0, -2.0, 0.5])
    sigma = 0.7
    y = np.sum((a + sample_noise(rng, "gaussian", sigma, (20000, 3))) ** 2, axis=1)
    mean, var = norm_sq_mean_and_var(a, sigma, "gaussian")
    assert_mean_close(y, mean, var)
    with pytest.raises(AssertionError):  # the same data must reject a wrong moment (d sigma^2 dropped)
        assert_mean_close(y, float(np.sum(a**2)), var)


@SETTINGS
@given(
    d=st.integers(1, 24),
    rho=st.floats(0.0, 1.0),
    sigma=st.floats(0.05, 3.0),
    kind=st.sampled_from(NOISE_KINDS),
    active=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
def test_channel2_second_moment_monte_carlo(d, rho, sigma, kind, active, seed):
    """Theorem 2 (both rows) for three zero-mean laws: the Lean statement needs no Gaussianity."""
    rng = np.random.default_rng(seed)
    g = rng.standard_normal(d) * rng.uniform(0.1, 5.0)
    a = rho * g if active else np.zeros(d)
    N = 20000
    out = a + sample_noise(rng, kind, sigma, (N, d))
    y = np.sum(out**2, axis=1)
    mean, var = norm_sq_mean_and_var(a, sigma, kind)
    expected = rho**2 * float(g @ g) + d * sigma**2 if active else d * sigma**2
    assert math.isclose(mean, expected, rel_tol=1e-12, abs_tol=1e-12)
    assert_mean_close(y, expected, var, terms=d)


def rows_flood_reference(G, rho, lam, tau, Z):
    """DESIGN.md section 1, rows mode, restated in numpy (independently of aegis_kernels)."""
    norms = np.linalg.norm(G, axis=1)
    M = norms.max(initial=0.0)
    active = norms > tau * M
    mbar = float(norms[active].mean()) if active.any() else 0.0
    sigma = lam * mbar
    out = np.where(active[:, None], rho * G, 0.0) + sigma * Z
    return out, active, mbar, sigma


@SETTINGS
@given(
    V=st.integers(2, 12),
    d=st.integers(1, 16),
    rho=st.floats(0.0, 1.0),
    lam=st.floats(0.1, 4.0),
    seed=st.integers(0, 2**32 - 1),
)
def test_channel2_design_rows_flood_monte_carlo(V, d, rho, lam, seed):
    """Theorem 2 on the design's own rows flood: sigma = lam * m_bar from the active rows."""
    rng = np.random.default_rng(seed)
    G = rng.standard_normal((V, d)) * rng.uniform(0.1, 3.0, size=(V, 1))
    G[0] = 0.0  # an absent token: inactive
    G[1] *= 1e-4  # a tiny row: inactive under tau = 0.01 (unless all rows are tiny)
    K = 4000
    Z = rng.standard_normal((K, V, d))
    out, active, mbar, sigma = rows_flood_reference(G, rho, lam, 0.01, Z)
    assert sigma > 0
    y = np.sum(out**2, axis=2)  # (K, V)
    for v in range(V):
        a = rho * G[v] if active[v] else np.zeros(d)
        mean, var = norm_sq_mean_and_var(a, sigma, "gaussian")
        expected = (rho**2 * float(G[v] @ G[v]) if active[v] else 0.0) + d * sigma**2
        assert math.isclose(mean, expected, rel_tol=1e-12)
        assert_mean_close(y[:, v], expected, var, terms=d)


# --------------------------------------------------------------------------------------------
# relative inflation (Theorems 2 and 3)
# --------------------------------------------------------------------------------------------


def test_relative_inflation_symbolic():
    """rho^2 S / (D lam^2 m^2) <= rho^2 C^2 / (D lam^2) whenever S <= C^2 m^2, with D = d (rows)
    or D = m n (matrix): the gap is exactly rho^2 (C^2 m^2 - S) / (D lam^2 m^2) >= 0."""
    rho = sp.Symbol("rho", real=True)
    C, t = sp.symbols("C t", nonnegative=True)
    lam, mbar, D = sp.symbols("lam mbar D", positive=True)
    S = C**2 * mbar**2 - t  # the hypothesis S <= (C mbar)^2, with slack t >= 0
    ratio = rho**2 * S / (D * (lam * mbar) ** 2)
    bound = rho**2 * C**2 / (D * lam**2)
    gap = sp.simplify(bound - ratio)
    assert sp.simplify(gap - rho**2 * t / (D * lam**2 * mbar**2)) == 0
    assert gap.is_nonnegative is True
    assert sp.simplify(gap.subs(t, 0)) == 0  # the bound is attained at ||g|| = C m_bar
    # can fail: without the hypothesis (slack t < 0) the bound is violated for rho != 0
    assert sp.simplify(gap.subs({t: -1, rho: 1})) < 0
    # matrix case: m n lam^2 m_bar^2 is D (lam m_bar)^2 with D = m n
    m, n = sp.symbols("m n", positive=True)
    assert sp.simplify(m * n * lam**2 * mbar**2 - (m * n) * (lam * mbar) ** 2) == 0


def _frac(x: float) -> Fraction:
    return Fraction(x)  # exact value of the float


@SETTINGS
@given(
    entries=st.lists(st.integers(-50, 50), min_size=1, max_size=12),
    mbar_num=st.integers(1, 40),
    lam_num=st.integers(1, 40),
    rho_num=st.integers(-20, 20),
    slack=st.integers(0, 30),
)
def test_channel2_relative_inflation_exact(entries, mbar_num, lam_num, rho_num, slack):
    """Theorem 2 inequality in exact rational arithmetic, on every input meeting the hypothesis."""
    g = [Fraction(e, 7) for e in entries]
    d = len(g)
    S = sum(x * x for x in g)
    mbar, lam, rho = Fraction(mbar_num, 5), Fraction(lam_num, 5), Fraction(rho_num, 10)
    # a rational C with S <= (C mbar)^2: C = (ceil-ish sqrt(S) + slack) / mbar
    root = Fraction(math.isqrt(math.ceil(S)) + 1 + slack)
    C = root / mbar
    assert S <= (C * mbar) ** 2  # hypothesis of channel2_relative_inflation (sqrt form squared)
    ratio = rho**2 * S / (d * (lam * mbar) ** 2)
    bound = rho**2 * C**2 / (d * lam**2)
    assert ratio <= bound
    # can fail: a C below ||g|| / m_bar breaks the conclusion whenever rho != 0 and g != 0
    if rho != 0 and S > 0:
        C_bad = Fraction(1, 2) * Fraction(math.isqrt(math.floor(S))) / mbar
        if (C_bad * mbar) ** 2 < S:
            assert rho**2 * S / (d * (lam * mbar) ** 2) > rho**2 * C_bad**2 / (d * lam**2)


@SETTINGS
@given(
    m=st.integers(1, 5),
    n=st.integers(1, 5),
    lam=st.floats(0.1, 8.0),
    rho=st.floats(-1.0, 1.0),
    seed=st.integers(0, 2**32 - 1),
)
def test_channel3_relative_inflation_exact(m, n, lam, rho, seed):
    """Theorem 3 inequality, exact rational arithmetic on the design's matrix-flood m_bar."""
    rng = np.random.default_rng(seed)
    G = rng.standard_normal((m, n)) * rng.uniform(0.01, 10.0)
    mbar = _frac(float(np.mean(np.abs(G))))  # DESIGN: m_bar = mean |G|
    S = sum(_frac(float(x)) ** 2 for x in G.ravel())
    # a C with ||G||_F <= C m_bar, checked exactly: C = (float sqrt upper bound) / m_bar
    root = _frac(math.sqrt(float(S)) * (1 + 2**-40) + 1e-300)
    assert root * root >= S
    C = root / mbar
    lam_f, rho_f = _frac(lam), _frac(rho)
    ratio = rho_f**2 * S / (m * n * lam_f**2 * mbar**2)
    bound = rho_f**2 * C**2 / (m * n * lam_f**2)
    assert ratio <= bound


# --------------------------------------------------------------------------------------------
# Gaussian corollary: rows are non-zero almost surely
# --------------------------------------------------------------------------------------------


def test_gaussian_singleton_probability_zero():
    """P(X = c) = 0 for X ~ N(0, sigma^2), sigma > 0: the singleton-null fact the Lean corollary
    uses (the degenerate case sigma = 0 is the counterexample in test_channel2_rows_nonzero_ae_twin)."""
    from scipy import stats
    from sympy.stats import Normal, cdf

    c = sp.Symbol("c", real=True)
    eps = sp.Symbol("eps", positive=True)
    F = cdf(Normal("X", 0, SIGMA))
    assert sp.limit(F(c + eps) - F(c - eps), eps, 0, "+") == 0
    # and numerically, the mass of [c - eps, c + eps] is at most 2 eps * max pdf -> 0
    for cv in (-1.3, 0.0, 2.5):
        for e in (1e-3, 1e-6, 1e-9):
            mass = stats.norm.cdf(cv + e) - stats.norm.cdf(cv - e)
            # + rounding of the two cdf values (each within a few ulps of numbers <= 1)
            assert 0 <= mass <= 2 * e * stats.norm.pdf(0) + 4 * np.finfo(np.float64).eps


@SETTINGS
@given(
    V=st.integers(1, 64),
    d=st.integers(1, 16),
    rho=st.floats(0.0, 1.0),
    lam=st.floats(1e-3, 4.0),
    seed=st.integers(0, 2**32 - 1),
)
def test_channel2_rows_nonzero_ae_twin(V, d, rho, lam, seed):
    """With sigma > 0, no flooded row is zero (active or inactive); with sigma = 0 inactive rows
    stay exactly zero, i.e. the conclusion fails without the hypothesis."""
    rng = np.random.default_rng(seed)
    G = rng.standard_normal((V, d))
    G[rng.random(V) < 0.5] = 0.0  # many absent tokens
    G[0] = rng.standard_normal(d) + 1.0  # at least one present token
    Z = rng.standard_normal((1, V, d))
    out, active, mbar, sigma = rows_flood_reference(G, rho, lam, 0.01, Z)
    assert sigma > 0
    assert not np.any(np.all(out[0] == 0.0, axis=1)), "a flooded row is exactly zero"
    out0, active0, _, _ = rows_flood_reference(G, rho, 0.0, 0.01, Z)  # lam = 0: sigma = 0
    inactive_rows = ~active0
    if inactive_rows.any():
        assert np.all(out0[0][inactive_rows] == 0.0)


# --------------------------------------------------------------------------------------------
# Theorem 3: matrix flood
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("m,n", [(1, 1), (2, 3), (3, 2)])
def test_channel3_decomposition_symbolic(m, n):
    """E[rho G + sigma Z] - G = (rho - 1) G entrywise, for any zero-mean Z."""
    rho = sp.Symbol("rho", real=True)
    G = sp.Matrix(m, n, sp.symbols(f"G0:{m * n}", real=True))
    Zs = list(sp.symbols(f"Z0:{m * n}", real=True))
    Z = sp.Matrix(m, n, Zs)
    out = rho * G + SIGMA * Z
    mean = out.applyfunc(lambda e: expect(e, Zs))
    assert (mean - G - (rho - 1) * G).applyfunc(sp.expand) == sp.zeros(m, n)
    # can fail: the decomposition is not unbiased unless rho = 1
    assert (mean - G).applyfunc(sp.expand) != sp.zeros(m, n)


@pytest.mark.parametrize("m,n", [(1, 2), (2, 2), (2, 3)])
def test_channel3_frobenius_symbolic(m, n):
    """E||rho G + lam m_bar Z||_F^2 = rho^2 ||G||_F^2 + m n lam^2 m_bar^2 for E Z = 0, E Z^2 = 1."""
    rho = sp.Symbol("rho", real=True)
    lam, mbar = sp.symbols("lam mbar", positive=True)
    G = sp.symbols(f"G0:{m * n}", real=True)
    Z = list(sp.symbols(f"Z0:{m * n}", real=True))

    def unit_moments(k):  # Z: mean 0, second moment 1, free higher moments
        return general_moments(k).subs(SIGMA, 1)

    fro = expect(sum((rho * gi + lam * mbar * zi) ** 2 for gi, zi in zip(G, Z)), Z, unit_moments)
    expected = rho**2 * sum(gi**2 for gi in G) + m * n * lam**2 * mbar**2
    assert sp.expand(fro - expected) == 0


@SETTINGS
@given(
    m=st.integers(1, 8),
    n=st.integers(1, 8),
    rho=st.floats(0.0, 1.0),
    lam=st.floats(0.1, 8.0),
    kind=st.sampled_from(NOISE_KINDS),
    seed=st.integers(0, 2**32 - 1),
)
def test_channel3_frobenius_monte_carlo(m, n, rho, lam, kind, seed):
    """Theorem 3 on the design's matrix flood (sigma = lam * mean|G|), three noise laws."""
    rng = np.random.default_rng(seed)
    G = rng.standard_normal((m, n)) * rng.uniform(0.01, 10.0)
    mbar = float(np.mean(np.abs(G)))
    sigma = lam * mbar
    N = 20000
    out = rho * G + sample_noise(rng, kind, sigma, (N, m, n))
    y = np.sum(out**2, axis=(1, 2))
    mean, var = norm_sq_mean_and_var((rho * G).ravel(), sigma, kind)
    expected = rho**2 * float(np.sum(G**2)) + m * n * lam**2 * mbar**2
    assert math.isclose(mean, expected, rel_tol=1e-12)
    assert_mean_close(y, expected, var, terms=m * n)


@SETTINGS
@given(
    m=st.integers(1, 6),
    n=st.integers(1, 6),
    rho=st.floats(0.0, 1.0),
    lam=st.floats(0.1, 8.0),
    kind=st.sampled_from(NOISE_KINDS),
    seed=st.integers(0, 2**32 - 1),
)
def test_channel3_decomposition_monte_carlo(m, n, rho, lam, kind, seed):
    """Entrywise E[out] - G = (rho - 1) G; SE of each entry's mean is exactly sigma / sqrt(N)."""
    rng = np.random.default_rng(seed)
    G = rng.standard_normal((m, n))
    sigma = lam * float(np.mean(np.abs(G)))
    N = 20000
    out = rho * G + sample_noise(rng, kind, sigma, (N, m, n))
    bias = out.mean(axis=0) - G
    se = sigma / math.sqrt(N)
    assert np.all(np.abs(bias - (rho - 1.0) * G) <= Z_TOL * se)


# --------------------------------------------------------------------------------------------
# Proposition 1
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("d", [1, 2, 4])
def test_biased_gradient_decomposition_symbolic(d):
    """E[out] = rho g, bias = (rho - 1) g, ||bias|| = (1 - rho) ||g|| for 0 <= rho <= 1."""
    rho = sp.Symbol("rho", real=True)
    g = sp.symbols(f"g0:{d}", real=True)
    n = list(sp.symbols(f"n0:{d}", real=True))
    mean = [expect(rho * gi + ni, n) for gi, ni in zip(g, n)]
    assert all(sp.expand(mi - rho * gi) == 0 for mi, gi in zip(mean, g))
    bias = [mi - gi for mi, gi in zip(mean, g)]
    assert all(sp.expand(bi - (rho - 1) * gi) == 0 for bi, gi in zip(bias, g))
    t = sp.Symbol("t", nonnegative=True)  # rho = 1 - t with t >= 0 (rho <= 1)
    norm_bias = sp.sqrt(sp.factor(sp.expand(sum(bi**2 for bi in bias).subs(rho, 1 - t))))
    norm_g = sp.sqrt(sum(gi**2 for gi in g))
    assert sp.simplify(norm_bias - t * norm_g) == 0
    # can fail: for rho > 1 the norm is (rho - 1) ||g||, not (1 - rho) ||g||
    vals = {gi: 1 for gi in g}
    bias_norm_at_2 = sp.sqrt(sum(bi**2 for bi in bias)).subs(vals).subs(rho, 2)
    assert bias_norm_at_2 != ((1 - rho) * norm_g).subs(vals).subs(rho, 2)


@SETTINGS
@given(
    d=st.integers(1, 32),
    rho=st.floats(0.0, 1.0),
    sigma=st.floats(0.05, 3.0),
    kind=st.sampled_from(NOISE_KINDS),
    seed=st.integers(0, 2**32 - 1),
)
def test_biased_gradient_monte_carlo(d, rho, sigma, kind, seed):
    """Proposition 1 by simulation: coordinate means within 6 exact SEs (sigma / sqrt(N)) of
    rho g, and the exact bias norm identity in floating point."""
    rng = np.random.default_rng(seed)
    g = rng.standard_normal(d) * rng.uniform(0.1, 5.0)
    N = 20000
    out = rho * g + sample_noise(rng, kind, sigma, (N, d))
    se = sigma / math.sqrt(N)
    assert np.all(np.abs(out.mean(axis=0) - rho * g) <= Z_TOL * se)
    bias = rho * g - g
    assert math.isclose(float(np.linalg.norm(bias)), (1.0 - rho) * float(np.linalg.norm(g)),
                        rel_tol=1e-12, abs_tol=1e-300)


# --------------------------------------------------------------------------------------------
# Theorem 1: frozen attention projections
# --------------------------------------------------------------------------------------------


def zero_extend(trainable_grads: dict[str, np.ndarray], shapes: dict[str, tuple[int, ...]]):
    """Exported gradient of the whole model: trainable gradients, zeros for frozen parameters."""
    return {name: trainable_grads.get(name, np.zeros(shape)) for name, shape in shapes.items()}


def span_projection(M: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Orthogonal projection of v onto the span of the rows of M (SVD, numerical rank)."""
    if M.size == 0:
        return np.zeros_like(v)
    _, s, vh = np.linalg.svd(M, full_matrices=False)
    if s.size == 0 or s.max() == 0.0:
        return np.zeros_like(v)
    tol = max(M.shape) * np.finfo(M.dtype).eps * s.max()
    basis = vh[s > tol]
    return basis.T @ (basis @ v)


def residual_score(M: np.ndarray, v: np.ndarray) -> float:
    return float(np.linalg.norm(v - span_projection(M, v)) / np.linalg.norm(v))


@SETTINGS
@given(hidden=st.integers(2, 48), layers=st.integers(1, 3), seed=st.integers(0, 2**32 - 1))
def test_channel1_exported_grad_zero_twin(hidden, layers, seed):
    """The zero extension of the trainable gradient exports exactly zero for every frozen
    attention projection (Q, K, V, O / fused QKV) and the true gradient elsewhere."""
    rng = np.random.default_rng(seed)
    shapes = {}
    for layer in range(layers):
        shapes[f"h.{layer}.attn.c_attn.weight"] = (hidden, 3 * hidden)
        shapes[f"h.{layer}.attn.c_proj.weight"] = (hidden, hidden)  # output projection W_O
        shapes[f"h.{layer}.mlp.c_fc.weight"] = (hidden, 4 * hidden)
    shapes["wte.weight"] = (50, hidden)
    frozen = {name for name in shapes if ".attn." in name}
    trainable_grads = {name: rng.standard_normal(s) for name, s in shapes.items() if name not in frozen}
    exported = zero_extend(trainable_grads, shapes)
    assert set(exported) == set(shapes)
    for name in shapes:
        if name in frozen:
            assert exported[name].shape == shapes[name]
            assert not np.any(exported[name]), name
        else:
            assert np.array_equal(exported[name], trainable_grads[name])


@SETTINGS
@given(m=st.integers(1, 40), n=st.integers(1, 40), seed=st.integers(0, 2**32 - 1))
def test_channel1_residual_eq_one_twin(m, n, seed):
    """Projection onto the (trivial) row span of the exported zero W_O gradient is 0, so the
    residual score ||v - P v|| / ||v|| is exactly 1 for every non-zero embedding v."""
    rng = np.random.default_rng(seed)
    G = np.zeros((m, n))  # exported W_O gradient of a frozen attention block
    for _ in range(5):
        v = rng.standard_normal(n) * rng.uniform(1e-3, 1e3)
        assert np.array_equal(span_projection(G, v), np.zeros(n))
        assert residual_score(G, v) == 1.0
        # squared form (no square roots), as in channel1_residual_sq_eq
        assert float(np.sum((v - span_projection(G, v)) ** 2)) == float(np.sum(v**2))


@SETTINGS
@given(m=st.integers(1, 8), n=st.integers(9, 40), seed=st.integers(0, 2**32 - 1))
def test_channel1_residual_control_can_fail(m, n, seed):
    """Control: with an unfrozen (non-zero) W_O gradient, an embedding inside the row span has
    residual ~0, i.e. the twin distinguishes a frozen from a trainable projection."""
    rng = np.random.default_rng(seed)
    G = rng.standard_normal((m, n))  # rank m < n
    v = rng.standard_normal(m) @ G  # a vector in the row span
    assert residual_score(G, v) < 1e-8
