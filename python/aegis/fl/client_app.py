"""The ClientApp (``flwr run`` component ``aegis.fl.client_app:app``): one FedSGD step on this SuperNode's
shard of the corpus, masked by AEGIS under :class:`~aegis.fl.client.AegisMod` (settings from the run config),
or a secure round's stage (:mod:`aegis.fl.secure_app`) on a node that pins its survivors.

A SuperNode keeps one :class:`~aegis.fl.client.ClientTrainer` per (run, node, partition, settings) for the
life of the process, so its model and batches are built once.
"""

from __future__ import annotations

import os

from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from .client import AegisMod, ClientTrainer, refuse
from .secure_app import PIN_ENV, PIN_KEY, client_train, is_secure
from .task import decoder, settings, train_batches

_TRAINERS: dict[tuple, ClientTrainer] = {}
_AEGIS = AegisMod()


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


@app.train()
def train(msg: Message, context: Context) -> Message:
    """One FedSGD step on this SuperNode's corpus shard, masked by AEGIS (settings from the run config).

    A node that pins its survivor count (node config ``aegis-min-survivors`` or ``AEGIS_MIN_SURVIVORS``)
    answers only secure rounds (:func:`aegis.fl.secure_app.client_train`), whatever the run config says;
    an unpinned node asked for one refuses."""
    try:
        secure = is_secure(context.run_config) or PIN_KEY in context.node_config or PIN_ENV in os.environ
    except TypeError as err:
        return refuse(msg, str(err))
    if secure:
        return client_train(msg, context)
    return _AEGIS(msg, context, lambda m, c: trainer(c)(m, c))
