"""Client side of AEGIS on Flower: the FedSGD training function and ``AegisMod``, which fails closed.

A Flower mod only sees the outgoing Message, never the training loop, so the work is split (the same
split as Opacus's optimizer + module wrapper):

* the training function (:class:`ClientTrainer`) computes the batch gradient, masks it with the shield
  and packs ``shield.export()`` with :func:`pack_masked`, which also records a *receipt* (the digest of
  the packed arrays and the AEGIS configuration used) in the mod's call scope;
* :class:`AegisMod` configures AEGIS at call time from the client's own configuration, which the run config
  may only tighten (:mod:`aegis.fl.floor`; the train function reads the result with :func:`active_config`),
  and, on the way back, refuses any reply that is not exactly an AEGIS
  reply (below) whose arrays are byte for byte what a shield masked during this very call with this
  call's configuration. A forgotten ``mask_()``, a raw ``p.grad`` packed by hand, arrays edited after
  masking, a wrong preset or a fixed seed, a metrics-only reply, an extra record (a raw gradient in a
  ConfigRecord or MetricRecord, a second ArrayRecord) or an unknown metric all turn into an error reply;
  nothing unmasked is sent.

**What a train reply contains** (:func:`reply_content` builds it; nothing else passes the mod):

* ``"arrays"`` — one ArrayRecord: the masked gradient of the trainable parameters (fp32);
* ``"aegis"`` — the proof ConfigRecord ``{"masked": True, "digest": <sha256 of the arrays>}``;
* ``"metrics"`` — the MetricRecord ``{"num-examples": 1}`` (:data:`REPLY_METRICS`): a public constant
  weight, so FedSGD takes the unweighted mean of the clients' gradients (each already a per-example
  mean over the client's batch; the batch size is a configured public constant anyway).

Nothing computed from the private batch travels besides the masked gradient. In particular the clean
batch loss is **not** sent: with the global model the server can score any candidate text by its loss,
and the candidate whose loss equals the reported one is the private batch (the true word order of a
sentence ranks first among all its permutations, with |Δloss| = 0). The true batch size is not sent
either (a short last batch tells the size of the client's shard). The server measures the loss on its
own held-out data instead (``aegis.fl.task.validation_loss``).

Register the mod first so it is the last to touch the reply: ``@app.train(mods=[AegisMod(), ...])``.
"""
from __future__ import annotations

import contextvars
import hashlib
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Error, Message, MetricRecord, RecordDict
from torch import Tensor, nn

from ..config import AegisConfig
from ..defence import Aegis, Batch, Defence, LossFn, lm_loss
from ..shield import Shield
from .floor import config_from_run_config

log = logging.getLogger(__name__)

ARRAYS_KEY, METRICS_KEY, CONFIG_KEY, PROOF_KEY = "arrays", "metrics", "config", "aegis"
# Values of Flower's ErrorCode (flwr.common.constant is not public API).
CLIENT_APP_RAISED_EXCEPTION = 2
MOD_FAILED_PRECONDITION = 6

# The only metrics a reply may carry, with the only value each may take: public constants, nothing
# computed from the private batch. "num-examples" is the FedSGD weight: 1 per client (unweighted mean).
REPLY_METRICS: dict[str, int] = {"num-examples": 1}
PROOF_FIELDS = ("masked", "digest")


@dataclass
class _Session:
    """One AegisMod call: its configuration and the receipts of what shields masked during it."""

    config: AegisConfig
    receipts: dict[str, AegisConfig] = field(default_factory=dict)


_SESSION: contextvars.ContextVar[_Session | None] = contextvars.ContextVar("aegis_fl_session", default=None)


def active_config() -> AegisConfig | None:
    """The AEGIS configuration of the enclosing AegisMod call, or None outside one."""
    session = _SESSION.get()
    return None if session is None else session.config


