"""benchmarks/frontier_delta.py: the delta-mode frontier, its quick CPU run and its noise helper."""
from __future__ import annotations

import json
import math

import pytest
import torch

from benchmark_scripts import load


def test_noise_of_a_mean_of_n_exports_has_sigma_over_sqrt_n():
    attacks = load("frontier_delta_attacks")
    clipped = {"w": torch.zeros(200_000), "frozen": torch.ones(3)}
    out = attacks.noisy(clipped, {"w": 2.0}, torch.Generator().manual_seed(0), scale=1 / math.sqrt(4))
    n = clipped["w"].numel()
    # N(0, 1) per entry after dividing by sigma / sqrt(N) = 1: mean sd 1/sqrt(n), mean square sd sqrt(2/n)
    z = out["w"].double() / 1.0
    assert abs(float(z.mean())) < 6 / math.sqrt(n) and abs(float(z.square().mean()) - 1) < 6 * math.sqrt(2 / n)
    assert torch.equal(out["frozen"], clipped["frozen"])  # no sigma: left as it is


@pytest.mark.slow
def test_quick_run_writes_every_leg(tmp_path):
    bench = load("frontier_delta")
    result = bench.main(["--quick", "--out", str(tmp_path), "--attacks", "dager,mlp_span,embedding_norm,verification"])
    saved = json.loads((tmp_path / "frontier-delta-cpu-tiny.json").read_text())
    assert saved["complete"] and (tmp_path / "frontier-delta-cpu-tiny.png").exists()
    rows = result["rows"]
    assert not [r for r in rows if "error" in r]
    utility = {(r["variant"], r.get("D"), r.get("E")): r for r in rows if r["leg"] == "utility"}
    for variant in ("lora-mlp", "full-mlp"):
        point = utility[(variant, 2, 1)]["by_N"]["2"]
        assert {"undefended", "S=inf", "S=100", "S=10"} <= set(point) and all(math.isfinite(v) for v in point.values())
    assert "undefended" in utility[("full-ft", 2, 1)]["by_N"]["1"]
    lora = {r["rank"]: r for r in rows if r["leg"] == "attention-lora"}
    assert 3 * 4 < lora[4]["tokens"] < 3 * 64  # the premise of the two ranks
    assert lora[64]["token_recall"] >= 0.8 and lora[4]["token_recall"] <= lora[4]["null_token_recall"] + 0.05
    control = next(r for r in rows if r["leg"] == "attack" and r["optimizer"] == "sgd")
    assert control["attacks"]["mlp_span"]["token_recall"] >= 0.8  # the positive control leaks
    assert control["attacks"]["mlp_span"]["null_token_recall"] <= 0.05
