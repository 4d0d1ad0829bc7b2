"""The numba CPU flood (aegis_kernels.cpu) against the reference, bit for bit: the keystream words over
random keys and counters (the 32-bit carry of the counter included), and the exported values and
stats of rows / matrix floods of odd shapes in fp32 / bf16 / fp16 at random offsets, through the
registered ops. Also: fail-closed inputs, chunk and thread splits, the thread rule and torch's
restored thread count, and the reference fallback (warned once) without numba."""
from __future__ import annotations

import math
import warnings

import pytest
import torch

import aegis_kernels
from aegis_kernels import cpu, ops
from aegis_kernels import reference as ref

pytest.importorskip("numba")
from aegis_kernels.cpu import flood as cpu_flood  # noqa: E402
from aegis_kernels.cpu import threads as cpu_threads  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(BITS[t.dtype])


def _random_key(gen: torch.Generator) -> torch.Tensor:
    return torch.randint(0, 2**32, (ref.KEY_WORDS,), generator=gen, dtype=torch.int64)


@pytest.fixture
def reference_not_called(monkeypatch):
    """The registered CPU ops must not fall back to the reference's noise (the path under test is numba's)."""

    def refuse(*args, **kwargs):
        raise AssertionError("the CPU op drew its noise from the reference")

    monkeypatch.setattr(ref, "noise_components", refuse)
    monkeypatch.setattr(ref, "flood_many_", refuse)


def _reference_flood(grad, mode, params, key, offset):
    """reference.flood, with the reference's own noise even while ``reference_not_called`` is active."""
    per = ref.words_per_element(grad.dtype)
    za, zb = _REF_NOISE(grad.numel(), key, offset, per, grad.device)
    return ref.flood(grad, mode, params, z=za.view(grad.shape), zb=None if zb is None else zb.view(grad.shape))


_REF_NOISE = ref.noise_components


# ----------------------------------------------------------------------------- keystream words
@pytest.mark.parametrize("seed", range(4))
def test_keystream_words_equal_the_reference(seed):
    """Random keys, random 64-bit counters, both domains; a run across the low word's carry."""
    gen = torch.Generator().manual_seed(seed)
    key = _random_key(gen)
    starts = [int(torch.randint(0, 2**62, (1,), generator=gen)) * 4 + seed, 2**32 - 37, 2**64 - 300, 0]
    for start in starts:
        for domain in (ref.NOISE_DOMAIN, ref.DERIVE_DOMAIN):
            count = 300
            got = cpu_flood.keystream(key, start, count, domain)
            blocks = torch.tensor([(start + i) & (2**64 - 1) for i in range(count)], dtype=torch.uint64)
            expect = ref.keystream(key, blocks.view(torch.int64), domain)
            assert torch.equal(got, expect), (seed, start, domain)


def test_keystream_is_rfc8439_chacha8_not_a_copy_of_the_reference():
    """An independent check: the words against a plain-Python ChaCha8 of the documented state."""
    from test_reference import _our_state, _py_chacha

    key = aegis_kernels.key_from_int(0x0F1E2D3C4B5A69788796A5B4C3D2E1F0)
    got = cpu_flood.keystream(key, 2**32 - 1, 2)
    for i, block in enumerate((2**32 - 1, 2**32)):
        assert got[i].tolist() == _py_chacha(_our_state(key, block, ref.NOISE_DOMAIN), 8)


def test_torch_elementwise_functions_do_not_depend_on_position():
    """What bit-for-bit equality rests on: torch's fp32 log / cos / sin / sqrt give an element the same
    result in a long tensor, in a short one and alone (no separate vector body and scalar tail), on the
    argument ranges of the flood."""
    gen = torch.Generator().manual_seed(11)
    args = {torch.log: torch.rand(20011, generator=gen) * 0.5 + 2.0**-33,
            torch.cos: (torch.rand(20011, generator=gen) * 2 - 1) * math.pi,
            torch.sin: (torch.rand(20011, generator=gen) * 2 - 1) * math.pi,
            torch.sqrt: torch.rand(20011, generator=gen) * 46}
    for fn, x in args.items():
        whole = fn(x)
        pieces = torch.cat([fn(x[i : i + 7]) for i in range(0, 3003, 7)])
        assert torch.equal(pieces, whole[:3003]), fn.__name__
        assert torch.equal(fn(x[5:]), whole[5:]), fn.__name__
        assert all(torch.equal(fn(x[i]), whole[i]) for i in range(0, 200, 13)), fn.__name__


# ----------------------------------------------------------------------------- floods, bit for bit
SHAPES = {"rows": [(1, 1), (7, 5), (37, 29), (301, 3), (4099, 17)], "matrix": [(1,), (13,), (5, 7, 3), (333, 101),
                                                                           (100003,)]}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mode", ["rows", "matrix"])
