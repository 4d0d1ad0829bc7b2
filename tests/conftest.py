"""Tests may fix the noise key (reproducible floods); production code refuses a fixed key without this."""
import os
import sys

os.environ.setdefault("AEGIS_ALLOW_FIXED_KEY", "1")
sys.path.insert(0, os.path.dirname(__file__))  # tests import their shared helpers (families)


import pytest  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _module_exposure_state(tmp_path_factory):
    """Module-scoped fixtures (set up before any test's own) get their module's exposure-state folder: the
    default state persists across processes, and must never be the user's."""
    previous = os.environ.get("AEGIS_CACHE_DIR")
    os.environ["AEGIS_CACHE_DIR"] = str(tmp_path_factory.mktemp("aegis-cache"))
    yield
    if previous is None:
        del os.environ["AEGIS_CACHE_DIR"]
    else:
        os.environ["AEGIS_CACHE_DIR"] = previous


@pytest.fixture(autouse=True)
def _fresh_exposure_state(tmp_path, monkeypatch):
    """Each test gets its own exposure-state folder."""
    monkeypatch.setenv("AEGIS_CACHE_DIR", str(tmp_path / "aegis-cache"))
