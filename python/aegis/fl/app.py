"""The AEGIS Flower app (``server_app`` + ``client_app`` for ``flwr run``) and in-process runners.

**With ``flwr run``.** In a Flower app project, point the components at this module (``flwr run`` builds a
FAB from the project directory, so it needs its own ``pyproject.toml`` and LICENSE; see
``python/aegis/fl/README.md``)::

    [project]
    name = "aegis-fedsgd"
    version = "0.1.0"
    description = "FedSGD with AEGIS-masked gradients"
    license = { file = "LICENSE" }
    dependencies = ["flwr>=1.42"]   # aegis comes from the running environment, see below

    [tool.flwr.app]
    publisher = "aegis"
    fab-format-version = 1
    flwr-version-target = "1.42.0"

    [tool.flwr.app.components]
    serverapp = "aegis.fl.app:server_app"
    clientapp = "aegis.fl.app:client_app"

    [tool.flwr.app.config]
    num-server-rounds = 3
    lr = 0.1
    server-optimizer = "sgd"
    batch-size = 4
    model-layers = 2
    model-width = 384       # 384: MiniLM's pretrained embeddings; other widths are random
    model-heads = 6
    min-nodes = 2
    fraction-train = 1.0
    aegis-preset = "utility"

then ``FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1 flwr run . --federation-config "num-supernodes=4"``
(simulation needs ``pip install "flwr[simulation]"``, i.e. Ray; the variable keeps Flower from building a
fresh per-run environment from PyPI, where aegis is not). Each SuperNode trains the offline default
decoder (``aegis.models.default_decoder``) on its shard (``partition-id`` / ``num-partitions``) of the
shipped corpus's train split; the server evaluates validation loss/perplexity after every round. The ClientApp's train function runs under
:class:`~aegis.fl.client.AegisMod`, so AEGIS settings come from the run config and nothing unmasked leaves.

A client's reply is the masked gradient, the mod's proof and ``num-examples`` = 1 (a public constant:
FedSGD takes the unweighted mean), nothing else: no training loss (with the global model the clean batch
loss is an exact oracle for the private batch, see :mod:`aegis.fl.client`). The loss the server reports
is :func:`validation_loss` on the held-out validation split.

**Without Ray.** :func:`simulate` runs these same two apps in this process over :class:`InProcessGrid`;
:func:`run_rounds` runs FedSGD rounds for any model, data and defence and returns every gradient the
server received (the honest-but-curious attacker's view) with the batch it came from — what the audit
attacks.
"""
from __future__ import annotations

import contextlib
import copy
import logging
import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import torch
from flwr.app import ArrayRecord, Context, Error, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from torch import Tensor, nn

from ..baselines import Aegis, Batch, Defence, LossFn, NoDefence, lm_loss, make_defence
from ..config import AegisConfig
from ..data import load_corpus
from ..shield import protect
from .client import (
    CLIENT_APP_RAISED_EXCEPTION,
    AegisMod,
    ClientTrainer,
    _server_round,
    config_from_run_config,
    load_arrays,
    trainable_arrays,
)
from .strategy import FedSGD

SUPERLINK_NODE_ID = 1  # Flower's node id for the server side (flwr.common.constant, not public API)
FIRST_NODE_ID = 1000  # in-process SuperNodes get ids 1000, 1001, ...


# -- in-process transport ----------------------------------------------------------------------
@contextlib.contextmanager
def flower_runtime(run_id: int = 0) -> Iterator[None]:
    """Give this process the task identity that Flower's ServerApp runtime sets before running a ServerApp.

    Instruction Messages (``Message(content, dst_node_id, message_type)``) read it. An in-process run
    stands in for that runtime, so it sets the identity itself, as Flower's own legacy ``start_grid``
    does with a dummy one. The setter lives in ``flwr.supercore`` (not public API): this is the only
    internal import of ``aegis.fl``, kept here.
    """
    from flwr.supercore.task_identity import TaskIdentity

    saved = (TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id)
    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, run_id, SUPERLINK_NODE_ID
    try:
        yield
    finally:
        TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id = saved


