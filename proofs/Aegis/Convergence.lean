import Aegis.Mechanism
import Aegis.Moments

/-!
# Proposition 1: SGD on flooded gradients

The flood of a gradient `g` (`floodVec ρ σ c g Z ω i = ρ min(1, c/‖g‖) g i + σ Z i ω`, the
matrix flood of the gradient vector) is a biased, scaled gradient plus zero-mean noise:

* `biased_gradient_decomposition`: `E out = k g` with `k = ρ min(1, c/‖g‖)`, bias `(k − 1) g`,
  and `‖E out − g‖ = (1 − k) ‖g‖` for `0 ≤ ρ ≤ 1`, `c ≥ 0`.

The paper's Proposition 1 is this decomposition (it states no rate). Beyond the paper, two
lemmas of the standard biased-SGD analysis (Ajalloeian & Stich 2020, Thm 2), specialised to this
multiplicative bias and Gaussian noise:

* `biased_sgd_descent_step`: if `f` satisfies the descent inequality of an `L`-smooth function
  (`f y ≤ f x + ⟨∇f x, y − x⟩ + L/2 ‖y − x‖²`, an explicit hypothesis), one step
  `x ↦ x − η out` satisfies
  `E f(x − η out) ≤ f x − η k ‖∇f x‖² + L/2 η² (k² ‖∇f x‖² + d σ²)`;
* `telescope_assumed_expected_descent`: a telescoping lemma about real sequences. *Given* the
  per-step recursion `F (t+1) ≤ F t − η k_t Gn t + L/2 η² (k_t² Gn t + d σ²)` as a hypothesis
  (with `L η k_t ≤ 1`), it sums it to
  `η/2 ∑_{t<T} k_t Gn t ≤ F 0 − f* + T · L/2 η² d σ²`.

It is not a convergence theorem for the flooded SGD: the recursion on `F t = E f(x_t)`,
`Gn t = E ‖∇f(x_t)‖²` would follow from `biased_sgd_descent_step` at each fixed `x_t` by the tower
property over the iterates, which is not formalised; the lemma assumes it (`hstep`).

Written without a Lean toolchain at hand: not machine-checked where it was written.
-/

open MeasureTheory ProbabilityTheory
open scoped ENNReal NNReal

noncomputable section

namespace Aegis

variable {Ω : Type*} [MeasurableSpace Ω] {μ : Measure Ω} [IsProbabilityMeasure μ]

