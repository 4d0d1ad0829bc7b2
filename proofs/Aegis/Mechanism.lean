import Mathlib

/-!
# The mechanism: rows flood, matrix flood, and the paper's batch calibration

The executable specification is `aegis_kernels/reference.py` (`flood_rows`, `flood_matrix`,
`statistic`, `batch_params`); this file restates it. Vectors are `Fin d → ℝ`, matrices
`Fin m → Fin n → ℝ`; Euclidean and Frobenius norms are written through explicit sums (on
`Fin d → ℝ`, Mathlib's `‖·‖` is the sup norm).

**Default (public) calibration.** `ρ, σ, c (clip), thr` are public numbers:

* rows:   `out v = ρ · min(1, c/‖G v‖) · [thr < ‖G v‖] · G v + σ · Z v`   (`floodRows`)
* matrix: `out = ρ · min(1, c/‖G‖_F) · G + σ · Z`                         (`floodMatrix`)

**Paper (batch) calibration.** No clip; the noise level is read from the private gradient:

* rows: `M = max_v ‖G v‖`, `S = {v : τ M < ‖G v‖}`, `m̄ = mean_{v ∈ S} ‖G v‖`, `σ = λ m̄`,
  `out v = ρ [v ∈ S] G v + σ Z v`                                            (`floodRowsBatch`)
* matrix: `m̄ = mean |G|`, `σ = λ m̄`, `out = ρ G + σ Z`                     (`floodMatrixBatch`)

Deterministic facts proved here (they replace the constants `C` the paper assumes):

* `mbarRows_pos`: `0 < m̄` when `G ≠ 0` and `τ < 1`;
* `tau_mul_norm_le_mbar`, `norm_le_mbar_div_tau`: `τ ‖G v‖ ≤ m̄`, i.e. `‖G v‖ ≤ m̄ / τ`, for every
  row `v` (so `C = 1 / τ` for the rows flood);
* `froNorm_le_mn_meanAbs`: `‖G‖_F ≤ m n · mean |G|` (so `C = m n` for the matrix flood);
* `clipped_norm_le`, `clip_energy_le`: `‖ρ min(1, c/‖g‖) g‖ ≤ ρ c` (public constants).

Written without a Lean toolchain at hand: not machine-checked where it was written.
-/

noncomputable section

namespace Aegis

/-! ## Norms -/

/-- Squared Euclidean norm `∑ᵢ xᵢ²`. -/
def sqNorm {d : ℕ} (x : Fin d → ℝ) : ℝ := ∑ i, x i ^ 2

/-- Euclidean norm `√(∑ᵢ xᵢ²)`. -/
def l2norm {d : ℕ} (x : Fin d → ℝ) : ℝ := Real.sqrt (sqNorm x)

/-- Squared Frobenius norm. -/
def froSq {m n : ℕ} (G : Fin m → Fin n → ℝ) : ℝ := ∑ i, ∑ j, G i j ^ 2

/-- Frobenius norm. -/
def froNorm {m n : ℕ} (G : Fin m → Fin n → ℝ) : ℝ := Real.sqrt (froSq G)

/-- Mean absolute entry `(∑ |G i j|) / (m n)` (the matrix statistic `m̄`). -/
def meanAbs {m n : ℕ} (G : Fin m → Fin n → ℝ) : ℝ :=
  (∑ i, ∑ j, |G i j|) / ((m : ℝ) * (n : ℝ))

theorem sqNorm_nonneg {d : ℕ} (x : Fin d → ℝ) : 0 ≤ sqNorm x :=
  Finset.sum_nonneg (fun i _ => sq_nonneg (x i))

theorem l2norm_nonneg {d : ℕ} (x : Fin d → ℝ) : 0 ≤ l2norm x := Real.sqrt_nonneg _

theorem sq_l2norm {d : ℕ} (x : Fin d → ℝ) : l2norm x ^ 2 = sqNorm x :=
  Real.sq_sqrt (sqNorm_nonneg x)

theorem froSq_nonneg {m n : ℕ} (G : Fin m → Fin n → ℝ) : 0 ≤ froSq G :=
  Finset.sum_nonneg (fun i _ => Finset.sum_nonneg (fun j _ => sq_nonneg (G i j)))

theorem sq_froNorm {m n : ℕ} (G : Fin m → Fin n → ℝ) : froNorm G ^ 2 = froSq G :=
  Real.sq_sqrt (froSq_nonneg G)

/-- `‖k x‖² = k² ‖x‖²`. -/
theorem sqNorm_smul {d : ℕ} (k : ℝ) (x : Fin d → ℝ) :
    sqNorm (fun i => k * x i) = k ^ 2 * sqNorm x := by
  unfold sqNorm
  rw [Finset.mul_sum]
  exact Finset.sum_congr rfl (fun i _ => by ring)

/-- `‖k G‖_F² = k² ‖G‖_F²`. -/
theorem froSq_smul {m n : ℕ} (k : ℝ) (G : Fin m → Fin n → ℝ) :
    froSq (fun i j => k * G i j) = k ^ 2 * froSq G := by
  unfold froSq
  rw [Finset.mul_sum]
  refine Finset.sum_congr rfl (fun i _ => ?_)
  rw [Finset.mul_sum]
  exact Finset.sum_congr rfl (fun j _ => by ring)

/-- A vector with a non-zero coordinate has positive norm. -/
theorem l2norm_pos {d : ℕ} (x : Fin d → ℝ) (i : Fin d) (hi : x i ≠ 0) : 0 < l2norm x := by
  have hsq : 0 < x i ^ 2 := by
    have h := mul_self_pos.mpr hi
    nlinarith [h]
  have hle : x i ^ 2 ≤ sqNorm x := by
    unfold sqNorm
    first
      | exact Finset.single_le_sum (f := fun j => x j ^ 2) (fun j _ => sq_nonneg (x j))
          (Finset.mem_univ i)
      | exact Finset.single_le_sum (fun j _ => sq_nonneg (x j)) (Finset.mem_univ i)
  exact Real.sqrt_pos.mpr (lt_of_lt_of_le hsq hle)

/-! ## Division without `field_simp` -/

/-- `A / D ≤ B / E` from the cross product `A E ≤ B D` (`D, E > 0`). -/
theorem div_le_div_of_cross (A B D E : ℝ) (hD : 0 < D) (hE : 0 < E) (h : A * E ≤ B * D) :
    A / D ≤ B / E := by
  have hDi : D * D⁻¹ = 1 := mul_inv_cancel₀ hD.ne'
  have hEi : E * E⁻¹ = 1 := mul_inv_cancel₀ hE.ne'
  have hk : 0 ≤ D⁻¹ * E⁻¹ := mul_nonneg (inv_nonneg.mpr hD.le) (inv_nonneg.mpr hE.le)
  have h2 : (A * E) * (D⁻¹ * E⁻¹) ≤ (B * D) * (D⁻¹ * E⁻¹) := mul_le_mul_of_nonneg_right h hk
  have hl : (A * E) * (D⁻¹ * E⁻¹) = A / D := by
    rw [div_eq_mul_inv]
    linear_combination (A * D⁻¹) * hEi
  have hr : (B * D) * (D⁻¹ * E⁻¹) = B / E := by
    rw [div_eq_mul_inv]
    linear_combination (B * E⁻¹) * hDi
  linarith [h2, hl, hr]

/-- `x ≤ b / a` from `a x ≤ b` (`a > 0`). -/
theorem le_div_of_mul_le_pos (a b x : ℝ) (ha : 0 < a) (h : a * x ≤ b) : x ≤ b / a := by
  have hai : a * a⁻¹ = 1 := mul_inv_cancel₀ ha.ne'
  have hx : x = (a * x) * a⁻¹ := by linear_combination (-x) * hai
  have hstep : (a * x) * a⁻¹ ≤ b * a⁻¹ := mul_le_mul_of_nonneg_right h (inv_nonneg.mpr ha.le)
  rw [div_eq_mul_inv]
  linarith [hx, hstep]

/-! ## The clip `(C)` -/

/-- `min(1, c / r)`: `1` when `r ≤ c` (in particular for a zero norm), else `c / r`. -/
def clipScale (c r : ℝ) : ℝ := if r ≤ c then 1 else c / r

theorem clipScale_nonneg (c r : ℝ) (hc : 0 ≤ c) (hr : 0 ≤ r) : 0 ≤ clipScale c r := by
  unfold clipScale
  split_ifs with h
  · exact zero_le_one
  · exact div_nonneg hc hr

/-- The clipped norm never exceeds the clip: `min(1, c/r) · r ≤ c`. -/
theorem clipScale_mul_le (c r : ℝ) (hc : 0 ≤ c) : clipScale c r * r ≤ c := by
  unfold clipScale
  split_ifs with h
  · linarith
  · have hr : 0 < r := by
      push_neg at h
      linarith
    have hri : r⁻¹ * r = 1 := inv_mul_cancel₀ hr.ne'
    have he : c / r * r = c := by
      rw [div_eq_mul_inv]
      linear_combination c * hri
    linarith [he]

theorem clipScale_le_one (c r : ℝ) (hc : 0 ≤ c) : clipScale c r ≤ 1 := by
  unfold clipScale
  split_ifs with h
  · exact le_refl 1
  · have hr : 0 < r := by
      push_neg at h
      linarith
    have hcr : c ≤ r := by
      push_neg at h
      exact h.le
    have hri : r * r⁻¹ = 1 := mul_inv_cancel₀ hr.ne'
    have hstep : c * r⁻¹ ≤ r * r⁻¹ := mul_le_mul_of_nonneg_right hcr (inv_nonneg.mpr hr.le)
    rw [div_eq_mul_inv]
    linarith [hstep, hri]

/-- Energy of a clipped signal: `(ρ min(1, c/r))² r² ≤ (ρ c)²` (`ρ, c ≥ 0`, `r ≥ 0`). -/
theorem clip_energy_le (ρ c r : ℝ) (hρ : 0 ≤ ρ) (hc : 0 ≤ c) (hr : 0 ≤ r) :
    (ρ * clipScale c r) ^ 2 * r ^ 2 ≤ (ρ * c) ^ 2 := by
  have h0 : 0 ≤ ρ * (clipScale c r * r) :=
    mul_nonneg hρ (mul_nonneg (clipScale_nonneg c r hc hr) hr)
  have h1 : ρ * (clipScale c r * r) ≤ ρ * c :=
    mul_le_mul_of_nonneg_left (clipScale_mul_le c r hc) hρ
  have h2 := mul_self_le_mul_self h0 h1
  nlinarith [h2]

/-- **Public constants.** The clipped signal of a row has norm at most `ρ c`:
`‖ρ min(1, c/‖g‖) g‖ ≤ ρ c`. -/
theorem clipped_norm_le {d : ℕ} (ρ c : ℝ) (hρ : 0 ≤ ρ) (hc : 0 ≤ c) (g : Fin d → ℝ) :
    l2norm (fun i => ρ * clipScale c (l2norm g) * g i) ≤ ρ * c := by
  have hk : 0 ≤ ρ * clipScale c (l2norm g) :=
    mul_nonneg hρ (clipScale_nonneg c _ hc (l2norm_nonneg g))
  have hsq : sqNorm (fun i => ρ * clipScale c (l2norm g) * g i)
      = (ρ * clipScale c (l2norm g) * l2norm g) ^ 2 := by
    rw [sqNorm_smul, ← sq_l2norm g]
    ring
  have hnn : 0 ≤ ρ * clipScale c (l2norm g) * l2norm g := mul_nonneg hk (l2norm_nonneg g)
  have heq : l2norm (fun i => ρ * clipScale c (l2norm g) * g i)
      = ρ * clipScale c (l2norm g) * l2norm g :=
    calc l2norm (fun i => ρ * clipScale c (l2norm g) * g i)
        = Real.sqrt (sqNorm (fun i => ρ * clipScale c (l2norm g) * g i)) := rfl
      _ = Real.sqrt ((ρ * clipScale c (l2norm g) * l2norm g) ^ 2) := by rw [hsq]
      _ = ρ * clipScale c (l2norm g) * l2norm g := Real.sqrt_sq hnn
  rw [heq]
  have h1 : ρ * (clipScale c (l2norm g) * l2norm g) ≤ ρ * c :=
    mul_le_mul_of_nonneg_left (clipScale_mul_le c _ hc) hρ
  linarith [h1]

/-! ## The floods with public parameters (the default) -/

/-- Signal coefficient of a row: `ρ · min(1, c/‖g‖)` if `thr < ‖g‖` (active), else `0`. -/
def rowCoef {d : ℕ} (ρ c thr : ℝ) (g : Fin d → ℝ) : ℝ :=
  if thr < l2norm g then ρ * clipScale c (l2norm g) else 0

/-- **Rows flood** (E4, C) of `G ∈ ℝ^{V×d}` with public `(ρ, σ, c, thr)` and noise `Z`. -/
def floodRows {Ω : Type*} {V d : ℕ} (ρ σ c thr : ℝ) (G : Fin V → Fin d → ℝ)
    (Z : Fin V → Fin d → Ω → ℝ) (ω : Ω) (v : Fin V) (i : Fin d) : ℝ :=
  rowCoef ρ c thr (G v) * G v i + σ * Z v i ω

/-- **Matrix flood** (E5, C) of `G ∈ ℝ^{m×n}` with public `(ρ, σ, c)` and noise `Z`. -/
def floodMatrix {Ω : Type*} {m n : ℕ} (ρ σ c : ℝ) (G : Fin m → Fin n → ℝ)
    (Z : Fin m → Fin n → Ω → ℝ) (ω : Ω) (i : Fin m) (j : Fin n) : ℝ :=
  ρ * clipScale c (froNorm G) * G i j + σ * Z i j ω

/-- The matrix flood of a gradient vector (Proposition 1 floods the whole gradient). -/
def floodVec {Ω : Type*} {d : ℕ} (ρ σ c : ℝ) (g : Fin d → ℝ) (Z : Fin d → Ω → ℝ) (ω : Ω)
    (i : Fin d) : ℝ :=
  ρ * clipScale c (l2norm g) * g i + σ * Z i ω

theorem rowCoef_of_active {d : ℕ} (ρ c thr : ℝ) (g : Fin d → ℝ) (h : thr < l2norm g) :
    rowCoef ρ c thr g = ρ * clipScale c (l2norm g) := by
  unfold rowCoef
  exact if_pos h

theorem rowCoef_of_inactive {d : ℕ} (ρ c thr : ℝ) (g : Fin d → ℝ) (h : ¬ thr < l2norm g) :
    rowCoef ρ c thr g = 0 := by
  unfold rowCoef
  exact if_neg h

/-- The exported signal energy of a row is at most `(ρ c)²`, active or not. -/
theorem rowCoef_energy_le {d : ℕ} (ρ c thr : ℝ) (hρ : 0 ≤ ρ) (hc : 0 ≤ c) (g : Fin d → ℝ) :
    rowCoef ρ c thr g ^ 2 * sqNorm g ≤ (ρ * c) ^ 2 := by
  by_cases h : thr < l2norm g
  · rw [rowCoef_of_active ρ c thr g h, ← sq_l2norm g]
    exact clip_energy_le ρ c (l2norm g) hρ hc (l2norm_nonneg g)
  · rw [rowCoef_of_inactive ρ c thr g h]
    nlinarith [sqNorm_nonneg g, sq_nonneg (ρ * c)]

/-! ## The paper's batch calibration -/

open Classical in
/-- `M = max_v ‖G v‖` (`0` for `V = 0`), as a value attained by some row. -/
def peak {V d : ℕ} (G : Fin V → Fin d → ℝ) : ℝ :=
  if h : ∃ u : Fin V, ∀ v : Fin V, l2norm (G v) ≤ l2norm (G u) then
    l2norm (G (Classical.choose h))
  else 0

/-- The active rows `S = {v : τ M < ‖G v‖}`. -/
def active {V d : ℕ} (τ : ℝ) (G : Fin V → Fin d → ℝ) : Finset (Fin V) :=
  Finset.univ.filter (fun v => τ * peak G < l2norm (G v))

/-- `m̄ = mean_{v ∈ S} ‖G v‖` (E3; `0` when `S` is empty). -/
def mbarRows {V d : ℕ} (τ : ℝ) (G : Fin V → Fin d → ℝ) : ℝ :=
  (∑ v ∈ active τ G, l2norm (G v)) / ((active τ G).card : ℝ)

/-- **Rows flood, batch calibration**: `σ = λ m̄`, no clip, threshold `τ M`. -/
def floodRowsBatch {Ω : Type*} {V d : ℕ} (ρ lam τ : ℝ) (G : Fin V → Fin d → ℝ)
    (Z : Fin V → Fin d → Ω → ℝ) (ω : Ω) (v : Fin V) (i : Fin d) : ℝ :=
  (if v ∈ active τ G then ρ else 0) * G v i + lam * mbarRows τ G * Z v i ω

/-- **Matrix flood, batch calibration**: `σ = λ mean |G|`, no clip. -/
def floodMatrixBatch {Ω : Type*} {m n : ℕ} (ρ lam : ℝ) (G : Fin m → Fin n → ℝ)
    (Z : Fin m → Fin n → Ω → ℝ) (ω : Ω) (i : Fin m) (j : Fin n) : ℝ :=
  ρ * G i j + lam * meanAbs G * Z i j ω

theorem mem_active {V d : ℕ} (τ : ℝ) (G : Fin V → Fin d → ℝ) (v : Fin V) :
    v ∈ active τ G ↔ τ * peak G < l2norm (G v) := by
  first
    | (unfold active; rw [Finset.mem_filter]; exact and_iff_right (Finset.mem_univ v))
    | simp [active]

theorem exists_argmax {V d : ℕ} (G : Fin V → Fin d → ℝ) (v : Fin V) :
    ∃ u : Fin V, ∀ w : Fin V, l2norm (G w) ≤ l2norm (G u) := by
  obtain ⟨u, _, hu⟩ := Finset.exists_max_image (Finset.univ : Finset (Fin V))
    (fun w => l2norm (G w)) ⟨v, Finset.mem_univ v⟩
  exact ⟨u, fun w => hu w (Finset.mem_univ w)⟩

theorem le_peak {V d : ℕ} (G : Fin V → Fin d → ℝ) (v : Fin V) : l2norm (G v) ≤ peak G := by
  have h : ∃ u : Fin V, ∀ w : Fin V, l2norm (G w) ≤ l2norm (G u) := exists_argmax G v
  have hp : peak G = l2norm (G (Classical.choose h)) := by
    first
      | exact dif_pos h
      | (unfold peak; exact dif_pos h)
      | simp [peak, h]
  rw [hp]
  exact Classical.choose_spec h v

theorem peak_nonneg {V d : ℕ} (G : Fin V → Fin d → ℝ) : 0 ≤ peak G := by
  by_cases h : ∃ u : Fin V, ∀ w : Fin V, l2norm (G w) ≤ l2norm (G u)
  · obtain ⟨u, _⟩ := h
    exact le_trans (l2norm_nonneg (G u)) (le_peak G u)
  · have hp : peak G = 0 := by
      first
        | exact dif_neg h
        | (unfold peak; exact dif_neg h)
        | simp [peak, h]
    rw [hp]

/-- A positive peak is attained by some row. -/
theorem peak_attained {V d : ℕ} (G : Fin V → Fin d → ℝ) (hp : 0 < peak G) :
    ∃ u : Fin V, l2norm (G u) = peak G := by
  by_cases h : ∃ u : Fin V, ∀ w : Fin V, l2norm (G w) ≤ l2norm (G u)
  · have he : peak G = l2norm (G (Classical.choose h)) := by
      first
        | exact dif_pos h
        | (unfold peak; exact dif_pos h)
        | simp [peak, h]
    exact ⟨Classical.choose h, he.symm⟩
  · have h0 : peak G = 0 := by
      first
        | exact dif_neg h
        | (unfold peak; exact dif_neg h)
        | simp [peak, h]
    rw [h0] at hp
    exact absurd hp (lt_irrefl 0)

theorem peak_pos {V d : ℕ} (G : Fin V → Fin d → ℝ) (hG : ∃ v i, G v i ≠ 0) : 0 < peak G := by
  obtain ⟨v, i, hi⟩ := hG
  exact lt_of_lt_of_le (l2norm_pos (G v) i hi) (le_peak G v)

/-- For `τ < 1` the row of largest norm is active (when `G ≠ 0`). -/
theorem argmax_active {V d : ℕ} (τ : ℝ) (hτ1 : τ < 1) (G : Fin V → Fin d → ℝ)
    (hG : ∃ v i, G v i ≠ 0) : ∃ u, u ∈ active τ G ∧ l2norm (G u) = peak G := by
  have hp : 0 < peak G := peak_pos G hG
  obtain ⟨u, hu⟩ := peak_attained G hp
  refine ⟨u, ?_, hu⟩
  rw [mem_active, hu]
  have h1 : 0 < (1 - τ) * peak G := mul_pos (sub_pos.mpr hτ1) hp
  nlinarith [h1]

/-- **`0 < m̄`** whenever `G ≠ 0` and `τ < 1`. -/
theorem mbarRows_pos {V d : ℕ} (τ : ℝ) (hτ1 : τ < 1) (G : Fin V → Fin d → ℝ)
    (hG : ∃ v i, G v i ≠ 0) : 0 < mbarRows τ G := by
  obtain ⟨u, hu, hun⟩ := argmax_active τ hτ1 G hG
  have hcard : (0 : ℝ) < ((active τ G).card : ℝ) := by
    have h : 0 < (active τ G).card := Finset.card_pos.mpr ⟨u, hu⟩
    exact_mod_cast h
  have hle : l2norm (G u) ≤ ∑ v ∈ active τ G, l2norm (G v) := by
    first
      | exact Finset.single_le_sum (f := fun v => l2norm (G v)) (fun v _ => l2norm_nonneg (G v)) hu
      | exact Finset.single_le_sum (fun v _ => l2norm_nonneg (G v)) hu
  have hsum : 0 < ∑ v ∈ active τ G, l2norm (G v) := by
    rw [hun] at hle
    exact lt_of_lt_of_le (peak_pos G hG) hle
  unfold mbarRows
  exact div_pos hsum hcard

theorem mbarRows_nonneg {V d : ℕ} (τ : ℝ) (G : Fin V → Fin d → ℝ) : 0 ≤ mbarRows τ G := by
  unfold mbarRows
  exact div_nonneg (Finset.sum_nonneg (fun v _ => l2norm_nonneg (G v))) (Nat.cast_nonneg _)

/-- `τ M ≤ m̄`: every active row has norm above `τ M`, so their mean does too. -/
theorem tau_mul_peak_le_mbar {V d : ℕ} (τ : ℝ) (hτ0 : 0 ≤ τ) (hτ1 : τ < 1)
    (G : Fin V → Fin d → ℝ) : τ * peak G ≤ mbarRows τ G := by
  by_cases hp : peak G ≤ 0
  · have h1 : 0 ≤ τ * (-peak G) := mul_nonneg hτ0 (neg_nonneg.mpr hp)
    linarith [h1, mbarRows_nonneg τ G]
  · push_neg at hp
    obtain ⟨u, hun⟩ := peak_attained G hp
    have hu : u ∈ active τ G := by
      rw [mem_active, hun]
      have h1 : 0 < (1 - τ) * peak G := mul_pos (sub_pos.mpr hτ1) hp
      nlinarith [h1]
    have hcardN : 0 < (active τ G).card := Finset.card_pos.mpr ⟨u, hu⟩
    have hcard : (0 : ℝ) < ((active τ G).card : ℝ) := by exact_mod_cast hcardN
    have hlow : ∑ _v ∈ active τ G, τ * peak G ≤ ∑ v ∈ active τ G, l2norm (G v) :=
      Finset.sum_le_sum (fun v hv => le_of_lt ((mem_active τ G v).mp hv))
    have hconst : ∑ _v ∈ active τ G, τ * peak G = ((active τ G).card : ℝ) * (τ * peak G) := by
      first
        | (rw [Finset.sum_const, nsmul_eq_mul])
        | (simp [Finset.sum_const, nsmul_eq_mul]; done)
        | simp
    have hci : ((active τ G).card : ℝ) * ((active τ G).card : ℝ)⁻¹ = 1 :=
      mul_inv_cancel₀ hcard.ne'
    have hmc : mbarRows τ G * ((active τ G).card : ℝ) = ∑ v ∈ active τ G, l2norm (G v) := by
      unfold mbarRows
      rw [div_eq_mul_inv]
      linear_combination (∑ v ∈ active τ G, l2norm (G v)) * hci
    have hmul : (τ * peak G) * ((active τ G).card : ℝ) ≤ mbarRows τ G * ((active τ G).card : ℝ) := by
      linarith [hlow, hconst, hmc]
    first
      | exact le_of_mul_le_mul_right hmul hcard
      | exact (mul_le_mul_right hcard).mp hmul
      | nlinarith [hmul, hcard]

/-- **`τ ‖G v‖ ≤ m̄`** for every row (`0 ≤ τ < 1`). -/
theorem tau_mul_norm_le_mbar {V d : ℕ} (τ : ℝ) (hτ0 : 0 ≤ τ) (hτ1 : τ < 1)
    (G : Fin V → Fin d → ℝ) (v : Fin V) : τ * l2norm (G v) ≤ mbarRows τ G :=
  le_trans (mul_le_mul_of_nonneg_left (le_peak G v) hτ0) (tau_mul_peak_le_mbar τ hτ0 hτ1 G)

/-- **`‖G v‖ ≤ m̄ / τ`** for every row (`0 < τ < 1`): the paper's `C = 1 / τ`. -/
theorem norm_le_mbar_div_tau {V d : ℕ} (τ : ℝ) (hτ0 : 0 < τ) (hτ1 : τ < 1)
    (G : Fin V → Fin d → ℝ) (v : Fin V) : l2norm (G v) ≤ mbarRows τ G / τ :=
  le_div_of_mul_le_pos τ _ _ hτ0 (tau_mul_norm_le_mbar τ hτ0.le hτ1 G v)

/-- `τ² ‖G v‖² ≤ m̄²`, the squared form used by the inflation bounds. -/
theorem tau_sq_sqNorm_le {V d : ℕ} (τ : ℝ) (hτ0 : 0 ≤ τ) (hτ1 : τ < 1)
    (G : Fin V → Fin d → ℝ) (v : Fin V) : τ ^ 2 * sqNorm (G v) ≤ mbarRows τ G ^ 2 := by
  have h0 : 0 ≤ τ * l2norm (G v) := mul_nonneg hτ0 (l2norm_nonneg (G v))
  have h1 := mul_self_le_mul_self h0 (tau_mul_norm_le_mbar τ hτ0 hτ1 G v)
  rw [← sq_l2norm (G v)]
  nlinarith [h1]

/-- `‖G‖_F ≤ ∑ |G i j|`. -/
theorem froNorm_le_sum_abs {m n : ℕ} (G : Fin m → Fin n → ℝ) :
    froNorm G ≤ ∑ i, ∑ j, |G i j| := by
  have hS0 : 0 ≤ ∑ i, ∑ j, |G i j| :=
    Finset.sum_nonneg (fun i _ => Finset.sum_nonneg (fun j _ => abs_nonneg (G i j)))
  -- every entry is at most the whole sum
  have hentry : ∀ i j, |G i j| ≤ ∑ i, ∑ j, |G i j| := by
    intro i j
    have hrow : |G i j| ≤ ∑ j', |G i j'| := by
      first
        | exact Finset.single_le_sum (f := fun j' => |G i j'|) (fun j' _ => abs_nonneg (G i j'))
            (Finset.mem_univ j)
        | exact Finset.single_le_sum (fun j' _ => abs_nonneg (G i j')) (Finset.mem_univ j)
    have hall : ∑ j', |G i j'| ≤ ∑ i', ∑ j', |G i' j'| := by
      first
        | exact Finset.single_le_sum (f := fun i' => ∑ j', |G i' j'|)
            (fun i' _ => Finset.sum_nonneg (fun j' _ => abs_nonneg (G i' j'))) (Finset.mem_univ i)
        | exact Finset.single_le_sum (fun i' _ => Finset.sum_nonneg (fun j' _ => abs_nonneg (G i' j')))
            (Finset.mem_univ i)
    exact le_trans hrow hall
  -- so `G i j² = |G i j| |G i j| ≤ |G i j| S`, and `‖G‖_F² ≤ S²`
  have hsq : froSq G ≤ (∑ i, ∑ j, |G i j|) * (∑ i, ∑ j, |G i j|) := by
    unfold froSq
    have hterm : ∀ i j, G i j ^ 2 ≤ |G i j| * (∑ i, ∑ j, |G i j|) := by
      intro i j
      have he : G i j ^ 2 = |G i j| * |G i j| := by
        rw [abs_mul_abs_self]
        ring
      rw [he]
      exact mul_le_mul_of_nonneg_left (hentry i j) (abs_nonneg (G i j))
    have h1 : ∑ i, ∑ j, G i j ^ 2 ≤ ∑ i, ∑ j, |G i j| * (∑ i, ∑ j, |G i j|) :=
      Finset.sum_le_sum (fun i _ => Finset.sum_le_sum (fun j _ => hterm i j))
    have h2 : ∑ i, ∑ j, |G i j| * (∑ i, ∑ j, |G i j|)
        = (∑ i, ∑ j, |G i j|) * (∑ i, ∑ j, |G i j|) := by
      rw [Finset.sum_mul]
      refine Finset.sum_congr rfl (fun i _ => ?_)
      rw [Finset.sum_mul]
    linarith [h1, h2]
  unfold froNorm
  calc Real.sqrt (froSq G)
      ≤ Real.sqrt ((∑ i, ∑ j, |G i j|) * (∑ i, ∑ j, |G i j|)) := by
        first
          | exact Real.sqrt_le_sqrt hsq
          | exact Real.sqrt_le_sqrt (le_of_lt_or_eq (lt_or_eq_of_le hsq))
          | gcongr
    _ = ∑ i, ∑ j, |G i j| := Real.sqrt_mul_self hS0

