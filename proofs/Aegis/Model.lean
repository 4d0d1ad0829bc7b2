import Mathlib

/-!
# The probability model of the noise

The flood adds `σ · Z` where `Z` is the keystream's normal noise. The proofs model the keystream
as ideal: a probability space `(Ω, μ)` and noise coordinates `Z : Ω → ℝ` that are measurable with
law `μ.map Z = gaussianReal 0 1` (`IsStdNormal μ Z`). Only marginal laws are assumed: every theorem
below is linear in the noise or about one coordinate at a time, so no independence is needed.

This is the only file that touches Mathlib's Gaussian API. It derives, from the law, every fact
the theorems use:

* `IsStdNormal.integrable`, `IsStdNormal.integrable_sq`: `Z` and `Z²` are integrable;
* `IsStdNormal.integral_eq_zero`: `∫ Z = 0`;
* `IsStdNormal.integral_sq_eq_one`: `∫ Z² = 1`;
* `IsStdNormal.ae_ne`: `Z ≠ a` almost surely, for every `a` (singletons are null).

and, from Mathlib's density `gaussianPDFReal a v x = (√(2π v))⁻¹ exp(−(x − a)² / (2v))`, the
Kullback–Leibler divergence of two Gaussians with one variance (used by `Divergence.lean`):

* `gaussLogLR a b v x = log (p_{a,v}(x) / p_{b,v}(x))`, the log-likelihood ratio of `N(a, v)`
  against `N(b, v)`; `gaussLogLR_eq`: it is `((x − b)² − (x − a)²) / (2v)`;
