"""The shield's flood as one CUDA graph that reads every gradient's address from a device table
(``aegis_kernels.triton.addressed``, ``aegis_kernels.cuda_graph.GraphedFlood``).

CPU: what cannot be addressed is named. GPU (``-m gpu``): the addressed launches and every replay give the bits of
eager ``flood_keyed_`` + ``norms`` under the same key while the gradients move between steps; a non-finite rows
tensor is poisoned; a fresh key per replay; a graph flooding the wrong memory cannot export a clean gradient; the
embedding-row attack reads the batch's tokens from a clean gradient and not from a replayed export.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

import aegis  # noqa: E402
import aegis_kernels  # noqa: E402,F401  (registers the CUDA kernels)
from aegis.attacks.embedding_norm import embedding_norm_leak  # noqa: E402
from aegis.exposure import ExposurePolicy  # noqa: E402
from aegis_kernels import cuda_graph  # noqa: E402
from aegis_kernels import triton as TF  # noqa: E402
from aegis_kernels.triton.addressed import STATE, AddressedFlood, unaddressable  # noqa: E402

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
MASTER = [0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344, 0xA4093822, 0x299F31D0, 0x082EFA98, 0xEC4E6C89]
# rows (long rows: the one-pass kernels), matrix tensors over several tiles, one tile, part of one
SHAPES = [(1000, 768), (64, 512), (3072, 768), (768,), (5,), (40000,)]
MODES = "rows,rows,matrix,matrix,matrix,matrix"


def test_what_cannot_be_addressed_is_named():
    assert unaddressable([], "") == "no tensors"
    assert unaddressable([torch.zeros(4, 768)], "rows") == "not on a CUDA device"


def _tensors(gen, dtype=torch.float32):
    return [torch.randn(s, device="cuda", generator=gen).to(dtype) for s in SHAPES]


def _params(T):
    rows = [[0.7, 0.05, 2.0, 0.1]] * 2 + [[0.5, 0.03, 10.0, 0.0]] * (T - 2)
    return torch.tensor(rows, dtype=torch.float32, device="cuda")


def _eager(clean, params, step):
    """The reference path: flood_keyed_ on copies, then their norms."""
    out = [c.clone() for c in clean]
    state = torch.tensor([*MASTER, step], dtype=torch.int64, device="cuda")
    TF.flood_keyed_(out, MODES, params, state)
    return out, TF.norms(out)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_addressed_launch_equals_flood_keyed_and_norms_wherever_the_tensors_are(dtype):
    gen = torch.Generator(device="cuda").manual_seed(0)
    params = _params(len(SHAPES))
    tensors = _tensors(gen, dtype)
    inputs = torch.zeros(STATE + len(SHAPES), dtype=torch.int64, device="cuda")
    flood = AddressedFlood(tensors, MODES, params, inputs)
    for step in range(3):
        if step:
            tensors = _tensors(gen, dtype)  # new tensors at new addresses, the same layout
        clean = [t.clone() for t in tensors]
        inputs.copy_(torch.tensor([*MASTER, step, *(t.data_ptr() for t in tensors)]))
        got = flood.launch()
        want, want_norms = _eager(clean, params, step)
        assert all(torch.equal(a, b) for a, b in zip(tensors, want)), step
        assert torch.equal(got, want_norms)
        assert int(inputs[STATE - 1]) == step + 1  # the key state advanced on the device


@pytest.mark.gpu
@gpu
def test_gpu_graph_replays_over_moved_tensors_bit_for_bit_with_a_fresh_key_each_step():
    gen = torch.Generator(device="cuda").manual_seed(1)
    params = _params(len(SHAPES))
    graphed = cuda_graph.GraphedFlood(torch.device("cuda"))
    for step in range(6):
        tensors = _tensors(gen)  # zero_grad(set_to_none=True): every step new gradients
        clean = [t.clone() for t in tensors]
        got = graphed(tensors, MODES, params, MASTER, step)
        want, want_norms = _eager(clean, params, step)
        assert all(torch.equal(a, b) for a, b in zip(tensors, want)), step
        assert torch.equal(got, want_norms), step
    assert (graphed.captures, graphed.replays, graphed.disabled) == (1, 4, None)  # eager, capture, replays
    # the same clean tensor replayed at two steps: the difference is the two noises, variance 2 sigma^2 (a key
    # repeated even in part would cancel them), to 6 sigma of the sample variance of n normals
    same = torch.randn(SHAPES[2], device="cuda", generator=gen)
    outs = []
    for step in (10, 11):
        tensors = _tensors(gen)
        tensors[2].copy_(same)
        graphed(tensors, MODES, params, MASTER, step)
        outs.append(tensors[2].double())
    n, sigma = same.numel(), float(params[2, 1])
    ratio = float((outs[0] - outs[1]).var()) / (2 * sigma**2)
    assert abs(ratio - 1) < 6 * (2 / n) ** 0.5


@pytest.mark.gpu
@gpu
def test_gpu_replayed_flood_poisons_a_non_finite_rows_tensor_and_its_norm():
    gen = torch.Generator(device="cuda").manual_seed(2)
    params = _params(len(SHAPES))
    graphed = cuda_graph.GraphedFlood(torch.device("cuda"))
    for step in range(3):  # eager, capture, replay
        tensors = _tensors(gen)
        if step == 2:
            tensors[0][7, 3] = float("inf")
        norms = graphed(tensors, MODES, params, MASTER, step)
    assert graphed.replays == 1
    assert bool(torch.isnan(tensors[0]).all())  # the whole tensor: a step never goes out half clean
    assert bool(torch.isnan(norms[0])) and bool(torch.isfinite(norms[1:]).all())


@pytest.mark.gpu
@gpu
def test_gpu_unaddressable_gradients_are_flooded_eagerly():
    gen = torch.Generator(device="cuda").manual_seed(3)
    shapes, modes = [(300, 384), (5000,)], "rows,matrix"  # short rows: no one-pass kernels
    params = _params(2)
    graphed = cuda_graph.GraphedFlood(torch.device("cuda"))
    assert "short rows" in unaddressable([torch.zeros(s, device="cuda") for s in shapes], modes)
    for step in range(3):
        tensors = [torch.randn(s, device="cuda", generator=gen) for s in shapes]
        clean = [t.clone() for t in tensors]
        assert graphed(tensors, modes, params, MASTER, step) is None
        want = [c.clone() for c in clean]
        TF.flood_keyed_(want, modes, params, torch.tensor([*MASTER, step], dtype=torch.int64, device="cuda"))
        assert all(torch.equal(a, b) for a, b in zip(tensors, want))
    assert graphed.captures == graphed.replays == 0


def _gpt2_on_gpu():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=2048, n_positions=64, n_embd=512, n_layer=2, n_head=8)
    return transformers.GPT2LMHeadModel(cfg).cuda().eval()  # 512-wide rows: the one-pass kernels


@pytest.mark.gpu
@gpu
def test_gpu_a_graph_that_floods_the_wrong_memory_cannot_export_a_clean_gradient(monkeypatch):
    """The attack on the table itself: a stale address table would leave the new gradients clean. The checksum
    (norms of what was flooded, taken in the graph) then disagrees with the gradients', and export() refuses."""
    model = _gpt2_on_gpu()
    shield = aegis.protect(model, config=aegis.AegisConfig(exposure=ExposurePolicy.OFF))
    ids = torch.randint(0, 2048, (1, 24), device="cuda")
    tables, stale = [], [False]
    original = cuda_graph._Staging.load

    def load(self, values):  # fresh key words and step; with ``stale``, the previous step's addresses
        if len(values) > STATE:
            values = values[:STATE] + tables[-1][STATE:] if stale[0] else values
            tables.append(list(values))
        return original(self, values)

    monkeypatch.setattr(cuda_graph._Staging, "load", load)
    for _ in range(3):  # eager, capture, replay
        model.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids).loss.backward()
        shield.mask_()
        shield.export()
    assert shield.flood_graph_counts == {"captures": 1, "replays": 1}
    held = [p.grad for p in model.parameters() if p.grad is not None]  # the old gradients stay allocated
    model.zero_grad(set_to_none=True)
    model(input_ids=ids, labels=ids).loss.backward()
    clean = model.transformer.wte.weight.grad.clone()
    stale[0] = True
    shield.mask_()
    assert shield.flood_graph_counts["replays"] == 2
    assert torch.equal(model.transformer.wte.weight.grad, clean)  # the replay flooded the stale memory...
    with pytest.raises(RuntimeError, match="changed after mask_"):  # ...and nothing clean leaves
        shield.export()
    del held


