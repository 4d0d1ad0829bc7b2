"""`aegis audit` end to end on a small configuration: report.json, the PNG and the HTML are real."""
import html
import json

import pytest
from typer.testing import CliRunner

from aegis.cli import app


@pytest.fixture(scope="module")
def report_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("report")
    result = CliRunner().invoke(
        app,
        ["audit", "--quick", "--out", str(out), "--defences", "none,aegis-paper,prune-90", "--attacks", "dager,embedding_norm",
         "--rounds", "1", "--clients", "1"],
        env={"COLUMNS": "200"},
    )
    assert result.exit_code == 0, result.output
    return out


def test_report_json_schema_and_privacy(report_dir):
    report = json.loads((report_dir / "report.json").read_text())
    rows = {(r["model"], r["defence"], r["attack"]): r for r in report["results"]}
    assert set(rows) == {("decoder", d, a) for d in ("none", "aegis-paper", "prune-90") for a in ("dager", "embedding_norm")}
    for row in rows.values():
        assert {"rouge1", "rouge2", "rougeL", "token_recall", "exact_rate", "null_rouge1"} <= row.keys()
    assert rows["decoder", "none", "dager"]["rouge1"] >= 0.9  # undefended: the attack works
    for attack in ("dager", "embedding_norm"):
        aegis_row = rows["decoder", "aegis-paper", attack]
        assert aegis_row["rouge1"] <= max(0.05, aegis_row["null_rouge1"] + 0.05)
    utility = {u["defence"]: u for u in report["utility"]}
    assert set(utility) == {"none", "aegis-paper", "prune-90"}
    assert all(u["perplexity"] > 1 for u in utility.values())


def test_plot_and_html_show_what_they_claim(report_dir):
    png = (report_dir / "privacy_utility.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000
    page = (report_dir / "report.html").read_text()
    report = json.loads((report_dir / "report.json").read_text())
    undefended = [r for r in report["reconstructions"] if r["defence"] == "none" and r["attack"] == "dager"]
    assert undefended and all(html.escape(r["reference"]) in page for r in undefended)
    assert "class='hit'" in page  # the undefended reconstruction is coloured token by token


@pytest.mark.slow
def test_quick_audit_meets_the_bar(tmp_path):
    """The full `aegis audit --quick` (every quick defence and attack): the issue's bar, under 3 minutes."""
    import time

    start = time.perf_counter()
    result = CliRunner().invoke(app, ["audit", "--quick", "--out", str(tmp_path)], env={"COLUMNS": "200"})
    elapsed = time.perf_counter() - start
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "report.json").read_text())
    rows = {(r["defence"], r["attack"]): r for r in report["results"]}
    defences = {d for d, _ in rows}
    assert {"none", "aegis-paper", "aegis-utility"} <= defences
    assert any(d.startswith("dp-noise") for d in defences) and any(d.startswith("dp-sgd") for d in defences)
    assert any(d.startswith("prune") for d in defences) and any(d.startswith("soteria") for d in defences)
    assert rows["none", "dager"]["rouge1"] >= 0.90
    for (defence, attack), row in rows.items():
        if defence.startswith("aegis"):
            assert row["rouge1"] <= 0.05, (defence, attack, row["rouge1"])
    ppl = {u["defence"]: u["perplexity"] for u in report["utility"]}
    assert ppl["aegis-utility"] <= 1.10 * ppl["none"], ppl
    print(f"quick audit: {elapsed:.0f} s; perplexity {ppl}")
    assert elapsed < 180


@pytest.mark.parametrize("flag, attacked, said", [([], 1, "the first round's"), (["--attack-rounds", "0"], 2, "every round's")])
def test_attack_rounds_chooses_which_captured_gradients_are_attacked(tmp_path, flag, attacked, said):
    """The server captures every round; by default it attacks round 1's gradients, 0 means all."""
    result = CliRunner().invoke(
        app,
        ["audit", "--quick", "--out", str(tmp_path), "--defences", "none", "--attacks", "embedding_norm",
         "--rounds", "2", "--clients", "1", *flag],
        env={"COLUMNS": "200"},
    )
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "report.json").read_text())
    [row] = report["results"]
    assert row["gradients"] == attacked
    assert report["rounds"][0]["rounds"] and len(report["rounds"][0]["rounds"]) == 2  # both rounds ran
    assert f"attacked {said} gradients" in (tmp_path / "report.html").read_text()


def test_negative_attack_rounds_is_refused_with_the_fix():
    from aegis.audit import AuditConfig

    with pytest.raises(ValueError, match="attack_rounds=-1.*>= 0"):
        AuditConfig(attack_rounds=-1)
