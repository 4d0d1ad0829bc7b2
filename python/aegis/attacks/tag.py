"""TAG-style optimisation attack (Deng et al., Findings of EMNLP 2021), re-implemented from the spec.

Spec: DESIGN §6.3 (no code copied). The server optimises dummy input *embeddings*
(``inputs_embeds``, so the token lookup is bypassed) and dummy labels until the gradient they produce matches the
shared one:

    L_match = Σ_i ‖∇θ_i L(x', y') − g_i‖² + α ‖∇θ_i L(x', y') − g_i‖₁

over every shared tensor ``g_i`` the attacker can reproduce (missing, all-zero or non-finite tensors are skipped:
that channel is closed). The token-embedding gradient is never matched: with ``inputs_embeds`` the dummy has no
input-side embedding gradient (LAMP/breaching do the same). Each dummy vector is read out as the token whose
embedding row has the highest cosine similarity.

Labels:

* causal LMs: the targets are the inputs shifted by one. ``label_mode="coupled"`` (default) ties the dummy label
  at position ``t`` to the dummy input at ``t + 1`` (a sharp softmax of its cosine similarities to the embedding
  rows), so the output-side gradient also pulls on the inputs; ``label_mode="free"`` optimises an independent
  soft-label distribution per position, as in TAG.
* sequence classifiers: a soft distribution over the classes is optimised jointly.

Setting: B sequences of one common length (no padding), B = 1 is the setting in which TAG works. The length comes
from the position-embedding rows when they are shared (:func:`aegis.attacks.embedding_norm.embedding_norm_leak`),
else from ``seq_len``.
"""
from __future__ import annotations

import math
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..models import input_embedding, is_decoder

__all__ = ["tag", "tag_tokens"]


def _usable(g) -> Tensor | None:
    if g is None:
        return None
    if not isinstance(g, Tensor):
        g = torch.as_tensor(g)
    g = g.detach()
    if g.is_sparse:
        g = g.to_dense()
    if g.numel() == 0 or not torch.isfinite(g).all() or not bool(g.any()):
        return None
    return g


@contextmanager
def _grad_enabled_on(params: list[nn.Parameter]):
    """Temporarily let ``params`` require grad (the server's copy may have them frozen), then restore."""
    saved = [p.requires_grad for p in params]
    try:
        for p in params:
            p.requires_grad_(True)
        yield
    finally:
        for p, r in zip(params, saved):
            p.requires_grad_(r)


@contextmanager
def _math_attention():
    """Fused SDPA kernels have no double backward: run attention through the composite math path."""
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:  # pragma: no cover - old torch
        yield
        return
    with sdpa_kernel([SDPBackend.MATH]):
        yield


def _targets(model: nn.Module, grads: dict, skip: set[int]):
    """(params, shared grads) for every parameter the attack can match, by name (tied aliases included)."""
    params, targets, seen = [], [], set()
    try:
        it = model.named_parameters(remove_duplicate=False)
    except TypeError:
        it = model.named_parameters()
    for name, p in it:
        if id(p) in seen or id(p) in skip or name not in grads:
            continue
        g = _usable(grads[name])
        if g is None or tuple(g.shape) != tuple(p.shape):
            continue
        seen.add(id(p))
        params.append(p)
        targets.append(g.to(device=p.device, dtype=torch.float32))
    return params, targets


def _seq_len(model, grads, seq_len):
    if seq_len is not None:
        return int(seq_len)
    try:
        from .embedding_norm import sequence_length

        n = sequence_length(model, grads)
    except Exception:
        n = None
    return int(n) if n else 16


