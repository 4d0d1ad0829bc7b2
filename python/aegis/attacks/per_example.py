"""Per-example gradients of chosen parameters from one batched forward/backward.

The server in a 1-of-N verification needs the gradient every candidate batch would give: N separate
forward/backward passes of a small model on a few tokens are launch-bound, so candidates are packed into
one batch and each one's gradient is rebuilt from what the backward pass already computes. Every
candidate's rows attend only to themselves, so the gradient at each token position is the candidate's
own; the layers whose weight gradient is a sum over positions then give each candidate's share:

    nn.Embedding   G[v] = sum of the output gradients at the positions whose id is v
    nn.Linear      G = sum_t delta_t a_t^T          (bias: sum_t delta_t)
    Conv1D         G = sum_t a_t delta_t^T          (GPT-2's transposed linear)
    nn.LayerNorm   G = sum_t delta_t * xhat_t       (bias: sum_t delta_t)

A parameter owned by another kind of module is not supported (:func:`supported` says so up front and the
caller falls back to one pass per candidate). Tied weights (GPT-2's token embedding and LM head) sum the
contributions of every module that holds them.
"""
from __future__ import annotations

import inspect
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["per_example_gradients", "supported"]


def _conv1d() -> type | None:
    try:
        from transformers.pytorch_utils import Conv1D
    except ImportError:  # transformers absent: no GPT-2 blocks to differentiate either
        return None
    return Conv1D


_KINDS = tuple(k for k in (nn.Embedding, nn.Linear, nn.LayerNorm, _conv1d()) if k is not None)


def _owners(model: nn.Module, params: Sequence[nn.Parameter]) -> dict[int, list[tuple[nn.Module, str]]]:
    """id(param) -> [(module, "weight" | "bias")] over every module of a supported kind that holds it."""
    wanted = {id(p) for p in params}
    owners: dict[int, list[tuple[nn.Module, str]]] = {i: [] for i in wanted}
    for module in model.modules():
        if not isinstance(module, _KINDS):
            continue
        for role in ("weight", "bias"):
            p = getattr(module, role, None)
            if isinstance(p, nn.Parameter) and id(p) in wanted:
                owners[id(p)].append((module, role))
    return owners


def supported(model: nn.Module, params: Sequence[nn.Parameter]) -> bool:
    """Whether every parameter is the weight or bias of an Embedding, Linear, Conv1D or LayerNorm (a
    weight also read outside such modules, functionally, would be missed: the tests check the shipped
    models against one pass per example)."""
    owners = _owners(model, params)
    return all(owners[id(p)] for p in params)


def _position_kwargs(model: nn.Module, ids: Tensor) -> dict[str, Tensor]:
    """Explicit per-row position ids: models that broadcast a (1, T) buffer over the batch would give a
    learned position table one gradient for every row together."""
    if "position_ids" not in inspect.signature(model.forward).parameters:
        return {}
    return {"position_ids": torch.arange(ids.shape[1], device=ids.device).expand_as(ids)}


