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

end Aegis
