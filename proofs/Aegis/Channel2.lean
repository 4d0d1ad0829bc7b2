import Aegis.Mechanism
import Aegis.Moments

/-!
# Channel 2: the rows flood of embedding gradients (Theorem 2)

`G ∈ ℝ^{V×d}` (token-embedding rows), noise `Z v i` standard normal (`IsStdNormal`), and the
shipped rows flood `floodRows ρ σ c thr G Z ω v i = rowCoef ρ c thr (G v) · G v i + σ Z v i ω`
(public `σ, c, thr`, the default), or `floodRowsBatch` (the paper's `σ = λ m̄`, `S`, no clip).

* `channel2_second_moment_active`:   `thr < ‖G v‖ → E‖out v‖² = (ρ min(1, c/‖G v‖))² ‖G v‖² + d σ²`
* `channel2_second_moment_inactive`: `¬ thr < ‖G v‖ → E‖out v‖² = d σ²`
* `channel2_second_moment_batch`:    `E‖out v‖² = ρ² [v ∈ S] ‖G v‖² + d (λ m̄)²`
* `channel2_relative_inflation`:     the paper's Theorem 2 (3): batch, Assumption 1
  (`‖G u‖ ≤ C m̄` on `S`, any `C`, any `τ`) → `0 ≤ (E‖out v‖² − d σ²) / (d σ²) ≤ ρ² C² / (d λ²)`;
  `channel2_relative_inflation_tau`: its corollary with the mechanism's `C = 1/τ`
* `channel2_relative_inflation_public`: public: `(E‖out v‖² − d σ²) / (d σ²) ≤ ρ² c² / (d σ²)`
* `channel2_rows_nonzero_ae`:        `σ ≠ 0 → ` a.s. no row of `out` is zero (public flood);
  `channel2_rows_nonzero_ae_batch`:  the same for the batch flood when `G ≠ 0`.

Written without a Lean toolchain at hand: not machine-checked where it was written.
-/

open MeasureTheory ProbabilityTheory
open scoped ENNReal NNReal

noncomputable section

namespace Aegis

variable {Ω : Type*} [MeasurableSpace Ω] {μ : Measure Ω} [IsProbabilityMeasure μ]

/-- The second moment of a row flooded with any deterministic coefficient `k`. -/
theorem row_second_moment {V d : ℕ} (k : ℝ) (σ : ℝ) (G : Fin V → Fin d → ℝ)
    (Z : Fin V → Fin d → Ω → ℝ) (hZ : ∀ v i, IsStdNormal μ (Z v i)) (v : Fin V) :
    ∫ ω, ∑ i, (k * G v i + σ * Z v i ω) ^ 2 ∂μ = k ^ 2 * sqNorm (G v) + (d : ℝ) * σ ^ 2 := by
  have h : ∫ ω, ∑ i, (k * G v i + σ * Z v i ω) ^ 2 ∂μ
      = (∑ i, (k * G v i) ^ 2) + (d : ℝ) * σ ^ 2 :=
    vec_second_moment (fun i => k * G v i) σ (Z v) (hZ v)
  have hs : ∑ i, (k * G v i) ^ 2 = k ^ 2 * sqNorm (G v) := sqNorm_smul k (G v)
  rw [h, hs]

/-- The rows flood's second moment for any row (public parameters). -/
theorem floodRows_second_moment {V d : ℕ} (ρ σ c thr : ℝ) (G : Fin V → Fin d → ℝ)
    (Z : Fin V → Fin d → Ω → ℝ) (hZ : ∀ v i, IsStdNormal μ (Z v i)) (v : Fin V) :
    ∫ ω, sqNorm (floodRows ρ σ c thr G Z ω v) ∂μ
      = rowCoef ρ c thr (G v) ^ 2 * sqNorm (G v) + (d : ℝ) * σ ^ 2 :=
  row_second_moment (rowCoef ρ c thr (G v)) σ G Z hZ v

/-- **Theorem 2 (active row, public calibration).** A row with `thr < ‖G v‖` has
`E ‖out v‖² = (ρ min(1, c/‖G v‖))² ‖G v‖² + d σ²`. -/
theorem channel2_second_moment_active {V d : ℕ} (ρ σ c thr : ℝ) (G : Fin V → Fin d → ℝ)
    (Z : Fin V → Fin d → Ω → ℝ) (hZ : ∀ v i, IsStdNormal μ (Z v i)) (v : Fin V)
    (hv : thr < l2norm (G v)) :
    ∫ ω, sqNorm (floodRows ρ σ c thr G Z ω v) ∂μ
      = (ρ * clipScale c (l2norm (G v))) ^ 2 * sqNorm (G v) + (d : ℝ) * σ ^ 2 := by
  rw [floodRows_second_moment ρ σ c thr G Z hZ v, rowCoef_of_active ρ c thr (G v) hv]

/-- **Theorem 2 (inactive row, public calibration).** A row with `‖G v‖ ≤ thr` exports pure
noise: `E ‖out v‖² = d σ²`. -/
theorem channel2_second_moment_inactive {V d : ℕ} (ρ σ c thr : ℝ) (G : Fin V → Fin d → ℝ)
    (Z : Fin V → Fin d → Ω → ℝ) (hZ : ∀ v i, IsStdNormal μ (Z v i)) (v : Fin V)
    (hv : ¬ thr < l2norm (G v)) :
    ∫ ω, sqNorm (floodRows ρ σ c thr G Z ω v) ∂μ = (d : ℝ) * σ ^ 2 := by
  rw [floodRows_second_moment ρ σ c thr G Z hZ v, rowCoef_of_inactive ρ c thr (G v) hv]
  ring

/-- **Theorem 2 (batch calibration).** With `σ = λ m̄`:
`E ‖out v‖² = ρ² [v ∈ S] ‖G v‖² + d (λ m̄)²`. -/
theorem channel2_second_moment_batch {V d : ℕ} (ρ lam τ : ℝ) (G : Fin V → Fin d → ℝ)
    (Z : Fin V → Fin d → Ω → ℝ) (hZ : ∀ v i, IsStdNormal μ (Z v i)) (v : Fin V) :
    ∫ ω, sqNorm (floodRowsBatch ρ lam τ G Z ω v) ∂μ
      = (if v ∈ active τ G then ρ else 0) ^ 2 * sqNorm (G v)
        + (d : ℝ) * (lam * mbarRows τ G) ^ 2 :=
  row_second_moment (if v ∈ active τ G then ρ else 0) (lam * mbarRows τ G) G Z hZ v

/-- **Theorem 2 (3), as the paper states it.** Batch calibration `σ = λ m̄`, `λ > 0`, `m̄ > 0`,
and the paper's Assumption 1 with any constant `C`: `‖G u‖ ≤ C m̄` for every active row `u ∈ S`.
Then for every row `v` the relative inflation of its second moment,
`(E‖out v‖² − d σ²) / (d σ²)` (`= ρ² [v ∈ S] ‖G v‖² / (d λ² m̄²)`), satisfies
`0 ≤ … ≤ ρ² C² / (d λ²)`.

No hypothesis on `τ`: `τ = 0` (every non-zero row active) is allowed; `m̄ > 0` is the paper's
standing assumption (`mbarRows_pos` derives it from `G ≠ 0` and `τ < 1`). The bound is a ratio of
*expected squared norms*; what it does not say about distinguishing rows is in
`Aegis/Divergence.lean`. -/
theorem channel2_relative_inflation {V d : ℕ} (hd : 0 < d) (ρ lam τ C : ℝ)
    (G : Fin V → Fin d → ℝ) (Z : Fin V → Fin d → Ω → ℝ) (hZ : ∀ v i, IsStdNormal μ (Z v i))
    (hlam : 0 < lam) (hm : 0 < mbarRows τ G)
    (hC : ∀ u ∈ active τ G, l2norm (G u) ≤ C * mbarRows τ G) (v : Fin V) :
    0 ≤ (∫ ω, sqNorm (floodRowsBatch ρ lam τ G Z ω v) ∂μ - (d : ℝ) * (lam * mbarRows τ G) ^ 2)
        / ((d : ℝ) * (lam * mbarRows τ G) ^ 2)
    ∧ (∫ ω, sqNorm (floodRowsBatch ρ lam τ G Z ω v) ∂μ - (d : ℝ) * (lam * mbarRows τ G) ^ 2)
        / ((d : ℝ) * (lam * mbarRows τ G) ^ 2)
      ≤ ρ ^ 2 * C ^ 2 / ((d : ℝ) * lam ^ 2) := by
  have hdpos : (0 : ℝ) < (d : ℝ) := by exact_mod_cast hd
  have hnum : ∫ ω, sqNorm (floodRowsBatch ρ lam τ G Z ω v) ∂μ - (d : ℝ) * (lam * mbarRows τ G) ^ 2
      = (if v ∈ active τ G then ρ else 0) ^ 2 * sqNorm (G v) := by
    rw [channel2_second_moment_batch ρ lam τ G Z hZ v]
    ring
  rw [hnum]
  have hD : 0 < (d : ℝ) * (lam * mbarRows τ G) ^ 2 := mul_pos hdpos (pow_pos (mul_pos hlam hm) 2)
  have hE : 0 < (d : ℝ) * lam ^ 2 := mul_pos hdpos (pow_pos hlam 2)
  refine ⟨div_nonneg (mul_nonneg (sq_nonneg _) (sqNorm_nonneg (G v))) hD.le, ?_⟩
  -- the signal energy of row `v` is at most `ρ² C² m̄²` (zero when `v ∉ S`)
  have hk : (if v ∈ active τ G then ρ else 0) ^ 2 * sqNorm (G v)
      ≤ ρ ^ 2 * (C ^ 2 * mbarRows τ G ^ 2) := by
    split_ifs with hv
    · have h0 : 0 ≤ l2norm (G v) := l2norm_nonneg (G v)
      have h1 := mul_self_le_mul_self h0 (hC v hv)
      have h2 : sqNorm (G v) ≤ C ^ 2 * mbarRows τ G ^ 2 := by
        rw [← sq_l2norm (G v)]
        nlinarith [h1]
      exact mul_le_mul_of_nonneg_left h2 (sq_nonneg ρ)
    · have h0 : 0 ≤ ρ ^ 2 * (C ^ 2 * mbarRows τ G ^ 2) := by positivity
      have h00 : (0 : ℝ) ^ 2 * sqNorm (G v) = 0 := by ring
      linarith [h0, h00]
  have step := mul_le_mul_of_nonneg_right hk hE.le
  apply div_le_div_of_cross _ _ _ _ hD hE
  nlinarith [step]

/-- **Theorem 2 (3) with `C = 1 / τ`** (corollary of `channel2_relative_inflation`). The batch
calibration itself gives Assumption 1 with `C = 1/τ` (`norm_le_mbar_div_tau`, `0 < τ < 1`), so
for `G ≠ 0` every row's relative inflation is at most `ρ² / (d λ² τ²)`.

*Looseness.* This `C` holds for every gradient, so it is the worst case: at `τ = 0.01`,
`ρ = 0.3`, `λ = 1`, `d = 768` the bound is `0.09 / 0.0768 ≈ 1.17`, order one, where the paper's
`C ≈ 1` (rows of similar norm) gives `ρ² / (d λ²) ≈ 1.2 · 10⁻⁴`. It excludes `τ = 0`. -/
theorem channel2_relative_inflation_tau {V d : ℕ} (hd : 0 < d) (ρ lam τ : ℝ)
    (G : Fin V → Fin d → ℝ) (Z : Fin V → Fin d → Ω → ℝ) (hZ : ∀ v i, IsStdNormal μ (Z v i))
    (hlam : 0 < lam) (hτ0 : 0 < τ) (hτ1 : τ < 1) (hG : ∃ v i, G v i ≠ 0) (v : Fin V) :
    (∫ ω, sqNorm (floodRowsBatch ρ lam τ G Z ω v) ∂μ - (d : ℝ) * (lam * mbarRows τ G) ^ 2)
        / ((d : ℝ) * (lam * mbarRows τ G) ^ 2)
      ≤ ρ ^ 2 / ((d : ℝ) * lam ^ 2 * τ ^ 2) := by
  have hm : 0 < mbarRows τ G := mbarRows_pos τ hτ1 G hG
  have hC : ∀ u ∈ active τ G, l2norm (G u) ≤ (1 / τ) * mbarRows τ G := by
    intro u _
    have h := norm_le_mbar_div_tau τ hτ0 hτ1 G u
    have he : (1 / τ) * mbarRows τ G = mbarRows τ G / τ := by ring
    rw [he]
    exact h
  have h := (channel2_relative_inflation hd ρ lam τ (1 / τ) G Z hZ hlam hm hC v).2
  have he : ρ ^ 2 * (1 / τ) ^ 2 / ((d : ℝ) * lam ^ 2) = ρ ^ 2 / ((d : ℝ) * lam ^ 2 * τ ^ 2) := by
    ring
  exact le_of_le_of_eq h he

/-- **Theorem 2 (relative inflation, public calibration).** Under the default calibration the
bound holds with public constants only: `(E‖out v‖² − d σ²) / (d σ²) ≤ ρ² c² / (d σ²)`, because
the clipped signal of any row has norm at most `ρ c`. -/
theorem channel2_relative_inflation_public {V d : ℕ} (hd : 0 < d) (ρ σ c thr : ℝ)
    (G : Fin V → Fin d → ℝ) (Z : Fin V → Fin d → Ω → ℝ) (hZ : ∀ v i, IsStdNormal μ (Z v i))
    (hρ : 0 ≤ ρ) (hc : 0 ≤ c) (hσ : σ ≠ 0) (v : Fin V) :
    (∫ ω, sqNorm (floodRows ρ σ c thr G Z ω v) ∂μ - (d : ℝ) * σ ^ 2) / ((d : ℝ) * σ ^ 2)
      ≤ (ρ * c) ^ 2 / ((d : ℝ) * σ ^ 2) := by
  have hdpos : (0 : ℝ) < (d : ℝ) := by exact_mod_cast hd
  have hnum : ∫ ω, sqNorm (floodRows ρ σ c thr G Z ω v) ∂μ - (d : ℝ) * σ ^ 2
      = rowCoef ρ c thr (G v) ^ 2 * sqNorm (G v) := by
    rw [floodRows_second_moment ρ σ c thr G Z hZ v]
    ring
  rw [hnum]
  have hD : 0 < (d : ℝ) * σ ^ 2 := by
    have hσ2 : 0 < σ ^ 2 := by
      have h := mul_self_pos.mpr hσ
      nlinarith [h]
    exact mul_pos hdpos hσ2
  have hle := rowCoef_energy_le ρ c thr hρ hc (G v)
  apply div_le_div_of_cross _ _ _ _ hD hD
  exact mul_le_mul_of_nonneg_right hle hD.le

/-- Almost surely no row `k v · G v + σ Z v` is zero, when `σ ≠ 0` (any coefficients `k`). -/
theorem rows_nonzero_ae {V d : ℕ} (hd : 0 < d) (k : Fin V → ℝ) (σ : ℝ) (hσ : σ ≠ 0)
    (G : Fin V → Fin d → ℝ) (Z : Fin V → Fin d → Ω → ℝ) (hZ : ∀ v i, IsStdNormal μ (Z v i)) :
    ∀ᵐ ω ∂μ, ∀ v, (fun i => k v * G v i + σ * Z v i ω) ≠ 0 := by
  have hσi : σ * σ⁻¹ = 1 := mul_inv_cancel₀ hσ
  have hrow : ∀ v, ∀ᵐ ω ∂μ, (fun i => k v * G v i + σ * Z v i ω) ≠ 0 := by
    intro v
    have hc : ∀ᵐ ω ∂μ, Z v ⟨0, hd⟩ ω ≠ -(k v * G v ⟨0, hd⟩) * σ⁻¹ :=
      (hZ v ⟨0, hd⟩).ae_ne _
    refine hc.mono (fun ω hω => ?_)
    intro hzero
    have h0 : k v * G v ⟨0, hd⟩ + σ * Z v ⟨0, hd⟩ ω = 0 := by
      first
        | exact congrFun hzero ⟨0, hd⟩
        | simpa using congrFun hzero ⟨0, hd⟩
    apply hω
    linear_combination σ⁻¹ * h0 - Z v ⟨0, hd⟩ ω * hσi
  first
    | exact ae_all_iff.mpr hrow
    | exact ae_all_iff.2 hrow

/-- **Theorem 2 (no empty rows, public calibration).** If `σ ≠ 0`, almost surely every row of
the flooded gradient is non-zero, active or not: which rows carry tokens is not visible in the
zero pattern. -/
theorem channel2_rows_nonzero_ae {V d : ℕ} (hd : 0 < d) (ρ σ c thr : ℝ) (hσ : σ ≠ 0)
    (G : Fin V → Fin d → ℝ) (Z : Fin V → Fin d → Ω → ℝ) (hZ : ∀ v i, IsStdNormal μ (Z v i)) :
    ∀ᵐ ω ∂μ, ∀ v, floodRows ρ σ c thr G Z ω v ≠ 0 :=
  rows_nonzero_ae hd (fun v => rowCoef ρ c thr (G v)) σ hσ G Z hZ

/-- **Theorem 2 (no empty rows, batch calibration).** With `σ = λ m̄`, `λ > 0`, `τ < 1` and
`G ≠ 0`, `σ > 0` is derived (`mbarRows_pos`), so no flooded row is zero almost surely. -/
theorem channel2_rows_nonzero_ae_batch {V d : ℕ} (hd : 0 < d) (ρ lam τ : ℝ) (hlam : 0 < lam)
    (hτ1 : τ < 1) (G : Fin V → Fin d → ℝ) (hG : ∃ v i, G v i ≠ 0)
    (Z : Fin V → Fin d → Ω → ℝ) (hZ : ∀ v i, IsStdNormal μ (Z v i)) :
    ∀ᵐ ω ∂μ, ∀ v, floodRowsBatch ρ lam τ G Z ω v ≠ 0 := by
  have hσ : lam * mbarRows τ G ≠ 0 := (mul_pos hlam (mbarRows_pos τ hτ1 G hG)).ne'
  exact rows_nonzero_ae hd (fun v => if v ∈ active τ G then ρ else 0) (lam * mbarRows τ G) hσ
    G Z hZ

end Aegis
