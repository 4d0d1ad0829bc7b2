"""torch.ops.aegis registrations on CPU: schema / fake / aliasing (opcheck), fake shapes, the grouped
and keyed semantics, and torch.compile. (CUDA: tests/test_kernels.py, -m gpu.)"""
from __future__ import annotations

import math

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import aegis_kernels
from aegis_kernels import reference as ref

CPU = torch.device("cpu")
KEY = aegis_kernels.key_from_int(0x6A09E667F3BCC908BB67AE8584CAA73B3C6EF372FE94F82BA54FF53A5F1D36F1)


def _grads():
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(5, 3, generator=gen), torch.randn(7, generator=gen), torch.randn(4, 6, generator=gen).t(),
            torch.randn(6, 4, generator=gen).to(torch.bfloat16), torch.zeros(0, 3)]


MODES = "rows,matrix,matrix,rows,rows"
PARAMS = torch.tensor([[0.3, 1.0, 2.0, 0.1], [0.0, 4.0, math.inf, 0.0], [0.3, 1.0, 0.5, 0.0],
                       [1.0, 0.5, 1.0, 0.2], [0.3, 1.0, 1.0, 0.0]])


def _state(step: int) -> torch.Tensor:
    return torch.cat([KEY, torch.tensor([step])])


@pytest.mark.parametrize(
    "args",
    [
        (torch.randn(7, 5), "rows", torch.tensor([0.3, 1.0, 2.0, 0.1]), KEY, 16),
        (torch.randn(5, 7).t(), "matrix", torch.tensor([0.0, 8.0, math.inf, 0.0]), KEY, 0),
        (torch.randn(6, 4, dtype=torch.bfloat16), "rows", torch.tensor([0.3, 1.0, 0.5, 0.0]), KEY, 2**36),
        (torch.randn(2, 3, 4, dtype=torch.float16), "matrix", torch.tensor([0.5, 1.0, 1.0, 0.0]), KEY, 32),
        (torch.zeros(0, 4), "rows", torch.tensor([0.3, 1.0, 1.0, 0.0]), KEY, 0),
    ],
)
def test_opcheck_flood(args):
    torch.library.opcheck(torch.ops.aegis.flood.default, args)


def test_opcheck_flood_inplace_keyed_and_noise():
    torch.library.opcheck(torch.ops.aegis.flood_.default, (_grads(), MODES, PARAMS, KEY))
    torch.library.opcheck(torch.ops.aegis.flood_keyed_.default, (_grads(), MODES, PARAMS, _state(4)))
    for dtype in (torch.float32, torch.bfloat16):
        torch.library.opcheck(torch.ops.aegis.noise.default, ([3, 5], KEY, 16, dtype, CPU))


