"""Twins of ``proofs/Aegis/Channel1.lean`` (Theorem 1) on a real model: a two-block GPT-2
(random weights, 32 wide) trained by the shipped shield (attention frozen, every other gradient
flooded), with DAGER's span test (``aegis.attacks``) on the first blocks' attention gradients."""
from __future__ import annotations

import pytest
import torch
import transformers as T

import aegis
from aegis.attacks import dager
from aegis.attacks.span import build_span, layer_spans, module_input, token_inputs
from aegis.config import AegisConfig

VOCAB, WIDTH = 96, 32
PROBE = "transformer.h.0.attn.c_attn"  # block 1's fused QKV: DAGER's first span


def gpt2(seed: int = 0) -> T.GPT2LMHeadModel:
    torch.manual_seed(seed)
    config = T.GPT2Config(vocab_size=VOCAB, n_layer=2, n_embd=WIDTH, n_head=2, n_positions=64,
                          pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return T.GPT2LMHeadModel(config).eval()


def batch(seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (2, 6), generator=gen)  # 12 token inputs < 32 = the span's width


def residual(basis: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    """DAGER's score ||v - P v|| / ||v|| against the row span with orthonormal ``basis`` (None: {0})."""
    x = x.double()
    if basis is None:
        proj = torch.zeros_like(x)
    else:
        proj = (x @ basis.T) @ basis
    return torch.linalg.vector_norm(x - proj, dim=-1) / torch.linalg.vector_norm(x, dim=-1)


def attention_names(model) -> list[str]:
    return [n for n, _ in model.named_parameters() if ".attn." in n]


def train_with_shield(steps: int):
    model = gpt2()
    theta0 = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    shield = aegis.protect(model, opt, AegisConfig(seed=11, exposure_budget=None))
    for t in range(steps):
        ids = batch(t)
        opt.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()  # the shield floods before the step
    pseudo = {n: theta0[n] - p.detach() for n, p in model.named_parameters()}
    return model, shield, pseudo


@pytest.fixture(scope="module")
def trained():
    return train_with_shield(steps=3)


def test_frozen_attention_never_moves(trained):
    """channel1_exported_grad_zero: after T local steps on flooded gradients, the round's update
    theta_0 - theta_T (FedAvg's pseudo-gradient) is exactly zero on every attention weight, while
    the trainable parameters moved (the training is not vacuous)."""
    model, shield, pseudo = trained
    names = attention_names(model)
    assert names and all(not p.requires_grad for n, p in model.named_parameters() if n in names)
    for n in names:
        assert not bool(pseudo[n].any()), n
    assert any(bool(pseudo[n].any()) for n in pseudo if n not in names)


def test_dager_span_test_on_frozen_attention(trained):
    """channel1_residual_eq_one / channel1_no_candidate_passes: the span of the frozen attention
    gradient is {0}, every candidate input (each vocabulary token at positions 0-3, what DAGER's
    token filter tests) has residual exactly 1, none passes any threshold <= 1, and DAGER
    reconstructs nothing, from the FedAvg update and from the FedSGD export alike."""
    model, shield, pseudo = trained
    spans = layer_spans(model, pseudo, "attention", (0, 1))
    assert [s for s, _ in spans] == [None, None]
    assert dager(model, pseudo, None, 2) == []
    grad = pseudo[f"{PROBE}.weight"].T  # Conv1D: (in x out) -> rows in the input space
    assert build_span([grad]) is None
    for position in range(4):
        cand = token_inputs(model, PROBE, position)
        score = residual(None, cand)
        assert bool((score == 1.0).all())
        assert not bool((score < 1.0).any())
    ids = batch(0)
    model.zero_grad()
    model(input_ids=ids, labels=ids).loss.backward()
    shield.mask_()
    exported = shield.export()
    assert not any(".attn." in n for n in exported)  # FedSGD: nothing to build a span from
    assert dager(model, exported, None, 2) == []
    model.zero_grad()


def test_span_test_passes_batch_tokens_when_attention_trains():
    """The control (channel1_trainable_rows_in_input_span, channel1_trainable_inputs_in_span): with
    attention trainable, every row of the block-1 attention gradient lies in the span of the block's
    inputs, and every batch input that reaches the loss lies in the gradient's row span (residual
    ~ 0) while inputs of tokens outside the batch do not: Theorem 1's conclusion comes from
    freezing, not from the model."""
    model = gpt2()
    ids = batch(0)
    model.zero_grad()
    model(input_ids=ids, labels=ids).loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    inputs = module_input(model, PROBE, ids).reshape(-1, WIDTH).double()  # u_t, (12, 32)
    grad = grads[f"{PROBE}.weight"].T.double()  # (3 * 32) x 32
    q = torch.linalg.qr(inputs.T).Q  # orthonormal basis of span{u_t}, columns
    rows_res = residual(q.T, grad[grad.norm(dim=1) > 0])
    assert rows_res.max().item() < 1e-5  # rows of dL/dW in span{u_t}
    # the last position of each sequence reaches no loss term (delta_t = 0): it is the one input
    # the left-inverse hypothesis excludes
    used = module_input(model, PROBE, ids)[:, :-1].reshape(-1, WIDTH)
    span1 = layer_spans(model, grads, "attention", (0, 1))[0][0]
    assert span1 is not None and span1.rank == used.shape[0]
    assert residual(span1.basis, used).max().item() < 1e-4  # every batch input passes
    cand = token_inputs(model, PROBE, 2)
    outside = torch.tensor([v for v in range(3, VOCAB) if v not in ids.tolist()[0] + ids.tolist()[1]])
    assert residual(span1.basis, cand[outside]).min().item() > 1e-2  # others do not
