"""The CPU flood: ChaCha8 and Box-Muller vectorised over 32-bit lanes, bit for bit the reference.

``torch.ops.aegis.flood`` and ``flood_`` (so ``Shield.mask_()``, and ``flood_keyed_``, which calls
``flood_``) run ``aegis_kernels.cpu.flood`` on CPU tensors when numba is installed (the ``cpu`` extra),
and the PyTorch reference otherwise, with a warning once per process.

Why numba. The reference spends ~170 ns per fp32 element: ChaCha8 is ~400 32-bit operations per
16-word block, and each is a separate torch operation, a pass over memory. The cipher wants one loop
over blocks that keeps the state in vector registers. Candidates:

* numba ``@njit``: plain Python loops compiled by LLVM for the host CPU (AVX2 / AVX-512 lanes), wheels
  for CPython 3.10-3.13 on Linux, macOS and Windows, nothing to compile at install. Its integers are
  64-bit; two small LLVM intrinsics (a 32-bit add, a funnel-shift rotate) keep the cipher on 32-bit
  lanes. Measured (Xeon, AVX-512, one thread): ChaCha8 at ~1 ns per Box-Muller pair, the whole flood at
  ~5 ns per fp32 element, against ~170 ns for the reference.
* Triton's CPU backend is a separate, experimental project (the triton wheels carry only GPU
  backends; the interpreter the tests use runs numpy per operation, slower than the reference).
* The reference on int32 lanes already is what ``chacha_block`` does; the passes over memory remain.
* A C or C++ extension needs a compiler on every client at install time.

numba's own ``parallel=True`` is not used: its OpenMP layer loads a second OpenMP runtime beside
torch's. The flood's parallelism is its own Python threads running numba kernels that release the
GIL (threads.py says how many, and what happens to torch's thread setting).

Bit for bit: the cipher, the Box-Muller operands, the radius series, the products and the fused
multiply-adds (through fp64, as ``reference.fma``) are exact integer or IEEE fp32 / fp64 steps done in
the reference's order. log, cos, sin and sqrt come from torch itself, the calls the reference makes,
on buffers of the same values: torch's fp32 versions are not the correctly rounded ones (sqrt included),
and they give each element the same result wherever it sits in a tensor (tests/test_cpu_flood.py checks
the floods against the reference bit for bit). Per-tensor factors and stats come from the reference's
own ``rows_scale`` / ``matrix_scale``.
"""
from __future__ import annotations

import importlib.util

from .threads import default_threads, flood_threads, set_threads

HAS_NUMBA = importlib.util.find_spec("numba") is not None

__all__ = ["HAS_NUMBA", "default_threads", "flood_threads", "set_threads"]