def digest(record: ArrayRecord) -> str:
    """SHA-256 over the keys, dtypes, shapes and bytes of an ArrayRecord, in order."""
    h = hashlib.sha256()
    for key, array in record.items():
        h.update(repr((key, array.dtype, tuple(array.shape), array.stype, len(array.data))).encode())
        h.update(array.data)
    return h.hexdigest()


def pack_gradients(grads: Mapping[str, Tensor]) -> ArrayRecord:
    """An ArrayRecord of fp32 NumPy arrays (bf16 cannot travel through NumPy), keys in order."""
    return ArrayRecord({k: Array(g.detach().to("cpu", torch.float32).numpy()) for k, g in grads.items()})


def pack_masked(shield: Shield) -> tuple[ArrayRecord, ConfigRecord]:
    """``shield.export()`` packed for Flower, plus the proof the mod checks; fails closed if unmasked."""
    record = pack_gradients(shield.export())
    d = digest(record)
    session = _SESSION.get()
    if session is not None:
        session.receipts[d] = shield.config
    return record, ConfigRecord({"masked": True, "digest": d})


def reply_content(arrays: ArrayRecord, proof: ConfigRecord | None = None) -> RecordDict:
    """The whole content of a train reply: the arrays, the proof (AEGIS) and :data:`REPLY_METRICS`.

    ``reply_content(*pack_masked(shield))`` is what :class:`AegisMod` lets through; add nothing to it.
    """
    content = RecordDict({ARRAYS_KEY: arrays})
    if proof is not None:
        content[PROOF_KEY] = proof
    content[METRICS_KEY] = MetricRecord(dict(REPLY_METRICS))
    return content


# What the server reads of any refusal: one constant. The reason stays in the client's log, since it may tell
# the server about the private batch (how many of its examples were already exported, which tensor was NaN).
REFUSAL = "AegisMod refused to send the reply; the reason is in the client's log"


def refuse(msg: Message, reason: str) -> Message:
    """The error reply AegisMod sends instead of an unmasked one: the constant REFUSAL; ``reason`` is logged."""
    log.warning("AegisMod refused to send the reply: %s", reason)
    return Message(Error(code=MOD_FAILED_PRECONDITION, reason=REFUSAL), reply_to=msg)


class AegisMod:
    """Flower client mod: AEGIS configured by the client, unmasked replies refused.

    ``config`` is the client's own configuration, a floor: on every call the run config's ``aegis-*`` keys
    may tighten it and a key that would relax it is refused (:func:`~aegis.fl.floor.config_from_run_config`).
    It must not carry a fixed seed.
    """

    def __init__(self, config: AegisConfig | None = None) -> None:
        config = config or AegisConfig()
        if config.seed is not None or config.device_seed:
            raise ValueError("AegisMod: a Flower client must draw a fresh secret seed per step (config.seed=None)")
        self.config = config

    def __call__(self, msg: Message, context: Context, call_next: Callable[[Message, Context], Message]) -> Message:
        try:
            config = config_from_run_config(context.run_config, self.config)
        except (ValueError, TypeError) as err:
            return refuse(msg, f"AEGIS run config refused: {err}")
        session = _Session(config)
        token = _SESSION.set(session)
        try:
            reply = call_next(msg, context)
        except Exception as err:  # Flower would send the exception's text to the server
            return refuse(msg, f"{type(err).__name__}: {err}")
        finally:
            _SESSION.reset(token)
        if reply.has_error():  # an error carries no records, but its reason is the client's text
            return refuse(msg, f"error {reply.error.code}: {reply.error.reason}")
        problem = _unmasked(reply.content, session)
        return reply if problem is None else refuse(msg, problem)


_BUILD_HINT = "build the reply with aegis.fl.client.reply_content(*pack_masked(shield)) and add nothing to it"


