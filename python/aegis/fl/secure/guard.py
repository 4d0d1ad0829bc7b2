"""The outermost client mod of a secure round: what a client accepts of a SecAgg+ round, and what it sends.

A client floods its update with a ``1 / sqrt(t)`` share of the flood (:mod:`aegis.fl.secure.client`), where
``t`` is the smallest number of survivors *the client* accepts (:class:`SurvivorPin`), never a number the
server sends. :class:`SecureGuard` answers only SecAgg+ stages and refuses (error reply, nothing sent) a round
whose setup asks for less than the pin: a reconstruction threshold below ``t`` or not above half the shares
(a server that tells different clients different dropouts could otherwise rebuild one client's mask), fewer
than ``t`` sampled clients, a modulus that overflows for the sampled count, a weight that does not quantise
exactly, nodes outside the client's peer list (where it has one: without one, every node the server names
counts toward ``t``, nodes the server runs itself included), fewer than ``t`` neighbours at any later stage,
or being told it dropped. On the way out it lets through only the SecAgg+ record and the legacy FitRes
fields with public constants (``num_examples`` 1, no metrics, status OK and empty): nothing travels in the
clear. :func:`check_quantisation` is the quantisation rule both sides check.
"""
from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

from flwr.app import ConfigRecord, Context, Error, Message, RecordDict
from flwr.app.message_type import MessageType
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key, Stage

from ..client import MOD_FAILED_PRECONDITION
from . import patch

# The legacy FitRes layout the SecAgg+ workflow reads (flwr.compat's fitres_to_recorddict), with the
# only values an AEGIS client sends in the clear: public constants.
FITRES_PARAMETERS, FITRES_NUM_EXAMPLES = "fitres.parameters", "fitres.num_examples"
FITRES_METRICS, FITRES_STATUS = "fitres.metrics", "fitres.status"
FITINS_PARAMETERS, FITINS_CONFIG = "fitins.parameters", "fitins.config"
NUM_EXAMPLES = 1  # the SecAgg+ weight of every client: the server gets the plain mean of the survivors
MAX_WEIGHT = float(NUM_EXAMPLES)  # weight / max_weight = 1 quantises exactly
CLIP_SDS = 8.0  # the clipping range must cover signal + this many standard deviations of the share
# SecAgg+ quantises [-c, c] to the integers [0, q] (step 2c / q) by stochastic rounding, whose error has a
# variance below step^2 / 4: a step at most the share's smallest noise sd adds at most a quarter of its variance.
QUANT_STEP_SDS = 1.0
# The only reason a refusal sends: why a client refused (a failed check on its own data, a budget) is
# itself information, so it stays in the client's log and SecureGuard.refusals.
REFUSAL = "SecureGuard refused this SecAgg+ stage; the reason is in the client's log"
SETUP_KEY = "aegis-secagg-setup"  # this client's copy of the accepted setup (Context.state, never sent)
log = logging.getLogger("aegis.fl")
REPLY_FIELDS = {  # what each stage may send: the SecAgg+ record's fields
    Stage.SETUP: {Key.PUBLIC_KEY_1, Key.PUBLIC_KEY_2},
    Stage.SHARE_KEYS: {Key.DESTINATION_LIST, Key.CIPHERTEXT_LIST},
    Stage.COLLECT_MASKED_VECTORS: {Key.MASKED_PARAMETERS},
    Stage.UNMASK: {Key.NODE_ID_LIST, Key.SHARE_LIST},
}


@dataclass(frozen=True)
class SurvivorPin:
    """What a client accepts of a secure round.

    min_survivors:  t, the fewest clients whose sum the server may learn; the client's noise share is
                    ``sigma / sqrt(t)`` of the flood, so the sum of ``n >= t`` shares is at least one flood.
    peers:          node ids of the clients it trusts to add their own share (an allow-list from outside
                    the server, e.g. Flower's node authentication); any other node in the round is refused.
                    None: every node the server names counts toward t (sybils the server runs then do too).
    """

    min_survivors: int
    peers: frozenset[int] | None = None

    def __post_init__(self):
        if not isinstance(self.min_survivors, int) or self.min_survivors < 2:
            raise ValueError(
                f"min_survivors={self.min_survivors!r}: pin at least 2 survivors (with 1 the server sees this "
                "client's update alone); the noise share is sigma / sqrt(min_survivors)"
            )
        if self.peers is not None:
            object.__setattr__(self, "peers", frozenset(int(p) for p in self.peers))
            if len(self.peers) < self.min_survivors:
                raise ValueError(
                    f"peers: {len(self.peers)} trusted node(s) cannot make min_survivors={self.min_survivors}: "
                    "list more peers or lower the pin"
                )

    @property
    def share(self) -> float:
        """The noise share: the factor on the flood's sigma."""
        return 1.0 / math.sqrt(self.min_survivors)



