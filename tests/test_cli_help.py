"""The command line's first impressions: `aegis --help` without torch, help texts that say each default once,
"did you mean" for a mistyped name, and no warning about a preset the user did not choose."""
from __future__ import annotations

import subprocess
import sys
import warnings

from typer.testing import CliRunner

from aegis.cli import app

runner = CliRunner()


def test_help_imports_no_torch_and_costs_under_a_cpu_second():
    code = ("import resource, sys\n"
            "sys.argv = ['aegis', '--help']\n"
            "from aegis.cli import app\n"
            "try:\n    app()\nexcept SystemExit:\n    pass\n"
            "assert 'torch' not in sys.modules, 'aegis --help imported torch'\n"
            "r = resource.getrusage(resource.RUSAGE_SELF)\n"
            "print('cpu', r.ru_utime + r.ru_stime)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "audit" in out.stdout and "report" in out.stdout
    assert float(out.stdout.split("cpu")[-1]) < 1.0, out.stdout


def test_naming_the_attacks_imports_no_attack():
    code = ("import sys\nfrom aegis.attacks.registry import NAMES\nfrom aegis.audit.options import AuditConfig\n"
            "assert 'torch' not in sys.modules and NAMES\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr


def test_each_default_is_said_once():
    for command in ("calibrate", "audit", "inspect", "utility", "report"):
        result = runner.invoke(app, [command, "--help"], env={"COLUMNS": "80"})
        assert result.exit_code == 0, result.output
        assert "[default" not in result.output, (command, result.output)


def test_the_help_lists_what_each_job_runs():
    from aegis.audit.options import DEFENCES, FULL_DEFENCES, QUICK_DEFENCES, AuditConfig

    text = " ".join(runner.invoke(app, ["audit", "--help"], env={"COLUMNS": "80"}).output.split()).replace("- ", "-")
    for name in (*DEFENCES, *FULL_DEFENCES):
        assert name in text, name
    for config, defences in ((AuditConfig(), DEFENCES), (AuditConfig.quick(), QUICK_DEFENCES),
                             (AuditConfig.full(), FULL_DEFENCES)):
        assert config.defences == defences and f"{', '.join(defences)}" in text
    assert "aegis-sentences with --batch-size 8" in text  # runs only when named, at its promise's batch


def test_a_mistyped_name_gets_a_suggestion_in_one_line(tmp_path):
    for option, typo, meant in (("--defences", "aegis-verificaton", "aegis-verification"),
                                ("--defences", "prune90", "prune-90"),
                                ("--attacks", "spectal", "spectral")):
        result = runner.invoke(app, ["audit", "--out", str(tmp_path), option, typo])
        assert result.exit_code == 2, result.output
        [line] = result.stderr.strip().splitlines()
        assert line.startswith(f"error: {option}: ") and f"did you mean {meant!r}?" in line, line


def test_no_preset_warning_for_a_preset_the_user_did_not_choose():
    from aegis.audit.options import FULL_DEFENCES, AuditConfig, resolve_defence

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for config in (AuditConfig(), AuditConfig.quick(), AuditConfig.full()):
            for name in config.defences:
                resolve_defence(name)
        assert "aegis-paper-batch" in FULL_DEFENCES
    result = runner.invoke(app, ["inspect", "decoder", "--summary-only"])
    assert result.exit_code == 0, result.output
    assert "warning" not in result.output.lower() and "paper" not in result.stderr


def test_an_audit_of_the_papers_row_says_it_in_the_verdict_not_in_warnings(tmp_path):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = runner.invoke(app, ["audit", "--quick", "--out", str(tmp_path), "--defences", "aegis-paper-batch",
                                     "--attacks", "embedding_norm", "--rounds", "1", "--clients", "1"])
    assert result.exit_code == 0, result.output
    assert not [w for w in caught if "preset 'paper'" in str(w.message)]


def test_a_mistyped_command_is_suggested_once_and_a_bare_group_shows_its_help():
    result = runner.invoke(app, ["inspct"])
    assert result.exit_code == 2
    assert result.stderr.strip() == "error: No such command 'inspct'. Did you mean 'inspect'? (see aegis --help)"
    result = runner.invoke(app, ["exposure", "shw"])
    assert result.stderr.strip() == ("error: No such command 'shw'. Did you mean 'show'? "
                                     "(see aegis exposure --help)")
    for args in ([], ["exposure"]):
        result = runner.invoke(app, args)
        assert "Usage: " in result.output and "Commands:" in result.output and "error:" not in result.output
