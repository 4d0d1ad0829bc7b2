"""LoRA in delta mode: adapter roles (mlp_lora, attention_lora, the latter an explicit opt-in) and DAGER on
attention-LoRA deltas. DAGER stacks a block's q/k/v factors, whose rows span at most 3 r of the block's
inputs: below the round's token count the span is partial and the sequence test fails; rank 256 (DAGER's
LoRA setting) is the positive control."""
from __future__ import annotations

import peft
import pytest
import torch

from aegis.attacks import dager
from aegis.config import FROZEN, ROLES, SENTENCES, VERIFICATION, AegisConfig, ExportMode, Treatment
from aegis.data import load_corpus
from aegis.delta import DeltaShield, PublicBatches
from aegis.delta_attacks import attacker_model, pseudo_gradient, span_view
from aegis.exposure import ExposurePolicy
from aegis.metrics import null_gradient, rouge
from aegis.models import default_decoder
from aegis.policy import plan
from families import build

PUBLIC = ("The weather today is mild with a light breeze from the west.",
          "The library opens at nine in the morning and closes at six.",
          "The train to the city leaves every half hour from platform two.",
          "Our team finished the project a week ahead of schedule.")
OPEN = Treatment("matrix", rho=1.0, clip=1e6)  # no cap, no noise: the clean delta (the attack's best case)


def _roles(model, config):
    return {p.name: p for p in plan(model, config) if "lora_" in p.name}


@pytest.mark.parametrize("family,targets", [("llama", ["q_proj", "v_proj", "up_proj", "down_proj"]),
                                            ("gpt2", ["c_attn", "c_fc"])])
def test_adapters_get_their_own_roles_and_attention_ones_are_an_opt_in(family, targets):
    model = peft.get_peft_model(build(family), peft.LoraConfig(r=4, target_modules=targets,
                                                               fan_in_fan_out=family == "gpt2"))
    plans = _roles(model, AegisConfig(preset=SENTENCES))
    attention = {n for n in plans if ".self_attn." in n or ".attn." in n}
    assert attention and len(plans) > len(attention)
    assert all(plans[n].role == "attention_lora" and plans[n].treatment == FROZEN for n in attention)
    assert all(p.role == "mlp_lora" and p.treatment == SENTENCES["mlp"] for n, p in plans.items() if n not in attention)
    opted = _roles(model, AegisConfig(preset=SENTENCES, overrides={"attention_lora": OPEN}))
    assert all(opted[n].treatment == OPEN for n in attention)
    # a mapping written without the adapter roles gives adapters the treatment of the module they adapt
    legacy = {r: t for r, t in VERIFICATION.items() if r not in ("mlp_lora", "attention_lora")}
    config = AegisConfig(preset=legacy)
    assert config.treatments["mlp_lora"] == VERIFICATION["mlp"] and config.treatments["attention_lora"] == FROZEN


def test_span_view_reads_the_a_factor_under_the_adapted_weight():
    delta = {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight": torch.ones(2, 3),
             "base_model.model.model.layers.0.self_attn.q_proj.lora_B.default.weight": torch.ones(3, 2),
             "model.layers.0.mlp.up_proj.weight": torch.zeros(4, 3)}
    view = span_view(delta)
    assert set(view) == {"model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.up_proj.weight"}
    assert view["model.layers.0.self_attn.q_proj.weight"].shape == (2, 3)
    assert torch.equal(pseudo_gradient({"w": torch.ones(2)}, 0.5)["w"], -2 * torch.ones(2))
    with pytest.raises(ValueError, match="lr=0"):
        pseudo_gradient(delta, 0)


def attention_lora_round(rank: int, texts: list[str]):
    """One client's round (one SGD step) with LoRA of ``rank`` on q/k/v, opted in and exported clean; the
    adapters start from a later round's state (B non-zero). Returns (attacker's model, exported delta)."""
    base, tok = default_decoder(arch="llama", n_layer=2)
    model = peft.get_peft_model(base, peft.LoraConfig(r=rank, lora_alpha=rank, target_modules=["q_proj", "k_proj",
                                                                                              "v_proj"]))
    g = torch.Generator().manual_seed(rank)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    server = attacker_model(model)  # the snapshot the server sent
    config = AegisConfig(preset=dict.fromkeys(ROLES, FROZEN) | {"attention_lora": OPEN}, export=ExportMode.DELTA,
                         exposure=ExposurePolicy.OFF)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1.0)
    shield = DeltaShield(model, opt, config, PublicBatches(model, tok, PUBLIC, len(texts), 64))
    with shield.round() as rnd:
        enc = tok(texts, padding=True, return_tensors="pt")
        model(**enc, labels=enc["input_ids"].masked_fill(enc["attention_mask"] == 0, -100)).loss.backward()
        opt.step()
        opt.zero_grad()
    return server, rnd.delta, tok


@pytest.mark.slow
def test_dager_reads_attention_lora_only_above_the_rounds_token_count():
    texts = [e.text for e in load_corpus("train")[:16]]  # D = 16 short sentences
    server, _, tok = attention_lora_round(8, texts[:1])
    tokens = sum(len(ids) for ids in tok(texts)["input_ids"])
    assert 3 * 64 < tokens <= min(3 * 256, 384) - 20  # the premise: ranks 8, 64 below it, 256 above
    scores = {}
    for rank in (8, 64, 256):
        server, delta, tok = attention_lora_round(rank, texts)
        view = span_view(delta)
        scores[rank] = (rouge(dager(server, view, tok, len(texts)), texts)["rouge1"],
                        rouge(dager(server, null_gradient(view), tok, len(texts)), texts)["rouge1"])
    assert scores[256][0] >= 0.8, scores  # positive control: r >= tokens, the span is whole
    for rank in (8, 64):
        assert scores[rank][0] <= scores[rank][1] + 0.05, scores  # at its null