def tag_tokens(
    model: nn.Module,
    grads: dict,
    batch_size: int = 1,
    steps: int = 2000,
    lr: float = 0.05,
    seed: int = 0,
    *,
    seq_len: int | None = None,
    alpha: float = 0.01,
    label_mode: str = "coupled",
    temperature: float = 0.05,
    exclude_special: list[int] | None = None,
) -> list[list[int]]:
    """Run the optimisation and return the recovered token ids, one list per sequence (``[]`` if nothing to match)."""
    if not grads or batch_size < 1 or steps < 0:
        return []
    E = input_embedding(model).weight
    params, targets = _targets(model, grads, skip={id(E)})
    if not params:
        return []
    decoder = is_decoder(model)
    B = int(batch_size)
    L = max(_seq_len(model, grads, seq_len), 2 if decoder else 1)
    device = E.device
    d = E.shape[1]

    gen = torch.Generator(device="cpu").manual_seed(int(seed))
    with torch.no_grad():
        Ed = E.detach().float()
        row_scale = Ed.norm(dim=1).mean() / math.sqrt(d)
        E_unit = F.normalize(Ed, dim=1)
    x = (torch.randn(B, L, d, generator=gen) * row_scale.cpu()).to(device).requires_grad_(True)
    opt_vars = [x]
    y_logits = None
    if decoder:
        if label_mode == "free":
            y_logits = torch.zeros(B, L - 1, E.shape[0], device=device, requires_grad=True)
            opt_vars.append(y_logits)
        elif label_mode != "coupled":
            raise ValueError("label_mode must be 'coupled' or 'free'")
    else:
        n_cls = int(getattr(model.config, "num_labels", 2))
        y_logits = torch.zeros(B, n_cls, device=device, requires_grad=True)
        opt_vars.append(y_logits)

    opt = torch.optim.Adam(opt_vars, lr=lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: max(0.0, 1.0 - s / max(steps, 1)) if steps else 1.0)
    mask = torch.ones(B, L, dtype=torch.long, device=device)

    def dummy_loss():
        out = model(inputs_embeds=x.to(E.dtype), attention_mask=mask)
        logits = out.logits.float()
        if y_logits is None:  # a decoder's coupled labels: label t = soft nearest token of input t+1
            q = torch.softmax(F.normalize(x[:, 1:], dim=-1) @ E_unit.T / temperature, dim=-1)
        else:
            q = torch.softmax(y_logits, dim=-1)
        if decoder:
            logits = logits[:, :-1]
        return -(q * torch.log_softmax(logits, dim=-1)).sum(-1).mean()

    best, best_x = float("inf"), x.detach().clone()
    was_training = model.training
    model.eval()
    try:
        with _grad_enabled_on(params), _math_attention():
            for _ in range(steps):
                opt.zero_grad(set_to_none=True)
                dg = torch.autograd.grad(dummy_loss(), params, create_graph=True, allow_unused=True)
                rec = x.new_zeros(())
                for gi, ti in zip(dg, targets):
                    diff = (gi if gi is not None else torch.zeros_like(ti)) - ti
                    rec = rec + diff.pow(2).sum() + alpha * diff.abs().sum()
                if not torch.isfinite(rec):
                    break
                val = float(rec.detach())
                if val < best:
                    best, best_x = val, x.detach().clone()
                rec.backward(inputs=opt_vars)
                torch.nn.utils.clip_grad_norm_(opt_vars, 1.0)
                opt.step()
                sched.step()
    finally:
        model.train(was_training)

    with torch.no_grad():
        sims = F.normalize(best_x.float(), dim=-1) @ E_unit.T  # B × L × V
        if exclude_special:
            sims[..., torch.as_tensor(exclude_special, device=device)] = -2.0
        ids = sims.argmax(-1)
    return [row.tolist() for row in ids.cpu()]


def tag(
    model: nn.Module,
    grads: dict,
    tokenizer,
    batch_size: int,
    steps: int = 2000,
    lr: float = 0.05,
    seed: int = 0,
    **kwargs,
) -> list[str]:
    """TAG reconstruction: ``batch_size`` strings (``[]`` when no usable gradient was shared).

    Keyword arguments go to :func:`tag_tokens` (``seq_len``, ``alpha``, ``label_mode``, ``temperature``).
    """
    ids = tag_tokens(model, grads, batch_size, steps, lr, seed, **kwargs)
    if not ids:
        return []
    return [tokenizer.decode(row, skip_special_tokens=True).strip() for row in ids]
