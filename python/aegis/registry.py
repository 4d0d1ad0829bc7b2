"""The one defence registry: every name a defence can be given, parsed once into a :class:`DefenceSpec`.

The grammar (case-insensitive), the same wherever a defence is named (``aegis audit --defences``, the
utility study, ``aegis.fl.run_rounds(defence=...)``, :func:`aegis.baselines.make_defence`)::

    none | undefended            the plain gradient
    aegis | aegis-PRESET         AEGIS with public calibration ("aegis" alone: the default preset)
    aegis-PRESET-batch           AEGIS with the paper's batch calibration (to reproduce the paper; it leaks)
    dp-noise-SIGMA               DAGER's noise defence, g + SIGMA * N(0, 1), SIGMA >= 0
    dp-sgd | dp-sgd-cC-zZ        Opacus DP-SGD, clipping norm C > 0, noise multiplier Z >= 0 (default 1, 1)
    prune-PERCENT                zero the PERCENT smallest-magnitude entries of every gradient, 0..100
    soteria | soteria-PERCENT    Soteria, PERCENT of the first MLP layer's features pruned (default 80)

This module names and checks; it builds nothing. :func:`aegis.defence.core_defence` builds ``none`` and
AEGIS, :func:`aegis.baselines.make_defence` builds every kind.
"""

from __future__ import annotations

import enum
import math
import re
import warnings
from dataclasses import dataclass, replace
from typing import Any

from .config import AegisConfig, Calibration, Preset, Promise
from .errors import UsageError

# names a message offers as examples: one per family
EXAMPLES = ("none", "aegis-verification", "aegis-sentences", "aegis-paper-batch", "dp-noise-0.01", "dp-sgd-C1-z1",
            "prune-90", "soteria-80")
FORMS = (f"none, aegis[-PRESET][-batch] (PRESET: {', '.join(p.value for p in Preset)}), dp-noise-SIGMA, "
         "dp-sgd[-cC-zZ], prune-PERCENT, soteria[-PERCENT]")


class DefenceKind(str, enum.Enum):
    NONE = "none"
    AEGIS = "aegis"
    DP_NOISE = "dp-noise"
    DP_SGD = "dp-sgd"
    PRUNE = "prune"
    SOTERIA = "soteria"

    @property
    def comparator(self) -> bool:
        """A defence AEGIS is compared against (built by :mod:`aegis.baselines`)."""
        return self not in (DefenceKind.NONE, DefenceKind.AEGIS)


@dataclass(frozen=True)
class DefenceSpec:
    """A parsed defence name: its kind and parameters (AEGIS: its whole configuration).

    ``DefenceSpec(name, config)`` names a custom AEGIS configuration (a study's candidate); every other
    spec comes from :func:`parse_defence`.
    """

    name: str
    aegis: AegisConfig | None = None
    kind: DefenceKind = DefenceKind.AEGIS
    sigma: float | None = None  # dp-noise
    share: float | None = None  # prune, soteria: the share of entries / features zeroed, in [0, 1]
    max_grad_norm: float | None = None  # dp-sgd
    noise_multiplier: float | None = None  # dp-sgd

    def __post_init__(self) -> None:
        if (self.kind is DefenceKind.AEGIS) != (self.aegis is not None):
            raise ValueError(f"DefenceSpec({self.name!r}): an AEGIS spec carries its AegisConfig and no other "
                             "does; build specs from names with aegis.registry.parse_defence")

    @property
    def run_as(self) -> AegisConfig | str:
        """What ``aegis.fl.run_rounds(defence=...)`` takes."""
        return self.aegis if self.aegis is not None else self.name

    @property
    def calibration(self) -> str | None:
        return None if self.aegis is None else self.aegis.calibration.value

    @property
    def promise(self) -> Promise | None:
        """What the preset promises to stop (the verdict checks it); None for baselines and custom settings."""
        return None if self.aegis is None else self.aegis.promise

    def with_aegis(self, **changes: Any) -> DefenceSpec:
        """The same spec with its AEGIS configuration changed (e.g. ``exposure_state=IN_MEMORY`` for simulated
        clients); a spec of another kind is returned as it is."""
        if self.aegis is None:
            return self
        with warnings.catch_warnings():  # the preset's warnings were given when the name was parsed
            warnings.simplefilter("ignore")
            return replace(self, aegis=self.aegis.replace(**changes))


_AEGIS = re.compile(r"aegis(?:-(?P<preset>[a-z]+?))?(?P<batch>-batch)?")
_DP_SGD = re.compile(r"dp-sgd(?:-c(?P<c>.+?)-z(?P<z>.+))?")
_NUMBERED = re.compile(r"(?P<kind>dp-noise|prune|soteria)(?:-(?P<value>.+))?")
DEFAULT_SOTERIA_PERCENT = 80.0


def parse_defence(name: str, option: str = "defence") -> DefenceSpec:
    """The spec of a defence name (see the module docstring for the forms); :class:`UsageError` naming
    ``option`` and the fix for anything else."""
    if not isinstance(name, str):
        raise UsageError(option, f"{name!r}: name a defence as text, e.g. {', '.join(EXAMPLES[:3])}")
    given = name.strip()
    text = given.lower()
    if text in ("none", "undefended"):
        return DefenceSpec(given, kind=DefenceKind.NONE)
    if match := _AEGIS.fullmatch(text):
        calibration = Calibration.BATCH if match["batch"] else Calibration.PUBLIC
        try:
            config = (AegisConfig(preset=match["preset"], calibration=calibration) if match["preset"]
                      else AegisConfig(calibration=calibration))
            return DefenceSpec(given, config)
        except ValueError as err:
            raise UsageError(option, f"{given!r}: {err}") from None
    if match := _DP_SGD.fullmatch(text):
        clip = _number(option, given, match["c"], "C", 1.0, "dp-sgd-C1-z1")
        z = _number(option, given, match["z"], "Z", 1.0, "dp-sgd-C1-z1")
        if not clip > 0:
            raise UsageError(option, f"{given!r}: the clipping norm C must be > 0, e.g. dp-sgd-C1-z1")
        return DefenceSpec(given, kind=DefenceKind.DP_SGD, max_grad_norm=clip, noise_multiplier=z)
    if match := _NUMBERED.fullmatch(text):
        kind = DefenceKind(match["kind"])
        if kind is DefenceKind.DP_NOISE:
            sigma = _number(option, given, match["value"], "SIGMA", None, "dp-noise-0.01")
            return DefenceSpec(given, kind=kind, sigma=sigma)
        default = DEFAULT_SOTERIA_PERCENT if kind is DefenceKind.SOTERIA else None
        percent = _number(option, given, match["value"], "PERCENT", default, f"{kind.value}-90")
        if percent > 100:
            raise UsageError(option, f"{given!r}: PERCENT must lie in 0..100, e.g. {kind.value}-90")
        return DefenceSpec(given, kind=kind, share=percent / 100)
    raise UsageError(option, f"unknown {given!r}; name one such as {', '.join(EXAMPLES)} (the forms: {FORMS})")


def _number(option: str, name: str, text: str | None, what: str, default: float | None, example: str) -> float:
    """A finite number >= 0 from ``text`` (``default`` when absent; absent with no default: refused)."""
    if text is None:
        if default is None:
            raise UsageError(option, f"{name!r} needs its {what}, e.g. {example}")
        return default
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 0) or text.strip() != text:
        raise UsageError(option, f"{name!r}: {what} must be a number >= 0, e.g. {example}")
    return value

