"""Baseline defences (aegis.baselines): each does exactly what its name says."""
import math
import subprocess
import sys

import pytest
import torch
import transformers
from torch import nn

from aegis.baselines import (
    DPSGD,
    Aegis,
    GaussianNoise,
    NoDefence,
    Pruning,
    Soteria,
    add_noise,
    default_baselines,
    make_defence,
    prune,
    prune_,
)
from aegis.config import AegisConfig

transformers.logging.set_verbosity_error()


def tiny_gpt2(seed=0):
    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=200, n_positions=64)
    return transformers.GPT2LMHeadModel(cfg).eval()


def tiny_bert(seed=0):
    torch.manual_seed(seed)
    cfg = transformers.BertConfig(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=2, intermediate_size=64, vocab_size=200, num_labels=4
    )
    return transformers.BertForSequenceClassification(cfg).eval()


def lm_batch(batch=3, length=7, seed=1):
    ids = torch.randint(0, 200, (batch, length), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids}


def cls_batch(seed=1):
    ids = torch.randint(0, 200, (3, 7), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": torch.tensor([0, 1, 3])}


def clean_grads(model, batch):
    return NoDefence().attach(model).step(batch)[1]


# -- DAGER's Gaussian noise ---------------------------------------------------------------------
@pytest.mark.parametrize("sigma", [1e-3, 1e-2, 1e-1])
def test_gaussian_noise_has_exact_variance_on_every_gradient(sigma):
    model = tiny_gpt2()
    defence = GaussianNoise(sigma, seed=7).attach(model)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    defence.defend_()
    noise = torch.cat([g.flatten() for g in defence.export().values()]).double()
    n = noise.numel()
    assert n == sum(p.numel() for p in model.parameters())  # every tensor, attention included
    # Sample variance of n iid N(0, sigma^2) draws has std sigma^2 * sqrt(2 / n): a 6-sigma band.
    assert abs(noise.pow(2).mean() - sigma**2) <= 6 * sigma**2 * math.sqrt(2 / n)
    assert abs(noise.mean()) <= 6 * sigma / math.sqrt(n)


def test_gaussian_noise_is_added_to_the_real_gradient_and_seeded():
    batch = lm_batch()
    clean = clean_grads(tiny_gpt2(), batch)
    a = GaussianNoise(0.01, seed=3).attach(tiny_gpt2()).step(batch)[1]
    b = GaussianNoise(0.01, seed=3).attach(tiny_gpt2()).step(batch)[1]
    c = GaussianNoise(0.01).attach(tiny_gpt2()).step(batch)[1]
    for name in clean:
        assert torch.equal(a[name], b[name])
        assert not torch.equal(a[name], c[name])
    residual = torch.cat([(a[k] - clean[k]).flatten() for k in clean]).double()
    n = residual.numel()
    assert abs(residual.pow(2).mean() - 1e-4) <= 6 * 1e-4 * math.sqrt(2 / n)


def test_functional_add_noise_variance():
    grads = {"w": torch.zeros(300, 100), "b": torch.zeros(100)}
    noisy = add_noise(grads, 0.1, seed=0)
    flat = torch.cat([v.flatten() for v in noisy.values()]).double()
    assert abs(flat.pow(2).mean() - 0.01) <= 6 * 0.01 * math.sqrt(2 / flat.numel())
    assert torch.equal(grads["w"], torch.zeros(300, 100))  # input untouched


# -- pruning ------------------------------------------------------------------------------------
@pytest.mark.parametrize("fraction", [0.5, 0.9, 0.99])
def test_pruning_zeroes_exactly_the_smallest_fraction_per_tensor(fraction):
    model = tiny_gpt2()
    defence = Pruning(fraction).attach(model)
    gen = torch.Generator().manual_seed(0)
    original = {}
    for name, p in model.named_parameters():
        p.grad = torch.randn(p.shape, generator=gen)  # continuous: no ties, no zeros
        original[name] = p.grad.clone()
    defence.defend_()
    for name, g in defence.export().items():
        before = original[name]
        k = round(fraction * before.numel())
        pruned = g == 0
        assert int(pruned.sum()) == k, name
        assert torch.equal(g[~pruned], before[~pruned])  # survivors unchanged
        if 0 < k < before.numel():
            assert before[~pruned].abs().min() > before[pruned].abs().max()


def test_prune_non_contiguous_and_functional():
    g = torch.arange(1.0, 13.0).reshape(3, 4).t()  # non-contiguous view
    prune_(g, 0.5)
    assert torch.equal(g, torch.tensor([[0.0, 0, 9], [0, 0, 10], [0, 7, 11], [0, 8, 12]]))
    grads = {"x": torch.tensor([3.0, -1.0, 2.0, -4.0])}
    assert torch.equal(prune(grads, 0.5)["x"], torch.tensor([3.0, 0.0, 0.0, -4.0]))
    assert torch.equal(grads["x"], torch.tensor([3.0, -1.0, 2.0, -4.0]))
    assert torch.equal(prune({"x": torch.ones(3)}, 1.0)["x"], torch.zeros(3))


# -- Soteria --------------------------------------------------------------------------------------
def soteria_ratios_by_loop(model, layer, batch):
    """Independent reference: one backward per feature, ratio = sum_b ||ds_bf/dX_b|| / (|s_bf| + 0.1)."""
    captured = {}
    h1 = model.get_input_embeddings().register_forward_hook(lambda m, a, out: captured.setdefault("x", out))
    h2 = layer.register_forward_pre_hook(lambda m, a: captured.setdefault("r", a[0]))
    model(**batch)
    h1.remove(), h2.remove()
    x, r = captured["x"], captured["r"]
    ratios = []
    for f in range(r.shape[-1]):
        per_sample = []
        for b in range(r.shape[0]):
            (g,) = torch.autograd.grad(r[b, :, f].sum(), x, retain_graph=True)
            per_sample.append(g[b].norm() / (r[b, :, f].sum().abs() + 0.1))
        ratios.append(torch.stack(per_sample).sum())
    return torch.stack(ratios)


@pytest.mark.parametrize("arch", ["gpt2", "bert"])
def test_soteria_prunes_the_features_with_smallest_ratio_in_the_first_mlp_only(arch):
    if arch == "gpt2":  # Conv1D weight is (in, out): features are rows
        model, batch = tiny_gpt2(), lm_batch()
        name, layer, dim = "transformer.h.0.mlp.c_fc.weight", model.transformer.h[0].mlp.c_fc, 0
    else:  # nn.Linear weight is (out, in): features are columns
        model, batch = tiny_bert(), cls_batch()
        name, layer, dim = (
            "bert.encoder.layer.0.intermediate.dense.weight",
            model.bert.encoder.layer[0].intermediate.dense,
            1,
        )
    clean = clean_grads(model, batch)
    defence = Soteria(0.75).attach(model)
    _, shared = defence.step(batch)
    assert defence.targets == [(name, dim)]
    expected = set(torch.topk(soteria_ratios_by_loop(model, layer, batch), 24, largest=False).indices.tolist())
    assert set(defence.pruned.tolist()) == expected  # 0.75 * 32 features
    weight = shared[name]
    zero = (weight == 0).all(dim=1 - dim)
    assert set(torch.nonzero(zero).flatten().tolist()) == expected
    kept = [i for i in range(32) if i not in expected]
    assert torch.equal(weight.index_select(dim, torch.tensor(kept)), clean[name].index_select(dim, torch.tensor(kept)))
    for other in clean:
        if other != name:
            assert torch.equal(shared[other], clean[other]), other


def test_soteria_prunes_every_mlp_input_fed_by_the_representation_llama():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, vocab_size=200
    )
    model = transformers.LlamaForCausalLM(cfg).eval()
    defence = Soteria(0.5).attach(model)
    _, shared = defence.step(lm_batch())
    gate, up = shared["model.layers.0.mlp.gate_proj.weight"], shared["model.layers.0.mlp.up_proj.weight"]
    down = shared["model.layers.0.mlp.down_proj.weight"]
    pruned = defence.pruned.tolist()
    assert len(pruned) == 16
    for w in (gate, up):
        assert torch.nonzero((w == 0).all(dim=0)).flatten().tolist() == sorted(pruned)
    assert not (down == 0).all(dim=0).any()  # down_proj reads the MLP's hidden state, not r


