"""For tests and benchmarks only: a keyed ``torch.randn`` in place of the CPU flood's ChaCha normals.

The reference cipher costs ~1.6 s per 12M elements on one quiet core; attack tests and CPU benchmarks
that mask hundreds of steps swap it for :func:`keyed_normals`. The attacks never read the noise itself
(they do not know the key), only its law, which is the same standard normal; calibration, clipping,
masking and export run unchanged. The CPU op is pointed back at the reference (as without numba), so
the swap reaches ``mask_()``. CUDA floods (the Triton kernels) are not affected.

A client must never ship with it, so it is never active by default and cannot be switched on by accident:

* every switch (:func:`fast_noise`, :func:`install`) raises unless the process opted in with
  ``AEGIS_ALLOW_FAST_NOISE=1`` (the tests' fixture sets it; a benchmark's caller sets it);
* no module of ``aegis`` or ``aegis_kernels`` imports this one (``tests/test_imports.py`` checks), so
  importing the library never loads it;
* :func:`active` tells whether the swap is on, and the utility study records the noise source.

Usage::

    with fast_noise():           # restores the ChaCha normals on exit, also after an exception
        ...
    install()                    # a whole benchmark process (--fast-noise)
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from . import cpu, ops, reference

ENV = "AEGIS_ALLOW_FAST_NOISE"
CHACHA_COMPONENTS = reference.noise_components  # the shipped normals, as this module found them


def keyed_normals(n: int, key: torch.Tensor, offset: int, per: int,
                  device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``reference.noise_components``'s contract with torch.randn seeded from (key, offset)."""
    seed = int.from_bytes(hashlib.sha256(repr((key.tolist(), offset)).encode()).digest()[:8], "little")
    generator = torch.Generator().manual_seed(seed)
    za = torch.randn(n, generator=generator).to(device)
    return za, (torch.randn(n, generator=generator).to(device) if per == 2 else None)


def active() -> bool:
    """Whether the CPU flood draws :func:`keyed_normals` now."""
    return reference.noise_components is keyed_normals


def _allowed() -> None:
    if os.environ.get(ENV) != "1":
        raise RuntimeError(
            f"aegis_kernels.testing replaces the flood's secret ChaCha normals with a keyed torch.randn (tests "
            f"and benchmarks only): set {ENV}=1 in the process that means it, never in a client"
        )


def install() -> None:
    """For a whole benchmark process: the CPU flood draws :func:`keyed_normals` from now on."""
    _allowed()
    reference.noise_components = keyed_normals
    cpu.HAS_NUMBA, ops._WARNED = False, True  # the CPU op runs the reference (no warning: chosen here)


@contextmanager
def fast_noise() -> Iterator[None]:
    """:func:`install` until the block ends, then the normals (and the CPU op) exactly as they were."""
    _allowed()
    saved = reference.noise_components, cpu.HAS_NUMBA, ops._WARNED
    install()
    try:
        yield
    finally:
        reference.noise_components, cpu.HAS_NUMBA, ops._WARNED = saved
