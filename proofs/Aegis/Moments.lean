import Aegis.Model

/-!
# Moments of a flooded coordinate, row and matrix

For deterministic signal `a` and standard normal noise `X` (`IsStdNormal`), a flooded coordinate
is `a + σ X`. From the model:

* `coord_mean`: `E[a + σ X] = a`;
* `coord_second_moment`: `E[(a + σ X)²] = a² + σ²`;
* `vec_second_moment`: `E ∑ᵢ (aᵢ + σ Xᵢ)² = ∑ᵢ aᵢ² + d σ²`;
* `mat_second_moment`: `E ∑ᵢ ∑ⱼ (aᵢⱼ + σ Xᵢⱼ)² = ∑ᵢ ∑ⱼ aᵢⱼ² + m n σ²`.

Only the marginal law of each coordinate is used (linearity of the integral).
Written without a Lean toolchain at hand: not machine-checked where it was written.
-/

open MeasureTheory ProbabilityTheory
open scoped ENNReal NNReal

noncomputable section

namespace Aegis

variable {Ω : Type*} [MeasurableSpace Ω] {μ : Measure Ω} [IsProbabilityMeasure μ]

/-- The integral of a constant against a probability measure. -/
theorem integral_const_prob (c : ℝ) : ∫ _ω, c ∂μ = c := by
  first
    | (simp; done)
    | (rw [integral_const]; simp; done)
    | (simp [integral_const, measure_univ]; done)

/-- Pulling a real constant out of an integral (version-robust wrapper). -/
theorem flood_integral_cmul (c : ℝ) (f : Ω → ℝ) : ∫ ω, c * f ω ∂μ = c * ∫ ω, f ω ∂μ := by
  first
    | exact integral_const_mul c f
    | exact integral_mul_left c f
    | simpa [smul_eq_mul] using integral_smul (μ := μ) c f

theorem coord_integrable {X : Ω → ℝ} (hX : IsStdNormal μ X) (a σ : ℝ) :
    Integrable (fun ω => a + σ * X ω) μ :=
  (integrable_const a).add (hX.integrable.const_mul σ)

theorem coord_integrable_sq {X : Ω → ℝ} (hX : IsStdNormal μ X) (a σ : ℝ) :
    Integrable (fun ω => (a + σ * X ω) ^ 2) μ := by
  have hfun : (fun ω => (a + σ * X ω) ^ 2)
      = fun ω => (a ^ 2 + (2 * a * σ) * X ω) + σ ^ 2 * X ω ^ 2 := by
    funext ω
    ring
  have hI : Integrable (fun ω => (a ^ 2 + (2 * a * σ) * X ω) + σ ^ 2 * X ω ^ 2) μ :=
    ((integrable_const (a ^ 2)).add (hX.integrable.const_mul (2 * a * σ))).add
      (hX.integrable_sq.const_mul (σ ^ 2))
  first
    | (rw [hfun]; exact hI)
    | exact hfun ▸ hI
    | simpa [hfun] using hI

/-- `E[a + σ X] = a`. -/
theorem coord_mean {X : Ω → ℝ} (hX : IsStdNormal μ X) (a σ : ℝ) :
    ∫ ω, (a + σ * X ω) ∂μ = a := by
  have h1 : ∫ ω, (a + σ * X ω) ∂μ = ∫ _ω, a ∂μ + ∫ ω, σ * X ω ∂μ :=
    integral_add (integrable_const a) (hX.integrable.const_mul σ)
  have h2 : ∫ _ω, a ∂μ = a := integral_const_prob (μ := μ) a
  have h3 : ∫ ω, σ * X ω ∂μ = σ * ∫ ω, X ω ∂μ := flood_integral_cmul (μ := μ) σ X
  have h4 : σ * ∫ ω, X ω ∂μ = 0 := by
    rw [hX.integral_eq_zero]
    ring
  linarith [h1, h2, h3, h4]