# -- DP-SGD (Opacus) ------------------------------------------------------------------------------
def tiny_causal_bert(seed=0):
    """BERT run causally with its LM head (tied, vocabulary bias): the default decoder's structure."""
    torch.manual_seed(seed)
    cfg = transformers.BertConfig(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=2, intermediate_size=64, vocab_size=200,
        is_decoder=True,
    )
    return transformers.BertLMHeadModel(cfg).eval()


@pytest.mark.parametrize("make_model", [tiny_gpt2, tiny_causal_bert])
def test_dpsgd_without_noise_is_the_mean_of_per_sample_clipped_gradients(make_model):
    batch = lm_batch(batch=3, length=6)
    clip = 0.05
    model = make_model()
    expected = None
    for i in range(3):  # per-sample gradients, one sample at a time
        g = clean_grads(model, {k: v[i : i + 1] for k, v in batch.items()})
        norm = torch.sqrt(sum(v.pow(2).sum() for v in g.values()))
        scale = min(1.0, clip / (float(norm) + 1e-6))
        expected = {k: v * scale / 3 for k, v in g.items()} if expected is None else {
            k: expected[k] + v * scale / 3 for k, v in g.items()
        }
    defence = DPSGD(max_grad_norm=clip, noise_multiplier=0.0).attach(make_model())
    _, shared = defence.step(batch)
    assert shared.keys() == expected.keys()
    for k in expected:
        torch.testing.assert_close(shared[k], expected[k], rtol=1e-4, atol=1e-7)
    assert defence.epsilon == math.inf  # no noise, no privacy