def check_quantisation(*, clipping_range: float, quantization_range: int, modulus_range: int,
                       max_weight: float, clients: int, bound: float | None = None,
                       noise: float | None = None) -> None:
    """Raise (naming the parameter and the fix) unless SecAgg+'s quantisation is exact for this round:
    the weight quantises exactly, the modulus holds the sum of ``clients`` quantised updates, (given
    ``bound``, the largest entry of an update) the clipping range covers every entry, and (given
    ``noise``, the update's smallest noise sd) the step 2 clipping_range / quantization_range is at most
    :data:`QUANT_STEP_SDS` times it."""
    if max_weight != MAX_WEIGHT:
        raise ValueError(
            f"max_weight={max_weight}: AEGIS clients send the public weight {NUM_EXAMPLES}, which quantises "
            f"exactly only with SecAggPlusWorkflow(max_weight={MAX_WEIGHT})"
        )
    if quantization_range < 2 or modulus_range & (modulus_range - 1):
        raise ValueError(f"quantization_range={quantization_range}, modulus_range={modulus_range}: use a power-of-two "
                         "modulus_range and quantization_range >= 2")
    if clients * quantization_range >= modulus_range:
        need = 1 << (clients * quantization_range).bit_length()
        raise ValueError(
            f"modulus_range={modulus_range}: the sum of {clients} updates quantised to [0, {quantization_range}] "
            f"overflows it; use SecAggPlusWorkflow(modulus_range={need}) or fewer clients per round"
        )
    if bound is not None and not clipping_range >= bound:
        raise ValueError(
            f"clipping_range={clipping_range}: the update's entries reach {bound:.4g} (signal + {CLIP_SDS:g} sd of "
            f"the noise share) and SecAgg+ would clip them silently; use SecAggPlusWorkflow(clipping_range >= "
            f"{bound:.4g}) (aegis.fl.secure.server.required_clipping_range)"
        )
    step = 2 * clipping_range / quantization_range
    if noise is not None and noise > 0 and not step <= QUANT_STEP_SDS * noise:
        need = 1 << math.ceil(math.log2(2 * clipping_range / (QUANT_STEP_SDS * noise)))
        fix = f"use SecAggPlusWorkflow(quantization_range >= {need}) or a smaller clipping_range"
        raise ValueError(
            f"quantization_range={quantization_range}, clipping_range={clipping_range}: the quantisation step "
            f"{step:.3g} exceeds {QUANT_STEP_SDS:g} x the update's smallest noise sd {noise:.3g}, so rounding, not "
            f"the flood, would set what the sum carries; {fix}"
        )


@dataclass(frozen=True)
class SecAggSetup:
    """The SecAgg+ parameters a setup stage announces (what this client checks and keeps)."""

    sampled: int
    shares: int
    threshold: int
    clipping_range: float
    quantization_range: int
    modulus_range: int
    max_weight: float

    _KEYS = ((Key.SAMPLE_NUMBER, int), (Key.SHARE_NUMBER, int), (Key.THRESHOLD, int), (Key.CLIPPING_RANGE, float),
             (Key.TARGET_RANGE, int), (Key.MOD_RANGE, int), (Key.MAX_WEIGHT, float))

    @classmethod
    def read(cls, configs: ConfigRecord) -> SecAggSetup:
        return cls(*(_number(configs, key, kind) for key, kind in cls._KEYS))

    def record(self) -> ConfigRecord:
        return ConfigRecord({key: value for (key, _), value in zip(self._KEYS, vars(self).values())})

    def check(self, bound: float | None = None, noise: float | None = None) -> None:
        check_quantisation(clipping_range=self.clipping_range, quantization_range=self.quantization_range,
                           modulus_range=self.modulus_range, max_weight=self.max_weight, clients=self.sampled,
                           bound=bound, noise=noise)


def _number(configs: ConfigRecord, key: str, kind: type[int] | type[float]):
    value = configs.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and not isinstance(value, int)):
        raise TypeError(f"the server's '{key}' = {value!r} is not a {kind.__name__}")
    return kind(value)


def _ids(configs: ConfigRecord, key: str) -> set[int]:
    value = configs.get(key, [])
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise TypeError(f"the server's '{key}' is not a list of node ids")
    return {int(v) for v in value}