/-- `E[(a + σ X)²] = a² + σ²`. -/
theorem coord_second_moment {X : Ω → ℝ} (hX : IsStdNormal μ X) (a σ : ℝ) :
    ∫ ω, (a + σ * X ω) ^ 2 ∂μ = a ^ 2 + σ ^ 2 := by
  have hfun : (fun ω => (a + σ * X ω) ^ 2)
      = fun ω => (a ^ 2 + (2 * a * σ) * X ω) + σ ^ 2 * X ω ^ 2 := by
    funext ω
    ring
  have hA : Integrable (fun ω => a ^ 2 + (2 * a * σ) * X ω) μ :=
    (integrable_const (a ^ 2)).add (hX.integrable.const_mul (2 * a * σ))
  have hB : Integrable (fun ω => σ ^ 2 * X ω ^ 2) μ := hX.integrable_sq.const_mul (σ ^ 2)
  have h0 : ∫ ω, (a + σ * X ω) ^ 2 ∂μ
      = ∫ ω, ((a ^ 2 + (2 * a * σ) * X ω) + σ ^ 2 * X ω ^ 2) ∂μ := by
    first
      | exact congrArg (fun f : Ω → ℝ => ∫ ω, f ω ∂μ) hfun
      | rw [hfun]
      | simp only [hfun]
  have h1 : ∫ ω, ((a ^ 2 + (2 * a * σ) * X ω) + σ ^ 2 * X ω ^ 2) ∂μ
      = ∫ ω, (a ^ 2 + (2 * a * σ) * X ω) ∂μ + ∫ ω, σ ^ 2 * X ω ^ 2 ∂μ :=
    integral_add hA hB
  have h2 : ∫ ω, (a ^ 2 + (2 * a * σ) * X ω) ∂μ = a ^ 2 :=
    coord_mean (μ := μ) hX (a ^ 2) (2 * a * σ)
  have h3 : ∫ ω, σ ^ 2 * X ω ^ 2 ∂μ = σ ^ 2 * ∫ ω, X ω ^ 2 ∂μ :=
    flood_integral_cmul (μ := μ) (σ ^ 2) (fun ω => X ω ^ 2)
  have h4 : σ ^ 2 * ∫ ω, X ω ^ 2 ∂μ = σ ^ 2 := by
    rw [hX.integral_sq_eq_one]
    ring
  linarith [h0, h1, h2, h3, h4]

/-- `E ∑ᵢ (aᵢ + σ Xᵢ)² = ∑ᵢ aᵢ² + d σ²`. -/
theorem vec_second_moment {d : ℕ} (a : Fin d → ℝ) (σ : ℝ) (X : Fin d → Ω → ℝ)
    (hX : ∀ i, IsStdNormal μ (X i)) :
    ∫ ω, ∑ i, (a i + σ * X i ω) ^ 2 ∂μ = (∑ i, a i ^ 2) + (d : ℝ) * σ ^ 2 := by
  have hint : ∀ i ∈ (Finset.univ : Finset (Fin d)),
      Integrable (fun ω => (a i + σ * X i ω) ^ 2) μ :=
    fun i _ => coord_integrable_sq (hX i) (a i) σ
  have hswap : ∫ ω, ∑ i, (a i + σ * X i ω) ^ 2 ∂μ = ∑ i, ∫ ω, (a i + σ * X i ω) ^ 2 ∂μ :=
    integral_finset_sum Finset.univ hint
  have hsum : ∑ i, ∫ ω, (a i + σ * X i ω) ^ 2 ∂μ = ∑ i, (a i ^ 2 + σ ^ 2) :=
    Finset.sum_congr rfl (fun i _ => coord_second_moment (hX i) (a i) σ)
  have hsplit : ∑ i, (a i ^ 2 + σ ^ 2) = (∑ i, a i ^ 2) + ∑ _i : Fin d, σ ^ 2 := by
    first
      | exact Finset.sum_add_distrib
      | rw [Finset.sum_add_distrib]
  have hconst : ∑ _i : Fin d, σ ^ 2 = (d : ℝ) * σ ^ 2 := by
    first
      | (simp; done)
      | (rw [Finset.sum_const, Finset.card_univ, Fintype.card_fin, nsmul_eq_mul])
      | (simp [Finset.sum_const, nsmul_eq_mul]; done)
  linarith [hswap, hsum, hsplit, hconst]