* `kl_gaussianReal_same_var`: `KL(N(a, v) ‖ N(b, v)) = ∫ log (p_a / p_b) dN(a, v) = (a − b)² / (2v)`;
* `kl_gaussianReal_sum`: summed over `d` coordinates, `∑ᵢ (aᵢ − bᵢ)² / (2v)`. For independent
  coordinates this sum is `KL(N(a, v I) ‖ N(b, v I))` (the product density's log is the sum of
  the coordinates' logs); that product step is a textbook fact, not formalised here.

Written without a Lean toolchain at hand: not machine-checked where it was written.
-/

open MeasureTheory ProbabilityTheory
open scoped ENNReal NNReal

noncomputable section

namespace Aegis

/-- A real random variable with the standard normal law `N(0, 1)`. -/
structure IsStdNormal {Ω : Type*} [MeasurableSpace Ω] (μ : Measure Ω) (X : Ω → ℝ) : Prop where
  measurable : Measurable X
  law : μ.map X = gaussianReal 0 1

section Gaussian

/-- The identity is in `L²` of `N(0, 1)`. -/
theorem gauss_memLp_two : MemLp (fun x : ℝ => x) 2 (gaussianReal 0 1) := by
  first
    | exact memLp_id_gaussianReal' 2 (by simp)
    | exact memLp_id_gaussianReal' 2 ENNReal.ofNat_ne_top
    | simpa using memLp_id_gaussianReal (μ := (0 : ℝ)) (v := (1 : ℝ≥0)) 2
    | exact memLp_id_gaussianReal 2

theorem gauss_integrable_id : Integrable (fun x : ℝ => x) (gaussianReal 0 1) := by
  first
    | exact gauss_memLp_two.integrable one_le_two
    | exact gauss_memLp_two.integrable (by norm_num)
    | exact MemLp.integrable (by norm_num) gauss_memLp_two

theorem gauss_integrable_sq : Integrable (fun x : ℝ => x ^ 2) (gaussianReal 0 1) := by
  first
    | exact gauss_memLp_two.integrable_sq
    | simpa using gauss_memLp_two.integrable_sq

/-- The mean of `N(0, 1)` is `0`. -/
theorem gauss_integral_id : ∫ x, x ∂(gaussianReal 0 1) = 0 := by
  first
    | exact integral_id_gaussianReal
    | (simp; done)

/-- The variance of `N(0, 1)` is `1`. -/
theorem gauss_variance : variance (fun x : ℝ => x) (gaussianReal 0 1) = 1 := by
  first
    | (rw [variance_fun_id_gaussianReal]; done)
    | (rw [variance_fun_id_gaussianReal]; simp; done)
    | (have h := variance_id_gaussianReal (μ := (0 : ℝ)) (v := (1 : ℝ≥0)); simpa using h)
    | (simp; done)

/-- The second moment of `N(0, 1)` is `1` (its variance, the mean being `0`). -/
theorem gauss_integral_sq : ∫ x, x ^ 2 ∂(gaussianReal 0 1) = 1 := by
  have h : ∫ x, x ^ 2 ∂(gaussianReal 0 1) = variance (fun x : ℝ => x) (gaussianReal 0 1) := by
    first
      | exact (variance_of_integral_eq_zero measurable_id'.aemeasurable gauss_integral_id).symm
      | (rw [variance_eq_integral measurable_id'.aemeasurable, gauss_integral_id]; simp; done)
      | (rw [variance_eq_integral (by fun_prop), gauss_integral_id]; simp; done)
      | (rw [variance_def' gauss_memLp_two, gauss_integral_id]; simp; done)
  rw [h]
  exact gauss_variance

/-- Singletons are null for `N(0, 1)`. -/
theorem gauss_singleton (a : ℝ) : gaussianReal 0 1 {a} = 0 := by
  first
    | exact (gaussianReal_absolutelyContinuous 0 one_ne_zero) Real.volume_singleton
    | exact (gaussianReal_absolutelyContinuous (0 : ℝ) (v := (1 : ℝ≥0)) one_ne_zero)
        (Real.volume_singleton (a := a))
    | (haveI := noAtoms_gaussianReal (μ := (0 : ℝ)) (v := (1 : ℝ≥0)) one_ne_zero;
       exact measure_singleton a)
    | (haveI := nullSingletonClass_gaussianReal (μ := (0 : ℝ)) (v := (1 : ℝ≥0)) one_ne_zero;
       exact measure_singleton a)

end Gaussian

namespace IsStdNormal

variable {Ω : Type*} [MeasurableSpace Ω] {μ : Measure Ω} {X : Ω → ℝ}

/-- Integrals of `f ∘ X` are integrals against the law: `∫ f (X ω) dμ = ∫ f d N(0, 1)`. -/
theorem integral_comp (h : IsStdNormal μ X) (f : ℝ → ℝ) (hf : Measurable f) :
    ∫ ω, f (X ω) ∂μ = ∫ x, f x ∂(gaussianReal 0 1) := by
  have hmap : ∫ x, f x ∂(μ.map X) = ∫ ω, f (X ω) ∂μ :=
    integral_map h.measurable.aemeasurable hf.aestronglyMeasurable
  rw [← hmap, h.law]

theorem integrable (h : IsStdNormal μ X) : Integrable X μ := by
  have h1 : Integrable (fun x : ℝ => x) (μ.map X) := by
    rw [h.law]
    exact gauss_integrable_id
  first
    | exact h1.comp_measurable h.measurable
    | simpa [Function.comp_def] using h1.comp_measurable h.measurable

theorem integrable_sq (h : IsStdNormal μ X) : Integrable (fun ω => X ω ^ 2) μ := by
  have h1 : Integrable (fun x : ℝ => x ^ 2) (μ.map X) := by
    rw [h.law]
    exact gauss_integrable_sq
  first
    | exact h1.comp_measurable h.measurable
    | simpa [Function.comp_def] using h1.comp_measurable h.measurable

theorem integral_eq_zero (h : IsStdNormal μ X) : ∫ ω, X ω ∂μ = 0 := by
  have h1 : ∫ ω, X ω ∂μ = ∫ x, x ∂(gaussianReal 0 1) :=
    h.integral_comp (fun x => x) measurable_id'
  rw [h1]
  exact gauss_integral_id

theorem integral_sq_eq_one (h : IsStdNormal μ X) : ∫ ω, X ω ^ 2 ∂μ = 1 := by
  have hmeas : Measurable (fun x : ℝ => x ^ 2) := by
    first
      | exact measurable_id'.pow_const 2
      | fun_prop
      | exact (continuous_pow 2).measurable
  have h1 : ∫ ω, X ω ^ 2 ∂μ = ∫ x, x ^ 2 ∂(gaussianReal 0 1) :=
    h.integral_comp (fun x => x ^ 2) hmeas
  rw [h1]
  exact gauss_integral_sq

/-- No value is hit with positive probability: `X ≠ a` almost surely. -/
theorem ae_ne (h : IsStdNormal μ X) (a : ℝ) : ∀ᵐ ω ∂μ, X ω ≠ a := by
  have hpre : μ (X ⁻¹' {a}) = 0 := by
    have hm : μ.map X {a} = μ (X ⁻¹' {a}) := Measure.map_apply h.measurable (measurableSet_singleton a)
    rw [← hm, h.law]
    exact gauss_singleton a
  have hset : {ω | ¬ (X ω ≠ a)} = X ⁻¹' {a} := by
    ext ω
    simp
  have hnull : μ {ω | ¬ (X ω ≠ a)} = 0 := by
    rw [hset]
    exact hpre
  exact ae_iff.mpr hnull

end IsStdNormal

/-! ## The Kullback–Leibler divergence of two Gaussians with one variance -/

section Divergence

/-- `σ²` as the `ℝ≥0` variance parameter of `gaussianReal` / `gaussianPDFReal`. -/
def nnsq (σ : ℝ) : ℝ≥0 := by
  first
    | exact ⟨σ ^ 2, sq_nonneg σ⟩
    | exact .mk (σ ^ 2) (sq_nonneg σ)

theorem coe_nnsq (σ : ℝ) : ((nnsq σ : ℝ≥0) : ℝ) = σ ^ 2 := rfl

theorem nnsq_ne_zero (σ : ℝ) (hσ : σ ≠ 0) : nnsq σ ≠ 0 := by
  intro h
  have h2 : ((nnsq σ : ℝ≥0) : ℝ) = ((0 : ℝ≥0) : ℝ) := congrArg (fun r : ℝ≥0 => (r : ℝ)) h
  have h3 : σ ^ 2 = 0 := by
    rw [coe_nnsq σ, NNReal.coe_zero] at h2
    exact h2
  exact pow_ne_zero 2 hσ h3

/-- The log-likelihood ratio of `N(a, v)` against `N(b, v)` at `x`, from Mathlib's densities:
`log (gaussianPDFReal a v x / gaussianPDFReal b v x)`. -/
def gaussLogLR (a b : ℝ) (v : ℝ≥0) (x : ℝ) : ℝ :=
  Real.log (gaussianPDFReal a v x / gaussianPDFReal b v x)

/-- The normalising constants cancel: `log (p_a(x) / p_b(x)) = ((x − b)² − (x − a)²) / (2v)`. -/
theorem gaussLogLR_eq (a b : ℝ) (v : ℝ≥0) (hv : v ≠ 0) (x : ℝ) :
    gaussLogLR a b v x = ((x - b) ^ 2 - (x - a) ^ 2) / (2 * (v : ℝ)) := by
  have hv' : (0 : ℝ) < (v : ℝ) := by
    first
      | exact NNReal.coe_pos.mpr (pos_iff_ne_zero.mpr hv)
      | exact lt_of_le_of_ne v.2 (fun h => hv (NNReal.coe_eq_zero.mp h.symm))
  have h2pv : (0 : ℝ) < 2 * Real.pi * (v : ℝ) :=
    mul_pos (mul_pos (by norm_num) Real.pi_pos) hv'
  have hc : (Real.sqrt (2 * Real.pi * (v : ℝ)))⁻¹ ≠ 0 :=
    inv_ne_zero (Real.sqrt_pos.mpr h2pv).ne'
  have hpdf : ∀ m : ℝ, gaussianPDFReal m v x
      = (Real.sqrt (2 * Real.pi * (v : ℝ)))⁻¹ * Real.exp (-(x - m) ^ 2 / (2 * (v : ℝ))) := by
    intro m
    first
      | rfl
      | (unfold gaussianPDFReal; rfl)
      | simp [gaussianPDFReal]
  unfold gaussLogLR
  rw [hpdf a, hpdf b, mul_div_mul_left _ _ hc, ← Real.exp_sub, Real.log_exp]
  ring

/-- **KL of two Gaussians with one variance.** `KL(N(a, v) ‖ N(b, v))`, written as the expected
log-likelihood ratio `∫ log (p_a / p_b) dN(a, v)`, is `(a − b)² / (2v)`. -/
theorem kl_gaussianReal_same_var (a b : ℝ) (v : ℝ≥0) (hv : v ≠ 0) :
    ∫ x, gaussLogLR a b v x ∂(gaussianReal a v) = (a - b) ^ 2 / (2 * (v : ℝ)) := by
  -- the log-likelihood ratio is affine in `x`
  have hfun : (fun x => gaussLogLR a b v x)
      = fun x => (a - b) / (v : ℝ) * x + (b ^ 2 - a ^ 2) / (2 * (v : ℝ)) := by
    funext x
    rw [gaussLogLR_eq a b v hv x]
    ring
  have hI : Integrable (fun x : ℝ => x) (gaussianReal a v) := by
    first
      | exact (memLp_id_gaussianReal' 1 ENNReal.one_ne_top).integrable le_rfl
      | exact memLp_one_iff_integrable.mp (memLp_id_gaussianReal' 1 ENNReal.one_ne_top)
      | exact (memLp_id_gaussianReal 1).integrable le_rfl
      | exact memLp_one_iff_integrable.mp (memLp_id_gaussianReal 1)
  have h0 : ∫ x, gaussLogLR a b v x ∂(gaussianReal a v)
      = ∫ x, ((a - b) / (v : ℝ) * x + (b ^ 2 - a ^ 2) / (2 * (v : ℝ))) ∂(gaussianReal a v) := by
    first
      | exact congrArg (fun f : ℝ → ℝ => ∫ x, f x ∂(gaussianReal a v)) hfun
      | rw [hfun]
      | simp only [hfun]
  have h1 : ∫ x, ((a - b) / (v : ℝ) * x + (b ^ 2 - a ^ 2) / (2 * (v : ℝ))) ∂(gaussianReal a v)
      = ∫ x, (a - b) / (v : ℝ) * x ∂(gaussianReal a v)
        + ∫ _x, (b ^ 2 - a ^ 2) / (2 * (v : ℝ)) ∂(gaussianReal a v) :=
    integral_add (hI.const_mul _) (integrable_const _)
  have h2 : ∫ x, (a - b) / (v : ℝ) * x ∂(gaussianReal a v)
      = (a - b) / (v : ℝ) * ∫ x, x ∂(gaussianReal a v) := by
    first
      | exact integral_const_mul _ _
      | exact integral_mul_left _ _
      | simpa [smul_eq_mul] using
          integral_smul (μ := gaussianReal a v) ((a - b) / (v : ℝ)) (fun x : ℝ => x)
  have h3 : ∫ x, x ∂(gaussianReal a v) = a := by
    first
      | exact integral_id_gaussianReal
      | simp
  have h4 : ∫ _x, (b ^ 2 - a ^ 2) / (2 * (v : ℝ)) ∂(gaussianReal a v)
      = (b ^ 2 - a ^ 2) / (2 * (v : ℝ)) := by
    first
      | simp
      | (rw [integral_const]; simp)
  rw [h0, h1, h2, h3, h4]
  ring

/-- **Summed over coordinates.** `∑ᵢ KL(N(aᵢ, v) ‖ N(bᵢ, v)) = (∑ᵢ (aᵢ − bᵢ)²) / (2v)`: for a
vector with independent coordinates this is `KL(N(a, v I) ‖ N(b, v I)) = ‖a − b‖² / (2v)`, with
no factor `1/d`. -/
theorem kl_gaussianReal_sum {d : ℕ} (a b : Fin d → ℝ) (v : ℝ≥0) (hv : v ≠ 0) :
    ∑ i, ∫ x, gaussLogLR (a i) (b i) v x ∂(gaussianReal (a i) v)
      = (∑ i, (a i - b i) ^ 2) / (2 * (v : ℝ)) := by
  have h : ∑ i, ∫ x, gaussLogLR (a i) (b i) v x ∂(gaussianReal (a i) v)
      = ∑ i, (a i - b i) ^ 2 / (2 * (v : ℝ)) :=
    Finset.sum_congr rfl (fun i _ => kl_gaussianReal_same_var (a i) (b i) v hv)
  rw [h]
  first
    | exact (Finset.sum_div Finset.univ (fun i => (a i - b i) ^ 2) (2 * (v : ℝ))).symm
    | rw [Finset.sum_div]
    | (simp only [div_eq_mul_inv]; rw [Finset.sum_mul])

end Divergence

end Aegis
