"""Default models (offline, pretrained MiniLM pieces) and the client's shared gradient."""
import copy

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

import aegis
from aegis.attacks import shared_gradient
from aegis.models import (
    DecoderArch,
    _minilm_embeddings,
    attack_settings,
    default_decoder,
    default_encoder,
    is_decoder,
    minilm_path,
)

TEXTS = ["Patient Dana Kerr was prescribed 20 mg of sertraline.", "Wire the deposit to account 4471 today."]


@pytest.fixture(scope="module")
def decoder():
    return default_decoder()


def test_default_decoder_is_minilm_run_causally_with_its_pretrained_weights(decoder):
    model, tok = decoder
    cfg = model.config
    assert type(model).__name__ == "BertLMHeadModel" and cfg.is_decoder and is_decoder(model)
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.vocab_size) == (6, 384, 12, 30522)
    # Every parameter but the head's vocabulary bias is the checkpoint's own tensor (no random weights).
    weights = {n: w for n, w in load_file(str(minilm_path() / "model.safetensors")).items() if w.is_floating_point()}
    params = dict(model.named_parameters())
    assert set(params) == {f"bert.{n}" for n in weights if not n.startswith("pooler.")} | {"cls.predictions.bias"}
    for name, value in weights.items():
        if not name.startswith("pooler."):
            assert torch.equal(params[f"bert.{name}"], value.float()), name
    # Head: logits = h E^T + b, tied to the word embeddings, no transform, b starts at 0.
    head = model.get_output_embeddings()
    assert head.weight is model.get_input_embeddings().weight
    assert head.bias is model.cls.predictions.bias and not head.bias.any()
    assert isinstance(model.cls.predictions.transform, nn.Identity)
    assert not model.training and all(p.dtype == torch.float32 for p in model.parameters())
    # [CLS] = BOS, [SEP] = EOS, [PAD] = pad, padding on the right.
    ids = tok(["hi", "hello there friend"], padding=True)["input_ids"]
    assert ids[0][0] == cfg.bos_token_id == 101 and ids[0][2] == cfg.eos_token_id == 102
    assert ids[0][-1] == cfg.pad_token_id == 0


def test_default_decoder_is_causal_and_its_head_is_the_tied_embeddings(decoder):
    model, tok = decoder
    ids = torch.tensor(tok(["the rent is late again this month"])["input_ids"])
    changed = ids.clone()
    changed[0, 4] = tok.convert_tokens_to_ids("cat")
    with torch.no_grad():
        out, other = model(ids, output_hidden_states=True), model(changed).logits
    assert torch.equal(out.logits[0, :4], other[0, :4])  # positions before the change see none of it
    assert (out.logits[0, 4:] - other[0, 4:]).abs().amax(-1).min() > 1e-3
    h = out.hidden_states[-1][0]
    torch.testing.assert_close(out.logits[0], h @ model.get_input_embeddings().weight.T)


def test_default_decoder_is_deterministic_and_leaves_global_rng_alone(decoder):
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    a, _ = default_decoder(arch="gpt2", n_layer=1, seed=7)
    minilm, _ = default_decoder(seed=7)
    after = torch.rand(1)
    b, _ = default_decoder(arch=DecoderArch.GPT2, n_layer=1, seed=7)
    c, _ = default_decoder(arch="gpt2", n_layer=1, seed=8)
    assert torch.equal(before, after)
    w = "transformer.h.0.attn.c_attn.weight"
    assert torch.equal(a.state_dict()[w], b.state_dict()[w])
    assert not torch.equal(a.state_dict()[w], c.state_dict()[w])
    # Nothing in the MiniLM decoder is random: any seed gives the same model.
    assert all(torch.equal(p, q) for p, q in zip(minilm.parameters(), decoder[0].parameters()))


def test_the_minilm_decoder_refuses_a_shape():
    for shape in ({"n_layer": 2}, {"n_embd": 768}, {"n_head": 6}, {"n_kv_head": 2}):
        (name,) = shape
        with pytest.raises(ValueError, match=rf"^{name}: arch='minilm' is the pretrained MiniLM.*arch='gpt2'"):
            default_decoder(**shape)


