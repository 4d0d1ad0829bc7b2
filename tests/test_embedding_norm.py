"""Embedding-row attack (DESIGN §6.3): exact / tied token bags, positions, closed channels, and AEGIS.

Bars (issue 4): token recall ≥ 0.90 undefended (tied: the default decoder; untied: GPT-2 config with
``tie_word_embeddings=False``); with ``aegis.protect`` (paper preset) recall ≤ max(0.05, null + 0.05) and
ROUGE-1 ≤ max(0.05, null + 0.05), where null is the same attack on a random gradient of matched norms
(``aegis.metrics.null_gradient``).
"""
from __future__ import annotations

import copy

import pytest
import torch

import aegis
from aegis.attacks import shared_gradient
from aegis.attacks.embedding_norm import (
    embedding_norm,
    embedding_norm_leak,
    embedding_norm_tokens,
    embedding_param_names,
)
from aegis.metrics import null_gradient, rouge
from aegis.models import default_decoder, default_encoder

TEXTS = [
    "the quick brown fox jumps over the lazy dog near the river bank",
    "federated learning keeps private text on the device of each client",
    "my password is hunter2 and my bank account number is 12345678",
    "the patient was admitted with chest pain and shortness of breath",
    "please send the quarterly report to the finance team by friday",
    "a small model can still memorise rare strings from its training data",
    "the weather in zurich was cold and rainy for most of november",
    "gradient inversion attacks recover sentences from shared updates",
]


def _true_ids(tok, texts) -> set[int]:
    enc = tok(list(texts), padding=True)
    return {i for row, mask in zip(enc["input_ids"], enc["attention_mask"]) for i, m in zip(row, mask) if m}


def _recall(found: set[int], true: set[int]) -> float:
    return len(found & true) / len(true)


def _precision(found: set[int], true: set[int]) -> float:
    return len(found & true) / max(len(found), 1)


def _rouge1(preds: list[str], refs: list[str], field: str = "fmeasure") -> float:
    """ROUGE-1 as the project scores it (``aegis.metrics.rouge``, greedy alignment); ``field="recall"`` gives the
    mean over references of the best ROUGE-1 recall (how much of each reference the bag contains)."""
    if field == "fmeasure":
        return rouge(preds, refs)["rouge1"]
    from rouge_score import rouge_scorer

    sc = rouge_scorer.RougeScorer(["rouge1"], use_stemmer=False)
    if not preds:
        return 0.0
    return sum(max(getattr(sc.score(r, p)["rouge1"], field) for p in preds) for r in refs) / len(refs)


