"""An audit stopped by SIGTERM keeps its finished rows, draws them, and `aegis audit --resume` finishes it with
the verdicts an uninterrupted run reaches; `aegis report` draws any report.json, finished or not."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from typer.testing import CliRunner

from aegis.audit.records import AttackRecord, AuditReport, UtilityRecord, verdicts
from aegis.audit.report import ReportWriter
from aegis.cli import app

# the quickest audit with three rows: one client, one round, two cheap attacks
TINY = ["--quick", "--defences", "none,aegis-verification,prune-90", "--attacks", "embedding_norm,dager",
        "--rounds", "1", "--clients", "1", "--threads", "1"]


def _verdicts(folder) -> dict[tuple[str, str], tuple[bool, list[str]]]:
    report = json.loads((folder / "report.json").read_text())
    return {(v["model"], v["defence"]): (v["holds"], v["leaking"]) for v in report["verdicts"]}


def _utility(folder) -> dict[str, float]:
    return {u["defence"]: u["value"] for u in json.loads((folder / "report.json").read_text())["utility"]}


def test_sigterm_keeps_the_finished_rows_and_resume_completes_them(tmp_path):
    stopped, whole = tmp_path / "stopped", tmp_path / "whole"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "120"}
    proc = subprocess.Popen([sys.executable, "-m", "aegis.cli", "audit", "--out", str(stopped), *TINY], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:  # stop it once the first row is on disk
        try:
            if json.loads((stopped / "report.json").read_text())["verdicts"]:
                break
        except (OSError, ValueError):
            pass
        time.sleep(0.05)
    assert proc.poll() is None, "the audit finished before it could be stopped"
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err[-2000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("interrupted: ") and f"continue with: aegis audit --resume {stopped}" in last, err
    partial = json.loads((stopped / "report.json").read_text())
    assert partial["complete"] is False and 1 <= len(partial["verdicts"]) < 3
    # the rows that finished are drawn at once, with the page saying the report is partial
    assert (stopped / "privacy_utility.png").read_bytes()[:4] == b"\x89PNG"
    assert "Partial report" in (stopped / "report.html").read_text()

    runner = CliRunner()
    result = runner.invoke(app, ["audit", "--resume", str(stopped)], env={"COLUMNS": "120"})
    assert result.exit_code == 0, result.output
    result = runner.invoke(app, ["audit", "--out", str(whole), *TINY], env={"COLUMNS": "120"})
    assert result.exit_code == 0, result.output

    resumed = json.loads((stopped / "report.json").read_text())
    assert resumed["complete"] is True and "Partial report" not in (stopped / "report.html").read_text()
    assert _verdicts(stopped) == _verdicts(whole)
    assert _verdicts(whole)[("decoder", "aegis-verification")][0] is True
    # each row draws from its own seed: a row resumed after others equals the same row run from the start
    # (AEGIS's rows draw fresh keys, so only the baselines compare exactly)
    for defence in ("none", "prune-90"):
        assert _utility(stopped)[defence] == pytest.approx(_utility(whole)[defence], rel=1e-6)
    assert len(resumed["nulls"]) == len(partial["nulls"])  # the nulls were kept, not recomputed

    again = runner.invoke(app, ["audit", "--resume", str(stopped)])
    assert again.exit_code == 0 and "nothing to resume" in again.output


def _partial_report() -> AuditReport:
    """One finished row (decoder, none) of a run planned as 2 models x 3 defences."""
    report = AuditReport({"config": {"models": ["decoder", "encoder"], "defences": ["none", "aegis", "prune-90"],
                                     "clients": 2, "rounds": 2, "batch_size": 2, "seed": 0}, "seconds": 12.0})
    report.utility.append(UtilityRecord("decoder", "none", 2, "perplexity", 900.0, 6.8, 26000.0))
    report.results.append(AttackRecord("decoder", "none", "dager", "rouge1", 1.0, 0.1, 2, 1.0, rouge1=1.0,
                                       token_recall=1.0, null_token_recall=0.1))
    report.verdicts.append(verdicts(report.results, "decoder", "none"))
    return report


def test_report_draws_a_partial_json(tmp_path):
    ReportWriter(tmp_path).save(_partial_report())
    result = CliRunner().invoke(app, ["report", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert "partial: 1 of 6 rows" in result.output and f"aegis audit --resume {tmp_path}" in result.output
    page = (tmp_path / "report.html").read_text()
    assert "Partial report</b>: 1 of 6 (model, defence) rows finished" in page and "dager" in page
    assert (tmp_path / "privacy_utility.png").read_bytes()[:4] == b"\x89PNG"
    # a report with no finished row yet is drawn too (an empty plot that says so)
    empty = tmp_path / "empty"
    ReportWriter(empty).save(AuditReport({"config": {"models": ["decoder"], "defences": ["none"]}}))
    result = CliRunner().invoke(app, ["report", str(empty / "report.json")])
    assert result.exit_code == 0 and "partial: 0 of 1 rows" in result.output, result.output
    assert (empty / "privacy_utility.png").stat().st_size > 1000


@pytest.mark.parametrize("content, says", [(None, "does not exist"), ("{not json", "cannot read"),
                                           ("[1, 2]", "is not an audit report")])
def test_report_and_resume_refuse_what_is_not_a_report(tmp_path, content, says):
    if content is not None:
        (tmp_path / "report.json").write_text(content)
    for args, option in ((["report", str(tmp_path)], "DIR"), (["audit", "--resume", str(tmp_path)], "--resume")):
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 2, result.output
        [line] = result.stderr.strip().splitlines()
        assert line.startswith(f"error: {option}: ") and says in line, line


def test_resume_takes_its_settings_from_the_report(tmp_path):
    ReportWriter(tmp_path).save(_partial_report())
    result = CliRunner().invoke(app, ["audit", "--resume", str(tmp_path), "--rounds", "5"])
    assert result.exit_code == 2
    assert result.stderr.strip() == ("error: --rounds: --resume takes every setting from the report it continues: "
                                     "drop --rounds")
    result = CliRunner().invoke(app, ["audit", "--quick", "--full"])
    assert result.exit_code == 2 and "--full" in result.stderr and "choose one" in result.stderr
