"""torch.ops.aegis registrations: schema/fake/aliasing (opcheck), grouped semantics, torch.compile."""
import pytest
import torch

import aegis_kernels
from aegis_kernels import reference as ref

CPU = torch.device("cpu")


def _grads():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(5, 3, generator=g), torch.randn(7, generator=g), torch.randn(4, 6, generator=g).t()]


@pytest.mark.parametrize(
    "args",
    [
        (torch.randn(7, 5), "rows", 0.3, 1.0, 0.01, 42, 8),
        (torch.randn(5, 7).t(), "matrix", 0.0, 8.0, 0.01, 2**61, 0),
        (torch.randn(6, 4, dtype=torch.bfloat16), "rows", 0.3, 1.0, 0.01, 1, 8),
        (torch.zeros(0, 4), "rows", 0.3, 1.0, 0.01, 1, 0),
    ],
)
def test_opcheck_flood(args):
    torch.library.opcheck(torch.ops.aegis.flood.default, args)


def test_opcheck_grouped_and_noise():
    torch.library.opcheck(torch.ops.aegis.flood_.default, (_grads(), "rows,matrix,matrix", [0.3, 0.0, 0.3], [1.0, 4.0, 1.0], 0.01, 7))
    state = torch.tensor([5, 0])
    torch.library.opcheck(torch.ops.aegis.flood_seeded_.default, (_grads(), "rows,matrix,matrix", [0.3, 0.0, 0.3], [1.0, 4.0, 1.0], 0.01, state))
    torch.library.opcheck(torch.ops.aegis.noise.default, ([3, 5], 11, 8, CPU))


def test_grouped_flood_equals_per_tensor_floods_at_stream_offsets():
    grads, modes, rhos, lams = _grads(), ["rows", "matrix", "matrix"], [0.3, 0.0, 0.3], [1.0, 4.0, 1.0]
    clean = [g.clone() for g in grads]
    torch.ops.aegis.flood_(grads, ",".join(modes), rhos, lams, 0.01, 7)
    offsets = aegis_kernels.stream_offsets([g.numel() for g in clean])
    assert offsets == [0, 16, 24]
    for g, c, mode, rho, lam, off in zip(grads, clean, modes, rhos, lams, offsets):
        assert torch.equal(g, torch.ops.aegis.flood(c, mode, rho, lam, 0.01, 7, off)[0])


def test_seeded_flood_derives_and_advances_the_seed():
    grads = _grads()
    clean = [g.clone() for g in grads]
    state = torch.tensor([123, 4])
    torch.ops.aegis.flood_seeded_(grads, "rows,matrix,matrix", [0.3, 0.0, 0.3], [1.0, 4.0, 1.0], 0.01, state)
    assert state.tolist() == [123, 5]
    expect = [c.clone() for c in clean]
    torch.ops.aegis.flood_(expect, "rows,matrix,matrix", [0.3, 0.0, 0.3], [1.0, 4.0, 1.0], 0.01, int(ref.derive_seed(123, 4)))
    assert all(torch.equal(a, b) for a, b in zip(grads, expect))


def test_derived_seeds_are_distinct_and_62_bit():
    seeds = [int(ref.derive_seed(2**61 + 5, k)) for k in range(1000)]
    assert len(set(seeds)) == 1000 and all(0 <= s < 2**62 for s in seeds)


def test_mismatched_group_lengths_are_rejected():
    with pytest.raises(ValueError, match="same length"):
        torch.ops.aegis.flood_(_grads(), "rows,matrix", [0.3], [1.0], 0.01, 7)


def test_functional_op_inside_torch_compile():
    g = torch.randn(8, 6)

    def step(x):
        out, stats = torch.ops.aegis.flood(x * 2, "rows", 0.3, 1.0, 0.01, 3, 0)
        return out + 1, stats

    compiled = torch.compile(step, fullgraph=True, backend="inductor")
    out, stats = compiled(g)
    expect, expect_stats = step(g)
    torch.testing.assert_close(out, expect)
    torch.testing.assert_close(stats, expect_stats)
