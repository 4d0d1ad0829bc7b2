"""DAGER and the shared span machinery (DESIGN §6.2): exact recovery undefended, nothing through closed
channels. Batches are the shipped corpus' validation sentences (6-29 tokens each), in file order. "decoder"
is the default (MiniLM's pretrained layers run causally); GPT-2 internals are tested on arch="gpt2"."""
import math
import time

import pytest
import torch

import aegis
from aegis.attacks import dager, shared_gradient
from aegis.attacks.span import (
    Found,
    Outlier,
    Threshold,
    assemble,
    build_span,
    gradient_matrix,
    grow,
    input_projections,
    layer_spans,
    module_input,
    noise_level,
    position_free,
    similar,
    token_inputs,
)
from aegis.data import LABELS, load_corpus
from aegis.metrics import null_baseline, rouge
from aegis.models import default_decoder, default_encoder

EXAMPLES = load_corpus("validation")


def batch(size, index=0):
    return EXAMPLES[index * size : (index + 1) * size]


def attack_score(model, tok, examples, encoder=False):
    texts = [e.text for e in examples]
    labels = [LABELS.index(e.label) for e in examples] if encoder else None
    grads = shared_gradient(model, texts, tok, labels=labels)
    out = dager(model, grads, tok, len(texts))
    return rouge(out, texts, "hungarian" if encoder else "greedy")


@pytest.fixture(scope="module")
def decoder():
    return default_decoder()


# -- span machinery -------------------------------------------------------------------------------------


def low_rank_gradient(n_inputs=12, d=64, m=100, seed=0):
    gen = torch.Generator().manual_seed(seed)
    inputs = torch.randn(n_inputs, d, generator=gen, dtype=torch.float64)
    return torch.randn(m, n_inputs, generator=gen, dtype=torch.float64) @ inputs, inputs, gen


def test_numerical_span_is_the_input_span():
    grad, inputs, gen = low_rank_gradient()
    span = build_span([grad.float().double()])  # fp32 roundoff, as real gradients have
    assert span.rank == 12
    assert span.residual(inputs).max() < 1e-5
    assert span.residual(7.5 * inputs).max() < 1e-5  # unit normalisation: scale does not matter
    assert span.residual(torch.randn(50, 64, generator=gen, dtype=torch.float64)).min() > 0.5
    # Stacking matrices that read the same input (q, k, v) gives the same span.
    assert build_span([grad[:40], grad[40:]]).rank == 12
    # Full rank is clipped to min(shape) - 20 (DAGER's rank_cutoff); nothing present -> None.
    assert build_span([torch.randn(64, 64, dtype=torch.float64)]).rank == 44
    assert build_span([None]) is None


def test_marchenko_pastur_span_keeps_only_directions_above_the_edge():
    m, n, sigma = 768, 192, 0.01
    gen = torch.Generator().manual_seed(1)
    noise = sigma * torch.randn(m, n, generator=gen, dtype=torch.float64)
    assert noise_level(noise) == pytest.approx(sigma, rel=0.03)
    assert build_span([noise], "mp") is None  # pure noise: nothing above the edge
    edge = sigma * (math.sqrt(m) + math.sqrt(n))
    u = torch.linalg.qr(torch.randn(m, 6, generator=gen, dtype=torch.float64)).Q
    v = torch.linalg.qr(torch.randn(n, 6, generator=gen, dtype=torch.float64)).Q
    strengths = torch.tensor([8.0, 6.0, 4.0, 3.0, 0.2, 0.1], dtype=torch.float64) * edge
    span = build_span([noise + u @ torch.diag(strengths) @ v.T], "mp")
    assert span.rank == 4  # the two weak directions sit inside the bulk
    assert span.residual(v[:, :4].T).max() < 0.2 and span.residual(v[:, 4:].T).min() > 0.9


def test_acceptance_rules():
    r = torch.tensor([1e-7, 5e-4, 2e-3, 0.6])
    assert Threshold(1e-3)(r).tolist() == [True, True, False, False]
    pool = torch.full((2, 1000), 0.8) + 0.01 * torch.randn(2, 1000, generator=torch.Generator().manual_seed(0))
    pool[0, 3], pool[0, 7], pool[0, 9] = 0.1, 0.2, 0.75  # two real outliers, one mild
    ok = Outlier(z=6, top=4)(pool)
    assert ok[0].nonzero().flatten().tolist() == [3, 7] and not ok[1].any()
    assert Outlier(z=6, top=1)(pool)[0].nonzero().flatten().tolist() == [3]
    # Once exact, a sentence stays exact; noisy sentences are left to the outlier test.
    assert Outlier().consistent([], 0.9) and Outlier().consistent([1e-6, 2e-6], 5e-4)
    assert not Outlier().consistent([1e-6, 3e-6], 0.2)
    assert Outlier().consistent([0.04, 0.3], 0.9)
    assert Threshold(1e-3).consistent([1e-6], 0.5)