/-- `∑ |G i j| = m n · mean |G|` (`m, n > 0`). -/
theorem sum_abs_eq_mn_meanAbs {m n : ℕ} (hm : 0 < m) (hn : 0 < n) (G : Fin m → Fin n → ℝ) :
    ∑ i, ∑ j, |G i j| = ((m : ℝ) * (n : ℝ)) * meanAbs G := by
  have hmn : (0 : ℝ) < (m : ℝ) * (n : ℝ) := by
    have hm' : (0 : ℝ) < (m : ℝ) := by exact_mod_cast hm
    have hn' : (0 : ℝ) < (n : ℝ) := by exact_mod_cast hn
    exact mul_pos hm' hn'
  have hi : ((m : ℝ) * (n : ℝ)) * ((m : ℝ) * (n : ℝ))⁻¹ = 1 := mul_inv_cancel₀ hmn.ne'
  unfold meanAbs
  rw [div_eq_mul_inv]
  linear_combination (-(∑ i, ∑ j, |G i j|)) * hi

/-- **`‖G‖_F ≤ m n · mean |G|`**: the paper's `C = m n` for the matrix flood. -/
theorem froNorm_le_mn_meanAbs {m n : ℕ} (hm : 0 < m) (hn : 0 < n) (G : Fin m → Fin n → ℝ) :
    froNorm G ≤ ((m : ℝ) * (n : ℝ)) * meanAbs G := by
  rw [← sum_abs_eq_mn_meanAbs hm hn G]
  exact froNorm_le_sum_abs G

