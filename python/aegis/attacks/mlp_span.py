"""Adaptive attacker for frozen attention: DAGER retargeted to the MLP input projection (DESIGN §6.2).

The first block's MLP input projection (GPT-2 ``c_fc``, LLaMA ``gate_proj``/``up_proj``, BERT
``intermediate.dense``) obeys the same span lemma as the attention projections, with input
u_t = norm(x_t + attention_t). Frozen attention weights are public, so the server can compute u_t for any
candidate prefix, but u_t depends on the whole prefix: there is no context-free token filter. Decoding is
therefore DAGER's prefix extension with the full vocabulary scanned at every step.

Encoders are out of reach of this attack without another leak (u_t depends on the whole sentence, so the
search is over V^L): ``mlp_attack`` returns [] for them.
"""
from __future__ import annotations

import warnings

import torch
from torch import Tensor, nn

from ..models import input_embedding, is_decoder
from .span import Rule, Span, Threshold, assemble, decode, grow, layer_spans, module_input, repeats


def mlp_span(
    model: nn.Module,
    grads: dict[str, Tensor],
    tokenizer,
    batch_size: int,
    *,
    rtol: float = 1e-6,
    tau: float = 1e-3,
    max_len: int | None = None,
) -> list[str]:
    """Reconstruct up to ``batch_size`` texts from the first block's MLP input-projection gradient.

    Exact span (numerical rank) and residual threshold ``tau``; returns [] if that gradient is missing,
    zero, or buried in noise (a flooded matrix has full numerical rank, clipped to d - 20, and then
    nothing is close to the span)."""
    if not is_decoder(model):
        return []  # see the module docstring: no tractable search for encoders
    [(span, probe)] = layer_spans(model, grads, "mlp", (0,), "numerical", rtol=rtol)
    return mlp_attack(model, tokenizer, batch_size, span, probe, Threshold(tau), max_len)


def mlp_attack(
    model: nn.Module,
    tokenizer,
    batch_size: int,
    span: Span | None,
    probe: str | None,
    rule: Rule,
    max_len: int | None = None,
    beam: int | None = None,
) -> list[str]:
    """Prefix extension scanning the whole vocabulary against the block-1 MLP-input span."""
    if span is None or probe is None or not is_decoder(model):
        return []
    scan = _scanner(model, probe)
    limit = max_len or int(getattr(getattr(model, "config", None), "max_position_embeddings", 512))
    pad = tokenizer.pad_token_id
    device = input_embedding(model).weight.device

    def extend(prefixes):
        out = []
        for prefix in prefixes:
            known = None
            if not rule.exact and prefix:
                known = module_input(model, probe, torch.tensor([prefix], device=device))[0]
            r = span.residual(scan(prefix), known)
            ok = rule(r)
            if pad is not None:
                ok[pad] = False
            tokens = [t for t in ok.nonzero().flatten().tolist() if not repeats(prefix, t)]
            out.append((tokens, r[tokens].tolist()))
        return out

    with torch.no_grad():
        found = grow(extend, limit, beam or max(64, 8 * batch_size), rule)
    return decode(tokenizer, assemble(found, batch_size))


def _scanner(model: nn.Module, probe: str):
    """``scan(prefix) -> (V, d)``: the block-1 MLP input at position len(prefix) for every next token.

    GPT-2, LLaMA-style and causal BERT models get a fast path: block-1 keys, values and queries of a
    token depend only on (token, position), so they are computed once per position for the whole
    vocabulary and each prefix only adds its own attention. Other decoders run every candidate sequence
    (exact, slow)."""
    if hasattr(model, "transformer") and hasattr(model.transformer, "wpe"):
        return _GPT2Scan(model)
    if getattr(model.config, "model_type", None) == "bert" and hasattr(model, "bert"):
        return _BertScan(model)
    inner = getattr(model, "model", None)
    if inner is not None and hasattr(inner, "rotary_emb") and hasattr(inner.layers[0], "post_attention_layernorm"):
        return _LlamaScan(model)
    warnings.warn(
        f"mlp_span: no fast path for {type(model).__name__}; scanning with full forwards (slow)", stacklevel=2
    )
    table = input_embedding(model)
    vocab = torch.arange(table.num_embeddings, device=table.weight.device)[:, None]

    def full(prefix):
        ids = torch.cat([torch.tensor(prefix, dtype=torch.long, device=vocab.device).expand(len(vocab), -1), vocab], 1)
        return module_input(model, probe, ids)[:, -1]

    return full


