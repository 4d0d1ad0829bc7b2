"""`aegis exposure path|show|reset`: where the counts are, what they hold, and forgetting them only when told."""
from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from aegis.cli import app
from aegis.exposure_store import ExposureStore, create_state, default_state_path

runner = CliRunner()


def _line(result) -> str:
    [line] = result.stderr.strip().splitlines()
    return line


def test_path_names_the_default_store_and_says_when_there_is_none():
    result = runner.invoke(app, ["exposure", "path"])
    assert result.exit_code == 0
    assert result.stdout.strip() == str(default_state_path())
    assert "nothing was exported with it yet" in result.stderr
    result = runner.invoke(app, ["exposure", "show"])
    assert result.exit_code == 0 and "no exposure store at" in result.stdout
    assert not default_state_path().exists()  # looking creates nothing


def test_show_then_reset_only_with_yes(tmp_path):
    store = create_state(tmp_path / "client.sqlite")
    counts = ExposureStore(store)
    assert counts.reserve([[1, 2, 3], [4, 5]], budget=4) == 0
    assert counts.reserve([[1, 2]], budget=4) == 0
    result = runner.invoke(app, ["exposure", "show", "--state", str(store)])
    assert result.exit_code == 0, result.output
    text = " ".join(result.stdout.split())
    assert f"exposure store {store}" in text
    assert "token windows counted: 5" in text and "most exports of one window: 2" in text
    assert "exports counted: 2" in text

    refused = runner.invoke(app, ["exposure", "reset", "--state", str(store)])
    assert refused.exit_code == 2
    assert _line(refused) == (f"error: --yes: reset forgets 5 token windows' counts (2 exports, up to 2 of one "
                              f"window) in {store}; add --yes to confirm")
    assert ExposureStore(store).summary().windows == 5  # nothing forgotten

    done = runner.invoke(app, ["exposure", "reset", "--state", str(store), "--yes"])
    assert done.exit_code == 0, done.output
    assert done.stdout.startswith("forgot 5 token windows' counts (2 exports, up to 2 of one window)")
    after = runner.invoke(app, ["exposure", "show", "--state", str(store)])
    assert "token windows counted: 0" in " ".join(after.stdout.split())


def test_bad_stores_are_one_line(tmp_path, monkeypatch):
    missing = runner.invoke(app, ["exposure", "show", "--state", str(tmp_path / "nope.sqlite")])
    assert missing.exit_code == 2
    assert _line(missing).startswith("error: --state: ") and "does not exist" in _line(missing)
    junk = tmp_path / "junk.sqlite"
    junk.write_text("not a database")
    junk.chmod(0o600)
    broken = runner.invoke(app, ["exposure", "reset", "--state", str(junk), "--yes"])
    assert broken.exit_code == 2 and _line(broken).startswith(f"error: --state: {junk}: ")
    assert Path(junk).read_text() == "not a database"  # an unreadable store is never replaced
    monkeypatch.setenv("AEGIS_CACHE_DIR", "relative/cache")
    relative = runner.invoke(app, ["exposure", "path"])
    assert relative.exit_code == 2 and _line(relative).startswith("error: AEGIS_CACHE_DIR: ")
