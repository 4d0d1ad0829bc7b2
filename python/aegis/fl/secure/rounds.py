"""Secure FedSGD / FedAvg rounds over Flower's SecAgg+ in this process, every message serialised.

:func:`run_secure_rounds` drives Flower's ``DefaultWorkflow(fit_workflow=SecAggPlus(...))`` with
:class:`~aegis.fl.secure.server.SecureStrategy` over a :class:`~aegis.fl.grid.SerialisingGrid`,
whose clients are :class:`~aegis.fl.secure.client.SecureTrainer` under ``[SecureGuard, secaggplus_mod]``;
the grid's bytes are the server's wire, kept for the audit.
"""
from __future__ import annotations

import copy
import logging
import math
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from flwr.app import Context, Message, RecordDict
from flwr.client.mod import secaggplus_mod
from flwr.clientapp import ClientApp
from flwr.server import LegacyContext, ServerConfig
from flwr.server.workflow import DefaultWorkflow, SecAggPlusWorkflow
from torch import Tensor, nn

from ...config import AegisConfig, simulated_client
from ...defence import Batch, LossFn, lm_loss
from ...exposure import ExposurePolicy
from ...shield import protect
from ..client import trainable_arrays
from ..grid import FIRST_NODE_ID, SUPERLINK_NODE_ID, SerialisingGrid, flower_log_level, flower_runtime
from . import patch
from .accountant import PrivacyStatement, noise_multiplier, statement
from .client import SecureTrainer
from .guard import MAX_WEIGHT, SecureGuard, SurvivorPin, check_quantisation, reply_stage
from .server import SecAggPlus, SecureStrategy, required_clipping_range

__all__ = ["SecAggPlus", "SecureRun", "SecureStrategy", "SerialisingGrid", "required_clipping_range",
           "run_secure_rounds"]


@dataclass
class SecureRun:
    """Result of :func:`run_secure_rounds`."""

    strategy: SecureStrategy
    grid: SerialisingGrid
    trainers: list[SecureTrainer]
    guards: list[SecureGuard]  # per client: its refusals (client side, never sent)
    names: list[str]  # the trainable parameters, in the order of every array list
    model: nn.Module  # the global model after the last round
    sums: dict[int, dict[str, Tensor]] = field(default_factory=dict)  # round -> survivors' sum (mean x count)

    def privacy(self, delta: float = 1e-5, rows: Mapping[str, int] | None = None, *,
                at_budget: bool = False) -> PrivacyStatement:
        """The run's (epsilon, delta) per example, for the worst client: each export's z from the
        flood tables the client used (its share times sqrt of its pin: the sum's noise when the
        survivors are at least its pin and share alike), composed over the most-exported batch's
        exports, no sampling amplification (each client passes over its batches in order).
        ``at_budget``: compose the exposure budget's count of exports instead (what the
        configuration promises, whatever this run used)."""
        worst = None
        for trainer in self.trainers:
            report = trainer.shield.report().rows
            shapes = {r.name: r.shape for r in report}
            modes = {r.name: "rows" if r.action == "rows flood" else "matrix" for r in report}
            names = [r.name for r in report if r.action.endswith("flood")]
            scale = math.sqrt(trainer.pin.min_survivors)
            z = math.inf
            for tables in trainer.tables.values():
                for table in tables:
                    full = {n: (rho, sigma * scale, clip, thr) for n, (rho, sigma, clip, thr) in
                            zip(names, table.double().tolist())}
                    z = min(z, noise_multiplier(full, shapes, modes, rows))
            uses = Counter(id(b) for used in trainer.batches_used.values() for b in used)
            count = trainer.shield.config.exposures if at_budget else max(uses.values(), default=0)
            found = statement(z, count, delta=delta)
            if worst is None or found.epsilon > worst.epsilon:
                worst = found
        return worst if worst is not None else statement(math.inf, 0, delta=delta)


