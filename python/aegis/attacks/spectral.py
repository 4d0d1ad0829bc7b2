"""Adaptive denoiser for flooded gradients: span attacks on what survives the Marchenko–Pastur edge.

A flooded matrix is rho*G + sigma*Z with G of rank N (one row-space direction per input vector). The
singular values of sigma*Z fill a bulk that ends at sigma*(sqrt(m) + sqrt(n)); signal directions strong
enough to stick out above that edge keep (a perturbed copy of) their span direction. So: estimate sigma
from the median singular value (MP median law), keep the directions above the edge, and run the span
tests on that subspace. Residuals of true inputs are no longer ~0, so candidates are accepted as robust
low outliers of their pool instead of by an absolute threshold.

Channel: the first two blocks' attention projections when their gradients are present and carry
signal above the edge (the DAGER pipeline), else the first block's MLP input projection (the
``mlp_span`` pipeline).
"""
from __future__ import annotations

from torch import Tensor, nn

from .dager import attention_attack
from .mlp_span import mlp_attack
from .span import Outlier, layer_spans


def spectral(
    model: nn.Module,
    grads: dict[str, Tensor],
    tokenizer,
    batch_size: int,
    *,
    z: float = 6.0,
    max_len: int = 48,
    search_budget: int = 4_000,
) -> list[str]:
    """Reconstruct up to ``batch_size`` texts from noisy attention or MLP gradients.

    ``z``: how many robust standard deviations below its pool a candidate's log-residual must lie.
    ``max_len``: decoding stops there (noise can keep weak extensions alive; each step costs a scan).
    ``search_budget``: sequences scored per encoder sentence search. Noise never lets the search stop
    early, so it always spends the budget; on the embedded encoder (B = 4, first round) 4000 matched
    20000 (ROUGE-1 0.77 vs 0.78 undefended, 0.41 vs 0.39 under prune-50) at a third of the time."""
    attention = layer_spans(model, grads, "attention", (0, 1), "mp")
    if all(span is not None for span, _ in attention):
        # Block 1's token filter stays wide (absolute positions blur between nearby positions); block 2
        # picks the continuation.
        tokens, sequences = Outlier(z, top=max(8, 4 * batch_size)), Outlier(z, top=batch_size)
        return attention_attack(
            model, tokenizer, batch_size, attention, tokens, sequences, max_len, search_budget, beam=2 * batch_size
        )
    [(span, probe)] = layer_spans(model, grads, "mlp", (0,), "mp")
    # Each prefix keeps its few best next tokens; the beam stays near B so noise cannot fan out.
    rule = Outlier(z, top=2)
    return mlp_attack(model, tokenizer, batch_size, span, probe, rule, max_len, beam=2 * batch_size)
