"""The shield's checksum on CUDA from one address table (``aegis_kernels.triton.norms``).

CPU: where the grouped norms do not apply they decline, and the shield falls back to ``torch._foreach_norm``.
GPU (``-m gpu``): the grouped norms against ``torch.linalg.vector_norm`` in float64, bit-identical on every call,
non-finite exactly where a tensor is; a write through ``.data`` after ``mask_()`` is refused at ``export()``.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

import aegis  # noqa: E402
import aegis_kernels  # noqa: E402,F401  (registers the CUDA kernels)
from aegis.exposure import ExposurePolicy  # noqa: E402
from aegis.flood import norms  # noqa: E402
from aegis_kernels import triton as TF  # noqa: E402
from families import build  # noqa: E402

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_grouped_norms_decline_what_they_do_not_cover_and_the_shield_falls_back():
    tensors = [torch.randn(3, 5), torch.randn(7)]
    assert TF.norms(tensors) is None  # CPU tensors
    assert TF.norms([]) is None
    expected = torch.stack([torch.linalg.vector_norm(t) for t in tensors])
    assert torch.allclose(norms(tensors), expected)
    assert norms([]) is None


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_grouped_norms_match_float64_and_repeat_bit_for_bit(dtype):
    gen = torch.Generator(device="cuda").manual_seed(0)
    shapes = [(50257, 64), (3072, 768), (768,), (5,), (40000,), (1, 17)]  # several tiles, one, part of one
    tensors = [torch.randn(s, device="cuda", generator=gen).to(dtype) for s in shapes]
    out = TF.norms(tensors)
    assert out is not None and out.dtype == torch.float32 and out.shape == (len(shapes),)
    exact = torch.stack([torch.linalg.vector_norm(t.double()) for t in tensors]).float()
    assert torch.allclose(out, exact, rtol=1e-5, atol=0)
    assert all(torch.equal(TF.norms(tensors).view(torch.int32), out.view(torch.int32)) for _ in range(3))
    changed = [t.clone() for t in tensors]
    changed[3][2] += 1  # one element of one tensor
    moved = TF.norms(changed).view(torch.int32) != out.view(torch.int32)
    assert moved.tolist() == [False, False, False, True, False, False]


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_gpu_grouped_norms_are_non_finite_exactly_where_a_tensor_is(bad):
    tensors = [torch.ones(70000, device="cuda"), torch.ones(33, device="cuda"), torch.ones(16, device="cuda")]
    tensors[0][65537] = bad
    out = TF.norms(tensors)
    assert torch.isfinite(out).tolist() == [False, True, True]


@pytest.mark.gpu
@gpu
def test_gpu_grouped_norms_decline_mixed_dtypes_and_non_contiguous_tensors():
    a = torch.randn(64, 32, device="cuda")
    assert TF.norms([a, a.half()]) is None
    assert TF.norms([a, a.t()]) is None
    assert TF.norms([a, a.cpu()]) is None
    assert torch.allclose(norms([a, a.t()]), torch.stack([a.norm(), a.norm()]))


@pytest.mark.gpu
@gpu
def test_gpu_a_write_through_data_after_mask_is_refused_at_export():
    model = build("gpt2").cuda()
    ids = torch.randint(3, 90, (2, 9), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    shield = aegis.protect(model, config=aegis.AegisConfig(exposure=ExposurePolicy.OFF))
    model(input_ids=ids, labels=ids).loss.backward()
    shield.mask_()
    assert set(shield.export())  # untouched: exported
    grad = next(p.grad for name, p in model.named_parameters() if "mlp" in name and p.grad is not None)
    grad.data.view(-1)[0] += 1.0  # no version bump
    with pytest.raises(RuntimeError, match="changed after mask_"):
        shield.export()