def _unmasked(content: RecordDict, session: _Session) -> str | None:
    """Why the reply is not exactly an AEGIS reply masked in this session, or None.

    Allowed, and required: one ArrayRecord under ``"arrays"`` masked during this call, the proof
    ConfigRecord under ``"aegis"`` (fields ``masked`` and ``digest`` only) and the MetricRecord under
    ``"metrics"`` equal to :data:`REPLY_METRICS`. Any other record could carry the private batch.
    """
    arrays, configs, metrics = content.array_records, content.config_records, content.metric_records
    if not arrays:
        return (
            "the reply carries no ArrayRecord (a metrics-only reply): an AEGIS train reply is the masked "
            f"gradient, its proof and {REPLY_METRICS}; {_BUILD_HINT}"
        )
    if list(arrays) != [ARRAYS_KEY]:
        return (
            f"{len(arrays)} ArrayRecord(s) {sorted(arrays)} in the reply; an AEGIS reply carries exactly one, "
            f"the masked gradient under '{ARRAYS_KEY}': drop the others ({_BUILD_HINT})"
        )
    extra_configs = sorted(k for k in configs if k != PROOF_KEY)
    if extra_configs:
        return (
            f"ConfigRecord(s) {extra_configs} in the reply: only the proof '{PROOF_KEY}' may travel "
            f"(any other record could carry a raw gradient or the loss); remove them ({_BUILD_HINT})"
        )
    extra_metrics = sorted(k for k in metrics if k != METRICS_KEY)
    if extra_metrics:
        return (
            f"MetricRecord(s) {extra_metrics} in the reply: only '{METRICS_KEY}' = {REPLY_METRICS} may travel; "
            f"remove them ({_BUILD_HINT})"
        )
    if METRICS_KEY not in metrics:
        return (
            f"the reply has no MetricRecord '{METRICS_KEY}' = {REPLY_METRICS} (FedSGD needs its weight); {_BUILD_HINT}"
        )
    unknown = sorted(k for k in metrics[METRICS_KEY] if k not in REPLY_METRICS)
    if unknown:
        return (
            f"unknown metric key(s) {unknown}: a reply may carry only {sorted(REPLY_METRICS)} "
            "(metrics computed from the private batch, such as its loss, let the server recover it); remove them"
        )
    for key, expected in REPLY_METRICS.items():
        value = metrics[METRICS_KEY].get(key)
        if type(value) is not type(expected) or value != expected:
            return (
                f"metric '{key}' = {value!r}, expected the public constant {expected!r} "
                "(a value computed from the private batch must not travel); send REPLY_METRICS unchanged"
            )
    record = arrays[ARRAYS_KEY]
    proof = configs.get(PROOF_KEY)
    if proof is None or proof.get("masked") is not True:
        return "the arrays are not marked as masked (pack them with aegis.fl.pack_masked(shield))"
    if sorted(proof) != sorted(PROOF_FIELDS):
        extra = sorted(set(proof) - set(PROOF_FIELDS))
        return (
            f"the proof '{PROOF_KEY}' has fields {extra} beyond {list(PROOF_FIELDS)}: send pack_masked's proof "
            "unchanged"
        )
    d = digest(record)
    if proof.get("digest") != d:
        return "the arrays changed after masking (digest mismatch)"
    if d not in session.receipts:
        return "no shield masked these arrays during this call"
    if session.receipts[d] != session.config:
        return "the arrays were masked with a configuration other than this run's run_config"
    return None


