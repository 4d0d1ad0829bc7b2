"""Adaptive attacks (DESIGN §6.2): mlp_span reads the MLP channel that freezing attention leaves open,
spectral denoises flooded matrices; with the AEGIS paper preset no attack beats its null baseline."""
import warnings

import pytest
import torch

import aegis
from aegis.attacks import dager, embedding_norm, mlp_span, shared_gradient, spectral, tag
from aegis.attacks.mlp_span import _scanner
from aegis.attacks.span import input_projections, module_input
from aegis.data import LABELS, load_corpus
from aegis.metrics import null_baseline, rouge
from aegis.models import attack_settings, default_decoder, default_encoder

EXAMPLES = load_corpus("validation")
SHORT = [EXAMPLES[35].text]  # "Patient is allergic to codeine." (7 tokens): keeps vocabulary scans cheap
SPAN_ATTACKS = {"dager": dager, "mlp_span": mlp_span, "spectral": spectral}


def freeze_attention(model):
    """The paper's two-channel variant: attention frozen, every other gradient shared raw."""
    for name, p in model.named_parameters():
        if any(part in name for part in (".attn.", ".self_attn.", ".attention.")):
            p.requires_grad_(False)
    return model


def mlp_flooded(lam, rho, seed=0):
    """The verification preset with only the MLP treatment changed."""
    mlp = aegis.Treatment("matrix", lam=lam, rho=rho)
    return aegis.AegisConfig(preset="verification", overrides={"mlp": mlp}, seed=seed)


@pytest.mark.parametrize("arch, kv", [("minilm", None), ("gpt2", None), ("llama", 2)])
def test_vocabulary_scan_equals_the_models_forward(arch, kv):
    """The fast block-1 scan (per-position K/V/Q reuse) gives exactly the MLP input a full forward does."""
    model, _ = default_decoder() if arch == "minilm" else default_decoder(arch=arch, n_layer=2, n_kv_head=kv)
    probe = input_projections(model, "mlp")[0][0]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a fast path, not the full-forward fallback (which warns)
        scan = _scanner(model, probe)
    tokens = torch.tensor([7, 2026, 30000])
    for prefix in [(), (101,), (101, 2026, 4413, 1999)]:
        ids = torch.cat([torch.tensor(prefix, dtype=torch.long).expand(3, -1), tokens[:, None]], 1)
        with torch.no_grad():
            torch.testing.assert_close(
                scan(prefix)[tokens], module_input(model, probe, ids)[:, -1], atol=2e-5, rtol=1e-4
            )


@pytest.fixture(scope="module")
def frozen():
    """Default decoder with attention frozen (every shield below freezes it anyway) and its tokenizer."""
    model, tok = default_decoder()
    return freeze_attention(model), tok


def test_mlp_span_reads_the_channel_frozen_attention_leaves_open(frozen):
    model, tok = frozen
    grads = shared_gradient(model, SHORT, tok)
    assert not any(".attn." in n or ".attention." in n for n in grads)
    assert dager(model, grads, tok, 1) == []  # vanilla DAGER is blind here ...
    assert rouge(mlp_span(model, grads, tok, 1), SHORT)["rouge1"] >= 0.5  # ... the adaptive attacker is not


def test_mlp_span_closed_or_flooded_channel_and_encoders_give_nothing(frozen):
    model, tok = frozen
    grads = shared_gradient(model, SHORT, tok)
    fc = f"{input_projections(model, 'mlp')[0][0]}.weight"  # block 1's MLP input projection
    assert mlp_span(model, {k: v for k, v in grads.items() if k != fc}, tok, 1) == []
    assert mlp_span(model, {**grads, fc: torch.zeros_like(grads[fc])}, tok, 1) == []
    noise = torch.randn(grads[fc].shape, generator=torch.Generator().manual_seed(0))
    noisy = grads[fc] + 0.5 * grads[fc].abs().mean() * noise
    assert mlp_span(model, {**grads, fc: noisy}, tok, 1) == []  # full numerical rank: no exact span left
    enc, etok = default_encoder(num_labels=len(LABELS))
    assert mlp_span(enc, shared_gradient(enc, SHORT, etok, labels=[0]), etok, 1) == []


