"""Secure rounds as a Flower app: ``flwr run`` with ``secure = true`` in ``[tool.flwr.app.config]``.

:mod:`aegis.fl.server_app` and :mod:`aegis.fl.client_app` hand a secure run to this module:

* :func:`server_main` runs Flower's ``DefaultWorkflow(fit_workflow=SecAggPlusWorkflow(...))`` with
  :class:`~aegis.fl.secure.server.SecureStrategy` on the app's decoder (:mod:`aegis.fl.task`), FedSGD or
  FedAvg (``aggregation``), the reconstruction threshold ``min-survivors``, a clipping range that covers
  the clients' updates, and validation loss after every round.
* :func:`client_train` is the train function of a node that pins its survivor count itself: from its
  own node config (``flower-supernode --node-config 'aegis-min-survivors=3'``) or its own environment
  (``AEGIS_MIN_SURVIVORS``), never from the run config or a message (both come from the server). It runs
  ``SecureGuard -> secaggplus_mod -> SecureTrainer`` (:mod:`aegis.fl.secure.client`) with the cipher masks
  (:mod:`aegis.fl.secure.patch`). A pinned node answers nothing but SecAgg+ rounds; an unpinned node
  asked for a secure round refuses.

Both sides write what they saw under ``$AEGIS_FL_RECORD_DIR`` when their own process has it set
(:mod:`aegis.fl.secure.record`): a diagnostic for tests, off by default.
"""
from __future__ import annotations

import logging
import math
import os
from collections.abc import Mapping
from typing import Any, cast

import numpy as np
import torch
from flwr.app import Context, Message, MetricRecord
from flwr.client.mod import secaggplus_mod
from flwr.server import LegacyContext, ServerConfig
from flwr.server.workflow import DefaultWorkflow
from flwr.serverapp import Grid

from ...config import AegisConfig
from ...exposure import ExposurePolicy
from ...shield import protect
from ..client import refuse, trainable_arrays
from ..floor import config_from_run_config
from ..node import ReplyFloor, RunCache, max_runs, node_floor
from ..strategy import fail_unless_accepted
from ..task import DEFAULT_RUN_CONFIG, decoder, train_batches, validation_batches, validation_loss
from . import patch
from .client import SecureTrainer
from .guard import MAX_WEIGHT, SecureGuard, SurvivorPin, check_quantisation
from .record import ClientRecord, RecordingGrid, ServerRecord
from .server import SecAggPlus, SecureStrategy, required_clipping_range

# Run config keys of a secure run (the server's choices) and their defaults.
SECURE_RUN_CONFIG: dict[str, Any] = {
    "secure": False,
    "aggregation": "fedsgd",  # or "fedavg": clients take local-steps SGD steps at lr
    "min-survivors": 2,  # SecAggPlusWorkflow's reconstruction threshold; each client checks it against its pin
    "local-steps": 1,
    "secagg-timeout": 300.0,  # seconds a SecAgg+ stage waits for replies; a node silent that long drops out
}
QUANTIZATION_RANGE, MODULUS_RANGE = 2**22, 2**32
# The node's own pin: node config key, else environment variable (a server-side value never counts).
PIN_KEY, PEERS_KEY = "aegis-min-survivors", "aegis-peers"
PIN_ENV, PEERS_ENV = "AEGIS_MIN_SURVIVORS", "AEGIS_PEERS"
log = logging.getLogger("flwr")  # what flwr run --stream shows from the ServerApp


def is_secure(run_config: Mapping[str, Any]) -> bool:
    """The run config's ``secure`` key (a boolean, default false)."""
    value = run_config.get("secure", False)
    if not isinstance(value, bool):
        raise TypeError(f"run config 'secure' = {value!r}: use true or false")
    return value


