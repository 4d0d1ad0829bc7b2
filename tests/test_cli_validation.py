"""`aegis audit` refuses bad input before any model loads: one line naming the option and the fix, exit 2.

Fast tests call the validators and the CLI in process (a model load would fail the test: ``load_model``
is replaced by a function that raises). The slow test runs the bad-input table of issue 17 through the
installed ``aegis`` command, and checks that a late failure loses nothing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from aegis.audit import dataset as audit_data
from aegis.audit.options import AuditConfig, UsageError, check_model_name, check_out
from aegis.cli import app

runner = CliRunner()


def _small_audit(out) -> list[str]:
    """One client, one round, one baseline and one attack: the smallest audit that writes a report."""
    return ["audit", "--quick", "--out", str(out), "--defences", "none,prune-90", "--attacks", "embedding_norm",
            "--rounds", "1", "--clients", "1", "--threads", "1"]


@pytest.fixture
def no_model_loads(monkeypatch):
    import aegis.audit.runner as runner_module

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the input was validated")

    monkeypatch.setattr(runner_module, "load_model", refuse)


def _error(result) -> str:
    """The one error line (stderr, besides progress lines "[  12s] 3/5 ..."), checked to be one line."""
    lines = [line for line in result.stderr.splitlines() if line.strip() and not line.startswith("[")]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: "), lines[0]
    assert "Traceback" not in result.output
    return lines[0]


# -- names and ranges ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "changes, option, fix",
    [
        ({"defences": ("bogus",)}, "--defences", "aegis-paper-batch"),
        ({"defences": ("none", "bogus")}, "--defences", "prune-90"),
        ({"defences": ("none", "none")}, "--defences", "once"),
        ({"attacks": ("dager", "nope")}, "--attacks", "fingerprint_secret"),
        ({"models": ("gpt9",)}, "--models", "decoder, encoder"),
        ({"models": ("decoder",), "attacks": ("labels",)}, "--attacks", "--models encoder"),
        ({"rounds": 0}, "--rounds", "from 1"),
        ({"batch_size": 1000}, "--batch-size", "to 64"),
        ({"attack_rounds": 5}, "--attack-rounds", "more than --rounds 2: use at most 2"),
        ({"attack_rounds": -1}, "--attack-rounds", "0 attacks every round"),
        ({"validation_share": 0.9}, "--validation-share", "0.5"),
        ({"models": ("encoder",), "decoder": "gpt2"}, "--model", "drop --model"),
    ],
)
def test_names_and_ranges_are_refused_with_the_fix(changes, option, fix):
    with pytest.raises(UsageError) as err:
        AuditConfig(**changes)
    assert err.value.option == option and str(err.value).startswith(option) and fix in str(err.value)
    assert "\n" not in str(err.value)


def test_the_defaults_validate_and_name_both_calibrations():
    from aegis.audit.options import resolve_defence

    config = AuditConfig()
    assert {"aegis-verification", "aegis-paper-batch"} <= set(config.defences)
    assert "aegis-sentences" not in config.defences  # below its stated batch: costly and checks no promise
    assert resolve_defence("aegis-paper-batch").calibration == "batch"
    assert resolve_defence("aegis-verification").calibration == "public"
    assert resolve_defence("prune-90").aegis is None
    assert "labels" not in config.attacks_for("decoder") and "labels" in config.attacks_for("encoder")


def test_out_must_be_writable(tmp_path):
    assert check_out(tmp_path / "new" / "deeper").is_dir()  # created
    (tmp_path / "file").write_text("x")
    for bad in ("/proc/aegis-x", str(tmp_path / "file")):
        with pytest.raises(UsageError, match="^--out: .*(writable|folder)"):
            check_out(bad)


def test_offline_hub_names_fail_at_once(monkeypatch):
    import aegis.loading

    monkeypatch.setattr(aegis.loading, "hub_reachable", lambda timeout=3.0: False)
    start = time.perf_counter()
    with pytest.raises(UsageError, match="^--model: .*not reachable"):
        check_model_name("--model", "no-such-org/no-such-model-aegis")
    with pytest.raises(UsageError, match="^--dataset: .*(not reachable|pip install datasets)"):
        audit_data.load(AuditConfig(dataset="no-such-org/no-such-dataset-aegis", models=("decoder",)))
    assert time.perf_counter() - start < 10
    with pytest.raises(UsageError, match="^--encoder: .*no such folder"):
        check_model_name("--encoder", "./no/such/folder")


# -- the dataset ---------------------------------------------------------------------------------------------------


def _config(path, **changes) -> AuditConfig:
    return AuditConfig(dataset=str(path), models=("decoder",), **changes)


@pytest.mark.parametrize(
    "name, content, option, fix",
    [
        ("missing.txt", None, "--dataset", "no such file"),
        ("empty.txt", b"", "--dataset", "no sentences"),
        ("blank.csv", b"text\n\n", "--dataset", "no sentences"),
        ("random.txt", bytes(range(128, 256)) * 4, "--dataset", "save it as UTF-8"),
        ("random.csv", os.urandom(2048).replace(b"\x00", b"\x01") + b"\xff", "--dataset", "UTF-8"),
        ("nul.txt", b"one\x00two\n", "--dataset", "binary"),
        ("table.csv", b"id,body\n1,hello there\n", "--text-field", "--text-field COLUMN"),
        ("rows.jsonl", b'{"body": "x"}\n[1, 2]\n', "--dataset", "not an object"),
        ("bad.jsonl", b'{"text": "x"}\n{oops\n', "--dataset", "line 2 is not JSON"),
        ("data.parquet", b"PAR1", "--dataset", ".jsonl"),
        ("small.txt", b"one sentence\nanother one\n", "--dataset", "lower --clients/--rounds/--batch-size"),
    ],
)
def test_bad_datasets_are_refused_with_the_fix(tmp_path, name, content, option, fix):
    path = tmp_path / name
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(UsageError) as err:
        audit_data.load(_config(path))
    assert err.value.option == option, str(err.value)
    assert fix in str(err.value) and "\n" not in str(err.value)


def test_named_text_field_and_labels(tmp_path):
    rows = [f"{i},sentence number {i} about topic {i % 3},t{i % 3}" for i in range(60)]
    path = tmp_path / "d.csv"
    path.write_text("id,body,kind\n" + "\n".join(rows) + "\n")
    data = audit_data.load(AuditConfig(dataset=str(path), text_field="body", label_field="kind"))
    assert data.labels == ("t0", "t1", "t2") and all(e.text.startswith("sentence number") for e in data.train)
    with pytest.raises(UsageError, match="^--label-field: .*no column 'topic'"):
        audit_data.load(AuditConfig(dataset=str(path), text_field="body", label_field="topic"))
    with pytest.raises(UsageError, match="^--label-field: .*encoder trains a classifier.*--models decoder"):
        audit_data.load(AuditConfig(dataset=str(path), text_field="body", models=("encoder",)))


def test_own_data_gets_a_seeded_held_out_split(tmp_path):
    path = tmp_path / "mine.txt"
    path.write_text("\n".join(f"private sentence number {i}" for i in range(50)) + "\n")
    a = audit_data.load(_config(path, seed=3))
    b = audit_data.load(_config(path, seed=3))
    c = audit_data.load(_config(path, seed=4))
    train, validation = {e.text for e in a.train}, {e.text for e in a.validation}
    assert not train & validation and len(train | validation) == 50 and len(validation) == 10
    assert validation == {e.text for e in b.validation} and validation != {e.text for e in c.validation}
    assert "held out at random (seed 3)" in a.split and "never trained on" in a.split


def test_a_split_column_is_used(tmp_path):
    path = tmp_path / "split.jsonl"
    lines = [json.dumps({"text": f"s {i}", "split": "validation" if i % 5 == 0 else "train"}) for i in range(40)]
    path.write_text("\n".join(lines))
    data = audit_data.load(_config(path, rounds=1))
    assert len(data.validation) == 8 and len(data.train) == 32 and "'validation' rows" in data.split


# -- through the CLI, in process -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args, option",
    [
        (["--defences", "none,bogus"], "--defences"),
        (["--rounds", "abc"], "--rounds"),
        (["--attack-rounds", "9"], "--attack-rounds"),
        (["--out", "/proc/aegis-x"], "--out"),
        (["--threads", "0"], "--threads"),
        (["--bogus-option"], "--bogus-option"),
    ],
)
def test_cli_refuses_in_one_line_before_loading(no_model_loads, tmp_path, args, option):
    result = runner.invoke(app, ["audit", "--out", str(tmp_path / "out"), *args])
    assert result.exit_code == 2, result.output
    assert option in _error(result)


def test_cli_dataset_errors_are_one_line(no_model_loads, tmp_path):
    path = tmp_path / "noise.txt"
    path.write_bytes(bytes(range(256)) * 8)
    result = runner.invoke(app, ["audit", "--out", str(tmp_path / "o"), "--dataset", str(path)])
    assert result.exit_code == 2 and "--dataset" in _error(result) and "UTF-8" in result.stderr
    result = runner.invoke(app, ["audit", "--out", str(tmp_path / "o"), "--dataset", str(path), "--debug"])
    assert result.exit_code != 0 and isinstance(result.exception, UsageError)  # --debug: the exception itself


def test_decoder_random_is_an_embedded_decoder_not_a_hub_name(no_model_loads, tmp_path):
    """--model decoder-random skips the Hub lookup (the next check, --threads, is the one that fails)."""
    args = ["audit", "--out", str(tmp_path / "o"), "--model", "decoder-random", "--threads", "0"]
    result = runner.invoke(app, args)
    assert result.exit_code == 2 and "--threads" in _error(result)
    result = runner.invoke(app, [*args[:-2], "--models", "encoder"])
    assert result.exit_code == 2 and "--model" in _error(result) and "drop --model" in result.stderr


def test_the_audit_decoders():
    from aegis.audit.runner import load_model

    default, _ = load_model("decoder", AuditConfig.quick(), num_labels=2)
    random_attention, _ = load_model("decoder", AuditConfig.quick(decoder="decoder-random"), num_labels=2)
    assert type(default).__name__ == "BertLMHeadModel" and default.config.is_decoder
    assert type(random_attention).__name__ == "GPT2LMHeadModel"


# -- slow: the table through the installed command, and late failures -----------------------------------


def _aegis(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "80", "HF_HUB_OFFLINE": "0"}
    return subprocess.run(
        [sys.executable, "-m", "aegis.cli", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120
    )


@pytest.mark.slow
def test_bad_input_table_through_the_command(tmp_path):
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "random.txt").write_bytes(os.urandom(4096).replace(b"\n", b"\xff") + b"\xfe")
    (tmp_path / "table.csv").write_text("id,body\n1,a sentence\n2,another\n")
    table = [
        (["--dataset", "missing.txt"], "--dataset"),
        (["--dataset", "empty.txt"], "--dataset"),
        (["--dataset", "random.txt"], "--dataset"),
        (["--dataset", "table.csv"], "--text-field"),
        (["--dataset", "no-such-org/no-such-dataset-aegis"], "--dataset"),
        (["--model", "no-such-org/no-such-model-aegis"], "--model"),
        (["--defences", "bogus"], "--defences"),
        (["--defences", "none,bogus"], "--defences"),
        (["--out", "/proc/x"], "--out"),
        (["--rounds", "0"], "--rounds"),
        (["--batch-size", "two"], "--batch-size"),
    ]
    for args, option in table:
        start = time.perf_counter()
        done = _aegis("audit", "--out", str(tmp_path / "out"), *args, cwd=tmp_path)
        seconds = time.perf_counter() - start
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        assert done.returncode == 2, (args, done.stderr[-2000:])
        assert len(lines) == 1 and lines[0].startswith("error: ") and option in lines[0], (args, done.stderr[-2000:])
        assert "Traceback" not in done.stderr + done.stdout and not done.stdout.strip(), args
        assert seconds < 60, (args, seconds)  # refused up front: no model load, no minute of Hub retries
    assert not (tmp_path / "out" / "report.json").exists()


@pytest.mark.slow
def test_nothing_is_lost_when_out_fails_late(tmp_path, monkeypatch):
    """The output folder disappears (replaced by a file) after the first defence: the run goes on, the
    report lands in a fresh folder, the error line names it, and every defence's rows are there."""
    import aegis.audit.runner as runner_module

    out = tmp_path / "out"
    real = runner_module.federate
    calls = []

    def federate(ctx, spec, *args, **kwargs):
        calls.append(spec.name)
        if len(calls) == 2:
            import shutil

            shutil.rmtree(out)
            out.write_text("not a folder any more")
        return real(ctx, spec, *args, **kwargs)

    monkeypatch.setattr(runner_module, "federate", federate)
    result = runner.invoke(
        app,
        _small_audit(out),
    )
    assert result.exit_code == 1, result.output
    line = _error(result)
    assert "--out" in line and str(out) in line
    fallback = Path(line.rsplit(" is in ", 1)[1].strip())
    report = json.loads((fallback / "report.json").read_text())
    assert report["complete"] and {r["defence"] for r in report["results"]} == {"none", "prune-90"}
    assert (fallback / "report.html").exists() and (fallback / "privacy_utility.png").exists()


@pytest.mark.slow
def test_a_crash_mid_run_keeps_the_finished_defences(tmp_path, monkeypatch):
    import aegis.audit.runner as runner_module

    real = runner_module.federate

    def federate(ctx, spec, *args, **kwargs):
        if spec.name == "prune-90":
            raise RuntimeError("simulated failure\nwith a second line")
        return real(ctx, spec, *args, **kwargs)

    monkeypatch.setattr(runner_module, "federate", federate)
    out = tmp_path / "out"
    result = runner.invoke(
        app,
        _small_audit(out),
    )
    assert result.exit_code == 1
    line = _error(result)
    assert "simulated failure with a second line" in line and "--debug" in line and "report.json" in line
    report = json.loads((out / "report.json").read_text())
    assert not report["complete"] and [v["defence"] for v in report["verdicts"]] == ["none"]
    assert [r["defence"] for r in report["results"]] == ["none"]