/-- **Proposition 1 (bias decomposition).** For the flooded gradient `out = k g + σ Z`,
`k = ρ min(1, c/‖g‖)`: (1) `E out i = k g i`; (2) the bias is `E out i − g i = (k − 1) g i`;
(3) for `0 ≤ ρ ≤ 1` and `c ≥ 0`, `‖E out − g‖ = (1 − k) ‖g‖`. -/
theorem biased_gradient_decomposition {d : ℕ} (ρ σ c : ℝ) (g : Fin d → ℝ)
    (Z : Fin d → Ω → ℝ) (hZ : ∀ i, IsStdNormal μ (Z i)) :
    (∀ i, ∫ ω, floodVec ρ σ c g Z ω i ∂μ = ρ * clipScale c (l2norm g) * g i) ∧
    (∀ i, (∫ ω, floodVec ρ σ c g Z ω i ∂μ) - g i = (ρ * clipScale c (l2norm g) - 1) * g i) ∧
    (0 ≤ ρ → ρ ≤ 1 → 0 ≤ c →
      l2norm (fun i => (∫ ω, floodVec ρ σ c g Z ω i ∂μ) - g i)
        = (1 - ρ * clipScale c (l2norm g)) * l2norm g) := by
  have hE : ∀ i, ∫ ω, floodVec ρ σ c g Z ω i ∂μ = ρ * clipScale c (l2norm g) * g i :=
    fun i => coord_mean (hZ i) (ρ * clipScale c (l2norm g) * g i) σ
  have hB : ∀ i, (∫ ω, floodVec ρ σ c g Z ω i ∂μ) - g i
      = (ρ * clipScale c (l2norm g) - 1) * g i := by
    intro i
    rw [hE i]
    ring
  refine ⟨hE, hB, ?_⟩
  intro hρ0 hρ1 hc
  have hs0 : 0 ≤ clipScale c (l2norm g) := clipScale_nonneg c _ hc (l2norm_nonneg g)
  have hs1 : clipScale c (l2norm g) ≤ 1 := clipScale_le_one c _ hc
  have hk1 : ρ * clipScale c (l2norm g) ≤ 1 := by
    have h := mul_le_mul_of_nonneg_right hρ1 hs0
    linarith [h]
  have h1k : 0 ≤ 1 - ρ * clipScale c (l2norm g) := by linarith
  have hfun : (fun i => (∫ ω, floodVec ρ σ c g Z ω i ∂μ) - g i)
      = fun i => (ρ * clipScale c (l2norm g) - 1) * g i := funext hB
  rw [hfun]
  calc l2norm (fun i => (ρ * clipScale c (l2norm g) - 1) * g i)
      = Real.sqrt (sqNorm (fun i => (ρ * clipScale c (l2norm g) - 1) * g i)) := rfl
    _ = Real.sqrt (((1 - ρ * clipScale c (l2norm g)) * l2norm g) ^ 2) := by
        rw [sqNorm_smul, ← sq_l2norm g]
        first
          | (congr 1; ring)
          | ring_nf
    _ = (1 - ρ * clipScale c (l2norm g)) * l2norm g :=
        Real.sqrt_sq (mul_nonneg h1k (l2norm_nonneg g))

