"""Role detection: no covered family falls to the weak 'other' flood; vocabulary vectors; LoRA on embeddings;
strict errors."""
import re
import warnings

import peft
import pytest
import torch
from torch import nn

import aegis
from aegis.config import ROLES, SENTENCES_SNR, VERIFICATION, AegisConfig
from aegis.models import default_decoder
from aegis.policy import LORA_EMBEDDING_ROLE, plan, rows_view
from families import POLICY_FAMILIES, VOCAB, build

# The parameters an attacker found in 'other', and their roles now.
EXPECTED = {
    "albert-mlm": {
        "albert.encoder.albert_layer_groups.0.albert_layers.0.ffn.weight": "mlp",
        "albert.encoder.albert_layer_groups.0.albert_layers.0.ffn_output.weight": "mlp",
        "albert.encoder.embedding_hidden_mapping_in.weight": "mlp",
        "predictions.dense.weight": "mlp",
    },
    "albert-pretraining": {"sop_classifier.classifier.weight": "head", "albert.pooler.weight": "mlp"},
    "electra-discriminator": {
        "electra.embeddings_project.weight": "mlp",
        "discriminator_predictions.dense.weight": "mlp",
        "discriminator_predictions.dense_prediction.weight": "head",
    },
    "electra-generator": {"electra.embeddings_project.weight": "mlp", "generator_predictions.dense.weight": "mlp"},
    "electra-cls": {
        "electra.embeddings_project.weight": "mlp",
        "classifier.dense.weight": "mlp",  # a hidden transform of the head
        "classifier.out_proj.weight": "head",  # rows indexed by label
    },
    "distilbert-cls": {"pre_classifier.weight": "mlp", "pre_classifier.bias": "bias", "classifier.weight": "head"},
    "bert-cls": {"bert.pooler.dense.weight": "mlp", "classifier.weight": "head"},
    "distilbert-mlm": {"vocab_transform.weight": "mlp"},
    "bert-mlm": {"cls.predictions.transform.dense.weight": "mlp"},
    "roberta-mlm": {"lm_head.dense.weight": "mlp"},
    "opt-projected": {"model.decoder.project_in.weight": "mlp", "model.decoder.project_out.weight": "mlp"},
    "t5-gated": {
        "encoder.block.0.layer.1.DenseReluDense.wi_0.weight": "mlp",
        "encoder.block.0.layer.1.DenseReluDense.wi_1.weight": "mlp",
        "decoder.block.0.layer.2.DenseReluDense.wo.weight": "mlp",
    },
}
# Enough roles for the LoRA-embedding role until config.ROLES / the presets carry it.
_WITH_LORA_ROLE = AegisConfig(
    preset={**VERIFICATION, LORA_EMBEDDING_ROLE: VERIFICATION["token_embedding"]}, strict=True
)


@pytest.mark.parametrize("family", sorted(POLICY_FAMILIES))
def test_no_trainable_parameter_of_a_covered_family_is_other(family):
    model = build(family)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plans = plan(model, AegisConfig(strict=True))
    roles = {p.name: p.role for p in plans}
    assert not [n for n, p in model.named_parameters() if p.requires_grad and roles[n] == "other"]
    assert "attention" in roles.values()
    assert list(roles.values()).count("token_embedding") == 1
    for name, role in EXPECTED.get(family, {}).items():
        assert roles[name] == role, name
    for p in plans:  # only tables indexed by token or label ids (and vocabulary vectors) flood along an axis
        indexed = p.role in ("token_embedding", "position_embedding", "lm_head", "head") and p.param.dim() == 2
        assert p.rows_axis == (0 if indexed or (p.role == "lm_head" and p.param.dim() == 1) else None), p.name
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    bias = getattr(head, "bias", None)
    for name, param in model.named_parameters():  # an output bias is indexed by token id: never 'bias'
        if param is bias:
            assert roles[name] == "lm_head", name