def test_flood_equals_the_reference_bit_for_bit(mode, dtype, reference_not_called):
    """torch.ops.aegis.flood on CPU: out and stats identical to the reference for random keys, offsets,
    parameters (clip active or not, thresholds that split the rows) and odd shapes, several chunks included."""
    gen = torch.Generator().manual_seed(10 * DTYPES.index(dtype) + len(mode))
    for shape in SHAPES[mode]:
        row_scale = torch.rand(shape[:1] + (1,) * (len(shape) - 1), generator=gen)  # rows of unequal norms
        g = (torch.randn(shape, generator=gen) * row_scale).to(dtype)
        key = _random_key(gen)
        offset = 16 * int(torch.randint(0, 2**40, (1,), generator=gen))
        norm = g.float().norm().item()
        for params in ([0.3, 0.7, 2.0, 0.5], [1.0, 1e-3, 0.01 * norm, 0.0], [0.0, 4.0, math.inf, 0.0]):
            p = torch.tensor(params)
            out, stats = torch.ops.aegis.flood(g, mode, p, key, offset)
            expect, expect_stats = _reference_flood(g, mode, p, key, offset)
            assert out.dtype == dtype and out.shape == g.shape
            assert torch.equal(_bits(out), _bits(expect)), (shape, params)
            assert torch.equal(stats, expect_stats), (shape, params)


def test_flood_of_a_non_contiguous_gradient_leaves_it(reference_not_called):
    base = torch.randn(40, 33, generator=torch.Generator().manual_seed(3))
    g = base.t()
    before = g.clone()
    key = aegis_kernels.key_from_int(99)
    for mode in ("rows", "matrix"):
        p = torch.tensor([0.5, 1.0, 3.0, 0.1])
        out, _ = torch.ops.aegis.flood(g, mode, p, key, 48)
        assert torch.equal(g, before) and out.is_contiguous()
        assert torch.equal(_bits(out), _bits(_reference_flood(g, mode, p, key, 48)[0]))


def _group(gen):
    grads = [torch.randn(301, 7, generator=gen), torch.randn(5, generator=gen).to(torch.float16),
             torch.randn(40, 9, generator=gen).t(), torch.randn(70001, generator=gen),
             torch.randn(9, 33, generator=gen).to(torch.bfloat16), torch.zeros(0, 3), torch.randn(1, 1, generator=gen)]
    modes = "rows,matrix,matrix,matrix,rows,rows,rows"
    params = torch.tensor([[0.3, 1.0, 2.0, 0.1], [0.0, 4.0, math.inf, 0.0], [0.3, 1.0, 0.5, 0.0],
                           [1.0, 0.1, 10.0, 0.0], [1.0, 0.5, 1.0, 0.2], [0.3, 1.0, 1.0, 0.0], [0.2, 0.3, 1.0, 0.0]])
    return grads, modes, params


@pytest.mark.parametrize("threads", [1, 3])
def test_grouped_flood_equals_the_reference_in_place(threads, reference_not_called):
    """flood_ (what mask_() calls) over mixed dtypes, a non-contiguous and an empty tensor, split among threads."""
    grads, modes, params = _group(torch.Generator().manual_seed(threads))
    clean = [g.clone() for g in grads]
    key = _random_key(torch.Generator().manual_seed(7))
    ptrs = [g.data_ptr() for g in grads]
    cpu.set_threads(threads)
    try:
        torch.ops.aegis.flood_(grads, modes, params, key)
    finally:
        cpu.set_threads(None)
    offsets = ref.stream_offsets([(g.numel(), g.dtype) for g in clean])
    for g, c, mode, p, off, ptr in zip(grads, clean, modes.split(","), params, offsets, ptrs):
        assert g.data_ptr() == ptr and g.stride() == c.stride()  # in place, layout kept
        assert torch.equal(_bits(g), _bits(_reference_flood(c, mode, p, key, off)[0]))


def test_keyed_flood_runs_the_cpu_path(reference_not_called):
    grads, modes, params = _group(torch.Generator().manual_seed(5))
    clean = [g.clone() for g in grads]
    master = aegis_kernels.key_from_int(0xABCDEF)
    state = torch.cat([master, torch.tensor([11])])
    torch.ops.aegis.flood_keyed_(grads, modes, params, state)
    assert state[8].item() == 12
    key = ref.derive_key(master, 11)
    offsets = ref.stream_offsets([(g.numel(), g.dtype) for g in clean])
    for g, c, mode, p, off in zip(grads, clean, modes.split(","), params, offsets):
        assert torch.equal(_bits(g), _bits(_reference_flood(c, mode, p, key, off)[0]))


