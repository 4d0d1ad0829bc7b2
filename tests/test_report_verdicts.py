"""The report's one line per defence: privacy verdict, utility verdict (from the run's own numbers) and the
recommendation, on the HTML page (parsed) and in the terminal table."""
from __future__ import annotations

import math
import shutil
import subprocess
from html.parser import HTMLParser

import pytest
from rich.console import Console

from aegis.audit.advice import TRAINS_SHARE, recommendation, utility_verdict
from aegis.audit.records import AttackRecord, AuditReport, UtilityRecord, verdicts
from aegis.audit.report import write_html
from aegis.config import Preset

UNTRAINED = 30_000.0


def _report(ppl: dict[str, float], leaking: tuple[str, ...] = ("none", "prune-90")) -> AuditReport:
    """A decoder report: every defence's final perplexity, and a dager row that leaks for ``leaking``."""
    report = AuditReport({"config": {"rounds": 2, "attack_rounds": 1}, "data": {}}, complete=True)
    for defence, value in ppl.items():
        report.utility.append(UtilityRecord("decoder", defence, 2, "perplexity", value, math.log(value), UNTRAINED))
        score = 0.9 if defence in leaking else 0.02
        report.results.append(AttackRecord("decoder", defence, "dager", "rouge1", score, 0.02, 2, 0.1,
                                           rouge1=score, token_recall=score, null_token_recall=0.02))
        promise = Preset.VERIFICATION.promise if defence == "aegis-verification" else None
        report.verdicts.append(verdicts(report.results, "decoder", defence, None, promise, 8))
    return report


PPL = {"none": 2_000.0, "aegis-verification": 26_872.0, "prune-90": 2_500.0, "dp-sgd-C1-z1": 4_000.0}


def test_trains_means_keeping_a_share_of_the_undefended_gain():
    report = _report(PPL)
    gain = math.log(UNTRAINED / 2_000.0)
    paper = utility_verdict(report, "decoder", "aegis-verification")
    assert paper.trains is False and paper.ratio == pytest.approx(26_872 / 2_000)
    assert paper.text() == "does not train (13.4x undefended)"
    dp = utility_verdict(report, "decoder", "dp-sgd-C1-z1")
    assert math.log(UNTRAINED / 4_000) >= TRAINS_SHARE * gain and dp.trains is True
    assert utility_verdict(report, "decoder", "none").trains is True
    # just below / above the share of the undefended run's gain
    edge = UNTRAINED * math.exp(-TRAINS_SHARE * gain)
    assert utility_verdict(_report({"none": 2_000.0, "x": edge * 1.01}), "decoder", "x").trains is False
    assert utility_verdict(_report({"none": 2_000.0, "x": edge * 0.99}), "decoder", "x").trains is True


def test_no_verdict_when_the_undefended_run_did_not_train_or_is_missing():
    flat = utility_verdict(_report({"none": UNTRAINED * 1.01, "prune-90": 2_000.0}), "decoder", "prune-90")
    assert flat.trains is None and "undefended run did not train" in flat.text()
    alone = utility_verdict(_report({"prune-90": 2_000.0}), "decoder", "prune-90")
    assert alone.trains is None and "none" in alone.text()


def test_accuracy_gains_are_points():
    report = AuditReport({})
    for defence, acc in (("none", 0.9), ("soteria-80", 0.85), ("dp-sgd", 0.55)):
        report.utility.append(UtilityRecord("encoder", defence, 2, "accuracy", acc, 0.1, 0.5, chance=0.5))
    assert utility_verdict(report, "encoder", "soteria-80").trains is True
    assert utility_verdict(report, "encoder", "dp-sgd").trains is False  # 0.05 of 0.4 points


