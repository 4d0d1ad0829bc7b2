"""Tests may fix the noise key (reproducible floods); production code refuses a fixed key without this."""
import os
import sys

os.environ.setdefault("AEGIS_ALLOW_FIXED_KEY", "1")
sys.path.insert(0, os.path.dirname(__file__))  # tests import their shared helpers (families)


import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _fresh_exposure_state(tmp_path, monkeypatch):
    """Each test gets its own exposure-state folder: the default state persists across processes."""
    monkeypatch.setenv("AEGIS_CACHE_DIR", str(tmp_path / "aegis-cache"))
