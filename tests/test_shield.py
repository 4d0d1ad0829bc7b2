"""Shield tests on every family: attention frozen and never exported, nothing clean ever leaves."""
import warnings

import peft
import pytest
import torch
import transformers as T
from torch import nn

import aegis
import aegis_kernels
from aegis.policy import rows_view
from families import FAMILIES, VOCAB, build, loss_of

SEED = 2024


def _expected_export(shield, clean: dict[str, torch.Tensor], step: int) -> dict[str, torch.Tensor]:
    """What export() must be: torch.ops.aegis.flood of each clean gradient with the shield's public
    parameters under the step's key (derive_key of the fixed test key)."""
    flooded = [(k, p) for k, p in enumerate(shield._flooded) if p.name in clean]
    offsets = aegis_kernels.stream_offsets([(clean[p.name].numel(), clean[p.name].dtype) for _, p in flooded])
    key = aegis_kernels.derive_key(aegis_kernels.key_from_int(SEED), step)
    out = {}
    for (k, p), off in zip(flooded, offsets):
        rows = shield._flooded[k].flood_mode == "rows"
        g = rows_view(clean[p.name], shield._flooded[k].transposed) if rows else clean[p.name]
        flooded_g = torch.ops.aegis.flood(g, shield._flooded[k].flood_mode, shield._params[k], key, off)[0]
        out[p.name] = (flooded_g.t() if shield._flooded[k].transposed else flooded_g.view_as(clean[p.name]))
    return out


