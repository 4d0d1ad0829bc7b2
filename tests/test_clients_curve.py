"""benchmarks/clients_curve.py on CPU: the round's noise scales as sigma sqrt(N / t), and a --quick run on a
tiny LLaMA writes the curve (ratios to undefended at the same sampling rate, epsilon per example, N*)."""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch
import transformers

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import clients_curve  # noqa: E402
from clients_curve import Alone, grid, micro_loss, rate, server_mean, survivors  # noqa: E402

from aegis import AegisConfig, ExposurePolicy, Preset, protect  # noqa: E402
from aegis.accounting import gaussian_epsilon  # noqa: E402
from fast_noise import fast_noise  # noqa: E402, F401  (fixture)

PURE_NOISE = "transformer.h.0.mlp.c_fc.weight"  # verification floods the MLP with rho = 0


def tiny_gpt2():
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=200, n_positions=64)
    return transformers.GPT2LMHeadModel(cfg).eval()


def batch(rows=6, length=7):
    ids = torch.randint(0, 200, (rows, length), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[0, 5:] = 0  # one padded sentence: its pad positions carry no label
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def test_the_round_noise_is_sigma_sqrt_n_over_t_with_one_key():
    """With a fixed flood key the same standard normals Z are drawn in every round, so the pure-noise tensor of
    the round mean times N / sqrt(N / t) is the same sigma Z for every (N, t): exactly the sqrt(N / t) law."""
    config = AegisConfig(preset=Preset.VERIFICATION, exposure=ExposurePolicy.OFF, seed=11)
    sigma = protect(tiny_gpt2(), None, config).public_params()[PURE_NOISE][1]
    scaled = {}
    for n, t in ((1, 1), (4, 4), (4, 2), (16, 4), (64, 2)):
        mean = server_mean(tiny_gpt2(), batch(), n, t, config, micro_loss(4))
        scaled[n, t] = mean[PURE_NOISE] * n / math.sqrt(n / t)
    base = scaled[1, 1]
    for key, z in scaled.items():  # to fp32 rounding of the flood (a factor sqrt(2) off would miss by 40 %)
        assert torch.allclose(z, base, rtol=1e-5, atol=1e-6 * float(base.abs().max())), key
    # sigma Z is N(0, sigma^2) per entry: its mean square within 6 sd (sqrt(2 / n) relative) of sigma^2
    assert abs(float(base.pow(2).mean()) / sigma**2 - 1) <= 6 * math.sqrt(2 / base.numel())
    # a fresh key per round without the seed: a different draw, same law
    fresh = server_mean(tiny_gpt2(), batch(), 4, 2, config.replace(seed=None), micro_loss(4))[PURE_NOISE] * 4
    assert not torch.allclose(fresh / math.sqrt(2), base)


def test_micro_batches_give_the_full_batch_gradient():
    full, parts = tiny_gpt2(), tiny_gpt2()
    full(**batch()).loss.backward()
    micro_loss(4)(parts, batch()).backward()  # the returned leaf adds nothing
    for (name, a), b in zip(full.named_parameters(), parts.parameters()):
        assert torch.allclose(a.grad, b.grad, rtol=1e-4, atol=1e-7), name


def test_sampling_rates_pins_and_grid():
    assert rate(1, 8, 128, 320) == 8 / 320 and rate(16, 8, 128, 320) == 0.4 and rate(10000, 8, 999, 320) == 1.0
    assert (survivors(1, 1.0), survivors(10, 1.0), survivors(10, 0.5), survivors(3, 0.1)) == (1, 10, 5, 2)
    assert Alone().min_survivors == 1
    args = type("A", (), {"clients": [1, 4, 16, 64], "batch": 8, "max_examples": 128, "train_size": 320})()
    points = grid(args)
    undefended = [p.clients for p in points if p.preset == "undefended"]
    assert undefended == [1, 4, 16]  # 16 and 64 share the capped rate: one baseline
    assert len(points) == 3 + 2 * 4 and len({p.key for p in points}) == len(points)


@pytest.fixture(scope="module")
def quick(tmp_path_factory, fast_noise):
    out = tmp_path_factory.mktemp("clients-curve")
    path = clients_curve.main(["--quick", "--cipher", "--out", str(out)])  # --cipher: the fixture's normals
    return json.loads(path.read_text()), path


def test_quick_run_writes_the_curve(quick):
    result, path = quick
    assert path.name == "clients-curve-cpu-tiny.json" and path.with_suffix(".png").stat().st_size > 0
    assert result["complete"] and result["validation"] == 16 and result["train_size"] == 320
    assert result["noise"].startswith("keyed torch.randn")
    rows = {r["key"]: r for r in result["rows"]}
    assert set(rows) == {"undefended N=1", "undefended N=4", *(f"{p} N={n}" for p in ("verification", "sentences")
                                                                for n in (1, 4))}
    for r in rows.values():
        n = r["point"]["clients"]
        assert r["sample_rate"] == min(8 * n, 16) / 320 and r["survivors"] == n
        assert [c[0] for c in r["curve"]] == [0, 1] and r["best"] == r["curve"][1][1] > 0
        base = rows[f"undefended N={n}"]["best"]
        assert r["ratio"] == pytest.approx(r["best"] / base)
        if r["point"]["preset"] == "undefended":
            assert "privacy" not in r
            continue
        run = r["privacy"]["run"]
        assert run["compositions"] == 1 and run["sample_rate"] == r["sample_rate"] and run["delta"] == 1e-5
        assert 0 < run["epsilon"] <= run["epsilon_rdp"] < math.inf
        # no amplification claimed above the exact unsampled composition of the same rounds
        assert run["epsilon"] <= gaussian_epsilon(1 / run["noise_multiplier"], 1e-5) * (1 + 1e-9)
    for preset in ("verification", "sentences"):  # z at the pretrained model is the preset's, not N's
        assert rows[f"{preset} N=1"]["noise_multipliers"][0] == rows[f"{preset} N=4"]["noise_multipliers"][0]
        for n in (1, 4):
            r = rows[f"{preset} N={n}"]
            assert len(r["noise_multipliers"]) == 2 and r["privacy"]["run"]["noise_multiplier"] == min(
                r["noise_multipliers"])
    ratios = [rows[f"verification N={n}"]["ratio"] for n in (1, 4)]
    assert result["n_star"] in (1, 4) if min(ratios) <= 1.1 else result["n_star"] == "not reached up to N = 4"
