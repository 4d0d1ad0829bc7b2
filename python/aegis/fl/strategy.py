"""FedSGD for Flower's Message API: clients send gradients, the server averages them and steps the model.

Flower ships no gradient-sharing strategy (flwrlabs/flower#1158). ``FedSGD`` reuses ``FedAvg``'s node
sampling and message layout, and replaces aggregation: the ``num-examples``-weighted mean of the clients'
gradients drives a server-side torch optimizer (SGD or AdamW, state kept across rounds) on the global
trainable arrays. Do not wrap it in Flower's DP strategy wrappers: they clip ``reply - global``, which is
meaningless when replies are gradients.

AEGIS clients (:class:`aegis.fl.ClientTrainer` under :class:`aegis.fl.AegisMod`) reply with the masked
gradient, its proof and ``num-examples`` = 1, a public constant: the weighted mean is then the plain
(unweighted) mean of the clients' gradients, each already a per-example mean over the client's batch.
Clients send no loss and no other metric computed from their private batch (the clean loss is an exact
oracle for the batch given the global model), so the round's metrics are client counts only; the loss
curve comes from the server's own held-out data (``evaluate_fn``, e.g. ``aegis.fl.task.validation_loss``).
Other metric keys in a reply are ignored, never aggregated or logged.

A round survives bad clients: error replies (a client that raised), replies that do not match the global
arrays (keys, shapes, non-finite values, no positive weight) and clients that never answered are left
out of the average and counted in the round's metrics (``clients-ok``, ``clients-failed``,
``clients-rejected``, ``clients-missing``). With no usable reply the global model is unchanged.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import cast

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg

log = logging.getLogger("flwr")

OptimizerFactory = Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]


class FedSGD(FedAvg):
    """Gradient averaging plus a server optimizer step.

    optimizer:  "sgd", "adamw" or a factory ``params -> torch.optim.Optimizer``.
    lr, momentum, weight_decay, betas:  hyper-parameters of the named optimizers.
    The sampling arguments are FedAvg's; evaluation on clients is off by default (``fraction_evaluate=0``)
    because FedSGD replies carry gradients, not models: evaluate on the server with ``evaluate_fn``.
    """

    def __init__(
        self,
        *,
        optimizer: str | OptimizerFactory = "sgd",
        lr: float = 0.1,
        momentum: float = 0.0,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.999),
        fraction_train: float = 1.0,
        min_train_nodes: int = 1,
        min_available_nodes: int = 1,
        fraction_evaluate: float = 0.0,
        min_evaluate_nodes: int = 0,
        weighted_by_key: str = "num-examples",
        arrayrecord_key: str = "arrays",
        configrecord_key: str = "config",
    ) -> None:
        super().__init__(
            fraction_train=fraction_train,
            fraction_evaluate=fraction_evaluate,
            min_train_nodes=min_train_nodes,
            min_evaluate_nodes=min_evaluate_nodes,
            min_available_nodes=min_available_nodes,
            weighted_by_key=weighted_by_key,
            arrayrecord_key=arrayrecord_key,
            configrecord_key=configrecord_key,
        )
        if isinstance(optimizer, str) and optimizer.lower() not in ("sgd", "adamw"):
            raise ValueError(f"optimizer={optimizer!r}: use 'sgd', 'adamw' or a factory params -> Optimizer")
        self.optimizer_spec = optimizer
        self.lr, self.momentum, self.weight_decay, self.betas = lr, momentum, weight_decay, betas
        self.params: dict[str, torch.nn.Parameter] = {}
        self.optimizer: torch.optim.Optimizer | None = None
        self._sent: dict[int, int] = {}

    def summary(self) -> None:
        super().summary()
        log.info("\t└──> Server optimizer: %s (lr %g)", self.optimizer_spec, self.lr)

    # -- global model ------------------------------------------------------------------------
    def _load(self, arrays: ArrayRecord) -> None:
        """Adopt the global arrays as the server's parameters (same Parameter objects across rounds,
        so optimizer state such as AdamW moments persists)."""
        if not self.params:
            self.params = {k: torch.nn.Parameter(_tensor(a)) for k, a in arrays.items()}
            self.optimizer = self._make_optimizer(list(self.params.values()))
            return
        if list(arrays.keys()) != list(self.params):
            raise ValueError("FedSGD: the global arrays changed keys between rounds")
        with torch.no_grad():
            for k, a in arrays.items():
                self.params[k].copy_(_tensor(a))

    def _make_optimizer(self, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        spec = self.optimizer_spec
        if callable(spec):
            return spec(params)
        if spec.lower() == "sgd":
            return torch.optim.SGD(params, lr=self.lr, momentum=self.momentum, weight_decay=self.weight_decay)
        return torch.optim.AdamW(params, lr=self.lr, betas=self.betas, weight_decay=self.weight_decay)

    def arrays(self) -> ArrayRecord:
        """The current global trainable arrays (fp32)."""
        return ArrayRecord({k: Array(p.detach().numpy().copy()) for k, p in self.params.items()})

    # -- rounds ------------------------------------------------------------------------------
    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        self._load(arrays)
        messages = list(super().configure_train(server_round, arrays, config, grid))
        self._sent[server_round] = len(messages)
        return messages

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        replies = list(replies)
        usable: list[RecordDict] = []
        failed = rejected = 0
        for msg in replies:
            if msg.has_error():
                failed += 1
                log.warning(
                    "FedSGD round %d: node %d failed: %s", server_round, msg.metadata.src_node_id, msg.error.reason
                )
                continue
            problem = self._problem(msg.content)
            if problem:
                rejected += 1
                log.warning(
                    "FedSGD round %d: reply of node %d rejected: %s", server_round, msg.metadata.src_node_id, problem
                )
            else:
                usable.append(msg.content)
        missing = max(self._sent.get(server_round, len(replies)) - len(replies), 0)
        metrics = MetricRecord(
            {
                "clients-ok": len(usable),
                "clients-failed": failed,
                "clients-rejected": rejected,
                "clients-missing": missing,
            }
        )
        if not usable:
            log.warning("FedSGD round %d: no usable gradient, global model unchanged", server_round)
            return None, metrics
        optimizer = self.optimizer
        if optimizer is None:
            raise RuntimeError("FedSGD: aggregate_train before configure_train loaded the global arrays")
        # _problem let through only replies whose weight is a positive int or float
        weights = np.array([float(cast(float, _metrics(c)[self.weighted_by_key])) for c in usable])
        weights /= weights.sum()
        mean = self._weighted_mean(usable, weights)
        optimizer.zero_grad(set_to_none=True)
        for key, param in self.params.items():
            param.grad = mean[key]
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return self.arrays(), metrics

    def _problem(self, content: RecordDict) -> str | None:
        """Why a reply cannot be averaged, or None."""
        if len(content.array_records) != 1:
            return f"expected one ArrayRecord, got {len(content.array_records)}"
        if len(content.metric_records) != 1:
            return f"expected one MetricRecord, got {len(content.metric_records)}"
        weight = _metrics(content).get(self.weighted_by_key)
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not weight > 0:
            return f"MetricRecord needs a positive '{self.weighted_by_key}', got {weight!r}"
        record = next(iter(content.array_records.values()))
        if set(record.keys()) != set(self.params):
            extra, absent = set(record.keys()) - set(self.params), set(self.params) - set(record.keys())
            return (
                f"gradient keys differ from the global arrays (extra {sorted(extra)[:3]}, missing {sorted(absent)[:3]})"
            )
        for key, array in record.items():
            if tuple(array.shape) != tuple(self.params[key].shape):
                return f"{key} has shape {tuple(array.shape)}, expected {tuple(self.params[key].shape)}"
            if not np.isfinite(array.numpy()).all():
                return f"{key} has non-finite values"
        return None

    def _weighted_mean(self, contents: list[RecordDict], weights: np.ndarray) -> dict[str, torch.Tensor]:
        mean = {k: torch.zeros_like(p, dtype=torch.float64) for k, p in self.params.items()}
        for content, w in zip(contents, weights):
            record = next(iter(content.array_records.values()))
            for key, array in record.items():
                mean[key].add_(torch.from_numpy(array.numpy()).double(), alpha=float(w))
        return {k: v.to(self.params[k].dtype) for k, v in mean.items()}


def fail_unless_accepted(accepted: int, rounds: int) -> None:
    """End a run in which no client reply was accepted loudly: the error is the run's last line, and the
    ServerApp (or :func:`aegis.fl.simulate`) exits with it."""
    if accepted:
        return
    message = (f"AEGIS: NO CLIENT REPLY WAS ACCEPTED IN {rounds} ROUND(S): the global model did not change. Every "
               "client refused, failed or never answered; the reasons are in the clients' logs (a client refuses "
               "a run config that would relax its own AEGIS configuration, a batch size outside its promise, or "
               "an example past its exposure budget)")
    log.error(message)
    raise RuntimeError(message)


def _metrics(content: RecordDict) -> MetricRecord:
    return next(iter(content.metric_records.values()))


def _tensor(array: Array) -> torch.Tensor:
    return torch.from_numpy(np.array(array.numpy(), dtype=np.float32))

