"""``aegis calibrate``: recommend a preset for a threat and batch from the presets' promises, or search
per-role treatments for a model and data and show the privacy-utility frontier.

:func:`recommend` reads each :class:`~aegis.config.Preset`'s promise (what it stops, at which batch sizes and
exposure budget, whether it trains) and picks the one that stops the user's threat where it is stated to,
training if one can. The search (``--search``): a candidate sets the SNR cap of every rows flood (token and
position embeddings, LM head, classifier head: ``Treatment.snr``, the signal one row exports over the
per-entry noise) and what the MLP weights get: frozen, or a matrix flood (lam 8, rho 1) capped at an SNR.
Norms, biases and attention stay frozen. Each candidate is measured twice:

* utility: a short federated run of the harness (FedSGD), final validation metric against the undefended
  run of the same rounds;
* privacy: the audit's secret-completion verification (``fingerprint_secret``: "my pin is ____", 1-of-N,
  K = the exposure budget's exports of the secret scored jointly with ``aegis.attacks.fingerprint``'s
  likelihood and the other variants), whose null is 1/N.

The frontier is the candidates no other candidate beats on both axes.
"""

from __future__ import annotations

import copy
import enum
import math
from dataclasses import asdict, dataclass

import torch

from ..audit import attacks as audit_attacks
from ..audit.options import AuditConfig
from ..audit.records import MARGIN, NullBaseline
from ..audit.runner import batch_builder
from ..config import FROZEN, PROMISES, VERIFICATION, AegisConfig, Preset, Threat, Treatment
from ..data import LABELS, load_corpus
from ..errors import UsageError
from ..harness.evaluate import evaluator, metric_of
from ..registry import DefenceSpec
from .config import Algorithm, UtilityConfig
from .federation import federate
from .harness import load
from .split import dirichlet_split

ROWS_ROLES = ("token_embedding", "token_embedding_lora", "position_embedding", "lm_head", "head")
# The search's fixed structure: attention, norms, biases (and unknown roles) frozen; rows roles and the MLP vary.
SEARCH_BASE = {**VERIFICATION, **dict.fromkeys(("attention", "norm", "bias", "other"), FROZEN)}


@dataclass(frozen=True)
class Recommendation:
    """The preset for a threat at a batch size and exposure count (None: no preset's promise covers it)."""

    threat: Threat
    batch_size: int
    exposures: int
    preset: Preset | None
    why: list[str]  # sentences: what the preset promises and costs, and what the others would not do

    def text(self) -> str:
        head = f"use preset {self.preset.value}" if self.preset else "no preset's promise covers this"
        return f"{self.threat.words} at batch {self.batch_size}, {self.exposures} export(s) per example: {head}"


