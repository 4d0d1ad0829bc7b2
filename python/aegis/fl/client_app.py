"""The ClientApp (``flwr run`` component ``aegis.fl.client_app:app``): one FedSGD step on this SuperNode's
shard of the corpus, masked by AEGIS under :class:`~aegis.fl.client.AegisMod` (settings from the run config).

A SuperNode keeps one :class:`~aegis.fl.client.ClientTrainer` per (run, node, partition, settings) for the
life of the process, so its model and batches are built once.
"""

from __future__ import annotations

from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from .client import AegisMod, ClientTrainer
from .task import decoder, settings, train_batches

_TRAINERS: dict[tuple, ClientTrainer] = {}


def trainer(context: Context) -> ClientTrainer:
    """This SuperNode's trainer (built on first use, then kept)."""
    s = settings(context.run_config)
    part = int(context.node_config.get("partition-id", 0))
    parts = int(context.node_config.get("num-partitions", 1))
    key = (context.run_id, context.node_id, part, parts, *(s[k] for k in sorted(s)))
    if key not in _TRAINERS:
        model, tok = decoder(s)
        _TRAINERS[key] = ClientTrainer(model, train_batches(tok, part, parts, int(s["batch-size"])))
    return _TRAINERS[key]


app = ClientApp()
client_app = app  # the name ``aegis.fl.app`` has always exported


@app.train(mods=[AegisMod()])
def train(msg: Message, context: Context) -> Message:
    """One FedSGD step on this SuperNode's corpus shard, masked by AEGIS (settings from the run config)."""
    return trainer(context)(msg, context)
