import Aegis.Mechanism
import Aegis.Moments

/-!
# What the paper's "indistinguishable rows" can and cannot mean

Theorem 2 (`channel2_relative_inflation`) bounds a **ratio of expected squared norms**: the
signal energy of a flooded row over its noise energy, `ρ² ‖g‖² / (d σ²) ≤ ρ² C² / (d λ²)`. The
factor `1/d` is there because the noise spreads over all `d` coordinates while the signal is one
direction. It says that a test which looks only at a row's norm (an energy detector, blind to the
direction of `g`) gains little.

It does **not** bound what a server gains when it knows the direction to test: a server that
forms a candidate's gradient `g` (one backward on the candidate text) compares the flooded row with
`N(ρ g, σ² I)` against `N(0, σ² I)` (token absent) or `N(ρ g', σ² I)` (another candidate). The
optimal test is the likelihood ratio, and its expected value, the Kullback–Leibler divergence, is

  `KL(N(ρ g, σ² I) ‖ N(0, σ² I)) = ρ² ‖g‖² / (2 σ²)`   (no `1/d`)

per row and per exported step. With the paper's `σ = λ m̄` and `‖g‖ ≈ m̄` this is `ρ² / (2 λ²)`,
whatever `d`: `0.045` at `ρ = 0.3`, `λ = 1`, and it adds up over the steps a row is exported. So
"indistinguishable" can mean: *the energy ratio is small* (Theorem 2); it cannot mean: *a server
testing a candidate is close to guessing*, which is governed by `ρ² ‖g‖² / (2 σ²)` and must be
read from that number (and from the attacks that measure it).

Proved here, about the flood itself (`IsStdNormal` noise, only marginals):

