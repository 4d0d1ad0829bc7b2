import Mathlib

/-!
# Channel 1: DAGER's span test on frozen attention (Theorem 1)

DAGER reads the gradient of the first block's attention input projection `W` (`m × n`, rows in
`ℝⁿ`, the block's input space) and tests a candidate input `v` by its residual against the row
span: `‖v − P v‖ / ‖v‖`, `P` the orthogonal projection onto `span(rows)`. A batch token passes
when its residual is about `0`.

**Why the test works on a trainable layer** (`channel1_trainable_rows_in_input_span`,
`channel1_trainable_inputs_in_span`): for `z_t = W u_t`, back-propagation gives
`∂L/∂W = ∑_t δ_t u_tᵀ` (`linearWeightGrad`), so every gradient row lies in `span{u_t}`, and when
`δ` has a left inverse every input `u_t` lies in the span of the gradient rows.

**What AEGIS changes.** It freezes the attention parameters: the client's optimiser moves only
trainable coordinates (`maskedStep`), for any number of local steps and any update rule
(`localTrain`: flooded gradients, momentum, …). The server reads the first block's attention
gradient from the round's model update `θ₀ − θ_T` (`exportedGrad`; FedSGD is `T = 1`, `η = 1`,
where this is the exported update direction itself).

* `channel1_exported_grad_zero`: with the attention coordinates frozen, that gradient is zero
  after any local training (`localTrain_frozen`, by induction on the steps);
* `channel1_residual_eq_one`: hence every projection onto its row span is `0` and every non-zero
  candidate has residual exactly `1` (`channel1_residual_sq_eq`: squared form);
* `channel1_no_candidate_passes`: no candidate passes the span test at any threshold `≤ 1`.

Vectors are `Fin n → ℝ`; norms are `Real.sqrt (∑ j, x j ^ 2)`.
Written without a Lean toolchain at hand: not machine-checked where it was written.
-/

noncomputable section

namespace Aegis

/-! ## The span test on a trainable linear layer -/

/-- Back-propagation through `z_t = W u_t` (`N` inputs `u_t ∈ ℝⁿ`, output gradients
`δ_t ∈ ℝᵐ`): `(∂L/∂W) i j = ∑_t δ_t i · u_t j`. -/
def linearWeightGrad {N m n : ℕ} (δ : Fin N → Fin m → ℝ) (u : Fin N → Fin n → ℝ)
    (i : Fin m) (j : Fin n) : ℝ :=
  ∑ t, δ t i * u t j

/-- Row `i` of the weight gradient is `∑_t δ_t i • u_t`. -/
theorem linearWeightGrad_row {N m n : ℕ} (δ : Fin N → Fin m → ℝ) (u : Fin N → Fin n → ℝ)
    (i : Fin m) : linearWeightGrad δ u i = ∑ t, δ t i • u t := by
  funext j
  first
    | (simp [linearWeightGrad, Finset.sum_apply, smul_eq_mul]; done)
    | (rw [Finset.sum_apply]; rfl)

/-- **DAGER's lemma (soundness of the test).** Every row of a trainable linear layer's weight
gradient lies in the span of the layer's inputs. -/
theorem channel1_trainable_rows_in_input_span {N m n : ℕ} (δ : Fin N → Fin m → ℝ)
    (u : Fin N → Fin n → ℝ) (i : Fin m) :
    linearWeightGrad δ u i ∈ Submodule.span ℝ (Set.range u) := by
  rw [linearWeightGrad_row]
  have hmem : ∀ t ∈ (Finset.univ : Finset (Fin N)),
      δ t i • u t ∈ Submodule.span ℝ (Set.range u) :=
    fun t _ => Submodule.smul_mem _ _ (Submodule.subset_span (Set.mem_range_self t))
  first
    | exact Submodule.sum_mem _ hmem
    | exact sum_mem hmem
    | exact Submodule.sum_mem hmem

