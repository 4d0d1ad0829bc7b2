"""Client side of AEGIS over Flower's SecAgg+: a noise share per client, the server sees only the sum.

Each client floods its update with the shield's public parameters but ``sigma / sqrt(t)``
(:func:`noise_share`), where ``t`` is the smallest number of survivors *the client* accepts
(:class:`SurvivorPin`), never a number the server sends. The sum over ``n >= t`` survivors then carries
noise of standard deviation ``sigma * sqrt(n / t) >= sigma`` per entry: at least one full flood.

The client is three layers, outermost first (``@app.train(mods=[SecureGuard(pin), secaggplus_mod])``
around :class:`SecureTrainer`):

* :class:`SecureGuard` answers only SecAgg+ stages and refuses (error reply, nothing sent) a round
  whose setup asks for less than the pin: a reconstruction threshold below ``t`` or not above half the
  shares (a server that tells different clients different dropouts could otherwise rebuild one
  client's mask), fewer than ``t`` sampled clients, a modulus that overflows for the sampled count, a
  weight that does not quantise exactly, peers outside the client's allow-list (sybils), fewer than
  ``t`` neighbours at any later stage, or being told it dropped. On the way out it lets through only
  the SecAgg+ record and the legacy FitRes fields with public constants (``num_examples`` 1, no
  metrics, status OK and empty): nothing travels in the clear.
* Flower's ``secaggplus_mod`` quantises and masks (with :mod:`aegis.fl.secagg_patch`'s cipher).
* :class:`SecureTrainer` trains (FedSGD: one batch; FedAvg: E local SGD steps, reply = pseudo-gradient
  ``(global - local) / lr``), floods each step with the share, and checks before replying that the
  server's ``clipping_range`` covers every entry's signal bound plus 8 standard deviations of its noise.
"""
from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Error, Message, MetricRecord, RecordDict
from flwr.app.message_type import MessageType
from flwr.common import bytes_to_ndarray
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key, Stage
from torch import Tensor, nn

from ..config import AegisConfig
from ..defence import Batch, LossFn, lm_loss
from ..shield import Shield, protect
from . import secagg_patch
from .client import MOD_FAILED_PRECONDITION

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


# -- the share -------------------------------------------------------------------------------------
@contextlib.contextmanager
def noise_share(shield: Shield, scale: float) -> Iterator[Tensor]:
    """For the ``mask_()`` calls in the block: the shield's public (rho, sigma, clip, thr) table with
    sigma times ``scale`` (1/sqrt(t) for a share; 0 gives the bare signal rho clip(G), for attacks).

    Yields the table the floods use (a copy). Needs the public calibration (the batch calibration's
    sigma reads the private gradient, so no share of it can be sized in advance)."""
    if not 0.0 <= scale <= 1.0:
        raise ValueError(f"scale={scale}: a noise share is a factor in [0, 1] on the flood's sigma")
    with shield.scaled_table(sigma=scale) as table:
        yield table


def entry_bound(tables: Sequence[Tensor]) -> float:
    """The largest entry an update of these steps can take, with the shares' noise at CLIP_SDS sd:
    sum over steps of rho * clip (every clipped row or tensor bounds each entry) plus CLIP_SDS times
    the root sum of the steps' sigma^2, maximised over tensors."""
    if not tables or tables[0].numel() == 0:
        return 0.0
    t = torch.stack([x.double() for x in tables])  # (steps, tensors, 4)
    signal = (t[..., 0] * t[..., 2]).sum(0)
    noise = t[..., 1].pow(2).sum(0).sqrt()
    bound = signal + CLIP_SDS * noise
    if not bool(torch.isfinite(bound).all()):
        raise ValueError("the shield's public table has a non-finite clip or sigma: no clipping range covers it")
    return float(bound.max())


def noise_floor(tables: Sequence[Tensor]) -> float:
    """The smallest noise sd of an update of these steps over its noisy tensors: the root sum of the steps'
    sigma^2, minimised over the tensors that have noise (inf for none; a configuration without noise on a
    tensor, lam 0, sends it as it is, and no step compares with that)."""
    if not tables or tables[0].numel() == 0:
        return math.inf
    t = torch.stack([x.double() for x in tables])  # (steps, tensors, 4)
    sd = t[..., 1].pow(2).sum(0).sqrt()
    sd = sd[sd > 0]
    return float(sd.min()) if sd.numel() else math.inf


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
            f"{bound:.4g}) (aegis.fl.secure_server.required_clipping_range)"
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
            secagg_patch.require_installed()
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


