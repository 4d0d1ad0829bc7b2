"""The loss oracle: which candidate batch a client trained on, from the loss value it reported.

A client that reports its batch loss ``L(θ; x)`` beside its update (Flower's ``train-loss`` is the common
habit) gives a server that holds the global model ``θ`` an exact test: the server computes ``L(θ; x')`` for
any candidate batch ``x'`` and ranks the candidates by ``|L(θ; x') − reported|``. The private batch scores
``|Δ| ≈ 0`` (float rounding, ~1e-7), while any other candidate differs at the third decimal or earlier, so
whatever the candidate set — the word orders of a known bag of tokens (the bag itself leaks through the
embedding rows), the N values of a formatted secret, which of N sentences — the truth comes first.

Nothing is learnt from a reply that carries no loss: :func:`reported_loss` says so (``None``), and a caller
must report "nothing to read" rather than a score. AEGIS clients send no loss (``aegis.fl.client``).
"""
from __future__ import annotations

import itertools
import math
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.nn import functional as F

__all__ = [
    "LossRanking",
    "batch_losses",
    "rank_by_loss",
    "reported_loss",
    "sequence_losses",
    "word_orders",
]

Batch = Mapping[str, Tensor]
LossFn = Callable[[nn.Module, Batch], Tensor]


def _model_loss(model: nn.Module, batch: Batch) -> Tensor:
    return model(**batch).loss


def reported_loss(metrics: Mapping[str, object]) -> tuple[str, float] | None:
    """The first finite metric whose name contains "loss" (names in sorted order) as ``(name, value)``;
    None when the reply carries no loss (nothing for the oracle to read)."""
    for key in sorted(metrics):
        value = metrics[key]
        if "loss" in key.lower() and isinstance(value, (int, float)) and not isinstance(value, bool):
            if math.isfinite(float(value)):
                return key, float(value)
    return None


@dataclass(frozen=True)
class LossRanking:
    """Candidates ranked by how far their loss lies from the reported one (lower gap ranks higher)."""

    reported: float
    losses: list[float]  # the candidates' losses, in candidate order
    gaps: list[float]  # |loss − reported|, in candidate order

    @property
    def order(self) -> list[int]:
        """Candidate indices, best first."""
        return sorted(range(len(self.gaps)), key=self.gaps.__getitem__)

    def rank(self, index: int) -> float:
        """1-based rank of candidate ``index``; ties count half (the expected rank under a random tie-break)."""
        from .fingerprint import rank_of_truth

        return rank_of_truth(self.gaps, index)

    def top_share(self, index: int) -> float:
        """Probability that candidate ``index`` is picked first (random tie-break among equal gaps)."""
        from .fingerprint import top_share

        return top_share(self.gaps, index)


def rank_by_loss(reported: float, losses: Sequence[float]) -> LossRanking:
    """Rank candidates whose losses are ``losses`` against the ``reported`` loss."""
    if not math.isfinite(reported):
        raise ValueError(f"reported={reported}: the reported loss must be a finite number")
    if not losses:
        raise ValueError("losses is empty: pass one loss per candidate")
    values = [float(v) for v in losses]
    return LossRanking(float(reported), values, [abs(v - reported) for v in values])


@torch.no_grad()
def batch_losses(model: nn.Module, batches: Sequence[Batch], loss_fn: LossFn = _model_loss) -> list[float]:
    """``loss_fn(model, batch)`` of every candidate batch, in eval mode as the clients compute it (any model,
    any batch size: an encoder's batches carry their labels)."""
    was = model.training
    model.eval()
    device = next(model.parameters()).device
    try:
        return [float(loss_fn(model, {k: torch.as_tensor(v).to(device) for k, v in b.items()})) for b in batches]
    finally:
        model.train(was)


@torch.no_grad()
def sequence_losses(model: nn.Module, sequences: Sequence[Sequence[int]], chunk: int = 128) -> list[float]:
    """The causal-LM loss of each single sequence as a batch of one (mean next-token cross-entropy over its
    positions, what ``model(input_ids=s, labels=s).loss`` gives), sequences of one length run together."""
    if any(len(s) < 2 for s in sequences):
        raise ValueError("every sequence needs at least 2 tokens (a causal-LM loss predicts tokens 2..T)")
    was = model.training
    model.eval()
    device = next(model.parameters()).device
    out = [0.0] * len(sequences)
    by_length: dict[int, list[int]] = {}
    for i, s in enumerate(sequences):
        by_length.setdefault(len(s), []).append(i)
    try:
        for indices in by_length.values():
            for start in range(0, len(indices), chunk):
                part = indices[start : start + chunk]
                ids = torch.tensor([list(sequences[i]) for i in part], device=device)
                logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits.float()
                ce = F.cross_entropy(logits[:, :-1].transpose(1, 2), ids[:, 1:], reduction="none").mean(1)
                for i, value in zip(part, ce.tolist()):
                    out[i] = value
    finally:
        model.train(was)
    return out


def word_orders(tokens: Sequence[int], limit: int = 1000, seed: int = 0) -> list[tuple[int, ...]]:
    """Distinct orderings of a bag of tokens: all of them when there are at most ``limit`` (in lexicographic
    order of the sorted bag, so the list does not depend on the order the bag was given in), else ``limit``
    distinct orderings drawn with ``seed``."""
    if limit < 1:
        raise ValueError(f"limit={limit}: ask for at least one ordering")
    bag = sorted(int(t) for t in tokens)
    counts: dict[int, int] = {}
    for t in bag:
        counts[t] = counts.get(t, 0) + 1
    distinct = math.factorial(len(bag))
    for c in counts.values():
        distinct //= math.factorial(c)
    if distinct <= limit:
        return sorted(set(itertools.permutations(bag)))
    rng = random.Random(seed)
    seen: set[tuple[int, ...]] = set()
    while len(seen) < limit:
        order = bag[:]
        rng.shuffle(order)
        seen.add(tuple(order))
    return sorted(seen)
