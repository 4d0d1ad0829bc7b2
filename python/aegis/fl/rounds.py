"""The audit's runner: FedSGD rounds for any model, data and defence, every shared gradient captured.

:func:`run_rounds` runs the real client (:class:`~aegis.fl.client.ClientTrainer`, under
:class:`~aegis.fl.client.AegisMod` for AEGIS) and the real strategy (:class:`~aegis.fl.strategy.FedSGD`)
over an :class:`~aegis.fl.grid.InProcessGrid`, and returns what the honest-but-curious server
received (:class:`SharedGradient`) with the private batch behind each reply, for the attacks to score.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from torch import Tensor, nn

from ..config import AegisConfig, simulated_client
from ..defence import Aegis, Batch, Defence, LossFn, NoDefence, core_defence, lm_loss
from ..exposure import ExposurePolicy
from ..shield import protect
from .client import AegisMod, ClientTrainer, load_arrays, server_round_of, trainable_arrays
from .floor import config_from_run_config
from .grid import FIRST_NODE_ID, InProcessGrid, flower_log_level, flower_runtime
from .strategy import FedSGD


@dataclass
class SharedGradient:
    """What one client shared in one round, as the server received it, and the private batch behind it.

    The reply carried ``grads`` and ``metrics`` (the public constant ``{"num-examples": 1}``) plus, under
    AEGIS, the masking proof; no loss and no batch size. ``batch`` is the client's ground truth, never sent.
    """

    server_round: int
    client: int  # index into client_batches
    grads: dict[str, Tensor]  # fp32, CPU: exactly the arrays of the reply
    batch: Batch  # ground truth for scoring attacks (never sent)
    metrics: dict[str, float]  # the reply's MetricRecord, as received


@dataclass
class FederatedRun:
    """Result of :func:`run_rounds`."""

    defence: str
    captured: list[list[SharedGradient]]  # captured[r - 1]: round r's usable replies, by client index
    utility: list[dict[str, float]]  # utility[0] before training, utility[r] after round r (eval_fn)
    # rounds[r - 1]: FedSGD's client counts of round r (clients-ok/-failed/-rejected/-missing) and eval_fn's
    # metrics of the model after round r (server-side, held-out data: clients send no loss)
    rounds: list[dict[str, float]]
    model: nn.Module  # the global model after the last round
    reports: list[dict[str, float]]  # per client: its defence's report (e.g. DP-SGD epsilon)


def run_rounds(
    model: nn.Module,
    client_batches: Sequence[Sequence[Batch]],
    *,
    rounds: int,
    defence: str | AegisConfig | Callable[[], Defence] | None = None,
    loss_fn: LossFn = lm_loss,
    optimizer: str = "sgd",
    lr: float = 0.1,
    eval_fn: Callable[[nn.Module], Mapping[str, float]] | None = None,
    run_config: Mapping[str, Any] | None = None,
    faults: Mapping[tuple[int, int], str] | None = None,
    on_round: Callable[[int], None] | None = None,
    quiet: bool = True,
) -> FederatedRun:
    """FedSGD rounds on Flower's Message API in this process; every shared gradient is captured.

    model:           the initial global model (copied for the server and every client; left untouched).
    client_batches:  ``client_batches[c]`` is client c's private batches; round r uses batch (r-1) mod len.
    defence:         ``None``/"none", an AEGIS spec ("aegis", "aegis-sentences") or ``AegisConfig`` — clients
                     then run under AegisMod, configured from ``run_config`` — or a baseline spec for
                     :func:`aegis.baselines.make_defence` ("prune-90", ...) or a factory ``() -> Defence``
                     (called once per client, so per-client state such as DP accounting stays separate).
    optimizer, lr:   the server's FedSGD step.
    eval_fn:         ``global_model -> {metric: value}``, run before round 1 and after every round (the
                     server's own loss curve: clients send no loss); also merged into ``rounds``.
    faults:          ``{(round, client): "raise" | "absent"}``: that client raises, or never answers.
    on_round:        called with the round number after each round (progress bars).
    quiet:           silence Flower's INFO logging for the run.
    """
    aegis_config, factory = _resolve_defence(defence)
    if aegis_config is not None:
        aegis_config = simulated_client(aegis_config)
    run_config = dict(run_config or {})
    faults = dict(faults or {})
    for (r, c), kind in faults.items():
        if kind not in ("raise", "absent") or not 0 <= c < len(client_batches):
            raise ValueError(f"faults[({r}, {c})] = {kind!r}: use 'raise' or 'absent' for an existing client")

    server_model = copy.deepcopy(model)
    if aegis_config is not None:
        # The global state is what AEGIS clients share: trainable parameters with attention frozen.
        server_config = config_from_run_config(run_config, aegis_config).replace(exposure=ExposurePolicy.OFF)
        protect(server_model, None, server_config)  # the server exports nothing: no budget to keep
    trainers, apps, contexts = [], {}, {}
    for c, batches in enumerate(client_batches):
        node = FIRST_NODE_ID + c
        trainer = ClientTrainer(
            copy.deepcopy(model), batches, defence=None if factory is None else factory(), loss_fn=loss_fn
        )
        app = ClientApp()
        app.train(mods=[AegisMod(aegis_config)] if aegis_config is not None else None)(_with_faults(trainer, c, faults))
        trainers.append(trainer)
        apps[node] = app
        contexts[node] = Context(
            run_id=0, node_id=node, node_config={"partition-id": c, "num-partitions": len(client_batches)},
            state=RecordDict(), run_config=run_config,
        )
    grid = InProcessGrid(
        apps,
        contexts,
        absent=lambda node, msg: faults.get((server_round_of(msg.content), node - FIRST_NODE_ID)) == "absent",
    )

    utility: list[dict[str, float]] = []

    def evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
        if server_round > 0 and on_round is not None:
            on_round(server_round)
        if eval_fn is None:
            return None
        load_arrays(server_model, arrays)
        metrics = {k: float(v) for k, v in eval_fn(server_model).items()}
        utility.append(metrics)
        return MetricRecord({**metrics})  # a fresh dict typed as MetricRecord's values

    n = len(client_batches)
    with flower_runtime(), flower_log_level(logging.ERROR if quiet else None):
        strategy = FedSGD(optimizer=optimizer, lr=lr, min_train_nodes=n, min_available_nodes=n)
        result = strategy.start(
            grid=grid, initial_arrays=trainable_arrays(server_model), num_rounds=rounds, evaluate_fn=evaluate
        )
    if len(result.arrays):  # empty when no round produced a usable gradient
        load_arrays(server_model, result.arrays)

    captured: list[list[SharedGradient]] = [[] for _ in range(rounds)]
    for d in grid.deliveries:
        if d.reply.has_error():
            continue
        c = d.node_id - FIRST_NODE_ID
        record = next(iter(d.reply.content.array_records.values()))
        metrics = next(iter(d.reply.content.metric_records.values()), MetricRecord())
        captured[d.server_round - 1].append(
            SharedGradient(
                server_round=d.server_round,
                client=c,
                grads={k: torch.from_numpy(a.numpy()) for k, a in record.items()},
                batch=trainers[c].batches_used[d.server_round],
                metrics=_floats(metrics),
            )
        )
    for shared in captured:
        shared.sort(key=lambda s: s.client)
    return FederatedRun(
        defence=_defence_name(aegis_config, trainers),
        captured=captured,
        utility=utility,
        rounds=[
            {
                **_floats(result.evaluate_metrics_serverapp.get(r, MetricRecord())),
                **_floats(result.train_metrics_clientapp.get(r, MetricRecord())),
            }
            for r in range(1, rounds + 1)
        ],
        model=server_model,
        reports=[t.defence.report() if t.defence is not None else {} for t in trainers],
    )


def _resolve_defence(defence) -> tuple[AegisConfig | None, Callable[[], Defence] | None]:
    """(AEGIS config, None) for the AEGIS path under AegisMod, or (None, per-client factory)."""
    if defence is None:
        return None, NoDefence
    if isinstance(defence, AegisConfig):
        return defence, None
    if isinstance(defence, str):
        probe = core_defence(defence)
        if isinstance(probe, Aegis):
            return probe.config, None
        if probe is not None:
            return None, NoDefence
        return None, _comparator(defence)
    if callable(defence):
        probe = defence()
        if isinstance(probe, Aegis):
            return probe.config, None
        return None, defence
    raise TypeError(f"defence={defence!r}: pass None, a spec string, an AegisConfig or a factory () -> Defence")


def _comparator(spec: str) -> Callable[[], Defence]:
    """A per-client factory for a comparator named by the audit ("prune-90", "dp-sgd", ...).

    The only place ``aegis.fl`` reaches :mod:`aegis.baselines`, and only when a run names a comparator:
    importing ``aegis.fl`` or running AEGIS never loads it (``tests/test_fl.py`` checks)."""
    from ..baselines import make_defence

    make_defence(spec)  # an unknown name fails here, before any round
    return lambda: make_defence(spec)


def _with_faults(trainer: ClientTrainer, client: int, faults: Mapping[tuple[int, int], str]):
    def train(msg: Message, context: Context) -> Message:
        if faults.get((server_round_of(msg.content), client)) == "raise":
            raise RuntimeError(f"injected failure of client {client}")
        return trainer(msg, context)

    return train


def _defence_name(aegis_config: AegisConfig | None, trainers: list[ClientTrainer]) -> str:
    if aegis_config is not None:
        return Aegis(aegis_config).name
    first = trainers[0].defence if trainers else None
    return first.name if first is not None else "none"


def _floats(record: MetricRecord) -> dict[str, float]:
    """A MetricRecord of scalars as floats (every metric of a run is one number)."""
    out = {}
    for key, value in record.items():
        if isinstance(value, list):
            raise ValueError(f"metric {key!r} is a list ({value!r}): a run's metrics are scalars")
        out[key] = float(value)
    return out
