"""The quick utility study end to end (slow: about 3 minutes on 2 quiet CPU cores): the report's structure
and the facts that do not depend on timing."""

from __future__ import annotations

import json

import pytest
import torch

from aegis.utility import DEFENCES, UtilityConfig
from aegis.utility.study import study


@pytest.fixture
def one_thread():
    """As ``aegis utility`` on busy cores: a parallel region waits for its slowest thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.slow
def test_quick_study_keeps_its_promises(tmp_path, one_thread):
    config = UtilityConfig.quick()
    result, paths = study(config, "cpu", tmp_path, say=lambda line: None)
    assert [p.name for p in paths] == ["report.json", "learning_curves.png", "frontier.png", "report.html"]
    assert json.loads((tmp_path / "report.json").read_text())["utility"]["complete"]
    assert result["machine"]["device"] == "cpu" and result["wall_seconds"] > 0

    runs = {(r["algorithm"], r["defence"]): r for r in result["runs"]}
    assert set(runs) == {(a, d) for a in ("fedsgd", "fedavg") for d in DEFENCES}
    failed = {k: r["error"] for k, r in runs.items() if "error" in r}
    assert not failed, failed
    untrained = result["references"][0]["untrained"]["perplexity"]
    for (algorithm, defence), run in runs.items():
        assert [p["round"] for p in run["curve"]] == [0, 1, 2, 3]  # evaluated every round, from round 0
        assert 0.0 <= run["silenced_export_share"] <= 1.0
        scored = [a for a in run["attacks"] if "skipped" not in a]
        for name in {a["attack"] for a in scored}:
            assert sorted(a["round"] for a in scored if a["attack"] == name) == [1, 2, 3]
        if defence == "none":
            assert run["final"]["perplexity"] < 0.5 * untrained  # the undefended run learns
        if defence == "dp-sgd":
            assert run["epsilon"] is not None and run["epsilon"] > 0 and run["delta"] is not None
        if defence.startswith("aegis-"):
            assert all(a["privacy"] <= 0.05 for a in scored if a["attack"] in ("dager", "embedding_norm"))
            assert any(a["attack"] == "fingerprint_pool" for a in scored) == (algorithm == "fedsgd")
    assert max(a["privacy"] for a in runs[("fedsgd", "none")]["attacks"] if a.get("attack") == "dager") >= 0.9
    assert len(result["summary"]) == len(runs) and len(result["statements"]) == 2
    page = (tmp_path / "report.html").read_text()
    assert all(line.split(" (")[0] in page for line in result["statements"])
