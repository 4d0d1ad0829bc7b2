"""What the Flower app trains and evaluates (Flower's ``task.py``): the model, the data and the loss.

The run config keys the app reads (:data:`DEFAULT_RUN_CONFIG`), an offline GPT-2 decoder of their shape (built once
per process and copied per caller: a SuperNode or the server never rebuild it), each SuperNode's shard of
the shipped corpus, and the server's held-out validation loss.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from ..data import load_corpus
from ..defence import Batch

DEFAULT_RUN_CONFIG: dict[str, Any] = {
    "num-server-rounds": 3,
    "lr": 0.1,
    "server-optimizer": "sgd",
    "batch-size": 4,
    "model-layers": 2,
    "model-width": 384,
    "model-heads": 6,
    "min-nodes": 2,
    "fraction-train": 1.0,
}
VALIDATION_BATCH = 16  # bounded logits memory on the server

# (layers, width, heads) -> (model, tokenizer): the process-wide cache of built decoders, the MODELS_KEPT
# most recently used shapes (the shapes are the run config's: a server must not grow it without bound)
_MODELS: OrderedDict[tuple[int, int, int], tuple[nn.Module, Any]] = OrderedDict()
MODELS_KEPT = 2


def settings(run_config: Mapping[str, Any]) -> dict[str, Any]:
    """:data:`DEFAULT_RUN_CONFIG` with the run config's values for its keys (other keys ignored)."""
    return {**DEFAULT_RUN_CONFIG, **{k: v for k, v in run_config.items() if k in DEFAULT_RUN_CONFIG}}


def decoder(s: Mapping[str, Any]) -> tuple[nn.Module, Any]:
    """A fresh copy of an offline GPT-2 decoder of the run config's shape (built once per process) and its
    tokenizer.

    Width 384 uses MiniLM's pretrained embeddings; other widths are random (small test federations)."""
    key = (int(s["model-layers"]), int(s["model-width"]), int(s["model-heads"]))
    if key not in _MODELS:
        from ..models import DecoderArch, default_decoder

        while len(_MODELS) >= MODELS_KEPT:
            _MODELS.popitem(last=False)
        _MODELS[key] = default_decoder(arch=DecoderArch.GPT2, n_layer=key[0], n_embd=key[1], n_head=key[2])
    _MODELS.move_to_end(key)
    model, tok = _MODELS[key]
    return copy.deepcopy(model), tok


def tokenize(tok, texts: Sequence[str]) -> Batch:
    """A causal-LM batch: right padding, pads masked out of attention and out of the loss (label -100)."""
    enc = tok(list(texts), padding=True, return_tensors="pt")
    labels = enc["input_ids"].masked_fill(enc["attention_mask"] == 0, -100)
    return {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"], "labels": labels}


def train_batches(tok, partition: int, partitions: int, batch_size: int) -> list[Batch]:
    """SuperNode ``partition``'s shard of the corpus's train split, in full batches of ``batch_size`` (a short
    last batch would tell the shard's size, and lie outside a preset's smallest batch)."""
    texts = [e.text for e in load_corpus("train")][partition::partitions]
    if len(texts) < batch_size:
        raise ValueError(f"run config 'batch-size' = {batch_size}: this node's shard holds {len(texts)} texts "
                         f"(partition {partition} of {partitions}); use a batch size of at most {len(texts)}")
    return [tokenize(tok, texts[i : i + batch_size]) for i in range(0, len(texts) - batch_size + 1, batch_size)]


def validation_batches(tok) -> list[Batch]:
    """The corpus's validation split: the server's held-out data."""
    texts = [e.text for e in load_corpus("validation")]
    return [tokenize(tok, texts[i : i + VALIDATION_BATCH]) for i in range(0, len(texts), VALIDATION_BATCH)]


def validation_loss(model: nn.Module, batches: Sequence[Batch]) -> float:
    """Token-weighted mean loss of a causal LM over batches (labels -100 excluded)."""
    total = tokens = 0.0
    with torch.no_grad():
        for batch in batches:
            # HF shifts labels by one: the first label of every row is never predicted.
            n = float((batch["labels"][:, 1:] != -100).sum())
            total += float(model(**batch).loss) * n
            tokens += n
    return total / tokens
