"""A keyed torch.randn in place of the CPU reference's ChaCha normals, for attack tests on CPU.

The reference cipher costs ~1.6 s per 12M elements on one quiet core; attack tests that mask hundreds of
steps swap it for this. The registered CPU op is pointed back at the reference (as without numba), so the
swap reaches ``mask_()`` and these tests keep their normals. The attacks never read the noise itself (they
do not know the key), only its law, which is the same standard normal; the shield's calibration,
clipping, masking and export run unchanged. Tests of the stream itself (test_reference, test_kernels,
test_noise_battery, test_cpu_flood) never use it.
"""
import hashlib

import pytest
import torch

import aegis_kernels.reference as ref
from aegis_kernels import cpu, ops

CHACHA_COMPONENTS = ref.noise_components


def keyed_normals(n: int, key: torch.Tensor, offset: int, per: int, device) -> tuple:
    seed = int.from_bytes(hashlib.sha256(repr((key.tolist(), offset)).encode()).digest()[:8], "little")
    generator = torch.Generator().manual_seed(seed)
    za = torch.randn(n, generator=generator).to(device)
    return za, (torch.randn(n, generator=generator).to(device) if per == 2 else None)


def install() -> None:
    """For a whole benchmark process (``--fast-noise``): the CPU flood draws these normals from now on."""
    ref.noise_components = keyed_normals
    cpu.HAS_NUMBA, ops._WARNED = False, True  # the CPU op runs the reference (no warning: chosen here)


@pytest.fixture(scope="module")
def fast_noise():
    mp = pytest.MonkeyPatch()
    mp.setattr(ref, "noise_components", keyed_normals)
    mp.setattr(cpu, "HAS_NUMBA", False)
    mp.setattr(ops, "_WARNED", True)
    yield
    mp.undo()
