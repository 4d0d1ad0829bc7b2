"""Steps that would poison the model or leak around the flood: non-finite gradients, a second shield, a
mask with no backward, parameters the backward did not reach, whole-name allow_clean, captured graphs."""
import warnings

import pytest
import torch

import aegis
from aegis import ExposurePolicy, NonFinite
from aegis.exposure import IN_MEMORY
from families import build, loss_of

pytestmark = pytest.mark.filterwarnings(r"ignore:AegisConfig\(seed=")


def _config(**kw):
    return aegis.AegisConfig(**{"seed": 3, "exposure_state": IN_MEMORY, **kw})


def _setup(family="gpt2", **kw):
    model = build(family)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    return model, opt, aegis.protect(model, opt, _config(**kw))


def _weights(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


# -- non-finite gradients -----------------------------------------------------------------------------
@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("where", ["transformer.wte.weight", "transformer.h.0.mlp.c_fc.weight",
                                   "transformer.ln_f.bias"])
def test_a_non_finite_gradient_skips_the_step(value, where):
    model, opt, shield = _setup(non_finite=NonFinite.SKIP)
    before = _weights(model)
    loss_of(model).backward()
    dict(model.named_parameters())[where].grad.view(-1)[3] = value
    with pytest.warns(UserWarning, match=f"skipped this step: non-finite gradient in {where}"):
        opt.step()  # the optimizer hook masks
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())  # weight decay did not run either
    with pytest.raises(RuntimeError, match=f"skipped.*{where}"):
        shield.export()
    assert shield.report().skipped_steps == 1
    opt.step()  # nothing since: still a no-op
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    with pytest.raises(RuntimeError, match="no gradient since the last step"):
        shield.mask_()
    # the next finite step goes through
    opt.zero_grad()
    loss_of(model, seed=1).backward()
    opt.step()
    assert all(t.isfinite().all() for t in shield.export().values())
    assert any(not torch.equal(p, before[n]) for n, p in model.named_parameters())


@pytest.mark.parametrize("where", ["transformer.wte.weight", "transformer.h.0.mlp.c_fc.weight",
                                   "transformer.ln_f.bias"])
def test_by_default_a_non_finite_gradient_is_refused_at_export_and_mask_does_not_skip(where):
    """NonFinite.STEP: mask_() does not wait for the device; export() refuses, naming the tensor and the option."""
    model, opt, shield = _setup()
    loss_of(model).backward()
    dict(model.named_parameters())[where].grad.view(-1)[3] = float("nan")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        shield.mask_()
    assert shield.is_masked
    with pytest.raises(RuntimeError, match=f"non-finite gradient in {where}.*NonFinite.SKIP"):
        shield.export()
    assert shield.report().skipped_steps == 0
    opt.step()  # as without AEGIS: the optimizer steps on it
    assert not bool(torch.isfinite(dict(model.named_parameters())[where]).all())
    with pytest.raises(ValueError, match="non_finite='sometimes'"):
        aegis.AegisConfig(non_finite="sometimes")


def test_grad_scaler_skips_inf_steps_before_the_shield_and_masks_unscaled_gradients():
    model, opt, shield = _setup()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    before = _weights(model)
    scaler.scale(loss_of(model)).backward()
    model.transformer.wte.weight.grad[4, 1] = float("inf")
    scaler.step(opt)  # found inf: optimizer.step() (and with it the shield's hook) never runs
    scaler.update()
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    with pytest.raises(RuntimeError, match="not masked"):
        shield.export()
    opt.zero_grad()
    scaler.scale(loss_of(model, seed=1)).backward()
    scaler.step(opt)  # unscales, then optimizer.step() -> the hook masks the unscaled gradients
    scaler.update()
    exported = shield.export()
    clip = dict(shield.public_params())["transformer.h.0.mlp.c_fc.weight"][2]
    assert exported["transformer.h.0.mlp.c_fc.weight"].norm() < 1e3 * clip  # not 2**10 x scaled
    assert shield.report().skipped_steps == 0


