"""Reconstruction metrics as DAGER reports them (DESIGN §6.1) and a matched null baseline.

Words are rouge-score's tokens (lowercased alphanumeric runs, no stemming), so case and punctuation do
not count. Scores average over references: a reference nobody reconstructed scores 0.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn

_KEYS = ("rouge1", "rouge2", "rougeL")


def _words(text: str) -> list[str]:
    from rouge_score.tokenizers import DefaultTokenizer

    return DefaultTokenizer(use_stemmer=False).tokenize(text)


def _scorer():
    from rouge_score import rouge_scorer

    return rouge_scorer.RougeScorer(list(_KEYS), use_stemmer=False)


def align(predictions: Sequence[str], references: Sequence[str], alignment: str = "greedy") -> list[int | None]:
    """Index of the prediction matched to each reference (None: unmatched).

    ``greedy`` (DAGER's decoders): the prediction with the most position-wise equal words; a prediction
    may serve several references. ``hungarian`` (DAGER's encoders, LAMP): one-to-one assignment
    maximising ROUGE-1 F."""
    if not predictions:
        return [None] * len(references)
    if alignment == "greedy":
        pred_words = [_words(p) for p in predictions]
        out: list[int | None] = []
        for ref in references:
            ref_words = _words(ref)
            agree = [sum(a == b for a, b in zip(ref_words, pw)) for pw in pred_words]
            out.append(max(range(len(predictions)), key=agree.__getitem__))
        return out
    if alignment == "hungarian":
        from scipy.optimize import linear_sum_assignment

        scorer = _scorer()
        cost = [[1.0 - scorer.score(ref, pred)["rouge1"].fmeasure for pred in predictions] for ref in references]
        rows, cols = linear_sum_assignment(cost)
        matched: list[int | None] = [None] * len(references)
        for r, c in zip(rows, cols):
            matched[r] = int(c)
        return matched
    raise ValueError(f"alignment={alignment!r}: use 'greedy' or 'hungarian'")


def rouge(predictions: Sequence[str], references: Sequence[str], alignment: str = "greedy") -> dict[str, float]:
    """Mean ROUGE-1/2/L F-measure over references after DAGER's alignment.

    The mean replaces the bootstrap median DAGER prints (same centre, deterministic)."""
    if not references:
        raise ValueError("rouge needs at least one reference")
    scorer = _scorer()
    totals = dict.fromkeys(_KEYS, 0.0)
    for ref, j in zip(references, align(predictions, references, alignment)):
        if j is not None:
            scores = scorer.score(ref, predictions[j])
            for k in _KEYS:
                totals[k] += scores[k].fmeasure
    return {k: v / len(references) for k, v in totals.items()}


def token_recall(predictions: Sequence[str], references: Sequence[str], tokenizer=None) -> float:
    """Share of the distinct reference tokens that occur anywhere in the predictions (batch level).

    Tokens are rouge words, or the ``tokenizer``'s ids (no special tokens) when given: the right unit
    for token-bag attacks, whose output is a bag of sub-word tokens."""
    if tokenizer is None:
        split = _words
    else:
        split = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    wanted = {t for ref in references for t in split(ref)}
    got = {t for pred in predictions for t in split(pred)}
    return len(wanted & got) / len(wanted) if wanted else 0.0


def exact_rate(predictions: Sequence[str], references: Sequence[str]) -> float:
    """Share of references reproduced word for word by some prediction."""
    if not references:
        return 0.0
    preds = {tuple(_words(p)) for p in predictions}
    return sum(tuple(_words(r)) in preds for r in references) / len(references)


def null_gradient(grads: dict[str, Tensor], seed: int = 0) -> dict[str, Tensor]:
    """Gaussian tensors with the same names, shapes and per-tensor norms as ``grads`` (zeros stay zero)."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, g in grads.items():
        z = torch.randn(g.shape, generator=gen, dtype=torch.float32).to(g.device, g.dtype)
        out[name] = z * (g.float().norm() / z.float().norm().clamp_min(1e-30)).to(g.dtype)
    return out


def null_baseline(
    attack: Callable[..., list[str]],
    model: nn.Module,
    grads: dict[str, Tensor],
    tokenizer,
    batch_size: int,
    references: Sequence[str],
    *,
    alignment: str | None = None,
    seed: int = 0,
    **attack_kwargs,
) -> dict[str, float]:
    """ROUGE of ``attack`` run on ``null_gradient(grads)``: what it "recovers" from a gradient that holds
    no information about the batch. A defence is judged against max(0.05, null + 0.05).

    ``alignment`` defaults to greedy for decoders and hungarian for encoders, as in DAGER."""
    from .models import is_decoder

    predictions = attack(model, null_gradient(grads, seed), tokenizer, batch_size, **attack_kwargs)
    if alignment is None:
        alignment = "greedy" if is_decoder(model) else "hungarian"
    return rouge(predictions, references, alignment)
