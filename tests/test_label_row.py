"""The audit's label row at its decisive sample size and at the defence's exposure budget (aegis.audit.label_attack).

The row's verdict needs the accuracy to exceed its chance level by MARGIN and a permutation p below ALPHA. A preset's
head flood exports rho * clip(G) at a capped snr by design, so its excess is small but not zero, and only the margin
separates it from a leak: the margin has to be many standard errors of the row's accuracy, or chance alone calls a
leak in about 1 % of runs. Real model: the audit's encoder (pretrained MiniLM, 4-class head) on the shipped corpus.
"""
from __future__ import annotations

import statistics

import pytest
import torch
from torch import nn

import aegis
from aegis.attacks.labels import find_head, infer_labels, infer_many, label_accuracy
from aegis.audit.records import MARGIN


@pytest.fixture(scope="module")
def ctx():
    from aegis.audit.attacks import ModelContext
    from aegis.audit.dataset import load
    from aegis.audit.options import AuditConfig
    from aegis.audit.runner import batch_builder, client_examples, load_model

    config = AuditConfig(models=("encoder",), defences=("none",), attacks=("labels",))
    data = load(config)
    label_ids = data.label_ids()
    model, tok = load_model("encoder", config, num_labels=len(label_ids))
    used = {id(e) for client in client_examples(data, config) for batch in client for e in batch}
    decoys = [e for e in data.validation + data.train if id(e) not in used]
    return ModelContext("encoder", model, tok, config, batch_builder("encoder", tok, label_ids), label_ids, decoys)


def no_signal_accuracies(ctx, size: int, count: int) -> list[float]:
    """Per batch, the attack's accuracy on a gradient that carries nothing of the batch (a Gaussian of the clean
    head gradient's per-tensor norms, as the row's null baseline draws it)."""
    from aegis.audit.label_attack import clean_head_gradient, fresh_batches, head_features
    from aegis.metrics import null_gradient

    examples, batches = fresh_batches(ctx, {size: count})
    features, labels = head_features(ctx.model, ctx.build, examples)
    head = find_head(ctx.model)
    exports = [
        null_gradient(clean_head_gradient(head, features[idx], labels[idx]), seed=i)
        for i, idx in enumerate(batches[size])
    ]
    guesses = infer_many(ctx.model, exports, size)
    return [label_accuracy(g, labels[idx].tolist()) for g, idx in zip(guesses, batches[size])]


@pytest.mark.parametrize("size", [1, 2, 8])
def test_the_margin_is_four_standard_errors_of_the_row(ctx, size):
    """At every batch size of the row, MARGIN >= 4 standard errors of its accuracy when the exports carry nothing
    (chance alone then clears the margin with probability < 1e-4). 160 batches at B = 2 gave 2.4."""
    from aegis.audit.label_attack import LABEL_BATCHES

    n = LABEL_BATCHES[size]
    spread = statistics.pstdev(no_signal_accuracies(ctx, size, n))
    assert spread > 0.05  # the guesses do vary: a constant guess would pass trivially
    assert 4 * spread / n**0.5 <= MARGIN, (size, n, spread)


def test_fresh_batches_reuse_sentences_across_batches_never_within(ctx):
    from aegis.audit.label_attack import fresh_batches

    examples, batches = fresh_batches(ctx, {1: 3 * len(ctx.decoys), 8: 100, 2: 5})
    assert len(examples) == len(ctx.decoys) and {b: len(v) for b, v in batches.items()} == {1: 3 * len(ctx.decoys),
                                                                                             8: 100, 2: 5}
    assert all(len(set(idx)) == len(idx) == b for b, v in batches.items() for idx in v)
    assert sorted(i for [i] in batches[1]) == sorted(list(range(len(ctx.decoys))) * 3)  # whole passes at B = 1
    assert batches[8][0] == list(range(8)) and batches[8][50] != list(range(8))  # pass 2 is reshuffled
    small, few = fresh_batches(ctx, {2: 5})
    assert len(small) == 10 and few[2] == [[2 * i, 2 * i + 1] for i in range(5)]


@pytest.mark.filterwarnings("ignore:AegisConfig\\(seed")
def test_the_row_reads_the_mean_of_k_exports_at_the_budget(ctx):
    """K exports of one batch average the noise by sqrt(K): a head flood whose single export reads near chance reads
    far above it from the mean of 16. The row exports each batch K = the configuration's exposure budget times."""
    from aegis.audit.attacks import server_copy
    from aegis.audit.label_attack import LabelAttack, evaluate
    from aegis.audit.options import DefenceSpec

    model = server_copy(ctx.model)
    # rows flood of the head at lam 4, rho 0.3, no snr cap (fixed key): one export reads chance (0.25 against
    # 0.25 on 64 batches), the mean of 16 reads 0.56 (p 1e-4)
    head = aegis.Treatment("rows", lam=4.0, rho=0.3)
    config = aegis.AegisConfig(preset="verification", seed=11, overrides={"head": head}, exposure_budget=16)
    spec = DefenceSpec("aegis-noisy-head", config)
    one = evaluate(ctx, spec, model, {1: 48}, 0, 1)[0]["B=1"]
    mean16 = evaluate(ctx, spec, model, {1: 48}, 0, 16)[0]["B=1"]
    assert one.accuracy < one.null + 0.1 and one.p_value > 0.05, one
    assert mean16.accuracy > mean16.null + 0.2 and mean16.p_value < 0.01, mean16
    with pytest.raises(ValueError, match="k=0"):
        evaluate(ctx, spec, model, {1: 4}, 0, 0)

    row, _ = LabelAttack({1: 4, 2: 2}).run(ctx, spec, [], [model], None, lambda cost: None)
    assert row.exposures == 16 and "16 exports each" in row.note
    plain = aegis.AegisConfig(preset="verification", seed=11)
    row, _ = LabelAttack({1: 4}).run(ctx, DefenceSpec("aegis-verification", plain), [], [model], None, lambda c: None)
    assert row.exposures == plain.exposures > 1


def test_infer_many_is_infer_labels_of_each(ctx):
    torch.manual_seed(0)
    head = find_head(ctx.model)
    exports = [{n: torch.randn_like(head.module.weight) for n in head.weight} for _ in range(5)]
    for size in (1, 3):
        assert infer_many(ctx.model, exports, size, gain=0.5) == [
            infer_labels(ctx.model, g, size, gain=0.5) for g in exports
        ]


def test_find_head_follows_a_replaced_head():
    model = nn.Sequential()
    model.add_module("body", nn.Linear(3, 3))
    model.add_module("classifier", nn.Linear(3, 4))
    first = find_head(model)
    assert find_head(model) is first and first.module is model.classifier
    model.classifier = nn.Linear(3, 5)
    assert find_head(model).module is model.classifier and find_head(model).num_labels == 5
    model.classifier.weight = nn.Parameter(torch.zeros(5, 3))
    assert find_head(model).module.weight is model.classifier.weight
