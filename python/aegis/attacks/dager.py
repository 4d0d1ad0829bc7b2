"""DAGER (Petrov et al., NeurIPS 2024), re-implemented from the paper (DESIGN §6.2).

Channel: the first two blocks' attention input projections (GPT-2 fused c_attn, LLaMA q/k/v_proj, BERT
query/key/value; every one present is stacked, they all read the same input). Block 1's span filters
tokens position by position (context-free input); block 2's span verifies whole sequences: greedy prefix
extension for causal decoders, a heuristic candidate search for bidirectional encoders.
``attention_attack`` is the pipeline; ``spectral`` reuses it with denoised spans and outlier rules.
"""
from __future__ import annotations

import itertools
import math

import torch
from torch import Tensor, nn

from ..models import is_decoder
from .span import (
    Found,
    Rule,
    Span,
    Threshold,
    assemble,
    decode,
    grow,
    layer_spans,
    module_input,
    position_free,
    repeats,
    token_inputs,
)


def dager(
    model: nn.Module,
    grads: dict[str, Tensor],
    tokenizer,
    batch_size: int,
    *,
    rtol: float = 1e-6,
    tau_token: float = 1e-4,
    tau_sequence: float = 1e-3,
    max_len: int | None = None,
    search_budget: int = 20_000,
) -> list[str]:
    """Reconstruct up to ``batch_size`` texts from the attention gradients in ``grads`` (exact spans).

    ``tau_token`` / ``tau_sequence``: residual thresholds of the block-1 token filter and the block-2
    sequence test. Returns [] when either block's attention gradient is missing or zero."""
    spans = layer_spans(model, grads, "attention", (0, 1), "numerical", rtol=rtol)
    return attention_attack(
        model, tokenizer, batch_size, spans, Threshold(tau_token), Threshold(tau_sequence), max_len, search_budget
    )


def attention_attack(
    model: nn.Module,
    tokenizer,
    batch_size: int,
    spans: list[tuple[Span | None, str | None]],
    token_rule: Rule,
    sequence_rule: Rule,
    max_len: int | None = None,
    search_budget: int = 20_000,
    beam: int | None = None,
) -> list[str]:
    """DAGER's two stages on the given block-1 / block-2 spans, with the given acceptance rules.

    ``beam``: most prefixes alive per decoding step (default max(64, 8B))."""
    (span1, probe1), (span2, probe2) = spans
    if span1 is None or span2 is None:
        return []
    limit = max_len or getattr(model.config, "max_position_embeddings", 512)
    with torch.no_grad():
        if is_decoder(model):
            beam = beam or max(64, 8 * batch_size)
            found = _decoder(model, tokenizer, span1, probe1, span2, probe2, token_rule, sequence_rule, limit, beam)
        else:
            found = _encoder(
                model,
                tokenizer,
                batch_size,
                span1,
                probe1,
                span2,
                probe2,
                token_rule,
                sequence_rule,
                limit,
                search_budget,
            )
    return decode(tokenizer, assemble(found, batch_size))


def _passing(rule: Rule, residuals: Tensor, drop: set[int]) -> list[tuple[int, float]]:
    """(token, residual) of the tokens the rule accepts in one vocabulary scan, best first."""
    idx = rule(residuals).nonzero().flatten()
    idx = idx[residuals[idx].argsort()]
    return [(int(i), float(residuals[i])) for i in idx if int(i) not in drop]


# -- causal decoders ----------------------------------------------------------------------------------


def _decoder(model, tokenizer, span1, probe1, span2, probe2, token_rule, sequence_rule, limit, beam):
    drop = {tokenizer.pad_token_id}
    if position_free(model, probe1):
        # RoPE: rotation happens after the projection, so block 1 sees the bare token: one bag, no length.
        bag = [t for t, _ in _passing(token_rule, span1.residual(token_inputs(model, probe1, 0)), drop)]
        per_step = lambda step: bag  # noqa: E731
        steps = limit
    else:
        filters = []
        for position in range(limit):
            passing = _passing(token_rule, span1.residual(token_inputs(model, probe1, position)), drop)
            if not passing:
                break  # the first empty position is the longest sequence's length
            filters.append([t for t, _ in passing])
        per_step = filters.__getitem__
        steps = len(filters)

    vocab = model.get_input_embeddings().num_embeddings
    reference = torch.Generator().manual_seed(0)

    def extend(prefixes):
        pool = list(per_step(len(prefixes[0])))
        if not sequence_rule.exact:
            # An outlier needs a population: random vocabulary tokens stand in for "not in the batch".
            pool = list(dict.fromkeys(pool + torch.randint(vocab, (64,), generator=reference).tolist()))
        if not pool:
            return [([], [])] * len(prefixes)
        ids = torch.tensor([p + (c,) for p in prefixes for c in pool], device=model.device)
        u = module_input(model, probe2, ids).view(len(prefixes), len(pool), len(prefixes[0]) + 1, -1)
        # Causality: earlier positions were verified at earlier steps, only the new one is tested
        # (under noise, against what the prefix's own positions do not already explain).
        r = torch.stack(
            [span2.residual(u[k, :, -1], None if sequence_rule.exact else u[k, 0, :-1]) for k in range(len(prefixes))]
        )
        ok = sequence_rule(r)
        ok &= torch.tensor([[not repeats(p, c) for c in pool] for p in prefixes], device=ok.device)
        return [([pool[j] for j in row.nonzero().flatten().tolist()], r[i, row].tolist()) for i, row in enumerate(ok)]

    return grow(extend, steps, beam, sequence_rule)


