"""Public calibration, keys and export integrity: each a leak an attacker demonstrated."""
import os
import warnings

import peft
import pytest
import torch

import aegis
import aegis.flood
import aegis_kernels
from aegis.config import FIXED_KEY_ENV, Calibration
from families import build, loss_of

SEED = 7


def _config(**kwargs):
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"AegisConfig\(seed=")
        return aegis.AegisConfig(seed=SEED, allow_outside_promise=True, **kwargs)


def _masked(model, shield, seed):
    model.zero_grad()
    loss_of(model, seed=seed).backward()
    shield.mask_()
    return shield.export()


def test_public_parameters_do_not_depend_on_the_private_batch():
    model = build("gpt2")
    shield = aegis.protect(model, config=_config())
    _masked(model, shield, seed=1)
    first = shield._params.clone()
    _masked(model, shield, seed=2)
    assert torch.equal(shield._params, first)  # same public sigma, clip, thr whatever the batch
    assert (first[:, 1] > 0).all()


def test_batch_calibration_follows_the_batch_and_is_flagged():
    model = build("gpt2")
    shield = aegis.protect(model, config=_config(calibration=Calibration.BATCH))
    assert shield.report().leaks_flood_level
    assert not aegis.protect(build("gpt2"), config=_config()).report().leaks_flood_level
    stds = []
    for seed in (1, 2):
        out = _masked(model, shield, seed)
        stds.append(out["transformer.h.0.mlp.c_fc.weight"].std().item())  # rho 0: sigma * Z
    assert abs(stds[0] - stds[1]) / stds[0] > 1e-3  # the level moves with the batch: the fingerprint


@pytest.mark.parametrize("preset", ["verification", "sentences"])  # signal in rows / in matrix floods
def test_private_signal_is_clipped_to_the_public_bound(preset):
    model = build("gpt2")
    shield = aegis.protect(model, config=_config(preset=preset))
    model.zero_grad()
    (1e4 * loss_of(model, seed=1)).backward()  # a private gradient far above the public scale
    shield.mask_()
    exported = shield.export()
    key = aegis_kernels.derive_key(aegis_kernels.key_from_int(SEED), 0)
    present = [p for p in shield._flooded if p.param.grad is not None]
    offsets = aegis_kernels.stream_offsets([(p.param.numel(), p.param.dtype) for p in present])
    for p, off in zip(present, offsets):
        k = shield._flooded.index(p)
        rho, sigma, clip, _ = shield._params[k].tolist()
        z = aegis_kernels.reference.noise(tuple(p.param.shape), key, off, p.param.dtype)
        signal = exported[p.name] - sigma * z
        if shield._flooded[k].flood_mode == "rows":
            assert torch.linalg.vector_norm(signal, dim=1).max() <= rho * clip * (1 + 1e-4) + 1e-6, p.name
        else:
            assert torch.linalg.vector_norm(signal) <= rho * clip * (1 + 1e-4) + 1e-5, p.name


def test_a_fixed_key_is_refused_outside_tests(monkeypatch):
    monkeypatch.delenv(FIXED_KEY_ENV, raising=False)
    with pytest.raises(ValueError, match=FIXED_KEY_ENV):
        aegis.AegisConfig(seed=3)
    monkeypatch.setenv(FIXED_KEY_ENV, "1")
    with pytest.warns(UserWarning, match="FIXED noise key"):
        aegis.AegisConfig(seed=3)


def test_two_clients_never_share_noise():
    """With a shared key, out1 - out2 = rho (g1 - g2) exactly (rows where both carry signal); fresh keys
    leave the noise in the difference."""
    grads = []
    for _ in range(2):
        model = build("gpt2")
        # two clients, one batch
        config = aegis.AegisConfig(preset="verification", exposure_state=aegis.exposure.IN_MEMORY)
        shield = aegis.protect(model, config=config)
        grads.append(_masked(model, shield, seed=1)["transformer.wte.weight"])
    diff = grads[0] - grads[1]
    assert diff.std() > 0.5 * grads[0].std()  # noise does not cancel


def device_master(shield):
    return aegis.flood.device_state_of(shield._flood)[: aegis_kernels.reference.KEY_WORDS]


