import Mathlib

/-!
# Channel 1: frozen attention projections (Theorem 1)

AEGIS freezes every attention parameter. A client exports the gradient of the *trainable*
parameters only; seen from the server, the exported gradient of the whole model is the zero
extension of the trainable gradient. We model:

* parameter coordinates as an arbitrary type `ι`, with a Boolean `trainable : ι → Bool`;
* the trainable gradient as a function on the trainable coordinates only,
  `gT : {k // trainable k = true} → ℝ` (frozen coordinates have no gradient at all);
* the exported gradient as the zero extension `zeroExtend trainable gT : ι → ℝ`;
* an attention output-projection weight `W_O` of shape `m × n` as a coordinate map
  `coord : Fin m → Fin n → ι`, all of whose coordinates are frozen.

Results:

* `Aegis.channel1_exported_grad_zero`: the exported `W_O` gradient is the zero matrix.
* `Aegis.channel1_projection_zero`: any vector of the span of the rows of a zero matrix is `0`,
  so every projection onto that (trivial) span maps everything to `0`.
* `Aegis.channel1_residual_eq_one`: hence DAGER's subspace residual score
  `‖v - P v‖ / ‖v‖` equals `1` for every non-zero embedding `v` (no token passes the span test).

Vectors are `Fin n → ℝ`; Euclidean norms are written as `Real.sqrt (∑ j, x j ^ 2)` explicitly
(on `Fin n → ℝ`, `‖x‖` would be the sup norm).

Written without a Lean toolchain at hand: not machine-checked where it was written.
-/

noncomputable section

namespace Aegis

