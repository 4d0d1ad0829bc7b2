"""Exposure budget: one example may leave the client at most ``exposure_budget`` times (noise averages as sqrt(K))."""
import pytest
import torch

import aegis
from aegis import ExposurePolicy
from aegis.config import PROMISES, Preset
from families import build

pytestmark = pytest.mark.filterwarnings(r"ignore:AegisConfig\(seed=")

SENTENCE = torch.tensor([[5, 9, 17, 33, 4]])


def step(model, shield, ids, pad_left=0, pad_right=0):
    """One client step on ``ids`` (padded with the pad id 0), masked; returns the export."""
    ids = torch.nn.functional.pad(ids, (pad_left, pad_right), value=0)
    model.zero_grad(set_to_none=True)
    model(input_ids=ids, labels=ids).loss.backward()
    shield.mask_()
    return shield.export()


def rescale(model, scale):
    """A different model (so a different gradient) with the same layout."""
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.mul_(scale)


def protected(budget=2, policy=ExposurePolicy.REFUSE, **kw):
    model = build("gpt2")
    return model, aegis.protect(model, config=aegis.AegisConfig(seed=3, exposure_budget=budget, exposure=policy, **kw))


def test_refuses_past_the_budget_and_exports_nothing():
    model, shield = protected(budget=2)
    step(model, shield, SENTENCE)
    step(model, shield, SENTENCE, pad_right=3)  # the same example padded differently
    with pytest.raises(RuntimeError, match=r"exposure budget.*exposure_budget=K.*ExposurePolicy.SILENCE"):
        step(model, shield, SENTENCE, pad_left=2)
    assert not shield.is_masked
    with pytest.raises(RuntimeError, match="not masked"):
        shield.export()
    assert shield.report().max_exposure == 2


def test_fresh_examples_and_calibration_forwards_do_not_count():
    """refresh_every=1: the public calibration runs a forward on every step; it is not the client's example."""
    model, shield = protected(budget=1, refresh_every=1)
    for k in range(4):
        step(model, shield, SENTENCE + k)
    assert shield.report().max_exposure == 1


def test_a_step_dropped_after_its_backward_stays_counted():
    """The decision is taken at the backward's first gradient: a step whose gradients are then dropped without
    an export (a GradScaler's skipped fp16 step) has reserved its text, counted on the safe side."""
    model, shield = protected(budget=1)
    other = torch.tensor([[7, 7, 8, 60]])
    model.zero_grad(set_to_none=True)
    model(input_ids=other, labels=other).loss.backward()
    model.zero_grad(set_to_none=True)  # thrown away before mask_()
    step(model, shield, SENTENCE)  # the drop made way for a fresh step
    with pytest.raises(RuntimeError, match="exposure budget"):
        step(model, shield, other)


def test_silence_exports_pure_noise_that_does_not_depend_on_the_batch():
    """Past the budget, SILENCE floods with rho = 0: two different gradients give the same export."""
    exports = []
    for scale in (1.0, 3.0):
        model, shield = protected(budget=1, policy=ExposurePolicy.SILENCE)
        step(model, shield, SENTENCE)
        rescale(model, scale)
        exports.append(step(model, shield, SENTENCE))
    assert exports[0].keys() == exports[1].keys()
    assert all(torch.equal(exports[0][k], exports[1][k]) for k in exports[0])
    # within the budget the same change does show: the flood carried the signal
    first = []
    for scale in (1.0, 3.0):
        model, shield = protected(budget=1, policy=ExposurePolicy.SILENCE)
        rescale(model, scale)
        first.append(step(model, shield, SENTENCE))
    assert any(not torch.equal(first[0][k], first[1][k]) for k in first[0])


def test_off_does_not_track_and_says_so():
    model, shield = protected(budget=1, policy=ExposurePolicy.OFF)
    for _ in range(3):
        step(model, shield, SENTENCE)
    report = shield.report()
    assert report.exposure is ExposurePolicy.OFF and report.max_exposure == 0


def test_budget_defaults_and_validation():
    for preset in Preset:
        assert aegis.AegisConfig(preset=preset).exposures == PROMISES[preset].exposures
    custom = dict(aegis.PRESETS[Preset.VERIFICATION])
    assert aegis.AegisConfig(preset=custom).exposures == 1
    assert aegis.AegisConfig(exposure_budget=9).exposures == 9
    with pytest.raises(ValueError, match="exposure_budget=0"):
        aegis.AegisConfig(exposure_budget=0)
    with pytest.raises(ValueError):
        aegis.AegisConfig(exposure="sometimes")


def test_a_model_without_token_ids_must_opt_out():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    config = aegis.AegisConfig(role_overrides={".*": "mlp"})
    with pytest.raises(ValueError, match="ExposurePolicy.OFF"):
        aegis.protect(model, config=config)
    aegis.protect(model, config=config.replace(exposure=ExposurePolicy.OFF))
