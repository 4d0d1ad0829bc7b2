"""The train function of a secure round: the update floods with the client's noise share.

Each client floods its update with the shield's public parameters but ``sigma / sqrt(t)``
(:func:`noise_share`), where ``t`` is the client's own pin (:class:`~aegis.fl.secure.guard.SurvivorPin`). The
sum over ``n >= t`` survivors then carries noise of standard deviation ``sigma * sqrt(n / t) >= sigma`` per
entry: at least one full flood.

The client is three layers, outermost first (``@app.train(mods=[SecureGuard(pin), secaggplus_mod])``
around :class:`SecureTrainer`): :class:`~aegis.fl.secure.guard.SecureGuard`; Flower's ``secaggplus_mod``,
which quantises and masks (with :mod:`aegis.fl.secure.patch`'s cipher); :class:`SecureTrainer`, which trains
(FedSGD: one batch; FedAvg: E local SGD steps, reply = pseudo-gradient ``(global - local) / lr``), floods
each step with the share, and checks before replying that the server's ``clipping_range`` covers every
entry's signal bound plus 8 standard deviations of its noise, and that the quantisation step is at most the
update's smallest noise standard deviation.
"""
from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.common import bytes_to_ndarray
from torch import Tensor, nn

from ...config import AegisConfig
from ...defence import Batch, LossFn, lm_loss
from ...shield import Shield, protect
from .guard import (
    CLIP_SDS,
    FITINS_CONFIG,
    FITINS_PARAMETERS,
    FITRES_METRICS,
    FITRES_NUM_EXAMPLES,
    FITRES_PARAMETERS,
    FITRES_STATUS,
    NUM_EXAMPLES,
    SETUP_KEY,
    SecAggSetup,
    SurvivorPin,
    _number,
)


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
        load_arrays(self.model, record)


def load_arrays(model: nn.Module, record: ArrayRecord) -> None:
    """The server's global arrays into ``model``'s trainable parameters, in order (count and shapes checked)."""
    params = [p for p in model.parameters() if p.requires_grad]
    arrays = list(record.values())
    if len(arrays) != len(params):
        raise ValueError(f"the server sent {len(arrays)} arrays for {len(params)} trainable parameters")
    with torch.no_grad():
        for p, a in zip(params, arrays):
            value = torch.from_numpy(np.array(bytes_to_ndarray(a.data), dtype=np.float32))
            if value.shape != p.shape:
                raise ValueError(f"the server sent shape {tuple(value.shape)} for one of shape {tuple(p.shape)}")
            p.copy_(value.to(p.device))


def fitres_content(update: Sequence[Tensor]) -> RecordDict:
    """The legacy FitRes layout of an update with public constants: weight 1, no metrics, status OK."""
    arrays = ArrayRecord({str(i): Array(u.detach().to("cpu", torch.float32).numpy()) for i, u in enumerate(update)})
    return RecordDict({
        FITRES_PARAMETERS: arrays,
        FITRES_NUM_EXAMPLES: MetricRecord({"num_examples": NUM_EXAMPLES}),
        FITRES_METRICS: ConfigRecord({}),
        FITRES_STATUS: ConfigRecord({"code": 0, "message": ""}),
    })
