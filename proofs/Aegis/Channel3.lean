import Aegis.Channel2

/-!
# Channel 3: matrix flood of MLP gradients (Theorem 3)

For an `m × n` gradient `G` (an MLP expansion / contraction weight) AEGIS exports
`out = ρ G + σ Z` with `σ = λ m̄` and noise entries `Z i j` of mean `0` and second moment `1`.

The statements hold for an arbitrary probability space `(Ω, μ)` with the moment facts about `Z`
as explicit hypotheses; no distribution-specific lemma is used.

* `Aegis.channel3_decomposition`: `E[out i j] - G i j = (ρ - 1) G i j` (biased-gradient
  decomposition: the flood is unbiased up to the scale `ρ`).
* `Aegis.channel3_frobenius_second_moment`:
  `E ‖out‖_F² = ρ² ‖G‖_F² + m n λ² m̄²`.
* `Aegis.channel3_relative_inflation`: if `‖G‖_F ≤ C m̄`, `λ > 0`, `m̄ > 0`, then
  `ρ² ‖G‖_F² / (m n λ² m̄²) ≤ ρ² C² / (m n λ²)`.

Matrices are `Fin m → Fin n → ℝ`; squared Frobenius norms are explicit double sums
`∑ i, ∑ j, G i j ^ 2` (Mathlib's Frobenius norm is a scoped, non-canonical instance).
Written without a Lean toolchain at hand: not machine-checked where it was written.
-/

open MeasureTheory ProbabilityTheory
open scoped ENNReal NNReal

noncomputable section

namespace Aegis

variable {Ω : Type*} [MeasurableSpace Ω] {μ : Measure Ω} [IsProbabilityMeasure μ]

/-- **Theorem 3 (decomposition).** Each entry of the matrix flood has mean `ρ G i j`, so the
exported gradient is the true gradient plus the bias `(ρ - 1) G` plus zero-mean noise. -/
theorem channel3_decomposition {m n : ℕ} (ρ σ : ℝ) (G : Fin m → Fin n → ℝ)
    (Z : Fin m → Fin n → Ω → ℝ) (hZ : ∀ i j, Integrable (Z i j) μ)
    (hmean : ∀ i j, ∫ ω, Z i j ω ∂μ = 0) (i : Fin m) (j : Fin n) :
    (∫ ω, (ρ * G i j + σ * Z i j ω) ∂μ) - G i j = (ρ - 1) * G i j := by
  have hX : Integrable (fun ω => σ * Z i j ω) μ := (hZ i j).const_mul σ
  have hXm : ∫ ω, σ * Z i j ω ∂μ = 0 := by
    have h : ∫ ω, σ * Z i j ω ∂μ = σ * ∫ ω, Z i j ω ∂μ :=
      flood_integral_cmul (μ := μ) σ (Z i j)
    first
      | (rw [h, hmean i j]; ring)
      | (simp [h, hmean i j]; done)
  have hE : ∫ ω, (ρ * G i j + σ * Z i j ω) ∂μ = ρ * G i j :=
    flood_coord_mean (μ := μ) (ρ * G i j) (fun ω => σ * Z i j ω) hX hXm
  first
    | linarith [hE]
    | linear_combination hE
    | (rw [hE]; ring)

/-- **Theorem 3 (Frobenius second moment).** For `out = ρ G + λ m̄ Z` with `E Z = 0` and
`E Z² = 1` entrywise: `E ‖out‖_F² = ρ² ‖G‖_F² + m n λ² m̄²`. -/
theorem channel3_frobenius_second_moment {m n : ℕ} (ρ lam mbar : ℝ) (G : Fin m → Fin n → ℝ)
    (Z : Fin m → Fin n → Ω → ℝ) (hZ : ∀ i j, Integrable (Z i j) μ)
    (hZ2 : ∀ i j, Integrable (fun ω => Z i j ω ^ 2) μ)
    (hmean : ∀ i j, ∫ ω, Z i j ω ∂μ = 0) (hsq : ∀ i j, ∫ ω, Z i j ω ^ 2 ∂μ = 1) :
    ∫ ω, ∑ i, ∑ j, (ρ * G i j + lam * mbar * Z i j ω) ^ 2 ∂μ
      = ρ ^ 2 * (∑ i, ∑ j, G i j ^ 2) + (m : ℝ) * (n : ℝ) * lam ^ 2 * mbar ^ 2 := by
  -- the scaled noise `X i j = λ m̄ Z i j`: integrable, mean 0, second moment (λ m̄)²
  have hX : ∀ i j, Integrable (fun ω => lam * mbar * Z i j ω) μ :=
    fun i j => (hZ i j).const_mul (lam * mbar)
  have hX2 : ∀ i j, Integrable (fun ω => (lam * mbar * Z i j ω) ^ 2) μ := by
    intro i j
    have hfun : (fun ω => (lam * mbar * Z i j ω) ^ 2)
        = fun ω => (lam * mbar) ^ 2 * Z i j ω ^ 2 := by
      funext ω
      ring
    have hI : Integrable (fun ω => (lam * mbar) ^ 2 * Z i j ω ^ 2) μ :=
      (hZ2 i j).const_mul ((lam * mbar) ^ 2)
    first
      | (rw [hfun]; exact hI)
      | exact hfun ▸ hI
      | simpa [hfun] using hI
  have hXm : ∀ i j, ∫ ω, lam * mbar * Z i j ω ∂μ = 0 := by
    intro i j
    have h : ∫ ω, lam * mbar * Z i j ω ∂μ = lam * mbar * ∫ ω, Z i j ω ∂μ :=
      flood_integral_cmul (μ := μ) (lam * mbar) (Z i j)
    first
      | (rw [h, hmean i j]; ring)
      | (simp [h, hmean i j]; done)
  have hXs : ∀ i j, ∫ ω, (lam * mbar * Z i j ω) ^ 2 ∂μ = (lam * mbar) ^ 2 := by
    intro i j
    have hfun : (fun ω => (lam * mbar * Z i j ω) ^ 2)
        = fun ω => (lam * mbar) ^ 2 * Z i j ω ^ 2 := by
      funext ω
      ring
    have h0 : ∫ ω, (lam * mbar * Z i j ω) ^ 2 ∂μ
        = ∫ ω, (lam * mbar) ^ 2 * Z i j ω ^ 2 ∂μ := by
      first
        | exact congrArg (fun f : Ω → ℝ => ∫ ω, f ω ∂μ) hfun
        | rw [hfun]
        | simp only [hfun]
    have h1 : ∫ ω, (lam * mbar) ^ 2 * Z i j ω ^ 2 ∂μ
        = (lam * mbar) ^ 2 * ∫ ω, Z i j ω ^ 2 ∂μ :=
      flood_integral_cmul (μ := μ) ((lam * mbar) ^ 2) (fun ω => Z i j ω ^ 2)
    have h2 : (lam * mbar) ^ 2 * ∫ ω, Z i j ω ^ 2 ∂μ = (lam * mbar) ^ 2 := by
      first
        | (rw [hsq i j]; ring)
        | (simp [hsq i j]; done)
    first
      | linarith [h0, h1, h2]
      | linear_combination h0 + h1 + h2
  -- one row at a time (Theorem 2's computation with `d = n`)
  have hrow : ∀ i, ∫ ω, ∑ j, (ρ * G i j + lam * mbar * Z i j ω) ^ 2 ∂μ
      = (∑ j, (ρ * G i j) ^ 2) + (n : ℝ) * (lam * mbar) ^ 2 := by
    intro i
    exact flood_row_second_moment (μ := μ) (fun j => ρ * G i j)
      (fun j ω => lam * mbar * Z i j ω) (lam * mbar) (hX i) (hX2 i) (hXm i) (hXs i)
  have hint : ∀ i ∈ (Finset.univ : Finset (Fin m)),
      Integrable (fun ω => ∑ j, (ρ * G i j + lam * mbar * Z i j ω) ^ 2) μ := by
    intro i _
    exact integrable_finset_sum Finset.univ (fun j _ =>
      flood_coord_integrable_sq (μ := μ) (ρ * G i j) (fun ω => lam * mbar * Z i j ω)
        (hX i j) (hX2 i j))
  have hswap : ∫ ω, ∑ i, ∑ j, (ρ * G i j + lam * mbar * Z i j ω) ^ 2 ∂μ
      = ∑ i, ∫ ω, ∑ j, (ρ * G i j + lam * mbar * Z i j ω) ^ 2 ∂μ :=
    integral_finset_sum Finset.univ hint
  have hsum : ∑ i, ∫ ω, ∑ j, (ρ * G i j + lam * mbar * Z i j ω) ^ 2 ∂μ
      = ∑ i, ((∑ j, (ρ * G i j) ^ 2) + (n : ℝ) * (lam * mbar) ^ 2) :=
    Finset.sum_congr rfl (fun i _ => hrow i)
  have hsplit : ∑ i, ((∑ j, (ρ * G i j) ^ 2) + (n : ℝ) * (lam * mbar) ^ 2)
      = (∑ i, ∑ j, (ρ * G i j) ^ 2) + ∑ _i : Fin m, (n : ℝ) * (lam * mbar) ^ 2 := by
    first
      | exact Finset.sum_add_distrib
      | rw [Finset.sum_add_distrib]
  have hconst : ∑ _i : Fin m, (n : ℝ) * (lam * mbar) ^ 2
      = (m : ℝ) * ((n : ℝ) * (lam * mbar) ^ 2) := by
    first
      | (simp; done)
      | (rw [Finset.sum_const, Finset.card_univ, Fintype.card_fin, nsmul_eq_mul])
      | (simp [Finset.sum_const, nsmul_eq_mul]; done)
  have hfac : ∑ i, ∑ j, (ρ * G i j) ^ 2 = ρ ^ 2 * (∑ i, ∑ j, G i j ^ 2) := by
    have hinner : ∀ i, ∑ j, (ρ * G i j) ^ 2 = ρ ^ 2 * (∑ j, G i j ^ 2) := by
      intro i
      first
        | (rw [Finset.mul_sum]; exact Finset.sum_congr rfl (fun j _ => by ring))
        | (simp [mul_pow, Finset.mul_sum]; done)
    have hcongr : ∑ i, ∑ j, (ρ * G i j) ^ 2 = ∑ i, ρ ^ 2 * (∑ j, G i j ^ 2) :=
      Finset.sum_congr rfl (fun i _ => hinner i)
    have hout : ∑ i, ρ ^ 2 * (∑ j, G i j ^ 2) = ρ ^ 2 * (∑ i, ∑ j, G i j ^ 2) := by
      first
        | exact (Finset.mul_sum Finset.univ (fun i => ∑ j, G i j ^ 2) (ρ ^ 2)).symm
        | rw [Finset.mul_sum]
        | (simp [Finset.mul_sum]; done)
    first
      | linarith [hcongr, hout]
      | linear_combination hcongr + hout
  first
    | linarith [hswap, hsum, hsplit, hconst, hfac]
    | linear_combination hswap + hsum + hsplit + hconst + hfac

/-- **Theorem 3 (relative inflation).** If `‖G‖_F ≤ C m̄`, `λ > 0` and `m̄ > 0`, the
signal-to-noise ratio of the matrix flood, `ρ² ‖G‖_F² / (m n λ² m̄²)`, is at most
`ρ² C² / (m n λ²)`. -/
theorem channel3_relative_inflation {m n : ℕ} (hm : 0 < m) (hn : 0 < n) (ρ lam mbar C : ℝ)
    (G : Fin m → Fin n → ℝ) (hlam : 0 < lam) (hmbar : 0 < mbar)
    (hG : Real.sqrt (∑ i, ∑ j, G i j ^ 2) ≤ C * mbar) :
    (ρ ^ 2 * (∑ i, ∑ j, G i j ^ 2)) / ((m : ℝ) * (n : ℝ) * lam ^ 2 * mbar ^ 2)
      ≤ (ρ ^ 2 * C ^ 2) / ((m : ℝ) * (n : ℝ) * lam ^ 2) := by
  have hmpos : (0 : ℝ) < (m : ℝ) := by
    first
      | exact_mod_cast hm
      | exact Nat.cast_pos.mpr hm
  have hnpos : (0 : ℝ) < (n : ℝ) := by
    first
      | exact_mod_cast hn
      | exact Nat.cast_pos.mpr hn
  have hS0 : 0 ≤ ∑ i, ∑ j, G i j ^ 2 :=
    Finset.sum_nonneg (fun i _ => Finset.sum_nonneg (fun j _ => sq_nonneg (G i j)))
  have hS : ∑ i, ∑ j, G i j ^ 2 ≤ (C * mbar) ^ 2 := flood_sq_le_of_sqrt_le _ _ hS0 hG
  have h1 : ρ ^ 2 * (∑ i, ∑ j, G i j ^ 2) ≤ ρ ^ 2 * (C * mbar) ^ 2 := by
    first
      | exact mul_le_mul_of_nonneg_left hS (sq_nonneg ρ)
      | nlinarith [hS, sq_nonneg ρ]
  have h2 : ρ ^ 2 * (C * mbar) ^ 2 = (ρ ^ 2 * C ^ 2) * mbar ^ 2 := by ring
  have hAB : ρ ^ 2 * (∑ i, ∑ j, G i j ^ 2) ≤ (ρ ^ 2 * C ^ 2) * mbar ^ 2 := by
    linarith [h1, h2]
  have hmn : (0 : ℝ) < (m : ℝ) * (n : ℝ) := mul_pos hmpos hnpos
  have hE : 0 < (m : ℝ) * (n : ℝ) * lam ^ 2 := mul_pos hmn (pow_pos hlam 2)
  have hD : 0 < (m : ℝ) * (n : ℝ) * lam ^ 2 * mbar ^ 2 := mul_pos hE (pow_pos hmbar 2)
  have hDE : (m : ℝ) * (n : ℝ) * lam ^ 2 * mbar ^ 2 = ((m : ℝ) * (n : ℝ) * lam ^ 2) * mbar ^ 2 := by
    ring
  exact flood_inflation_core _ _ _ _ _ hD hE hDE hAB

end Aegis
