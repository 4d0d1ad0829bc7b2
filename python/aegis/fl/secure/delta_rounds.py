"""Secure rounds in delta mode: FedAvg over SecAgg+, one flooded delta per client per round, user-level
(epsilon, delta).

Each client trains E local epochs on its own data inside a :class:`~aegis.delta.DeltaShield` round (nothing
leaves while it trains) and replies ``global - local`` once: its delta, each tensor clipped to the public
round's clip and flooded with its ``1 / sqrt(t)`` share of the flood, ``t`` its own
:class:`~aegis.fl.secure.guard.SurvivorPin`. The server (:class:`~aegis.fl.secure.server.SecureStrategy`,
FedAvg, lr 1) learns only the survivors' sum and adds its mean to the global weights.

The share. The public round sets ``sigma = max(lam m_bar, rho clip / S)`` per tensor (docs/design.md §8);
:func:`share_config` gives every flooded role ``lam / sqrt(t)`` and ``S sqrt(t)``, the same maximum over
sqrt(t), so a client's shield floods with ``sigma / sqrt(t)`` and n >= t survivors' shares sum to noise of
standard deviation ``sigma sqrt(n / t) >= sigma`` per entry: at least one full flood.

User-level accounting. A client is one user and exports its whole delta, tensor k clipped to ``rho_k
clip_k``: adding or removing the user moves the round's sum by at most that per tensor, so a round is a
Gaussian mechanism of noise multiplier ``z = 1 / sqrt(sum_k (rho_k clip_k / sigma_k)^2)``
(:func:`user_noise_multiplier`). Over R rounds, each user in a round's cohort independently at rate
q = N / population, :func:`user_privacy` composes them (:mod:`aegis.accounting`: Opacus's PRV, RDP as the
cross-check; exact Gaussian without sampling). The amplification by q holds against whoever sees the
models but not who took part. The server running SecAgg+ sees the cohort, so against it a user who took
part in K rounds has the unsampled composition of K rounds (``sample_rate=1``, ``rounds=K``); the
client's exposure budget (its examples counted once per round, :mod:`aegis.delta`) bounds K.

The shortcut. :func:`shortcut_delta_sum` is the sum of the clients' clipped deltas plus one flood of
``sigma sqrt(n / t)``: the same in distribution as the secure round (each client clips its own delta, the
shares are independent Gaussians), from deltas trained anywhere, e.g. many LoRA clients at once
(:class:`~aegis.fl.secure.cohort.Cohort`). ``tests/test_secure_delta.py`` checks it against these rounds.
"""
from __future__ import annotations

import copy
import dataclasses
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from flwr.app import Context, Message, RecordDict
from flwr.client.mod import secaggplus_mod
from flwr.clientapp import ClientApp
from flwr.server import LegacyContext, ServerConfig
from flwr.server.workflow import DefaultWorkflow
from torch import Tensor, nn

import aegis_kernels  # noqa: F401  (registers torch.ops.aegis)
import aegis_kernels.reference as ref

from ...accounting import DELTA, PrivacyStatement, Table, calibrate_noise_multiplier, noise_multiplier, statement
from ...calibration import PublicLoss
from ...config import FROZEN, ROLES, AegisConfig, ExportMode, Treatment, simulated_client
from ...defence import Batch, LossFn, lm_loss
from ...delta import DeltaShield
from ...exposure import ExposurePolicy
from ...policy import plan
from ..client import trainable_arrays
from ..grid import FIRST_NODE_ID, SUPERLINK_NODE_ID, SerialisingGrid, flower_log_level, flower_runtime
from . import patch
from .client import entry_bound, fitres_content, load_arrays, noise_floor
from .guard import (
    FITINS_CONFIG,
    FITINS_PARAMETERS,
    MAX_WEIGHT,
    SETUP_KEY,
    SecAggSetup,
    SecureGuard,
    SurvivorPin,
    _number,
    check_quantisation,
    reply_stage,
)
from .rounds import _per_client
from .server import SecAggPlus, SecureStrategy

Optimizer = Callable[[list[nn.Parameter]], torch.optim.Optimizer]
PublicLossFactory = Callable[[nn.Module], PublicLoss]  # the public loss of a given model copy


