"""Span machinery shared by the three span attacks: ``dager``, ``mlp_span`` and ``spectral``.

The lemma every one of them uses (DESIGN §6.2): for a linear layer applied row-wise to inputs u_t,
each row of the weight gradient is a combination of the u_t, so the gradient's row space is the span of the
layer's inputs whenever there are fewer of them than the input width. A candidate input belongs to the
batch iff its unit-normalised residual against that span is ~0.

What lives here, once: finding the input projections of a layer and their gradients (``gradient_matrix``),
the rank estimate and SVD basis (``build_span``: numerical rank for exact gradients, Marchenko–Pastur edge
for flooded ones), the residual test (``Span.residual``), the two acceptance rules (``Threshold``,
``Outlier``), what the server feeds a layer for candidate tokens (``module_input``, ``token_inputs``),
the prefix search of causal decoding (``grow``) and the final assembly of B sentences (``assemble``).
"""
from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch
from torch import Tensor, nn

from ..models import input_embedding

RANK_CUTOFF = 20  # DAGER's rank_cutoff: the basis never exceeds min(shape) - 20 directions
_LAYER = r"(?:^|\.)(?:h|layers|layer|blocks)\.(\d+)\."
_INPUT_PROJECTIONS = {
    # Modules reading the block's attention input: GPT-2 fused QKV, LLaMA/Mistral/Qwen q/k/v, BERT q/k/v.
    "attention": re.compile(
        _LAYER + r"(?:attn|self_attn|attention\.self)\.(?:c_attn|q_proj|k_proj|v_proj|query|key|value|qkv_proj)$"
    ),
    # Modules reading the MLP input: GPT-2 c_fc, LLaMA gate/up, BERT intermediate.dense.
    "mlp": re.compile(_LAYER + r"(?:mlp\.(?:c_fc|gate_proj|up_proj|fc1|fc_in)|intermediate\.dense)$"),
}


# -- gradients -> spans -------------------------------------------------------------------------------


def input_projections(model: nn.Module, kind: str) -> dict[int, list[str]]:
    """``{layer index: [module names]}`` of the linear maps that read a block's attention or MLP input."""
    found: dict[int, list[str]] = {}
    for name, _ in model.named_modules():
        match = _INPUT_PROJECTIONS[kind].search(name)
        if match:
            found.setdefault(int(match.group(1)), []).append(name)
    return dict(sorted(found.items()))


def gradient_matrix(model: nn.Module, grads: dict[str, Tensor], module_name: str) -> Tensor | None:
    """The shared weight gradient of ``module_name`` as (out x in) float64, or None if the channel is closed
    (missing, all zero or non-finite). GPT-2's Conv1D stores weights (in x out), hence the transpose."""
    grad = grads.get(f"{module_name}.weight")
    if grad is None or grad.dim() != 2:
        return None
    grad = grad.detach().to(torch.float64)
    if not bool(torch.isfinite(grad).all()) or not bool(grad.any()):
        return None
    if type(model.get_submodule(module_name)).__name__ == "Conv1D":
        grad = grad.T
    return grad


@dataclass(frozen=True)
class Span:
    """An orthonormal basis (rows) of the estimated input span of one layer."""

    basis: Tensor  # (r, d) float64

    @property
    def rank(self) -> int:
        return self.basis.shape[0]

    def residual(self, x: Tensor, known: Tensor | None = None) -> Tensor:
        """||(I - R^T R) x/||x|| ||_2 for every row of ``x`` (any leading shape), in float64.

        Scale-invariant by the unit normalisation, so a norm's 1/sigma does not matter (its bias does).
        ``known`` (k, d): inputs already attributed (a prefix's own positions). Their span is projected out
        of ``x`` first, so a candidate cannot pass by resembling them; under noise, where nothing is
        exactly in the span, such look-alikes (e.g. repeats of earlier tokens) otherwise win."""
        lead, d = x.shape[:-1], x.shape[-1]
        x = x.reshape(-1, d)
        q = None
        if known is not None and known.shape[0]:
            q = torch.linalg.qr(known.to(self.basis.device, torch.float64).T).Q
        out = torch.empty(x.shape[0], dtype=torch.float64, device=self.basis.device)
        # Chunks of rows: a vocabulary scan is V x d, and float64 copies of it all at once cost more
        # in page faults than the arithmetic.
        for start in range(0, x.shape[0], _RESIDUAL_CHUNK):
            xs = x[start : start + _RESIDUAL_CHUNK].to(self.basis.device, torch.float64)
            if q is not None:
                xs = xs - (xs @ q) @ q.T
            norm2 = xs.square().sum(-1).clamp_min(1e-300)
            inside = (xs @ self.basis.T).square().sum(-1) / norm2
            out[start : start + _RESIDUAL_CHUNK] = (1.0 - inside).clamp_min(0.0).sqrt()
        return out.reshape(lead)


_RESIDUAL_CHUNK = 4096


