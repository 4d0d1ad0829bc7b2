"""The ServerApp (``flwr run`` component ``aegis.fl.server_app:app``): FedSGD on the trainable
(non-attention) parameters of the app's decoder, validation loss/perplexity after every round.

Clients send no loss (it is an oracle for their batch, see :mod:`aegis.fl.client`): the curve is the
server's own :func:`~aegis.fl.task.validation_loss` on the held-out validation split.
"""

from __future__ import annotations

import math
from typing import cast

from flwr.app import ArrayRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp

from ..exposure import ExposurePolicy
from ..shield import protect
from .client import load_arrays, trainable_arrays
from .floor import config_from_run_config
from .secure.app import is_secure, server_main
from .strategy import FedSGD, fail_unless_accepted
from .task import decoder, settings, validation_batches, validation_loss

app = ServerApp()
server_app = app  # the name ``aegis.fl.app`` has always exported


@app.main()
def main(grid: Grid, context: Context) -> None:
    """FedSGD on the trainable (non-attention) parameters; validation loss/perplexity after every round,
    also written to ``context.state["evaluation"]`` (lists indexed by round, round 0 = initial model).
    With ``secure = true`` in the run config: secure rounds over SecAgg+ (:func:`aegis.fl.secure.app.server_main`)."""
    if is_secure(context.run_config):
        return server_main(grid, context)
    if context.run_config.get("aggregation", "fedsgd") != "fedsgd":
        raise ValueError(f"run config 'aggregation' = {context.run_config['aggregation']!r}: the plain app runs "
                         "FedSGD only; set secure = true for FedAvg")
    s = settings(context.run_config)
    model, tok = decoder(s)
    # the server exports nothing: no exposure budget to keep
    protect(model, None, config_from_run_config(context.run_config).replace(exposure=ExposurePolicy.OFF))
    validation = validation_batches(tok)
    history: dict[str, list[float]] = {"validation-loss": [], "validation-perplexity": []}

    def evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        load_arrays(model, arrays)
        loss = validation_loss(model, validation)
        history["validation-loss"].append(loss)
        history["validation-perplexity"].append(math.exp(loss))
        return MetricRecord({"validation-loss": loss, "validation-perplexity": math.exp(loss)})

    strategy = FedSGD(
        optimizer=str(s["server-optimizer"]),
        lr=float(s["lr"]),
        fraction_train=float(s["fraction-train"]),
        min_train_nodes=int(s["min-nodes"]),
        min_available_nodes=int(s["min-nodes"]),
    )
    result = strategy.start(grid=grid, initial_arrays=trainable_arrays(model), num_rounds=int(s["num-server-rounds"]),
                            evaluate_fn=evaluate)
    context.state["evaluation"] = MetricRecord({**history})  # a fresh dict typed as MetricRecord's values
    accepted = sum(int(cast(int, m.get("clients-ok", 0))) for m in result.train_metrics_clientapp.values())
    fail_unless_accepted(accepted, int(s["num-server-rounds"]))