# -- the share, the clip, the sum ---------------------------------------------------------------------
def share_config(config: AegisConfig, survivors: int) -> AegisConfig:
    """``config`` with every flooded role's noise a ``1 / sqrt(survivors)`` share: lam / sqrt(t), S sqrt(t)."""
    if config.export is not ExportMode.DELTA:
        raise ValueError("share_config: a delta-mode configuration (AegisConfig(export=ExportMode.DELTA))")
    if isinstance(survivors, bool) or not isinstance(survivors, int) or survivors < 1:
        raise ValueError(f"survivors={survivors!r}: the pin t, an integer >= 1")
    root = math.sqrt(survivors)
    treatments = {role: t if t.kind == "frozen" else dataclasses.replace(t, lam=t.lam / root, snr=t.snr * root)
                  for role, t in config.treatments.items()}
    return config.replace(preset=treatments, overrides={})


def clip_delta(delta: Mapping[str, Tensor], table: Table) -> dict[str, Tensor]:
    """``rho min(1, clip / |delta|_F) delta`` per tensor of the (matrix-flood) ``table``: what a client's
    export carries before its noise."""
    missing = sorted(set(table) - set(delta))
    if missing:
        raise ValueError(f"clip_delta: no delta for {missing[:3]} of the table")
    out = {}
    for name, (rho, _sigma, clip, _thr) in table.items():
        d = delta[name].float()
        out[name] = rho * ref.clip_scale(d.norm(), torch.tensor(clip, device=d.device)) * d
    return out


def shortcut_delta_sum(clipped_sum: Mapping[str, Tensor], table: Table, *, clients: int, pin: int,
                       key: Tensor | None = None) -> dict[str, Tensor]:
    """The server's sum of a secure delta round given the ``clients`` survivors' clipped deltas summed: plus
    one flood of ``sigma sqrt(clients / pin)`` per entry under a fresh secret key (``key``: tests only)."""
    if set(clipped_sum) != set(table):
        raise ValueError("shortcut_delta_sum: the clipped sum and the table must name the same tensors (a tensor "
                         "without its noise would leave clean)")
    if clients < pin or pin < 1:
        raise ValueError(f"clients={clients}, pin={pin}: a secure sum needs clients >= pin >= 1")
    names = list(table)
    out = {n: clipped_sum[n].detach().float().contiguous().clone() for n in names}
    device = out[names[0]].device
    scale = math.sqrt(clients / pin)
    rows = torch.tensor([[1.0, table[n][1] * scale, torch.finfo(torch.float32).max, 0.0] for n in names],
                        dtype=torch.float32, device=device)
    key = ref.new_key() if key is None else key
    torch.ops.aegis.flood_([out[n] for n in names], ",".join(["matrix"] * len(names)), rows, key.to(device))
    return out


# -- accounting ---------------------------------------------------------------------------------------
def user_noise_multiplier(table: Table, shapes: Mapping[str, tuple[int, ...]]) -> float:
    """z of one round for one user: its whole clipped delta added or removed, whitened by the full flood
    (the sum's noise at the pin)."""
    return noise_multiplier(table, shapes, dict.fromkeys(table, "matrix"), sensitivity=1.0)


def user_privacy(z: float, *, rounds: int, sample_rate: float = 1.0, delta: float = DELTA) -> PrivacyStatement:
    """(epsilon, delta) per user over ``rounds`` rounds of user-level multiplier z, each user in a round
    at ``sample_rate`` (module docstring: against the server, 1 and the rounds the user took part in)."""
    return statement(z, rounds, sample_rate=sample_rate, delta=delta)


def full_table(share: Table, pin: int) -> dict[str, tuple[float, float, float, float]]:
    """A client's share table with sigma times sqrt(pin): the full flood the sum carries at the pin."""
    root = math.sqrt(pin)
    return {n: (rho, sigma * root, clip, thr) for n, (rho, sigma, clip, thr) in share.items()}


# -- the recipe ---------------------------------------------------------------------------------------
TO_BE_MEASURED = "to be measured (benchmarks/clients_curve_delta.py on a GPU)"


