"""AEGIS flood kernels: ``torch.ops.aegis.{flood, flood_, flood_keyed_, noise}``.

Knows nothing of the ``aegis`` library. The PyTorch reference (``aegis_kernels.reference``) is the
spec; on CPU the numba flood (``aegis_kernels.cpu``) replaces it when numba is installed, on CUDA the
fused Triton kernels when Triton is.
"""
import importlib.util

from . import ops, reference
from .reference import derive_key, key_from_int, new_key, stream_offsets

ops.register_cpu_kernels()  # the numba flood on CPU (the reference, with a warning, without numba)
HAS_TRITON = importlib.util.find_spec("triton") is not None  # without it the reference serves CUDA too
if HAS_TRITON:
    try:  # CUDA implementations of the ops
        ops.register_triton_kernels()
    except Exception as exc:  # pragma: no cover - a broken Triton must not break the package
        import warnings

        warnings.warn(f"aegis_kernels: Triton kernels not registered ({exc!r}); the PyTorch reference serves CUDA",
                      stacklevel=2)
        HAS_TRITON = False

flood = ops.flood
flood_ = ops.flood_
flood_keyed_ = ops.flood_keyed_
noise = ops.noise

__all__ = ["flood", "flood_", "flood_keyed_", "noise", "reference", "stream_offsets", "new_key", "key_from_int",
           "derive_key", "HAS_TRITON"]
