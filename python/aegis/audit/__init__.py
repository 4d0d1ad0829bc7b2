"""``aegis audit``: privacy/utility report of AEGIS and baselines against the attack suite."""
from .runner import ATTACKS, DEFENCES, MODELS, AuditConfig, Progress, run_audit

__all__ = ["AuditConfig", "Progress", "run_audit", "ATTACKS", "DEFENCES", "MODELS", "audit"]


def audit(config: AuditConfig | None = None, out: str = "aegis-report") -> dict:
    """Run the audit and write report.json, privacy_utility.png and report.html under ``out``."""
    from pathlib import Path

    from . import report

    result = run_audit(config or AuditConfig())
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    report.write_json(result, folder / "report.json")
    report.plot(result, folder / "privacy_utility.png")
    report.write_html(result, folder / "report.html", plot_name="privacy_utility.png")
    return result