@dataclass(frozen=True)
class ScaleRecipe:
    """A run-config recipe for secure delta rounds over a population: LoRA adapters on the MLP (everything
    else frozen), ``local_epochs`` clean local epochs per round, each user's whole delta clipped per tensor to
    ``clip`` x the public round's delta norm, and the noise calibrated so that ``rounds`` rounds at
    q = N / population give ``epsilon`` per user at ``delta`` (:func:`user_privacy`). The cap S per tensor is
    then ``1 / (z sqrt(T))`` for T flooded tensors, z at least ``min_noise_multiplier``: the floor at which
    1-of-n candidate verification against one round's sum, with every other user of the round known, stays at
    chance (measured on public text). ``n_star`` and ``measured`` hold what the clients curve measured
    (None / :data:`TO_BE_MEASURED` until then)."""

    name: str
    epsilon: float
    rounds: int
    local_epochs: int
    sentences_per_user: int
    rank: int
    local_lr: float
    clip: float
    delta: float = DELTA
    min_noise_multiplier: float | None = None  # the verification floor (None: to be measured)
    n_star: int | None = None  # the fewest clients per round that train to 1.25x undefended FedAvg
    measured: str = TO_BE_MEASURED  # perplexity against undefended, epsilon and verification at n_star

    def noise_multiplier(self, clients: int, population: int) -> float:
        """User-level z for ``clients`` per round out of ``population`` users (q = clients / population)."""
        if not 1 <= clients <= population:
            raise ValueError(f"clients={clients}, population={population}: a round samples 1 to population users "
                             "(q = N / population <= 1); lower N or use more users (smaller sentences_per_user)")
        z = calibrate_noise_multiplier(self.epsilon, self.rounds, sample_rate=clients / population,
                                       delta=self.delta, tolerance=1e-2)  # z within 1 %, epsilon <= the target
        return max(z, self.min_noise_multiplier or 0.0)

    def config(self, z: float, tensors: int) -> AegisConfig:
        """The client's delta-mode configuration at user-level multiplier z over ``tensors`` flooded tensors;
        each user's examples may be in every round (the exposure budget is the rounds)."""
        if not (z > 0 and tensors >= 1):
            raise ValueError(f"z={z}, tensors={tensors}: a positive noise multiplier over >= 1 flooded tensor")
        cap = Treatment("matrix", rho=1.0, clip=self.clip, snr=1.0 / (z * math.sqrt(tensors)))
        return AegisConfig(preset=dict.fromkeys(ROLES, FROZEN) | {"mlp_lora": cap}, export=ExportMode.DELTA,
                           exposure_budget=self.rounds)


# Verification at scale: a server that verifies candidate texts against a round's sum, for users of D = 4
# sentences at user-level epsilon 8 (delta 1e-5). Its settings are those benchmarks/clients_curve_delta.py
# measures (LoRA r = 8 on the MLP, AdamW lr 3e-3, 16 rounds of 2 local epochs, clip 1 x the public delta);
# the floor and N* are that benchmark's H200 run (benchmarks/results/clients-curve-delta-h200-smollm2.json).
VERIFICATION_AT_SCALE = ScaleRecipe(
    name="verification-at-scale", epsilon=8.0, rounds=16, local_epochs=2, sentences_per_user=4, rank=8,
    local_lr=3e-3, clip=1.0,
    min_noise_multiplier=math.sqrt(2),  # the verification floor at the initial adapters (1.0 once trained)
    n_star=1000,
    measured="SmolLM2-135M, State of the Union users (D = 4), H200: at N = 1 000 best perplexity 43.04 against "
             "39.70 for undefended FedAvg on the same pools (1.08x; pretrained 76.4), user-level epsilon 1.26 "
             "(delta 1e-5, 16 rounds, q = 0.072); candidate verification on the round's sum, every other user "
             "known, 0.078 (null 1/16). N = 100 does not train (z = 1.41 over 100 users).")


# -- the public round ---------------------------------------------------------------------------------
def public_table(model: nn.Module, config: AegisConfig, public_loss: PublicLossFactory, *, optimizer: Optimizer,
                 steps: int) -> dict[str, tuple[float, float, float, float]]:
    """The table of a delta round of ``steps`` optimizer steps from ``model``'s current weights under
    ``config``, from public text alone: a copy trains ``steps`` steps on the public loss itself and its
    :class:`~aegis.delta.DeltaShield` runs the public round. Every client of the round floods with this
    table (its clip and sigma do not depend on the client's data)."""
    if steps < 1:
        raise ValueError(f"steps={steps}: a round takes at least one optimizer step")
    local = copy.deepcopy(model)
    opt = optimizer([p for p in local.parameters() if p.requires_grad])
    loss = public_loss(local)
    shield = DeltaShield(local, opt, config.replace(exposure=ExposurePolicy.OFF), loss)
    try:
        with shield.round():
            for _ in range(steps):
                loss().backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
        return shield.public_params()
    finally:
        shield.remove()


