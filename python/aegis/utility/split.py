"""Non-identical client data: a seeded Dirichlet split of each label (topic) over the clients, and each
client's stream of batches (a fresh seeded shuffle every local epoch, full batches only).

Unlabelled data (a .txt file) is split by contiguous blocks of the seeded order instead, which is what a
federation of different writers looks like when no label says who wrote what.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import numpy as np

from ..data import Example
from ..errors import UsageError

MAX_DRAWS = 200


def dirichlet_split(
    examples: Sequence[Example], clients: int, alpha: float, seed: int, min_size: int
) -> list[list[Example]]:
    """``clients`` disjoint shards covering ``examples``; per label, the share each client gets is drawn from
    Dir(alpha). Draws repeat (seeded) until every shard holds ``min_size`` examples (a client needs one batch)."""
    if clients * min_size > len(examples):
        raise UsageError(
            "--clients",
            f"{clients} clients x batch {min_size} needs {clients * min_size} training sentences, the data has "
            f"{len(examples)}: use fewer clients or a smaller --batch-size",
        )
    rng = np.random.default_rng(seed)
    labels = sorted({e.label for e in examples if e.label is not None})
    groups = [[e for e in examples if e.label == lab] for lab in labels] if labels else []
    for _ in range(MAX_DRAWS):
        shards: list[list[Example]] = [[] for _ in range(clients)]
        if groups:
            for group in groups:
                order = rng.permutation(len(group))
                cuts = (np.cumsum(rng.dirichlet([alpha] * clients))[:-1] * len(group)).astype(int)
                for c, part in enumerate(np.split(order, cuts)):
                    shards[c].extend(group[i] for i in part)
        else:
            order = rng.permutation(len(examples))
            for c, part in enumerate(np.array_split(order, clients)):
                shards[c].extend(examples[i] for i in part)
        if min(map(len, shards)) >= min_size:
            return shards
    raise UsageError(
        "--dirichlet-alpha",
        f"no split in {MAX_DRAWS} draws gave every client {min_size} sentences: raise the alpha or use fewer clients",
    )


class BatchStream:
    """One client's batches in order: epoch after epoch over its shard, reshuffled (seeded) each epoch."""

    def __init__(self, shard: Sequence[Example], batch_size: int, seed: int) -> None:
        if len(shard) < batch_size:
            raise ValueError(f"a shard of {len(shard)} sentences cannot fill a batch of {batch_size}")
        self.shard, self.batch_size = list(shard), batch_size
        self.per_epoch = len(shard) // batch_size
        self._rng = random.Random(seed)
        self._batches: list[list[Example]] = []

    def batch(self, index: int) -> list[Example]:
        """The ``index``-th batch of the stream (0-based)."""
        while len(self._batches) <= index:
            order = list(self.shard)
            self._rng.shuffle(order)
            self._batches += [order[i * self.batch_size : (i + 1) * self.batch_size] for i in range(self.per_epoch)]
        return self._batches[index]
