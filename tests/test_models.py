"""Default models (offline, pretrained MiniLM pieces) and the client's shared gradient."""
import pytest
import torch

import aegis
from aegis.attacks import shared_gradient
from aegis.models import _minilm_embeddings, default_decoder, default_encoder, is_decoder

TEXTS = ["Patient Dana Kerr was prescribed 20 mg of sertraline.", "Wire the deposit to account 4471 today."]


@pytest.fixture(scope="module")
def decoder():
    return default_decoder()


def test_default_decoder_is_gpt2_with_pretrained_minilm_embeddings(decoder):
    model, tok = decoder
    cfg = model.config
    assert type(model).__name__ == "GPT2LMHeadModel"
    assert (cfg.n_layer, cfg.n_embd, cfg.n_head, cfg.vocab_size) == (4, 384, 6, 30522)
    assert model.lm_head.weight is model.transformer.wte.weight  # tied head
    emb = _minilm_embeddings()
    assert torch.equal(model.transformer.wte.weight, emb["word"])
    assert torch.equal(model.transformer.wpe.weight, emb["position"])
    assert not model.training and model.transformer.wte.weight.dtype == torch.float32
    # [CLS] = BOS, [SEP] = EOS, [PAD] = pad, padding on the right.
    ids = tok(["hi", "hello there friend"], padding=True)["input_ids"]
    assert ids[0][0] == cfg.bos_token_id == 101 and ids[0][2] == cfg.eos_token_id == 102
    assert ids[0][-1] == cfg.pad_token_id == 0
    assert is_decoder(model)


def test_default_decoder_is_deterministic_and_leaves_global_rng_alone():
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    a, _ = default_decoder(n_layer=1, seed=7)
    after = torch.rand(1)
    b, _ = default_decoder(n_layer=1, seed=7)
    c, _ = default_decoder(n_layer=1, seed=8)
    assert torch.equal(before, after)
    w = "transformer.h.0.attn.c_attn.weight"
    assert torch.equal(a.state_dict()[w], b.state_dict()[w])
    assert not torch.equal(a.state_dict()[w], c.state_dict()[w])


def test_decoder_variants():
    llama, tok = default_decoder(arch="llama", n_layer=2, n_kv_head=2)
    assert type(llama).__name__ == "LlamaForCausalLM" and llama.config.num_key_value_heads == 2
    assert torch.equal(llama.model.embed_tokens.weight, _minilm_embeddings()["word"])
    wide, _ = default_decoder(n_layer=1, n_embd=768, n_head=12)  # GPT-2-small width: random embeddings
    assert wide.transformer.wte.weight.shape == (30522, 768)
    with pytest.raises(ValueError, match="arch"):
        default_decoder(arch="t5")


def test_default_encoder_is_pretrained_minilm_classifier():
    model, tok = default_encoder(num_labels=3)
    assert type(model).__name__ == "BertForSequenceClassification"
    assert model.config.num_labels == 3 and not is_decoder(model)
    assert torch.equal(model.bert.embeddings.word_embeddings.weight, _minilm_embeddings()["word"])
    assert tok("a b")["input_ids"][0] == tok.cls_token_id


def test_shared_gradient_masks_pads_exactly(decoder):
    """The batch loss is the token-weighted mean of the two sentences' losses iff pads are invisible."""
    model, tok = decoder
    both = shared_gradient(model, TEXTS, tok)
    alone = [shared_gradient(model, [t], tok) for t in TEXTS]
    counts = [len(tok(t)["input_ids"]) - 1 for t in TEXTS]  # predicted positions per sentence
    for name, g in both.items():
        mix = (counts[0] * alone[0][name] + counts[1] * alone[1][name]) / sum(counts)
        torch.testing.assert_close(g, mix, rtol=1e-4, atol=1e-5 * float(g.abs().max()))
    assert set(both) == {n for n, p in model.named_parameters() if p.requires_grad}
    assert all(p.grad is None for p in model.parameters())  # nothing of the batch left behind


def test_shared_gradient_restores_mode_and_needs_labels_for_encoders():
    model, tok = default_decoder(n_layer=1)
    model.train()
    shared_gradient(model, TEXTS, tok)
    assert model.training
    enc, etok = default_encoder()
    with pytest.raises(ValueError, match="labels"):
        shared_gradient(enc, TEXTS, etok)
    grads = shared_gradient(enc, TEXTS, etok, labels=[0, 1])
    assert grads["classifier.weight"].abs().sum() > 0


def test_shared_gradient_with_shield_is_the_export():
    model, tok = default_decoder(n_layer=1)
    shield = aegis.protect(model, config=aegis.AegisConfig(preset="paper", seed=3))
    grads = shared_gradient(model, TEXTS, tok, shield=shield)
    assert not any(".attn." in n for n in grads)  # frozen attention is never exported
    assert set(grads) == {n for n, p in model.named_parameters() if p.requires_grad}
    # Reproduce by hand: same seed and step -> the identical flood.
    again = aegis.protect(default_decoder(n_layer=1)[0], config=aegis.AegisConfig(preset="paper", seed=3))
    again.model.zero_grad()
    enc = tok(TEXTS, padding=True, return_tensors="pt")
    labels = enc["input_ids"].masked_fill(enc["attention_mask"] == 0, -100)
    again.model(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"], labels=labels).loss.backward()
    again.mask_()
    for name, g in again.export().items():
        torch.testing.assert_close(grads[name], g)
