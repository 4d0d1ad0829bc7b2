"""TAG-style optimisation attack (DESIGN §6.3): a fast smoke test, and slow recovery / defence tests.

The slow tests use a tiny GPT-2 (d = 64, 2 blocks, MiniLM WordPiece vocabulary) at B = 1: the setting in which
optimisation attacks are known to work. Run them with ``pytest -m slow tests/test_tag.py``.
"""
from __future__ import annotations

import pytest
import torch

import aegis
from aegis.attacks import shared_gradient
from aegis.attacks.tag import tag, tag_tokens
from aegis.metrics import null_gradient, rouge
from aegis.models import minilm_tokenizer

SENTENCES = [
    "my password is blue sky",
    "patients with chest pain were admitted",
    "send the report to alice by friday",
]


def _tiny_gpt2(tok, n_embd=64, n_layer=2, n_head=4, tied=True, seed=0):
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(
        vocab_size=tok.vocab_size, n_embd=n_embd, n_layer=n_layer, n_head=n_head, n_positions=64,
        tie_word_embeddings=tied, bos_token_id=tok.cls_token_id, eos_token_id=tok.sep_token_id,
        pad_token_id=tok.pad_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return GPT2LMHeadModel(cfg).float().eval()


def _rouge(pred: str, ref: str) -> tuple[float, float]:
    r = rouge([pred], [ref])
    return r["rouge1"], r["rouge2"]


def _token_recall(ids: list[int], ref: list[int]) -> float:
    return len(set(ids) & set(ref)) / len(set(ref))


@pytest.fixture(scope="module")
def tok():
    return minilm_tokenizer()


# -- fast ----------------------------------------------------------------------------------------------------------


def test_tag_smoke_runs_returns_b_strings_and_handles_missing(tok):
    model = _tiny_gpt2(tok, n_embd=32, n_layer=1, n_head=2)
    texts = ["a short one", "and another"]
    grads = shared_gradient(model, texts, tok)
    flags = {n: p.requires_grad for n, p in model.named_parameters()}

    out = tag(model, grads, tok, batch_size=2, steps=3, lr=0.05, seed=0)
    assert isinstance(out, list) and len(out) == 2 and all(isinstance(s, str) for s in out)
    ids = tag_tokens(model, grads, batch_size=2, steps=3, seed=0)
    assert [len(r) for r in ids] == [len(tok(texts[0])["input_ids"])] * 2  # length from the position rows
    assert tag_tokens(model, grads, batch_size=2, steps=3, seed=0) == ids  # fixed seed: deterministic

    # Closed channels: nothing, only the (never matched) token embedding, all zeros, NaN -> [].
    assert tag(model, {}, tok, 1, steps=3) == []
    assert tag(model, {"transformer.wte.weight": grads["transformer.wte.weight"]}, tok, 1, steps=3) == []
    assert tag(model, {k: torch.zeros_like(v) for k, v in grads.items()}, tok, 1, steps=3) == []
    assert tag(model, {k: torch.full_like(v, float("nan")) for k, v in grads.items()}, tok, 1, steps=3) == []
    # Some channels missing (frozen attention, no positions): still runs; the length comes from seq_len.
    partial = {k: v for k, v in grads.items() if ".attn." not in k and "wpe" not in k}
    out = tag(model, partial, tok, 1, steps=3, seq_len=5)
    assert len(out) == 1 and isinstance(out[0], str)
    # A frozen server copy (as after aegis.protect) is fine, and nothing is left changed.
    for n, p in model.named_parameters():
        if ".attn." in n:
            p.requires_grad_(False)
    assert len(tag(model, grads, tok, 1, steps=2, seq_len=4)) == 1
    for n, p in model.named_parameters():
        assert p.grad is None
        if ".attn." not in n:
            assert p.requires_grad == flags[n]


def test_tag_smoke_encoder_classifier(tok):
    """Sequence classification (tiny BERT): soft class labels are optimised; B strings come back."""
    from transformers import BertConfig, BertForSequenceClassification

    cfg = BertConfig(vocab_size=tok.vocab_size, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                     intermediate_size=64, max_position_embeddings=64, num_labels=2)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = BertForSequenceClassification(cfg).eval()
    text = "a short one"
    grads = shared_gradient(model, [text], tok, labels=[1])
    ids = tag_tokens(model, grads, 1, steps=3, seed=0)
    assert len(ids) == 1 and len(ids[0]) == len(tok(text)["input_ids"])  # bidirectional: no +1
    assert len(tag(model, grads, tok, 1, steps=3)) == 1


# -- slow -----------------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_tag_recovers_short_sentences_undefended(tok):
    """B = 1, 300 steps: TAG recovers most of each short sentence from the raw gradient."""
    r1s, recalls = [], []
    for text in SENTENCES:
        model = _tiny_gpt2(tok)
        grads = shared_gradient(model, [text], tok)
        ids = tag_tokens(model, grads, 1, steps=300, lr=0.05, seed=0)[0]
        pred = tok.decode(ids, skip_special_tokens=True)
        r1s.append(_rouge(pred, text)[0])
        recalls.append(_token_recall(ids, tok(text)["input_ids"]))
    print(f"TAG undefended: ROUGE-1 {r1s}, token recall {recalls}")
    assert sum(r1s) / len(r1s) >= 0.6
    assert sum(recalls) / len(recalls) >= 0.6


@pytest.mark.slow
def test_tag_fails_against_aegis(tok):
    """With the paper preset (attention frozen, everything else flooded) TAG is at the null level; the attacker
    is even told the true length (the flooded position rows no longer give it)."""
    r1s, nulls = [], []
    for text in SENTENCES[:2]:
        L = len(tok(text)["input_ids"])
        model = _tiny_gpt2(tok)
        null = null_gradient(shared_gradient(model, [text], tok))
        nulls.append(_rouge(tag(model, null, tok, 1, steps=300, seed=0, seq_len=L)[0], text)[0])
        shield = aegis.protect(model, config=aegis.AegisConfig(preset="verification"))
        grads = shared_gradient(model, [text], tok, shield=shield)
        assert not any(".attn." in k for k in grads)
        r1s.append(_rouge(tag(model, grads, tok, 1, steps=300, seed=0, seq_len=L)[0], text)[0])
    print(f"TAG defended: ROUGE-1 {r1s}, null {nulls}")
    assert max(r1s) <= max(0.05, max(nulls) + 0.05)