def test_the_default_decoder_roles_and_what_each_preset_trains():
    model, _ = default_decoder()
    plans = {p.name: p for p in plan(model, AegisConfig(preset="verification"))}
    roles = {n: p.role for n, p in plans.items()}
    rows = {
        "bert.embeddings.word_embeddings.weight": "token_embedding",
        "bert.embeddings.position_embeddings.weight": "position_embedding",
        "bert.embeddings.token_type_embeddings.weight": "position_embedding",  # embedding rows of type ids
        "cls.predictions.bias": "lm_head",  # the tied head's vocabulary bias
    }
    for name, role in rows.items():
        assert roles[name] == role and plans[name].rows_axis == 0, name
        assert plans[name].treatment == VERIFICATION[role] and plans[name].treatment.kind == "rows"
    for name, role in roles.items():
        if name in rows:
            continue
        block = re.match(r"bert\.(?:embeddings|encoder\.layer\.\d+)\.(.+)\.(weight|bias)$", name)
        assert block, name
        module, leaf = block.groups()
        if module.startswith("attention.self.") or module == "attention.output.dense":
            expected = "attention"
        elif module.endswith("LayerNorm"):
            expected = "norm"
        else:
            assert module in ("intermediate.dense", "output.dense"), name
            expected = "mlp" if leaf == "weight" else "bias"
        assert role == expected, name
    assert sum(r == "attention" for r in roles.values()) == 6 * 8
    # reconstruction: every vocabulary- or position-indexed table is frozen (no rows flood: the bag of words stays
    # in), the MLP, norms and biases are matrix floods at its snr
    trains = {r.name: r for r in aegis.protect(model, config=AegisConfig(preset="sentences")).report().rows}
    assert all(trains[name].action == "frozen" for name in rows)
    assert not [r for r in trains.values() if r.action == "rows flood"]
    matrix = {r.role for r in trains.values() if r.action == "matrix flood"}
    assert matrix == {"mlp", "norm", "bias"}
    assert {r.snr_cap for r in trains.values() if r.action == "matrix flood"} == {SENTENCES_SNR}


def test_a_vocabulary_bias_carries_the_bag_of_next_tokens_and_is_flooded_along_it():
    model = build("bert-causal")
    (bias,) = [p for p in plan(model, AegisConfig()) if p.role == "lm_head" and p.param.dim() == 1]
    ids = torch.tensor([[5, 17, 40, 17, 63, 9]])
    model(input_ids=ids, labels=ids).loss.backward()
    # d loss / d b_v = mean_t (softmax_tv - [y_t = v]): negative exactly at the next tokens
    assert set((bias.param.grad < 0).nonzero().flatten().tolist()) == set(ids[0, 1:].tolist())
    view = rows_view(bias.param.grad)
    assert view.shape == (VOCAB, 1) and view.data_ptr() == bias.param.grad.data_ptr()  # one row per id, in place
    assert rows_view(torch.zeros(3, 5), transposed=True).shape == (5, 3)


def _lora(family, targets, **kw):
    base = build(family)
    return peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules=targets, init_lora_weights=False, **kw))


def _trainable(plans):
    return {p.name: p for p in plans if p.trainable}


@pytest.mark.parametrize("family,target", [("llama", "embed_tokens"), ("bert-cls", "word_embeddings"), ("gpt2", "wte")])
def test_lora_on_the_embedding_floods_along_the_token_axis(family, target):
    model = _lora(family, [target])
    plans = _trainable(plan(model, _WITH_LORA_ROLE))
    (a,) = [p for n, p in plans.items() if ".lora_embedding_A." in n]
    (b,) = [p for n, p in plans.items() if ".lora_embedding_B." in n]
    assert a.role == b.role == LORA_EMBEDDING_ROLE
    assert a.param.shape == (4, VOCAB) and a.rows_axis == 1  # (r x V): columns are per token
    assert b.rows_axis is None  # (d x r): dense factor, matrix flood at the embedding's strength
    assert a.treatment == b.treatment == VERIFICATION["token_embedding"]
    # The leak rows_axis answers: A's gradient is non-zero exactly in the input tokens' columns.
    ids = torch.tensor([[5, 17, 17, 40, 63, 9, 88]])
    if "ForSequenceClassification" in type(model.base_model.model).__name__:
        model(input_ids=ids, labels=torch.tensor([1])).loss.backward()
    else:
        model(input_ids=ids, labels=ids).loss.backward()
    hot = set(a.param.grad.norm(dim=1 - a.rows_axis).nonzero().flatten().tolist())
    assert set(ids[0, :-1].tolist()) <= hot <= set(ids[0].tolist())  # a causal LM's last token has no loss
    assert (b.param.grad != 0).all()