def _config(**kwargs):
    """A fixed-key test config (its warning is expected here, and only here)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="AegisConfig.seed=")
        warnings.filterwarnings("ignore", message=r"AegisConfig\(seed=")
        return aegis.AegisConfig(seed=SEED, **kwargs)


def _clean_grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_export_is_the_flood_of_the_clean_gradient(family):
    model = build(family)
    config = _config()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every parameter of the covered families has a known role
        shield = aegis.protect(model, config=config)
    attention = {p.name for p in shield.plans if p.role == "attention"}
    assert attention, "attention parameters must be detected"
    assert all(not dict(model.named_parameters())[n].requires_grad for n in attention)
    loss_of(model).backward()
    clean = _clean_grads(model)
    assert not attention & clean.keys()  # frozen: no gradient is even computed
    shield.mask_()
    exported = shield.export()
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert exported.keys() == trainable
    expected = _expected_export(shield, clean, step=0)
    assert expected.keys() == exported.keys()
    for name, tensor in exported.items():
        assert torch.equal(tensor, expected[name]), name
        assert not torch.equal(tensor, clean[name]), f"{name} left clean"
    report = shield.report()
    assert [r.name for r in report.rows] == [n for n, _ in model.named_parameters()]
    assert report.count("frozen") == len(attention)
    with_frozen = shield.export(include_frozen=True)
    assert all(torch.equal(with_frozen[n], torch.zeros_like(with_frozen[n])) for n in attention)


@pytest.mark.parametrize("family,tied", [("gpt2", True), ("gpt2-untied", False), ("llama", False), ("gemma", True)])
def test_tied_and_untied_heads(family, tied):
    model = build(family)
    roles = {p.name: p.role for p in aegis.protect(model).plans}
    assert ("lm_head" in roles.values()) is not tied
    assert list(roles.values()).count("token_embedding") == 1


def test_classification_heads_are_heads():
    roles = {p.name: p.role for p in aegis.protect(build("roberta-cls")).plans}
    assert roles["classifier.out_proj.weight"] == "head" and roles["classifier.out_proj.bias"] == "bias"
    roles = {p.name: p.role for p in aegis.protect(build("gpt2-cls")).plans}
    assert roles["score.weight"] == "head"


def test_lora_adapters_inside_attention_are_frozen_and_mlp_adapters_flooded():
    model = peft.get_peft_model(
        build("gpt2"),
        peft.LoraConfig(r=4, target_modules=["c_attn", "c_fc"], fan_in_fan_out=True, init_lora_weights=False),
    )
    shield = aegis.protect(model, config=_config())
    plans = {p.name: p for p in shield.plans}
    attn = [n for n in plans if "lora" in n and ".attn." in n]
    mlp = [n for n in plans if "lora" in n and ".mlp." in n]
    assert attn and mlp
    assert all(plans[n].role == "attention_lora" and not plans[n].trainable for n in attn)
    assert all(plans[n].role == "mlp_lora" and plans[n].flooded for n in mlp)
    loss_of(model).backward()
    clean = _clean_grads(model)
    shield.mask_()
    exported = shield.export()
    assert set(exported) == set(mlp)  # peft froze the base model; only MLP adapters train
    expected = _expected_export(shield, clean, step=0)
    assert all(torch.equal(exported[n], expected[n]) for n in mlp)


def test_unknown_parameters_are_rejected_by_default_or_flooded_when_not_strict():
    model = _with_mystery()
    with pytest.warns(UserWarning, match="mystery"):
        shield = aegis.protect(model, config=_config(strict=False))
    assert {p.name: p.role for p in shield.plans}["mystery"] == "other"
    (loss_of(model) + model.mystery.sum()).backward()
    shield.mask_()
    assert not torch.equal(shield.export()["mystery"], torch.ones(5))
    with pytest.raises(ValueError, match="role_overrides"):
        aegis.protect(_with_mystery(), config=aegis.AegisConfig())  # strict by default: fail closed


def _with_mystery():
    model = build("gpt2")
    model.register_parameter("mystery", nn.Parameter(torch.ones(5)))
    return model


def test_role_override_and_allow_clean_are_explicit():
    model = _with_mystery()
    config = _config(role_overrides={r"^mystery$": "bias"}, allow_clean=(r"transformer\.ln_f\..*",))
    shield = aegis.protect(model, config=config)
    plans = {p.name: p for p in shield.plans}
    assert plans["mystery"].role == "bias"
    assert {r.name for r in shield.report().clean} == {"transformer.ln_f.weight", "transformer.ln_f.bias"}
    loss_of(model).backward()
    clean = _clean_grads(model)
    shield.mask_()
    assert torch.equal(shield.export()["transformer.ln_f.weight"], clean["transformer.ln_f.weight"])


def test_export_fails_closed_until_masked():
    model = build("gpt2")
    shield = aegis.protect(model, config=_config())
    loss_of(model).backward()
    with pytest.raises(RuntimeError, match="mask_"):
        shield.export()
    shield.mask_()
    shield.export()
    loss_of(model, seed=1).backward()  # accumulates new clean signal into the masked grads
    with pytest.raises(RuntimeError, match="not masked"):
        shield.export()


def test_optimizer_hook_masks_once_and_drops_frozen_params():
    model = build("gpt2")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    shield = aegis.protect(model, optimizer, _config())
    in_optimizer = {id(p) for g in optimizer.param_groups for p in g["params"]}
    assert all(id(p.param) not in in_optimizer for p in shield.plans if p.role == "attention")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    loss_of(model).backward()
    clean = _clean_grads(model)
    shield.mask_()  # manual mask, then step: the hook must not flood twice
    optimizer.step()
    expected = _expected_export(shield, clean, step=0)
    exported = shield.export()
    assert all(torch.equal(exported[n], expected[n]) for n in expected)
    for p in shield.plans:
        moved = not torch.equal(before[p.name], p.param.detach())
        assert moved == p.flooded, p.name
    optimizer.zero_grad()
    loss_of(model, seed=1).backward()
    clean = _clean_grads(model)
    optimizer.step()  # the hook masks this time
    expected = _expected_export(shield, clean, step=1)
    assert all(torch.equal(shield.export()[n], expected[n]) for n in expected)


def test_fresh_secret_seed_each_step():
    model = build("gpt2")
    shield = aegis.protect(model, config=aegis.AegisConfig(preset="paper"))
    outs = []
    for k in range(2):
        model.zero_grad()
        loss_of(model, seed=k).backward()
        shield.mask_()
        outs.append(shield.export()["transformer.h.0.mlp.c_fc.weight"])  # rho = 0: pure noise
    assert not torch.equal(outs[0], outs[1])


def test_trainer_callback_masks_before_each_step(tmp_path):
    model = build("gpt2")
    shield = aegis.protect(model, config=_config())
    attn = model.transformer.h[0].attn.c_attn.weight.detach().clone()
    ids = torch.randint(3, VOCAB, (4, 8), generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": row, "labels": row} for row in ids]
    args = T.TrainingArguments(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=2, report_to=[],
                               use_cpu=True, save_strategy="no", logging_strategy="no")
    trainer = T.Trainer(model=model, args=args, train_dataset=data, callbacks=[shield.trainer_callback()])
    trainer.train()
    assert shield._flood.step == 2
    assert torch.equal(model.transformer.h[0].attn.c_attn.weight, attn)


@pytest.mark.parametrize(
    "make,error,match",
    [
        (lambda: aegis.protect(nn.Module()), ValueError, "no parameters"),
        (lambda: aegis.AegisConfig(preset="papr"), ValueError, "paper"),
        (lambda: aegis.AegisConfig(overrides={"mlps": aegis.Treatment("matrix")}), ValueError, "roles"),
        (lambda: aegis.Treatment("noise"), ValueError, "'rows'"),
        (lambda: aegis.AegisConfig(seed=-1), ValueError, "seed"),
        (lambda: aegis.AegisConfig(refresh_every=0), ValueError, "refresh_every"),
        (lambda: aegis.AegisConfig(calibration="private"), ValueError, "private"),
    ],
)
def test_bad_configuration_names_the_fix(make, error, match):
    with pytest.raises(error, match=match):
        make()


def test_sparse_gradient_is_rejected_with_the_fix():
    model = nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Linear(4, 2))
    shield = aegis.protect(
        model, config=aegis.AegisConfig(role_overrides={r"^0\.": "token_embedding", r"^1\.": "head"})
    )
    model(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(ValueError, match="sparse=False"):
        shield.mask_()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_default_decoder_export_on_cuda_is_the_flood_of_the_clean_gradient():
    """The grouped CUDA flood of the default decoder, whose vocabulary bias is a rows flood of V rows of
    width 1, equals the per-tensor flood of each clean gradient."""
    from aegis.models import default_decoder

    model = default_decoder()[0].cuda()
    shield = aegis.protect(model, config=_config())
    ids = torch.randint(3, 30522, (2, 9), generator=torch.Generator().manual_seed(0)).cuda()
    model(input_ids=ids, labels=ids).loss.backward()
    clean = _clean_grads(model)
    assert clean["cls.predictions.bias"].dim() == 1 and shield._flooded[-1].flood_mode == "rows"
    shield.mask_()
    expected = _expected_export(shield, clean, step=0)
    for name, tensor in shield.export().items():
        assert torch.equal(tensor, expected[name]), name
