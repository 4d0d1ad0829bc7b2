"""What a shield reports: each parameter's treatment and the public signal it exports, and the budget."""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from .accounting import DELTA, PrivacyStatement, noise_multiplier, statement
from .config import AegisConfig, Calibration
from .exposure import ExposurePolicy
from .policy import ParamPlan


@dataclass(frozen=True)
class ReportRow:
    name: str
    role: str
    action: str
    lam: float | None
    rho: float | None
    shape: tuple[int, ...]
    numel: int
    # rho * clip / sigma of the public calibration: the largest exported signal of one row (rows flood) or
    # of the tensor (matrix flood) over the per-entry noise, i.e. the matched-filter SNR an attacker who
    # knows the candidate's gradient gets from one export (None before the first calibration, or BATCH)
    snr: float | None = None
    snr_cap: float | None = None  # Treatment.snr of a flood (None: uncapped, or not flooded)


@dataclass(frozen=True)
class CoverageReport:
    rows: list[ReportRow]
    calibration: Calibration = Calibration.PUBLIC
    exposure_budget: int = 1  # exports per example the configuration's strength covers
    exposure: ExposurePolicy = ExposurePolicy.REFUSE  # OFF: nothing enforces the budget
    max_exposure: int = 0  # the most exports any one fingerprint has had so far
    silenced_steps: int = 0  # steps exported as pure noise (ExposurePolicy.SILENCE past the budget)
    skipped_steps: int = 0  # steps with a non-finite gradient: nothing exported, no optimizer step
    # z of one export under the public table (aegis.accounting.noise_multiplier, every row of a rows flood
    # counted): also a secure round's sum at the pin (n >= t shares of sigma / sqrt(t) add to the full flood).
    # 0 with a clean export (no finite epsilon); None before the first calibration or under BATCH.
    noise_multiplier: float | None = None

    def privacy(self, delta: float = DELTA) -> PrivacyStatement | None:
        """(epsilon, delta) per example when each is exported at most ``exposure_budget`` times (a secure
        round counts one export of the examples in its batch); None where no noise multiplier is public.
        The budget is enforced unless ``exposure`` is OFF; then the statement covers the budget only."""
        if self.noise_multiplier is None:
            return None
        return statement(self.noise_multiplier, self.exposure_budget, delta=delta)

    @property
    def leaks_flood_level(self) -> bool:
        """The paper's batch calibration: the exported noise level fingerprints the private batch."""
        return self.calibration is Calibration.BATCH and bool(self.flooded)

    def count(self, action: str) -> int:
        return sum(r.action == action for r in self.rows)

    @property
    def frozen_share(self) -> float:
        total = sum(r.numel for r in self.rows)
        return sum(r.numel for r in self.rows if r.action == "frozen") / total if total else 0.0

    @property
    def flooded(self) -> list[ReportRow]:
        return [r for r in self.rows if r.action.endswith("flood")]

    @property
    def clean(self) -> list[ReportRow]:
        return [r for r in self.rows if r.action.startswith("CLEAN")]


def coverage_report(plans: Sequence[ParamPlan], public: Mapping[str, tuple[float, float, float, float]] | None,
                    config: AegisConfig, max_exposure: int, silenced: int, skipped: int) -> CoverageReport:
    """The report of a shield's plans under its public table (None before the first calibration, or BATCH)."""
    public = public or {}
    snr = {name: float(rho * clip / sigma) if sigma > 0 else float("inf")
           for name, (rho, sigma, clip, _) in public.items()}
    rows = []
    for p in plans:
        flooded = p.action.endswith("flood")
        rows.append(ReportRow(
            name=p.name, role=p.role, action=p.action, lam=p.treatment.lam if flooded else None,
            rho=p.treatment.rho if flooded else None, shape=tuple(p.param.shape), numel=p.param.numel(),
            snr=snr.get(p.name), snr_cap=p.treatment.snr if flooded and math.isfinite(p.treatment.snr) else None))
    flooded_plans = [p for p in plans if p.flooded]
    z = None
    if any(r.action.startswith("CLEAN") for r in rows):
        z = 0.0
    elif public or not flooded_plans:
        modes = {p.name: p.flood_mode for p in flooded_plans}
        z = noise_multiplier(dict(public), {r.name: r.shape for r in rows}, modes)
    return CoverageReport(rows, config.calibration, config.exposures, config.exposure, max_exposure, silenced,
                          skipped, z)
