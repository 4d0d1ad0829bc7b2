import Mathlib

/-!
# Channel 2: row flood of embedding gradients (Theorem 2)

For a row gradient `g_v ∈ ℝ^d` (a token-embedding row) AEGIS exports

* `out_v = ρ g_v + n_v` if the row is active (`v ∈ S`),
* `out_v = n_v` otherwise,

where the noise `n_v` has zero-mean coordinates with second moment `σ²` (`σ = λ m̄`).

The moment statements hold for an arbitrary probability space `(Ω, μ)`: the facts about the noise
are explicit hypotheses (integrability, `∫ n_i = 0`, `∫ n_i ^ 2 = σ ^ 2`). Only the last result
(`channel2_rows_nonzero_ae`) is Gaussian-specific, a thin corollary on top.

* `Aegis.channel2_second_moment_active`: `E ‖ρ g + n‖² = ρ² ‖g‖² + d σ²`.
* `Aegis.channel2_second_moment_inactive`: `E ‖n‖² = d σ²`.
* `Aegis.channel2_relative_inflation`: if `‖g‖ ≤ C m̄`, `λ > 0`, `m̄ > 0`, then
  `ρ² ‖g‖² / (d (λ m̄)²) ≤ ρ² C² / (d λ²)`.
* `Aegis.channel2_rows_nonzero_ae`: with Gaussian noise of variance `v ≠ 0`, every flooded row
  (active or not) is non-zero almost surely.

This file also holds the generic helper lemmas (prefixed `flood_`) reused by `Channel3` and
`Convergence`.

Vectors are `Fin d → ℝ` and squared norms are explicit sums `∑ i, x i ^ 2`.
Written without a Lean toolchain at hand: not machine-checked where it was written.
-/

open MeasureTheory ProbabilityTheory
open scoped ENNReal NNReal

noncomputable section

namespace Aegis

section Helpers

variable {Ω : Type*} [MeasurableSpace Ω] {μ : Measure Ω} [IsProbabilityMeasure μ]

/-- The integral of a constant against a probability measure. -/
theorem flood_integral_const (c : ℝ) : ∫ _ω, c ∂μ = c := by
  first
    | (simp; done)
    | (rw [integral_const]; simp; done)
    | (simp [integral_const, measure_univ]; done)

/-- Pulling a real constant out of an integral (version-robust wrapper). -/
theorem flood_integral_cmul (c : ℝ) (f : Ω → ℝ) :
    ∫ ω, c * f ω ∂μ = c * ∫ ω, f ω ∂μ := by
  first
    | exact integral_const_mul c f
    | exact integral_mul_left c f
    | simpa [smul_eq_mul] using integral_smul (μ := μ) c f

/-- `(a + X)²` is integrable when `X` and `X²` are. -/
theorem flood_coord_integrable_sq (a : ℝ) (X : Ω → ℝ) (hX : Integrable X μ)
    (hX2 : Integrable (fun ω => X ω ^ 2) μ) :
    Integrable (fun ω => (a + X ω) ^ 2) μ := by
  have hfun : (fun ω => (a + X ω) ^ 2) = fun ω => (a ^ 2 + 2 * a * X ω) + X ω ^ 2 := by
    funext ω
    ring
  have hI : Integrable (fun ω => (a ^ 2 + 2 * a * X ω) + X ω ^ 2) μ :=
    ((integrable_const (a ^ 2)).add (hX.const_mul (2 * a))).add hX2
  first
    | (rw [hfun]; exact hI)
    | exact hfun ▸ hI
    | simpa [hfun] using hI

/-- Mean of one flooded coordinate: `E[a + X] = a` when `E[X] = 0`. -/
theorem flood_coord_mean (a : ℝ) (X : Ω → ℝ) (hX : Integrable X μ)
    (hmean : ∫ ω, X ω ∂μ = 0) :
    ∫ ω, (a + X ω) ∂μ = a := by
  have h1 : ∫ ω, (a + X ω) ∂μ = ∫ _ω, a ∂μ + ∫ ω, X ω ∂μ :=
    integral_add (integrable_const a) hX
  have h2 : ∫ _ω, a ∂μ = a := flood_integral_const (μ := μ) a
  first
    | linarith [h1, h2, hmean]
    | linear_combination h1 + h2 + hmean

