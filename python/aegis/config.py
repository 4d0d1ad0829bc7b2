"""Configuration as plain data: treatments per role, presets, and AegisConfig (DESIGN §3)."""
from __future__ import annotations

import dataclasses
import enum
import os
import warnings
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Literal, Mapping

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

    def __post_init__(self) -> None:
        if self.kind not in ("frozen", "rows", "matrix"):
            raise ValueError(f"Treatment kind={self.kind!r}: use 'frozen', 'rows' or 'matrix'")
        if self.kind != "frozen" and (self.lam < 0 or self.rho < 0 or not self.clip > 0):
            raise ValueError(f"Treatment lam={self.lam}, rho={self.rho}, clip={self.clip}: lam, rho >= 0 and clip > 0")

    def describe(self) -> str:
        return "frozen" if self.kind == "frozen" else f"{self.kind} flood"


FROZEN = Treatment("frozen")
_EMBEDDING = Treatment("rows", lam=1.0, rho=0.3)

# The paper's values (DESIGN §3 table).
PAPER: Mapping[str, Treatment] = MappingProxyType(
    {
        "attention": FROZEN,
        "token_embedding": _EMBEDDING,
        # LoRA factors indexed by token id: rows flood along the token axis (ParamPlan.rows_axis); the
        # other factor of the pair (not token-indexed) gets a matrix flood at the embedding's strength
        "token_embedding_lora": _EMBEDDING,
        "position_embedding": _EMBEDDING,
        "lm_head": _EMBEDDING,
        "mlp": Treatment("matrix", lam=8.0, rho=0.0),
        "norm": Treatment("matrix", lam=4.0, rho=0.0),
        "bias": Treatment("matrix", lam=4.0, rho=0.0),
        "head": Treatment("matrix", lam=1.0, rho=0.3),
        "other": Treatment("matrix", lam=1.0, rho=0.3),
    }
)

# A gentler MLP flood that keeps the training signal (rho 0.3). The paper's ablation used lam 1.0,
# which the adaptive spectral denoiser reads through, hence lam 2.0; under the public calibration the
# private MLP gradient is clipped to the public batch's Frobenius norm (clip 1.0): at 2.0 the spectral
# attack of `aegis audit --quick` read ROUGE-1 0.106, at 1.0 0.000 with perplexity 1.024x undefended.
UTILITY: Mapping[str, Treatment] = MappingProxyType({**PAPER, "mlp": Treatment("matrix", lam=2.0, rho=0.3, clip=1.0)})

PRESETS: Mapping[str, Mapping[str, Treatment]] = MappingProxyType({"paper": PAPER, "utility": UTILITY})


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
    device_seed: bool = False
    cuda_graph: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.preset, str) and self.preset not in PRESETS:
            raise ValueError(f"preset={self.preset!r} is unknown: use one of {sorted(PRESETS)} or a role -> Treatment mapping")
        for role in (*self.overrides, *self.role_overrides.values()):
            if role not in ROLES:
                raise ValueError(f"unknown role {role!r} in overrides/role_overrides: roles are {ROLES}")
        if not 0.0 <= self.rel_threshold < 1.0:
            raise ValueError(f"rel_threshold={self.rel_threshold}: must lie in [0, 1)")
        object.__setattr__(self, "calibration", Calibration(self.calibration))
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

    def replace(self, **changes) -> "AegisConfig":
        return dataclasses.replace(self, **changes)