def test_spectral_recovers_through_a_weak_flood_that_stops_mlp_span(frozen):
    model, tok = frozen
    grads = shared_gradient(model, SHORT, tok, shield=aegis.protect(model, config=mlp_flooded(lam=0.5, rho=0.3)))
    assert mlp_span(model, grads, tok, 1) == []
    assert rouge(spectral(model, grads, tok, 1), SHORT)["rouge1"] >= 0.5


def test_paper_preset_default_decoder(frozen):
    model, tok = frozen
    grads = shared_gradient(
        model, SHORT, tok, shield=aegis.protect(model, config=aegis.AegisConfig(preset="verification", seed=0))
    )
    for attack in SPAN_ATTACKS.values():
        null = null_baseline(attack, model, grads, tok, 1, SHORT)["rouge1"]
        assert rouge(attack(model, grads, tok, 1), SHORT)["rouge1"] <= max(0.05, null + 0.05), attack.__name__


# -- slow: the remaining bars ---------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("arch, size", [("gpt2", 1), ("gpt2", 4), ("llama", 1)])
def test_mlp_span_two_channel_variant(arch, size):
    model, tok = default_decoder(arch=arch, n_layer=4 if arch == "gpt2" else 2)
    freeze_attention(model)
    for index in range(2):
        texts = [e.text for e in EXAMPLES[index * size : (index + 1) * size]]
        scores = rouge(mlp_span(model, shared_gradient(model, texts, tok), tok, size), texts)
        print(arch, size, index, scores)
        assert scores["rouge1"] >= 0.5


@pytest.mark.slow
def test_spectral_on_a_flooded_attention_channel():
    """Attention flooded instead of frozen (rho 0.3, tiny lambda): spectral works on the DAGER pipeline."""
    model, tok = default_decoder()
    texts = [e.text for e in EXAMPLES[:2]]
    config = aegis.AegisConfig(
        preset="verification", overrides={"attention": aegis.Treatment("matrix", lam=0.0, rho=0.3)}, seed=0
    )
    grads = shared_gradient(model, texts, tok, shield=aegis.protect(model, config=config))
    assert rouge(spectral(model, grads, tok, 2), texts)["rouge1"] >= 0.9


SETTINGS = attack_settings()


@pytest.mark.slow
@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_paper_preset_every_attack_every_setting(setting):
    """Mean over three flood seeds: an attack that outputs junk tokens matches a reference word now and
    then (embedding_norm hit "not" once), so one seed is a noisy estimate. TAG (minutes per run) is
    checked with seed 0 on the B = 1 settings of the default decoder and encoder."""
    build, size = SETTINGS[setting]
    model, tok = build()
    examples = EXAMPLES[:size]
    texts = [e.text for e in examples]
    encoder = setting.startswith("encoder")
    labels = [LABELS.index(e.label) for e in examples] if encoder else None
    alignment = "hungarian" if encoder else "greedy"
    attacks = {**SPAN_ATTACKS, "embedding_norm": embedding_norm}
    if setting in ("decoder B=1", "encoder B=1"):
        attacks["tag"] = tag
    seeds = (0, 1, 2)
    got = {name: [] for name in attacks}
    null = {name: [] for name in attacks}
    for seed in seeds:
        shield = aegis.protect(model, config=aegis.AegisConfig(preset="verification", seed=seed))
        grads = shared_gradient(model, texts, tok, shield=shield, labels=labels)
        for name, attack in attacks.items():
            if name == "tag" and seed:
                continue
            got[name].append(rouge(attack(model, grads, tok, size), texts, alignment)["rouge1"])
            null[name].append(
                null_baseline(attack, model, grads, tok, size, texts, alignment=alignment, seed=seed)["rouge1"]
            )
    failures = []
    for name in attacks:
        mean, null_mean = sum(got[name]) / len(got[name]), sum(null[name]) / len(null[name])
        print(f"{setting} {name}: ROUGE-1 {mean:.3f} {[round(g, 3) for g in got[name]]} (null {null_mean:.3f})")
        if mean > max(0.05, null_mean + 0.05):
            failures.append(f"{name}: {mean:.3f} > max(0.05, {null_mean:.3f} + 0.05)")
    assert not failures, failures