# -- the trainer -----------------------------------------------------------------------------------
class SecureTrainer:
    """The train function inside ``secaggplus_mod``: the update floods with the pin's noise share.

    Reads the legacy FitIns (``fitins.parameters`` in ``names`` order, ``fitins.config`` with
    ``server-round``, ``algorithm`` "fedsgd" | "fedavg", and for FedAvg ``local-steps`` and ``lr``) and
    replies in the legacy FitRes layout with public constants. Round r takes the E batches from
    ``batches[(r - 1) * E]`` on (FedSGD: E = 1), cyclically: each round fresh batches, so a FedAvg client
    exports no batch twice before it has used them all (AEGIS's exposure budget counts re-exports).
    ``tables[r]``, ``batches_used[r]`` and ``updates[r]`` keep the flood tables, batches and update of
    round r (ground truth for the audit; never sent)."""

    def __init__(self, model: nn.Module, batches: Sequence[Batch], pin: SurvivorPin, *,
                 config: AegisConfig | None = None, loss_fn: LossFn = lm_loss) -> None:
        self.model, self.batches, self.pin, self.loss_fn = model, list(batches), pin, loss_fn
        self.shield = protect(model, None, config or AegisConfig())
        self.names = [n for n, p in model.named_parameters() if p.requires_grad]
        self.tables: dict[int, list[Tensor]] = {}
        self.batches_used: dict[int, list[Batch]] = {}
        self.updates: dict[int, list[Tensor]] = {}

    def __call__(self, msg: Message, context: Context) -> Message:
        content = msg.content
        config = content.config_records[FITINS_CONFIG]
        server_round, algorithm = _number(config, "server-round", int), str(config.get("algorithm", "fedsgd"))
        steps = _number(config, "local-steps", int) if algorithm == "fedavg" else 1
        if algorithm not in ("fedsgd", "fedavg") or steps < 1:
            raise ValueError(f"algorithm={algorithm!r}, local-steps={steps}: use fedsgd, or fedavg with >= 1 step")
        self._load(content.array_records[FITINS_PARAMETERS])
        params = [p for n, p in self.model.named_parameters() if p.requires_grad]
        start = [p.detach().clone() for p in params]
        lr = _number(config, "lr", float) if algorithm == "fedavg" else 1.0
        tables, used = [], []
        for s in range(steps):
            batch = self.batches[((server_round - 1) * steps + s) % len(self.batches)]
            for p in self.model.parameters():
                p.grad = None
            self.loss_fn(self.model, batch).backward()
            with noise_share(self.shield, self.pin.share) as table:
                self.shield.mask_()
            tables.append(table)
            used.append(batch)
            grads = self.shield.export()
            if algorithm == "fedavg":
                with torch.no_grad():
                    for n, p in zip(self.names, params):
                        p.sub_(grads[n], alpha=lr)
        if algorithm == "fedavg":  # the pseudo-gradient: the sum of the E masked steps
            update = [(s0 - p.detach()) / lr for s0, p in zip(start, params)]
        else:
            update = [grads[n] for n in self.names]
        SecAggSetup.read(context.state.config_records[SETUP_KEY]).check(entry_bound(tables), noise_floor(tables))
        self.tables[server_round], self.batches_used[server_round] = tables, used
        self.updates[server_round] = [u.detach().cpu().clone() for u in update]
        return Message(fitres_content(update), reply_to=msg)

    def _load(self, record: ArrayRecord) -> None:
        params = [p for p in self.model.parameters() if p.requires_grad]
        arrays = list(record.values())
        if len(arrays) != len(params):
            raise ValueError(f"the server sent {len(arrays)} arrays for {len(params)} trainable parameters")
        with torch.no_grad():
            for p, a in zip(params, arrays):
                value = torch.from_numpy(np.array(bytes_to_ndarray(a.data), dtype=np.float32))
                if value.shape != p.shape:
                    raise ValueError(f"the server sent shape {tuple(value.shape)} for one of shape {tuple(p.shape)}")
                p.copy_(value)


def fitres_content(update: Sequence[Tensor]) -> RecordDict:
    """The legacy FitRes layout of an update with public constants: weight 1, no metrics, status OK."""
    arrays = ArrayRecord({str(i): Array(u.detach().to("cpu", torch.float32).numpy()) for i, u in enumerate(update)})
    return RecordDict({
        FITRES_PARAMETERS: arrays,
        FITRES_NUM_EXAMPLES: MetricRecord({"num_examples": NUM_EXAMPLES}),
        FITRES_METRICS: ConfigRecord({}),
        FITRES_STATUS: ConfigRecord({"code": 0, "message": ""}),
    })