@pytest.fixture(scope="module")
def gpt2():
    return default_decoder(arch="gpt2")


def test_gradient_matrix_orientation_and_closed_channels(gpt2):
    model, _ = gpt2
    name = "transformer.h.0.attn.c_attn"
    g = torch.randn(384, 1152)
    assert gradient_matrix(model, {f"{name}.weight": g}, name).shape == (1152, 384)  # Conv1D stores (in, out)
    assert gradient_matrix(model, {}, name) is None
    assert gradient_matrix(model, {f"{name}.weight": torch.zeros(384, 1152)}, name) is None
    assert gradient_matrix(model, {f"{name}.weight": torch.full((384, 1152), math.nan)}, name) is None
    assert input_projections(model, "attention")[1] == ["transformer.h.1.attn.c_attn"]
    assert input_projections(model, "mlp")[0] == ["transformer.h.0.mlp.c_fc"]


def test_layer_inputs_are_exactly_what_the_model_computes(gpt2):
    model, tok = gpt2
    tr = model.transformer
    ids = torch.tensor(tok(["the rent is late again"])["input_ids"])
    with torch.no_grad():
        hidden = model(ids, output_hidden_states=True).hidden_states[1]
        torch.testing.assert_close(module_input(model, "transformer.h.1.attn.c_attn", ids), tr.h[1].ln_1(hidden))
        at5 = token_inputs(model, "transformer.h.0.attn.c_attn", 5)
        torch.testing.assert_close(at5, tr.h[0].ln_1(tr.wte.weight + tr.wpe.weight[5]))
    assert not position_free(model, "transformer.h.0.attn.c_attn")
    llama, _ = default_decoder(arch="llama", n_layer=1)
    assert position_free(llama, "model.layers.0.self_attn.q_proj")  # RoPE rotates after the projection


def test_the_default_decoders_layer_inputs_are_bert_embeddings_run_causally(decoder):
    """Block 1 reads LayerNorm(word + position + token type 0); block 2 reads block 1's causal output."""
    model, tok = decoder
    emb = model.bert.embeddings
    query = "bert.encoder.layer.{}.attention.self.query"
    qkv = [f"bert.encoder.layer.0.attention.self.{m}" for m in ("query", "key", "value")]
    assert input_projections(model, "attention")[0] == qkv
    assert input_projections(model, "mlp")[1] == ["bert.encoder.layer.1.intermediate.dense"]
    ids = torch.tensor(tok(["the rent is late again"])["input_ids"])
    with torch.no_grad():
        at5 = token_inputs(model, query.format(0), 5)
        typed = emb.word_embeddings.weight + emb.position_embeddings.weight[5] + emb.token_type_embeddings.weight[0]
        torch.testing.assert_close(at5, emb.LayerNorm(typed))
        hidden = model(ids, output_hidden_states=True).hidden_states[1]
        torch.testing.assert_close(module_input(model, query.format(1), ids), hidden)
        # causal: block 2's input at position t does not change with the tokens after t
        longer = torch.cat([ids[:, :-1], torch.tensor([[2000, 3000, ids[0, -1]]])], dim=1)
        torch.testing.assert_close(module_input(model, query.format(1), longer)[:, : ids.shape[1] - 1], hidden[:, :-1])
    assert not position_free(model, query.format(0))


def test_prefix_search_and_assembly():
    sentences = [(1, 2, 3), (1, 4, 5, 6)]

    def extend(prefixes):  # accept exactly the continuations of the two "batch sentences"
        out = []
        for p in prefixes:
            nxt = sorted({s[len(p)] for s in sentences if s[: len(p)] == p and len(s) > len(p)})
            out.append((nxt, [0.0] * len(nxt)))
        return out

    found = grow(extend, max_len=10, beam=8, rule=Threshold(1e-3))
    assert sorted(f.ids for f in found) == sentences
    assert similar((1, 2, 3, 4), (1, 2, 3, 9)) and not similar((1, 2, 3, 4), (1, 2, 9, 9))
    picks = [
        Found((1, 2), 0.1, False),
        Found((9, 8, 7), 0.0, True),
        Found((1, 2), 0.05, False),
        Found((5,), 0.2, False),
    ]
    assert assemble(picks, 2) == [(9, 8, 7), (1, 2)]
    assert assemble(picks, 5) == [(9, 8, 7), (1, 2), (5,)]


def test_layer_spans_of_shared_gradient(decoder):
    """One span per requested block, from every present input projection; closed blocks give None."""
    model, tok = decoder
    grads = shared_gradient(model, [e.text for e in batch(1)], tok)
    (s1, p1), (s2, p2) = layer_spans(model, grads, "attention", (0, 1))
    n_tokens = len(tok(batch(1)[0].text)["input_ids"]) - 1  # the last token has no gradient (no label)
    assert s1.rank == n_tokens and s2.rank == n_tokens and p2 == "bert.encoder.layer.1.attention.self.query"
    assert layer_spans(model, {}, "attention", (0,)) == [(None, "bert.encoder.layer.0.attention.self.query")]


