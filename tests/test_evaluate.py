"""The one held-out evaluator (aegis.harness.evaluate), used by the audit and the utility study: its numbers
are the model's token-weighted loss and sklearn's accuracy / macro-F1, whatever the evaluation batching."""
from __future__ import annotations

import math

import pytest
import torch
import transformers as T
from sklearn.metrics import f1_score

from aegis.audit.options import AuditConfig
from aegis.audit.runner import batch_builder
from aegis.audit.runner import evaluator as audit_evaluator
from aegis.data import LABELS, load_corpus
from aegis.harness import evaluate as harness
from aegis.models import minilm_tokenizer


@pytest.fixture(scope="module")
def tok():
    return minilm_tokenizer()


@pytest.fixture(scope="module")
def validation():
    return load_corpus("validation")[:37]  # not a multiple of the evaluation batch


def _decoder(tok):
    torch.manual_seed(0)
    cfg = T.GPT2Config(n_layer=1, n_embd=16, n_head=2, n_positions=64, vocab_size=tok.vocab_size,
                       pad_token_id=tok.pad_token_id)
    return T.GPT2LMHeadModel(cfg).eval()


def _encoder(tok):
    torch.manual_seed(0)
    cfg = T.BertConfig(vocab_size=tok.vocab_size, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                       intermediate_size=32, num_labels=len(LABELS))
    return T.BertForSequenceClassification(cfg).eval()


@torch.no_grad()
def _token_weighted_loss(model, batch) -> float:
    """Cross-entropy over every predicted token of the whole set at once (next-token, padding ignored)."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    labels = batch["labels"][:, 1:]
    return float(torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels.flatten(), ignore_index=-100))


def test_decoder_perplexity_is_the_token_weighted_loss_for_any_batching(tok, validation, monkeypatch):
    model = _decoder(tok)
    build = batch_builder("decoder", tok, {})
    expected = _token_weighted_loss(model, build(validation))
    for size in (1, 5, 16, 64):
        monkeypatch.setattr(harness, "EVAL_BATCH", size)
        out = harness.evaluator("decoder", build, validation, len(LABELS))(model)
        assert out["val_loss"] == pytest.approx(expected, rel=1e-5)
        assert out["perplexity"] == pytest.approx(math.exp(expected), rel=1e-5)


def test_classifier_accuracy_and_f1_are_sklearns(tok, validation):
    model = _encoder(tok)
    ids = {label: i for i, label in enumerate(LABELS)}
    build = batch_builder("encoder", tok, ids)
    batch = build(validation)
    with torch.no_grad():
        out = model(**batch)
    pred, truth = out.logits.argmax(-1), batch["labels"]
    got = harness.evaluator("encoder", build, validation, len(LABELS))(model)
    assert got["accuracy"] == pytest.approx(float((pred == truth).float().mean()))
    assert got["f1"] == pytest.approx(f1_score(truth, pred, average="macro", zero_division=0))
    assert got["val_loss"] == pytest.approx(float(out.loss), rel=1e-5)
    commonest = max(sum(e.label == label for e in validation) for label in LABELS) / len(validation)
    assert harness.chance_accuracy("encoder", validation) == pytest.approx(commonest)
    assert harness.chance_accuracy("decoder", validation) is None


def test_the_audit_evaluates_with_the_same_function(tok, validation):
    from aegis.audit.attack_base import ModelContext

    model = _decoder(tok)
    build = batch_builder("decoder", tok, {})
    config = AuditConfig.quick(max_eval=20)
    ctx = ModelContext("decoder", model, tok, config, build, {}, [])
    evaluate, chance = audit_evaluator(ctx, validation)
    assert chance is None
    assert evaluate(model) == harness.evaluator("decoder", build, validation[:20], len(LABELS))(model)
