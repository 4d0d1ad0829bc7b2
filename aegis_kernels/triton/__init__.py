"""Fused Triton kernels for the AEGIS floods (docs/design.md §1-2), judged against
``aegis_kernels.reference``: the same ChaCha keystream words bit for bit, the same normals up to
the last ulp of log / sqrt, the same flood formulas.

Raw ``@triton.jit`` kernels plus thin launchers (Liger-Kernel style), one concern per module:

  stream.py     the noise stream: ChaCha8 + Box-Muller jit helpers, the noise and key-derivation kernels
  rows.py       the rows flood: kernels and launcher
  matrix.py     the matrix flood (one tensor, a per-tensor chain, a grouped address table): kernels, launchers
  flood.py      flood / flood_ / flood_keyed_: checks, then the rows and matrix launchers; norms
  launch.py     launch planning: block sizes, kernels per device, rows tiling, flood_ plans
  tables.py     device address tables of grouped launches, their caches
  addressed.py  flood_keyed_ + norms reading every tensor's address from a device table (the shield's graph)
  interpret.py  CPU tensors through the Triton interpreter (no environment needed)
  testing.py    test-only kernels (raw keystream words, the normals' summands)

Each tensor's public parameters (rho, sigma, clip, thr) live in a device table and the key in a
device buffer, so a captured CUDA graph replays with new keys and new calibrations
(``aegis_kernels.cuda_graph``). Nothing here registers an op: ``aegis_kernels.ops`` does.
"""
from .flood import flood, flood_, flood_keyed_, norms
from .stream import derive_key, noise

__all__ = ["flood", "flood_", "flood_keyed_", "norms", "derive_key", "noise"]
