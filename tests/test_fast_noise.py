"""aegis_kernels.testing: the keyed-randn noise swap is refused without the opt-in, restores what it replaced,
is never on after importing the library, and draws standard normals keyed like the stream it replaces."""
from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch

import aegis_kernels
from aegis_kernels import cpu, ops, reference, testing


def _state():
    return reference.noise_components, cpu.HAS_NUMBA, ops._WARNED


def test_refused_without_the_opt_in(monkeypatch):
    monkeypatch.delenv(testing.ENV, raising=False)
    before = _state()
    with pytest.raises(RuntimeError, match=f"set {testing.ENV}=1"):
        with testing.fast_noise():
            pass
    with pytest.raises(RuntimeError, match=testing.ENV):
        testing.install()
    monkeypatch.setenv(testing.ENV, "yes")  # only "1" opts in
    with pytest.raises(RuntimeError, match=testing.ENV):
        testing.install()
    assert _state() == before and not testing.active()


def test_the_swap_reaches_the_cpu_flood_and_is_undone_even_after_an_error(monkeypatch):
    monkeypatch.setenv(testing.ENV, "1")
    before = _state()
    key = aegis_kernels.key_from_int(7)

    def flood() -> torch.Tensor:  # what mask_() runs on CPU: the flood op, rho 1, sigma 1, no clipping
        grad = torch.zeros(64, 64)
        aegis_kernels.flood_([grad], "matrix", torch.tensor([[1.0, 1.0, 1e9, 0.0]]), key)
        return grad

    chacha = flood()
    with pytest.raises(KeyError):
        with testing.fast_noise():
            assert testing.active()
            swapped = flood()
            again = flood()
            raise KeyError("inside the block")
    assert _state() == before and not testing.active()
    assert torch.equal(swapped, again) and not torch.equal(swapped, chacha)  # keyed, and not the cipher's
    assert torch.equal(flood(), chacha)  # the ChaCha stream is back, bit for bit


def test_keyed_normals_are_keyed_and_standard():
    key, other = aegis_kernels.key_from_int(1), aegis_kernels.key_from_int(2)
    n = 200_000
    z, zb = testing.keyed_normals(n, key, 0, 2, torch.device("cpu"))
    assert zb is not None and not torch.equal(z, zb)
    assert torch.equal(z, testing.keyed_normals(n, key, 0, 1, torch.device("cpu"))[0])
    assert not torch.equal(z, testing.keyed_normals(n, other, 0, 1, torch.device("cpu"))[0])
    assert not torch.equal(z, testing.keyed_normals(n, key, 1024, 1, torch.device("cpu"))[0])
    # mean and variance of N(0, 1) within 6 sigma of their sampling error (var of the sample variance: 2 / n)
    assert abs(float(z.double().mean())) < 6 / math.sqrt(n)
    assert abs(float(z.double().var()) - 1) < 6 * math.sqrt(2 / n)


def test_importing_the_library_never_loads_or_switches_on_the_swap():
    code = (
        "import sys, aegis, aegis.fl, aegis.audit, aegis.utility, aegis_kernels.reference as r\n"
        "assert 'aegis_kernels.testing' not in sys.modules, 'loaded'\n"
        "assert r.noise_components.__module__ == 'aegis_kernels.reference'\n"
    )
    env = {k: v for k, v in __import__("os").environ.items() if k != testing.ENV}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
