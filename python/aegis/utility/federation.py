"""The Flower-free federation: K clients (one model copy and one defence object each), FedSGD or FedAvg
rounds, a warmup + cosine learning-rate schedule, held-out evaluation every few rounds, and the exports
the server attacks at the first, middle and last round.

Exports are averaged as the server receives them (a silenced AEGIS export is pure noise and the server
cannot tell it apart). Under FedAvg the server attacks the pseudo-gradient ``(global - local) / lr``.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from ..baselines import make_defence as make_baseline
from ..config import AegisConfig
from ..data import Example
from ..defence import Aegis, Defence
from ..errors import UsageError
from ..exposure import IN_MEMORY, ExposurePolicy
from ..registry import parse_defence
from .config import Algorithm, Optimizer, UtilityConfig
from .split import BatchStream

Build = Callable[[Sequence[Example]], dict[str, Tensor]]


def lr_at(round_: int, config: UtilityConfig) -> float:
    """Round ``round_`` (1-based): linear warmup over ``warmup`` of the rounds, then cosine to ``min_lr_share``."""
    warm = max(1, math.ceil(config.warmup * config.rounds)) if config.warmup > 0 else 0
    if round_ <= warm:
        return config.lr * round_ / warm
    progress = (round_ - warm) / max(1, config.rounds - warm)
    floor = config.min_lr_share
    return config.lr * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


def make_defence(name: str | AegisConfig, exposure: ExposurePolicy = ExposurePolicy.SILENCE) -> Defence:
    """One client's defence. AEGIS silences over-budget steps, or (``OFF``) tracks no budget at all."""
    # a candidate configuration (aegis calibrate) or a name; simulated clients keep their exposure counts
    # for the run, never in the user's cache
    if isinstance(name, AegisConfig):
        return Aegis(name.replace(exposure=exposure, exposure_state=IN_MEMORY, allow_outside_promise=True))
    spec = parse_defence(name, "--defences")
    if spec.aegis is not None:
        return Aegis(spec.aegis.replace(exposure=exposure, exposure_state=IN_MEMORY, allow_outside_promise=True))
    return make_baseline(spec)


def make_optimizer(kind: Optimizer, params: list[nn.Parameter], lr: float) -> torch.optim.Optimizer:
    if kind is Optimizer.ADAMW:
        return torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    return torch.optim.SGD(params, lr=lr)


@dataclass
class Client:
    model: nn.Module
    defence: Defence
    stream: BatchStream
    steps: int = 0
    silenced: int = 0


@dataclass
class Capture:
    """One export the server attacks, with the ground truth behind it (never sent)."""

    round: int
    client: int
    grads: dict[str, Tensor]  # CPU fp32
    examples: list[Example]


@dataclass
class RunLog:
    curve: list[dict[str, float]] = field(default_factory=list)  # {"round": r, metric: value, "lr": ...}
    captures: list[Capture] = field(default_factory=list)
    models: dict[int, nn.Module] = field(default_factory=dict)  # attacked round -> the global model it started from
    steps: int = 0
    silenced_steps: int = 0
    exports: int = 0
    silenced_exports: int = 0
    train_seconds: float = 0.0
    reports: list[dict[str, float]] = field(default_factory=list)


def _load(model: nn.Module, state: dict[str, Tensor]) -> None:
    with torch.no_grad():
        params = dict(model.named_parameters())
        for name, value in state.items():
            params[name].copy_(value)


def _cpu_copy(model: nn.Module) -> nn.Module:
    return copy.deepcopy(model).cpu().eval()


