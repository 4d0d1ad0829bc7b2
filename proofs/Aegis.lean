import Aegis.Channel1
import Aegis.Channel2
import Aegis.Channel3
import Aegis.Convergence

/-!
# AEGIS: Lean 4 + Mathlib formalisation

Root module of the `Aegis` library (sources under `proofs/`).

| paper | Lean |
|---|---|
| Theorem 1 (channel 1, frozen attention) | `Aegis.channel1_exported_grad_zero`, `Aegis.channel1_residual_eq_one` |
| Theorem 2 (channel 2, row flood) | `Aegis.channel2_second_moment_inactive`, `Aegis.channel2_second_moment_active`, `Aegis.channel2_relative_inflation`, `Aegis.channel2_rows_nonzero_ae` |
| Theorem 3 (channel 3, matrix flood) | `Aegis.channel3_decomposition`, `Aegis.channel3_frobenius_second_moment`, `Aegis.channel3_relative_inflation` |
| Proposition 1 (biased gradient) | `Aegis.biased_gradient_decomposition` |

See `proofs/README.md`. Check with `lake exe cache get && lake build`.
-/