def test_gpt2_decoder_has_random_blocks_and_pretrained_minilm_embeddings():
    model, _ = default_decoder(arch="gpt2")
    cfg = model.config
    assert type(model).__name__ == "GPT2LMHeadModel"
    assert (cfg.n_layer, cfg.n_embd, cfg.n_head, cfg.vocab_size) == (4, 384, 6, 30522)
    assert model.lm_head.weight is model.transformer.wte.weight  # tied head
    emb = _minilm_embeddings()
    assert torch.equal(model.transformer.wte.weight, emb["word"])
    assert torch.equal(model.transformer.wpe.weight, emb["position"])
    assert not model.training and is_decoder(model)


def test_attack_settings_measure_the_default_and_the_random_attention_decoders():
    settings = attack_settings()
    assert settings["decoder B=4"] == (default_decoder, 4)
    model, _ = settings["gpt2 (random attention) B=4"][0]()
    assert type(model).__name__ == "GPT2LMHeadModel"


def test_decoder_variants():
    llama, tok = default_decoder(arch="llama", n_layer=2, n_kv_head=2)
    assert type(llama).__name__ == "LlamaForCausalLM" and llama.config.num_key_value_heads == 2
    assert torch.equal(llama.model.embed_tokens.weight, _minilm_embeddings()["word"])
    wide, _ = default_decoder(arch="gpt2", n_layer=1, n_embd=768, n_head=12)  # GPT-2-small width: random embeddings
    assert wide.transformer.wte.weight.shape == (30522, 768)
    with pytest.raises(ValueError, match=r"arch='t5': use one of 'minilm', 'gpt2', 'llama'"):
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
        # + 1e-8: attention key biases get a zero gradient (softmax ignores a shift), i.e. only roundoff
        torch.testing.assert_close(g, mix, rtol=1e-4, atol=1e-5 * float(g.abs().max()) + 1e-8)
    assert set(both) == {n for n, p in model.named_parameters() if p.requires_grad}
    assert all(p.grad is None for p in model.parameters())  # nothing of the batch left behind


def test_shared_gradient_restores_mode_and_needs_labels_for_encoders():
    model, tok = default_decoder(arch="gpt2", n_layer=1)
    model.train()
    shared_gradient(model, TEXTS, tok)
    assert model.training
    enc, etok = default_encoder()
    with pytest.raises(ValueError, match="labels"):
        shared_gradient(enc, TEXTS, etok)
    grads = shared_gradient(enc, TEXTS, etok, labels=[0, 1])
    assert grads["classifier.weight"].abs().sum() > 0


def test_shared_gradient_with_shield_is_the_export():
    model, tok = default_decoder(arch="gpt2", n_layer=1)
    shield = aegis.protect(model, config=aegis.AegisConfig(preset="verification", seed=3))
    grads = shared_gradient(model, TEXTS, tok, shield=shield)
    assert not any(".attn." in n for n in grads)  # frozen attention is never exported
    assert set(grads) == {n for n, p in model.named_parameters() if p.requires_grad}
    # Reproduce by hand: same seed and step -> the identical flood.
    config = aegis.AegisConfig(preset="verification", seed=3)
    again = aegis.protect(default_decoder(arch="gpt2", n_layer=1)[0], config=config)
    again.model.zero_grad()
    enc = tok(TEXTS, padding=True, return_tensors="pt")
    labels = enc["input_ids"].masked_fill(enc["attention_mask"] == 0, -100)
    again.model(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"], labels=labels).loss.backward()
    again.mask_()
    for name, g in again.export().items():
        torch.testing.assert_close(grads[name], g)


def test_the_shield_counts_exposures_on_the_default_decoder(decoder):
    """The exposure tracker hooks the input embedding (BERT's word_embeddings): the paper preset exports
    one example 4 times, then refuses."""
    model, tok = decoder
    shield = aegis.protect(copy.deepcopy(model), config=aegis.AegisConfig(preset="verification", seed=5))
    for _ in range(4):
        shared_gradient(shield.model, ["my pin is 4471"], tok, shield=shield)
    with pytest.raises(RuntimeError, match="already exported 4 time"):
        shared_gradient(shield.model, ["my pin is 4471"], tok, shield=shield)
    shared_gradient(shield.model, ["a fresh sentence"], tok, shield=shield)
