"""What the audit runs (:class:`AuditConfig`) and the checks that run before any model loads.

Every check raises :class:`UsageError`: one line that names the option, what is wrong with it and the
fix. The CLI turns it into ``error: ...`` and exit code 2.
"""

from __future__ import annotations

import difflib
import os
import tempfile
import warnings
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..attacks.registry import AUDIT_DEFAULT, ENCODER_ONLY, NAMES
from ..errors import UsageError

if TYPE_CHECKING:
    from ..registry import DefenceSpec

MODELS = ("decoder", "encoder")
# --model names of the embedded decoders other than the default (MiniLM's pretrained layers run causally),
# with their aegis.models.DecoderArch value
EMBEDDED_DECODERS = {"decoder-random": "gpt2"}  # GPT-2 blocks with random attention
ATTACKS = NAMES
DEFAULT_ATTACKS = AUDIT_DEFAULT
# The full study (--full): every family at several strengths, at batch 4. It leaves aegis-sentences out: its
# promise is stated at batch 8, and at batch 4 its MLP signal makes mlp_span and spectral search for tens of
# minutes and check no promise: name it (with --batch-size 8) to audit it.
FULL_DEFENCES = (
    "none",
    "aegis-verification",
    "aegis-paper-batch",  # the paper as written (its formulas and batch calibration), to reproduce it
    "dp-noise-0.001",
    "dp-noise-0.01",
    "dp-noise-0.1",
    "dp-sgd-C1-z1",
    "prune-50",
    "prune-90",
    "prune-99",
    "soteria-80",
)
# The main job: one setting per family, at batch 2 (docs/audit.md, "What it costs"). aegis-sentences is
# audited by name, at the batch 8 its promise is stated for.
DEFENCES = (
    "none",
    "aegis-verification",
    "aegis-paper-batch",
    "dp-noise-0.01",
    "dp-sgd-C1-z1",
    "prune-90",
    "soteria-80",
)
# --quick: the decoder alone at batch 1, without the paper's reproduction
QUICK_DEFENCES = tuple(d for d in DEFENCES if d != "aegis-paper-batch")
# every name the help and the "did you mean" know (any name of the registry's grammar is accepted)
KNOWN_DEFENCES = (*FULL_DEFENCES, "aegis-sentences")
MAX_BATCH = 64
MAX_CLIENTS = 64
MAX_ROUNDS = 100


@dataclass(frozen=True)
class AuditConfig:
    """What the audit runs. The defaults are the main job (about 7 CPU-minutes); ``quick()`` is
    the under-3-CPU-minutes variant and ``full()`` the full study."""

    models: tuple[str, ...] = MODELS
    defences: tuple[str, ...] = DEFENCES
    attacks: tuple[str, ...] = DEFAULT_ATTACKS
    clients: int = 2
    rounds: int = 2
    batch_size: int = 2
    # The server keeps every round's gradients; the attacks read the first N rounds' (0: every round).
    attack_rounds: int = 1
    decoder_lr: float = 1e-3
    encoder_lr: float = 1e-3
    optimizer: str = "adamw"
    seed: int = 0
    decoder: str | None = None  # HF causal LM name / path or an EMBEDDED_DECODERS name; None: the default decoder
    encoder: str | None = None  # HF sequence-classification name / path; None: embedded MiniLM
    dataset: str | None = None  # local file or HF dataset; None: the shipped corpus
    text_field: str | None = None
    label_field: str | None = None
    validation_share: float = 0.2  # held out (seeded) when the dataset has no validation split
    max_eval: int = 80  # validation sentences used for utility
    candidates: int = 40  # N of the 1-of-N fingerprint attacks
    secret_trials: int = 2  # secret-completion trials per defence (each one defended step at B = 1)

    @staticmethod
    def quick(**changes) -> AuditConfig:
        base = {"models": ("decoder",), "defences": QUICK_DEFENCES, "batch_size": 1}
        return AuditConfig(**{**base, **changes})

    @staticmethod
    def full(**changes) -> AuditConfig:
        base = {"defences": FULL_DEFENCES, "rounds": 3, "batch_size": 4, "secret_trials": 4}
        return AuditConfig(**{**base, **changes})

    @staticmethod
    def from_dict(values: dict) -> AuditConfig:
        """The settings ``as_dict()`` wrote (report.json's ``meta.config``)."""
        names = {f.name for f in fields(AuditConfig)}
        unknown = sorted(set(values) - names)
        if unknown:
            raise ValueError(f"unknown settings {', '.join(unknown)}")
        settings: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in values.items()}
        return AuditConfig(**settings)

    def __post_init__(self) -> None:
        check_config(self)

    def attacks_for(self, model: str) -> tuple[str, ...]:
        return tuple(a for a in self.attacks if model == "encoder" or a not in ENCODER_ONLY)

    def as_dict(self) -> dict:
        return {f.name: list(v) if isinstance(v := getattr(self, f.name), tuple) else v for f in fields(self)}


def __getattr__(name: str):
    # DefenceSpec is read here by callers of resolve_defence; it loads aegis.registry (and torch) only on use
    if name == "DefenceSpec":
        from ..registry import DefenceSpec

        return DefenceSpec
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# -- names ---------------------------------------------------------------------------------------------------------


def split_names(value: str | None) -> tuple[str, ...] | None:
    if value is None:
        return None
    return tuple(v.strip().lower() for v in value.split(",") if v.strip())


