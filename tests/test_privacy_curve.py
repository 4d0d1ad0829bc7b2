"""benchmarks/privacy_curve.py: the lambda axis configuration and the figure (the curve itself is a
benchmark run: see the module docstring for the commands)."""
import json

import pytest

import benchmark_scripts
from aegis.config import Preset
from fast_noise import fast_noise  # noqa: F401  (fixture)


@pytest.fixture(scope="module")
def curve():
    return benchmark_scripts.load("privacy_curve")


def test_uniform_floods_rows_and_mlp_at_lam_rho_without_snr_cap(curve):
    config = curve.uniform(2.0, 0.3)
    for role in ("token_embedding", "position_embedding", "lm_head", "head"):
        t = config.treatments[role]
        assert (t.kind, t.lam, t.rho) == ("rows", 2.0, 0.3) and t.snr == float("inf")
    assert (config.treatments["mlp"].kind, config.treatments["mlp"].lam, config.treatments["mlp"].rho) == \
        ("matrix", 2.0, 0.3)
    assert config.treatments["attention"].kind == "frozen"


def test_points_assemble_into_curves_and_a_figure(curve, tmp_path):
    lams, ks = [0.0, 1.0], [1, 4]
    keys = list(curve.plan(lams, ks))
    assert keys == ["rho 0.0 lam 0.0", "rho 0.0 lam 1.0", "rho 0.3 lam 0.0", "rho 0.3 lam 1.0",
                    "verification K=1", "verification K=4", "sentences K=1", "sentences K=4"]
    assert curve.plan(lams, ks)["sentences K=4"][1] == 4
    assert curve.plan(lams, ks)["sentences K=4"][0].preset is Preset.SENTENCES
    points = {key: {a: {"score": i / 10, "null": 0.0} for a in curve.ATTACKS} for i, key in enumerate(keys)}
    budgets = {p.value: p.promise.exposures for p in curve.CURVE_PRESETS}
    result = {"rhos": [0.0, 0.3], "lams": lams, "exposures": ks, "budgets": budgets,
              **curve.curves(points, lams, ks),
              "decoder": "d", "batch_size": 1, "sentences": 1, "label_batches": 1, "candidates": 10, "trials": 2}
    assert result["lam_curves"]["0.3"]["spectral"]["score"] == [0.2, 0.3]
    assert result["exposure_curves"]["sentences"]["fingerprint"]["score"] == [0.6, 0.7]
    path = tmp_path / "curve.png"
    curve.plot(json.loads(json.dumps(result)), path)
    assert path.stat().st_size > 10_000 and path.read_bytes()[:4] == b"\x89PNG"


def test_text_points_are_scored_from_stored_reconstructions(curve):
    """The attacks run where rouge-score may be absent; ROUGE-1 comes later from what they returned."""
    refs = [["my pin is 4471"], ["the cat sat"]]
    point = {name: {"references": refs, "predictions": [["my pin is 4471"], ["a dog ran"]],
                    "null_predictions": [[], ["the cat sat"]]} for name in curve.TEXT_ATTACKS}
    assert curve.score_text({"k": point})
    assert point["dager"]["score"] == pytest.approx(0.5) and point["dager"]["null"] == pytest.approx(0.5)


@pytest.mark.slow  # an encoder and eight masked exports: ~20 s on a quiet core
def test_label_point_is_scored_against_its_own_guesses_chance_level(curve, fast_noise):
    """The label null pairs the attack's guesses with other batches (label_test), not uniform guesses."""
    from types import SimpleNamespace

    from aegis.data import LABELS, load_corpus
    from aegis.models import default_encoder

    model, tok = default_encoder(num_labels=len(LABELS))
    examples = load_corpus("train")
    batches = [[next(e for e in examples[i:] if e.label == label)] for i in (0, 50) for label in LABELS]
    ctx = SimpleNamespace(encoder=model, etok=tok, label_batches=batches)
    point = curve.Curve._labels(ctx, curve.uniform(0.0, 0.3), 1)  # signal, no noise: the attack reads the head
    # 8 batches of one example, two per label: the true pairing scores 1, any other guess/batch pair 1/7
    assert point["score"] == 1.0
    assert point["null"] == pytest.approx(1 / 7)
    assert 0.0 < point["p_value"] <= 0.01
