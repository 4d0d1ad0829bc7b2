"""The ``fast_noise`` fixture: :func:`aegis_kernels.testing.fast_noise` for a test module (keyed torch.randn
in place of the CPU flood's ChaCha normals). Tests of the stream itself (test_reference, test_kernels,
test_noise_battery, test_cpu_flood) never use it."""
import pytest

from aegis_kernels import testing
from aegis_kernels.testing import CHACHA_COMPONENTS, keyed_normals

__all__ = ["CHACHA_COMPONENTS", "fast_noise", "keyed_normals"]


@pytest.fixture(scope="module")
def fast_noise():
    mp = pytest.MonkeyPatch()
    mp.setenv(testing.ENV, "1")  # the opt-in the swap requires, for this module only
    try:
        with testing.fast_noise():
            yield
    finally:
        mp.undo()