def federate(
    model: nn.Module,
    defence: str | AegisConfig,
    shards: list[list[Example]],
    build: Build,
    evaluate: Callable[[nn.Module], dict[str, float]],
    algorithm: Algorithm,
    config: UtilityConfig,
    device: torch.device,
    on_round: Callable[[int], None] = lambda r: None,
) -> RunLog:
    """Train a copy of ``model`` federatedly under ``defence`` (one defence object per client)."""
    log = RunLog()
    # dropout off, as the audit's clients run: the gradient is a function of the batch alone, so the
    # undefended attacks are at full strength and the defences are compared on what they remove
    global_model = copy.deepcopy(model).to(device).eval()
    clients = []
    for c, shard in enumerate(shards):
        local = copy.deepcopy(model).to(device).eval()
        d = make_defence(defence, config.exposure).attach(local)
        stream = BatchStream(shard, config.batch_size, config.seed * 1000 + c)
        clients.append(Client(local, d, stream))
    # what the clients train (AEGIS froze attention on theirs); the global model moves only there
    names = [n for n, p in clients[0].model.named_parameters() if p.requires_grad]
    params = dict(global_model.named_parameters())
    trained = [params[n] for n in names]
    server_opt = make_optimizer(config.optimizer, trained, config.lr) if algorithm is Algorithm.FEDSGD else None
    local_steps = _local_steps(clients, config) if algorithm is Algorithm.FEDAVG else 1
    attacked = set(config.attacked_rounds())

    log.curve.append({"round": 0, **evaluate(global_model)})
    for r in range(1, config.rounds + 1):
        lr = lr_at(r, config)
        if r in attacked:
            log.models[r] = _cpu_copy(global_model)
        state = {n: params[n].detach().clone() for n in names}
        t0 = time.perf_counter()
        total = {n: torch.zeros_like(state[n]) for n in names}
        for c, client in enumerate(clients):
            _load(client.model, state)
            silenced_before = client.silenced
            if algorithm is Algorithm.FEDSGD:
                batches = [client.stream.batch(r - 1)]
                _defended_step(client, build(batches[0]), device, None)
                export = client.defence.export()
            else:
                batches = [client.stream.batch(i) for i in _round_batches(client.stream, r, local_steps)]
                opt = make_optimizer(config.optimizer, [p for p in client.model.parameters() if p.requires_grad], lr)
                for examples in batches:
                    _defended_step(client, build(examples), device, opt)
                moved = dict(client.model.named_parameters())
                export = {n: (state[n] - moved[n].detach()) / lr for n in names}  # the pseudo-gradient
            for n in names:
                total[n] += export[n]
            log.exports += 1
            log.silenced_exports += client.silenced - silenced_before == len(batches)  # it carried nothing
            if c < config.attack_clients and r in attacked:
                flat = [e for b in batches for e in b]
                log.captures.append(Capture(r, c, {n: export[n].detach().float().cpu() for n in names}, flat))
        _server_step(algorithm, server_opt, trained, names, total, len(clients), lr)
        if device.type == "cuda":
            torch.cuda.synchronize()
        log.train_seconds += time.perf_counter() - t0
        if r % config.eval_every == 0 or r == config.rounds:
            log.curve.append({"round": r, "lr": lr, **evaluate(global_model)})
        on_round(r)
    log.steps = sum(client.steps for client in clients)
    log.silenced_steps = sum(client.silenced for client in clients)
    log.reports = [client.defence.report() for client in clients]
    for client in clients:
        client.defence.detach()
    return log


def _local_steps(clients: list[Client], config: UtilityConfig) -> int:
    smallest = min(c.stream.per_epoch for c in clients)
    if config.local_steps == 0:
        return smallest  # one local epoch of the smallest shard: every client takes the same E steps
    if config.local_steps > smallest:
        raise UsageError(
            "--local-steps",
            f"{config.local_steps} distinct batches per round, but the smallest client holds {smallest}: "
            f"use at most {smallest} (or 0 for one local epoch)",
        )
    return config.local_steps


def _round_batches(stream: BatchStream, r: int, steps: int) -> range:
    """FedAvg round r's E distinct batches: rounds tile each local epoch (its leftover batches are skipped)."""
    per_round = stream.per_epoch // steps
    epoch, slot = divmod(r - 1, per_round)
    start = epoch * stream.per_epoch + slot * steps
    return range(start, start + steps)


def _defended_step(
    client: Client, batch: dict[str, Tensor], device: torch.device, opt: torch.optim.Optimizer | None
) -> None:
    """Backward and defence on ``batch``; FedAvg (``opt``) then steps the local model."""
    batch = {k: v.to(device) for k, v in batch.items()}
    client.steps += 1
    for p in client.model.parameters():
        p.grad = None
    client.defence.backward(batch)
    client.defence.defend_()
    if isinstance(client.defence, Aegis) and client.defence.shield is not None:
        client.silenced = client.defence.shield.silenced_steps  # the shield's own count (ExposurePolicy.SILENCE)
    if opt is not None:
        opt.step()


def _server_step(
    algorithm: Algorithm,
    opt: torch.optim.Optimizer | None,
    trained: list[nn.Parameter],
    names: list[str],
    total: dict[str, Tensor],
    k: int,
    lr: float,
) -> None:
    with torch.no_grad():
        if algorithm is Algorithm.FEDAVG:  # the mean delta is -lr x the mean pseudo-gradient
            for p, n in zip(trained, names):
                p.sub_(total[n], alpha=lr / k)
            return
    assert opt is not None
    for group in opt.param_groups:
        group["lr"] = lr
    for p, n in zip(trained, names):
        p.grad = total[n] / k
    opt.step()
    for p in trained:
        p.grad = None