/-- Zero extension of a gradient defined on the trainable coordinates only: this is what the
server sees for the whole model when frozen parameters are never exported. -/
def zeroExtend {ι : Type*} (trainable : ι → Bool)
    (gT : {k : ι // trainable k = true} → ℝ) (k : ι) : ℝ :=
  if h : trainable k = true then gT ⟨k, h⟩ else 0

/-- The exported gradient of an `m × n` weight whose coordinates are `coord i j`. -/
def exportedGrad {ι : Type*} {m n : ℕ} (trainable : ι → Bool)
    (gT : {k : ι // trainable k = true} → ℝ) (coord : Fin m → Fin n → ι)
    (i : Fin m) (j : Fin n) : ℝ :=
  zeroExtend trainable gT (coord i j)

/-- A frozen coordinate is exported as zero. -/
theorem zeroExtend_of_frozen {ι : Type*} (trainable : ι → Bool)
    (gT : {k : ι // trainable k = true} → ℝ) (k : ι) (hk : trainable k = false) :
    zeroExtend trainable gT k = 0 := by
  have hne : ¬ (trainable k = true) := by
    first
      | (rw [hk]; decide)
      | simp [hk]
  first
    | exact dif_neg hne
    | (unfold zeroExtend; exact dif_neg hne)
    | (simp only [zeroExtend]; exact dif_neg hne)
    | simp [zeroExtend, hk]

/-- **Theorem 1 (first part).** With every attention coordinate frozen, the exported gradient of
the attention output projection is the zero matrix. -/
theorem channel1_exported_grad_zero {ι : Type*} {m n : ℕ} (trainable : ι → Bool)
    (gT : {k : ι // trainable k = true} → ℝ) (coord : Fin m → Fin n → ι)
    (hfrozen : ∀ i j, trainable (coord i j) = false) :
    ∀ i j, exportedGrad trainable gT coord i j = 0 := by
  intro i j
  have h : zeroExtend trainable gT (coord i j) = 0 :=
    zeroExtend_of_frozen trainable gT (coord i j) (hfrozen i j)
  first
    | exact h
    | (unfold exportedGrad; exact h)
    | (simp only [exportedGrad]; exact h)

/-- The span of the rows of a zero matrix is trivial: every element of it is `0`. In
particular any projection `P` onto that span (any map with `P v` in the span) is zero. -/
theorem channel1_projection_zero {m n : ℕ} (G : Fin m → Fin n → ℝ) (hG : ∀ i j, G i j = 0)
    (w : Fin n → ℝ) (hw : w ∈ Submodule.span ℝ (Set.range G)) : w = 0 := by
  have hrow : ∀ i, G i = 0 := by
    intro i
    funext j
    first
      | exact hG i j
      | simp [hG i j]
  have hbot : Submodule.span ℝ (Set.range G) = ⊥ := by
    rw [Submodule.span_eq_bot]
    rintro x ⟨i, rfl⟩
    exact hrow i
  rw [hbot] at hw
  first
    | exact (Submodule.mem_bot ℝ).mp hw
    | exact (Submodule.mem_bot ℝ).1 hw
    | simpa using hw

/-- **Theorem 1.** Let every attention coordinate be frozen, and let `P` be any projection onto
the span of the rows of the exported output-projection gradient (for DAGER's span test: the
orthogonal projection). Then the subspace residual score of every non-zero embedding `v` is
`‖v - P v‖ / ‖v‖ = 1`. -/
theorem channel1_residual_eq_one {ι : Type*} {m n : ℕ} (trainable : ι → Bool)
    (gT : {k : ι // trainable k = true} → ℝ) (coord : Fin m → Fin n → ι)
    (hfrozen : ∀ i j, trainable (coord i j) = false)
    (P : (Fin n → ℝ) → (Fin n → ℝ))
    (hP : ∀ w, P w ∈ Submodule.span ℝ (Set.range (exportedGrad trainable gT coord)))
    (v : Fin n → ℝ) (hv : v ≠ 0) :
    Real.sqrt (∑ j, (v j - P v j) ^ 2) / Real.sqrt (∑ j, v j ^ 2) = 1 := by
  have hG : ∀ i j, exportedGrad trainable gT coord i j = 0 :=
    channel1_exported_grad_zero trainable gT coord hfrozen
  have hPv : P v = 0 :=
    channel1_projection_zero (exportedGrad trainable gT coord) hG (P v) (hP v)
  have hres : ∀ j, v j - P v j = v j := by
    intro j
    first
      | (simp [hPv]; done)
      | (rw [hPv]; simp; done)
      | (rw [hPv, Pi.zero_apply, sub_zero])
  have hsum : ∑ j, (v j - P v j) ^ 2 = ∑ j, v j ^ 2 :=
    Finset.sum_congr rfl (fun j _ => by rw [hres j])
  obtain ⟨j0, hj0⟩ := Function.ne_iff.mp hv
  have hvj0 : v j0 ≠ 0 := by
    first
      | exact hj0
      | simpa using hj0
  have hpos1 : 0 < v j0 * v j0 := by
    first
      | exact mul_self_pos.mpr hvj0
      | positivity
  have hsq : v j0 ^ 2 = v j0 * v j0 := by ring
  have hle : v j0 ^ 2 ≤ ∑ j, v j ^ 2 := by
    first
      | exact Finset.single_le_sum (f := fun j => v j ^ 2) (fun j _ => sq_nonneg (v j))
          (Finset.mem_univ j0)
      | exact Finset.single_le_sum (fun j _ => sq_nonneg (v j)) (Finset.mem_univ j0)
  have hSpos : 0 < ∑ j, v j ^ 2 := by linarith
  have hsqrt_pos : 0 < Real.sqrt (∑ j, v j ^ 2) := Real.sqrt_pos.mpr hSpos
  have hsqrt_ne : Real.sqrt (∑ j, v j ^ 2) ≠ 0 := (ne_of_lt hsqrt_pos).symm
  rw [hsum]
  first
    | exact div_self hsqrt_ne
    | simp [hsqrt_ne]

/-- Squared form of Theorem 1 (no square roots): the residual energy equals the energy of `v`. -/
theorem channel1_residual_sq_eq {ι : Type*} {m n : ℕ} (trainable : ι → Bool)
    (gT : {k : ι // trainable k = true} → ℝ) (coord : Fin m → Fin n → ι)
    (hfrozen : ∀ i j, trainable (coord i j) = false)
    (P : (Fin n → ℝ) → (Fin n → ℝ))
    (hP : ∀ w, P w ∈ Submodule.span ℝ (Set.range (exportedGrad trainable gT coord)))
    (v : Fin n → ℝ) :
    ∑ j, (v j - P v j) ^ 2 = ∑ j, v j ^ 2 := by
  have hG : ∀ i j, exportedGrad trainable gT coord i j = 0 :=
    channel1_exported_grad_zero trainable gT coord hfrozen
  have hPv : P v = 0 :=
    channel1_projection_zero (exportedGrad trainable gT coord) hG (P v) (hP v)
  have hres : ∀ j, v j - P v j = v j := by
    intro j
    first
      | (simp [hPv]; done)
      | (rw [hPv]; simp; done)
      | (rw [hPv, Pi.zero_apply, sub_zero])
  exact Finset.sum_congr rfl (fun j _ => by rw [hres j])

end Aegis
