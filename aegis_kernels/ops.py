"""torch.ops.aegis.*: the flood ops (docs/design.md §2), and every registration of them.

Importing this module defines the ops with the PyTorch reference (``aegis_kernels.reference``) as the
implementation on every device. ``register_cpu_kernels()`` puts the numba CPU flood
(``aegis_kernels.cpu``) on the CPU key, ``register_triton_kernels()`` the fused Triton kernels
(``aegis_kernels.triton``) on the CUDA key; ``aegis_kernels/__init__.py`` calls both.
No other module registers anything with torch.library.
Keys, parameters and offsets are explicit arguments, so every op is a pure function of its
inputs (what opcheck, torch.compile and CUDA-graph replay need).
"""
from __future__ import annotations

import torch
from torch import Tensor

from . import reference as ref

STATS_LEN = {"rows": 4, "matrix": 3}


@torch.library.custom_op("aegis::flood", mutates_args=())
def flood(grad: Tensor, mode: str, params: Tensor, key: Tensor, offset: int) -> tuple[Tensor, Tensor]:
    """Flood one gradient with params = (rho, sigma, clip, thr) under a 256-bit key (8 int64 words).

    Returns (out, stats): rows [sigma, |S|, clipped rows, max n_v], matrix [sigma, ||G||_F, rho min(1, clip/||G||_F)].
    """
    out, stats = ref.flood(grad, mode, params, key.to(grad.device), offset)
    return out.contiguous().clone() if out is grad else out.contiguous(), stats


@flood.register_fake
def _flood_fake(grad, mode, params, key, offset):
    ref.check_grad(grad, mode)
    return grad.new_empty(grad.shape), grad.new_empty((STATS_LEN[mode],), dtype=torch.float32)


@torch.library.custom_op("aegis::flood_", mutates_args=("grads",))
def flood_(grads: list[Tensor], modes: str, params: Tensor, key: Tensor) -> None:
    """In place over many gradients under one key; tensor k reads params[k] and the keystream from
    word offset stream_offsets(...)[k]. ``modes`` is comma-separated ("rows,matrix,..."): the
    custom-op schema has no list-of-strings type."""
    device = grads[0].device if grads else params.device
    ref.flood_many_(grads, ref.split_modes(modes), params.to(device), key.to(device))


@torch.library.custom_op("aegis::flood_keyed_", mutates_args=("grads", "state"))
def flood_keyed_(grads: list[Tensor], modes: str, params: Tensor, state: Tensor) -> None:
    """flood_ with the key kept on the device: state = int64 [master key words x 8, step].

    Uses key = derive_key(master, step) and advances step, all without a host sync, so a captured
    CUDA graph draws a fresh key on every replay."""
    check_state(state)
    key = ref.derive_key(state[: ref.KEY_WORDS], state[ref.KEY_WORDS])
    flood_(grads, modes, params, key)
    state[ref.KEY_WORDS] += 1


def check_state(state: Tensor) -> None:
    if state.dtype != torch.int64 or state.shape != (ref.KEY_WORDS + 1,):
        raise ValueError(f"state must be an int64 tensor [master key words x {ref.KEY_WORDS}, step], "
                         f"got {state.dtype} {tuple(state.shape)}")


@torch.library.custom_op("aegis::noise", mutates_args=())
def noise(shape: list[int], key: Tensor, offset: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """The exact standard-normal Z (fp32) that a flood with output ``dtype`` adds, for exact kernel tests."""
    return ref.noise(tuple(shape), key.to(device), offset, dtype, device=device)


@noise.register_fake
def _noise_fake(shape, key, offset, dtype, device):
    ref.check_offset(offset)
    return torch.empty(shape, dtype=torch.float32, device=device)


# ----------------------------------------------------------------------------- CPU: the numba flood
_CPU_LIB: torch.library.Library | None = None
_WARNED = False


def _cpu_fallback() -> bool:
    """True (after one warning per process) when numba is missing and the reference serves CPU."""
    global _WARNED
    from .cpu import HAS_NUMBA

    if HAS_NUMBA:
        return False
    if not _WARNED:
        import warnings

        warnings.warn("aegis_kernels: numba is not installed, so CPU floods run the PyTorch reference (15-25x "
                      "slower); pip install 'aegis-flood[cpu]' for the vectorised CPU flood", stacklevel=3)
        _WARNED = True
    return True


def register_cpu_kernels() -> None:
    """Make aegis_kernels.cpu the CPU implementation of flood and flood_ (flood_keyed_ calls flood_);
    without numba the reference stays, with a warning at the first CPU flood. Idempotent.
    Registered on the dispatcher's CPU key directly, as the CUDA kernels are."""
    global _CPU_LIB
    if _CPU_LIB is not None:
        return

    def _flood_cpu(grad, mode, params, key, offset):
        if _cpu_fallback():
            out, stats = ref.flood(grad, mode, params, key, offset)
            return out.contiguous().clone() if out is grad else out.contiguous(), stats
        from .cpu import flood as cpu

        return cpu.flood(grad, mode, params, key, offset)

    def _flood__cpu(grads, modes, params, key):
        if _cpu_fallback():
            ref.flood_many_(grads, ref.split_modes(modes), params, key)
            return
        from .cpu import flood as cpu

        cpu.flood_(grads, modes, params, key)

    lib = torch.library.Library("aegis", "IMPL")
    lib.impl("flood", _flood_cpu, "CPU")
    lib.impl("flood_", _flood__cpu, "CPU")
    _CPU_LIB = lib


# ----------------------------------------------------------------------------- CUDA: the Triton kernels
_TRITON_LIB: torch.library.Library | None = None


def register_triton_kernels() -> None:
    """Make the fused Triton kernels the CUDA implementations of torch.ops.aegis.*. Idempotent.

    flood, flood_ and flood_keyed_ go on the dispatcher's CUDA key directly: custom_op's
    register_kernel wraps every call in a Python aliasing check that measured ~80 us per call on an
    H100 host, more than a rows flood's own launches. flood never returns a view of its input (a
    fresh output), the in-place ops return nothing."""
    global _TRITON_LIB
    if _TRITON_LIB is not None:
        return
    from . import triton as fused

    def _flood_cuda(grad, mode, params, key, offset):
        return fused.flood(grad, mode, params, key, offset)

    def _flood__cuda(grads, modes, params, key):
        fused.flood_(grads, modes, params, key)

    def _flood_keyed__cuda(grads, modes, params, state):
        fused.flood_keyed_(grads, modes, params, state)

    lib = torch.library.Library("aegis", "IMPL")
    lib.impl("flood", _flood_cuda, "CUDA")
    lib.impl("flood_", _flood__cuda, "CUDA")
    lib.impl("flood_keyed_", _flood_keyed__cuda, "CUDA")

    # noise has no tensor input but the key: it dispatches on the key's device (CPU keys are the
    # norm), so the CUDA case is chosen by the ``device`` argument inside one CPU/CUDA kernel.
    @noise.register_kernel(("cpu", "cuda"))
    def _noise_cpu_cuda(shape, key, offset, dtype, device):
        if torch.device(device).type == "cuda":
            return fused.noise(shape, key, offset, dtype, device=device)
        return ref.noise(tuple(shape), key, offset, dtype, device=device)

    _TRITON_LIB = lib