def test_recommendations():
    report = _report(PPL)
    by = {v.defence: v for v in report.verdicts}
    kinds = {d: recommendation(by[d], utility_verdict(report, "decoder", d)) for d in PPL}
    assert kinds["none"][0] == "leak" and "no protection" in kinds["none"][1]
    # private, but not usable: its colour is not a leak's
    assert kinds["aegis-verification"] == ("unusable", "private only because it does not train: not usable")
    assert kinds["prune-90"][0] == "leak" and "not private" in kinds["prune-90"][1]
    assert kinds["dp-sgd-C1-z1"] == ("holds", "use: private and trains")


class _Rows(HTMLParser):
    """The verdict table's rows: {cell class: text} per row that has classed cells."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[dict[str, str]] = []
        self.cell: str | None = None
        self.cells: list[str] = []

    def handle_starttag(self, tag, attrs):
        if tag == "tr":
            self.rows.append({})
            self.cells = []
        elif tag == "td":
            self.cell = dict(attrs).get("class") or f"col{len(self.cells)}"
            self.cells.append(self.cell)
            self.rows[-1][self.cell] = ""

    def handle_endtag(self, tag):
        if tag == "td":
            self.cell = None

    def handle_data(self, data):
        if self.cell is not None:
            self.rows[-1][self.cell] += data


def test_every_defence_row_of_the_page_has_both_verdicts_and_a_recommendation(tmp_path):
    report = _report(PPL)
    write_html(report, tmp_path / "report.html")
    parser = _Rows()
    parser.feed((tmp_path / "report.html").read_text())
    rows = {r["col1"]: r for r in parser.rows if "privacy" in r}
    assert set(rows) == set(PPL)  # one line per defence
    for defence, row in rows.items():
        assert row["privacy"].strip() and row["advice"].strip()
        assert row["utility"].startswith(("trains", "does not train")), (defence, row["utility"])
    assert rows["aegis-verification"]["utility"] == "does not train (13.4x undefended)"
    assert rows["aegis-verification"]["privacy"].startswith(Preset.VERIFICATION.promise.says)
    assert "leaks" in rows["prune-90"]["privacy"] and rows["prune-90"]["utility"].startswith("trains")


def test_report_json_carries_the_utility_verdicts(tmp_path):
    import json

    from aegis.audit.report import ReportWriter

    ReportWriter(tmp_path).save(_report(PPL))
    rows = {a["defence"]: a for a in json.loads((tmp_path / "report.json").read_text())["advice"]}
    assert set(rows) == set(PPL)
    assert rows["aegis-verification"]["trains"] is False and rows["aegis-verification"]["utility_ratio"] > 13
    assert rows["dp-sgd-C1-z1"]["recommendation"] == "use: private and trains"


def test_the_terminal_table_carries_the_same_three_verdicts():
    from aegis.audit.terminal import results_tables

    console = Console(record=True, width=200)
    for table in results_tables(_report(PPL)):
        console.print(table)
    text = console.export_text()
    assert "utility verdict" in text and "recommendation" in text
    line = next(line for line in text.splitlines() if line.strip().startswith("aegis-verification"))
    assert "does not train" in line and "not usable" in line
    line = next(line for line in text.splitlines() if line.strip().startswith("dp-sgd-C1-z1"))
    assert "trains" in line and "use: private and trains" in line


BROWSER = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


@pytest.mark.skipif(BROWSER is None, reason="no headless Chromium on this machine (apt-get install chromium)")
def test_a_real_browser_shows_both_verdicts_on_every_row(tmp_path):
    """Headless Chromium loads the page; the DOM it built (not our HTML string) has the three verdict cells
    filled on every defence row."""
    write_html(_report(PPL), tmp_path / "report.html")
    done = subprocess.run([BROWSER, "--headless=new", "--no-sandbox", "--disable-gpu", "--dump-dom",
                           (tmp_path / "report.html").as_uri()], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    parser = _Rows()
    parser.feed(done.stdout)
    rows = {r["col1"]: r for r in parser.rows if "privacy" in r}
    assert set(rows) == set(PPL)
    assert all(r["privacy"].strip() and r["utility"].strip() and r["advice"].strip() for r in rows.values())
