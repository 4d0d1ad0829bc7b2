import Aegis.Deps
import Aegis.Model
import Aegis.Mechanism
import Aegis.Moments
import Aegis.Channel1
import Aegis.Channel2
import Aegis.Channel3
import Aegis.Convergence

/-!
# AEGIS: Lean 4 + Mathlib formalisation

Root module of the `Aegis` library (sources under `proofs/`). `Model` is the probability model
of the noise (`μ.map Z = gaussianReal 0 1`), `Mechanism` the shipped floods and the paper's batch
calibration, `Moments` the flood moments under the model, `Deps` a `#check` of every external
name.

| paper | Lean |
|---|---|
| Theorem 1 (channel 1, frozen attention) | `Aegis.channel1_exported_grad_zero`, `Aegis.channel1_residual_eq_one`, `Aegis.channel1_no_candidate_passes` |
| Theorem 2 (channel 2, rows flood) | `Aegis.channel2_second_moment_active`, `Aegis.channel2_second_moment_inactive`, `Aegis.channel2_relative_inflation`, `Aegis.channel2_rows_nonzero_ae` |
| Theorem 3 (channel 3, matrix flood) | `Aegis.channel3_decomposition`, `Aegis.channel3_frobenius_second_moment`, `Aegis.channel3_relative_inflation` |
| Proposition 1 (biased SGD) | `Aegis.biased_gradient_decomposition`, `Aegis.biased_sgd_descent_step`, `Aegis.biased_sgd_bound` |

See `proofs/README.md`. Not machine-checked where it was written; check with
`lake exe cache get && lake build`.
-/