# -- the client ---------------------------------------------------------------------------------------
class DeltaTrainer:
    """The train function inside ``secaggplus_mod`` in delta mode (module docstring).

    Round r: the server's arrays loaded, ``epochs`` passes over ``batches`` (in order) inside one
    DeltaShield round under :func:`share_config`, the export checked against the accepted SecAgg+ setup
    (clipping range, quantisation step), reply ``-export`` in the legacy FitRes layout (FedAvg's
    ``global - local``). ``tables[r]`` (the share table) and ``raw[r]`` (the unclipped delta) are kept for
    tests and the audit, never sent."""

    def __init__(self, model: nn.Module, batches: Sequence[Batch], pin: SurvivorPin, *, config: AegisConfig,
                 public_loss: PublicLossFactory, optimizer: Optimizer, epochs: int = 1,
                 loss_fn: LossFn = lm_loss) -> None:
        if epochs < 1 or not batches:
            raise ValueError(f"epochs={epochs}, {len(batches)} batches: a client trains >= 1 epoch on >= 1 batch")
        self.model, self.batches, self.pin, self.epochs, self.loss_fn = model, list(batches), pin, epochs, loss_fn
        self.optimizer = optimizer([p for p in model.parameters() if p.requires_grad])
        self.shield = DeltaShield(model, self.optimizer, share_config(config, pin.min_survivors), public_loss(model))
        self.names = [n for n, p in model.named_parameters() if p.requires_grad]
        self.tables: dict[int, dict[str, tuple[float, float, float, float]]] = {}
        self.raw: dict[int, dict[str, Tensor]] = {}

    def __call__(self, msg: Message, context: Context) -> Message:
        config = msg.content.config_records[FITINS_CONFIG]
        server_round = _number(config, "server-round", int)
        if str(config.get("algorithm")) != "fedavg":
            raise ValueError(f"algorithm={config.get('algorithm')!r}: a delta-mode client replies global - local "
                             "once per round; run FedAvg (SecureStrategy(algorithm='fedavg', lr=1.0))")
        load_arrays(self.model, msg.content.array_records[FITINS_PARAMETERS])
        params = {n: p for n, p in self.model.named_parameters() if p.requires_grad}
        start = {n: p.detach().clone() for n, p in params.items()}
        with self.shield.round() as rnd:
            for _ in range(self.epochs):
                for batch in self.batches:
                    self.loss_fn(self.model, batch).backward()
                    self.optimizer.step()
                    self.optimizer.zero_grad(set_to_none=True)
            raw = {n: p.detach() - start[n] for n, p in params.items()}
        table = self.shield.public_params()
        values = torch.tensor(list(table.values()), dtype=torch.float64).reshape(-1, 4)
        SecAggSetup.read(context.state.config_records[SETUP_KEY]).check(entry_bound([values]), noise_floor([values]))
        self.tables[server_round], self.raw[server_round] = table, raw
        return Message(fitres_content([-rnd.delta[n] for n in self.names]), reply_to=msg)


# -- the run ------------------------------------------------------------------------------------------
@dataclass
class SecureDeltaRun:
    """Result of :func:`run_secure_delta_rounds`."""

    strategy: SecureStrategy
    grid: SerialisingGrid
    trainers: list[DeltaTrainer]
    guards: list[SecureGuard]
    names: list[str]  # the exported tensors, in the order of every array list
    model: nn.Module  # the global model after the last round
    sums: dict[int, dict[str, Tensor]] = field(default_factory=dict)  # round -> survivors' sum (mean x count)

    def noise_multiplier(self) -> float:
        """The smallest user-level z over every client's rounds (each share table at its pin: the full flood)."""
        z = math.inf
        for trainer in self.trainers:
            shapes = {n: tuple(p.shape) for n, p in trainer.model.named_parameters()}
            for table in trainer.tables.values():
                z = min(z, user_noise_multiplier(full_table(table, trainer.pin.min_survivors), shapes))
        return z

    def privacy(self, *, sample_rate: float = 1.0, delta: float = DELTA) -> PrivacyStatement:
        """(epsilon, delta) per user over the rounds the most active client answered; ``sample_rate`` 1 (every
        client in every round, as here; also the statement against this server), or q = N / population
        when the clients were a cohort sampled from a population (against observers of the models)."""
        rounds = max((len(t.tables) for t in self.trainers), default=0)
        return user_privacy(self.noise_multiplier(), rounds=rounds, sample_rate=sample_rate, delta=delta)