@dataclass(frozen=True)
class Delivery:
    """One reply as the server received it, with the round and node it answered."""

    server_round: int
    node_id: int
    reply: Message


class InProcessGrid(Grid):
    """A Grid that hands each message to a ClientApp in this process, one after another (no Ray, no SuperLink).

    It is also the honest-but-curious server's wire: every reply lands in ``deliveries``. A node whose app
    raises answers with an error reply, as Flower's runtime does; ``absent(node_id, message) -> True``
    makes a node drop the message (a client that never answers).
    """

    def __init__(
        self,
        apps: Mapping[int, Callable[[Message, Context], Message]],
        contexts: Mapping[int, Context],
        *,
        absent: Callable[[int, Message], bool] | None = None,
    ) -> None:
        self.apps, self.contexts, self.absent = dict(apps), dict(contexts), absent
        self.deliveries: list[Delivery] = []
        self._pending: dict[str, Delivery] = {}
        self._sent = 0
        self._run = None

    def set_run(self, run) -> None:
        self._run = run

    @property
    def run(self):
        return self._run

    def create_message(self, content: RecordDict, message_type: str, dst_node_id: int, group_id: str, ttl: float | None = None) -> Message:
        return Message(content, dst_node_id, message_type, ttl=ttl, group_id=group_id)

    def get_node_ids(self) -> Iterable[int]:
        return list(self.apps)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        ids = []
        for msg in messages:
            node = msg.metadata.dst_node_id
            if node not in self.apps:
                raise ValueError(f"InProcessGrid: no node {node} (nodes: {sorted(self.apps)})")
            self._sent += 1
            ids.append(str(self._sent))
            if self.absent is not None and self.absent(node, msg):
                continue
            try:
                reply = self.apps[node](msg, self.contexts[node])
            except Exception as err:  # a crashing client must not take the round down
                reply = Message(Error(code=CLIENT_APP_RAISED_EXCEPTION, reason=f"{type(err).__name__}: {err}"), reply_to=msg)
            self._pending[ids[-1]] = Delivery(_server_round(msg.content), node, reply)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        delivered = [self._pending.pop(i) for i in message_ids if i in self._pending]
        self.deliveries.extend(delivered)
        return [d.reply for d in delivered]

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        return self.pull_messages(self.push_messages(messages))


@contextlib.contextmanager
def _flower_log_level(level: int | None) -> Iterator[None]:
    logger = logging.getLogger("flwr")
    saved = logger.level
    if level is not None:
        logger.setLevel(level)
    try:
        yield
    finally:
        logger.setLevel(saved)