/-- `0 < mean |G|` when `G ≠ 0`. -/
theorem meanAbs_pos {m n : ℕ} (G : Fin m → Fin n → ℝ) (hG : ∃ i j, G i j ≠ 0) :
    0 < meanAbs G := by
  obtain ⟨i, j, hij⟩ := hG
  have hm : 0 < m := by
    first
      | exact Fin.pos i
      | exact Nat.lt_of_le_of_lt (Nat.zero_le _) i.isLt
  have hn : 0 < n := by
    first
      | exact Fin.pos j
      | exact Nat.lt_of_le_of_lt (Nat.zero_le _) j.isLt
  have hmn : (0 : ℝ) < (m : ℝ) * (n : ℝ) := by
    have hm' : (0 : ℝ) < (m : ℝ) := by exact_mod_cast hm
    have hn' : (0 : ℝ) < (n : ℝ) := by exact_mod_cast hn
    exact mul_pos hm' hn'
  have hpos : 0 < |G i j| := abs_pos.mpr hij
  have hrow : |G i j| ≤ ∑ j', |G i j'| := by
    first
      | exact Finset.single_le_sum (f := fun j' => |G i j'|) (fun j' _ => abs_nonneg (G i j'))
          (Finset.mem_univ j)
      | exact Finset.single_le_sum (fun j' _ => abs_nonneg (G i j')) (Finset.mem_univ j)
  have hall : ∑ j', |G i j'| ≤ ∑ i', ∑ j', |G i' j'| := by
    first
      | exact Finset.single_le_sum (f := fun i' => ∑ j', |G i' j'|)
          (fun i' _ => Finset.sum_nonneg (fun j' _ => abs_nonneg (G i' j'))) (Finset.mem_univ i)
      | exact Finset.single_le_sum (fun i' _ => Finset.sum_nonneg (fun j' _ => abs_nonneg (G i' j')))
          (Finset.mem_univ i)
  unfold meanAbs
  exact div_pos (lt_of_lt_of_le hpos (le_trans hrow hall)) hmn

/-- Squared form of `‖G‖_F ≤ m n m̄`: `‖G‖_F² ≤ (m n)² m̄²`. -/
theorem froSq_le_mn_sq_meanAbs_sq {m n : ℕ} (hm : 0 < m) (hn : 0 < n) (G : Fin m → Fin n → ℝ) :
    froSq G ≤ ((m : ℝ) * (n : ℝ)) ^ 2 * meanAbs G ^ 2 := by
  have h0 : 0 ≤ froNorm G := Real.sqrt_nonneg _
  have h1 := mul_self_le_mul_self h0 (froNorm_le_mn_meanAbs hm hn G)
  rw [← sq_froNorm G]
  nlinarith [h1]

end Aegis