def _tiny_gpt2(tok, tied: bool, seed: int = 0):
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(
        vocab_size=tok.vocab_size, n_embd=64, n_layer=2, n_head=4, n_positions=128, tie_word_embeddings=tied,
        bos_token_id=tok.cls_token_id, eos_token_id=tok.sep_token_id, pad_token_id=tok.pad_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return GPT2LMHeadModel(cfg).float().eval()


@pytest.fixture(scope="module")
def dec():
    """The default decoder (MiniLM run causally, tied head with a vocabulary bias), built once per module."""
    return default_decoder()


@pytest.fixture(scope="module")
def dec_grads(dec):
    model, tok = dec
    cache = {}

    def get(B):
        if B not in cache:
            cache[B] = shared_gradient(model, TEXTS[:B], tok)
        return cache[B]

    return get


@pytest.fixture(scope="module")
def tiny_untied(dec):
    return _tiny_gpt2(dec[1], tied=False)


# -- undefended --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("B", [1, 8])
def test_tied_default_decoder_token_recall(dec, dec_grads, B):
    model, tok = dec
    texts = TEXTS[:B]
    grads = dec_grads(B)
    leak = embedding_norm_leak(model, grads, B)
    true = _true_ids(tok, texts)
    assert any(c.startswith("embedding:tied-complement") for c in leak.channels)
    assert _recall(leak.tokens, true) >= 0.90
    assert _precision(leak.tokens, true) >= 0.90  # the complement rejects high-probability non-input tokens
    assert embedding_norm_tokens(model, grads, tok, B) == leak.tokens
    # Position rows: the longest sequence (with [CLS]/[SEP]).
    assert leak.seq_len == max(len(tok(t)["input_ids"]) for t in texts)


def test_tied_b1_recovers_sentence_in_order(dec, dec_grads):
    model, tok = dec
    text = TEXTS[0]
    out = embedding_norm(model, dec_grads(1), tok, 1)
    assert len(out) == 1
    assert _rouge1(out, [text]) >= 0.95
    assert out[0].split() == text.split()  # position rows put every token in its place


@pytest.mark.parametrize("tied", [True, False])
def test_tiny_gpt2_recall_and_bag_output(dec, tiny_untied, tied):
    tok = dec[1]
    model = tiny_untied if not tied else _tiny_gpt2(tok, tied=True)
    texts = TEXTS[:4]
    grads = shared_gradient(model, texts, tok)
    leak = embedding_norm_leak(model, grads, 4)
    assert ("embedding:sparse" in leak.channels) == (not tied)
    true = _true_ids(tok, texts)
    # Untied: the last token of a causal sequence has no input-side gradient; the head rows add it back.
    assert _recall(leak.tokens, true) >= 0.90 and _precision(leak.tokens, true) >= 0.90
    out = embedding_norm(model, grads, tok, 4)
    assert len(out) == 4  # order unknown for B > 1: the bag in every slot
    # Every reference word's pieces are in the bag; ROUGE splits words into pieces differently
    # ("hunter2" is one ROUGE token, two WordPieces), hence not 1.0.
    assert _rouge1(out, texts, "recall") >= 0.75


def test_llama_untied_no_positions():
    model, tok = default_decoder(n_layer=1, arch="llama")
    texts = TEXTS[:2]
    grads = shared_gradient(model, texts, tok)
    leak = embedding_norm_leak(model, grads, 2)
    assert leak.seq_len is None  # RoPE: no position rows to read
    assert _recall(leak.tokens, _true_ids(tok, texts)) >= 0.90


def test_encoder_sparse_exact_and_order():
    model, tok = default_encoder()
    text = TEXTS[2]
    grads = shared_gradient(model, [text], tok, labels=[1])
    leak = embedding_norm_leak(model, grads, 1)
    true = _true_ids(tok, [text])
    assert leak.tokens == true  # untied input embedding: non-zero rows are exactly the tokens
    assert leak.seq_len == len(tok(text)["input_ids"])  # bidirectional: every position has a gradient
    assert leak.token_types == {0}
    assert embedding_norm(model, grads, tok, 1) == [tok.decode(tok(text)["input_ids"], skip_special_tokens=True)]


# -- closed channels --------------------------------------------------------------------------------------------------


def test_closed_channels_return_empty(dec, dec_grads):
    model, tok = dec
    grads = dec_grads(1)
    assert embedding_norm(model, {}, tok, 2) == []
    assert embedding_norm_tokens(model, {}, tok) == set()
    rows = {n for names in embedding_param_names(model).values() for n in names}
    assert {"bert.embeddings.word_embeddings.weight", "cls.predictions.bias"} <= rows  # tied head + its bias
    no_rows = {k: v for k, v in grads.items() if k not in rows}
    assert embedding_norm(model, no_rows, tok, 2) == []
    zeros = {k: torch.zeros_like(v) for k, v in grads.items()}
    assert embedding_norm(model, zeros, tok, 2) == []
    nan = {k: torch.full_like(v, float("nan")) for k, v in grads.items()}
    assert embedding_norm(model, nan, tok, 2) == []
    # Positions alone: the length leaks, no tokens.
    only_pos = {n: grads[n] for n in embedding_param_names(model)["position"]}
    leak = embedding_norm_leak(model, only_pos, 1)
    assert not leak.tokens and leak.seq_len == len(tok(TEXTS[0])["input_ids"])


def test_untied_head_alone_gives_label_tokens(dec, tiny_untied):
    tok, model = dec[1], tiny_untied
    text = TEXTS[3]
    grads = shared_gradient(model, [text], tok)
    head_only = {"lm_head.weight": grads["lm_head.weight"]}
    found = embedding_norm_tokens(model, head_only, tok, 1)
    labels = set(tok(text)["input_ids"][1:])  # targets of a causal LM: every token but the first
    assert _recall(found, labels) >= 0.90 and _precision(found, labels) >= 0.90


# -- defended --------------------------------------------------------------------------------------------------------


@pytest.mark.filterwarnings(r"ignore:AegisConfig\(seed=")
@pytest.mark.parametrize("tied", [True, False])
def test_aegis_closes_the_row_channels(dec, tied):
    """Tied: the default decoder; untied: the tiny GPT-2 with ``tie_word_embeddings=False`` (flooding on CPU is
    slow, and the untied channels are the same: sparse embedding rows, head rows, position rows). One fixed
    noise key and dropout seed: a single sample compared with a one-word margin (ROUGE-1 0.05) must not
    depend on the run."""
    torch.manual_seed(0)
    base, tok = dec
    # protect() freezes attention in place: keep the fixtures clean.
    model = copy.deepcopy(base) if tied else _tiny_gpt2(tok, tied=False)
    B = 4
    texts = TEXTS[:B]
    true = _true_ids(tok, texts)
    clean = shared_gradient(model, texts, tok)
    assert _recall(embedding_norm_tokens(model, clean, tok, B), true) >= 0.90  # the same model leaks undefended
    null_grads = null_gradient(clean)
    null_recall = _recall(embedding_norm_tokens(model, null_grads, tok, B), true)
    null_r1 = _rouge1(embedding_norm(model, null_grads, tok, B), texts)

    shield = aegis.protect(model, config=aegis.AegisConfig(preset="verification", seed=7))
    grads = shared_gradient(model, texts, tok, shield=shield)
    leak = embedding_norm_leak(model, grads, B)
    recall = _recall(leak.tokens, true)
    r1 = _rouge1(embedding_norm(model, grads, tok, B), texts)
    assert recall <= max(0.05, null_recall + 0.05), (recall, null_recall)
    assert r1 <= max(0.05, null_r1 + 0.05), (r1, null_r1)
    assert leak.seq_len is None  # flooded position rows are dense: no length
    assert not any(c.startswith("embedding:sparse") or "complement" in c for c in leak.channels)