# -- the audit's runner ------------------------------------------------------------------------
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
    defence:         ``None``/"none", an AEGIS spec ("aegis", "aegis-utility") or ``AegisConfig`` — clients
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
    run_config = dict(run_config or {})
    faults = dict(faults or {})
    for (r, c), kind in faults.items():
        if kind not in ("raise", "absent") or not 0 <= c < len(client_batches):
            raise ValueError(f"faults[({r}, {c})] = {kind!r}: use 'raise' or 'absent' for an existing client")

    server_model = copy.deepcopy(model)
    if aegis_config is not None:
        # The global state is what AEGIS clients share: trainable parameters with attention frozen.
        protect(server_model, None, config_from_run_config(run_config, aegis_config))
    trainers, apps, contexts = [], {}, {}
    for c, batches in enumerate(client_batches):
        node = FIRST_NODE_ID + c
        trainer = ClientTrainer(copy.deepcopy(model), batches, defence=None if factory is None else factory(), loss_fn=loss_fn)
        app = ClientApp()
        app.train(mods=[AegisMod(aegis_config)] if aegis_config is not None else None)(_with_faults(trainer, c, faults))
        trainers.append(trainer)
        apps[node] = app
        contexts[node] = Context(
            run_id=0, node_id=node, node_config={"partition-id": c, "num-partitions": len(client_batches)},
            state=RecordDict(), run_config=run_config,
        )
    grid = InProcessGrid(apps, contexts, absent=lambda node, msg: faults.get((_server_round(msg.content), node - FIRST_NODE_ID)) == "absent")

    utility: list[dict[str, float]] = []

    def evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
        if server_round > 0 and on_round is not None:
            on_round(server_round)
        if eval_fn is None:
            return None
        load_arrays(server_model, arrays)
        metrics = {k: float(v) for k, v in eval_fn(server_model).items()}
        utility.append(metrics)
        return MetricRecord(metrics)

    n = len(client_batches)
    with flower_runtime(), _flower_log_level(logging.ERROR if quiet else None):
        strategy = FedSGD(optimizer=optimizer, lr=lr, min_train_nodes=n, min_available_nodes=n)
        result = strategy.start(grid=grid, initial_arrays=trainable_arrays(server_model), num_rounds=rounds, evaluate_fn=evaluate)
    if len(result.arrays):  # empty when no round produced a usable gradient
        load_arrays(server_model, result.arrays)

    captured: list[list[SharedGradient]] = [[] for _ in range(rounds)]
    for d in grid.deliveries:
        if d.reply.has_error():
            continue
        c = d.node_id - FIRST_NODE_ID
        record = next(iter(d.reply.content.array_records.values()))
        metrics = next(iter(d.reply.content.metric_records.values()), {})
        captured[d.server_round - 1].append(
            SharedGradient(
                server_round=d.server_round,
                client=c,
                grads={k: torch.from_numpy(a.numpy()) for k, a in record.items()},
                batch=trainers[c].batches_used[d.server_round],
                metrics=dict(metrics),
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
                **{k: float(v) for k, v in result.evaluate_metrics_serverapp.get(r, {}).items()},
                **{k: float(v) for k, v in result.train_metrics_clientapp.get(r, {}).items()},
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
        spec = defence
        probe = make_defence(spec)
        if isinstance(probe, Aegis):
            return probe.config, None
        return None, lambda: make_defence(spec)
    if callable(defence):
        probe = defence()
        if isinstance(probe, Aegis):
            return probe.config, None
        return None, defence
    raise TypeError(f"defence={defence!r}: pass None, a spec string, an AegisConfig or a factory () -> Defence")


def _with_faults(trainer: ClientTrainer, client: int, faults: Mapping[tuple[int, int], str]):
    def train(msg: Message, context: Context) -> Message:
        if faults.get((_server_round(msg.content), client)) == "raise":
            raise RuntimeError(f"injected failure of client {client}")
        return trainer(msg, context)

    return train


def _defence_name(aegis_config: AegisConfig | None, trainers: list[ClientTrainer]) -> str:
    if aegis_config is not None:
        return Aegis(aegis_config).name
    return trainers[0].defence.name if trainers else "none"


# -- the Flower app ----------------------------------------------------------------------------
DEFAULT_RUN_CONFIG: dict[str, Any] = {
    "num-server-rounds": 3,
    "lr": 0.1,
    "server-optimizer": "sgd",
    "batch-size": 4,
    "model-layers": 2,
    "model-width": 384,
    "model-heads": 6,
    "min-nodes": 2,
    "fraction-train": 1.0,
}
_MODELS: dict[tuple[int, int, int], tuple[nn.Module, Any]] = {}
_TRAINERS: dict[tuple, ClientTrainer] = {}


def _settings(run_config: Mapping[str, Any]) -> dict[str, Any]:
    return {**DEFAULT_RUN_CONFIG, **{k: v for k, v in run_config.items() if k in DEFAULT_RUN_CONFIG}}


def _decoder(settings: Mapping[str, Any]) -> tuple[nn.Module, Any]:
    """A fresh copy of the offline default decoder (built once per process) and its tokenizer.

    Width 384 uses MiniLM's pretrained embeddings; other widths are random (small test federations)."""
    key = (int(settings["model-layers"]), int(settings["model-width"]), int(settings["model-heads"]))
    if key not in _MODELS:
        from ..models import default_decoder

        _MODELS[key] = default_decoder(n_layer=key[0], n_embd=key[1], n_head=key[2])
    model, tok = _MODELS[key]
    return copy.deepcopy(model), tok


def tokenize(tok, texts: Sequence[str]) -> Batch:
    """A causal-LM batch: right padding, pads masked out of attention and out of the loss (label -100)."""
    enc = tok(list(texts), padding=True, return_tensors="pt")
    labels = enc["input_ids"].masked_fill(enc["attention_mask"] == 0, -100)
    return {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"], "labels": labels}


def _trainer(context: Context) -> ClientTrainer:
    s = _settings(context.run_config)
    part = int(context.node_config.get("partition-id", 0))
    parts = int(context.node_config.get("num-partitions", 1))
    key = (context.run_id, context.node_id, part, parts, *(s[k] for k in sorted(s)))
    if key not in _TRAINERS:
        model, tok = _decoder(s)
        texts = [e.text for e in load_corpus("train")][part::parts]
        size = int(s["batch-size"])
        _TRAINERS[key] = ClientTrainer(model, [tokenize(tok, texts[i : i + size]) for i in range(0, len(texts), size)])
    return _TRAINERS[key]


client_app = ClientApp()


@client_app.train(mods=[AegisMod()])
def train(msg: Message, context: Context) -> Message:
    """One FedSGD step on this SuperNode's corpus shard, masked by AEGIS (settings from the run config)."""
    return _trainer(context)(msg, context)


server_app = ServerApp()


@server_app.main()
def main(grid: Grid, context: Context) -> None:
    """FedSGD on the trainable (non-attention) parameters; validation loss/perplexity after every round,
    also written to ``context.state["evaluation"]`` (lists indexed by round, round 0 = initial model)."""
    s = _settings(context.run_config)
    model, tok = _decoder(s)
    protect(model, None, config_from_run_config(context.run_config))
    texts = [e.text for e in load_corpus("validation")]
    validation = [tokenize(tok, texts[i : i + 16]) for i in range(0, len(texts), 16)]  # bounded logits memory
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
    strategy.start(grid=grid, initial_arrays=trainable_arrays(model), num_rounds=int(s["num-server-rounds"]), evaluate_fn=evaluate)
    context.state["evaluation"] = MetricRecord(history)


def validation_loss(model: nn.Module, batches: Sequence[Batch]) -> float:
    """Token-weighted mean loss of a causal LM over batches (labels -100 excluded)."""
    total = tokens = 0.0
    with torch.no_grad():
        for batch in batches:
            # HF shifts labels by one: the first label of every row is never predicted.
            n = float((batch["labels"][:, 1:] != -100).sum())
            total += float(model(**batch).loss) * n
            tokens += n
    return total / tokens


def simulate(num_supernodes: int = 2, run_config: Mapping[str, Any] | None = None, *, quiet: bool = True) -> tuple[Context, InProcessGrid]:
    """Run ``server_app`` with ``num_supernodes`` copies of ``client_app`` in this process (no Ray).

    What ``flwr run`` does with a simulation federation, minus the transport. Returns the server's
    Context (``state["evaluation"]`` holds the validation curve) and the grid (every delivered reply).
    """
    config = {**DEFAULT_RUN_CONFIG, "min-nodes": num_supernodes, **(run_config or {})}
    nodes = [FIRST_NODE_ID + i for i in range(num_supernodes)]
    contexts = {
        node: Context(
            run_id=0, node_id=node, node_config={"partition-id": i, "num-partitions": num_supernodes},
            state=RecordDict(), run_config=config,
        )
        for i, node in enumerate(nodes)
    }
    grid = InProcessGrid({node: client_app for node in nodes}, contexts)
    server_context = Context(run_id=0, node_id=SUPERLINK_NODE_ID, node_config={}, state=RecordDict(), run_config=config)
    with flower_runtime(), _flower_log_level(logging.ERROR if quiet else None):
        server_app(grid, server_context)
    return server_context, grid