def build_span(
    mats: Iterable[Tensor | None], method: str = "numerical", rtol: float = 1e-6, cutoff: int = RANK_CUTOFF
) -> Span | None:
    """SVD basis of the stacked gradient rows of the matrices that share one input.

    ``method="numerical"``: rank = #singular values > ``rtol`` * largest (exact fp32 gradients keep their
    signal several orders above the ~1e-8 relative roundoff floor). ``method="mp"``: each matrix is
    divided by its estimated noise level and only directions above the Marchenko–Pastur edge
    sqrt(m) + sqrt(n) (plus a 5% margin for edge fluctuations) are kept. Either way at most
    min(shape) - ``cutoff`` directions. None when no direction is left."""
    present = [m for m in mats if m is not None]
    if not present:
        return None
    if method == "mp":
        present = [m / noise_level(m) for m in present]
    stacked = torch.cat(present)
    _, s, vh = torch.linalg.svd(stacked, full_matrices=False)
    if method == "numerical":
        rank = int((s > rtol * s[0]).sum())
    elif method == "mp":
        m, n = stacked.shape
        rank = int((s > 1.05 * (math.sqrt(m) + math.sqrt(n))).sum())
    else:
        raise ValueError(f"method={method!r}: use 'numerical' or 'mp'")
    rank = min(rank, min(stacked.shape) - cutoff)
    return Span(vh[:rank].contiguous()) if rank > 0 else None


def noise_level(mat: Tensor) -> float:
    """Per-entry std of the i.i.d. noise in ``mat``, from its median singular value (MP median law).

    Robust to a low-rank signal on top: only the directions it occupies move, the median barely does."""
    m, n = max(mat.shape), min(mat.shape)
    median = float(torch.linalg.svdvals(mat).median())
    return max(median / math.sqrt(m * _mp_median(n / m)), 1e-300)


@lru_cache(maxsize=64)
def _mp_median(beta: float) -> float:
    """Median of the Marchenko–Pastur law with ratio ``beta`` <= 1 (eigenvalues of X^T X / m, unit entries)."""
    lo, hi = (1 - math.sqrt(beta)) ** 2, (1 + math.sqrt(beta)) ** 2
    x = np.linspace(lo, hi, 200_001)[1:-1]
    density = np.sqrt((hi - x) * (x - lo)) / (2 * math.pi * beta * x)
    cdf = np.cumsum(density)
    return float(x[np.searchsorted(cdf / cdf[-1], 0.5)])


def layer_spans(
    model: nn.Module, grads: dict[str, Tensor], kind: str, layers: Sequence[int], method: str = "numerical", **kw
) -> list[tuple[Span | None, str | None]]:
    """For each requested layer: its span (None if closed) and one input-projection module name to probe."""
    modules = input_projections(model, kind)
    out = []
    for layer in layers:
        names = modules.get(layer, [])
        span = build_span((gradient_matrix(model, grads, n) for n in names), method, **kw)
        out.append((span, names[0] if names else None))
    return out


# -- acceptance rules ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Threshold:
    """Exact gradients: accept a candidate iff its residual is below ``tau`` (DAGER)."""

    tau: float
    exact = True

    def __call__(self, residuals: Tensor) -> Tensor:
        return residuals < self.tau

    def consistent(self, history: list[float], residual: float) -> bool:
        return True


@dataclass(frozen=True)
class Outlier:
    """Noisy gradients: no residual is ~0 any more, so accept the candidates whose log-residual is a
    robust low outlier of their pool (the last dimension: a vocabulary scan or one prefix's candidates
    plus random reference tokens): z < -``z`` and residual < ``ratio`` * the pool's median (the
    vocabulary's heavy lower tail alone reaches z ~ -10), at most ``top`` per pool. Callers using it
    also deflate candidates by their prefix (``Span.residual(known=...)``).

    A relative test always finds a "best" continuation, also after a sentence has ended. Where the flood
    left the span intact (tiny lambda) a sentence's residuals are ~0, and ``consistent`` ends it at its
    first step above ``exact_level`` (DAGER's sequence threshold): once exact, a sentence stays exact."""

    z: float = 6.0
    ratio: float = 0.6
    top: int = 4
    exact_level: float = 1e-3
    exact = False

    def consistent(self, history: list[float], residual: float) -> bool:
        return not history or max(history) >= self.exact_level or residual < self.exact_level

    def __call__(self, residuals: Tensor) -> Tensor:
        s = residuals.clamp_min(1e-12).log()
        median = s.median(-1, keepdim=True).values
        mad = (s - median).abs().median(-1, keepdim=True).values.clamp_min(1e-12) * 1.4826
        ok = ((s - median) / mad < -self.z) & (s - median < math.log(self.ratio))
        k = min(self.top, s.shape[-1])
        best = torch.zeros_like(ok)
        best.scatter_(-1, s.topk(k, dim=-1, largest=False).indices, True)
        return ok & best


Rule = Threshold | Outlier


# -- what the server feeds a layer --------------------------------------------------------------------


class _Stop(Exception):
    """Raised from a forward pre-hook once the wanted layer input is captured (skips the rest)."""


