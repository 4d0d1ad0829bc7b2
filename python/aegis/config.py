"""Configuration as plain data: treatments per role, presets, and AegisConfig (DESIGN §3)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Literal, Mapping

ROLES = (
    "attention",
    "token_embedding",
    "position_embedding",
    "lm_head",
    "mlp",
    "norm",
    "bias",
    "head",
    "other",
)

Kind = Literal["frozen", "rows", "matrix"]


@dataclass(frozen=True)
class Treatment:
    """What happens to a parameter's gradient: frozen (never exported) or flooded (rows / matrix)."""

    kind: Kind
    lam: float = 0.0
    rho: float = 1.0

    def __post_init__(self) -> None:
        if self.kind not in ("frozen", "rows", "matrix"):
            raise ValueError(f"Treatment kind={self.kind!r}: use 'frozen', 'rows' or 'matrix'")
        if self.kind != "frozen" and (self.lam < 0 or self.rho < 0):
            raise ValueError(f"Treatment lam={self.lam}, rho={self.rho}: both must be >= 0")

    def describe(self) -> str:
        return "frozen" if self.kind == "frozen" else f"{self.kind} flood"


FROZEN = Treatment("frozen")
_EMBEDDING = Treatment("rows", lam=1.0, rho=0.3)

# The paper's values (DESIGN §3 table).
PAPER: Mapping[str, Treatment] = MappingProxyType(
    {
        "attention": FROZEN,
        "token_embedding": _EMBEDDING,
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
# which the adaptive spectral denoiser reads through (ROUGE-1 0.67 at B = 1; 0.00 from lam 1.5 on:
# benchmarks/results/privacy-curve.json), hence lam 2.0.
UTILITY: Mapping[str, Treatment] = MappingProxyType({**PAPER, "mlp": Treatment("matrix", lam=2.0, rho=0.3)})

PRESETS: Mapping[str, Mapping[str, Treatment]] = MappingProxyType({"paper": PAPER, "utility": UTILITY})


@dataclass(frozen=True)
class AegisConfig:
    """Everything ``aegis.protect`` needs.

    preset:         a preset name ("paper", "utility") or a role -> Treatment mapping.
    overrides:      role -> Treatment replacing the preset's entry for that role.
    role_overrides: regex on parameter names -> role, checked before detection (first match wins).
    allow_clean:    regexes of parameter names exported UNFLOODED; explicit opt-out, shown in the report.
    strict:         raise instead of warning when a trainable parameter's role is unknown.
    rel_threshold:  tau of the rows flood (active rows have norm > tau * max norm).
    seed:           fixed base seed, for tests and reproduction only. None (default) draws a fresh
                    secret seed per step from ``secrets``; step k of a fixed seed s uses
                    ``aegis_kernels.derive_seed(s, k)``.
    device_seed:    keep the seed on the gradients' device and advance it there, so a captured CUDA
                    graph of ``mask_()`` draws fresh noise on every replay.
    cuda_graph:     on CUDA, capture the grouped flood once as a CUDA graph and replay it whenever the
                    gradients are back at addresses seen before (one launch per step instead of ~20;
                    the seed is still chosen on the host per step, so the noise equals the eager
                    path's). Pays off with ``zero_grad(set_to_none=False)``; with the default
                    ``set_to_none=True`` the allocator moves gradients and every step runs eagerly.
    """

    preset: str | Mapping[str, Treatment] = "paper"
    overrides: Mapping[str, Treatment] = field(default_factory=dict)
    role_overrides: Mapping[str, str] = field(default_factory=dict)
    allow_clean: tuple[str, ...] = ()
    strict: bool = False
    rel_threshold: float = 0.01
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
        if self.seed is not None and not 0 <= self.seed < 2**62:
            raise ValueError(f"seed={self.seed}: a fixed seed must lie in [0, 2**62)")

    @property
    def treatments(self) -> dict[str, Treatment]:
        base = PRESETS[self.preset] if isinstance(self.preset, str) else self.preset
        missing = set(ROLES) - set(base) - set(self.overrides)
        if missing:
            raise ValueError(f"preset has no treatment for roles {sorted(missing)}")
        return {**base, **self.overrides}

    def replace(self, **changes) -> "AegisConfig":
        return dataclasses.replace(self, **changes)
