import Mathlib

/-!
# Every external name the proofs use without a fallback

A Mathlib rename then fails here, in one place, with the old name in the error. Names used only
inside `first | … | …` alternatives (because they moved between Mathlib versions) are listed in
the comment at the end instead: `#check` of a name missing at the pinned tag would fail the build
even though the proofs have an alternative for it.

Written without a Lean toolchain at hand: not machine-checked where it was written.
-/

open MeasureTheory ProbabilityTheory

-- measure theory and the Gaussian (Model, Moments)
#check @ProbabilityTheory.gaussianReal
#check @ProbabilityTheory.variance
#check @MeasureTheory.Measure.map
#check @MeasureTheory.Measure.map_apply
#check @MeasureTheory.IsProbabilityMeasure
#check @MeasureTheory.MemLp
#check @MeasureTheory.MemLp.integrable_sq
#check @MeasureTheory.Integrable.comp_measurable
#check @MeasureTheory.integral_map
#check @MeasureTheory.integrable_const
#check @MeasureTheory.Integrable.add
#check @MeasureTheory.Integrable.sub
#check @MeasureTheory.Integrable.const_mul
#check @MeasureTheory.integrable_finset_sum
#check @MeasureTheory.integral_add
#check @MeasureTheory.integral_sub
#check @MeasureTheory.integral_finset_sum
#check @MeasureTheory.integral_mono
#check @MeasureTheory.ae_iff
#check @MeasureTheory.ae_all_iff
#check @Measurable.aemeasurable
#check @Measurable.aestronglyMeasurable
#check @measurable_id'
#check @measurableSet_singleton

-- the Gaussian density and the KL identity (Model, Divergence)
#check @ProbabilityTheory.gaussianPDFReal
#check @Real.log_exp
#check @Real.exp_sub
#check @Real.pi_pos
#check @mul_div_mul_left
#check @inv_ne_zero
#check @NNReal.coe_zero
#check @pow_ne_zero
#check @le_of_le_of_eq

-- finite sums
#check @Finset.sum_congr
#check @Finset.mul_sum
#check @Finset.sum_mul
#check @Finset.sum_add_distrib
#check @Finset.sum_comm
#check @Finset.sum_nonneg
#check @Finset.sum_le_sum
#check @Finset.single_le_sum
#check @Finset.sum_const
#check @Finset.sum_range_succ
#check @Finset.sum_apply
#check @Finset.mem_filter
#check @Finset.mem_univ
#check @Finset.card_pos
#check @Finset.exists_max_image
#check @nsmul_eq_mul

-- real arithmetic
#check @Real.sqrt
#check @Real.sqrt_nonneg
#check @Real.sq_sqrt
#check @Real.sqrt_sq
#check @Real.sqrt_pos
#check @Real.sqrt_mul_self
#check @mul_inv_cancel₀
#check @inv_mul_cancel₀
#check @inv_nonneg
#check @div_eq_mul_inv
#check @div_pos
#check @div_nonneg
#check @div_self
#check @mul_pos
#check @mul_nonneg
#check @mul_self_pos
#check @mul_self_le_mul_self
#check @mul_le_mul_of_nonneg_left
#check @mul_le_mul_of_nonneg_right
#check @abs_nonneg
#check @abs_pos
#check @abs_mul_abs_self
#check @sq_nonneg
#check @pow_pos
#check @sub_pos
#check @neg_nonneg
#check @not_lt
#check @lt_irrefl
#check @Nat.cast_nonneg

-- linear algebra and logic (Channel1, Mechanism)
#check @Submodule.span
#check @Submodule.span_eq_bot
#check @Submodule.mem_bot
#check @Submodule.subset_span
#check @Submodule.smul_mem
#check @Set.mem_range_self
#check @Function.ne_iff
#check @Classical.choose
#check @Classical.choose_spec
#check @dif_pos
#check @dif_neg
#check @if_pos
#check @if_neg
#check @Bool.false_ne_true

/-
Hedged names (each used only as one alternative of a `first`):
  memLp_id_gaussianReal, memLp_id_gaussianReal', MemLp.integrable, integral_id_gaussianReal,
  variance_fun_id_gaussianReal, variance_id_gaussianReal, variance_of_integral_eq_zero,
  variance_eq_integral, variance_def', gaussianReal_absolutelyContinuous, Real.volume_singleton,
  noAtoms_gaussianReal, nullSingletonClass_gaussianReal, measure_singleton,
  integral_const_mul, integral_mul_left, integral_smul, integral_const,
  le_of_mul_le_mul_right, mul_le_mul_right, Real.sqrt_le_sqrt, Fin.pos,
  Submodule.sum_mem, sum_mem, Finset.sum_ite_eq, Finset.sum_ite_eq', Pi.zero_apply,
  NNReal.coe_pos, pos_iff_ne_zero, NNReal.coe_eq_zero, memLp_one_iff_integrable,
  ENNReal.one_ne_top, Finset.sum_div.
-/