* `row_expected_llr`: for `out = a + σ Z` (`Z` standard normal coordinates, `σ ≠ 0`),
  `E ∑ᵢ log (p_{aᵢ,σ²}(outᵢ) / p_{bᵢ,σ²}(outᵢ)) = ‖a − b‖² / (2 σ²)`, the log-likelihood ratio
  built from Mathlib's Gaussian densities (`gaussLogLR`, `Model.lean`). When the coordinates of
  `Z` are independent (as the keystream's are modelled), the row's law is `N(a, σ² I)` and this
  expectation is `KL(N(a, σ² I) ‖ N(b, σ² I))` (`kl_gaussianReal_same_var`,
  `kl_gaussianReal_sum` give the same number from the one-dimensional KL; the product-density
  step is not formalised). Without independence it is still the expected score of that test.
* `channel2_row_kl_absent_public`, `channel2_row_kl_absent_batch`: the row flood's value against
  "row absent" (`b = 0`): `k² ‖G v‖² / (2 σ²)` with the row's coefficient `k`
  (`ρ min(1, c/‖G v‖)` on an active row of the public flood, `ρ` on an active row of the batch
  flood, where `σ = λ m̄`).

Written without a Lean toolchain at hand: not machine-checked where it was written.
-/

open MeasureTheory ProbabilityTheory
open scoped ENNReal NNReal

noncomputable section

namespace Aegis

variable {Ω : Type*} [MeasurableSpace Ω] {μ : Measure Ω} [IsProbabilityMeasure μ]

/-- **The expected log-likelihood ratio of a flooded row.** For `out i = a i + σ X i` with
standard normal `X i` and `σ ≠ 0`, the expected log-likelihood ratio of `N(a, σ² I)` against
`N(b, σ² I)` (a sum of one-dimensional Gaussian log-density ratios) is `‖a − b‖² / (2 σ²)`. -/
theorem row_expected_llr {d : ℕ} (a b : Fin d → ℝ) (σ : ℝ) (hσ : σ ≠ 0)
    (X : Fin d → Ω → ℝ) (hX : ∀ i, IsStdNormal μ (X i)) :
    ∫ ω, ∑ i, gaussLogLR (a i) (b i) (nnsq σ) (a i + σ * X i ω) ∂μ
      = sqNorm (fun i => a i - b i) / (2 * σ ^ 2) := by
  -- each term is affine in the noise: `(aᵢ − bᵢ)² / (2σ²) + (2 (aᵢ − bᵢ) σ / (2σ²)) Xᵢ`
  have hterm : ∀ i ω, gaussLogLR (a i) (b i) (nnsq σ) (a i + σ * X i ω)
      = (a i - b i) ^ 2 / (2 * σ ^ 2) + 2 * (a i - b i) * σ / (2 * σ ^ 2) * X i ω := by
    intro i ω
    rw [gaussLogLR_eq (a i) (b i) (nnsq σ) (nnsq_ne_zero σ hσ), coe_nnsq σ]
    ring
  have hfun : (fun ω => ∑ i, gaussLogLR (a i) (b i) (nnsq σ) (a i + σ * X i ω))
      = fun ω => ∑ i, ((a i - b i) ^ 2 / (2 * σ ^ 2)
          + 2 * (a i - b i) * σ / (2 * σ ^ 2) * X i ω) := by
    funext ω
    exact Finset.sum_congr rfl (fun i _ => hterm i ω)
  have h0 : ∫ ω, ∑ i, gaussLogLR (a i) (b i) (nnsq σ) (a i + σ * X i ω) ∂μ
      = ∫ ω, ∑ i, ((a i - b i) ^ 2 / (2 * σ ^ 2)
          + 2 * (a i - b i) * σ / (2 * σ ^ 2) * X i ω) ∂μ := by
    first
      | exact congrArg (fun f : Ω → ℝ => ∫ ω, f ω ∂μ) hfun
      | rw [hfun]
      | simp only [hfun]
  have hint : ∀ i ∈ (Finset.univ : Finset (Fin d)),
      Integrable (fun ω => (a i - b i) ^ 2 / (2 * σ ^ 2)
        + 2 * (a i - b i) * σ / (2 * σ ^ 2) * X i ω) μ :=
    fun i _ => coord_integrable (hX i) _ _
  have hswap : ∫ ω, ∑ i, ((a i - b i) ^ 2 / (2 * σ ^ 2)
        + 2 * (a i - b i) * σ / (2 * σ ^ 2) * X i ω) ∂μ
      = ∑ i, ∫ ω, ((a i - b i) ^ 2 / (2 * σ ^ 2)
        + 2 * (a i - b i) * σ / (2 * σ ^ 2) * X i ω) ∂μ :=
    integral_finset_sum Finset.univ hint
  have hsum : ∑ i, ∫ ω, ((a i - b i) ^ 2 / (2 * σ ^ 2)
        + 2 * (a i - b i) * σ / (2 * σ ^ 2) * X i ω) ∂μ
      = ∑ i, (a i - b i) ^ 2 / (2 * σ ^ 2) :=
    Finset.sum_congr rfl (fun i _ => coord_mean (hX i) _ _)
  have hdiv : ∑ i, (a i - b i) ^ 2 / (2 * σ ^ 2) = sqNorm (fun i => a i - b i) / (2 * σ ^ 2) := by
    unfold sqNorm
    first
      | exact (Finset.sum_div Finset.univ (fun i => (a i - b i) ^ 2) (2 * σ ^ 2)).symm
      | rw [Finset.sum_div]
      | (simp only [div_eq_mul_inv]; rw [Finset.sum_mul])
  rw [h0, hswap, hsum, hdiv]

/-- A row flooded with coefficient `k` (any deterministic `k`), against "row absent":
`E ∑ᵢ log (p_{k gᵢ,σ²}(outᵢ) / p_{0,σ²}(outᵢ)) = k² ‖g‖² / (2 σ²)`. -/
theorem row_llr_absent {d : ℕ} (k σ : ℝ) (hσ : σ ≠ 0) (g : Fin d → ℝ)
    (X : Fin d → Ω → ℝ) (hX : ∀ i, IsStdNormal μ (X i)) :
    ∫ ω, ∑ i, gaussLogLR (k * g i) 0 (nnsq σ) (k * g i + σ * X i ω) ∂μ
      = k ^ 2 * sqNorm g / (2 * σ ^ 2) := by
  have hs : sqNorm (fun i => k * g i - 0) = k ^ 2 * sqNorm g := by
    unfold sqNorm
    rw [Finset.mul_sum]
    exact Finset.sum_congr rfl (fun i _ => by first | ring | (beta_reduce; ring))
  have h := row_expected_llr (μ := μ) (fun i => k * g i) (fun _ => 0) σ hσ X hX
  rw [← hs]
  exact h

/-- **Row flood against "row absent" (public calibration).** For row `v` of the shipped rows
flood with public `σ ≠ 0`, the expected log-likelihood ratio of "the row carries its signal"
against "the row is pure noise" is `k² ‖G v‖² / (2 σ²)`, `k = rowCoef ρ c thr (G v)`
(`ρ min(1, c/‖G v‖)` on an active row, so at most `(ρ c)² / (2 σ²)`; `0` on an inactive one). -/
theorem channel2_row_kl_absent_public {V d : ℕ} (ρ σ c thr : ℝ) (hσ : σ ≠ 0)
    (G : Fin V → Fin d → ℝ) (Z : Fin V → Fin d → Ω → ℝ) (hZ : ∀ v i, IsStdNormal μ (Z v i))
    (v : Fin V) :
    ∫ ω, ∑ i, gaussLogLR (rowCoef ρ c thr (G v) * G v i) 0 (nnsq σ)
        (floodRows ρ σ c thr G Z ω v i) ∂μ
      = rowCoef ρ c thr (G v) ^ 2 * sqNorm (G v) / (2 * σ ^ 2) :=
  row_llr_absent (rowCoef ρ c thr (G v)) σ hσ (G v) (Z v) (hZ v)

/-- **Row flood against "row absent" (the paper's calibration).** With `σ = λ m̄ ≠ 0`, an active
row (`v ∈ S`) gives `ρ² ‖G v‖² / (2 (λ m̄)²)`: no factor `1/d`, unlike Theorem 2's ratio. -/
theorem channel2_row_kl_absent_batch {V d : ℕ} (ρ lam τ : ℝ) (G : Fin V → Fin d → ℝ)
    (hσ : lam * mbarRows τ G ≠ 0) (Z : Fin V → Fin d → Ω → ℝ)
    (hZ : ∀ v i, IsStdNormal μ (Z v i)) (v : Fin V) (hv : v ∈ active τ G) :
    ∫ ω, ∑ i, gaussLogLR ((if v ∈ active τ G then ρ else 0) * G v i) 0
        (nnsq (lam * mbarRows τ G)) (floodRowsBatch ρ lam τ G Z ω v i) ∂μ
      = ρ ^ 2 * sqNorm (G v) / (2 * (lam * mbarRows τ G) ^ 2) := by
  have h := row_llr_absent (μ := μ) (if v ∈ active τ G then ρ else 0) (lam * mbarRows τ G) hσ
    (G v) (Z v) (hZ v)
  have hk : (if v ∈ active τ G then ρ else 0) = ρ := if_pos hv
  have h2 : (if v ∈ active τ G then ρ else 0) ^ 2 * sqNorm (G v) / (2 * (lam * mbarRows τ G) ^ 2)
      = ρ ^ 2 * sqNorm (G v) / (2 * (lam * mbarRows τ G) ^ 2) := by
    rw [hk]
  exact h.trans h2

end Aegis