@torch.no_grad()
def module_input(model: nn.Module, module_name: str, input_ids: Tensor, chunk: int = 1024, **kw) -> Tensor:
    """The exact input the model feeds ``module_name`` for ``input_ids`` (n, L): (n, L, d).

    A forward pre-hook captures it and stops the forward there, so this is the model's own code path
    (norm affine parameters, RoPE, masks …) at the cost of the layers below only. Keyword tensors with
    a leading batch dimension (attention_mask, position_ids, token_type_ids) are chunked alongside."""
    module = model.get_submodule(module_name)
    captured: list[Tensor] = []

    def grab(_module, args):
        captured.append(args[0].detach())
        raise _Stop

    handle = module.register_forward_pre_hook(grab)
    try:
        for start in range(0, input_ids.shape[0], chunk):
            part = {k: v[start : start + chunk] for k, v in kw.items()}
            part.setdefault("attention_mask", torch.ones_like(input_ids[start : start + chunk]))
            try:
                model(input_ids=input_ids[start : start + chunk], **part)
            except _Stop:
                pass
    finally:
        handle.remove()
    return torch.cat(captured)


def token_inputs(model: nn.Module, module_name: str, position: int, token_type: int | None = None) -> Tensor:
    """Layer input of every vocabulary token alone at ``position`` (context-free at the first block): (V, d)."""
    table = input_embedding(model)
    ids = torch.arange(table.num_embeddings, device=table.weight.device)[:, None]
    kw = {"position_ids": torch.full_like(ids, position)}
    if token_type is not None:
        kw["token_type_ids"] = torch.full_like(ids, token_type)
    return module_input(model, module_name, ids, chunk=8192, **kw)[:, 0]


def position_free(model: nn.Module, module_name: str) -> bool:
    """True when the first block's input does not depend on the position (RoPE models: LLaMA, Mistral …)."""
    emb = input_embedding(model)
    ids = torch.arange(8, device=emb.weight.device)[:, None] * 997 % emb.num_embeddings
    at = [module_input(model, module_name, ids, position_ids=torch.full_like(ids, p)) for p in (0, 3)]
    return torch.allclose(at[0], at[1])


# -- decoding -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Found:
    """A recovered token sequence, its mean residual, and whether every step passed an exact test."""

    ids: tuple[int, ...]
    score: float
    exact: bool


Extend = Callable[[list[tuple[int, ...]]], list[tuple[list[int], list[float]]]]


def grow(extend: Extend, max_len: int, beam: int, rule: Rule) -> list[Found]:
    """Causal decoding by prefix extension (DESIGN §6.2).

    ``extend(prefixes)`` returns, per prefix, the next tokens ``rule`` accepted and their residuals. A
    prefix with no accepted (and ``rule.consistent``) extension is a finished sentence; different batch
    sentences are different branches. At most ``beam`` prefixes (lowest mean residual) survive a step,
    a guard against noise-driven blow-up."""
    alive: list[tuple[tuple[int, ...], list[float]]] = [((), [])]
    done: list[Found] = []
    for _ in range(max_len):
        if not alive:
            break
        grown = []
        for (prefix, res), (tokens, scores) in zip(alive, extend([p for p, _ in alive])):
            kept = [(prefix + (t,), res + [s]) for t, s in zip(tokens, scores) if rule.consistent(res, s)]
            if not kept and prefix:
                done.append(Found(prefix, float(np.mean(res)), rule.exact))
            grown += kept
        alive = sorted(grown, key=lambda item: float(np.mean(item[1])))[:beam]
    return done + [Found(p, float(np.mean(r)), rule.exact) for p, r in alive if p]


def repeats(prefix: Sequence[int], token: int) -> bool:
    """True when ``prefix + (token,)`` is one token repeated. Such a run has position-independent states
    under RoPE (equal keys and values everywhere), so it would pass a span test forever; DAGER rejects a
    repeated first token for the same reason. Cost: a text that really starts with a run is truncated."""
    return bool(prefix) and all(t == token for t in prefix)


def similar(a: Sequence[int], b: Sequence[int], thresh: float = 0.7) -> bool:
    """DAGER's distinctness rule: similar when >= ``thresh`` of the positions hold the same token."""
    same = sum(x == y for x, y in zip(a, b))
    return same >= thresh * max(len(a), len(b), 1)


def assemble(found: Iterable[Found], batch_size: int) -> list[tuple[int, ...]]:
    """Exact sentences first (lowest residual first), then the best distinct approximations, up to B."""
    found = list(found)
    chosen: list[tuple[int, ...]] = []
    for f in sorted((f for f in found if f.exact), key=lambda f: f.score):
        if f.ids not in chosen:
            chosen.append(f.ids)
    for f in sorted((f for f in found if not f.exact), key=lambda f: f.score):
        if not any(similar(f.ids, c) for c in chosen):
            chosen.append(f.ids)
    return chosen[:batch_size]


def decode(tokenizer, sequences: Iterable[Sequence[int]]) -> list[str]:
    """Texts without special tokens; a sequence of nothing but special tokens is no reconstruction."""
    texts = (tokenizer.decode(list(ids), skip_special_tokens=True).strip() for ids in sequences)
    return [text for text in texts if text]
