"""torch.ops.aegis.*: the flood ops (DESIGN §2).

The PyTorch reference is the implementation on every device; importing
``aegis_kernels.flood`` (done by ``aegis_kernels/__init__.py`` when Triton and CUDA are
present) registers the fused Triton kernels for CUDA on top of it.
Seeds and offsets are explicit arguments, so every op is a pure function of its inputs
(what opcheck, torch.compile and CUDA-graph replay need).
"""
from __future__ import annotations

import torch
from torch import Tensor

from . import reference as ref

STATS_LEN = {"rows": 4, "matrix": 2}


@torch.library.custom_op("aegis::flood", mutates_args=())
def flood(
    grad: Tensor, mode: str, rho: float, lam: float, rel_threshold: float, seed: int, offset: int
) -> tuple[Tensor, Tensor]:
    """Flood one gradient; returns (out, stats): rows [m_bar, sigma, |S|, M], matrix [m_bar, sigma]."""
    out, stats = ref.flood(grad, mode, rho, lam, rel_threshold, seed, offset)
    return out.contiguous().clone() if out is grad else out.contiguous(), stats


@flood.register_fake
def _flood_fake(grad, mode, rho, lam, rel_threshold, seed, offset):
    ref.check_params(grad, mode, rho, lam, rel_threshold)
    return grad.new_empty(grad.shape), grad.new_empty((STATS_LEN[mode],), dtype=torch.float32)


@torch.library.custom_op("aegis::flood_", mutates_args=("grads",))
def flood_(
    grads: list[Tensor], modes: str, rhos: list[float], lams: list[float], rel_threshold: float, seed: int
) -> None:
    """In place over many gradients under one seed; tensor k uses offset stream_offsets(numels)[k].

    ``modes`` is comma-separated, one entry per tensor ("rows,matrix,..."): the custom-op
    schema has no list-of-strings type.
    """
    ref.flood_many_(grads, ref.split_modes(modes), rhos, lams, rel_threshold, seed)


@torch.library.custom_op("aegis::flood_seeded_", mutates_args=("grads", "state"))
def flood_seeded_(
    grads: list[Tensor], modes: str, rhos: list[float], lams: list[float], rel_threshold: float, state: Tensor
) -> None:
    """flood_ with the seed kept on the device: state = int64 [key, step].

    Uses seed = derive_seed(key, step) and advances step, all without a host sync, so a
    captured CUDA graph draws fresh noise on every replay.
    """
    check_state(state)
    ref.flood_many_(grads, ref.split_modes(modes), rhos, lams, rel_threshold, ref.derive_seed(state[0], state[1]))
    state[1] += 1


def check_state(state: Tensor) -> None:
    if state.dtype != torch.int64 or state.shape != (2,):
        raise ValueError(f"state must be an int64 tensor [key, step], got {state.dtype} {tuple(state.shape)}")


@torch.library.custom_op("aegis::noise", mutates_args=())
def noise(shape: list[int], seed: int, offset: int, device: torch.device) -> Tensor:
    """The exact standard-normal Z that flood adds (fp32), for exact kernel tests."""
    return ref.noise(tuple(shape), seed, offset, device=device)


@noise.register_fake
def _noise_fake(shape, seed, offset, device):
    ref.check_offset(offset)
    return torch.empty(shape, dtype=torch.float32, device=device)