def run_secure_rounds(
    model: nn.Module,
    client_batches: Sequence[Sequence[Batch]],
    *,
    rounds: int,
    pin: SurvivorPin | Sequence[SurvivorPin],
    config: AegisConfig | Sequence[AegisConfig] | None = None,
    algorithm: str = "fedsgd",
    optimizer: str = "sgd",
    lr: float = 0.1,
    local_steps: int = 1,
    num_shares: int | float = 1.0,
    reconstruction_threshold: int | float | None = None,
    clipping_range: float | None = None,
    quantization_range: int = 2**22,
    modulus_range: int = 2**32,
    max_weight: float = MAX_WEIGHT,
    loss_fn: LossFn = lm_loss,
    absent: Callable[[int, Message], bool] | None = None,
    extra_nodes: Mapping[int, Callable[[Message, Context], Message]] | None = None,
    workflow: type[SecAggPlusWorkflow] = SecAggPlus,
    quiet: bool = True,
) -> SecureRun:
    """Secure rounds of ``len(client_batches)`` AEGIS clients on the in-process grid.

    pin, config:               each client's :class:`SurvivorPin` and AEGIS configuration (one for all, or
                               one per client; the first configuration also shapes the global arrays).
    num_shares, reconstruction_threshold, clipping_range, quantization_range, modulus_range, max_weight:
                               ``SecAggPlusWorkflow``'s; the threshold defaults to the largest pin and the
                               clipping range to :func:`required_clipping_range`. Checked before round 1.
    absent(node_id, message):  True drops that message (a client that never answers that stage).
    extra_nodes, workflow:     the audit's hooks: ClientApps the server runs itself (sybils), a
                               ``SecAggPlusWorkflow`` subclass (a server that lies about dropouts).
    """
    patch.install()
    n = len(client_batches)
    pins, configs = _per_client(pin, n, "pin"), _per_client(config or AegisConfig(), n, "config")
    configs = [simulated_client(c) for c in configs]  # each its own counts, as separate machines would keep
    server_model = _copy(model)
    # the global arrays: attention frozen, as on clients; the server masks nothing and tracks no exposure
    protect(server_model, None, configs[0].replace(exposure=ExposurePolicy.OFF))
    names = list(trainable_arrays(server_model).keys())
    if reconstruction_threshold is None:
        reconstruction_threshold = max(p.min_survivors for p in pins)
    if clipping_range is None:
        steps = local_steps if algorithm == "fedavg" else 1
        clipping_range = max(required_clipping_range(model, p, c, steps) for p, c in zip(pins, configs))
    nodes_total = n + len(extra_nodes or {})
    check_quantisation(clipping_range=clipping_range, quantization_range=quantization_range,
                       modulus_range=modulus_range, max_weight=max_weight, clients=nodes_total)

    trainers, guards, contexts = [], [], {}
    apps: dict[int, Callable[[Message, Context], Message]] = {}
    for c, batches in enumerate(client_batches):
        node = FIRST_NODE_ID + c
        trainer = SecureTrainer(_copy(model), batches, pins[c], config=configs[c], loss_fn=loss_fn)
        guard = SecureGuard(pins[c])
        app = ClientApp()
        app.train(mods=[guard, secaggplus_mod])(trainer)
        trainers.append(trainer)
        guards.append(guard)
        apps[node] = app
    apps.update(extra_nodes or {})
    for node in apps:
        contexts[node] = Context(run_id=0, node_id=node, node_config={}, state=RecordDict(), run_config={})
    grid = SerialisingGrid(apps, contexts, absent=absent, stage_of=reply_stage)

    strategy = SecureStrategy([a.numpy() for a in trainable_arrays(server_model).values()], algorithm=algorithm,
                              optimizer=optimizer, lr=lr, local_steps=local_steps, min_clients=nodes_total)
    server_context = Context(run_id=0, node_id=SUPERLINK_NODE_ID, node_config={}, state=RecordDict(), run_config={})
    legacy = LegacyContext(server_context, config=ServerConfig(num_rounds=rounds), strategy=strategy)
    fit = workflow(num_shares=num_shares, reconstruction_threshold=reconstruction_threshold,
                   max_weight=max_weight, clipping_range=clipping_range, quantization_range=quantization_range,
                   modulus_range=modulus_range)
    with flower_runtime(), flower_log_level(logging.ERROR if quiet else None):
        DefaultWorkflow(fit_workflow=fit)(grid, legacy)
    with torch.no_grad():
        params = dict(server_model.named_parameters())
        for name, p in zip(names, strategy.params):
            params[name].copy_(p)
    sums = {r: {k: torch.from_numpy(np.asarray(a, dtype=np.float64)) * strategy.survivors[r]
                for k, a in zip(names, mean)} for r, mean in strategy.aggregates.items()}
    return SecureRun(strategy, grid, trainers, guards, names, server_model, sums)


def _per_client(value, n: int, name: str) -> list:
    values = list(value) if isinstance(value, Sequence) else [value] * n
    if len(values) != n:
        raise ValueError(f"{name}: {len(values)} given for {n} clients; give one, or one per client")
    return values


def _copy(model: nn.Module) -> nn.Module:
    return copy.deepcopy(model)