def secure_settings(run_config: Mapping[str, Any]) -> dict[str, Any]:
    """The app's settings and the secure keys, checked (the error names the key and the fix)."""
    s = {**DEFAULT_RUN_CONFIG, **SECURE_RUN_CONFIG,
         **{k: v for k, v in run_config.items() if k in DEFAULT_RUN_CONFIG or k in SECURE_RUN_CONFIG}}
    if s["aggregation"] not in ("fedsgd", "fedavg"):
        raise ValueError(f"run config 'aggregation' = {s['aggregation']!r}: use \"fedsgd\" or \"fedavg\"")
    for key, least in (("min-survivors", 2), ("local-steps", 1), ("min-nodes", 2), ("num-server-rounds", 1)):
        if isinstance(s[key], bool) or not isinstance(s[key], int) or s[key] < least:
            raise ValueError(f"run config '{key}' = {s[key]!r}: use an integer >= {least}")
    if s["min-nodes"] < s["min-survivors"]:
        raise ValueError(f"run config 'min-nodes' = {s['min-nodes']} is below 'min-survivors' = "
                         f"{s['min-survivors']}: no round could reach its threshold; raise min-nodes")
    if not float(s["secagg-timeout"]) > 0:
        raise ValueError(f"run config 'secagg-timeout' = {s['secagg-timeout']!r}: use a positive number of seconds")
    return s


def node_pin(context: Context) -> SurvivorPin | None:
    """This node's :class:`SurvivorPin` from its node config or environment; None if it has none."""
    value = context.node_config.get(PIN_KEY, os.environ.get(PIN_ENV))
    if value is None:
        return None
    peers = context.node_config.get(PEERS_KEY, os.environ.get(PEERS_ENV))
    try:
        pin = int(value)
        allowed = None if peers in (None, "") else frozenset(int(p) for p in str(peers).replace(",", " ").split())
    except ValueError as err:
        raise ValueError(f"{PIN_KEY} = {value!r}, {PEERS_KEY} = {peers!r}: give an integer pin and node ids "
                         "separated by spaces") from err
    return SurvivorPin(pin, allowed)


# -- server ----------------------------------------------------------------------------------------
def server_main(grid: Grid, context: Context) -> None:
    """Secure FedSGD / FedAvg rounds of the app's decoder; validation loss in ``context.state["evaluation"]``
    (lists indexed by round, round 0 = initial model), survivors per round in ``context.state["secure"]``."""
    patch.install()
    s = secure_settings(context.run_config)
    config = config_from_run_config(context.run_config)
    steps = s["local-steps"] if s["aggregation"] == "fedavg" else 1
    threshold, nodes = s["min-survivors"], s["min-nodes"]
    model, tok = decoder(s)
    clipping = required_clipping_range(model, SurvivorPin(threshold), config, steps)
    check_quantisation(clipping_range=clipping, quantization_range=QUANTIZATION_RANGE, modulus_range=MODULUS_RANGE,
                       max_weight=MAX_WEIGHT, clients=nodes)
    # the global arrays: attention frozen, as on clients; the server masks nothing and tracks no exposure
    shield = protect(model, None, config.replace(exposure=ExposurePolicy.OFF))
    arrays = trainable_arrays(model)
    names = list(arrays.keys())
    validation = validation_batches(tok)
    record = ServerRecord.from_env(names, clipping_range=clipping, quantization_range=QUANTIZATION_RANGE,
                                   modulus_range=MODULUS_RANGE, patched=patch.installed())
    history: dict[str, list[float]] = {"validation-loss": [], "validation-perplexity": []}
    curves = cast(dict[str, Any], history)  # MetricRecord's value type names list[float]; dict is invariant
    params = dict(model.named_parameters())

    def evaluate() -> float:
        loss = validation_loss(model, validation)
        history["validation-loss"].append(loss)
        history["validation-perplexity"].append(math.exp(loss))
        return loss

    def on_round(server_round: int, arrays_now: list[np.ndarray]) -> None:
        with torch.no_grad():
            for name, value in zip(names, arrays_now):
                params[name].copy_(torch.from_numpy(np.asarray(value, dtype=np.float32)))
        loss, survivors = evaluate(), strategy.survivors[server_round]
        log.info("aegis secure round %d: %d survivors, validation-loss %.4f", server_round, survivors, loss)
        if record is not None:
            record.round_sum(server_round, strategy.aggregates[server_round], survivors)

    evaluate()  # round 0: the initial model
    strategy = SecureStrategy([a.numpy() for a in arrays.values()], algorithm=s["aggregation"],
                              optimizer=str(s["server-optimizer"]), lr=float(s["lr"]), local_steps=steps,
                              min_clients=nodes, on_round=on_round)
    legacy = LegacyContext(context, config=ServerConfig(num_rounds=s["num-server-rounds"]), strategy=strategy)
    fit = SecAggPlus(num_shares=1.0, reconstruction_threshold=threshold, max_weight=MAX_WEIGHT,
                             clipping_range=clipping, quantization_range=QUANTIZATION_RANGE,
                             modulus_range=MODULUS_RANGE, timeout=float(s["secagg-timeout"]))
    DefaultWorkflow(fit_workflow=fit)(grid if record is None else RecordingGrid(grid, record), legacy)
    context.state["evaluation"] = MetricRecord(curves)
    rounds = range(1, s["num-server-rounds"] + 1)
    context.state["secure"] = MetricRecord({"survivors": [strategy.survivors.get(r, 0) for r in rounds]})
    fail_unless_accepted(sum(strategy.survivors.values()), s["num-server-rounds"])
    shield.public_params()  # the public calibration at the initial model: the table every client floods with
    privacy = shield.report().privacy()
    log.info("aegis secure run: %s", "no (epsilon, delta) for this preset (no public noise multiplier)"
             if privacy is None else f"{privacy.line()} (at {threshold} survivors, each example at its exposure "
             f"budget of {config.exposures} export(s); a client whose own floor is stricter has a smaller epsilon)")


