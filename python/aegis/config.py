"""Configuration as plain data: treatments per role, presets, and AegisConfig (DESIGN §3)."""
from __future__ import annotations

import dataclasses
import enum
import math
import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Literal

from .exposure import ExposurePolicy

ROLES = (
    "attention",
    "token_embedding",
    "token_embedding_lora",
    "position_embedding",
    "lm_head",
    "mlp",
    "norm",
    "bias",
    "head",
    "other",
)

Kind = Literal["frozen", "rows", "matrix"]

FIXED_KEY_ENV = "AEGIS_ALLOW_FIXED_KEY"  # tests only: lets AegisConfig(seed=...) through


class Calibration(str, enum.Enum):
    """Where each tensor's noise level sigma (and clip bound) comes from.

    PUBLIC: the gradient of a public calibration batch (``protect(..., calibration_loss=...)``, or
            synthetic tokens), refreshed every ``refresh_every`` steps; the private gradient is
            clipped to a bound from the same public statistic. What leaves the client depends on
            the private batch only through rho * clip(G).
    BATCH:  the paper's calibration on the private gradient itself (sigma = lam * m_bar(G)). Its
            noise level is readable from any large tensor and fingerprints the batch: for
            reproducing the paper only; ``report()`` and ``inspect`` flag it as leaking.
    """

    PUBLIC = "public"
    BATCH = "batch"


@dataclass(frozen=True)
class Treatment:
    """What happens to a parameter's gradient: frozen (never exported) or flooded (rows / matrix)."""

    kind: Kind
    lam: float = 0.0
    rho: float = 1.0
    clip: float = 2.0  # public calibration: private norms clipped to clip x the public batch's largest
    # public calibration: rho is lowered where needed so that rho * clip / sigma <= snr, the signal one
    # row (rows) or the tensor (matrix) can export over the per-entry noise (inf: no cap)
    snr: float = math.inf

    def __post_init__(self) -> None:
        if self.kind not in ("frozen", "rows", "matrix"):
            raise ValueError(f"Treatment kind={self.kind!r}: use 'frozen', 'rows' or 'matrix'")
        if self.kind != "frozen" and (self.lam < 0 or self.rho < 0 or not self.clip > 0 or not self.snr >= 0):
            raise ValueError(f"Treatment lam={self.lam}, rho={self.rho}, clip={self.clip}, snr={self.snr}: "
                             "lam, rho, snr >= 0 and clip > 0")

    def describe(self) -> str:
        return "frozen" if self.kind == "frozen" else f"{self.kind} flood"


FROZEN = Treatment("frozen")

# What an attacker reads. A server holding the model computes any candidate batch's gradient and
# correlates it with the export (candidate verification: aegis.attacks.fingerprint "likelihood"). Its
# signal-to-noise ratio is rho * clip / sigma per row (rows floods) or per tensor (matrix floods), a
# public constant under the public calibration, capped by ``Treatment.snr`` and shown as ``ReportRow.snr``.
# K exports of one batch average to snr * sqrt(K) (``PRESET_EXPOSURES`` bounds K).
#
# Measured on an H100 with the real cipher (benchmarks/results/verification-h100.json, 1-of-40, 40
# trials, decoder / LLaMA / encoder, B = 1 and 4): rows snr 0.2 -> up to 0.20 (sentence), 0.1 -> up to
# 0.125, 0.05 -> at most 0.075 (the bar 1/40 + 0.05), 0.025 -> at most 0.025; label attack on the
# 4-class head at snr 0.05: 0.21 / 0.31 / 0.31 at B = 1 / 2 / 8 (nulls 0.25 / 0.39 / 0.66). The paper's
# rows rho = 0.3 uncapped is snr ~ 3 per token row: 1.00.

# The paper's structure (DESIGN §3 table): attention frozen, MLP / norm / bias floods with rho = 0, rows
# floods with the paper's lam and rho, capped at snr 0.02: 0.04 over PRESET_EXPOSURES["paper"] = 4 exports.
_PAPER_ROWS = Treatment("rows", lam=1.0, rho=0.3, snr=0.02)
PAPER: Mapping[str, Treatment] = MappingProxyType(
    {
        "attention": FROZEN,
        "token_embedding": _PAPER_ROWS,
        # LoRA factors indexed by token id: rows flood along the token axis (ParamPlan.rows_axis); the
        # other factor of the pair (not token-indexed) gets a matrix flood at the embedding's strength
        "token_embedding_lora": _PAPER_ROWS,
        "position_embedding": _PAPER_ROWS,
        "lm_head": _PAPER_ROWS,
        "mlp": Treatment("matrix", lam=8.0, rho=0.0),
        "norm": Treatment("matrix", lam=4.0, rho=0.0),
        "bias": Treatment("matrix", lam=4.0, rho=0.0),
        "head": _PAPER_ROWS,  # rows = labels (policy rule 10)
        "other": Treatment("matrix", lam=4.0, rho=0.0),  # strict=False only: pure noise, never signal
    }
)

# Trains what can carry signal, freezes the rest: a rho = 0 flood carries nothing yet moves the weights
# on a random walk of ~lr per step under Adam, so MLP, norms and biases are frozen instead; the rows
# floods get twice the paper's snr, which holds for one exposure of each example.
_UTILITY_ROWS = Treatment("rows", lam=1.0, rho=0.3, snr=0.04)
UTILITY: Mapping[str, Treatment] = MappingProxyType(
    {
        **PAPER,
        "token_embedding": _UTILITY_ROWS,
        "token_embedding_lora": _UTILITY_ROWS,
        "position_embedding": _UTILITY_ROWS,
        "lm_head": _UTILITY_ROWS,
        "head": _UTILITY_ROWS,
        "mlp": FROZEN,
        "norm": FROZEN,
        "bias": FROZEN,
        "other": FROZEN,
    }
)