/-- Second moment of one flooded coordinate: `E[(a + X)²] = a² + s²` when `E[X] = 0` and
`E[X²] = s²`. -/
theorem flood_coord_second_moment (a : ℝ) (X : Ω → ℝ) (s : ℝ) (hX : Integrable X μ)
    (hX2 : Integrable (fun ω => X ω ^ 2) μ) (hmean : ∫ ω, X ω ∂μ = 0)
    (hsq : ∫ ω, X ω ^ 2 ∂μ = s ^ 2) :
    ∫ ω, (a + X ω) ^ 2 ∂μ = a ^ 2 + s ^ 2 := by
  have hfun : (fun ω => (a + X ω) ^ 2) = fun ω => (a ^ 2 + 2 * a * X ω) + X ω ^ 2 := by
    funext ω
    ring
  have hA : Integrable (fun ω => a ^ 2 + 2 * a * X ω) μ :=
    (integrable_const (a ^ 2)).add (hX.const_mul (2 * a))
  have h0 : ∫ ω, (a + X ω) ^ 2 ∂μ = ∫ ω, ((a ^ 2 + 2 * a * X ω) + X ω ^ 2) ∂μ := by
    first
      | exact congrArg (fun f : Ω → ℝ => ∫ ω, f ω ∂μ) hfun
      | rw [hfun]
      | simp only [hfun]
  have h1 : ∫ ω, ((a ^ 2 + 2 * a * X ω) + X ω ^ 2) ∂μ
      = ∫ ω, (a ^ 2 + 2 * a * X ω) ∂μ + ∫ ω, X ω ^ 2 ∂μ :=
    integral_add hA hX2
  have h2 : ∫ ω, (a ^ 2 + 2 * a * X ω) ∂μ = ∫ _ω, a ^ 2 ∂μ + ∫ ω, 2 * a * X ω ∂μ :=
    integral_add (integrable_const (a ^ 2)) (hX.const_mul (2 * a))
  have h3 : ∫ _ω, a ^ 2 ∂μ = a ^ 2 := flood_integral_const (μ := μ) (a ^ 2)
  have h4 : ∫ ω, 2 * a * X ω ∂μ = 2 * a * ∫ ω, X ω ∂μ :=
    flood_integral_cmul (μ := μ) (2 * a) X
  have h5 : 2 * a * ∫ ω, X ω ∂μ = 0 := by
    first
      | (rw [hmean]; ring)
      | (simp [hmean]; done)
  first
    | linarith [h0, h1, h2, h3, h4, h5, hsq]
    | linear_combination h0 + h1 + h2 + h3 + h4 + h5 + hsq

/-- Second moment of a flooded vector `a + X ∈ ℝ^d`:
`E ∑ᵢ (aᵢ + Xᵢ)² = ∑ᵢ aᵢ² + d s²`. -/
theorem flood_row_second_moment {d : ℕ} (a : Fin d → ℝ) (X : Fin d → Ω → ℝ) (s : ℝ)
    (hX : ∀ i, Integrable (X i) μ) (hX2 : ∀ i, Integrable (fun ω => X i ω ^ 2) μ)
    (hmean : ∀ i, ∫ ω, X i ω ∂μ = 0) (hsq : ∀ i, ∫ ω, X i ω ^ 2 ∂μ = s ^ 2) :
    ∫ ω, ∑ i, (a i + X i ω) ^ 2 ∂μ = (∑ i, a i ^ 2) + (d : ℝ) * s ^ 2 := by
  have hint : ∀ i ∈ (Finset.univ : Finset (Fin d)),
      Integrable (fun ω => (a i + X i ω) ^ 2) μ :=
    fun i _ => flood_coord_integrable_sq (μ := μ) (a i) (X i) (hX i) (hX2 i)
  have hswap : ∫ ω, ∑ i, (a i + X i ω) ^ 2 ∂μ = ∑ i, ∫ ω, (a i + X i ω) ^ 2 ∂μ :=
    integral_finset_sum Finset.univ hint
  have hterm : ∀ i, ∫ ω, (a i + X i ω) ^ 2 ∂μ = a i ^ 2 + s ^ 2 :=
    fun i => flood_coord_second_moment (μ := μ) (a i) (X i) s (hX i) (hX2 i) (hmean i) (hsq i)
  have hsum : ∑ i, ∫ ω, (a i + X i ω) ^ 2 ∂μ = ∑ i, (a i ^ 2 + s ^ 2) :=
    Finset.sum_congr rfl (fun i _ => hterm i)
  have hsplit : ∑ i, (a i ^ 2 + s ^ 2) = (∑ i, a i ^ 2) + ∑ _i : Fin d, s ^ 2 := by
    first
      | exact Finset.sum_add_distrib
      | rw [Finset.sum_add_distrib]
  have hconst : ∑ _i : Fin d, s ^ 2 = (d : ℝ) * s ^ 2 := by
    first
      | (simp; done)
      | (rw [Finset.sum_const, Finset.card_univ, Fintype.card_fin, nsmul_eq_mul])
      | (simp [Finset.sum_const, nsmul_eq_mul]; done)
  first
    | linarith [hswap, hsum, hsplit, hconst]
    | linear_combination hswap + hsum + hsplit + hconst

