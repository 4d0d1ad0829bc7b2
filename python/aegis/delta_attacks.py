"""A round's delta as the gradient attacks of ``aegis.attacks`` read it (the server's side of delta mode).

The attacks take ``{parameter name: gradient}`` of the model they are given. A delta of full matrices is
one already: after one SGD step it is ``-lr x`` the gradient (``pseudo_gradient``), and over many steps
every row of an MLP input projection's delta still lies in the span of the inputs it saw (the span
attacks need only that). A LoRA delta is read through its factors: ``lora_A`` (r x d_in) moves along
``B^T delta_t u_t^T``, so its row space is the span of the adapted layer's inputs, of dimension at most
min(r, tokens) (DAGER's LoRA setting, Petrov et al. 2024, at r = 256). ``span_view`` hands the span
attacks that factor under the adapted weight's name, and ``attacker_model`` the plain model (adapters
merged) at the round's snapshot, whose layer inputs the attacks compute.
"""
from __future__ import annotations

import copy

from torch import Tensor, nn

_PEFT_PREFIX = "base_model.model."
_LORA_A, _LORA_B = ".lora_A.", ".lora_B."


def attacker_model(model: nn.Module) -> nn.Module:
    """A plain copy of ``model`` as it is now (take it at the round's start): peft adapters merged."""
    clone = copy.deepcopy(model)
    merge = getattr(clone, "merge_and_unload", None)
    return merge() if callable(merge) else clone


def span_view(delta: dict[str, Tensor]) -> dict[str, Tensor]:
    """The delta keyed as the plain model's weights: each LoRA ``A`` factor under the adapted weight's
    name (its row space is that layer's input span), ``B`` factors left out (their rows live in the r
    adapter dimensions, not the layer's input space), other tensors under their plain names."""
    out = {}
    for name, value in delta.items():
        plain = name.removeprefix(_PEFT_PREFIX)
        if _LORA_B in plain:
            continue
        if _LORA_A in plain:
            plain = plain.split(_LORA_A)[0] + ".weight"
        out[plain] = value
    return out


def pseudo_gradient(delta: dict[str, Tensor], lr: float) -> dict[str, Tensor]:
    """``-delta / lr``: the gradient itself after one SGD step (scale-matching attacks such as TAG need it)."""
    if not lr > 0:
        raise ValueError(f"pseudo_gradient(lr={lr}): the local learning rate, > 0")
    return {name: -value / lr for name, value in delta.items()}