# -- one shield per model -----------------------------------------------------------------------------
def test_a_second_protect_is_refused_until_the_first_is_removed():
    model, opt, shield = _setup()
    with pytest.raises(ValueError, match="already protected by .*Shield.*remove"):
        aegis.protect(model, config=_config())
    with pytest.raises(ValueError, match="already protected"):
        aegis.protect(model.transformer.h[0], config=_config(strict=False))  # a part of it
    other = build("gpt2")
    with pytest.raises(ValueError, match="optimizer is already protected"):
        aegis.protect(other, opt, _config())
    shield.remove()
    again = aegis.protect(model, opt, _config())
    loss_of(model).backward()
    opt.step()
    assert again.export()


def test_a_shield_nobody_holds_frees_the_model_and_its_hooks():
    model = build("gpt2")
    shield = aegis.protect(model, config=_config())  # no optimizer: only the caller holds it
    hooks = len(model._forward_pre_hooks)
    with pytest.raises(ValueError, match="already protected"):
        aegis.protect(model, config=_config())
    del shield
    again = aegis.protect(model, config=_config())
    assert len(model._forward_pre_hooks) == hooks  # the first shield's hooks went with it
    loss_of(model).backward()
    again.mask_()
    assert again.export()


def test_a_copy_of_a_protected_model_may_be_protected():
    import copy

    model, _, _ = _setup()
    twin = copy.deepcopy(model)
    assert aegis.protect(twin, config=_config()).plans


# -- no backward, no export ---------------------------------------------------------------------------
def test_mask_without_a_backward_is_refused():
    model, opt, shield = _setup()
    with pytest.raises(RuntimeError, match="no gradient since the last step"):
        shield.mask_()
    with pytest.raises(RuntimeError, match="no gradient since the last step"):
        opt.step()
    loss_of(model).backward()
    opt.step()
    opt.zero_grad(set_to_none=False)  # zeros in place, no backward
    with pytest.raises(RuntimeError, match="no gradient since the last step"):
        shield.mask_()


def test_a_shield_with_nothing_flooded_masks_every_step():
    """Attention and MLP frozen, the rest exported clean by name: each step's mask_() and export() follow
    its own backward (not "called twice" from the second step on)."""
    model = build("gpt2")
    clean = tuple(n for n, _ in model.named_parameters())  # whatever the treatments leave trainable
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    shield = aegis.protect(model, opt, _config(preset=dict.fromkeys(aegis.config.ROLES, aegis.config.FROZEN)
                                               | {r: aegis.Treatment("rows") for r in ("token_embedding",
                                                                                      "position_embedding")}
                                               | {r: aegis.Treatment("matrix") for r in ("norm", "bias")},
                                               allow_clean=clean))
    for seed in range(3):
        opt.zero_grad()
        loss_of(model, seed=seed).backward()
        want = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
        shield.mask_()
        got = shield.export()
        assert set(got) == set(want) and all(torch.equal(got[n], want[n]) for n in want)
        opt.step()
    assert not any(n.endswith(".weight") and (".mlp." in n or ".attn." in n) for n in got)  # frozen
    with pytest.raises(RuntimeError, match="called twice"):
        shield.mask_()


# -- a parameter the backward did not reach -----------------------------------------------------------
def test_a_flooded_parameter_without_gradient_is_flooded_as_zero():
    """A per-expert module the batch did not route to must not be exported as exact zeros."""
    model, _, shield = _setup(exposure=ExposurePolicy.OFF)
    loss_of(model).backward()
    expert = model.transformer.h[0].mlp.c_proj.weight
    expert.grad = None
    shield.mask_()
    out = shield.export()["transformer.h.0.mlp.c_proj.weight"]
    assert expert.grad is not None and torch.equal(out, expert.grad)
    assert (out != 0).float().mean() > 0.99
    zero = torch.zeros_like(out)
    rho, sigma = shield.public_params()["transformer.h.0.mlp.c_proj.weight"][:2]
    assert abs(out.std().item() - sigma) < 6 * sigma / (2 * out.numel()) ** 0.5  # pure noise at the public sigma
    assert not torch.equal(out, zero)