def per_example_gradients(model: nn.Module, params: Sequence[nn.Parameter], input_ids: Tensor,
                          attention_mask: Tensor, labels: Tensor, examples: int, *,
                          decoder: bool) -> list[Tensor]:
    """Gradient of each example's loss for every parameter: a list of (examples, *param.shape) tensors.

    The batch holds ``examples`` candidates of R / examples rows each (example c = rows c*R/E .. ), right
    padded; whole rows of padding carry labels -100. ``labels``: the causal-LM targets (R, T) with -100 on
    pads (``decoder``), else one class per row (R,). Each example's loss is the model's: the mean over its
    own target tokens (decoder) or rows (classifier)."""
    if input_ids.shape[0] % examples:
        raise ValueError(f"{input_ids.shape[0]} rows do not split into examples={examples} equal groups")
    owners = _owners(model, params)
    missing = [i for i, p in enumerate(params) if not owners[id(p)]]
    if missing:
        raise ValueError(f"parameters {missing} are not held by an Embedding/Linear/Conv1D/LayerNorm: "
                         "check per_example.supported(...) first and compute those one example at a time")
    modules = {id(m): m for entries in owners.values() for m, _ in entries}
    calls: dict[int, list[tuple[Tensor, Tensor]]] = {k: [] for k in modules}  # (input, output) per call

    def record(module, args, output):
        calls[id(module)].append((args[0].detach(), output))

    hooks = [module.register_forward_hook(record) for module in modules.values()]
    try:
        with torch.enable_grad():
            logits = model(input_ids=input_ids, attention_mask=attention_mask,
                           **_position_kwargs(model, input_ids)).logits
            losses = _example_losses(logits, labels, examples, decoder)
    finally:
        for h in hooks:
            h.remove()
    # differentiate towards the modules' outputs only: nothing accumulates into any .grad
    flat = [(key, x, y) for key, pairs in calls.items() for x, y in pairs if y.requires_grad]
    deltas = torch.autograd.grad(losses.sum(), [y for _, _, y in flat], allow_unused=True)
    out = []
    for p in params:
        total = torch.zeros((examples, *p.shape), dtype=_wide(p.dtype), device=p.device)
        for module, role in owners[id(p)]:
            for (key, x, _), delta in zip(flat, deltas):
                if key == id(module) and delta is not None:
                    _accumulate(total, module, role, x, delta)
        out.append(total)
    return out


def _wide(dtype: torch.dtype) -> torch.dtype:
    """Accumulate in float32 at least (bf16/fp16 models), in float64 for a float64 model."""
    return torch.promote_types(dtype, torch.float32)


def _example_losses(logits: Tensor, labels: Tensor, examples: int, decoder: bool) -> Tensor:
    if decoder:
        target = labels[:, 1:]
        wide = logits[:, :-1].flatten(0, 1).to(_wide(logits.dtype))
        token = F.cross_entropy(wide, target.flatten(), reduction="none", ignore_index=-100).view(target.shape)
        count = (target != -100).view(examples, -1).sum(1).clamp_min(1)
        return token.view(examples, -1).sum(1) / count
    row = F.cross_entropy(logits.to(_wide(logits.dtype)), labels, reduction="none", ignore_index=-100)
    count = (labels != -100).view(examples, -1).sum(1).clamp_min(1)
    return row.view(examples, -1).sum(1) / count


def _accumulate(total: Tensor, module: nn.Module, role: str, x: Tensor, delta: Tensor) -> None:
    """Add the module's ``role`` gradient, split by example, into ``total`` (examples, *shape) in place
    (no per-call copy of a vocabulary-sized table): positions are grouped per example, rows consecutive."""
    e = total.shape[0]
    if isinstance(module, nn.Embedding):
        ids = x.expand(delta.shape[:-1]).reshape(e, -1)
        d = delta.reshape(e, -1, delta.shape[-1]).to(total.dtype)
        if module.padding_idx is not None:
            d = d * (ids != module.padding_idx).unsqueeze(-1)
        vocab = total.shape[1]
        index = (ids + vocab * torch.arange(e, device=ids.device)[:, None]).reshape(-1)
        total.view(e * vocab, -1).index_add_(0, index, d.reshape(-1, d.shape[-1]))
        return
    d = delta.reshape(e, -1, delta.shape[-1]).to(total.dtype)
    if role == "bias":
        total += d.sum(1)
        return
    a = x.reshape(e, -1, x.shape[-1]).to(total.dtype)
    if isinstance(module, nn.Linear):
        total.baddbmm_(d.transpose(1, 2), a)  # sum_t delta_t a_t^T: (e, out, in)
    elif isinstance(module, nn.LayerNorm):
        total += (d * F.layer_norm(a, module.normalized_shape, None, None, module.eps)).sum(1)
    else:  # Conv1D: weight is (in, out)
        total.baddbmm_(a.transpose(1, 2), d)
