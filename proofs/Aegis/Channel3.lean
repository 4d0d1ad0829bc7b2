import Aegis.Mechanism
import Aegis.Moments

/-!
# Channel 3: the matrix flood of MLP (and every other dense) gradient (Theorem 3)

`G ∈ ℝ^{m×n}`, noise `Z i j` standard normal (`IsStdNormal`), and the shipped matrix flood
`floodMatrix ρ σ c G Z ω i j = ρ min(1, c/‖G‖_F) G i j + σ Z i j ω` (public `σ, c`, the default),
or `floodMatrixBatch` (the paper's `σ = λ mean |G|`, no clip).

* `channel3_decomposition`: `E[out i j] − G i j = (ρ min(1, c/‖G‖_F) − 1) G i j`
  (`channel3_decomposition_batch`: `(ρ − 1) G i j`);
* `channel3_frobenius_second_moment`: `E‖out‖_F² = (ρ min(1, c/‖G‖_F))² ‖G‖_F² + m n σ²`
  (`channel3_frobenius_second_moment_batch`: `ρ² ‖G‖_F² + m n λ² m̄²`);
* `channel3_bias_frobenius_batch`: the matrix identity `‖E out − G‖_F = (1 − ρ) ‖G‖_F`
  (`channel3_bias_frobenius`: `(1 − ρ min(1, c/‖G‖_F)) ‖G‖_F` with the clip);
* `channel3_relative_inflation`: the paper's Theorem 3 (3): batch, `‖G‖_F ≤ C m̄` (any `C`) →
  `0 ≤ (E‖out‖_F² − m n σ²) / (m n σ²) ≤ ρ² C² / (m n λ²)`;
  `channel3_relative_inflation_mn`: its corollary with the mechanism's `C = m n` (vacuous);
* `channel3_relative_inflation_public`: public: the same ratio is at most `ρ² c² / (m n σ²)`.

Written without a Lean toolchain at hand: not machine-checked where it was written.
-/

open MeasureTheory ProbabilityTheory
open scoped ENNReal NNReal

noncomputable section

namespace Aegis

variable {Ω : Type*} [MeasurableSpace Ω] {μ : Measure Ω} [IsProbabilityMeasure μ]

/-- The Frobenius second moment of a matrix flooded with any deterministic coefficient `k`. -/
theorem matrix_second_moment {m n : ℕ} (k σ : ℝ) (G : Fin m → Fin n → ℝ)
    (Z : Fin m → Fin n → Ω → ℝ) (hZ : ∀ i j, IsStdNormal μ (Z i j)) :
    ∫ ω, ∑ i, ∑ j, (k * G i j + σ * Z i j ω) ^ 2 ∂μ
      = k ^ 2 * froSq G + (m : ℝ) * (n : ℝ) * σ ^ 2 := by
  have h : ∫ ω, ∑ i, ∑ j, (k * G i j + σ * Z i j ω) ^ 2 ∂μ
      = (∑ i, ∑ j, (k * G i j) ^ 2) + (m : ℝ) * (n : ℝ) * σ ^ 2 :=
    mat_second_moment (fun i j => k * G i j) σ Z hZ
  have hs : ∑ i, ∑ j, (k * G i j) ^ 2 = k ^ 2 * froSq G := froSq_smul k G
  rw [h, hs]

/-- **Theorem 3 (decomposition, public calibration).** Each entry of the flood has mean
`ρ min(1, c/‖G‖_F) G i j`: the exported gradient is the true one plus the bias
`(ρ min(1, c/‖G‖_F) − 1) G` plus zero-mean noise. -/
theorem channel3_decomposition {m n : ℕ} (ρ σ c : ℝ) (G : Fin m → Fin n → ℝ)
    (Z : Fin m → Fin n → Ω → ℝ) (hZ : ∀ i j, IsStdNormal μ (Z i j)) (i : Fin m) (j : Fin n) :
    (∫ ω, floodMatrix ρ σ c G Z ω i j ∂μ) - G i j = (ρ * clipScale c (froNorm G) - 1) * G i j := by
  have h : ∫ ω, floodMatrix ρ σ c G Z ω i j ∂μ = ρ * clipScale c (froNorm G) * G i j :=
    coord_mean (hZ i j) (ρ * clipScale c (froNorm G) * G i j) σ
  rw [h]
  ring

/-- **Theorem 3 (decomposition, batch calibration).** `E[out i j] − G i j = (ρ − 1) G i j`. -/
theorem channel3_decomposition_batch {m n : ℕ} (ρ lam : ℝ) (G : Fin m → Fin n → ℝ)
    (Z : Fin m → Fin n → Ω → ℝ) (hZ : ∀ i j, IsStdNormal μ (Z i j)) (i : Fin m) (j : Fin n) :
    (∫ ω, floodMatrixBatch ρ lam G Z ω i j ∂μ) - G i j = (ρ - 1) * G i j := by
  have h : ∫ ω, floodMatrixBatch ρ lam G Z ω i j ∂μ = ρ * G i j :=
    coord_mean (hZ i j) (ρ * G i j) (lam * meanAbs G)
  rw [h]
  ring

/-- **Theorem 3 (Frobenius second moment, public calibration).**
`E ‖out‖_F² = (ρ min(1, c/‖G‖_F))² ‖G‖_F² + m n σ²`. -/
theorem channel3_frobenius_second_moment {m n : ℕ} (ρ σ c : ℝ) (G : Fin m → Fin n → ℝ)
    (Z : Fin m → Fin n → Ω → ℝ) (hZ : ∀ i j, IsStdNormal μ (Z i j)) :
    ∫ ω, froSq (floodMatrix ρ σ c G Z ω) ∂μ
      = (ρ * clipScale c (froNorm G)) ^ 2 * froSq G + (m : ℝ) * (n : ℝ) * σ ^ 2 :=
  matrix_second_moment (ρ * clipScale c (froNorm G)) σ G Z hZ

/-- **Theorem 3 (Frobenius second moment, batch calibration).** With `σ = λ mean |G|`:
`E ‖out‖_F² = ρ² ‖G‖_F² + m n λ² m̄²`. -/
theorem channel3_frobenius_second_moment_batch {m n : ℕ} (ρ lam : ℝ) (G : Fin m → Fin n → ℝ)
    (Z : Fin m → Fin n → Ω → ℝ) (hZ : ∀ i j, IsStdNormal μ (Z i j)) :
    ∫ ω, froSq (floodMatrixBatch ρ lam G Z ω) ∂μ
      = ρ ^ 2 * froSq G + (m : ℝ) * (n : ℝ) * lam ^ 2 * meanAbs G ^ 2 := by
  have h : ∫ ω, froSq (floodMatrixBatch ρ lam G Z ω) ∂μ
      = ρ ^ 2 * froSq G + (m : ℝ) * (n : ℝ) * (lam * meanAbs G) ^ 2 :=
    matrix_second_moment ρ (lam * meanAbs G) G Z hZ
  rw [h]
  ring

/-- `‖(k − 1) G‖_F = (1 − k) ‖G‖_F` for `k ≤ 1`. -/
theorem froNorm_bias {m n : ℕ} (k : ℝ) (hk : k ≤ 1) (G : Fin m → Fin n → ℝ) :
    froNorm (fun i j => (k - 1) * G i j) = (1 - k) * froNorm G := by
  have hsq : froSq (fun i j => (k - 1) * G i j) = ((1 - k) * froNorm G) ^ 2 := by
    rw [froSq_smul, ← sq_froNorm G]
    ring
  have h1k : 0 ≤ 1 - k := by linarith
  calc froNorm (fun i j => (k - 1) * G i j)
      = Real.sqrt (froSq (fun i j => (k - 1) * G i j)) := rfl
    _ = Real.sqrt (((1 - k) * froNorm G) ^ 2) := by rw [hsq]
    _ = (1 - k) * froNorm G := Real.sqrt_sq (mul_nonneg h1k (Real.sqrt_nonneg _))

/-- **Theorem 3 (1), the matrix identity (batch calibration).** For `ρ ≤ 1` the bias of the
flooded matrix has Frobenius norm `‖E out − G‖_F = (1 − ρ) ‖G‖_F` (the paper also assumes
`0 ≤ ρ`, which the identity does not need). -/
theorem channel3_bias_frobenius_batch {m n : ℕ} (ρ lam : ℝ) (hρ1 : ρ ≤ 1)
    (G : Fin m → Fin n → ℝ) (Z : Fin m → Fin n → Ω → ℝ) (hZ : ∀ i j, IsStdNormal μ (Z i j)) :
    froNorm (fun i j => (∫ ω, floodMatrixBatch ρ lam G Z ω i j ∂μ) - G i j)
      = (1 - ρ) * froNorm G := by
  have hfun : (fun i j => (∫ ω, floodMatrixBatch ρ lam G Z ω i j ∂μ) - G i j)
      = fun i j => (ρ - 1) * G i j := by
    funext i j
    exact channel3_decomposition_batch ρ lam G Z hZ i j
  exact (congrArg froNorm hfun).trans (froNorm_bias ρ hρ1 G)

/-- **Theorem 3 (1), the matrix identity (public calibration).** With the shipped clip,
`‖E out − G‖_F = (1 − ρ min(1, c/‖G‖_F)) ‖G‖_F` for `0 ≤ ρ ≤ 1`, `c ≥ 0`. -/
theorem channel3_bias_frobenius {m n : ℕ} (ρ σ c : ℝ) (hρ0 : 0 ≤ ρ) (hρ1 : ρ ≤ 1) (hc : 0 ≤ c)
    (G : Fin m → Fin n → ℝ) (Z : Fin m → Fin n → Ω → ℝ) (hZ : ∀ i j, IsStdNormal μ (Z i j)) :
    froNorm (fun i j => (∫ ω, floodMatrix ρ σ c G Z ω i j ∂μ) - G i j)
      = (1 - ρ * clipScale c (froNorm G)) * froNorm G := by
  have hs0 : 0 ≤ clipScale c (froNorm G) := clipScale_nonneg c _ hc (Real.sqrt_nonneg _)
  have hs1 : clipScale c (froNorm G) ≤ 1 := clipScale_le_one c _ hc
  have hk : ρ * clipScale c (froNorm G) ≤ 1 := by
    have h := mul_le_mul_of_nonneg_right hρ1 hs0
    have h' := mul_le_mul_of_nonneg_left hs1 hρ0
    linarith [h, h']
  have hfun : (fun i j => (∫ ω, floodMatrix ρ σ c G Z ω i j ∂μ) - G i j)
      = fun i j => (ρ * clipScale c (froNorm G) - 1) * G i j := by
    funext i j
    exact channel3_decomposition ρ σ c G Z hZ i j
  exact (congrArg froNorm hfun).trans (froNorm_bias (ρ * clipScale c (froNorm G)) hk G)

/-- **Theorem 3 (3), as the paper states it.** Batch calibration `σ = λ m̄` (`m̄ = mean |G|`),
`λ > 0`, `m̄ > 0`, and the paper's assumption with any constant `C`: `‖G‖_F ≤ C m̄`. Then the
relative inflation of the Frobenius second moment, `(E‖out‖_F² − m n σ²) / (m n σ²)`
(`= ρ² ‖G‖_F² / (m n λ² m̄²)`), satisfies `0 ≤ … ≤ ρ² C² / (m n λ²)`. -/
theorem channel3_relative_inflation {m n : ℕ} (hm : 0 < m) (hn : 0 < n) (ρ lam C : ℝ)
    (G : Fin m → Fin n → ℝ) (Z : Fin m → Fin n → Ω → ℝ) (hZ : ∀ i j, IsStdNormal μ (Z i j))
    (hlam : 0 < lam) (hpos : 0 < meanAbs G) (hC : froNorm G ≤ C * meanAbs G) :
    0 ≤ (∫ ω, froSq (floodMatrixBatch ρ lam G Z ω) ∂μ
        - (m : ℝ) * (n : ℝ) * (lam * meanAbs G) ^ 2) / ((m : ℝ) * (n : ℝ) * (lam * meanAbs G) ^ 2)
    ∧ (∫ ω, froSq (floodMatrixBatch ρ lam G Z ω) ∂μ
        - (m : ℝ) * (n : ℝ) * (lam * meanAbs G) ^ 2) / ((m : ℝ) * (n : ℝ) * (lam * meanAbs G) ^ 2)
      ≤ ρ ^ 2 * C ^ 2 / ((m : ℝ) * (n : ℝ) * lam ^ 2) := by
  have hmn : (0 : ℝ) < (m : ℝ) * (n : ℝ) := by
    have hm' : (0 : ℝ) < (m : ℝ) := by exact_mod_cast hm
    have hn' : (0 : ℝ) < (n : ℝ) := by exact_mod_cast hn
    exact mul_pos hm' hn'
  have hnum : ∫ ω, froSq (floodMatrixBatch ρ lam G Z ω) ∂μ
        - (m : ℝ) * (n : ℝ) * (lam * meanAbs G) ^ 2 = ρ ^ 2 * froSq G := by
    have h : ∫ ω, froSq (floodMatrixBatch ρ lam G Z ω) ∂μ
        = ρ ^ 2 * froSq G + (m : ℝ) * (n : ℝ) * (lam * meanAbs G) ^ 2 :=
      matrix_second_moment ρ (lam * meanAbs G) G Z hZ
    rw [h]
    ring
  rw [hnum]
  have hD : 0 < (m : ℝ) * (n : ℝ) * (lam * meanAbs G) ^ 2 :=
    mul_pos hmn (pow_pos (mul_pos hlam hpos) 2)
  have hE : 0 < (m : ℝ) * (n : ℝ) * lam ^ 2 := mul_pos hmn (pow_pos hlam 2)
  refine ⟨div_nonneg (mul_nonneg (sq_nonneg ρ) (froSq_nonneg G)) hD.le, ?_⟩
  have h0 : 0 ≤ froNorm G := Real.sqrt_nonneg _
  have h1 := mul_self_le_mul_self h0 hC
  have hF : froSq G ≤ C ^ 2 * meanAbs G ^ 2 := by
    rw [← sq_froNorm G]
    nlinarith [h1]
  have step := mul_le_mul_of_nonneg_right (mul_le_mul_of_nonneg_left hF (sq_nonneg ρ)) hE.le
  apply div_le_div_of_cross _ _ _ _ hD hE
  nlinarith [step]

/-- **Theorem 3 (3) with `C = m n`** (corollary of `channel3_relative_inflation`). The mechanism
gives the assumption with `C = m n` (`froNorm_le_mn_meanAbs`), so for `G ≠ 0` the relative
inflation is at most `ρ² (m n)² / (m n λ²) = ρ² m n / λ²`.

*Looseness.* `C = m n` is attained (a one-entry matrix), so nothing better holds for every
gradient, and the bound is vacuous in practice: an MLP matrix at `d = 768` (`768 × 3072`,
`m n ≈ 2.4 · 10⁶`) gives about `2.4 · 10⁶ ρ² / λ²`. -/
theorem channel3_relative_inflation_mn {m n : ℕ} (ρ lam : ℝ) (G : Fin m → Fin n → ℝ)
    (Z : Fin m → Fin n → Ω → ℝ) (hZ : ∀ i j, IsStdNormal μ (Z i j)) (hlam : 0 < lam)
    (hG : ∃ i j, G i j ≠ 0) :
    (∫ ω, froSq (floodMatrixBatch ρ lam G Z ω) ∂μ
        - (m : ℝ) * (n : ℝ) * (lam * meanAbs G) ^ 2) / ((m : ℝ) * (n : ℝ) * (lam * meanAbs G) ^ 2)
      ≤ ρ ^ 2 * ((m : ℝ) * (n : ℝ)) ^ 2 / ((m : ℝ) * (n : ℝ) * lam ^ 2) := by
  have hpos : 0 < meanAbs G := meanAbs_pos G hG
  obtain ⟨i0, j0, _⟩ := hG
  have hm : 0 < m := by
    first
      | exact Fin.pos i0
      | exact Nat.lt_of_le_of_lt (Nat.zero_le _) i0.isLt
  have hn : 0 < n := by
    first
      | exact Fin.pos j0
      | exact Nat.lt_of_le_of_lt (Nat.zero_le _) j0.isLt
  exact (channel3_relative_inflation hm hn ρ lam ((m : ℝ) * (n : ℝ)) G Z hZ hlam hpos
    (froNorm_le_mn_meanAbs hm hn G)).2

/-- **Theorem 3 (relative inflation, public calibration).** Under the default calibration:
`(E‖out‖_F² − m n σ²) / (m n σ²) ≤ ρ² c² / (m n σ²)`, public constants only. -/
theorem channel3_relative_inflation_public {m n : ℕ} (hm : 0 < m) (hn : 0 < n) (ρ σ c : ℝ)
    (G : Fin m → Fin n → ℝ) (Z : Fin m → Fin n → Ω → ℝ) (hZ : ∀ i j, IsStdNormal μ (Z i j))
    (hρ : 0 ≤ ρ) (hc : 0 ≤ c) (hσ : σ ≠ 0) :
    (∫ ω, froSq (floodMatrix ρ σ c G Z ω) ∂μ - (m : ℝ) * (n : ℝ) * σ ^ 2)
        / ((m : ℝ) * (n : ℝ) * σ ^ 2)
      ≤ (ρ * c) ^ 2 / ((m : ℝ) * (n : ℝ) * σ ^ 2) := by
  have hmn : (0 : ℝ) < (m : ℝ) * (n : ℝ) := by
    have hm' : (0 : ℝ) < (m : ℝ) := by exact_mod_cast hm
    have hn' : (0 : ℝ) < (n : ℝ) := by exact_mod_cast hn
    exact mul_pos hm' hn'
  have hnum : ∫ ω, froSq (floodMatrix ρ σ c G Z ω) ∂μ - (m : ℝ) * (n : ℝ) * σ ^ 2
      = (ρ * clipScale c (froNorm G)) ^ 2 * froNorm G ^ 2 := by
    rw [channel3_frobenius_second_moment ρ σ c G Z hZ, sq_froNorm G]
    ring
  rw [hnum]
  have hD : 0 < (m : ℝ) * (n : ℝ) * σ ^ 2 := by
    have hσ2 : 0 < σ ^ 2 := by
      have h := mul_self_pos.mpr hσ
      nlinarith [h]
    exact mul_pos hmn hσ2
  have hle := clip_energy_le ρ c (froNorm G) hρ hc (Real.sqrt_nonneg _)
  apply div_le_div_of_cross _ _ _ _ hD hD
  exact mul_le_mul_of_nonneg_right hle hD.le

end Aegis
