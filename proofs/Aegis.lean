import Aegis.Deps
import Aegis.Model
import Aegis.Mechanism
import Aegis.Moments
import Aegis.Channel1
import Aegis.Channel2
import Aegis.Channel3
import Aegis.Convergence
import Aegis.Divergence

/-!
# AEGIS: Lean 4 + Mathlib formalisation

Root module of the `Aegis` library (sources under `proofs/`). `Model` is the probability model
of the noise (`μ.map Z = gaussianReal 0 1`), `Mechanism` the shipped floods and the paper's batch
calibration, `Moments` the flood moments under the model, `Divergence` what the paper's
"indistinguishable rows" can mean (the per-row KL divergence), `Deps` a `#check` of every
external name.

| paper | Lean (faithful; corollaries and beyond-the-paper results in `proofs/README.md`) |
|---|---|
| Theorem 1 (channel 1, frozen attention) | `Aegis.channel1_exported_grad_zero`, `Aegis.channel1_residual_eq_one`, `Aegis.channel1_no_candidate_passes` |
| Theorem 2 (channel 2, rows flood) | (1)–(2) `Aegis.channel2_second_moment_active`, `Aegis.channel2_second_moment_inactive`, `Aegis.channel2_second_moment_batch`, `Aegis.channel2_rows_nonzero_ae`; (3) `Aegis.channel2_relative_inflation` |
| Theorem 3 (channel 3, matrix flood) | (1) `Aegis.channel3_decomposition_batch`, `Aegis.channel3_bias_frobenius_batch`; (2) `Aegis.channel3_frobenius_second_moment_batch`; (3) `Aegis.channel3_relative_inflation` |
| Proposition 1 (flooded gradient) | `Aegis.biased_gradient_decomposition` |
| "indistinguishable rows" | `Aegis.row_expected_llr`, `Aegis.kl_gaussianReal_same_var` (`Divergence.lean`) |

See `proofs/README.md`. Not machine-checked: no Lean toolchain runs where it was written; check
with `lake exe cache get && lake build`.
-/