/-- From `√x ≤ y` (and `0 ≤ x`) to `x ≤ y²`. -/
theorem flood_sq_le_of_sqrt_le (x y : ℝ) (hx : 0 ≤ x) (h : Real.sqrt x ≤ y) : x ≤ y ^ 2 := by
  have hs0 : 0 ≤ Real.sqrt x := Real.sqrt_nonneg x
  have hsq : Real.sqrt x ^ 2 = x := Real.sq_sqrt hx
  have hmul : Real.sqrt x * Real.sqrt x ≤ y * y := mul_self_le_mul_self hs0 h
  first
    | linarith [hsq, hmul]
    | nlinarith [hsq, hmul]

/-- The algebraic core of every relative-inflation bound: if `D = E m²` with `D, E > 0` and
`A ≤ B m²`, then `A / D ≤ B / E`. Proved without `field_simp`. -/
theorem flood_inflation_core (A B D E m2 : ℝ) (hD : 0 < D) (hE : 0 < E) (hDE : D = E * m2)
    (hAB : A ≤ B * m2) : A / D ≤ B / E := by
  have hDne : D ≠ 0 := (ne_of_lt hD).symm
  have hEne : E ≠ 0 := (ne_of_lt hE).symm
  have hu : D * D⁻¹ = 1 := mul_inv_cancel₀ hDne
  have hw : E * E⁻¹ = 1 := mul_inv_cancel₀ hEne
  have hu0 : 0 ≤ D⁻¹ := inv_nonneg.mpr (le_of_lt hD)
  have hkey : E * (m2 * D⁻¹) = E * E⁻¹ := by
    first
      | linear_combination (-D⁻¹) * hDE + hu - hw
      | rw [show E * (m2 * D⁻¹) = (E * m2) * D⁻¹ by ring, ← hDE, hu, hw]
  have hm2u : m2 * D⁻¹ = E⁻¹ := mul_left_cancel₀ hEne hkey
  have hstep : A * D⁻¹ ≤ (B * m2) * D⁻¹ := mul_le_mul_of_nonneg_right hAB hu0
  have hstep2 : (B * m2) * D⁻¹ = B * E⁻¹ := by
    first
      | linear_combination B * hm2u
      | rw [mul_assoc, hm2u]
  calc A / D = A * D⁻¹ := by rw [div_eq_mul_inv]
    _ ≤ (B * m2) * D⁻¹ := hstep
    _ = B * E⁻¹ := hstep2
    _ = B / E := by rw [div_eq_mul_inv]

/-- A singleton is null for a non-degenerate centred real Gaussian. -/
theorem gaussian_singleton_null (v : ℝ≥0) (hv : v ≠ 0) (a : ℝ) :
    gaussianReal 0 v {a} = 0 := by
  first
    | exact (gaussianReal_absolutelyContinuous 0 hv) Real.volume_singleton
    | exact (gaussianReal_absolutelyContinuous (0 : ℝ) hv) (Real.volume_singleton (a := a))
    | (haveI := noAtoms_gaussianReal (μ := (0 : ℝ)) hv; exact measure_singleton a)
    | (haveI := nullSingletonClass_gaussianReal (μ := (0 : ℝ)) hv; exact measure_singleton a)