def recommend(threat: Threat | str, batch_size: int, exposures: int = 1) -> Recommendation:
    """The preset whose promise stops ``threat`` at ``batch_size`` over ``exposures`` exports per example,
    one that trains before one that does not; the paper's formulas promise nothing and are never picked."""
    try:
        threat = Threat(threat)
    except ValueError:
        raise UsageError("--threat", f"unknown {threat!r}; choose from "
                         f"{', '.join(t.value for t in Threat)}") from None
    for option, value in (("--batch-size", batch_size), ("--exposures", exposures)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise UsageError(option, f"{value!r}: use a whole number of at least 1")
    fits, misses = [], {}
    for preset, promise in PROMISES.items():
        if threat not in promise.stops:
            continue
        outside = promise.outside(batch_size)
        if outside is None and exposures > promise.exposures:
            outside = f"it covers {promise.exposures} export(s) per example, not {exposures}"
        if outside is None:
            fits.append(preset)
        else:
            misses[preset] = f"{preset.value} would stop it, but {outside}."
    fits.sort(key=lambda p: not PROMISES[p].trains)  # a preset that trains first (the sort is stable)
    if not fits:
        return Recommendation(threat, batch_size, exposures, None, list(misses.values()))
    chosen = PROMISES[fits[0]]
    why = [f"{fits[0].value}: {chosen.says}.", f"Cost: {chosen.cost}."]
    if not chosen.trains:  # say what a preset that trains would need, and what one that trains stops
        why += [line for preset, line in misses.items() if PROMISES[preset].trains]
        why += [f"No preset that trains stops {threat.words}; {p.value} trains and stops only "
                f"{', '.join(t.words for t in sorted(q.stops))}: {q.says}." for p, q in PROMISES.items()
                if q.trains and q.stops and threat not in q.stops]  # a preset that promises nothing says nothing
    return Recommendation(threat, batch_size, exposures, fits[0], why)


class MlpMode(str, enum.Enum):
    FROZEN = "frozen"
    FLOOD = "flood"


@dataclass(frozen=True)
class Candidate:
    rows_snr: float
    mlp: MlpMode = MlpMode.FROZEN
    mlp_snr: float = 0.0  # the matrix flood's cap (MlpMode.FLOOD only)

    @property
    def name(self) -> str:
        mlp = "mlp frozen" if self.mlp is MlpMode.FROZEN else f"mlp flood snr<={self.mlp_snr:g}"
        return f"rows snr<={self.rows_snr:g}, {mlp}"

    def config(self, exposures: int) -> AegisConfig:
        rows = Treatment("rows", lam=1.0, rho=0.3, snr=self.rows_snr)
        mlp = FROZEN if self.mlp is MlpMode.FROZEN else Treatment("matrix", lam=8.0, rho=1.0, snr=self.mlp_snr)
        return AegisConfig(preset={**SEARCH_BASE, **dict.fromkeys(ROWS_ROLES, rows), "mlp": mlp},
                           exposure_budget=exposures)


def grid(rows_snrs: tuple[float, ...], mlp_snrs: tuple[float | None, ...]) -> list[Candidate]:
    """Every rows cap x every MLP choice (None: frozen)."""
    for option, values in (("--rows-snr", rows_snrs), ("--mlp-snr", tuple(v for v in mlp_snrs if v is not None))):
        if any(not (v > 0 and math.isfinite(v)) for v in values):
            raise UsageError(option, f"{values}: use positive, finite SNR caps")
    if not rows_snrs or not mlp_snrs:
        raise UsageError("--rows-snr" if not rows_snrs else "--mlp-snr", "empty: give at least one value")
    return [Candidate(r, MlpMode.FROZEN) if m is None else Candidate(r, MlpMode.FLOOD, m)
            for r in rows_snrs for m in mlp_snrs]


def frontier(rows: list[dict], metric: str) -> None:
    """Mark (in place) the rows no other row beats on utility and privacy at once."""
    better = (lambda a, b: a <= b) if metric == "perplexity" else (lambda a, b: a >= b)
    for row in rows:
        row["frontier"] = not any(
            other is not row
            and better(other["final"], row["final"])
            and other["privacy"] <= row["privacy"]
            and (other["final"] != row["final"] or other["privacy"] != row["privacy"])
            for other in rows
        )


def calibrate(
    candidates: list[Candidate],
    kind: str = "decoder",
    *,
    rounds: int = 20,
    clients: int = 8,
    batch_size: int = 4,
    lr: float = 1e-3,
    exposures: int = 1,
    trials: int = 8,
    n: int = 40,
    seed: int = 0,
    device: str = "cpu",
    say=lambda line: None,
) -> dict:
    """Measure every candidate; returns {"settings", "undefended", "untrained", "rows"} (rows sorted by utility)."""
    config = UtilityConfig(models=(kind,), clients=clients, rounds=rounds, batch_size=batch_size, lr=lr,
                           eval_every=rounds, attack_clients=0, seed=seed, max_eval=80)
    train, validation = load_corpus("train"), load_corpus("validation")
    label_ids = {name: i for i, name in enumerate(LABELS)}
    model, tok = load(kind, config)
    build = batch_builder(kind, tok, label_ids)
    shards = dirichlet_split(train, clients, config.dirichlet_alpha, seed, batch_size)
    evaluate = evaluator(kind, build, validation[: config.max_eval], len(LABELS))
    metric = metric_of(kind)
    dev = torch.device(device)
    say(f"{kind} · undefended")
    undefended = federate(model, "none", shards, build, evaluate, Algorithm.FEDSGD, config, dev).curve
    audit = AuditConfig(models=(kind,), defences=("none",), rounds=1, candidates=n, secret_trials=trials, seed=seed)
    ctx = audit_attacks.ModelContext(kind, copy.deepcopy(model).cpu().eval(), tok, audit, build, label_ids, [])
    attack = audit_attacks.make("fingerprint_secret")
    null = NullBaseline(kind, attack.name, 1 / n, how="1 / N")
    rows = []
    for cand in candidates:
        say(f"{kind} · {cand.name}")
        aegis_config = cand.config(exposures)
        curve = federate(model, aegis_config, shards, build, evaluate, Algorithm.FEDSGD, config, dev).curve
        record, _ = attack.run(ctx, DefenceSpec(cand.name, aegis_config), [], [ctx.model], null, lambda cost: None)
        final, ref = curve[-1][metric], undefended[-1][metric]
        ratio = final / ref
        rows.append({
            **asdict(cand), "mlp": cand.mlp.value, "name": cand.name, "final": final, "ratio": ratio,
            "privacy": record.score, "null": record.null, "p_value": record.p_value, "excess": record.excess,
            "meets_utility": ratio <= 1.05 if metric == "perplexity" else ratio >= 0.98,
            "meets_privacy": record.excess <= MARGIN, "note": record.note,
        })
    frontier(rows, metric)
    rows.sort(key=lambda r: r["final"] if metric == "perplexity" else -r["final"])
    return {
        "settings": {"model": kind, "rounds": rounds, "clients": clients, "batch_size": batch_size, "lr": lr,
                     "exposures": exposures, "trials": trials, "candidates": n, "seed": seed, "device": device},
        "metric": metric,
        "untrained": undefended[0][metric],
        "undefended": undefended[-1][metric],
        "rows": rows,
    }