def _attend(q: Tensor, k_self: Tensor, v_self: Tensor, k_pre: Tensor, v_pre: Tensor, scale: float) -> Tensor:
    """Causal attention of each candidate (V, H, dh) over the prefix (L, H, dh) and itself -> (V, H*dh)."""
    scores = torch.cat([torch.einsum("vhd,lhd->vhl", q, k_pre), (q * k_self).sum(-1, keepdim=True)], -1)
    w = (scores * scale).softmax(-1)
    out = torch.einsum("vhl,lhd->vhd", w[..., :-1], v_pre) + w[..., -1:] * v_self
    return out.flatten(1)


class _GPT2Scan:
    def __init__(self, model):
        tr = model.transformer
        self.wte, self.wpe, self.block = tr.wte.weight, tr.wpe.weight, tr.h[0]
        self.heads, self.dh, self.scale = self.block.attn.num_heads, self.block.attn.head_dim, self.block.attn.scaling
        self._position = None

    def _qkv(self, x):
        q, k, v = self.block.attn.c_attn(self.block.ln_1(x)).split(x.shape[-1], -1)
        return [t.view(*t.shape[:-1], self.heads, self.dh) for t in (q, k, v)]

    def __call__(self, prefix):
        i = len(prefix)
        if self._position is None or self._position[0] != i:
            x = self.wte + self.wpe[i]
            self._position = (i, x, *self._qkv(x))
        _, x, q, k, v = self._position
        _, k_pre, v_pre = self._qkv(self.wte[list(prefix)] + self.wpe[:i])
        a = self.block.attn.c_proj(_attend(q, k, v, k_pre, v_pre, self.scale))
        return self.block.ln_2(x + a)


class _LlamaScan:
    def __init__(self, model):
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        inner = model.model
        self.embed, self.rotary, self.layer = inner.embed_tokens.weight, inner.rotary_emb, inner.layers[0]
        attn = self.layer.self_attn
        self.attn, self.dh, self.scale = attn, attn.head_dim, attn.scaling
        self.group = model.config.num_attention_heads // model.config.num_key_value_heads
        self.rope = apply_rotary_pos_emb
        # Before RoPE, block-1 q/k/v of a token do not depend on its position at all: once for all.
        h = self.layer.input_layernorm(self.embed)
        self.q, self.k, self.v = (self._heads(p(h)) for p in (attn.q_proj, attn.k_proj, attn.v_proj))

    def _heads(self, t):
        return t.view(*t.shape[:-1], -1, self.dh)

    def _rotate(self, q, k, positions):
        cos, sin = self.rotary(self.embed, torch.as_tensor(positions, device=self.embed.device)[None])
        # (n, H, dh) with one position per row n: RoPE tables broadcast over the head axis.
        return self.rope(q, k, cos[0], sin[0], unsqueeze_dim=1)

    def __call__(self, prefix):
        i, ids = len(prefix), list(prefix)
        q, k = self._rotate(self.q, self.k, [i] * len(self.q))
        k_pre = self._rotate(self.k[ids], self.k[ids], list(range(i)))[1]
        rep = lambda t: t.repeat_interleave(self.group, dim=-2)  # noqa: E731 (grouped-query attention)
        o = _attend(q, rep(k), rep(self.v), rep(k_pre), rep(self.v[ids]), self.scale)
        return self.layer.post_attention_layernorm(self.embed + self.attn.o_proj(o))


class _BertScan:
    """BERT run causally (the default decoder): block-1 input LayerNorm(word + position + token type 0),
    post-LN attention: the MLP reads LayerNorm(x + attention output)."""

    def __init__(self, model):
        emb, layer = model.bert.embeddings, model.bert.encoder.layer[0]
        self.emb, self.attn, self.out = emb, layer.attention.self, layer.attention.output
        self.heads, self.dh = self.attn.num_attention_heads, self.attn.attention_head_size
        self.scale = self.attn.scaling
        self.typed = emb.word_embeddings.weight + emb.token_type_embeddings.weight[0]
        self._position = None

    def _qkv(self, x):
        a = self.attn
        return [p(x).view(*x.shape[:-1], self.heads, self.dh) for p in (a.query, a.key, a.value)]

    def __call__(self, prefix):
        i = len(prefix)
        if self._position is None or self._position[0] != i:
            x = self.emb.LayerNorm(self.typed + self.emb.position_embeddings.weight[i])
            self._position = (i, x, *self._qkv(x))
        _, x, q, k, v = self._position
        pre = self.emb.LayerNorm(self.typed[list(prefix)] + self.emb.position_embeddings.weight[:i])
        _, k_pre, v_pre = self._qkv(pre)
        return self.out.LayerNorm(x + self.out.dense(_attend(q, k, v, k_pre, v_pre, self.scale)))
