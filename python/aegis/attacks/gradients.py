"""What one FedSGD client shares: the gradient of its batch loss (DESIGN §6)."""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from ..models import is_decoder


def tokenize(tokenizer, texts: Sequence[str], model: nn.Module) -> dict[str, torch.Tensor]:
    """Right-padded ids and attention mask on the model's device (never token types: see aegis.models)."""
    enc = tokenizer(list(texts), padding=True, truncation=True, return_tensors="pt")
    device = next(model.parameters()).device
    return {"input_ids": enc["input_ids"].to(device), "attention_mask": enc["attention_mask"].to(device)}


def shared_gradient(
    model: nn.Module,
    texts: Sequence[str],
    tokenizer,
    shield=None,
    labels: Sequence[int] | torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """The gradient dict one client would send for ``texts``.

    Loss: classification cross-entropy when ``labels`` are given, else the causal-LM loss with pads set
    to -100 (a decoder is required then). The forward runs in eval mode (no dropout, as in DAGER's
    default) and the model's train/eval mode is restored afterwards.

    Without ``shield``: ``{name: raw gradient}`` of every trainable parameter (detached fp32 copies).
    With ``shield``: exactly ``shield.export()`` after ``shield.mask_()`` (frozen parameters absent).
    The model's ``.grad`` fields are cleared on return, so nothing of the batch stays behind.
    """
    enc = tokenize(tokenizer, texts, model)
    if labels is not None:
        target = torch.as_tensor(labels, device=enc["input_ids"].device)
    elif is_decoder(model):
        target = enc["input_ids"].masked_fill(enc["attention_mask"] == 0, -100)
    else:
        raise ValueError("an encoder needs classification labels: pass labels=[...] (one per text)")

    was_training = model.training
    model.eval()
    model.zero_grad(set_to_none=True)
    try:
        model(**enc, labels=target).loss.backward()
        if shield is not None:
            shield.mask_()
            return shield.export()
        return {
            n: p.grad.detach().float().clone()
            for n, p in model.named_parameters()
            if p.requires_grad and p.grad is not None
        }
    finally:
        model.zero_grad(set_to_none=True)
        model.train(was_training)