/-- The descent step for a flood with any deterministic coefficient `k`. -/
theorem descent_step_coef {d : ℕ} (f : (Fin d → ℝ) → ℝ) (gradf : (Fin d → ℝ) → Fin d → ℝ)
    (L : ℝ)
    (hsmooth : ∀ x y : Fin d → ℝ,
      f y ≤ f x + ∑ i, gradf x i * (y i - x i) + L / 2 * ∑ i, (y i - x i) ^ 2)
    (k σ η : ℝ) (Z : Fin d → Ω → ℝ) (hZ : ∀ i, IsStdNormal μ (Z i)) (x : Fin d → ℝ)
    (hint : Integrable (fun ω => f (fun i => x i - η * (k * gradf x i + σ * Z i ω))) μ) :
    ∫ ω, f (fun i => x i - η * (k * gradf x i + σ * Z i ω)) ∂μ
      ≤ f x - η * k * sqNorm (gradf x)
        + L / 2 * η ^ 2 * (k ^ 2 * sqNorm (gradf x) + (d : ℝ) * σ ^ 2) := by
  -- the descent inequality at every ω
  have hpt : ∀ ω, f (fun i => x i - η * (k * gradf x i + σ * Z i ω))
      ≤ f x - η * ∑ i, gradf x i * (k * gradf x i + σ * Z i ω)
        + L / 2 * η ^ 2 * ∑ i, (k * gradf x i + σ * Z i ω) ^ 2 := by
    intro ω
    have h' : f (fun i => x i - η * (k * gradf x i + σ * Z i ω))
        ≤ f x + ∑ i, gradf x i * ((x i - η * (k * gradf x i + σ * Z i ω)) - x i)
          + L / 2 * ∑ i, ((x i - η * (k * gradf x i + σ * Z i ω)) - x i) ^ 2 :=
      hsmooth x (fun i => x i - η * (k * gradf x i + σ * Z i ω))
    have h1 : ∑ i, gradf x i * ((x i - η * (k * gradf x i + σ * Z i ω)) - x i)
        = -η * ∑ i, gradf x i * (k * gradf x i + σ * Z i ω) := by
      rw [Finset.mul_sum]
      exact Finset.sum_congr rfl (fun i _ => by ring)
    have h2 : ∑ i, ((x i - η * (k * gradf x i + σ * Z i ω)) - x i) ^ 2
        = η ^ 2 * ∑ i, (k * gradf x i + σ * Z i ω) ^ 2 := by
      rw [Finset.mul_sum]
      exact Finset.sum_congr rfl (fun i _ => by ring)
    rw [h1, h2] at h'
    linarith [h']
  -- integrability of the two random sums
  have hS1 : Integrable (fun ω => ∑ i, gradf x i * (k * gradf x i + σ * Z i ω)) μ :=
    integrable_finset_sum Finset.univ
      (fun i _ => (coord_integrable (hZ i) (k * gradf x i) σ).const_mul (gradf x i))
  have hS2 : Integrable (fun ω => ∑ i, (k * gradf x i + σ * Z i ω) ^ 2) μ :=
    vec_integrable_sq (fun i => k * gradf x i) σ Z hZ
  have hA : Integrable (fun ω => f x - η * ∑ i, gradf x i * (k * gradf x i + σ * Z i ω)) μ :=
    (integrable_const (f x)).sub (hS1.const_mul η)
  have hR : Integrable (fun ω => f x - η * ∑ i, gradf x i * (k * gradf x i + σ * Z i ω)
      + L / 2 * η ^ 2 * ∑ i, (k * gradf x i + σ * Z i ω) ^ 2) μ :=
    hA.add (hS2.const_mul (L / 2 * η ^ 2))
  have hmono : ∫ ω, f (fun i => x i - η * (k * gradf x i + σ * Z i ω)) ∂μ
      ≤ ∫ ω, (f x - η * ∑ i, gradf x i * (k * gradf x i + σ * Z i ω)
        + L / 2 * η ^ 2 * ∑ i, (k * gradf x i + σ * Z i ω) ^ 2) ∂μ :=
    integral_mono hint hR hpt
  -- the expectation of the right-hand side
  have e1 : ∫ ω, (f x - η * ∑ i, gradf x i * (k * gradf x i + σ * Z i ω)
        + L / 2 * η ^ 2 * ∑ i, (k * gradf x i + σ * Z i ω) ^ 2) ∂μ
      = ∫ ω, (f x - η * ∑ i, gradf x i * (k * gradf x i + σ * Z i ω)) ∂μ
        + ∫ ω, L / 2 * η ^ 2 * ∑ i, (k * gradf x i + σ * Z i ω) ^ 2 ∂μ :=
    integral_add hA (hS2.const_mul (L / 2 * η ^ 2))
  have e2 : ∫ ω, (f x - η * ∑ i, gradf x i * (k * gradf x i + σ * Z i ω)) ∂μ
      = ∫ _ω, f x ∂μ - ∫ ω, η * ∑ i, gradf x i * (k * gradf x i + σ * Z i ω) ∂μ :=
    integral_sub (integrable_const (f x)) (hS1.const_mul η)
  have e3 : ∫ _ω, f x ∂μ = f x := integral_const_prob (μ := μ) (f x)
  have e4 : ∫ ω, η * ∑ i, gradf x i * (k * gradf x i + σ * Z i ω) ∂μ
      = η * ∫ ω, ∑ i, gradf x i * (k * gradf x i + σ * Z i ω) ∂μ :=
    flood_integral_cmul (μ := μ) η (fun ω => ∑ i, gradf x i * (k * gradf x i + σ * Z i ω))
  have e5 : ∫ ω, L / 2 * η ^ 2 * ∑ i, (k * gradf x i + σ * Z i ω) ^ 2 ∂μ
      = L / 2 * η ^ 2 * ∫ ω, ∑ i, (k * gradf x i + σ * Z i ω) ^ 2 ∂μ :=
    flood_integral_cmul (μ := μ) (L / 2 * η ^ 2) (fun ω => ∑ i, (k * gradf x i + σ * Z i ω) ^ 2)
  have e6 : ∫ ω, ∑ i, gradf x i * (k * gradf x i + σ * Z i ω) ∂μ = k * sqNorm (gradf x) := by
    have hint1 : ∀ i ∈ (Finset.univ : Finset (Fin d)),
        Integrable (fun ω => gradf x i * (k * gradf x i + σ * Z i ω)) μ :=
      fun i _ => (coord_integrable (hZ i) (k * gradf x i) σ).const_mul (gradf x i)
    have hswap : ∫ ω, ∑ i, gradf x i * (k * gradf x i + σ * Z i ω) ∂μ
        = ∑ i, ∫ ω, gradf x i * (k * gradf x i + σ * Z i ω) ∂μ :=
      integral_finset_sum Finset.univ hint1
    have hterm : ∀ i, ∫ ω, gradf x i * (k * gradf x i + σ * Z i ω) ∂μ
        = gradf x i * (k * gradf x i) := by
      intro i
      have hc : ∫ ω, gradf x i * (k * gradf x i + σ * Z i ω) ∂μ
          = gradf x i * ∫ ω, (k * gradf x i + σ * Z i ω) ∂μ :=
        flood_integral_cmul (μ := μ) (gradf x i) (fun ω => k * gradf x i + σ * Z i ω)
      rw [hc, coord_mean (hZ i) (k * gradf x i) σ]
    have hsum : ∑ i, ∫ ω, gradf x i * (k * gradf x i + σ * Z i ω) ∂μ
        = ∑ i, gradf x i * (k * gradf x i) :=
      Finset.sum_congr rfl (fun i _ => hterm i)
    have hfac : ∑ i, gradf x i * (k * gradf x i) = k * sqNorm (gradf x) := by
      unfold sqNorm
      rw [Finset.mul_sum]
      exact Finset.sum_congr rfl (fun i _ => by ring)
    rw [hswap, hsum, hfac]
  have e7 : ∫ ω, ∑ i, (k * gradf x i + σ * Z i ω) ^ 2 ∂μ
      = k ^ 2 * sqNorm (gradf x) + (d : ℝ) * σ ^ 2 := by
    have h : ∫ ω, ∑ i, (k * gradf x i + σ * Z i ω) ^ 2 ∂μ
        = (∑ i, (k * gradf x i) ^ 2) + (d : ℝ) * σ ^ 2 :=
      vec_second_moment (fun i => k * gradf x i) σ Z hZ
    have hs : ∑ i, (k * gradf x i) ^ 2 = k ^ 2 * sqNorm (gradf x) := sqNorm_smul k (gradf x)
    rw [h, hs]
  rw [e1, e2, e3, e4, e5, e6, e7] at hmono
  linarith [hmono]

/-- **One descent step** (beyond the paper, which states no rate). Let `f` satisfy the descent
inequality of an `L`-smooth function with gradient `gradf`. One SGD step on the flooded gradient,
`x ↦ x − η out` with `out = floodVec ρ σ c (∇f x) Z`, satisfies
`E f(x − η out) ≤ f x − η k ‖∇f x‖² + L/2 η² (k² ‖∇f x‖² + d σ²)`, `k = ρ min(1, c/‖∇f x‖)`. -/
theorem biased_sgd_descent_step {d : ℕ} (f : (Fin d → ℝ) → ℝ)
    (gradf : (Fin d → ℝ) → Fin d → ℝ) (L : ℝ)
    (hsmooth : ∀ x y : Fin d → ℝ,
      f y ≤ f x + ∑ i, gradf x i * (y i - x i) + L / 2 * ∑ i, (y i - x i) ^ 2)
    (ρ σ c η : ℝ) (Z : Fin d → Ω → ℝ) (hZ : ∀ i, IsStdNormal μ (Z i)) (x : Fin d → ℝ)
    (hint : Integrable (fun ω => f (fun i => x i - η * floodVec ρ σ c (gradf x) Z ω i)) μ) :
    ∫ ω, f (fun i => x i - η * floodVec ρ σ c (gradf x) Z ω i) ∂μ
      ≤ f x - η * (ρ * clipScale c (l2norm (gradf x))) * sqNorm (gradf x)
        + L / 2 * η ^ 2 * ((ρ * clipScale c (l2norm (gradf x))) ^ 2 * sqNorm (gradf x)
          + (d : ℝ) * σ ^ 2) :=
  descent_step_coef f gradf L hsmooth (ρ * clipScale c (l2norm (gradf x))) σ η Z hZ x hint

/-- Telescoping a descent recursion `a (t+1) ≤ a t − α g t + β`. -/
theorem descent_telescope (a g : ℕ → ℝ) (α β : ℝ)
    (hstep : ∀ t, a (t + 1) ≤ a t - α * g t + β) :
    ∀ T : ℕ, α * ∑ t ∈ Finset.range T, g t ≤ a 0 - a T + (T : ℝ) * β := by
  intro T
  induction T with
  | zero => simp
  | succ T ih =>
    rw [Finset.sum_range_succ]
    have hT := hstep T
    push_cast
    linarith [ih, hT]

/-- **Telescoping an assumed expected-descent recursion** (beyond the paper; not a convergence
theorem). For real sequences `F`, `Gn`, `k` with `0 ≤ k t`, `L η k t ≤ 1`, `0 ≤ Gn t`: *if*
`F (t+1) ≤ F t − η k t Gn t + L/2 η² (k t² Gn t + d σ²)` for every `t` (the hypothesis `hstep`,
which is what `biased_sgd_descent_step` would give for `F t = E f(x_t)`, `Gn t = E ‖∇f(x_t)‖²`
after the tower property, not formalised here) and `f* ≤ F T`, then
`η/2 ∑_{t<T} k t · Gn t ≤ F 0 − f* + T · L/2 η² d σ²`. -/
theorem telescope_assumed_expected_descent (T d : ℕ) (F Gn k : ℕ → ℝ) (η L σ fstar : ℝ)
    (hη : 0 ≤ η)
    (hk : ∀ t, 0 ≤ k t) (hkL : ∀ t, L * η * k t ≤ 1) (hG : ∀ t, 0 ≤ Gn t)
    (hstep : ∀ t, F (t + 1)
      ≤ F t - η * k t * Gn t + L / 2 * η ^ 2 * (k t ^ 2 * Gn t + (d : ℝ) * σ ^ 2))
    (hlow : fstar ≤ F T) :
    η / 2 * ∑ t ∈ Finset.range T, k t * Gn t
      ≤ F 0 - fstar + (T : ℝ) * (L / 2 * η ^ 2 * ((d : ℝ) * σ ^ 2)) := by
  have hhalf : ∀ t, F (t + 1)
      ≤ F t - η / 2 * (k t * Gn t) + L / 2 * η ^ 2 * ((d : ℝ) * σ ^ 2) := by
    intro t
    have h0 : 0 ≤ η * k t * Gn t := mul_nonneg (mul_nonneg hη (hk t)) (hG t)
    have hp : η * k t * Gn t * (L * η * k t) ≤ η * k t * Gn t * 1 :=
      mul_le_mul_of_nonneg_left (hkL t) h0
    have hs := hstep t
    nlinarith [hp, hs]
  have htel := descent_telescope F (fun t => k t * Gn t) (η / 2)
    (L / 2 * η ^ 2 * ((d : ℝ) * σ ^ 2)) hhalf T
  have htel' : η / 2 * ∑ t ∈ Finset.range T, k t * Gn t
      ≤ F 0 - F T + (T : ℝ) * (L / 2 * η ^ 2 * ((d : ℝ) * σ ^ 2)) := htel
  linarith [htel', hlow]

end Aegis