/-- **DAGER's lemma (completeness of the test).** If the output gradients `δ` have a left
inverse `Λ` (`∑ᵢ Λ s i δ t i = [t = s]`, the generic case with fewer inputs than outputs), every
input `u_s` lies in the span of the gradient rows: each batch token passes the test. -/
theorem channel1_trainable_inputs_in_span {N m n : ℕ} (δ : Fin N → Fin m → ℝ)
    (u : Fin N → Fin n → ℝ) (Λ : Fin N → Fin m → ℝ)
    (hΛ : ∀ s t, ∑ i, Λ s i * δ t i = if t = s then 1 else 0) (s : Fin N) :
    u s ∈ Submodule.span ℝ (Set.range (linearWeightGrad δ u)) := by
  have hcomb : u s = ∑ i, Λ s i • linearWeightGrad δ u i := by
    funext j
    have e1 : (∑ i, Λ s i • linearWeightGrad δ u i) j = ∑ i, Λ s i * ∑ t, δ t i * u t j := by
      first
        | (simp [Finset.sum_apply, linearWeightGrad, smul_eq_mul]; done)
        | (rw [Finset.sum_apply]; rfl)
    have e2 : ∑ i, Λ s i * ∑ t, δ t i * u t j = ∑ i, ∑ t, Λ s i * (δ t i * u t j) :=
      Finset.sum_congr rfl (fun i _ => by rw [Finset.mul_sum])
    have e3 : ∑ i, ∑ t, Λ s i * (δ t i * u t j) = ∑ t, ∑ i, Λ s i * (δ t i * u t j) :=
      Finset.sum_comm
    have e4 : ∀ t, ∑ i, Λ s i * (δ t i * u t j) = (∑ i, Λ s i * δ t i) * u t j := by
      intro t
      rw [Finset.sum_mul]
      exact Finset.sum_congr rfl (fun i _ => by ring)
    have e5 : ∑ t, ∑ i, Λ s i * (δ t i * u t j) = ∑ t, (if t = s then (1 : ℝ) else 0) * u t j :=
      Finset.sum_congr rfl (fun t _ => by rw [e4 t, hΛ s t])
    have e6 : ∑ t, (if t = s then (1 : ℝ) else 0) * u t j = u s j := by
      have h : ∀ t, (if t = s then (1 : ℝ) else 0) * u t j = if t = s then u t j else 0 := by
        intro t
        split_ifs <;> ring
      have e6a : ∑ t, (if t = s then (1 : ℝ) else 0) * u t j = ∑ t, (if t = s then u t j else 0) :=
        Finset.sum_congr rfl (fun t _ => h t)
      rw [e6a]
      first
        | (simp; done)
        | (rw [Finset.sum_ite_eq']; simp)
        | (rw [Finset.sum_ite_eq]; simp)
    rw [e1, e2, e3, e5, e6]
  rw [hcomb]
  have hmem : ∀ i ∈ (Finset.univ : Finset (Fin m)),
      Λ s i • linearWeightGrad δ u i ∈ Submodule.span ℝ (Set.range (linearWeightGrad δ u)) :=
    fun i _ => Submodule.smul_mem _ _ (Submodule.subset_span (Set.mem_range_self i))
  first
    | exact Submodule.sum_mem _ hmem
    | exact sum_mem hmem
    | exact Submodule.sum_mem hmem

/-! ## Frozen attention under local training -/

/-- One optimiser step that moves only trainable coordinates:
`θ' k = θ k − η u k` if `k` is trainable, `θ k` otherwise. -/
def maskedStep {ι : Type*} (trainable : ι → Bool) (η : ℝ) (u θ : ι → ℝ) (k : ι) : ℝ :=
  if trainable k = true then θ k - η * u k else θ k

/-- `T` local steps from `θ₀`; step `t` uses step size `η t` and the update direction
`upd t θ_t` computed from the current parameters (a flooded gradient, with momentum, …). -/
def localTrain {ι : Type*} (trainable : ι → Bool) (η : ℕ → ℝ)
    (upd : ℕ → (ι → ℝ) → ι → ℝ) (θ₀ : ι → ℝ) : ℕ → ι → ℝ
  | 0 => θ₀
  | t + 1 => maskedStep trainable (η t) (upd t (localTrain trainable η upd θ₀ t))
      (localTrain trainable η upd θ₀ t)

/-- What the server reads as the gradient of an `m × n` weight with coordinates `coord`:
the round's update `θ₀ − θ_T` on those coordinates (FedAvg's pseudo-gradient, up to the positive
factor `1 / (η T)` that no span test sees; FedSGD is `T = 1`, `η = 1`). -/
def exportedGrad {ι : Type*} {m n : ℕ} (θ₀ θT : ι → ℝ) (coord : Fin m → Fin n → ι)
    (i : Fin m) (j : Fin n) : ℝ :=
  θ₀ (coord i j) - θT (coord i j)

/-- A frozen coordinate never moves, whatever the updates. -/
theorem localTrain_frozen {ι : Type*} (trainable : ι → Bool) (η : ℕ → ℝ)
    (upd : ℕ → (ι → ℝ) → ι → ℝ) (θ₀ : ι → ℝ) (k : ι) (hk : trainable k = false) :
    ∀ t, localTrain trainable η upd θ₀ t k = θ₀ k := by
  intro t
  induction t with
  | zero =>
    first
      | rfl
      | simp [localTrain]
  | succ t ih =>
    have hne : ¬ (trainable k = true) := by
      first
        | (rw [hk]; exact Bool.false_ne_true)
        | simp [hk]
    have hstep : localTrain trainable η upd θ₀ (t + 1) k
        = maskedStep trainable (η t) (upd t (localTrain trainable η upd θ₀ t))
            (localTrain trainable η upd θ₀ t) k := by
      first
        | rfl
        | simp [localTrain]
    have hmask : maskedStep trainable (η t) (upd t (localTrain trainable η upd θ₀ t))
        (localTrain trainable η upd θ₀ t) k = localTrain trainable η upd θ₀ t k := by
      unfold maskedStep
      exact if_neg hne
    rw [hstep, hmask, ih]

/-- **Theorem 1 (frozen attention exports nothing).** If every coordinate of the first block's
attention input projection is frozen, the gradient the server reads for it is the zero matrix
after any number of local steps with any updates (flooded gradients included). -/
theorem channel1_exported_grad_zero {ι : Type*} {m n : ℕ} (trainable : ι → Bool)
    (η : ℕ → ℝ) (upd : ℕ → (ι → ℝ) → ι → ℝ) (θ₀ : ι → ℝ) (coord : Fin m → Fin n → ι)
    (hfrozen : ∀ i j, trainable (coord i j) = false) (T : ℕ) :
    ∀ i j, exportedGrad θ₀ (localTrain trainable η upd θ₀ T) coord i j = 0 := by
  intro i j
  have h := localTrain_frozen trainable η upd θ₀ (coord i j) (hfrozen i j) T
  show θ₀ (coord i j) - localTrain trainable η upd θ₀ T (coord i j) = 0
  rw [h]
  ring

/-- The span of the rows of a zero matrix is trivial. -/
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

/-- Squared form of Theorem 1: the residual energy of every candidate is its whole energy. -/
theorem channel1_residual_sq_eq {ι : Type*} {m n : ℕ} (trainable : ι → Bool)
    (η : ℕ → ℝ) (upd : ℕ → (ι → ℝ) → ι → ℝ) (θ₀ : ι → ℝ) (coord : Fin m → Fin n → ι)
    (hfrozen : ∀ i j, trainable (coord i j) = false) (T : ℕ)
    (P : (Fin n → ℝ) → (Fin n → ℝ))
    (hP : ∀ w, P w ∈ Submodule.span ℝ
      (Set.range (exportedGrad θ₀ (localTrain trainable η upd θ₀ T) coord)))
    (v : Fin n → ℝ) :
    ∑ j, (v j - P v j) ^ 2 = ∑ j, v j ^ 2 := by
  have hPv : P v = 0 :=
    channel1_projection_zero _ (channel1_exported_grad_zero trainable η upd θ₀ coord hfrozen T)
      (P v) (hP v)
  have hres : ∀ j, v j - P v j = v j := by
    intro j
    rw [hPv]
    first
      | (simp; done)
      | (rw [Pi.zero_apply, sub_zero])
  exact Finset.sum_congr rfl (fun j _ => by rw [hres j])

/-- **Theorem 1 (DAGER's span test fails).** With the first block's attention frozen, for any
local training and any projection `P` onto the row span of the gradient the server reads (in
particular DAGER's orthogonal projection), every non-zero candidate input `v` has residual
`‖v − P v‖ / ‖v‖ = 1`. -/
theorem channel1_residual_eq_one {ι : Type*} {m n : ℕ} (trainable : ι → Bool)
    (η : ℕ → ℝ) (upd : ℕ → (ι → ℝ) → ι → ℝ) (θ₀ : ι → ℝ) (coord : Fin m → Fin n → ι)
    (hfrozen : ∀ i j, trainable (coord i j) = false) (T : ℕ)
    (P : (Fin n → ℝ) → (Fin n → ℝ))
    (hP : ∀ w, P w ∈ Submodule.span ℝ
      (Set.range (exportedGrad θ₀ (localTrain trainable η upd θ₀ T) coord)))
    (v : Fin n → ℝ) (hv : v ≠ 0) :
    Real.sqrt (∑ j, (v j - P v j) ^ 2) / Real.sqrt (∑ j, v j ^ 2) = 1 := by
  have hsum : ∑ j, (v j - P v j) ^ 2 = ∑ j, v j ^ 2 :=
    channel1_residual_sq_eq trainable η upd θ₀ coord hfrozen T P hP v
  obtain ⟨j0, hj0⟩ := Function.ne_iff.mp hv
  have hvj0 : v j0 ≠ 0 := by
    first
      | exact hj0
      | simpa using hj0
  have hpos1 : 0 < v j0 * v j0 := mul_self_pos.mpr hvj0
  have hle : v j0 ^ 2 ≤ ∑ j, v j ^ 2 := by
    first
      | exact Finset.single_le_sum (f := fun j => v j ^ 2) (fun j _ => sq_nonneg (v j))
          (Finset.mem_univ j0)
      | exact Finset.single_le_sum (fun j _ => sq_nonneg (v j)) (Finset.mem_univ j0)
  have hSpos : 0 < ∑ j, v j ^ 2 := by nlinarith [hpos1, hle]
  have hsqrt_ne : Real.sqrt (∑ j, v j ^ 2) ≠ 0 := (Real.sqrt_pos.mpr hSpos).ne'
  rw [hsum]
  exact div_self hsqrt_ne

/-- **Theorem 1 (no candidate passes).** Under the same hypotheses, no non-zero candidate passes
the span test at any threshold `thr ≤ 1` (DAGER uses `thr = 10⁻⁵` for tokens, `10⁻³` for
sequences). -/
theorem channel1_no_candidate_passes {ι : Type*} {m n : ℕ} (trainable : ι → Bool)
    (η : ℕ → ℝ) (upd : ℕ → (ι → ℝ) → ι → ℝ) (θ₀ : ι → ℝ) (coord : Fin m → Fin n → ι)
    (hfrozen : ∀ i j, trainable (coord i j) = false) (T : ℕ)
    (P : (Fin n → ℝ) → (Fin n → ℝ))
    (hP : ∀ w, P w ∈ Submodule.span ℝ
      (Set.range (exportedGrad θ₀ (localTrain trainable η upd θ₀ T) coord)))
    (thr : ℝ) (hthr : thr ≤ 1) (v : Fin n → ℝ) (hv : v ≠ 0) :
    ¬ (Real.sqrt (∑ j, (v j - P v j) ^ 2) / Real.sqrt (∑ j, v j ^ 2) < thr) := by
  rw [channel1_residual_eq_one trainable η upd θ₀ coord hfrozen T P hP v hv]
  exact not_lt.mpr hthr

end Aegis
