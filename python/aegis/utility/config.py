"""What a utility run does (:class:`UtilityConfig`): plain data with enums, checked before any model loads.

Defaults and why:

* K = 8 clients with non-identical data (a seeded Dirichlet split of each topic, alpha 0.5);
* FedSGD and FedAvg. FedAvg's local work defaults to one local epoch per round (``local_steps=0``):
  Flower's quickstart apps train ``local-epochs = 1`` per round, which is what most users run;
* AdamW: the optimizer transformer fine-tuning uses (it is HF Trainer's default); under FedSGD it is the
  server's optimizer on the averaged export (adaptive federated optimization), under FedAvg each client's
  local optimizer, fresh every round as Flower clients keep no state between rounds;
* warmup (5 % of the rounds) then cosine decay to 10 % of the peak learning rate;
* the exposure budget stays ON for AEGIS: a long run reuses each client's examples, so over-budget steps
  are silenced (``ExposurePolicy.SILENCE``: pure noise, nothing leaks, nothing is learnt) and the run
  reports the silenced share of exports per defence. ``exposure=ExposurePolicy.OFF`` turns the budget
  off: every export carries its batch, so the run measures what the preset's noise alone costs in utility.
  That is a measurement, not a private setting (past one exposure per example the preset's promise lapses).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, fields

from ..attacks.registry import STUDY
from ..errors import UsageError
from ..exposure import ExposurePolicy
from ..registry import parse_defence

MODELS = ("decoder", "encoder")
ATTACKS = STUDY  # what runs on a run's captured exports
DEFENCES = ("none", "aegis-verification", "aegis-sentences", "dp-sgd", "prune-90", "soteria-80")
GPU_ROUNDS = 300
MAX_CLIENTS = 64
CHACHA = "chacha"  # the CPU flood's shipped normals, as the result file names them
# REFUSE would stop a long run at the first over-budget step, so the study offers the other two
EXPOSURES = (ExposurePolicy.SILENCE, ExposurePolicy.OFF)


class Algorithm(str, enum.Enum):
    """FEDSGD: one defended step per client, the server averages the exported gradients and steps.
    FEDAVG: E defended local steps per client on E distinct batches, the client exports its model delta."""

    FEDSGD = "fedsgd"
    FEDAVG = "fedavg"


class Optimizer(str, enum.Enum):
    ADAMW = "adamw"
    SGD = "sgd"


@dataclass(frozen=True)
class UtilityConfig:
    models: tuple[str, ...] = ("decoder",)
    defences: tuple[str, ...] = DEFENCES
    algorithms: tuple[Algorithm, ...] = (Algorithm.FEDSGD, Algorithm.FEDAVG)
    clients: int = 8
    rounds: int = GPU_ROUNDS
    batch_size: int = 4
    local_steps: int = 0  # FedAvg: E local steps per round; 0 = one local epoch (Flower's local-epochs = 1)
    eval_every: int = 10
    optimizer: Optimizer = Optimizer.ADAMW
    lr: float = 3e-4  # peak learning rate (FedSGD: the server's; FedAvg: each client's)
    warmup: float = 0.05  # share of the rounds spent warming up
    min_lr_share: float = 0.1  # the cosine ends at this share of the peak
    dirichlet_alpha: float = 0.5  # topic skew of the client split (smaller: more skewed)
    # clients whose exports the server attacks at the first, middle and last round (each one a trial of
    # the 1-of-N fingerprint, whose verdict needs several)
    attack_clients: int = 4
    attacks: tuple[str, ...] | None = None  # None: every attack this machine can run (see privacy.py)
    candidates: int = 40  # N of the 1-of-N fingerprint attack
    max_eval: int = 80  # validation sentences (held out, never trained on)
    seed: int = 0
    decoder: str | None = None  # None: aegis.models' default decoder (whatever the audit loads)
    encoder: str | None = None
    exposure: ExposurePolicy = ExposurePolicy.SILENCE  # AEGIS's exposure budget (OFF: the noise alone)

    @staticmethod
    def quick(**changes) -> UtilityConfig:
        """The 2-CPU-core variant (<= 3 min): the same structure, small numbers."""
        base = dict(
            clients=2, rounds=3, batch_size=2, local_steps=2, eval_every=1, lr=1e-3, candidates=8, max_eval=32,
            attack_clients=1,
            attacks=("dager", "embedding_norm", "labels", "fingerprint_pool"),
        )
        return UtilityConfig(**{**base, **changes})

    def __post_init__(self) -> None:
        object.__setattr__(self, "algorithms", tuple(Algorithm(a) for a in self.algorithms))
        object.__setattr__(self, "optimizer", Optimizer(self.optimizer))
        object.__setattr__(self, "exposure", ExposurePolicy(self.exposure))
        check(self)

    def attacked_rounds(self) -> tuple[int, ...]:
        """The first, middle and last round (fewer when they coincide)."""
        return tuple(sorted({1, (self.rounds + 1) // 2, self.rounds}))

    def as_dict(self) -> dict:
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, tuple):
                value = [v.value if isinstance(v, enum.Enum) else v for v in value]
            elif isinstance(value, enum.Enum):
                value = value.value
            out[f.name] = value
        return out


def _names(option: str, values: tuple[str, ...], allowed: tuple[str, ...]) -> None:
    if not values:
        raise UsageError(option, f"empty; choose from {', '.join(allowed)}")
    unknown = [v for v in values if v not in allowed]
    if unknown:
        raise UsageError(option, f"unknown {', '.join(map(repr, unknown))}; choose from {', '.join(allowed)}")
    if len(set(values)) != len(values):
        raise UsageError(option, "a name is given twice; name each once")


def check(config: UtilityConfig) -> None:
    _names("--models", config.models, MODELS)
    if not config.defences:
        raise UsageError("--defences", f"empty; name some of {', '.join(DEFENCES)}")
    for name in config.defences:
        parse_defence(name, "--defences")
    if len(set(config.defences)) != len(config.defences):
        raise UsageError("--defences", "a name is given twice; name each once")
    if config.attacks:
        _names("--attacks", config.attacks, ATTACKS)
    if not config.algorithms or len(set(config.algorithms)) != len(config.algorithms):
        raise UsageError("--algorithms", "name fedsgd and/or fedavg, each once")
    for option, value, low, high in (
        ("--clients", config.clients, 1, MAX_CLIENTS),
        ("--rounds", config.rounds, 1, 100_000),
        ("--batch-size", config.batch_size, 1, 64),
        ("--local-steps", config.local_steps, 0, 1000),
        ("--eval-every", config.eval_every, 1, 100_000),
        ("--attack-clients", config.attack_clients, 0, MAX_CLIENTS),  # more than --clients: every client
        ("--candidates", config.candidates, 2, 1000),
        ("--max-eval", config.max_eval, 4, 100_000),
        ("--seed", config.seed, 0, 2**32 - 1),
    ):
        if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
            raise UsageError(option, f"{value!r}: use a whole number from {low} to {high}")
    if config.exposure not in EXPOSURES:
        raise UsageError("--exposure", f"{config.exposure.value!r}; choose from "
                         f"{', '.join(e.value for e in EXPOSURES)}")
    if not config.lr > 0:
        raise UsageError("--lr", f"{config.lr}: use a positive learning rate")
    if not 0 <= config.warmup < 1:
        raise UsageError("--warmup", f"{config.warmup}: use a share of the rounds in [0, 1)")
    if not 0 <= config.min_lr_share <= 1:
        raise UsageError("--min-lr-share", f"{config.min_lr_share}: use a share in [0, 1]")
    if not config.dirichlet_alpha > 0:
        raise UsageError("--dirichlet-alpha", f"{config.dirichlet_alpha}: use a positive concentration")