theorem vec_integrable_sq {d : ℕ} (a : Fin d → ℝ) (σ : ℝ) (X : Fin d → Ω → ℝ)
    (hX : ∀ i, IsStdNormal μ (X i)) :
    Integrable (fun ω => ∑ i, (a i + σ * X i ω) ^ 2) μ :=
  integrable_finset_sum Finset.univ (fun i _ => coord_integrable_sq (hX i) (a i) σ)

/-- `E ∑ᵢ ∑ⱼ (aᵢⱼ + σ Xᵢⱼ)² = ∑ᵢ ∑ⱼ aᵢⱼ² + m n σ²`. -/
theorem mat_second_moment {m n : ℕ} (a : Fin m → Fin n → ℝ) (σ : ℝ)
    (X : Fin m → Fin n → Ω → ℝ) (hX : ∀ i j, IsStdNormal μ (X i j)) :
    ∫ ω, ∑ i, ∑ j, (a i j + σ * X i j ω) ^ 2 ∂μ
      = (∑ i, ∑ j, a i j ^ 2) + (m : ℝ) * (n : ℝ) * σ ^ 2 := by
  have hint : ∀ i ∈ (Finset.univ : Finset (Fin m)),
      Integrable (fun ω => ∑ j, (a i j + σ * X i j ω) ^ 2) μ :=
    fun i _ => vec_integrable_sq (a i) σ (X i) (hX i)
  have hswap : ∫ ω, ∑ i, ∑ j, (a i j + σ * X i j ω) ^ 2 ∂μ
      = ∑ i, ∫ ω, ∑ j, (a i j + σ * X i j ω) ^ 2 ∂μ :=
    integral_finset_sum Finset.univ hint
  have hsum : ∑ i, ∫ ω, ∑ j, (a i j + σ * X i j ω) ^ 2 ∂μ
      = ∑ i, ((∑ j, a i j ^ 2) + (n : ℝ) * σ ^ 2) :=
    Finset.sum_congr rfl (fun i _ => vec_second_moment (a i) σ (X i) (hX i))
  have hsplit : ∑ i, ((∑ j, a i j ^ 2) + (n : ℝ) * σ ^ 2)
      = (∑ i, ∑ j, a i j ^ 2) + ∑ _i : Fin m, (n : ℝ) * σ ^ 2 := by
    first
      | exact Finset.sum_add_distrib
      | rw [Finset.sum_add_distrib]
  have hconst : ∑ _i : Fin m, (n : ℝ) * σ ^ 2 = (m : ℝ) * ((n : ℝ) * σ ^ 2) := by
    first
      | (simp; done)
      | (rw [Finset.sum_const, Finset.card_univ, Fintype.card_fin, nsmul_eq_mul])
      | (simp [Finset.sum_const, nsmul_eq_mul]; done)
  linarith [hswap, hsum, hsplit, hconst]

theorem mat_integrable_sq {m n : ℕ} (a : Fin m → Fin n → ℝ) (σ : ℝ)
    (X : Fin m → Fin n → Ω → ℝ) (hX : ∀ i j, IsStdNormal μ (X i j)) :
    Integrable (fun ω => ∑ i, ∑ j, (a i j + σ * X i j ω) ^ 2) μ :=
  integrable_finset_sum Finset.univ (fun i _ => vec_integrable_sq (a i) σ (X i) (hX i))

end Aegis