@pytest.mark.parametrize("mode,shape,stats_len", [("rows", (7, 5), 4), ("matrix", (2, 3, 4), 3), ("rows", (0, 4), 4)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fake_shapes(mode, shape, stats_len, dtype):
    """register_fake: out like grad (contiguous), stats float32 of 4 (rows) or 3 (matrix)."""
    with FakeTensorMode():
        g = torch.empty(shape, dtype=dtype)
        out, stats = torch.ops.aegis.flood(g, mode, torch.empty(4), torch.empty(8, dtype=torch.int64), 16)
        assert out.shape == shape and out.dtype == dtype and out.is_contiguous()
        assert stats.shape == (stats_len,) and stats.dtype == torch.float32
        z = torch.ops.aegis.noise(list(shape), torch.empty(8, dtype=torch.int64), 32, dtype, CPU)
        assert z.shape == shape and z.dtype == torch.float32


def test_fake_checks_mode_and_offset():
    with FakeTensorMode():
        key = torch.empty(8, dtype=torch.int64)
        with pytest.raises(ValueError, match="mode='matrix'"):
            torch.ops.aegis.flood(torch.empty(7), "rows", torch.empty(4), key, 0)
        with pytest.raises(ValueError, match="stream_offsets"):
            torch.ops.aegis.noise([3], key, 8, torch.float32, CPU)


def test_cpu_ops_are_the_reference():
    """The CPU ops equal the reference bit for bit (flood: the numba CPU flood; noise dispatches on ``device``)."""
    for dtype in (torch.float32, torch.float16):
        assert torch.equal(torch.ops.aegis.noise([3, 5], KEY, 16, dtype, CPU), ref.noise((3, 5), KEY, 16, dtype))
    g = torch.randn(7, 8, generator=torch.Generator().manual_seed(1))
    for mode in ("rows", "matrix"):
        p = torch.tensor([0.3, 1.0, 2.0, 0.5])
        out, stats = torch.ops.aegis.flood(g, mode, p, KEY, 32)
        expect, expect_stats = ref.flood(g, mode, p, KEY, 32)
        assert torch.equal(out, expect) and torch.equal(stats, expect_stats)
        assert out.data_ptr() != g.data_ptr()
    assert aegis_kernels.flood is aegis_kernels.ops.flood and aegis_kernels.noise is aegis_kernels.ops.noise


def test_flood_returns_a_fresh_contiguous_tensor_and_leaves_its_input():
    base = torch.randn(6, 5, generator=torch.Generator().manual_seed(2))
    g = base.t()
    before = g.clone()
    out, _ = torch.ops.aegis.flood(g, "matrix", torch.tensor([1.0, 0.0, math.inf, 0.0]), KEY, 0)
    assert torch.equal(g, before)
    assert out.is_contiguous() and out.data_ptr() != g.data_ptr()
    assert torch.equal(out, g)  # rho 1, sigma 0, no clip: the identity, as a copy


def test_grouped_flood_equals_per_tensor_floods_at_stream_offsets():
    grads = _grads()
    clean = [g.clone() for g in grads]
    torch.ops.aegis.flood_(grads, MODES, PARAMS, KEY)
    offsets = aegis_kernels.stream_offsets([(g.numel(), g.dtype) for g in clean])
    assert offsets == [0, 32, 48, 96, 128]
    for g, c, mode, p, off in zip(grads, clean, MODES.split(","), PARAMS, offsets):
        assert g.dtype == c.dtype and g.stride() == c.stride()  # in place, layout kept
        assert torch.equal(g, torch.ops.aegis.flood(c, mode, p, KEY, off)[0])


def test_grouped_flood_of_nothing():
    torch.ops.aegis.flood_([], "", torch.empty(0, 4), KEY)


def test_keyed_flood_derives_and_advances_the_step():
    grads = _grads()
    clean = [g.clone() for g in grads]
    state = _state(41)
    torch.ops.aegis.flood_keyed_(grads, MODES, PARAMS, state)
    assert state[:8].tolist() == KEY.tolist() and state[8].item() == 42
    expect = [c.clone() for c in clean]
    torch.ops.aegis.flood_(expect, MODES, PARAMS, ref.derive_key(KEY, 41))
    assert all(torch.equal(a, b) for a, b in zip(grads, expect))
    # the next call uses the next step's key: fresh noise
    again = [c.clone() for c in clean]
    torch.ops.aegis.flood_keyed_(again, MODES, PARAMS, state)
    assert state[8].item() == 43 and not torch.equal(again[0], grads[0])


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda: torch.ops.aegis.flood_(_grads(), "rows,matrix", PARAMS, KEY), "same length"),
        (lambda: torch.ops.aegis.flood_(_grads(), MODES, PARAMS[:4], KEY), r"\(5, 4\)"),
        (lambda: torch.ops.aegis.flood_(_grads(), MODES, PARAMS.double(), KEY), "float32"),
        (lambda: torch.ops.aegis.flood_(_grads(), "rows,rows,matrix,rows,rows", PARAMS, KEY), "2-D"),
        (lambda: torch.ops.aegis.flood_keyed_(_grads(), MODES, PARAMS, _state(0)[:8]), "state"),
        (lambda: torch.ops.aegis.flood_keyed_(_grads(), MODES, PARAMS, _state(0).int()), "state"),
        (lambda: torch.ops.aegis.flood(torch.ones(3, 3), "rows", torch.ones(4), KEY, 8), "stream_offsets"),
        (lambda: torch.ops.aegis.flood(torch.ones(3, 3), "rows", torch.ones(4), KEY[:4], 0), "new_key"),
        (lambda: torch.ops.aegis.noise([3], KEY, 24, torch.float32, CPU), "stream_offsets"),
    ],
)
def test_bad_arguments_are_named(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_functional_op_inside_torch_compile():
    g = torch.randn(8, 6, generator=torch.Generator().manual_seed(3))
    params = torch.tensor([0.3, 1.0, 4.0, 0.5])

    def step(x):
        out, stats = torch.ops.aegis.flood(x * 2, "rows", params, KEY, 16)
        return out + 1, stats

    compiled = torch.compile(step, fullgraph=True, backend="inductor")
    out, stats = compiled(g)
    expect, expect_stats = step(g)
    assert torch.equal(out, expect) and torch.equal(stats, expect_stats)
    assert not torch.equal(out, 2 * g + 1)  # the flood ran inside the graph
