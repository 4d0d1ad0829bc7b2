"""``aegis audit``: privacy/utility report of AEGIS and baselines against the attack suite."""

from .options import ATTACKS, DEFAULT_ATTACKS, DEFENCES, MODELS, AuditConfig, UsageError
from .records import AuditReport
from .runner import Progress, run_audit

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


def audit(config: AuditConfig | None = None, out: str = "aegis-report") -> AuditReport:
    """Run the audit and write report.json (after every defence), privacy_utility.png and report.html."""
    from .options import check_out
    from .report import ReportWriter

    config = config or AuditConfig()
    writer = ReportWriter(check_out(out))
    report = run_audit(config, sink=writer.save)
    writer.finish(report)
    return report