# -- client ----------------------------------------------------------------------------------------
_NODES: RunCache[tuple[SecureGuard, SecureTrainer, ClientRecord | None]] = RunCache()


def _node(context: Context, pin: SurvivorPin,
          config: AegisConfig) -> tuple[SecureGuard, SecureTrainer, ClientRecord | None]:
    """This node's guard, trainer and record of the run (built on first use, kept while the run is among
    the node's ``aegis-max-runs`` most recent)."""
    s = secure_settings(context.run_config)
    part = int(context.node_config.get("partition-id", 0))
    parts = int(context.node_config.get("num-partitions", 1))
    key = (context.node_id, part, parts, pin, repr(config), *(s[k] for k in sorted(DEFAULT_RUN_CONFIG)))

    def build() -> tuple[SecureGuard, SecureTrainer, ClientRecord | None]:
        if pin.peers is None:
            log.warning("node %d pins %d survivors and no aegis-peers: every node the server names counts toward "
                        "the pin, nodes the server runs itself included", context.node_id, pin.min_survivors)
        model, tok = decoder(s)
        trainer = SecureTrainer(model, train_batches(tok, part, parts, int(s["batch-size"])), pin, config=config)
        return SecureGuard(pin), trainer, ClientRecord.from_env(context.node_id)

    return _NODES.get(context.run_id, key, build, max_runs(context))


def client_train(msg: Message, context: Context, clock: ReplyFloor | None = None) -> Message:
    """A secure round's stage on this node: refused unless the node pins its survivors itself, and unless
    the run config keeps the node's own AEGIS floor (:mod:`aegis.fl.floor`) at a batch size inside its
    promise. ``clock`` (the node's :class:`~aegis.fl.node.ReplyFloor`) times the stage, not the build."""
    try:
        pin = node_pin(context)
        if pin is None:
            raise ValueError(f"the run asks for secure rounds and this node pins no survivor count: start the "
                             f"SuperNode with --node-config '{PIN_KEY}=<t>' or set {PIN_ENV}")
        patch.install()
        config = config_from_run_config(context.run_config, node_floor(context))
        config.check_batch(int(secure_settings(context.run_config)["batch-size"]))
        guard, trainer, record = _node(context, pin, config)
    except (ValueError, TypeError, RuntimeError) as err:
        return refuse(msg, str(err))

    def stage(m: Message, c: Context) -> Message:
        return guard(m, c, lambda m2, c2: secaggplus_mod(m2, c2, trainer))

    reply = stage(msg, context) if clock is None else clock(msg, context, stage)
    if record is not None:
        record.updates(trainer.updates)
    return reply