def _check_names(option: str, values: tuple[str, ...], allowed: tuple[str, ...]) -> None:
    if not values:
        raise UsageError(option, f"empty; choose from {', '.join(allowed)}")
    unknown = [v for v in values if v not in allowed]
    if unknown:
        close = difflib.get_close_matches(unknown[0], allowed, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise UsageError(option, f"unknown {', '.join(map(repr, unknown))}; {hint}choose from {', '.join(allowed)}")
    twice = sorted({v for v in values if values.count(v) > 1})
    if twice:
        raise UsageError(option, f"{', '.join(twice)} named twice; name each once")


def resolve_defence(name: str) -> DefenceSpec:
    """A ``--defences`` name (:func:`aegis.registry.parse_defence`); AEGIS clients are simulated, so their
    exposure counts live for the run, never in the user's cache. A preset's warnings are not repeated here:
    the verdict states what each preset promises (and the paper's, that it promises nothing)."""
    from ..exposure import IN_MEMORY
    from ..registry import parse_defence

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            spec = parse_defence(name, "--defences")
    except UsageError as err:
        close = difflib.get_close_matches(name.strip().lower(), KNOWN_DEFENCES, n=1, cutoff=0.75)
        if not close or "unknown" not in str(err):  # a known form with a bad number says its own fix
            raise
        from ..registry import FORMS

        raise UsageError("--defences", f"unknown {name!r}: did you mean {close[0]!r}? (the forms: {FORMS})") from None
    # the audit measures a preset at any batch size: its verdict says when the batch lies outside the promise
    return spec.with_aegis(exposure_state=IN_MEMORY, allow_outside_promise=True)


def check_config(config: AuditConfig) -> None:
    """Names and ranges (no I/O)."""
    _check_names("--models", config.models, MODELS)
    _check_names("--attacks", config.attacks, ATTACKS)
    if not config.defences:
        raise UsageError("--defences", f"empty; choose from {', '.join(KNOWN_DEFENCES)}")
    for name in config.defences:
        resolve_defence(name)
    twice = sorted({d for d in config.defences if config.defences.count(d) > 1})
    if twice:
        raise UsageError("--defences", f"{', '.join(twice)} named twice; name each once")
    if "encoder" not in config.models:
        only = [a for a in config.attacks if a in ENCODER_ONLY]
        if only and len(only) == len(config.attacks):
            raise UsageError("--attacks", f"{', '.join(only)} reads a classification head: add --models encoder")
    for option, value, low, high in (
        ("--clients", config.clients, 1, MAX_CLIENTS),
        ("--rounds", config.rounds, 1, MAX_ROUNDS),
        ("--batch-size", config.batch_size, 1, MAX_BATCH),
        ("--attack-rounds", config.attack_rounds, 0, config.rounds),
        ("--seed", config.seed, 0, 2**32 - 1),
        ("--candidates", config.candidates, 2, 1000),
        ("--secret-trials", config.secret_trials, 1, 40),
    ):
        if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
            hint = " (0 attacks every round)" if option == "--attack-rounds" else ""
            if option == "--attack-rounds" and isinstance(value, int) and value > config.rounds:
                raise UsageError(
                    option, f"{value} is more than --rounds {config.rounds}: use at most {config.rounds}{hint}"
                )
            raise UsageError(option, f"{value!r}: use a whole number from {low} to {high}{hint}")
    if not 0.05 <= config.validation_share <= 0.5:
        raise UsageError("--validation-share", f"{config.validation_share}: use a share from 0.05 to 0.5")
    if config.decoder is not None and "decoder" not in config.models:
        raise UsageError("--model", "names the decoder, but --models leaves the decoder out: add it or drop --model")
    if config.encoder is not None and "encoder" not in config.models:
        raise UsageError(
            "--encoder", "names the encoder, but --models leaves the encoder out: add it or drop --encoder"
        )
    if config.label_field is not None and config.dataset is None:
        raise UsageError("--label-field", "needs --dataset (the shipped corpus has its labels)")
    if config.text_field is not None and config.dataset is None:
        raise UsageError("--text-field", "needs --dataset (the shipped corpus has its text field)")


# -- the output folder ---------------------------------------------------------------------------------------------


def check_out(out: str | os.PathLike) -> Path:
    """Create ``out`` and prove it writable (write and remove a probe file) before anything runs."""
    folder = Path(out).expanduser()
    if folder.exists() and not folder.is_dir():
        raise UsageError("--out", f"{out} is a file: name a folder (it is created if missing)")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".aegis-write-test-"):
            pass
    except OSError as err:
        reason = err.strerror or type(err).__name__
        raise UsageError("--out", f"cannot write to {out} ({reason}): name a writable folder") from None
    return folder


# -- models named on the command line ------------------------------------------------------------------------------


def check_model_name(option: str, name: str) -> None:
    """A local directory with config.json, a name in the local Hugging Face cache, or a Hub name while
    the Hub is reachable (checked with one quick connection, so offline machines fail at once)."""
    path = Path(name).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise UsageError(option, f"{name} has no config.json: name a saved Hugging Face model folder")
        return
    if name.startswith((".", "/", "~")) or os.sep in name.strip("/").split("/", 1)[-1]:
        raise UsageError(option, f"{name}: no such folder; name a saved model folder or a Hub name such as gpt2")
    from transformers import AutoConfig

    try:
        AutoConfig.from_pretrained(name, local_files_only=True)
        return
    except (OSError, ValueError):
        pass
    from ..loading import hub_reachable

    if not hub_reachable():
        raise UsageError(
            option,
            f"{name!r} is not in the local Hugging Face cache and the Hub is not "
            "reachable: use a local model folder, or leave the option out for the embedded model",
        )
    try:
        AutoConfig.from_pretrained(name)
    except (OSError, ValueError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise UsageError(option, f"{name!r}: {first[:160]}") from None
