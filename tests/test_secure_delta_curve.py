"""benchmarks/clients_curve_delta.py: its clipping and verification helpers (clients_curve_delta_attacks.py), and a
--quick run on a tiny LLaMA."""
from __future__ import annotations

import json
import math

import torch

from aegis.fl.secure.delta_rounds import clip_delta
from benchmark_scripts import load

curve = load("clients_curve_delta")
attacks = load("clients_curve_delta_attacks")


def test_clipped_sum_is_the_sum_of_each_clients_own_clip():
    g = torch.Generator().manual_seed(0)
    deltas = {"a": torch.randn(5, 3, 4, generator=g), "b": torch.randn(5, 6, generator=g) * 0.1}
    table = {"a": (1.0, 0.3, 3.0, 0.0), "b": (0.5, 0.1, 10.0, 0.0)}  # a's clip binds for most clients, b's never
    total, bound = attacks.clipped_sum(deltas, table)
    each = [clip_delta({k: v[c] for k, v in deltas.items()}, table) for c in range(5)]
    for k in table:
        torch.testing.assert_close(total[k], sum(e[k] for e in each))
        torch.testing.assert_close(attacks.clipped_each(deltas, table, 2)[k], each[2][k])
    norms = deltas["a"].flatten(1).norm(dim=1)
    assert bound == int((norms > 3.0).sum()) / 10 and 0 < bound < 0.5


def test_verification_is_at_chance_between_identical_candidates_and_certain_between_distant_ones():
    sigma = {"w": 2.0}
    same = [{"w": torch.ones(50)} for _ in range(4)]
    chance = attacks.verify(same, sigma, trials=400, seed=0, n=4)
    assert chance["null"] == 0.25 and chance["whitened_distance"]["median"] == 0.0
    assert abs(chance["score"] - 0.25) <= 6 * math.sqrt(0.25 * 0.75 / 400)
    far = [{"w": torch.full((50,), 10.0 * j)} for j in range(4)]  # whitened distance 5 sqrt(50) apart
    assert attacks.verify(far, sigma, trials=100, seed=0, n=4)["score"] == 1.0


def test_quick_run_writes_the_curve_privacy_and_attacks(tmp_path):
    result = curve.main(["--quick", "--out", str(tmp_path), "--clients", "2", "--rounds", "1", "--candidates", "3",
                         "--trials", "30", "--validation", "4"])
    saved = json.loads((tmp_path / "clients-curve-delta-cpu-tiny.json").read_text())
    assert saved["complete"] and (tmp_path / "clients-curve-delta-cpu-tiny.png").exists()
    rows = {r["key"]: r for r in saved["rows"]}
    assert set(rows) == {"undefended M=2", "defended N=2"} and not [r for r in rows.values() if "error" in r]
    defended = rows["defended N=2"]
    assert math.isfinite(defended["best"]) and math.isfinite(rows["undefended M=2"]["best"])
    assert defended["pool"] == 2 and defended["survivors"] == 2 and defended["sample_rate"] == 2 / saved["population"]
    # z is the larger of the epsilon-8 calibration (within 1 %) and the verification floor measured on public text
    floor = saved["verification_floor"]  # at the initial adapters and at a state trained on public text
    assert set(floor["by_state"]) == {"initial", "public-trained"}
    assert all(f["pseudo_users"] == 1 and len(f["accuracy_by_z"]) == 13 for f in floor["by_state"].values())
    target = max(defended["noise_multiplier_for_epsilon"], floor["z"] or 0.0)
    assert defended["noise_multiplier_target"] == target
    assert defended["noise_multiplier"] >= target * (1 - 1e-5)  # a tensor clipped to nothing only adds privacy
    eps = defended["privacy"]["run"]["epsilon"]
    assert 7.5 <= eps <= 8.0 if target == defended["noise_multiplier_for_epsilon"] else eps < 7.5
    attacks = defended["attacks"]
    assert attacks["verification"]["candidates"] == 3 and 0.0 <= attacks["verification"]["score"] <= 1.0
    closed = attacks["embedding_projection"]["sum"]  # the embedding is frozen: the channel reads nothing
    assert closed["predictions"] == [] and closed["token_recall"] == 0.0
    assert "positive_control" in attacks["embedding_projection"]
    assert defended["ratio"] == defended["best"] / rows["undefended M=2"]["best"]
    assert result["n_star"] in (2, "not reached up to N = 2")
