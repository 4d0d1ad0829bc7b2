"""The loss oracle (aegis.attacks.loss_oracle and the audit's ``loss_oracle`` row).

A reply that carries the clean train loss identifies the private batch among candidates scored by the server's
copy of the model; a reply without a loss (every reply of aegis.fl) leaves the oracle nothing to read.
Model: the default decoder (pretrained MiniLM layers run causally), fp32, eval mode.
"""
from __future__ import annotations

import random

import pytest
import torch

from aegis.attacks.loss_oracle import rank_by_loss, reported_loss, sequence_losses, word_orders
from aegis.models import default_decoder


@pytest.fixture(scope="module")
def decoder():
    model, tok = default_decoder()
    model.loss_type = "ForCausalLM"
    return model, tok


def client_loss(model, batch) -> float:
    """What a client computes (and a Flower reply with ``train-loss`` would carry): the model's own loss."""
    with torch.no_grad():
        return float(model(**batch).loss)


def lm_batch(tok, texts):
    enc = tok(texts, padding=True, return_tensors="pt")
    return {**enc, "labels": enc["input_ids"].masked_fill(enc["attention_mask"] == 0, -100)}


def test_reported_loss_reads_any_loss_metric_and_nothing_else():
    assert reported_loss({"num-examples": 1}) is None
    assert reported_loss({}) is None
    assert reported_loss({"num-examples": 4, "train-loss": 2.5}) == ("train-loss", 2.5)
    assert reported_loss({"val_loss": float("nan"), "train_loss": 1}) == ("train_loss", 1.0)
    assert reported_loss({"loss": True}) is None  # a flag, not a value


def test_rank_by_loss_ties_and_errors():
    ranking = rank_by_loss(1.0, [1.5, 1.0, 0.5, 1.0])
    assert ranking.order[:2] == [1, 3] and ranking.rank(1) == 1.5 and ranking.top_share(1) == 0.5
    assert ranking.rank(0) == 3.5  # ties with candidate 2 at gap 0.5
    with pytest.raises(ValueError, match="reported"):
        rank_by_loss(float("nan"), [1.0])
    with pytest.raises(ValueError, match="losses is empty"):
        rank_by_loss(1.0, [])


def test_word_orders_enumerates_or_samples_distinct_orders():
    orders = word_orders([3, 1, 2, 1], limit=100)
    assert len(orders) == 12 and len(set(orders)) == 12  # 4! / 2!
    assert word_orders([1, 2, 3, 1], limit=100) == orders  # the bag's order does not matter
    sample = word_orders(list(range(10)), limit=50, seed=1)
    assert len(set(sample)) == 50 and all(sorted(o) == list(range(10)) for o in sample)
    with pytest.raises(ValueError, match="limit"):
        word_orders([1, 2], limit=0)


def test_true_word_order_ranks_first_of_all_orders(decoder):
    """A bag of 6 tokens (one repeated): all 360 orders; the reported clean loss picks the true one."""
    model, tok = decoder
    batch = lm_batch(tok, ["the cat sat on the mat"])
    reply = {"num-examples": 1, "train-loss": client_loss(model, batch)}
    ids = batch["input_ids"][0].tolist()
    orders = word_orders(ids[1:-1], limit=1000)
    assert len(orders) >= 300
    candidates = [[ids[0], *o, ids[-1]] for o in orders]
    ranking = rank_by_loss(reported_loss(reply)[1], sequence_losses(model, candidates))
    truth = candidates.index(ids)
    assert ranking.rank(truth) == 1.0 and ranking.top_share(truth) == 1.0
    assert ranking.gaps[truth] < 1e-5 < sorted(ranking.gaps)[1]


def test_sequence_losses_equal_the_models_own_loss(decoder):
    model, tok = decoder
    texts = ["my pin is 4471", "the weather is fine today"]
    singles = [client_loss(model, lm_batch(tok, [t])) for t in texts]
    fast = sequence_losses(model, [tok(t)["input_ids"] for t in texts])
    assert fast == pytest.approx(singles, abs=1e-5)
    with pytest.raises(ValueError, match="at least 2 tokens"):
        sequence_losses(model, [[5]])


def test_true_secret_ranks_first_of_40(decoder):
    """1 of 40 same-format secrets, each trial a different truth: the reported loss names it every time."""
    model, tok = decoder
    rng = random.Random(0)
    values = [f"{v:04d}" for v in rng.sample(range(10000), 40)]
    candidates = [tok(f"my pin is {v}")["input_ids"] for v in values]
    losses = sequence_losses(model, candidates)
    for truth in rng.sample(range(40), 4):
        ranking = rank_by_loss(client_loss(model, lm_batch(tok, [f"my pin is {values[truth]}"])), losses)
        assert ranking.rank(truth) == 1.0 and ranking.top_share(truth) == 1.0


# -- the audit row ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def audit_decoder(decoder):
    from aegis.audit.attacks import ModelContext
    from aegis.audit.options import AuditConfig
    from aegis.audit.runner import batch_builder
    from aegis.data import load_corpus

    model, tok = decoder
    config = AuditConfig(models=("decoder",), defences=("none",), candidates=12, batch_size=2)
    train = load_corpus("train")
    ctx = ModelContext("decoder", model, tok, config, batch_builder("decoder", tok, {}), {}, train[8:])
    return ctx, train[:8]


def targets(ctx, examples, metrics):
    from aegis.audit.attacks import Target

    out = []
    for client in range(2):
        chosen = examples[client * 2 : client * 2 + 2]
        batch = ctx.build(chosen)
        out.append(Target(1, client, {}, batch, chosen, ctx.references(batch), metrics(ctx.model, batch)))
    return out


def test_audit_row_reads_a_reported_loss(audit_decoder):
    from aegis.audit.attacks import make
    from aegis.audit.options import resolve_defence

    ctx, examples = audit_decoder
    attack = make("loss_oracle")
    null = attack.null(ctx, None)
    found = targets(ctx, examples, lambda m, b: {"num-examples": 1, "train-loss": client_loss(m, b)})
    record, _ = attack.run(ctx, resolve_defence("none"), found, [ctx.model], null, lambda cost: None)
    assert record.applicable and record.candidates == 12 and record.gradients == 2
    assert record.score == 1.0 and record.ranks == [1.0, 1.0] and record.leaks
    assert record.null == pytest.approx(1 / 12, abs=1e-4) and record.p_value == pytest.approx((1 / 12) ** 2, rel=1e-3)
    assert "train-loss" in record.note


def test_audit_row_says_when_there_is_nothing_to_read(audit_decoder):
    from aegis.audit.attacks import make
    from aegis.audit.options import resolve_defence

    ctx, examples = audit_decoder
    attack = make("loss_oracle")
    null = attack.null(ctx, None)
    found = targets(ctx, examples, lambda m, b: {"num-examples": 1})
    record, _ = attack.run(ctx, resolve_defence("aegis-verification"), found, [ctx.model], null, lambda cost: None)
    assert not record.applicable and record.gradients == 0
    assert record.note.startswith("nothing to read") and "num-examples" in record.note
    assert record.score == record.null and not record.above_bar and not record.leaks and not record.suspect
    assert record.headline() == "loss_oracle: nothing to read"