# -- bidirectional encoders ---------------------------------------------------------------------------


def _encoder(model, tokenizer, batch_size, span1, probe1, span2, probe2, token_rule, sequence_rule, limit, budget):
    sep, cls, pad = tokenizer.sep_token_id, tokenizer.cls_token_id, tokenizer.pad_token_id
    n_types = getattr(model.config, "type_vocab_size", 0)
    types = list(range(n_types)) if n_types else [None]

    # Block-1 filter over (token, token type) per position; [SEP] hits are sentence ends (length, type).
    columns: list[list[tuple[int, int | None, float]]] = []
    ends: list[tuple[int, int | None]] = []
    for position in range(limit):
        column = []
        for tt in types:
            for tok, res in _passing(token_rule, span1.residual(token_inputs(model, probe1, position, tt)), {pad}):
                if tok == sep:
                    ends.append((position + 1, tt))
                else:
                    column.append((tok, tt, res))
        if not column and not any(length == position + 1 for length, _ in ends):
            break
        columns.append(column)

    found: list[Found] = []
    for length, tt in sorted(ends):
        # Top-B by block-1 residual at each inner position (DAGER's maxB filter); [CLS] and [SEP] are fixed.
        # A position where nothing of this type passed keeps a [PAD] placeholder: the sentence is then
        # only approximate, never exact.
        lists = [
            [t for t, ty, _ in sorted(columns[q], key=lambda c: c[2]) if ty == tt][:batch_size] or [pad]
            for q in range(1, length - 1)
        ]
        while sum(f.exact for f in found) < batch_size:
            used = [f.ids for f in found if f.exact and len(f.ids) == length - 2]
            # Non-overlap heuristic: a token already placed at a position by an exact sentence is not reused.
            pruned = [[t for t in opts if all(u[q] != t for u in used)] or opts for q, opts in enumerate(lists)]
            best, residuals = _search(model, probe2, span2, pruned, cls, sep, tt, budget, sequence_rule)
            exact = sequence_rule.exact and bool(sequence_rule(residuals).all())
            found.append(Found(best, float(residuals.mean()), exact))
            if not exact:
                break
    return found


def _search(model, probe, span, lists, cls, sep, token_type, budget, rule):
    """Best inner token sequence from per-position candidate lists, by mean block-2 residual.

    Enumerates the Cartesian product when it is small; otherwise steepest-descent single-position
    substitutions from the per-position favourites, then from random draws, until a sequence passes
    ``rule`` everywhere or ``budget`` sequences were scored (DAGER's sampling cap, scaled to CPUs)."""

    def score(seqs):
        ids = torch.tensor([[cls, *s, sep] for s in seqs], device=model.device)
        if token_type is None:
            return span.residual(module_input(model, probe, ids))
        return span.residual(module_input(model, probe, ids, token_type_ids=torch.full_like(ids, token_type)))

    size = math.prod(len(opts) for opts in lists)
    if size <= 1024:
        combos = list(itertools.product(*lists))
        res = score(combos)
        i = int(res.mean(-1).argmin())
        return combos[i], res[i]

    gen = torch.Generator().manual_seed(0)
    spent = 0
    best: tuple[int, ...] | None = None
    best_res: Tensor | None = None
    start = tuple(opts[0] for opts in lists)
    while spent < budget:
        current, cur_res = start, score([start])[0]
        spent += 1
        while spent < budget:
            moves = [
                current[:q] + (t,) + current[q + 1 :] for q, opts in enumerate(lists) for t in opts if t != current[q]
            ]
            res = score(moves)
            spent += len(moves)
            k = int(res.mean(-1).argmin())
            if res[k].mean() >= cur_res.mean():
                break
            current, cur_res = moves[k], res[k]
        if best_res is None or cur_res.mean() < best_res.mean():
            best, best_res = current, cur_res
        if rule.exact and bool(rule(best_res).all()):
            break
        start = tuple(opts[int(torch.randint(len(opts), (1,), generator=gen))] for opts in lists)
    return best, best_res
