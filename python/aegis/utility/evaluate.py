"""Held-out utility of a global model, in torch only (the GPU machine has no sklearn): token-weighted
validation perplexity for a decoder, accuracy and macro-F1 for a classifier."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn

from ..data import Example

EVAL_BATCH = 16


def macro_f1(pred: Tensor, truth: Tensor, classes: int) -> float:
    """Mean over the classes present in ``truth`` or ``pred`` of 2 TP / (2 TP + FP + FN)."""
    scores = []
    for k in range(classes):
        tp = int(((pred == k) & (truth == k)).sum())
        fp = int(((pred == k) & (truth != k)).sum())
        fn = int(((pred != k) & (truth == k)).sum())
        if tp + fp + fn:
            scores.append(2 * tp / (2 * tp + fp + fn))
    return sum(scores) / len(scores) if scores else 0.0


def evaluator(
    kind: str, build: Callable[[Sequence[Example]], dict[str, Tensor]], validation: Sequence[Example], classes: int
) -> Callable[[nn.Module], dict[str, float]]:
    """``model -> metrics`` on ``validation`` (batches built once, moved to the model's device at call time)."""
    batches = [build(validation[i : i + EVAL_BATCH]) for i in range(0, len(validation), EVAL_BATCH)]

    @torch.no_grad()
    def evaluate(model: nn.Module) -> dict[str, float]:
        was = model.training
        model.eval()
        device = next(model.parameters()).device
        nll, tokens, preds, truths = 0.0, 0, [], []
        try:
            for batch in batches:
                batch = {k: v.to(device) for k, v in batch.items()}
                out = model(**batch)
                if kind == "decoder":
                    # the model's loss is a mean over the batch's predicted tokens: weight it by their count
                    n = int((batch["labels"][:, 1:] != -100).sum())
                    nll += float(out.loss) * n
                    tokens += n
                else:
                    preds.append(out.logits.argmax(-1).cpu())
                    truths.append(batch["labels"].cpu())
        finally:
            model.train(was)
        if kind == "decoder":
            loss = nll / max(1, tokens)
            return {"val_loss": loss, "perplexity": math.exp(min(loss, 50.0))}
        pred, truth = torch.cat(preds), torch.cat(truths)
        return {"accuracy": float((pred == truth).float().mean()), "f1": macro_f1(pred, truth, classes)}

    return evaluate


def metric_of(kind: str) -> str:
    return "perplexity" if kind == "decoder" else "accuracy"