class ClientTrainer:
    """One FedSGD client as a ClientApp train function ``(Message, Context) -> Message``.

    Each call loads the global trainable arrays into ``model``, takes this round's batch, computes the
    gradient of ``loss_fn``, applies the defence and replies with :func:`reply_content`: the shared
    gradient (fp32 ArrayRecord ``arrays``), the AEGIS proof and ``metrics`` = :data:`REPLY_METRICS`
    (``num-examples`` = 1, a public constant). The batch loss is computed but never sent (it is an
    oracle for the batch, see the module docstring); nor is the true batch size.

    defence:  ``None`` (default) = AEGIS configured by the enclosing AegisMod (required then); an
              :class:`aegis.defence.Aegis` adds the masking proof; any other Defence (the audit's
              baselines) replies without one, and AegisMod would refuse it.
    batches:  a sequence (round r uses ``batches[(r - 1) % len(batches)]``) or ``server_round -> batch``.
    ``batches_used[r]`` keeps the batch of round r: ground truth for scoring attacks, never sent.
    """

    def __init__(
        self,
        model: nn.Module,
        batches: Sequence[Batch] | Callable[[int], Batch],
        *,
        defence: Defence | None = None,
        loss_fn: LossFn = lm_loss,
    ) -> None:
        self.model, self.loss_fn, self._batches = model, loss_fn, batches
        self.defence = defence.attach(model) if defence is not None else None
        self._aegis: Aegis | None = None
        self.batches_used: dict[int, Batch] = {}

    def batch(self, server_round: int) -> Batch:
        if callable(self._batches):
            return self._batches(server_round)
        return self._batches[(server_round - 1) % len(self._batches)]

    def current_defence(self) -> Defence:
        if self.defence is not None:
            return self.defence
        config = active_config()
        if config is None:
            raise RuntimeError(
                "ClientTrainer(defence=None) runs AEGIS as configured by AegisMod: register it with "
                "@app.train(mods=[AegisMod()]) or pass a defence"
            )
        if self._aegis is None or self._aegis.config != config:
            self._aegis = Aegis(config)
            self._aegis.attach(self.model)
        return self._aegis

    def __call__(self, msg: Message, context: Context) -> Message:
        defence = self.current_defence()
        load_arrays(self.model, _single_array_record(msg.content))
        server_round = server_round_of(msg.content)
        batch = self.batch(server_round)
        for p in self.model.parameters():
            p.grad = None
        defence.backward(batch, self.loss_fn)  # the loss stays here: it is an oracle for the batch
        defence.defend_()
        if isinstance(defence, Aegis):
            if defence.shield is None:  # attach() protects the model; a defence that was detached has none
                raise RuntimeError(f"{defence.name}: not attached to a model")
            content = reply_content(*pack_masked(defence.shield))
        else:
            content = reply_content(pack_gradients(defence.export()))
        self.batches_used[server_round] = batch
        return Message(content, reply_to=msg)


def load_arrays(model: nn.Module, record: ArrayRecord) -> None:
    """Copy the global arrays into the model's trainable parameters; the keys must match exactly."""
    params = dict(model.named_parameters())
    expected = {n for n, p in params.items() if p.requires_grad}
    if set(record.keys()) != expected:
        extra, missing = sorted(set(record.keys()) - expected), sorted(expected - set(record.keys()))
        raise ValueError(
            f"the server's arrays do not match the trainable parameters (extra {extra[:3]}, missing {missing[:3]})"
        )
    with torch.no_grad():
        for key, array in record.items():
            params[key].copy_(torch.from_numpy(array.numpy()))


def trainable_arrays(model: nn.Module) -> ArrayRecord:
    """The model's trainable parameters as fp32 arrays: the global state FedSGD starts from."""
    return pack_gradients({n: p for n, p in model.named_parameters() if p.requires_grad})


def _single_array_record(content: RecordDict) -> ArrayRecord:
    if len(content.array_records) != 1:
        raise ValueError(
            f"expected one ArrayRecord (the global model) in the message, got {len(content.array_records)}"
        )
    return next(iter(content.array_records.values()))


def server_round_of(content: RecordDict) -> int:
    """The round an instruction belongs to (its ConfigRecord's ``server-round``; 0 if none)."""
    for record in content.config_records.values():
        if "server-round" in record:
            value = record["server-round"]
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"the instruction's server-round must be an int, got {value!r}")
            return value
    return 0
