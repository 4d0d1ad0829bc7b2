"""The spectral span attack (issue 15): undefended, through weakened MLP floods, on averaged exports, and at
the null level under the shipped presets. Fast tests use a 1-2 block decoder and one short sentence; the
CPU cipher is swapped for keyed torch.randn (``fast_noise``: the attack only knows the noise law)."""
import math

import pytest
import torch

import aegis
from aegis.attacks import shared_gradient, spectral
from aegis.attacks.repeated import averaged_export
from aegis.attacks.spectral import build_probe, gd_shrink, mlp_weights
from aegis.data import load_corpus
from aegis.metrics import null_baseline, rouge
from aegis.models import default_decoder
from fast_noise import fast_noise  # noqa: F401 (fixture)

EXAMPLES = load_corpus("validation")
SHORT = [EXAMPLES[35].text]  # "Patient is allergic to codeine."


def mlp_flooded(lam, rho, seed=0, **kw):
    return aegis.AegisConfig(
        preset="verification", overrides={"mlp": aegis.Treatment("matrix", lam=lam, rho=rho)}, seed=seed, **kw
    )


@pytest.fixture
def small():  # one shield per model: every test protects a fresh copy (the same seed)
    torch.manual_seed(0)
    return default_decoder(arch="gpt2", n_layer=2)


def test_gavish_donoho_shrinker_and_the_edge():
    """Zero at and below the edge 1 + sqrt(beta); tends to the identity for strong spikes."""
    beta = 0.25
    y = torch.tensor([0.5, 1.0, 1.5, 1.51, 10.0, 100.0]).numpy()
    out = gd_shrink(y, beta)
    assert (out[:3] == 0).all() and out[3] > 0
    assert abs(out[-1] / 100 - 1) < 1e-3


def test_pure_noise_has_no_direction_above_the_edge():
    gen = torch.Generator().manual_seed(0)
    noise = 0.01 * torch.randn(1536, 384, generator=gen, dtype=torch.float64)
    assert build_probe(noise, "x", 0, 0.01, "span", 1.0) is None


def test_undefended(small):
    model, tok = small
    grads = shared_gradient(model, SHORT, tok)
    assert rouge(spectral(model, grads, tok, 1), SHORT)["rouge1"] >= 0.9


def test_undefended_exact_path_above_half_rank():
    """An exact gradient whose rank exceeds half a projection's short side (a GQA key projection of 32 rows
    holding 29 tokens) has a non-zero median singular value: it is still exact, and spectral reads it as
    DAGER does."""
    torch.manual_seed(0)
    model, tok = default_decoder(arch="llama", n_layer=2, n_embd=128, n_head=4, n_kv_head=1)
    texts = [e.text for e in load_corpus("train")[:2]]
    assert sum(len(tok(t)["input_ids"]) for t in texts) > 16  # more tokens than half of k_proj's 32 rows
    grads = shared_gradient(model, texts, tok)
    assert rouge(spectral(model, grads, tok, 2), texts)["rouge1"] >= 0.9


def test_weak_mlp_flood(small, fast_noise):  # noqa: F811
    """MLP matrix flood lam 1, rho 0.3 (attention frozen as in the paper preset): read through the edge."""
    model, tok = small
    shield = aegis.protect(model, config=mlp_flooded(lam=1.0, rho=0.3))
    grads = shared_gradient(model, SHORT, tok, shield=shield)
    public = shield.public_params()
    got = rouge(spectral(model, grads, tok, 1, public=public), SHORT)["rouge1"]
    null = null_baseline(spectral, model, grads, tok, 1, SHORT, public=public)["rouge1"]
    assert got >= 0.6 and null <= 0.05, (got, null)


def test_paper_preset_is_at_the_null_level(small, fast_noise):  # noqa: F811
    model, tok = small
    shield = aegis.protect(model, config=aegis.AegisConfig(preset="verification", seed=0))
    grads = shared_gradient(model, SHORT, tok, shield=shield)
    public = shield.public_params()
    got = rouge(spectral(model, grads, tok, 1, public=public), SHORT)["rouge1"]
    null = null_baseline(spectral, model, grads, tok, 1, SHORT, public=public)["rouge1"]
    assert got <= max(0.05, null + 0.05)


def test_reconstruction_preset_is_read_below_its_stated_batch(small, fast_noise):  # noqa: F811
    """One short sentence is below the batch the reconstruction promise is stated for: its MLP floods (snr
    SENTENCES_SNR per tensor) carry the sentence's span, and the attack reads it. This is why the promise
    starts at SENTENCES_BATCH sequences per export."""
    from aegis.config import SENTENCES_BATCH, Preset

    model, tok = small
    config = aegis.AegisConfig(preset=Preset.SENTENCES, seed=0, allow_outside_promise=True)  # read below its batch
    assert config.promise.outside(len(SHORT)) and len(SHORT) < SENTENCES_BATCH
    shield = aegis.protect(model, config=config)
    grads = shared_gradient(model, SHORT, tok, shield=shield)
    assert any(n.startswith(tuple(f"{m}." for _, m in mlp_weights(model))) for n in grads)  # the MLP is exported
    assert rouge(spectral(model, grads, tok, 1, public=shield.public_params()), SHORT)["rouge1"] >= 0.9


# -- slow -------------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("lam", [0.5, 1.0, 2.0])
def test_weakened_settings_default_decoder(lam, fast_noise):  # noqa: F811
    model, tok = default_decoder()
    texts = [e.text for e in EXAMPLES[:3]]
    scores = []
    for seed, text in enumerate(texts):
        shield = aegis.protect(model, config=mlp_flooded(lam=lam, rho=0.3, seed=seed))
        grads = shared_gradient(model, [text], tok, shield=shield)
        scores.append(rouge(spectral(model, grads, tok, 1, public=shield.public_params()), [text])["rouge1"])
    print(lam, scores)
    assert sum(scores) / len(scores) >= (0.5 if lam < 2 else 0.3)


@pytest.mark.slow
def test_averaged_exports_undo_a_strong_flood(fast_noise):  # noqa: F811
    """lam 4 at rho 0.3 is out of reach from one export; 16 exports average the noise to lam 1."""
    model, tok = default_decoder(arch="gpt2", n_layer=2)
    config = mlp_flooded(lam=4.0, rho=0.3, seed=None, exposure="off")
    shield = aegis.protect(model, config=config)
    public = shield.public_params()
    k = 16
    grads = averaged_export(lambda: shared_gradient(model, SHORT, tok, shield=shield), k)
    got = rouge(spectral(model, grads, tok, 1, public=public, exposures=k), SHORT)["rouge1"]
    assert got >= 0.5, got
    assert math.isfinite(got)
