"""aegis.attacks.embedding_projection: reads the bag of words from an exact token-embedding gradient (tied
and untied heads), nothing from a gradient that holds nothing, and less as the rows flood's noise grows."""
import copy

import pytest
import torch

import aegis
from aegis.attacks import shared_gradient
from aegis.attacks.embedding_projection import embedding_projection, embedding_projection_scores
from aegis.config import FROZEN, ROLES
from aegis.data import load_corpus
from aegis.metrics import null_gradient, token_recall
from aegis.models import default_decoder
from fast_noise import fast_noise  # noqa: F401  (fixture)

TEXTS = [e.text for e in load_corpus("train")][:8]


@pytest.fixture(scope="module", params=["gpt2", "llama"])  # tied and untied heads
def decoder(request):
    return default_decoder(arch=request.param, n_layer=1)


def test_reads_the_exact_gradient_and_nothing_from_noise(decoder):
    model, tok = decoder
    exact = shared_gradient(model, TEXTS, tok)
    assert token_recall(embedding_projection(model, exact, tok, 8), TEXTS, tok) >= 0.8
    misses = []
    for seed in range(4):  # pure noise of matched norms: under one token expected per draw
        got = embedding_projection(model, null_gradient(exact, seed), tok, 8)
        misses.append(len(got[0].split()) if got else 0)
    assert sum(misses) <= 8, misses


def test_a_closed_channel_reads_nothing(decoder):
    model, tok = decoder
    exact = shared_gradient(model, TEXTS, tok)
    name = next(n for n, p in model.named_parameters() if p is model.get_input_embeddings().weight)
    assert embedding_projection(model, {k: v for k, v in exact.items() if k != name}, tok, 8) == []
    assert embedding_projection(model, {**exact, name: torch.zeros_like(exact[name])}, tok, 8) == []
    assert embedding_projection_scores(model, {**exact, name: exact[name] * float("nan")}) is None


def test_recall_falls_as_the_rows_flood_grows(decoder, fast_noise):  # noqa: F811
    tok = decoder[1]
    recall = []
    for lam in (0.01, 30.0):
        model = copy.deepcopy(decoder[0])  # protect() freezes the other roles
        treatments = dict.fromkeys(ROLES, FROZEN) | {r: aegis.Treatment("rows", lam=lam, rho=1.0)
                                                     for r in ("token_embedding", "lm_head", "position_embedding")}
        shield = aegis.protect(model, config=aegis.AegisConfig(preset=treatments, exposure=aegis.ExposurePolicy.OFF))
        exported = shared_gradient(model, TEXTS, tok, shield=shield)
        recall.append(token_recall(embedding_projection(model, exported, tok, 8), TEXTS, tok))
    assert recall[0] >= 0.8 and recall[1] <= 0.1, recall
