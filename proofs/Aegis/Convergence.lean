import Aegis.Channel2

/-!
# Proposition 1: the flooded gradient is a biased, scaled gradient

For a gradient `g ∈ ℝ^d` AEGIS exports `out = ρ g + n` with zero-mean noise `n`. Then

* `E[out] = ρ g` (coordinatewise),
* the bias is `E[out] - g = (ρ - 1) g`,
* for `0 ≤ ρ ≤ 1` its Euclidean norm is `‖E[out] - g‖ = (1 - ρ) ‖g‖`.

So SGD on flooded gradients is SGD on the true gradient with the step scaled by `ρ`, plus
zero-mean noise (the convergence statement of the paper then follows from the standard analysis
of SGD with unbiased noise, which is not re-proved here).

Arbitrary probability space, explicit hypotheses (integrability and zero mean of the noise).
Euclidean norms are explicit: `Real.sqrt (∑ i, x i ^ 2)`.
Written without a Lean toolchain at hand: not machine-checked where it was written.
-/

open MeasureTheory ProbabilityTheory
open scoped ENNReal NNReal

noncomputable section

namespace Aegis

variable {Ω : Type*} [MeasurableSpace Ω] {μ : Measure Ω} [IsProbabilityMeasure μ]

/-- **Proposition 1.** For `out = ρ g + n` with integrable zero-mean noise:
(1) `E[out i] = ρ g i`; (2) the bias is `E[out i] - g i = (ρ - 1) g i`; (3) if `0 ≤ ρ ≤ 1`,
`‖E[out] - g‖ = (1 - ρ) ‖g‖`. -/
theorem biased_gradient_decomposition {d : ℕ} (ρ : ℝ) (g : Fin d → ℝ) (n : Fin d → Ω → ℝ)
    (hn : ∀ i, Integrable (n i) μ) (hmean : ∀ i, ∫ ω, n i ω ∂μ = 0) :
    (∀ i, ∫ ω, (ρ * g i + n i ω) ∂μ = ρ * g i) ∧
    (∀ i, (∫ ω, (ρ * g i + n i ω) ∂μ) - g i = (ρ - 1) * g i) ∧
    (0 ≤ ρ → ρ ≤ 1 →
      Real.sqrt (∑ i, ((∫ ω, (ρ * g i + n i ω) ∂μ) - g i) ^ 2)
        = (1 - ρ) * Real.sqrt (∑ i, g i ^ 2)) := by
  have hE : ∀ i, ∫ ω, (ρ * g i + n i ω) ∂μ = ρ * g i :=
    fun i => flood_coord_mean (μ := μ) (ρ * g i) (n i) (hn i) (hmean i)
  have hB : ∀ i, (∫ ω, (ρ * g i + n i ω) ∂μ) - g i = (ρ - 1) * g i := by
    intro i
    have h : ∫ ω, (ρ * g i + n i ω) ∂μ = ρ * g i := hE i
    first
      | linarith [h]
      | linear_combination h
      | (rw [h]; ring)
  refine ⟨hE, hB, ?_⟩
  intro hρ0 hρ1
  have h1ρ : 0 ≤ 1 - ρ := by linarith
  have hterm : ∀ i, ((∫ ω, (ρ * g i + n i ω) ∂μ) - g i) ^ 2
      = ((1 - ρ) * (1 - ρ)) * g i ^ 2 := by
    intro i
    first
      | (rw [hB i]; ring)
      | linear_combination ((∫ ω, (ρ * g i + n i ω) ∂μ) - g i + (ρ - 1) * g i) * hB i
  have hsum : ∑ i, ((∫ ω, (ρ * g i + n i ω) ∂μ) - g i) ^ 2
      = ∑ i, ((1 - ρ) * (1 - ρ)) * g i ^ 2 :=
    Finset.sum_congr rfl (fun i _ => hterm i)
  have hfac : ∑ i, ((1 - ρ) * (1 - ρ)) * g i ^ 2 = ((1 - ρ) * (1 - ρ)) * (∑ i, g i ^ 2) := by
    first
      | exact (Finset.mul_sum Finset.univ (fun i => g i ^ 2) ((1 - ρ) * (1 - ρ))).symm
      | rw [Finset.mul_sum]
      | (simp [Finset.mul_sum]; done)
  have hsqrt : Real.sqrt (((1 - ρ) * (1 - ρ)) * (∑ i, g i ^ 2))
      = (1 - ρ) * Real.sqrt (∑ i, g i ^ 2) := by
    rw [Real.sqrt_mul (mul_nonneg h1ρ h1ρ), Real.sqrt_mul_self h1ρ]
  rw [hsum, hfac, hsqrt]

/-- Proposition 1 in the flood's own parameters: noise `σ z` with `E z = 0` (any `σ`). -/
theorem biased_gradient_mean {d : ℕ} (ρ σ : ℝ) (g : Fin d → ℝ) (z : Fin d → Ω → ℝ)
    (hz : ∀ i, Integrable (z i) μ) (hmean : ∀ i, ∫ ω, z i ω ∂μ = 0) (i : Fin d) :
    ∫ ω, (ρ * g i + σ * z i ω) ∂μ = ρ * g i := by
  have hX : Integrable (fun ω => σ * z i ω) μ := (hz i).const_mul σ
  have hXm : ∫ ω, σ * z i ω ∂μ = 0 := by
    have h : ∫ ω, σ * z i ω ∂μ = σ * ∫ ω, z i ω ∂μ := flood_integral_cmul (μ := μ) σ (z i)
    first
      | (rw [h, hmean i]; ring)
      | (simp [h, hmean i]; done)
  exact flood_coord_mean (μ := μ) (ρ * g i) (fun ω => σ * z i ω) hX hXm

end Aegis
