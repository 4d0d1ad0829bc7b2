"""The one attack registry: every attack's name, what it reads and what a leak of it breaks, and the one
place that builds an attack's function (beside :mod:`aegis.registry`, which names the defences).

The audit (``aegis audit --attacks``), the utility study and the benchmarks take their names from here.
Importing this module imports no attack (and no torch): the command line lists the names for free, and
:func:`text_attack` imports an attack's module only when it is asked for.
"""

from __future__ import annotations

import difflib
import enum
import importlib
from collections.abc import Callable
from dataclasses import dataclass

from ..errors import UsageError


class Family(str, enum.Enum):
    """How an attack reads a shared gradient, and so how the audit runs and scores it."""

    TEXT = "text"  # fn(model, grads, tokenizer, batch_size) -> texts; scored by ROUGE and token recall
    LABELS = "labels"  # the batch's label multiset from a classification head's gradient
    FINGERPRINT = "fingerprint"  # which of N candidates an export came from, by AEGIS's public flood level
    LOSS = "loss"  # which of N candidates a reply came from, by the loss it reported


@dataclass(frozen=True)
class Attack:
    """One attack: ``threat`` is the :class:`aegis.config.Threat` value a leak of it counts against (a
    preset's promise is broken by a leak of an attack on a threat it stops)."""

    name: str
    family: Family
    threat: str
    reads: str  # one line: what it reads
    module: str  # aegis.attacks.<module> holds its function (TEXT: a function named like the attack)
    audit_default: bool = True  # in ``aegis audit``'s default selection
    encoder_only: bool = False  # reads a classification head
    study: bool = False  # the utility study can run it on a run's captured exports
    study_default: bool = False  # in the utility study's default selection


ATTACKS: tuple[Attack, ...] = (
    Attack("dager", Family.TEXT, "sentences", "the span of the first blocks' attention gradients (DAGER)", "dager",
           study=True, study_default=True),
    Attack("embedding_norm", Family.TEXT, "reconstruction", "which token-embedding rows are non-zero or outliers",
           "embedding_norm", study=True, study_default=True),
    Attack("embedding_projection", Family.TEXT, "reconstruction",
           "each token-embedding row along its own embedding (noise-aware)", "embedding_projection",
           audit_default=False),
    Attack("mlp_span", Family.TEXT, "sentences", "DAGER's span test on the first MLP projection", "mlp_span",
           study=True, study_default=True),
    Attack("spectral", Family.TEXT, "reconstruction", "the MLP gradients' top singular directions, denoised",
           "spectral", study=True, study_default=True),
    Attack("tag", Family.TEXT, "sentences", "gradient matching: optimises a batch whose gradient matches (TAG)",
           "tag", audit_default=False, study=True),
    Attack("labels", Family.LABELS, "reconstruction", "the label multiset from the classification head's gradient",
           "labels", encoder_only=True, study=True, study_default=True),
    Attack("fingerprint_pool", Family.FINGERPRINT, "verification",
           "which of N candidate batches an export came from (AEGIS's public flood level)", "fingerprint",
           study=True, study_default=True),
    Attack("fingerprint_secret", Family.FINGERPRINT, "verification",
           "which of N values completes 'my pin is ____' (AEGIS's public flood level)", "fingerprint"),
    Attack("loss_oracle", Family.LOSS, "verification", "which of N candidates a reply came from, by its loss",
           "loss_oracle"),
)

BY_NAME = {a.name: a for a in ATTACKS}
NAMES = tuple(BY_NAME)
TEXT = tuple(a.name for a in ATTACKS if a.family is Family.TEXT)
AUDIT_DEFAULT = tuple(a.name for a in ATTACKS if a.audit_default)
ENCODER_ONLY = tuple(a.name for a in ATTACKS if a.encoder_only)
STUDY = tuple(a.name for a in ATTACKS if a.study)
STUDY_DEFAULT = tuple(a.name for a in ATTACKS if a.study_default)


def attack(name: str, option: str = "attack") -> Attack:
    """The registry's entry for ``name``; :class:`UsageError` naming ``option``, a close name and the
    choices for anything else."""
    found = BY_NAME.get(name)
    if found is not None:
        return found
    close = difflib.get_close_matches(name, NAMES, n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    raise UsageError(option, f"unknown {name!r}; {hint}choose from {', '.join(NAMES)}")


def text_attack(name: str) -> Callable[..., list[str]]:
    """The function of text attack ``name``: ``fn(model, grads, tokenizer, batch_size) -> list[str]``."""
    entry = attack(name)
    if entry.family is not Family.TEXT:
        raise UsageError("attack", f"{name!r} is a {entry.family.value} attack, not a text attack: "
                         f"choose from {', '.join(TEXT)}")
    return getattr(importlib.import_module(f"{__package__}.{entry.module}"), name)


def text_attacks(names: tuple[str, ...] = TEXT) -> dict[str, Callable[..., list[str]]]:
    """``{name: function}`` of the named text attacks, in the order given."""
    return {name: text_attack(name) for name in names}