def run_secure_delta_rounds(
    model: nn.Module,
    client_batches: Sequence[Sequence[Batch]],
    *,
    rounds: int,
    pin: SurvivorPin | Sequence[SurvivorPin],
    config: AegisConfig | Sequence[AegisConfig],
    public_loss: PublicLossFactory,
    optimizer: Optimizer,
    epochs: int = 1,
    num_shares: int | float = 1.0,
    reconstruction_threshold: int | float | None = None,
    clipping_range: float | None = None,
    clipping_margin: float = 2.0,
    quantization_range: int = 2**22,
    modulus_range: int = 2**32,
    loss_fn: LossFn = lm_loss,
    absent: Callable[[int, Message], bool] | None = None,
    quiet: bool = True,
) -> SecureDeltaRun:
    """Secure delta rounds of ``len(client_batches)`` clients (one user each) on the in-process grid.

    config, pin:      each client's delta-mode configuration and pin (one for all, or one per client); the
                      first configuration also shapes the global arrays. Each client counts its examples in
                      memory for the run; its exposure budget is the rounds one user may take part in.
    public_loss:      model -> the public loss of that model (e.g. ``lambda m: PublicBatches(m, tok, texts,
                      B, T)``): every client's public round and the server's clipping range read it.
    optimizer:        params -> the local optimizer (a fresh state every round).
    clipping_range:   SecAgg+'s; default ``clipping_margin`` times the largest entry a round-1 export can
                      take (signal plus 8 sd of the share) by :func:`public_table` at ``model``.
    absent(node_id, message): True drops that message (a client that never answers that stage).
    """
    patch.install()
    n = len(client_batches)
    pins, configs = _per_client(pin, n, "pin"), _per_client(config, n, "config")
    configs = [simulated_client(c) for c in configs]
    server_model = copy.deepcopy(model)
    for entry in plan(server_model, configs[0]):  # the global arrays: the tensors a client exports
        if entry.treatment.kind == "frozen":
            entry.param.requires_grad_(False)
    names = list(trainable_arrays(server_model).keys())
    if reconstruction_threshold is None:
        reconstruction_threshold = max(p.min_survivors for p in pins)
    if clipping_range is None:
        bounds = []
        for p, c, batches in zip(pins, configs, client_batches):
            table = public_table(model, share_config(c, p.min_survivors), public_loss, optimizer=optimizer,
                                 steps=epochs * len(batches))
            bounds.append(entry_bound([torch.tensor(list(table.values()), dtype=torch.float64).reshape(-1, 4)]))
        clipping_range = clipping_margin * max(bounds)
    check_quantisation(clipping_range=clipping_range, quantization_range=quantization_range,
                       modulus_range=modulus_range, max_weight=MAX_WEIGHT, clients=n)

    trainers, guards, apps, contexts = [], [], {}, {}
    for c, batches in enumerate(client_batches):
        node = FIRST_NODE_ID + c
        trainer = DeltaTrainer(copy.deepcopy(model), batches, pins[c], config=configs[c], public_loss=public_loss,
                               optimizer=optimizer, epochs=epochs, loss_fn=loss_fn)
        guard = SecureGuard(pins[c])
        app = ClientApp()
        app.train(mods=[guard, secaggplus_mod])(trainer)
        trainers.append(trainer)
        guards.append(guard)
        apps[node] = app
        contexts[node] = Context(run_id=0, node_id=node, node_config={}, state=RecordDict(), run_config={})
    grid = SerialisingGrid(apps, contexts, absent=absent, stage_of=reply_stage)
    strategy = SecureStrategy([a.numpy() for a in trainable_arrays(server_model).values()], algorithm="fedavg",
                              lr=1.0, min_clients=n)
    server_context = Context(run_id=0, node_id=SUPERLINK_NODE_ID, node_config={}, state=RecordDict(), run_config={})
    legacy = LegacyContext(server_context, config=ServerConfig(num_rounds=rounds), strategy=strategy)
    fit = SecAggPlus(num_shares=num_shares, reconstruction_threshold=reconstruction_threshold, max_weight=MAX_WEIGHT,
                     clipping_range=clipping_range, quantization_range=quantization_range,
                     modulus_range=modulus_range)
    with flower_runtime(), flower_log_level(logging.ERROR if quiet else None):
        DefaultWorkflow(fit_workflow=fit)(grid, legacy)
    with torch.no_grad():
        params = dict(server_model.named_parameters())
        for name, p in zip(names, strategy.params):
            params[name].copy_(p)
    # the strategy holds the mean of the replies (-delta): the sum of the deltas is minus it times the count
    sums = {r: {k: -torch.from_numpy(np.asarray(a, dtype=np.float64)) * strategy.survivors[r]
                for k, a in zip(names, mean)} for r, mean in strategy.aggregates.items()}
    return SecureDeltaRun(strategy, grid, trainers, guards, names, server_model, sums)