def test_no_gradient_residue_stays_in_the_scratch_pool_after_export():
    """A shield's step on CPU through the numba flood: after export() the module's reused buffers hold
    nothing (they held the last chunk's rho clip(G), the bf16 gradient's fp32 copy and the noise)."""
    import transformers

    import aegis
    from aegis.exposure import IN_MEMORY

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=97, n_positions=16)
    model = transformers.GPT2LMHeadModel(cfg).to(torch.bfloat16)  # bf16: the flood copies through g32 / out32
    shield = aegis.protect(model, None, aegis.AegisConfig(preset="sentences", exposure_state=IN_MEMORY))
    ids = torch.randint(0, 97, (8, 12), generator=torch.Generator().manual_seed(1))
    model(input_ids=ids, labels=ids).loss.backward()
    shield.mask_()
    exported = shield.export()
    assert exported and cpu_flood._POOL, "the step did not run the numba flood"
    arrays = [getattr(buf, name) for buf in cpu_flood._POOL
              for name in ("words", "x", "theta", "cos", "sv", "sig", "g32", "out32")]
    assert all(not a.any() for a in arrays)


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
@pytest.mark.parametrize("mode", ["rows", "matrix"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_non_finite_input_poisons_everything(bad, mode, dtype):
    """Fail closed, as the reference: one non-finite element (here in the last chunk) -> all NaN."""
    g = torch.randn(9000, 5).to(dtype)
    g[8999, 4] = bad
    key = aegis_kernels.key_from_int(5)
    out, stats = torch.ops.aegis.flood(g, mode, torch.tensor([0.0, 1.0, 1.0, 0.0]), key, 0)
    assert out.isnan().all() and stats.isnan().all()
    grads = [torch.randn(3, 3), g.clone()]
    torch.ops.aegis.flood_(grads, f"matrix,{mode}", torch.tensor([[0.3, 1.0, 1.0, 0.0]] * 2), key)
    assert grads[1].isnan().all() and not grads[0].isnan().any()


def test_bad_arguments_are_named():
    key = aegis_kernels.key_from_int(1)
    with pytest.raises(ValueError, match="stream_offsets"):
        cpu_flood.flood(torch.randn(4, 4), "rows", torch.zeros(4), key, 8)
    with pytest.raises(ValueError, match="key must be"):
        cpu_flood.flood(torch.randn(4, 4), "rows", torch.zeros(4), key[:4], 0)
    with pytest.raises(ValueError, match="mode='matrix'"):
        cpu_flood.flood(torch.randn(4), "rows", torch.zeros(4), key, 0)
    with pytest.raises(ValueError, match="same length"):
        cpu_flood.flood_([torch.randn(3)], "rows,matrix", torch.zeros(1, 4), key)
    with pytest.raises(ValueError, match="params must be"):
        cpu_flood.flood_([torch.randn(3)], "matrix", torch.zeros(2, 4), key)
    with pytest.raises(ValueError, match="threads=0"):
        cpu_flood.flood(torch.randn(4, 4), "rows", torch.zeros(4), key, 0, threads=0)
    with pytest.raises(ValueError, match="threads="):
        cpu.set_threads(-2)


# ----------------------------------------------------------------------------- threads
def test_thread_rule_is_the_command_lines(monkeypatch):
    """1 thread at load >= 0.75, torch's count below it; read once per process until set_threads."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: 6)
    monkeypatch.setattr(cpu_threads.os, "getloadavg", lambda: (0.8, 0.0, 0.0))
    assert cpu.default_threads() == 1
    monkeypatch.setattr(cpu_threads.os, "getloadavg", lambda: (0.5, 0.0, 0.0))
    assert cpu.default_threads() == 6
    cpu.set_threads(None)
    assert cpu.flood_threads() == 6
    monkeypatch.setattr(cpu_threads.os, "getloadavg", lambda: (3.0, 0.0, 0.0))
    assert cpu.flood_threads() == 6  # decided at the first flood of the process
    assert cpu.flood_threads(2) == 2
    cpu.set_threads(3)
    assert cpu.flood_threads() == 3
    cpu.set_threads(None)
    assert cpu.flood_threads() == 1  # read again
    cpu.set_threads(None)


def test_flood_runs_torch_on_one_thread_and_restores_the_callers_setting(monkeypatch):
    seen = []
    real_log = torch.log

    def log(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return real_log(*args, **kwargs)

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        monkeypatch.setattr(cpu_flood.torch, "log", log)
        torch.ops.aegis.flood_([torch.randn(50, 50)], "matrix", torch.tensor([[0.3, 1.0, 1.0, 0.0]]),
                               aegis_kernels.key_from_int(3))
        assert seen and set(seen) == {1}
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


# ----------------------------------------------------------------------------- without numba
def test_without_numba_the_reference_serves_cpu_with_one_warning(monkeypatch):
    monkeypatch.setattr(cpu, "HAS_NUMBA", False)
    monkeypatch.setattr(ops, "_WARNED", False)
    g = torch.randn(6, 5)
    key = aegis_kernels.key_from_int(8)
    p = torch.tensor([0.3, 1.0, 2.0, 0.0])
    with pytest.warns(UserWarning, match="aegis-flood\\[cpu\\]"):
        out, _ = torch.ops.aegis.flood(g, "rows", p, key, 0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        grads = [g.clone()]
        torch.ops.aegis.flood_(grads, "rows", p[None], key)
    assert torch.equal(out, ref.flood(g, "rows", p, key, 0)[0]) and torch.equal(grads[0], out)