# -- DAGER, undefended ----------------------------------------------------------------------------------


def test_corpus_sentences_are_5_to_30_tokens(decoder):
    _, tok = decoder
    lengths = [len(tok(e.text, add_special_tokens=False)["input_ids"]) for e in batch(8, 0) + batch(8, 1)]
    assert 5 <= min(lengths) and max(lengths) <= 30


@pytest.mark.parametrize("size", [pytest.param(1, marks=pytest.mark.slow), 4])
def test_dager_default_decoder(decoder, size):
    model, tok = decoder
    scores = attack_score(model, tok, batch(size, 1))
    assert scores["rouge1"] >= 0.95 and scores["rouge2"] >= 0.90


def test_dager_default_encoder_b1():
    model, tok = default_encoder(num_labels=len(LABELS))
    assert attack_score(model, tok, batch(1, 2), encoder=True)["rouge1"] >= 0.90


def test_dager_rope_llama_b1():
    model, tok = default_decoder(arch="llama", n_layer=2)
    scores = attack_score(model, tok, batch(1, 3))
    assert scores["rouge1"] >= 0.95 and scores["rouge2"] >= 0.90


def test_dager_closed_channels_return_nothing(decoder):
    model, tok = decoder
    texts = [e.text for e in batch(2)]
    grads = shared_gradient(model, texts, tok)
    attention = [f"{n}.weight" for names in input_projections(model, "attention").values() for n in names]
    assert len(attention) == 6 * 3 and set(attention) <= set(grads)
    assert dager(model, {k: v for k, v in grads.items() if k not in attention}, tok, 2) == []
    assert dager(model, {**grads, **{n: torch.zeros_like(grads[n]) for n in attention}}, tok, 2) == []
    block2 = {n: torch.full_like(grads[n], math.nan) for n in attention if ".layer.1." in n}
    assert dager(model, {**grads, **block2}, tok, 2) == []
    assert dager(model, {}, tok, 2) == []


def test_dager_against_paper_preset_default_decoder():
    model, tok = default_decoder()
    texts = [e.text for e in batch(2)]
    grads = shared_gradient(
        model, texts, tok, shield=aegis.protect(model, config=aegis.AegisConfig(preset="verification", seed=0))
    )
    null = null_baseline(dager, model, grads, tok, 2, texts)["rouge1"]
    assert rouge(dager(model, grads, tok, 2), texts)["rouge1"] <= max(0.05, null + 0.05)


# -- slow: the remaining bars ---------------------------------------------------------------------------


@pytest.mark.slow
def test_dager_default_decoder_b8_under_60s(decoder):
    model, tok = decoder
    torch.set_num_threads(2)  # the bar is stated for 2 CPU cores
    for index in range(3):
        texts = [e.text for e in batch(8, index)]
        grads = shared_gradient(model, texts, tok)
        start = time.perf_counter()
        out = dager(model, grads, tok, 8)
        elapsed = time.perf_counter() - start
        scores = rouge(out, texts)
        print(f"B=8 batch {index}: {elapsed:.1f} s, {scores}")
        assert elapsed < 60
        assert scores["rouge1"] >= 0.95 and scores["rouge2"] >= 0.90


@pytest.mark.slow
@pytest.mark.parametrize("size, index", [(1, 0), (1, 2), (4, 0), (4, 2)])
def test_dager_default_decoder_more_batches(decoder, size, index):
    scores = attack_score(*decoder, batch(size, index))
    assert scores["rouge1"] >= 0.95 and scores["rouge2"] >= 0.90


@pytest.mark.slow
@pytest.mark.parametrize("size", [1, 4])
def test_dager_random_attention_gpt2(gpt2, size):
    for index in range(3):
        scores = attack_score(*gpt2, batch(size, index))
        assert scores["rouge1"] >= 0.95 and scores["rouge2"] >= 0.90


@pytest.mark.slow
def test_dager_gpt2_small_sized_b8():
    model, tok = default_decoder(arch="gpt2", n_layer=12, n_embd=768, n_head=12)
    for index in range(2):
        scores = attack_score(model, tok, batch(8, index))
        assert scores["rouge1"] >= 0.95 and scores["rouge2"] >= 0.90


@pytest.mark.slow
@pytest.mark.parametrize("size", [1, 4])
def test_dager_rope_llama(size):
    model, tok = default_decoder(arch="llama", n_layer=2)
    for index in range(3):
        scores = attack_score(model, tok, batch(size, index))
        assert scores["rouge1"] >= 0.95 and scores["rouge2"] >= 0.90


@pytest.mark.slow
@pytest.mark.parametrize("size", [1, 2])
def test_dager_default_encoder(size):
    model, tok = default_encoder(num_labels=len(LABELS))
    for index in range(4):
        assert attack_score(model, tok, batch(size, index), encoder=True)["rouge1"] >= 0.90
