"""One line per defence a user can act on: the privacy verdict, the utility verdict, and the recommendation.

The utility verdict comes from the run's own measurements: the global model's validation metric after the
last round, the same model before round 1 (untrained) and the undefended run. A defence *trains* when it
keeps at least :data:`TRAINS_SHARE` of what the undefended run gained over the untrained model (in log
perplexity for a decoder, in accuracy points for a classifier); the ratio to the undefended run says
what it costs. When the undefended run gained nothing either, the run is too short to tell.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from .records import AuditReport, UtilityRecord, Verdict

# share of the undefended run's gain over the untrained model a defence must keep to count as training
TRAINS_SHARE = 0.5
NONE = "none"


@dataclass(frozen=True)
class UtilityVerdict:
    """Does the defended model train, and at what cost next to the undefended run."""

    trains: bool | None  # None: not measurable (no utility, or the undefended run did not train either)
    ratio: float | None  # the defended metric over the undefended one (perplexity: > 1 is worse; accuracy: < 1)
    metric: str
    reason: str = ""  # why ``trains`` is None

    def text(self) -> str:
        if self.trains is None:
            return self.reason
        ratio = "" if self.ratio is None else f" ({self.ratio:.3g}x undefended)"
        return ("trains" if self.trains else "does not train") + ratio


def _gain(metric: str, before: float, value: float) -> float:
    """Improvement over the untrained model: log-perplexity drop, or accuracy points."""
    if metric == "perplexity":
        return math.log(before) - math.log(value)
    return value - before


def _finite(u: UtilityRecord | None) -> bool:
    return u is not None and u.value is not None and math.isfinite(u.value) and math.isfinite(u.before)


def utility_verdict(report: AuditReport, model: str, defence: str) -> UtilityVerdict:
    u, none = report.utility_of(model, defence), report.utility_of(model, NONE)
    metric = u.metric if u is not None else "perplexity"
    if u is None or not _finite(u):
        return UtilityVerdict(None, None, metric, "utility not measured")
    if none is None or not _finite(none):
        return UtilityVerdict(None, None, metric, "no undefended run to compare with (add none to --defences)")
    reference = _gain(metric, none.before, none.value)
    ratio = u.value / none.value if none.value else None
    if not reference > 0:
        return UtilityVerdict(None, ratio, metric, "the undefended run did not train either: run more rounds")
    return UtilityVerdict(_gain(metric, u.before, u.value) >= TRAINS_SHARE * reference, ratio, metric)


def private(v: Verdict) -> bool:
    """Holds against every attack, or keeps what its preset promises (its other leaks are stated)."""
    return v.holds or v.promise_kept is True


def recommendation(v: Verdict, utility: UtilityVerdict) -> tuple[str, str]:
    """(kind, text), the page's colour and the advice. kind: "holds" (use it), "suspect" (rerun first),
    "unusable" (private, but it does not train), "leak" (it leaks), "reference" (the undefended run and the
    paper's batch calibration, kept to compare with, where no attack read them)."""
    if v.defence == NONE:
        return "leak" if not v.holds else "reference", "the undefended reference: no protection"
    if v.calibration == "batch":
        return ("leak" if not private(v) else "reference",
                "reproduces the paper only: its noise level fingerprints the batch")
    if utility.trains is False:
        return ("unusable", "private only because it does not train: not usable") if private(v) else (
            "leak", "leaks and does not train: avoid")
    if not private(v):
        return "leak", "not private here: see the verdict"
    if v.suspect and v.holds:
        return "suspect", "rerun with more trials before relying on it"
    if utility.trains is None:
        return "suspect", f"private; utility unknown ({utility.reason})"
    scope = "" if v.holds else " against what it promises"
    return "holds", f"use{scope}: private and trains"


@dataclass(frozen=True)
class Advice:
    """The three verdicts of one defence on one model, in words."""

    model: str
    defence: str
    privacy: str
    utility: UtilityVerdict
    kind: str  # the recommendation's colour (:func:`recommendation`)
    recommendation: str


def advice(
    report: AuditReport,
    mark: Callable[[str, str], str] = lambda kind, s: s,
    esc: Callable[[str], str] = str,
) -> list[Advice]:
    """One :class:`Advice` per verdict of the report (``mark`` and ``esc`` style the privacy verdict's words)."""
    out = []
    for v in report.verdicts:
        utility = utility_verdict(report, v.model, v.defence)
        kind, text = recommendation(v, utility)
        out.append(Advice(v.model, v.defence, v.render(mark, esc), utility, kind, text))
    return out