def test_lora_on_the_output_embedding_and_trainable_tokens():
    plans = _trainable(plan(_lora("llama", ["lm_head", "down_proj"]), _WITH_LORA_ROLE))
    head_a = next(p for n, p in plans.items() if n.endswith("lm_head.lora_A.default.weight"))
    head_b = next(p for n, p in plans.items() if n.endswith("lm_head.lora_B.default.weight"))
    assert head_a.role == head_b.role == LORA_EMBEDDING_ROLE
    assert head_b.param.shape == (VOCAB, 4) and head_b.rows_axis == 0 and head_a.rows_axis is None
    assert {p.role for n, p in plans.items() if ".mlp." in n} == {"mlp_lora"}
    model = peft.get_peft_model(
        build("llama"), peft.LoraConfig(r=4, target_modules=["down_proj"], trainable_token_indices=[5, 6])
    )
    (delta,) = [p for n, p in _trainable(plan(model, _WITH_LORA_ROLE)).items() if "trainable_tokens_delta" in n]
    assert delta.role == LORA_EMBEDDING_ROLE and delta.param.shape == (2, 32) and delta.rows_axis == 0


def test_dora_magnitudes_are_norms_and_attention_adapters_stay_attention():
    model = _lora("llama", ["embed_tokens", "up_proj", "q_proj"], use_dora=True)
    roles = {n: p.role for n, p in _trainable(plan(model, _WITH_LORA_ROLE)).items()}
    magnitudes = {n: r for n, r in roles.items() if "lora_magnitude_vector" in n}
    assert {n.split(".")[-5]: r for n, r in magnitudes.items()} == {
        "model": "norm",
        "mlp": "norm",
        "self_attn": "attention",
    }
    assert "other" not in roles.values()


def test_the_new_role_without_a_treatment_names_the_fix():
    model = _lora("llama", ["embed_tokens"])
    without = {k: v for k, v in VERIFICATION.items() if k != LORA_EMBEDDING_ROLE}
    with pytest.raises(ValueError, match=LORA_EMBEDDING_ROLE):
        plan(model, AegisConfig(preset=without, strict=True))


def _with_mystery():
    model = build("gpt2")
    model.register_parameter("mystery", nn.Parameter(torch.ones(5)))
    model.transformer.h[0].add_module("gizmo", nn.Linear(4, 4, bias=False))
    return model


def test_strict_error_names_parameters_classes_and_fix():
    with pytest.raises(ValueError) as info:
        plan(_with_mystery(), AegisConfig(strict=True))
    message = str(info.value)
    assert "'mystery' (GPT2LMHeadModel)" in message
    assert "'transformer.h.0.gizmo.weight' (Linear in GPT2Block)" in message
    assert "AegisConfig(role_overrides={regex: role})" in message and "strict=False" in message
    listed = re.search(r"with role one of (.+?); or", message).group(1)
    assert listed == ", ".join(f"'{r}'" for r in ROLES if r != "other")
    assert "lam 4.0, rho 0.0" in message  # what strict=False would accept
    # The example override in the message is a working fix for the first parameter it names.
    example = re.search(r'role_overrides=\{r"(.+?)": "mlp"\}', message).group(1)
    assert example == "^mystery$"
    fixed = AegisConfig(strict=True, role_overrides={example: "bias", r"\.gizmo\.": "mlp"})
    roles = {p.name: p.role for p in plan(_with_mystery(), fixed)}
    assert roles["mystery"] == "bias" and roles["transformer.h.0.gizmo.weight"] == "mlp"


def test_lenient_mode_warns_with_the_same_fix_and_floods_other():
    with pytest.warns(UserWarning, match=r"mystery.*role_overrides.*strict=False"):
        plans = plan(_with_mystery(), AegisConfig(strict=False))
    assert {p.name: p.role for p in plans}["mystery"] == "other"


def test_frozen_unknown_parameters_are_not_an_error():
    model = _with_mystery()
    model.mystery.requires_grad_(False)
    model.transformer.h[0].gizmo.weight.requires_grad_(False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        roles = {p.name: p.role for p in plan(model, AegisConfig(strict=True))}
    assert roles["mystery"] == roles["transformer.h.0.gizmo.weight"] == "other"