PRESETS: Mapping[str, Mapping[str, Treatment]] = MappingProxyType({"paper": PAPER, "utility": UTILITY})

# How many exports of one example each preset's measured strength covers (noise averages as sqrt(K)).
PRESET_EXPOSURES: Mapping[str, int] = MappingProxyType({"paper": 4, "utility": 1})


@dataclass(frozen=True)
class AegisConfig:
    """Everything ``aegis.protect`` needs.

    preset:         a preset name ("paper", "utility") or a role -> Treatment mapping.
    overrides:      role -> Treatment replacing the preset's entry for that role.
    role_overrides: regex on parameter names -> role, checked before detection (first match wins).
    allow_clean:    regexes of parameter names exported UNFLOODED; explicit opt-out, shown in the report.
    strict:         raise (default) when a trainable parameter's role is unknown; False gives it the
                    'other' flood with a warning.
    rel_threshold:  tau of the rows flood (rows with norm > tau x the calibration's max norm carry signal).
    calibration:    Calibration.PUBLIC (default) or Calibration.BATCH (the paper's; leaks the flood level).
    refresh_every:  public calibration: recompute the public statistics every this many steps.
    seed:           a fixed key, for tests only: refused unless the environment sets
                    AEGIS_ALLOW_FIXED_KEY=1 (a known key lets anyone remove the noise). None (default)
                    draws a fresh 256-bit key from ``secrets`` for every step.
    exposure_budget: how many masked exports may carry one example (token sequence); None: the preset's
                    promise (``PRESET_EXPOSURES``), 1 for a custom preset.
    exposure:       ExposurePolicy.REFUSE (default: ``mask_()`` raises past the budget), SILENCE (that
                    step exports pure noise) or OFF (no tracking: the guarantee covers one export).
    device_seed:    keep a master key on the gradients' device and derive each step's key there through
                    the cipher, so a captured CUDA graph of ``mask_()`` draws a fresh key on every replay
                    (the master key is redrawn in a forked child).
    cuda_graph:     on CUDA, capture the grouped flood once as a CUDA graph and replay it whenever the
                    gradients are back at addresses seen before (one launch per step instead of ~20).
                    Pays off with ``zero_grad(set_to_none=False)``; with the default
                    ``set_to_none=True`` the allocator moves gradients and every step runs eagerly.
    """

    preset: str | Mapping[str, Treatment] = "paper"
    overrides: Mapping[str, Treatment] = field(default_factory=dict)
    role_overrides: Mapping[str, str] = field(default_factory=dict)
    allow_clean: tuple[str, ...] = ()
    strict: bool = True
    rel_threshold: float = 0.01
    calibration: Calibration = Calibration.PUBLIC
    refresh_every: int = 100
    seed: int | None = None
    exposure_budget: int | None = None
    exposure: ExposurePolicy = ExposurePolicy.REFUSE
    device_seed: bool = False
    cuda_graph: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.preset, str) and self.preset not in PRESETS:
            raise ValueError(
                f"preset={self.preset!r} is unknown: use one of {sorted(PRESETS)} or a role -> Treatment mapping"
            )
        for role in (*self.overrides, *self.role_overrides.values()):
            if role not in ROLES:
                raise ValueError(f"unknown role {role!r} in overrides/role_overrides: roles are {ROLES}")
        if not 0.0 <= self.rel_threshold < 1.0:
            raise ValueError(f"rel_threshold={self.rel_threshold}: must lie in [0, 1)")
        object.__setattr__(self, "calibration", Calibration(self.calibration))
        object.__setattr__(self, "exposure", ExposurePolicy(self.exposure))
        if self.exposure_budget is not None and self.exposure_budget < 1:
            raise ValueError(f"exposure_budget={self.exposure_budget}: must be >= 1 (exports per example), or "
                             "None for the preset's")
        if self.refresh_every < 1:
            raise ValueError(f"refresh_every={self.refresh_every}: must be >= 1 (steps between public calibrations)")
        if self.seed is not None:
            if os.environ.get(FIXED_KEY_ENV) != "1":
                raise ValueError(
                    f"seed={self.seed}: a fixed key lets anyone who knows it subtract the noise. Leave seed=None "
                    f"(a fresh secret key per step); tests may set {FIXED_KEY_ENV}=1 to allow it"
                )
            if not 0 <= self.seed < 2**256:
                raise ValueError(f"seed={self.seed}: a fixed key must lie in [0, 2**256)")
            warnings.warn(f"AegisConfig(seed={self.seed}): FIXED noise key (tests only); this noise is not secret",
                          stacklevel=3)

    @property
    def treatments(self) -> dict[str, Treatment]:
        base = PRESETS[self.preset] if isinstance(self.preset, str) else self.preset
        missing = set(ROLES) - set(base) - set(self.overrides)
        if missing:
            raise ValueError(f"preset has no treatment for roles {sorted(missing)}")
        return {**base, **self.overrides}

    @property
    def exposures(self) -> int:
        """The exposure budget in force (the preset's promise unless set)."""
        if self.exposure_budget is not None:
            return self.exposure_budget
        return PRESET_EXPOSURES[self.preset] if isinstance(self.preset, str) else 1

    def replace(self, **changes) -> AegisConfig:
        return dataclasses.replace(self, **changes)
