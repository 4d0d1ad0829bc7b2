"""The exposure decision taken at a backward's first gradient: ``mask_()`` finds it taken, and a step decided in
parts (gradient accumulation) counts its text once."""
import pytest
import torch

import aegis
from aegis import AegisConfig, ExposurePolicy
from families import build

pytestmark = pytest.mark.filterwarnings(r"ignore:AegisConfig\(seed=")

A = torch.tensor([[5, 9, 17, 33, 4]])
B = torch.tensor([[41, 42, 43, 44, 45]])


def protected(budget=1, **kw):
    model = build("gpt2")
    return model, aegis.protect(model, config=AegisConfig(seed=3, exposure_budget=budget, **kw))


def backward(model, ids):
    model(input_ids=ids, labels=ids).loss.backward()


def refused(model, shield, ids) -> bool:
    """A fresh step on ``ids``: True when the budget refuses it (its gradients are then dropped)."""
    model.zero_grad(set_to_none=True)
    backward(model, ids)
    try:
        shield.mask_()
    except RuntimeError as err:
        assert "exposure budget" in str(err)
        model.zero_grad(set_to_none=True)
        return True
    shield.export()
    return False


def test_the_decision_is_taken_at_the_backward_and_counted_once():
    model, shield = protected()
    backward(model, A)
    assert shield.report().max_exposure == 1  # reserved before mask_()
    shield.mask_()
    shield.export()
    assert shield.report().max_exposure == 1
    assert refused(model, shield, A)


def test_accumulated_micro_batches_count_shared_text_once():
    """Each micro-batch is decided at its own backward; the second repeats A, which the step counted already."""
    model, shield = protected(budget=1, allow_outside_promise=True)
    backward(model, A)
    backward(model, torch.cat([A, B]))
    shield.mask_()
    shield.export()
    assert shield.report().max_exposure == 1
    assert refused(model, shield, A) and refused(model, shield, B)


def test_a_micro_batch_past_the_budget_refuses_the_step_and_its_retry():
    model, shield = protected(budget=1)
    assert not refused(model, shield, B)
    model.zero_grad(set_to_none=True)
    backward(model, A)  # decided and reserved at this backward
    backward(model, B)  # past the budget
    for _ in range(2):  # the retry is refused again
        with pytest.raises(RuntimeError, match="1 example"):
            shield.mask_()
    assert not shield.is_masked
    model.zero_grad(set_to_none=True)
    assert refused(model, shield, A)  # the first micro-batch stayed counted: the safe side


def test_silenced_accumulation_exports_pure_noise():
    model, shield = protected(budget=1, exposure=ExposurePolicy.SILENCE)
    assert not refused(model, shield, B)
    model.zero_grad(set_to_none=True)
    backward(model, A)
    backward(model, B)
    shield.mask_()  # B is past the budget: the whole step is pure noise
    shield.export()
    assert shield.silenced_steps == 1
    assert refused(model, shield, A) is False and shield.silenced_steps == 2  # A stayed counted: silenced


def test_a_batch_outside_the_promise_is_not_decided_early():
    """mask_() refuses it before any decision: nothing of it is counted."""
    model, shield = protected(preset="sentences")
    four = torch.cat([A, B, A + 1, B + 1])
    backward(model, four)
    assert shield.report().max_exposure == 0
    with pytest.raises(ValueError, match="allow_outside_promise"):
        shield.mask_()
    assert shield.report().max_exposure == 0