def test_device_key_is_redrawn_after_fork(monkeypatch):
    """A forked worker (a new pid) must not reuse the parent's device master key. (A real fork of a
    torch process can deadlock its thread pool, so the child is simulated by its pid.)"""
    import aegis.flood as flood_module

    model = build("gpt2")
    shield = aegis.protect(model, config=aegis.AegisConfig(device_seed=True, preset="verification"))
    _masked(model, shield, seed=1)
    master = device_master(shield).clone()
    _masked(model, shield, seed=2)
    assert torch.equal(device_master(shield), master)  # same process: kept
    parent = os.getpid()
    monkeypatch.setattr(flood_module.os, "getpid", lambda: parent + 1)
    _masked(model, shield, seed=3)
    assert not torch.equal(device_master(shield), master)  # child: redrawn


def test_export_refuses_a_gradient_changed_through_data():
    model = build("gpt2")
    shield = aegis.protect(model, config=_config())
    loss_of(model).backward()
    clean = model.transformer.wte.weight.grad.clone()
    shield.mask_()
    model.transformer.wte.weight.grad.data.copy_(clean)  # no version bump
    with pytest.raises(RuntimeError, match="changed after mask_"):
        shield.export()


def test_masking_twice_is_refused():
    model = build("gpt2")
    shield = aegis.protect(model, config=_config())
    loss_of(model).backward()
    shield.mask_()
    with pytest.raises(RuntimeError, match="twice"):
        shield.mask_()
    shield.ensure_masked()  # the hook's path: a no-op on masked gradients


def test_lora_embedding_factor_does_not_reveal_the_tokens():
    """lora_embedding_A (r x V): the clean gradient is non-zero exactly in the input tokens' columns."""
    model = peft.get_peft_model(build("gpt2"), peft.LoraConfig(r=8, target_modules=["wte"], init_lora_weights=False))
    shield = aegis.protect(model, config=_config(preset="verification"))
    name = next(p.name for p in shield.plans if "lora_embedding_A" in p.name)
    ids = torch.tensor([[11, 17, 23, 29, 35, 41, 47, 53, 59, 65, 71, 3]])
    model(input_ids=ids, labels=ids).loss.backward()
    clean = dict(model.named_parameters())[name].grad.clone()
    tokens = set(ids[0, :-1].tolist())  # the last token carries no loss
    top_clean = set(torch.linalg.vector_norm(clean, dim=0).topk(len(tokens)).indices.tolist())
    assert top_clean == tokens  # undefended: the bag of tokens, exactly
    shield.mask_()
    exported = shield.export()[name]
    top = set(torch.linalg.vector_norm(exported, dim=0).topk(len(tokens)).indices.tolist())
    print("overlap", len(top & tokens))
    assert len(top & tokens) <= 4  # chance: 11 of 96 columns overlap 1.3 on average


def test_no_attribute_path_from_the_shield_reaches_the_device_key():
    """Whoever holds the shield object (vars, __dict__, gc.get_referents) finds no copy of the master key."""
    import gc
    import types

    model = build("gpt2")
    shield = aegis.protect(model, config=aegis.AegisConfig(device_seed=True, preset="verification"))
    _masked(model, shield, seed=1)
    master = device_master(shield).clone()
    assert bool(master.any())
    code_like = (types.FunctionType, types.MethodType, types.ModuleType, type, types.CodeType, types.FrameType,
                 types.BuiltinFunctionType)
    seen, frontier, tensors = {id(shield)}, [shield], 0
    while frontier and len(seen) < 200_000:
        obj = frontier.pop()
        if isinstance(obj, torch.Tensor):
            tensors += 1
            flat = obj.detach().reshape(-1)
            if flat.dtype == master.dtype and flat.numel() >= master.numel():
                windows = flat.unfold(0, master.numel(), 1)
                assert not bool((windows == master).all(dim=1).any()), "the master key is reachable from the shield"
            continue
        for ref_ in gc.get_referents(obj):
            if id(ref_) not in seen and not isinstance(ref_, code_like):
                seen.add(id(ref_))
                frontier.append(ref_)
    assert tensors > 10  # the walk did reach the shield's tensors (parameters, gradients, tables)
