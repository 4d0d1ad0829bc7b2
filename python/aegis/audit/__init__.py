"""``aegis audit``: privacy/utility report of AEGIS and baselines against the attack suite.

The names and the checks (:mod:`.options`) load without torch; the runner loads on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .options import ATTACKS, DEFAULT_ATTACKS, DEFENCES, MODELS, AuditConfig, UsageError

if TYPE_CHECKING:
    from .progress import Progress
    from .records import AuditReport
    from .runner import run_audit

__all__ = [
    "AuditConfig",
    "AuditReport",
    "Progress",
    "UsageError",
    "run_audit",
    "ATTACKS",
    "DEFAULT_ATTACKS",
    "DEFENCES",
    "MODELS",
    "audit",
]


def __getattr__(name: str) -> Any:
    if name == "AuditReport":
        from .records import AuditReport

        return AuditReport
    if name == "Progress":
        from .progress import Progress

        return Progress
    if name == "run_audit":
        from .runner import run_audit

        return run_audit
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def audit(config: AuditConfig | None = None, out: str = "aegis-report") -> AuditReport:
    """Run the audit and write report.json (after every defence), privacy_utility.png and report.html."""
    from .options import check_out
    from .report import ReportWriter
    from .runner import run_audit

    config = config or AuditConfig()
    writer = ReportWriter(check_out(out))
    report = run_audit(config, sink=writer.save)
    writer.finish(report)
    return report