@pytest.mark.parametrize("make_model,batch", [(tiny_gpt2, lm_batch()), (tiny_bert, cls_batch())])
def test_dpsgd_reports_finite_growing_epsilon(make_model, batch):
    defence = DPSGD(max_grad_norm=1.0, noise_multiplier=1.0, sample_rate=0.1, seed=0).attach(make_model())
    assert defence.epsilon == 0.0
    _, shared = defence.step(batch)
    eps1 = defence.epsilon
    defence.step(batch)
    eps2 = defence.report()["epsilon"]
    assert 0 < eps1 < eps2 < math.inf
    assert all(torch.isfinite(v).all() for v in shared.values())
    # noise std z*C/B per element dominates the clipped mean (norm <= C): the export is mostly noise
    flat = torch.cat([v.flatten() for v in shared.values()])
    assert flat.std() == pytest.approx(1.0 / 3, rel=0.05)


def test_dpsgd_names_the_parameter_opacus_cannot_handle():
    class Odd(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(4, 2)
            self.unused = nn.Parameter(torch.zeros(3))

    model = Odd()
    defence = DPSGD().attach(model)
    batch = {"x": torch.randn(5, 4)}
    with pytest.raises(RuntimeError, match=r"no per-sample gradient for \[.*'unused'.*\] of Odd"):
        defence.step(batch, lambda m, b: m.linear(b["x"]).pow(2).mean())


# -- AEGIS through the interface, names, and the common step --------------------------------------
def test_aegis_defence_exports_the_masked_non_attention_gradient():
    model = tiny_gpt2()
    defence = Aegis(AegisConfig(preset="verification")).attach(model)
    for p in model.parameters():
        p.grad = None
    defence.backward(lm_batch())
    with pytest.raises(RuntimeError, match="not masked"):
        defence.export()  # fails closed before defend_
    defence.defend_()
    shared = defence.export()
    assert shared and not any(".attn." in k for k in shared)
    clean = clean_grads(tiny_gpt2(), lm_batch())
    assert not torch.equal(shared["transformer.h.0.mlp.c_fc.weight"], clean["transformer.h.0.mlp.c_fc.weight"])


@pytest.mark.parametrize(
    "spec,kind,attrs",
    [
        ("none", NoDefence, {}),
        ("aegis", Aegis, {"name": "aegis-verification"}),
        ("aegis-sentences", Aegis, {"name": "aegis-sentences"}),
        ("dp-noise-0.001", GaussianNoise, {"sigma": 1e-3, "name": "dp-noise-0.001"}),
        ("dp-noise-1e-2", GaussianNoise, {"sigma": 1e-2}),
        ("prune-99", Pruning, {"fraction": 0.99, "name": "prune-99"}),
        ("soteria", Soteria, {"fraction": 0.8, "name": "soteria-80"}),
        ("dp-sgd", DPSGD, {"max_grad_norm": 1.0, "noise_multiplier": 1.0, "name": "dp-sgd-C1-z1"}),
        ("dp-sgd-c0.5-z2", DPSGD, {"max_grad_norm": 0.5, "noise_multiplier": 2.0}),
    ],
)
def test_make_defence_parses_names(spec, kind, attrs):
    defence = make_defence(spec)
    assert type(defence) is kind
    for attr, value in attrs.items():
        assert getattr(defence, attr) == value


@pytest.mark.parametrize("spec", ["dp-noise", "prune-abc", "shield", "prune-150"])
def test_make_defence_rejects_bad_names(spec):
    with pytest.raises(ValueError):
        make_defence(spec)


def test_every_baseline_runs_a_full_optimizer_step_like_the_benchmark():
    batch = lm_batch()
    for defence in [NoDefence(), Aegis(), *default_baselines()]:
        model = tiny_gpt2()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        defence.attach(model, opt)
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        opt.zero_grad(set_to_none=True)
        loss = defence.backward(batch)
        defence.defend_()
        shared = defence.export()
        opt.step()
        assert torch.isfinite(loss), defence.name
        assert set(shared) == {n for n, p in model.named_parameters() if p.requires_grad}, defence.name
        assert any(not torch.equal(before[n], p) for n, p in model.named_parameters()), defence.name
        defence.detach()


def test_attach_is_per_model():
    defence = Pruning(0.5).attach(tiny_gpt2())
    with pytest.raises(RuntimeError, match="one defence per model"):
        defence.attach(tiny_gpt2())


def test_baselines_import_with_torch_alone():
    code = (
        "import sys; sys.modules['opacus'] = None; sys.modules['flwr'] = None\n"
        "import aegis.baselines as b\n"
        "d = b.DPSGD()\n"  # constructing is fine; attaching needs Opacus
        "import torch\n"
        "try:\n"
        "    d.attach(torch.nn.Linear(2, 2))\n"
        "except ImportError as e:\n"
        "    assert 'pip install' in str(e); print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "ok", out.stderr