@pytest.mark.gpu
@gpu
def test_gpu_embedding_rows_attack_reads_a_clean_gradient_and_not_a_replayed_export():
    model = _gpt2_on_gpu()
    batch = torch.tensor([[11, 250, 999, 1500, 42, 7, 600, 1234]], device="cuda")
    tokens = set(batch.flatten().tolist())
    model(input_ids=batch, labels=batch).loss.backward()
    clean = {n: p.grad.detach().float().cpu() for n, p in model.named_parameters()}
    leak = embedding_norm_leak(model, clean, batch_size=1)
    assert leak.tokens >= tokens  # undefended: the exact bag of tokens
    shield = aegis.protect(model, config=aegis.AegisConfig(exposure=ExposurePolicy.OFF))
    recalls = []
    for step in range(5):  # eager, capture, replays
        model.zero_grad(set_to_none=True)
        model(input_ids=batch, labels=batch).loss.backward()
        shield.mask_()
        export = {n: t.float().cpu() for n, t in shield.export().items()}
        if step >= 2:
            found = embedding_norm_leak(model, export, batch_size=1)
            top = sorted(found.scores, key=found.scores.get, reverse=True)[: len(tokens)] if found.scores else []
            recalls.append(len(tokens & set(top)) / len(tokens))
    assert shield.flood_graph_counts["replays"] == 3
    # chance: 8 of 2048 rows; 6 sigma of a hypergeometric draw of 8 is below 2 hits
    assert max(recalls) <= 2 / len(tokens)
