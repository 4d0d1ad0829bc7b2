"""The one held-out evaluator of the audit and the utility study, in torch only (the GPU machine has no
sklearn): token-weighted validation loss and perplexity for a decoder; mean loss, accuracy and macro-F1
for a classifier. Batches of :data:`EVAL_BATCH` are built once; the numbers do not depend on the batching."""

from __future__ import annotations

import math
from collections import Counter
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
        nll, count, preds, truths = 0.0, 0, [], []
        try:
            for batch in batches:
                batch = {k: v.to(device) for k, v in batch.items()}
                out = model(**batch)
                # the model's loss is a mean over the batch's predicted tokens (decoder) or sequences: weight
                # it by their count
                if kind == "decoder":
                    n = int((batch["labels"][:, 1:] != -100).sum())
                else:
                    n = len(batch["labels"])
                    preds.append(out.logits.argmax(-1).cpu())
                    truths.append(batch["labels"].cpu())
                nll += float(out.loss) * n
                count += n
        finally:
            model.train(was)
        loss = nll / max(1, count)
        if kind == "decoder":
            return {"val_loss": loss, "perplexity": math.exp(min(loss, 50.0))}
        pred, truth = torch.cat(preds), torch.cat(truths)
        return {"val_loss": loss, "accuracy": float((pred == truth).float().mean()),
                "f1": macro_f1(pred, truth, classes)}

    return evaluate


def metric_of(kind: str) -> str:
    """The headline utility metric of a model kind."""
    return "perplexity" if kind == "decoder" else "accuracy"


def chance_accuracy(kind: str, validation: Sequence[Example]) -> float | None:
    """A classifier's accuracy from always guessing the commonest validation label (None for a decoder)."""
    if kind == "decoder" or not validation:
        return None
    return max(Counter(e.label for e in validation).values()) / len(validation)
