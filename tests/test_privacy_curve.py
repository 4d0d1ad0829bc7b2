"""benchmarks/privacy_curve.py: the lambda axis configuration and the figure (the curve itself is a
benchmark run: see the module docstring for the commands)."""
import importlib.util
import json
from pathlib import Path

import pytest

from aegis.config import PRESET_EXPOSURES

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def curve():
    spec = importlib.util.spec_from_file_location("privacy_curve", ROOT / "benchmarks" / "privacy_curve.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_uniform_floods_rows_and_mlp_at_lam_rho_without_snr_cap(curve):
    config = curve.uniform(2.0, 0.3)
    for role in ("token_embedding", "position_embedding", "lm_head", "head"):
        t = config.treatments[role]
        assert (t.kind, t.lam, t.rho) == ("rows", 2.0, 0.3) and t.snr == float("inf")
    assert (config.treatments["mlp"].kind, config.treatments["mlp"].lam, config.treatments["mlp"].rho) == \
        ("matrix", 2.0, 0.3)
    assert config.treatments["attention"].kind == "frozen"


def test_plot_draws_every_attack_and_panel(curve, tmp_path):
    lams, ks = [0.0, 1.0], [1, 4]
    line = lambda n: {"score": [0.5] * n, "null": [0.0] * n}  # noqa: E731
    result = {"rhos": [0.0, 0.3], "lams": lams, "exposures": ks, "budgets": dict(PRESET_EXPOSURES),
              "lam_curves": {r: {a: line(2) for a in curve.ATTACKS} for r in ("0.0", "0.3")},
              "exposure_curves": {p: {a: line(2) for a in curve.ATTACKS} for p in ("paper", "utility")},
              "decoder": "d", "batch_size": 1, "sentences": 1, "label_batches": 1, "candidates": 10, "trials": 2}
    path = tmp_path / "curve.png"
    curve.plot(json.loads(json.dumps(result)), path)
    assert path.stat().st_size > 10_000 and path.read_bytes()[:4] == b"\x89PNG"