# -- allow_clean --------------------------------------------------------------------------------------
def test_allow_clean_matches_whole_names_and_vocabulary_parameters_only_by_exact_name():
    model = build("bert-causal")
    vocab_bias = next(n for n, p in model.named_parameters() if p.dim() == 1 and p.numel() == model.config.vocab_size)
    shield = aegis.protect(model, config=_config(allow_clean=("bias",)))  # a word, not a name: cleans nothing
    assert shield.report().clean == []
    shield.remove()
    with pytest.raises(ValueError, match=f"match {vocab_bias}.*exact name"):
        aegis.protect(build("bert-causal"), config=_config(allow_clean=(r".*bias",)))
    with pytest.warns(UserWarning, match=f"exports {vocab_bias} .* unflooded"):
        shield = aegis.protect(build("bert-causal"), config=_config(allow_clean=(vocab_bias,)))
    assert [r.name for r in shield.report().clean] == [vocab_bias]
    config = aegis.AegisConfig(exposure_state=IN_MEMORY, allow_clean=(r"bert\.encoder\..*LayerNorm\..*",))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        shield = aegis.protect(build("bert-causal"), config=config)
    assert shield.report().clean and all("LayerNorm" in r.name for r in shield.report().clean)


# -- captured graphs ----------------------------------------------------------------------------------
def test_capture_without_device_seed_is_refused(monkeypatch):
    """A graph captured around mask_() with a host key replays that key: the CPU side of the check."""
    model, _, shield = _setup(exposure=ExposurePolicy.OFF)
    loss_of(model).backward()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match=r"device_seed=True"):
        shield.mask_()
    model2, _, tracked = _setup()
    loss_of(model2).backward()
    with pytest.raises(RuntimeError, match=r"device_seed=True.*ExposurePolicy.OFF"):
        tracked.mask_()


gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _tiny_gpu(**kw):
    model = build("gpt2").cuda()
    ids = torch.randint(3, 90, (2, 9), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    return model, ids


@pytest.mark.gpu
@gpu
def test_gpu_capture_without_device_seed_raises_and_with_it_every_replay_differs():
    model, ids = _tiny_gpu()
    shield = aegis.protect(model, config=aegis.AegisConfig(exposure=ExposurePolicy.OFF))
    model(input_ids=ids, labels=ids).loss.backward()
    with pytest.raises(RuntimeError, match="device_seed=True"):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            shield.mask_()
    shield.remove()
    model, ids = _tiny_gpu()
    shield = aegis.protect(model, config=aegis.AegisConfig(exposure=ExposurePolicy.OFF, device_seed=True))
    model(input_ids=ids, labels=ids).loss.backward()
    params = [p for p in model.parameters() if p.grad is not None]
    clean = [p.grad.clone() for p in params]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        shield.mask_()  # warm-up
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    model(input_ids=ids, labels=ids).loss.backward()  # a gradient for the capture's mask_()
    with torch.cuda.graph(graph):
        for p, c in zip(params, clean):
            p.grad.copy_(c)
        shield.mask_()
    exports = []
    for _ in range(3):
        graph.replay()
        exports.append(torch.cat([p.grad.flatten() for p in params]).clone())
    assert all(not torch.equal(exports[i], exports[j]) for i in range(3) for j in range(i))
    # the difference of two exports is noise, not zero
    assert (exports[0] - exports[1]).abs().max() > 0


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("where", ["transformer.wte.weight", "transformer.h.0.mlp.c_fc.weight"])
def test_gpu_a_non_finite_gradient_skips_the_step(where):
    model, ids = _tiny_gpu()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    shield = aegis.protect(model, opt, aegis.AegisConfig(exposure=ExposurePolicy.OFF, non_finite=NonFinite.SKIP))
    before = _weights(model)
    model(input_ids=ids, labels=ids).loss.backward()
    dict(model.named_parameters())[where].grad.view(-1)[7] = float("nan")
    with pytest.warns(UserWarning, match=where):
        opt.step()
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert shield.report().skipped_steps == 1