# -- the guard -------------------------------------------------------------------------------------
class SecureGuard:
    """Outermost client mod of a secure round (see the module docstring): refuses setups below the
    pin, sybils and shrunken survivor sets, and anything in the clear on the way out."""

    def __init__(self, pin: SurvivorPin) -> None:
        self.pin = pin
        self.refusals: list[str] = []  # why this client refused, in order (kept here and logged, never sent)

    def __call__(self, msg: Message, context: Context, call_next: Callable[[Message, Context], Message]) -> Message:
        if msg.metadata.message_type != MessageType.TRAIN:
            return self._refuse(msg, "a secure AEGIS client answers SecAgg+ train rounds only")
        try:
            patch.require_installed()
            stage = self._check_in(msg, context)
        except (KeyError, TypeError, ValueError, RuntimeError) as err:
            return self._refuse(msg, str(err))
        try:
            reply = call_next(msg, context)
        except Exception as err:  # noqa: BLE001 - whatever failed, nothing of this round may leave
            return self._refuse(msg, f"{type(err).__name__}: {err}")
        if reply.has_error():
            return self._refuse(msg, f"the inner app replied with an error: {reply.error.reason}")
        problem = _clear_text(reply.content, stage)
        return reply if problem is None else self._refuse(msg, problem)

    def _refuse(self, msg: Message, reason: str) -> Message:
        self.refusals.append(reason)
        log.warning("SecureGuard refused: %s", reason)
        return Message(Error(code=MOD_FAILED_PRECONDITION, reason=REFUSAL), reply_to=msg)

    def _check_in(self, msg: Message, context: Context) -> str:
        """The stage of an acceptable incoming message; raises why one is not."""
        configs = msg.content.config_records.get(RECORD_KEY_CONFIGS)
        if configs is None or not isinstance(configs.get(Key.STAGE), str):
            raise ValueError("not a SecAgg+ message: a secure client never sends its update outside SecAgg+")
        stage, t, node = str(configs[Key.STAGE]), self.pin.min_survivors, msg.metadata.dst_node_id
        if stage == Stage.SETUP:
            setup = SecAggSetup.read(configs)
            if setup.threshold < t:
                raise ValueError(f"reconstruction_threshold={setup.threshold} is below this client's pin of {t} "
                                 f"survivors: use SecAggPlusWorkflow(reconstruction_threshold >= {t})")
            if 2 * setup.threshold <= setup.shares:
                raise ValueError(
                    f"reconstruction_threshold={setup.threshold} is not above half of num_shares={setup.shares}: a "
                    "server could rebuild one client's mask from two disjoint halves; raise it above num_shares / 2")
            if setup.sampled < t:
                raise ValueError(f"{setup.sampled} clients sampled, fewer than this client's pin of {t}")
            setup.check()
            context.state.config_records[SETUP_KEY] = setup.record()
        elif SETUP_KEY not in context.state.config_records:
            raise ValueError(f"stage {stage!r} without an accepted setup")
        elif stage == Stage.SHARE_KEYS:
            self._members({int(k) for k in configs if k != Key.STAGE} - {node}, stage)
        elif stage == Stage.COLLECT_MASKED_VECTORS:
            self._members(_ids(configs, Key.SOURCE_LIST), stage)
        elif stage == Stage.UNMASK:
            active, dead = _ids(configs, Key.ACTIVE_NODE_ID_LIST), _ids(configs, Key.DEAD_NODE_ID_LIST)
            if node not in active or active & dead:
                raise ValueError(f"the server lists this node as dropped, or a neighbour as both active and dropped "
                                 f"({stage})")
            self._members(active - {node}, stage)
        return stage

    def _members(self, others: set[int], stage: str) -> None:
        """This node plus ``others`` must be at least t trusted clients."""
        peers, t = self.pin.peers, self.pin.min_survivors
        if peers is not None and others - peers:
            raise ValueError(f"{stage}: node(s) {sorted(others - peers)[:5]} are not among this client's trusted "
                             "peers (sybils count toward no pin)")
        if len(others) + 1 < t:
            raise ValueError(f"{stage}: {len(others) + 1} client(s) left, fewer than this client's pin of {t} "
                             "survivors (the server claims dropouts to shrink the sum)")


def _clear_text(content: RecordDict, stage: str) -> str | None:
    """Why the outgoing content carries more than SecAgg+ needs in the clear, or None."""
    allowed = {RECORD_KEY_CONFIGS}
    if stage == Stage.COLLECT_MASKED_VECTORS:
        allowed |= {FITRES_PARAMETERS, FITRES_NUM_EXAMPLES, FITRES_METRICS, FITRES_STATUS}
    extra = sorted(set(content.keys()) - allowed)
    if extra:
        return f"record(s) {extra} would travel in the clear beside SecAgg+'s; a secure reply carries none"
    fields = set(content.config_records[RECORD_KEY_CONFIGS].keys()) if RECORD_KEY_CONFIGS in content else set()
    if fields != REPLY_FIELDS[stage]:
        return f"the SecAgg+ record of stage {stage!r} has fields {sorted(fields)}, not {sorted(REPLY_FIELDS[stage])}"
    if stage != Stage.COLLECT_MASKED_VECTORS:
        return None
    if len(content.array_records.get(FITRES_PARAMETERS, {})):
        return "the update's arrays are still in the reply after masking"
    if dict(content.metric_records.get(FITRES_NUM_EXAMPLES, {})) != {"num_examples": NUM_EXAMPLES}:
        return f"num_examples must be the public constant {NUM_EXAMPLES}"
    if len(content.config_records.get(FITRES_METRICS, {})):
        return "metrics would travel in the clear: a secure reply sends none"
    if dict(content.config_records.get(FITRES_STATUS, {})) != {"code": 0, "message": ""}:
        return "the status must be the constant OK with an empty message"
    return None


def reply_stage(msg: Message) -> str:
    """The SecAgg+ stage a reply answers, by the fields of its record ("error" for an error reply, "?" if none)."""
    if msg.has_error():
        return "error"
    configs = msg.content.config_records.get(RECORD_KEY_CONFIGS)
    fields = set() if configs is None else set(configs.keys())
    return next((stage for stage, expected in REPLY_FIELDS.items() if fields == expected), "?")
