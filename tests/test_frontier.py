"""benchmarks/frontier.py on a tiny LLaMA (CPU): the settings' configurations, the masked fine-tuning and
(slow) a whole quick run with its attacks."""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import frontier  # noqa: E402
from frontier_points import GROUPS, NEAR_EXACT, Frontier, Setting, config_of, grid  # noqa: E402

import aegis  # noqa: E402
from aegis.models import default_decoder  # noqa: E402
from fast_noise import fast_noise  # noqa: E402, F401  (fixture: the script's default noise, restored after)


@pytest.fixture(scope="module")
def tiny():
    args = argparse.Namespace(model="tiny", gguf=None, tokens=64, steps=2, eval_every=1, attack_texts=1,
                              candidates=4, trials=2, seed=0)
    return Frontier(args, torch.device("cpu"))


def _actions(setting, verification=False):
    model, _ = default_decoder(arch="llama", n_layer=2)
    names = [n for n, _ in model.named_parameters()]
    shield = aegis.protect(model, config=config_of(setting, names, verification))
    shield.calibrate()
    return {r.name: r for r in shield.report().rows}


def test_undefended_has_no_shield_and_grid_keys_are_unique():
    assert config_of(Setting(attention="clean"), ["w"]) is None
    keys = [s.key for s in grid(False)]
    assert len(keys) == len(set(keys))
    assert grid(False)[0].undefended and grid(False)[1] == Setting()  # the controls lead


def test_each_group_is_frozen_clean_or_capped_as_set():
    rows = _actions(Setting(emb="frozen", mlp=300.0, norm="clean"))
    for name, row in rows.items():
        if "self_attn" in name or "embed" in name or "lm_head" in name:
            assert row.action == "frozen", name
        elif ".mlp." in name:
            assert row.action == "matrix flood" and row.snr_cap == 300.0
            assert row.snr is not None and row.snr <= 300.0 * (1 + 1e-6)
        else:
            assert "norm" in name and row.action.startswith("CLEAN"), name
    rows = _actions(Setting(emb=10.0, mlp="uncapped", norm="frozen"))
    emb = [r for n, r in rows.items() if "embed" in n or "lm_head" in n]
    assert emb and all(r.action == "rows flood" and r.snr_cap == 10.0 for r in emb)
    mlp = [r for n, r in rows.items() if ".mlp." in n]
    assert mlp and all(r.action == "matrix flood" and r.snr_cap is None and r.lam == 1.0 for r in mlp)
    with pytest.warns(UserWarning, match="unflooded"):  # a clean embedding is allowed, with its warning
        rows = _actions(Setting(emb="clean", mlp="frozen", norm="frozen"))
    assert all(r.action.startswith("CLEAN") for n, r in rows.items() if "embed" in n or "lm_head" in n)


def test_verification_floods_clean_groups_near_exactly():
    rows = _actions(Setting(attention="clean"), verification=True)
    assert all(r.action.endswith("flood") and r.lam == NEAR_EXACT for r in rows.values())
    rows = _actions(Setting(emb="frozen", mlp=1000.0), verification=True)
    norms = [r for n, r in rows.items() if "norm" in n]
    assert norms and all(r.lam == NEAR_EXACT and r.snr_cap is None for r in norms)
    assert set(GROUPS) == {"emb", "mlp", "norm"}


def test_fine_tune_steps_on_the_masked_gradient_and_leaves_frozen_weights(tiny):
    base = {n: p.detach().clone() for n, p in tiny.model.named_parameters()}
    out = tiny.fine_tune(Setting(emb="frozen", mlp=1000.0, norm=1000.0, batch=2))
    assert [s for s, _ in out["curve"]] == [0, 1, 2]
    assert all(math.isfinite(p) and p > 1 for _, p in out["curve"])
    assert out["best"] == min(p for _, p in out["curve"][1:]) and out["final"] == out["curve"][-1][1]
    # the pretrained copy is untouched (each setting trains its own deep copy)
    assert all(torch.equal(p, base[n]) for n, p in tiny.model.named_parameters())
    und = tiny.fine_tune(Setting(attention="clean", batch=2, lr=1e-2))
    assert und["final"] != out["final"]


@pytest.mark.slow
def test_quick_run_writes_rows_with_every_attack_and_positive_controls(tmp_path, fast_noise):
    frontier.main(["--model", "tiny", "--quick", "--steps", "2", "--out", str(tmp_path)])
    result = json.loads((tmp_path / "frontier-cpu-tiny.json").read_text())
    assert result["complete"] and len(result["rows"]) == len(grid(True))
    undefended = result["rows"][0]
    point = undefended["attacks"]["K=1"]
    assert set(point) == {"dager", "embedding_norm", "mlp_span", "spectral", "verification"}
    if result["scored"]:  # rouge-score installed: the undefended export is read (positive control)
        assert point["dager"]["score"] > point["dager"]["null"] + 0.5
    assert point["verification"]["score"] == 1.0
    assert "K=2" in result["rows"][1]["attacks"]
