"""The server side of secure rounds, shared by the in-process runner and the Flower app.

* :class:`SecAggPlus`: Flower's ``SecAggPlusWorkflow``, where a node that drops before sharing its keys
  leaves the round instead of halting it.
* :class:`SecureStrategy`: the legacy strategy SecAgg+ drives (SecAgg+ has no Message-API strategy).
  It receives the weighted mean of the survivors' updates (every weight is 1: the plain mean) and steps
  the global model: FedSGD with a server optimizer on the mean gradient, FedAvg with
  ``global - lr * mean pseudo-gradient`` (the mean of the local models).
* :func:`required_clipping_range`: a clipping range that covers an update of the model.
"""
from __future__ import annotations

import copy
from collections.abc import Callable, Sequence

import numpy as np
import torch
from flwr.common import FitIns, Parameters, ndarrays_to_parameters, parameters_to_ndarrays
from flwr.server.strategy import Strategy
from flwr.server.workflow import SecAggPlusWorkflow
from torch import nn

from ...config import AegisConfig
from ...exposure import ExposurePolicy
from ...shield import protect
from .client import entry_bound, noise_share
from .guard import SurvivorPin


class SecAggPlus(SecAggPlusWorkflow):
    """Flower's ``SecAggPlusWorkflow``, where a node that drops before sharing its keys leaves the round.

    Flower 1.42 keeps such a node among the sampled ones, so its unmask stage asks every survivor for
    a share of that node's key, which none holds (``secaggplus_mod`` raises ``KeyError``), and the
    round halts. No survivor's vector carries a mask with it (clients add pairwise masks only for the
    nodes whose shares reached them), so it is taken out of the round and of every neighbourhood."""

    def share_keys_stage(self, grid, context, state) -> bool:
        if not super().share_keys_stage(grid, context, state):
            return False
        kept = set(state.active_node_ids)
        state.sampled_node_ids = kept
        for nid in kept:
            state.nid_to_neighbours[nid] &= kept
        return True


class SecureStrategy(Strategy):
    """Legacy strategy for SecAgg+: every sampled client, the survivors' mean update, a global step.

    algorithm:  "fedsgd" (server optimizer "sgd" | "adamw" at ``lr`` on the mean gradient) or "fedavg"
                (clients take ``local_steps`` SGD steps at ``lr``; the server moves to the mean local model).
    ``aggregates[r]`` is round r's mean update as the server received it; ``survivors[r]`` its count."""

    def __init__(self, initial: Sequence[np.ndarray], *, algorithm: str = "fedsgd", optimizer: str = "sgd",
                 lr: float = 0.1, local_steps: int = 1, min_clients: int = 2,
                 on_round: Callable[[int, list[np.ndarray]], None] | None = None) -> None:
        if algorithm not in ("fedsgd", "fedavg"):
            raise ValueError(f"algorithm={algorithm!r}: use 'fedsgd' or 'fedavg'")
        if optimizer not in ("sgd", "adamw"):
            raise ValueError(f"optimizer={optimizer!r}: use 'sgd' or 'adamw'")
        self.algorithm, self.lr, self.local_steps, self.min_clients = algorithm, lr, local_steps, min_clients
        self.params = [torch.nn.Parameter(torch.from_numpy(np.array(a, dtype=np.float32))) for a in initial]
        make = torch.optim.SGD if optimizer == "sgd" else torch.optim.AdamW
        self.optimizer = make(self.params, lr=lr)
        self.on_round = on_round
        self.aggregates: dict[int, list[np.ndarray]] = {}
        self.survivors: dict[int, int] = {}

    def _parameters(self) -> Parameters:
        return ndarrays_to_parameters([p.detach().numpy().copy() for p in self.params])

    def initialize_parameters(self, client_manager):
        return self._parameters()

    def configure_fit(self, server_round, parameters, client_manager):
        clients = client_manager.sample(num_clients=client_manager.num_available(), min_num_clients=self.min_clients)
        config = {"server-round": server_round, "algorithm": self.algorithm, "lr": self.lr,
                  "local-steps": self.local_steps}
        return [(c, FitIns(parameters, dict(config))) for c in clients]

    def aggregate_fit(self, server_round, results, failures):
        if not results:
            return None, {}
        mean = parameters_to_ndarrays(results[0][1].parameters)  # every survivor carries the same mean
        self.aggregates[server_round], self.survivors[server_round] = mean, len(results)
        if self.algorithm == "fedavg":
            with torch.no_grad():
                for p, m in zip(self.params, mean):
                    p.sub_(torch.from_numpy(np.asarray(m, dtype=np.float32)), alpha=self.lr)
        else:
            for p, m in zip(self.params, mean):
                p.grad = torch.from_numpy(np.asarray(m, dtype=np.float32))
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        if self.on_round is not None:
            self.on_round(server_round, [p.detach().numpy().copy() for p in self.params])
        return self._parameters(), {}

    def configure_evaluate(self, server_round, parameters, client_manager):
        return []

    def aggregate_evaluate(self, server_round, results, failures):
        return None, {}

    def evaluate(self, server_round, parameters):
        return None


def required_clipping_range(model: nn.Module, pin: SurvivorPin, config: AegisConfig | None = None,
                            local_steps: int = 1, margin: float = 2.0) -> float:
    """A clipping range for ``SecAggPlusWorkflow`` that covers an update of this model (public
    calibration at its current weights), ``margin`` times the bound the clients check."""
    # the server's copy only calibrates: it masks nothing, so it tracks no exposure
    shield = protect(copy.deepcopy(model), None, (config or AegisConfig()).replace(exposure=ExposurePolicy.OFF))
    with noise_share(shield, pin.share) as table:
        return margin * entry_bound([table] * local_steps)
