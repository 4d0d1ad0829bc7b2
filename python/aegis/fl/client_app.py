"""The ClientApp (``flwr run`` component ``aegis.fl.client_app:app``): one FedSGD step on this SuperNode's
shard of the corpus, masked by AEGIS under :class:`~aegis.fl.client.AegisMod`, or a secure round's stage
(:mod:`aegis.fl.secure.app`) on a node that pins its survivors.

The node's own settings (:mod:`aegis.fl.node`) decide what the server may not: the preset it runs at least
(the run config may only tighten it, :mod:`aegis.fl.floor`), how many runs it keeps, and how soon it
replies. A batch size outside the promise of the resulting configuration is refused.

A SuperNode keeps one :class:`~aegis.fl.client.ClientTrainer` per (run, node, partition, settings), for its
``aegis-max-runs`` most recent runs, so its model and batches are built once per run.
"""

from __future__ import annotations

import os

from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from .client import AegisMod, ClientTrainer, active_config, refuse
from .node import ReplyFloor, RunCache, max_runs, node_floor, reply_floor, simulated
from .secure.app import PIN_ENV, PIN_KEY, client_train, is_secure
from .task import decoder, settings, train_batches

_TRAINERS: RunCache[ClientTrainer] = RunCache()
_CLOCK = ReplyFloor(reply_floor)


def trainer(context: Context) -> ClientTrainer:
    """This SuperNode's trainer of the run (built on first use, kept while the run is among the node's
    ``aegis-max-runs`` most recent)."""
    s = settings(context.run_config)
    part = int(context.node_config.get("partition-id", 0))
    parts = int(context.node_config.get("num-partitions", 1))
    key = (context.node_id, part, parts, *(s[k] for k in sorted(s)))

    def build() -> ClientTrainer:
        model, tok = decoder(s)
        return ClientTrainer(model, train_batches(tok, part, parts, int(s["batch-size"])))

    return _TRAINERS.get(context.run_id, key, build, max_runs(context))


app = ClientApp()
client_app = app  # the name ``aegis.fl.app`` has always exported


@app.train()
def train(msg: Message, context: Context) -> Message:
    """One FedSGD step on this SuperNode's corpus shard, masked by AEGIS at the node's floor.

    A node that pins its survivor count (node config ``aegis-min-survivors`` or ``AEGIS_MIN_SURVIVORS``)
    answers only secure rounds (:func:`aegis.fl.secure.app.client_train`), whatever the run config says;
    an unpinned node asked for one refuses. Every reply of a node that is not simulated leaves no earlier
    than its reply floor (:class:`~aegis.fl.node.ReplyFloor`); building the run's model is not timed."""
    try:
        reply_floor(context)  # a bad node setting is refused here, outside the clock
        if is_secure(context.run_config) or PIN_KEY in context.node_config or PIN_ENV in os.environ:
            return client_train(msg, context, None if simulated() else _CLOCK)
        mod, fit = AegisMod(node_floor(context)), trainer(context)
    except (ValueError, TypeError) as err:
        return refuse(msg, str(err))
    if simulated():
        return mod(msg, context, lambda m, c: _step(m, c, fit))
    return _CLOCK(msg, context, lambda m, c: mod(m, c, lambda m2, c2: _step(m2, c2, fit)))


def _step(msg: Message, context: Context, fit: ClientTrainer) -> Message:
    """The step under the mod's configuration, refused when the run's batch size lies outside its promise."""
    config = active_config()
    if config is None:
        raise RuntimeError("the app's train step runs under AegisMod")
    config.check_batch(int(settings(context.run_config)["batch-size"]))
    return fit(msg, context)