/-- A real random variable whose law is a non-degenerate centred Gaussian avoids any given value
almost surely. -/
theorem gaussian_coord_ne_ae (X : Ω → ℝ) (hX : Measurable X) (v : ℝ≥0) (hv : v ≠ 0)
    (hlaw : Measure.map X μ = gaussianReal 0 v) (a : ℝ) : ∀ᵐ ω ∂μ, X ω ≠ a := by
  have hnull : gaussianReal 0 v {a} = 0 := gaussian_singleton_null v hv a
  have hmap : Measure.map X μ {a} = μ (X ⁻¹' {a}) :=
    Measure.map_apply hX (measurableSet_singleton a)
  have hpre : μ (X ⁻¹' {a}) = 0 := by
    calc μ (X ⁻¹' {a}) = Measure.map X μ {a} := hmap.symm
      _ = gaussianReal 0 v {a} := by rw [hlaw]
      _ = 0 := hnull
  have hset : {ω | ¬ (X ω ≠ a)} = X ⁻¹' {a} := by
    ext ω
    simp
  refine ae_iff.mpr ?_
  first
    | (rw [hset]; exact hpre)
    | exact measure_mono_null (fun ω hω => by simpa using hω) hpre

end Helpers

section Theorem2

variable {Ω : Type*} [MeasurableSpace Ω] {μ : Measure Ω} [IsProbabilityMeasure μ]

/-- **Theorem 2 (active rows).** For an active row `out = ρ g + n`, with noise coordinates of
mean `0` and second moment `σ²`: `E ‖out‖² = ρ² ‖g‖² + d σ²`. -/
theorem channel2_second_moment_active {d : ℕ} (ρ σ : ℝ) (g : Fin d → ℝ) (n : Fin d → Ω → ℝ)
    (hn : ∀ i, Integrable (n i) μ) (hn2 : ∀ i, Integrable (fun ω => n i ω ^ 2) μ)
    (hmean : ∀ i, ∫ ω, n i ω ∂μ = 0) (hsq : ∀ i, ∫ ω, n i ω ^ 2 ∂μ = σ ^ 2) :
    ∫ ω, ∑ i, (ρ * g i + n i ω) ^ 2 ∂μ = ρ ^ 2 * (∑ i, g i ^ 2) + (d : ℝ) * σ ^ 2 := by
  have hrow : ∫ ω, ∑ i, (ρ * g i + n i ω) ^ 2 ∂μ = (∑ i, (ρ * g i) ^ 2) + (d : ℝ) * σ ^ 2 :=
    flood_row_second_moment (μ := μ) (fun i => ρ * g i) n σ hn hn2 hmean hsq
  have hfac : ∑ i, (ρ * g i) ^ 2 = ρ ^ 2 * (∑ i, g i ^ 2) := by
    first
      | (rw [Finset.mul_sum]; exact Finset.sum_congr rfl (fun i _ => by ring))
      | (simp [mul_pow, Finset.mul_sum]; done)
  first
    | linarith [hrow, hfac]
    | linear_combination hrow + hfac

/-- **Theorem 2 (inactive rows).** For an inactive row `out = n`, with noise coordinates of
second moment `σ²`: `E ‖out‖² = d σ²`. -/
theorem channel2_second_moment_inactive {d : ℕ} (σ : ℝ) (n : Fin d → Ω → ℝ)
    (hn2 : ∀ i, Integrable (fun ω => n i ω ^ 2) μ)
    (hsq : ∀ i, ∫ ω, n i ω ^ 2 ∂μ = σ ^ 2) :
    ∫ ω, ∑ i, n i ω ^ 2 ∂μ = (d : ℝ) * σ ^ 2 := by
  have hint : ∀ i ∈ (Finset.univ : Finset (Fin d)), Integrable (fun ω => n i ω ^ 2) μ :=
    fun i _ => hn2 i
  have hswap : ∫ ω, ∑ i, n i ω ^ 2 ∂μ = ∑ i, ∫ ω, n i ω ^ 2 ∂μ :=
    integral_finset_sum Finset.univ hint
  have hsum : ∑ i, ∫ ω, n i ω ^ 2 ∂μ = ∑ _i : Fin d, σ ^ 2 :=
    Finset.sum_congr rfl (fun i _ => hsq i)
  have hconst : ∑ _i : Fin d, σ ^ 2 = (d : ℝ) * σ ^ 2 := by
    first
      | (simp; done)
      | (rw [Finset.sum_const, Finset.card_univ, Fintype.card_fin, nsmul_eq_mul])
      | (simp [Finset.sum_const, nsmul_eq_mul]; done)
  first
    | linarith [hswap, hsum, hconst]
    | linear_combination hswap + hsum + hconst

/-- **Theorem 2 (relative inflation).** If `‖g‖ ≤ C m̄`, `λ > 0` and `m̄ > 0`, the signal-to-noise
ratio of an active row, `ρ² ‖g‖² / (d σ²)` with `σ = λ m̄`, is at most `ρ² C² / (d λ²)`. -/
theorem channel2_relative_inflation {d : ℕ} (hd : 0 < d) (ρ lam mbar C : ℝ) (g : Fin d → ℝ)
    (hlam : 0 < lam) (hm : 0 < mbar) (hg : Real.sqrt (∑ i, g i ^ 2) ≤ C * mbar) :
    (ρ ^ 2 * (∑ i, g i ^ 2)) / ((d : ℝ) * (lam * mbar) ^ 2)
      ≤ (ρ ^ 2 * C ^ 2) / ((d : ℝ) * lam ^ 2) := by
  have hdpos : (0 : ℝ) < (d : ℝ) := by
    first
      | exact_mod_cast hd
      | exact Nat.cast_pos.mpr hd
  have hS0 : 0 ≤ ∑ i, g i ^ 2 := Finset.sum_nonneg (fun i _ => sq_nonneg (g i))
  have hS : ∑ i, g i ^ 2 ≤ (C * mbar) ^ 2 := flood_sq_le_of_sqrt_le _ _ hS0 hg
  have h1 : ρ ^ 2 * (∑ i, g i ^ 2) ≤ ρ ^ 2 * (C * mbar) ^ 2 := by
    first
      | exact mul_le_mul_of_nonneg_left hS (sq_nonneg ρ)
      | nlinarith [hS, sq_nonneg ρ]
  have h2 : ρ ^ 2 * (C * mbar) ^ 2 = (ρ ^ 2 * C ^ 2) * mbar ^ 2 := by ring
  have hAB : ρ ^ 2 * (∑ i, g i ^ 2) ≤ (ρ ^ 2 * C ^ 2) * mbar ^ 2 := by linarith [h1, h2]
  have hD : 0 < (d : ℝ) * (lam * mbar) ^ 2 := mul_pos hdpos (pow_pos (mul_pos hlam hm) 2)
  have hE : 0 < (d : ℝ) * lam ^ 2 := mul_pos hdpos (pow_pos hlam 2)
  have hDE : (d : ℝ) * (lam * mbar) ^ 2 = ((d : ℝ) * lam ^ 2) * mbar ^ 2 := by ring
  exact flood_inflation_core _ _ _ _ _ hD hE hDE hAB

/-- **Theorem 2 (Gaussian corollary).** Rows of a `V × d` gradient are flooded as
`out_r = c_r g_r + n_r` (`c_r = ρ` on active rows, `c_r = 0` on inactive ones). If every noise
coordinate is measurable with law `N(0, v)`, `v ≠ 0` (i.e. `σ > 0`), then almost surely *every*
row of the flooded gradient is non-zero: the row-norm sparsity pattern carries no information. -/
theorem channel2_rows_nonzero_ae {V d : ℕ} (hd : 0 < d) (c : Fin V → ℝ)
    (g : Fin V → Fin d → ℝ) (n : Fin V → Fin d → Ω → ℝ) (v : ℝ≥0) (hv : v ≠ 0)
    (hmeas : ∀ r i, Measurable (n r i))
    (hlaw : ∀ r i, Measure.map (n r i) μ = gaussianReal 0 v) :
    ∀ᵐ ω ∂μ, ∀ r, (fun i => c r * g r i + n r i ω) ≠ 0 := by
  have hrow : ∀ r, ∀ᵐ ω ∂μ, (fun i => c r * g r i + n r i ω) ≠ 0 := by
    intro r
    have hc : ∀ᵐ ω ∂μ, n r ⟨0, hd⟩ ω ≠ -(c r * g r ⟨0, hd⟩) :=
      gaussian_coord_ne_ae (μ := μ) (n r ⟨0, hd⟩) (hmeas r ⟨0, hd⟩) v hv (hlaw r ⟨0, hd⟩) _
    refine hc.mono (fun ω hω => ?_)
    intro hzero
    have h0 : c r * g r ⟨0, hd⟩ + n r ⟨0, hd⟩ ω = 0 := by
      first
        | exact congrFun hzero ⟨0, hd⟩
        | simpa using congrFun hzero ⟨0, hd⟩
    apply hω
    first
      | linarith [h0]
      | linear_combination h0
  first
    | exact ae_all_iff.mpr hrow
    | exact ae_all_iff.2 hrow

end Theorem2

end Aegis
