"""Embedding-gradient row attack: the bag of input tokens (and more) from embedding-like gradients.

Spec: DESIGN §6.3 (re-implemented, no code copied). The attacker is the honest-but-curious
server: it holds the model and the client's shared gradient dict ``{param_name: grad}`` and reads three row
channels:

* **Token embedding** ``E`` (V×d). Row ``v`` of ``∂L/∂E`` is ``Σ_{(b,t): x_bt = v} δ_bt`` (input side) plus, when the
  LM head is tied to ``E``, ``(1/N) Σ_t (p_tv − 1[y_t = v]) h_t`` (output side: softmax term).

  - *untied / no LM head* (classifiers, untied decoders): the gradient is row-sparse and the non-zero rows are
    exactly the tokens present (exact).
  - *tied head*: every row is dense. The output-side term of every row lies in ``span{h_t}`` (dimension ≤ N,
    the number of predicted positions). The span is estimated by an SVD of low-norm rows (non-input tokens),
    cut at the first large singular-value gap; rows with a clear residual outside the span carry an input-side
    ``δ`` and are inputs ("subspace-complement refinement"). When no gap exists (N ≥ d, or a flooded gradient)
    the attack falls back to robust log-norm outliers.
  - causal LMs: the last token of each sequence gets ``δ = 0`` (its logits have no label), so it has no input
    side. It is still a *label* and shows up on the output side (tied rows, untied head rows) with a norm
    comparable to the other labels; at most ``batch_size`` such label-only tokens are added.

* **Untied LM head** rows ``(1/N) Σ_t (p_tv − 1[y_t = v]) h_t``: label tokens are norm outliers; a head bias (if
  any) gives label tokens exactly as its negative entries.
* **Position embeddings** (GPT-2 ``wpe``, BERT ``position_embeddings`` …): non-zero rows reveal the sequence length
  (the longest sequence of the batch; +1 for causal LMs, whose last position has no gradient). With
  ``batch_size == 1`` row ``t`` *is* ``δ_t``, so each recovered token's row can be written as a combination of
  position rows (least squares), which puts every token at its position: the sentence is recovered in order.

A missing, all-zero or non-finite tensor means that channel is closed; with every channel closed the attack
returns ``[]`` (never raises).

Output of :func:`embedding_norm` (documented choice): with ``batch_size == 1`` and an open position channel the
ordered sentence (one string); otherwise the order is unknown and each of the ``batch_size`` slots holds the whole
recovered bag (unique tokens, strongest first) — sentence membership is not recoverable from these rows, and the
bag is the best guess for every slot. :func:`embedding_norm_tokens` gives the token ids for exact token recall.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

__all__ = [
    "EmbeddingLeak",
    "embedding_norm",
    "embedding_norm_leak",
    "embedding_norm_tokens",
    "embedding_param_names",
    "sequence_length",
]

# Tuning constants (all relative, so they do not depend on the gradient scale).
_Z_OUTLIER = 3.5  # robust z-score (median / MAD) of log row norms for a norm outlier
_KEEP_REL = 0.35  # a kept outlier / label-only row must reach this fraction of the reference median norm
_GAP_OUTLIER = 3.0  # a drop by this factor between consecutive outlier norms separates populations
_GAP_MIN = 1e2  # singular-value gap that marks the edge of span{h_t}
_GAP_FLOOR = 1e-4  # ... and the first singular value after the gap must be this small (relative)
_RES_MIN = 1e-3  # relative residual outside span{h_t} that marks an input token
_BASIS_ROWS = 2048  # low-norm rows used to estimate span{h_t} (at least 4·d are used)
_CHUNK = 8192  # rows per chunk for the V×d products


@dataclass
class EmbeddingLeak:
    """Everything the row channels gave away."""

    tokens: set[int] = field(default_factory=set)  # recovered input token ids
    scores: dict[int, float] = field(default_factory=dict)  # per token: row norm (larger = stronger evidence)
    seq_len: int | None = None  # longest sequence in the batch (position rows), None if unknown
    order: list[int] | None = None  # token ids in sentence order (batch_size == 1 with positions)
    token_types: set[int] | None = None  # segment ids used (BERT token_type rows)
    channels: list[str] = field(default_factory=list)  # which channels were open and how they were read

    @property
    def open(self) -> bool:
        return bool(self.channels)


# -- locating the parameters -----------------------------------------------------------------------------------


def _aliases(model: nn.Module) -> dict[int, list[str]]:
    """id(param) -> every name it has (tied weights have several)."""
    names: dict[int, list[str]] = {}
    try:
        it = model.named_parameters(remove_duplicate=False)
    except TypeError:  # very old torch
        it = model.named_parameters()
    for name, p in it:
        names.setdefault(id(p), []).append(name)
    return names


def _lookup(grads: dict, names: list[str]) -> Tensor | None:
    """The shared gradient under any alias; None when missing, all-zero or non-finite (channel closed)."""
    for name in names:
        g = grads.get(name)
        if g is None:
            continue
        if not isinstance(g, Tensor):
            g = torch.as_tensor(g)
        if g.numel() == 0:
            continue
        g = g.detach()
        if g.is_sparse:
            g = g.to_dense()
        if not torch.isfinite(g).all() or not bool(g.any()):
            return None
        return g
    return None


@dataclass
class _Params:
    embedding: list[str]
    head: list[str] | None  # untied head weight
    head_bias: list[str] | None
    tied: bool
    positions: list[tuple[str, list[str]]]  # (module name, param aliases)
    token_types: list[list[str]]


def embedding_param_names(model: nn.Module) -> dict[str, list[str]]:
    """Names of the row-channel parameters: ``embedding``, ``lm_head``, ``lm_head_bias``, ``position``, ``token_type``.

    Identified by object identity (``get_input_embeddings`` / ``get_output_embeddings``) and by the names of the
    other ``nn.Embedding`` modules, never by hard-coded indices.
    """
    p = _find_params(model)
    return {
        "embedding": p.embedding,
        "lm_head": p.head or [],
        "lm_head_bias": p.head_bias or [],
        "position": [n for _, names in p.positions for n in names],
        "token_type": [n for names in p.token_types for n in names],
        "tied": [str(p.tied)],
    }


def _find_params(model: nn.Module) -> _Params:
    aliases = _aliases(model)
    get_input, get_output = getattr(model, "get_input_embeddings", None), getattr(model, "get_output_embeddings", None)
    emb_mod = get_input() if callable(get_input) else None
    emb_w = getattr(emb_mod, "weight", None)
    embedding = aliases.get(id(emb_w), []) if emb_w is not None else []
    head = head_bias = None
    tied = False
    out_mod = None
    if callable(get_output):
        try:
            out_mod = get_output()
        except Exception:  # some heads raise NotImplementedError
            out_mod = None
    if out_mod is not None and getattr(out_mod, "weight", None) is not None:
        if emb_w is not None and out_mod.weight is emb_w:
            tied = True
        else:
            head = aliases.get(id(out_mod.weight))
        b = getattr(out_mod, "bias", None)
        if isinstance(b, Tensor):
            head_bias = aliases.get(id(b))
    positions, token_types = [], []
    for name, mod in model.named_modules():
        if not isinstance(mod, nn.Embedding) or mod is emb_mod or mod is out_mod:
            continue
        names = aliases.get(id(mod.weight), [])
        if not names:
            continue
        low = name.lower()
        if "token_type" in low or "segment" in low:
            token_types.append(names)
        elif re.search(r"pos|wpe", low):
            positions.append((name, names))
    return _Params(embedding, head, head_bias, tied, positions, token_types)


def _is_causal(model: nn.Module) -> bool:
    try:
        from aegis.models import is_decoder

        return bool(is_decoder(model))
    except Exception:
        cfg = getattr(model, "config", None)
        if cfg is not None and getattr(cfg, "is_decoder", False):
            return True
        return bool(re.search(r"CausalLM|LMHeadModel", type(model).__name__))


# -- row statistics ------------------------------------------------------------------------------------------------


def _row_norms(G: Tensor) -> Tensor:
    return torch.cat([c.double().norm(dim=1) for c in G.split(_CHUNK)]) if G.shape[0] else G.new_zeros(0).double()


def _norm_outliers(n: Tensor) -> list[int]:
    """Robust log-norm outliers (median / MAD z-score), cut below the deepest clear gap.

    Rows above a ``_GAP_OUTLIER``-fold drop are a separate population (labels, inputs) from the continuum
    below it (high-probability predictions, the bulk); of what is left, rows weaker than ``_KEEP_REL`` times
    its median are dropped too.
    """
    pos = n > 0
    if int(pos.sum()) < 8:
        return torch.nonzero(pos).flatten().tolist()
    ln = torch.where(pos, n.clamp_min(1e-300).log(), torch.full_like(n, float("-inf")))
    vals = ln[pos]
    med = vals.median()
    mad = (vals - med).abs().median() * 1.4826
    if not torch.isfinite(mad) or float(mad) <= 0:
        mad = vals.std().clamp_min(1e-12)
    z = (ln - med) / mad
    cand = torch.nonzero(z > _Z_OUTLIER).flatten()
    if cand.numel() == 0:
        return []
    cand = cand[torch.argsort(n[cand], descending=True)]
    drops = torch.nonzero(n[cand][:-1] > _GAP_OUTLIER * n[cand][1:]).flatten()
    if drops.numel():
        cand = cand[: int(drops[-1]) + 1]
    keep = n[cand] >= _KEEP_REL * n[cand].median()  # and drop the weak tail of what is left
    return cand[keep].tolist()


def _span_basis(G: Tensor, n: Tensor, seed: int = 0) -> Tensor | None:
    """Orthonormal basis (r×d, float64) of span{h_t} from low-norm rows; None when there is no clear edge."""
    V, d = G.shape
    low = torch.nonzero(n <= n.median()).flatten()
    if low.numel() < 2 * d:
        return None
    keep = max(_BASIS_ROWS, 4 * d)
    if low.numel() > keep:
        gen = torch.Generator().manual_seed(seed)
        low = low[torch.randperm(low.numel(), generator=gen)[:keep].to(low.device)]
    A = G[low].double()
    A = A / n[low].clamp_min(1e-300).unsqueeze(1)  # unit rows: every direction of the span weighs in
    try:
        _, S, Vh = torch.linalg.svd(A, full_matrices=False)
    except RuntimeError:
        return None
    if S.numel() < 2 or float(S[0]) <= 0:
        return None
    s = S / S[0]
    ratio = s[:-1] / s[1:].clamp_min(1e-300)
    # The first clear edge: below it the roundoff floor can fall off again (BERT's LayerNorm'd states leave
    # the last few directions exactly empty), a larger ratio that is no edge of span{h_t}.
    edges = torch.nonzero((ratio >= _GAP_MIN) & (s[1:] <= _GAP_FLOOR)).flatten()
    r = int(edges[0]) + 1 if edges.numel() else d
    if r >= d - 4:
        return None
    return Vh[:r]


def _residuals(G: Tensor, Q: Tensor, n: Tensor) -> Tensor:
    """Relative residual ‖(I − QᵀQ) g_v‖ / ‖g_v‖ for every row."""
    Q = Q.to(G.device)
    out = []
    for c in G.split(_CHUNK):
        c = c.double()
        out.append((c - (c @ Q.T) @ Q).norm(dim=1))
    res = torch.cat(out)
    return res / n.clamp_min(1e-300)


# -- the attack --------------------------------------------------------------------------------------------------


def embedding_norm_leak(model: nn.Module, grads: dict, batch_size: int | None = None) -> EmbeddingLeak:
    """Read every row channel of ``grads`` (see module docstring). Never raises on closed channels."""
    leak = EmbeddingLeak()
    if not grads:
        return leak
    P = _find_params(model)
    causal = _is_causal(model)
    B = max(int(batch_size or 1), 1)

    E = _lookup(grads, P.embedding) if P.embedding else None
    H = _lookup(grads, P.head) if P.head else None
    Hb = _lookup(grads, P.head_bias) if P.head_bias else None
    E = E if E is not None and E.dim() == 2 else None
    H = H if H is not None and H.dim() == 2 else None

    confirmed: list[int] = []  # tokens with an input-side signal
    scores: dict[int, float] = {}
    label_rows: Tensor | None = None  # rows whose norm shows label tokens (output side)
    label_norms: Tensor | None = None
    basis: Tensor | None = None  # span{h_t} when the tied complement was used

    reliable = False  # confirmed set from exact sparsity or the complement (not from norms alone)
    if E is not None:
        n = _row_norms(E)
        nz = torch.nonzero(n > 0).flatten()
        if E.shape[0] - nz.numel() >= max(1, E.shape[0] // 10):  # many exactly-zero rows: sparse, exact bag
            reliable = True
            confirmed = nz.tolist()
            leak.channels.append("embedding:sparse")
        else:
            basis = _span_basis(E, n)
            if basis is not None:
                res = _residuals(E, basis, n)
                confirmed = torch.nonzero(res > _RES_MIN).flatten().tolist()
                reliable = True
                leak.channels.append(f"embedding:tied-complement(rank {basis.shape[0]})")
                if P.tied:
                    label_rows, label_norms = E, n
            else:
                confirmed = _norm_outliers(n)
                basis = None
                leak.channels.append("embedding:norm-outliers")
        for v in confirmed:
            scores[v] = float(n[v])
    if H is not None:
        label_rows, label_norms = H, _row_norms(H)
        leak.channels.append("lm_head:rows")

    tokens = set(confirmed)
    if label_norms is not None:
        if reliable and tokens:
            # Label-only tokens (the last token of each causal sequence has no input side): rows as strong as
            # the labels already confirmed, outside the confirmed set, at most B of them.
            conf = torch.tensor(sorted(tokens), device=label_norms.device)
            ref = float(label_norms[conf].median())
            order = torch.argsort(label_norms, descending=True)
            added = 0
            limit = B if causal else 0
            for v in order[: len(tokens) + 4 * B + 16].tolist():
                if added >= limit or float(label_norms[v]) < _KEEP_REL * ref:
                    break
                if v not in tokens:
                    tokens.add(v)
                    scores[v] = float(label_norms[v])
                    added += 1
        elif label_rows is H:  # only norms to go on: the head's label rows are norm outliers
            for v in _norm_outliers(label_norms):
                tokens.add(v)
                scores[v] = float(label_norms[v])
    if Hb is not None and Hb.dim() == 1:
        neg = torch.nonzero(Hb < 0).flatten()
        if 0 < neg.numel() <= max(64 * B, Hb.numel() // 100):  # undefended: labels are the only negative entries
            for v in neg.tolist():
                tokens.add(v)
                scores.setdefault(v, float(-Hb[v]))
            leak.channels.append("lm_head:bias")

    leak.tokens = tokens
    leak.scores = {v: scores.get(v, 0.0) for v in tokens}

    # Position rows: sequence length, and the order of tokens for B == 1.
    leak.seq_len, D = _position_rows(grads, P, causal)
    if D is not None:
        leak.channels.append("position:sparse")
    for names in P.token_types:
        W = _lookup(grads, names)
        if W is None or W.dim() != 2:
            continue
        nz = torch.nonzero(_row_norms(W) > 0).flatten()
        if nz.numel() < W.shape[0]:  # some segment rows exactly zero: the rest are the types used
            leak.token_types = set(nz.tolist())
            leak.channels.append("token_type")
        break

    if B == 1 and D is not None and E is not None and confirmed and reliable:
        leak.order = _order_b1(E, D, confirmed, basis, tokens, causal)
    return leak


def _position_rows(grads: dict, P: _Params, causal: bool) -> tuple[int | None, Tensor | None]:
    """(sequence length, the non-zero position rows in order) from the first sparse position table."""
    for _, names in P.positions:
        W = _lookup(grads, names)
        if W is None or W.dim() != 2:
            continue
        nz = torch.nonzero(_row_norms(W) > 0).flatten()
        if 0 < nz.numel() < W.shape[0]:  # no exactly-zero row (flooded): nothing about the length
            return int(nz.numel()) + (1 if causal else 0), W[nz]
    return None, None


def sequence_length(model: nn.Module, grads: dict) -> int | None:
    """Longest sequence of the batch from the position-embedding rows alone (None when not shared / dense).

    A causal LM's last position gets no gradient (its logits have no label), hence the +1 for decoders.
    """
    if not grads:
        return None
    return _position_rows(grads, _find_params(model), _is_causal(model))[0]


def _order_b1(E: Tensor, D: Tensor, confirmed: list[int], basis: Tensor | None, tokens: set[int], causal: bool):
    """Put each token at its positions: row_v = Σ_{t: x_t = v} δ_t and position row t = δ_t (B = 1)."""
    G = E[torch.tensor(confirmed, device=E.device)].double()
    Dd = D.double().to(G.device)
    if basis is not None:  # remove the tied head's output side: what is left is input side only
        Q = basis.to(G.device)
        G = G - (G @ Q.T) @ Q
        Dd = Dd - (Dd @ Q.T) @ Q
    try:
        C = torch.linalg.lstsq(Dd.T, G.T).solution  # (T × K): G.T ≈ Dd.T @ C
    except RuntimeError:
        return None
    C = C.T  # K × T: coefficient of position t in token row v (≈ 1 where v sits at t, else ≈ 0)
    best = C.argmax(dim=0)
    order = []
    for t in range(C.shape[1]):
        k = int(best[t])
        if float(C[k, t]) > 0.5:
            order.append(confirmed[k])
    if causal:  # the last position has no input-side gradient: a label-only token goes there
        extra = [v for v in tokens if v not in set(confirmed)]
        if extra:
            order.append(extra[0])
    return order


def embedding_norm_tokens(model: nn.Module, grads: dict, tokenizer=None, batch_size: int | None = None) -> set[int]:
    """The recovered bag of input token ids (``tokenizer`` is accepted for symmetry and unused)."""
    return set(embedding_norm_leak(model, grads, batch_size).tokens)


def embedding_norm(model: nn.Module, grads: dict, tokenizer, batch_size: int) -> list[str]:
    """Recovered text: the ordered sentence for B = 1 with positions, else the bag in each of the B slots.

    Returns ``[]`` when every row channel is closed (missing, zero or non-finite gradients) or nothing leaks.
    """
    leak = embedding_norm_leak(model, grads, batch_size)
    if not leak.tokens:
        return []
    if leak.order:
        text = tokenizer.decode(leak.order, skip_special_tokens=True).strip()
        return [text] if text else []
    return bag_slots(sorted(leak.tokens, key=lambda v: -leak.scores.get(v, 0.0)), tokenizer, batch_size)


def bag_slots(bag: list[int], tokenizer, batch_size: int | None) -> list[str]:
    """An unordered bag of token ids (strongest first) as the guess for every one of the ``batch_size``
    sentences (which sentence holds a token is not in the rows); ``[]`` when no non-special token is left."""
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    words = [tokenizer.decode([v]).strip() for v in bag if v not in special]
    words = [w.replace("##", "") for w in words if w]
    if not words:
        return []
    return [" ".join(words)] * max(int(batch_size or 1), 1)
