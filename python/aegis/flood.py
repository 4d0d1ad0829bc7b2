"""The flood's key and launch for one shield: ``G <- rho * clip(G) + sigma * Z`` over every flooded tensor in
one grouped call, Z from ChaCha8 under a secret key drawn fresh for every step.

Four launches, one law (aegis_kernels.reference is the executable spec):
- host key (default): a 256-bit key from ``secrets`` per step, ``flood_``;
- device seed (``device_seed=True``): a master key on the device, each step's key derived there by
  ``flood_keyed_``, so a captured CUDA graph of ``mask_()`` draws fresh noise on every replay;
- CUDA graph (``cuda_graph=True``, the default; CUDA only): the flood and its checksum captured once per
  layout of gradients and replayed with a fresh master key per step, wherever the gradients are;
- pure noise (a silenced step): rho = 0 under a host key.
Under ``torch.distributed`` every rank floods with rank 0's key (``aegis.ranks``), so replicas stay equal.
"""
from __future__ import annotations

import os
import weakref

import torch
from torch import Tensor

import aegis_kernels  # registers torch.ops.aegis
import aegis_kernels.reference as ref
from aegis_kernels.cuda_graph import GraphedFlood

from . import ranks
from .config import AegisConfig, Calibration


class Flood:
    """Draws each step's key and launches the grouped flood; counts the steps it keyed."""

    def __init__(self, config: AegisConfig):
        self.config = config
        self.fixed_key = ref.key_from_int(config.seed) if config.seed is not None else None  # tests only
        self.graphed: GraphedFlood | None = None
        self.step = 0

    def __call__(self, tensors: list[Tensor], modes: str, params: Tensor, *, pure_noise: bool = False
                 ) -> Tensor | None:
        """Flood ``tensors`` in place with the (T, 4) ``params``; ``pure_noise`` exports rho = 0. Returns the
        flooded tensors' norms (``norms``) when the CUDA graph took them with the flood, else None."""
        if pure_noise:
            params = params.clone()
            params[:, 0] = 0.0  # nothing of this batch leaves
            torch.ops.aegis.flood_(tensors, modes, params, self.step_key(tensors[0].device))
        elif self.config.device_seed:
            torch.ops.aegis.flood_keyed_(tensors, modes, params, self.device_state(tensors[0].device))
        elif self.graphable(tensors) and self.graphed is not None:
            return self.graphed(tensors, modes, params, self.master_words(), self.step)
        else:
            torch.ops.aegis.flood_(tensors, modes, params, self.step_key(tensors[0].device))
        return None

    def capturing(self, counting: bool) -> bool:
        """True inside a CUDA-graph capture, where only a device seed and no exposure count can run."""
        capturing = torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
        if capturing and not self.config.device_seed:
            raise RuntimeError(
                "mask_() inside a CUDA-graph capture needs AegisConfig(device_seed=True): with a host key the graph "
                "replays one key on every step, and the difference of two exports is noise-free"
                + (" (and exposure=ExposurePolicy.OFF: a replay counts nothing)" if counting else ""))
        if capturing and counting:
            raise RuntimeError(
                "mask_() inside a CUDA-graph capture cannot count exposures (a replay runs no Python hook and "
                "the token ids stay on the device): pass AegisConfig(exposure=ExposurePolicy.OFF) and keep "
                "each example within the preset's exposure budget yourself")
        return capturing

    def graphable(self, tensors: list[Tensor]) -> bool:
        """CUDA-graph replay: on (config.cuda_graph), public calibration, all on one GPU, not inside a capture."""
        if not (self.config.cuda_graph and tensors and tensors[0].is_cuda):
            return False
        if self.config.calibration is not Calibration.PUBLIC:
            return False
        device = tensors[0].device
        if any(t.device != device for t in tensors) or torch.cuda.is_current_stream_capturing():
            return False
        if self.graphed is None or self.graphed.device != device:
            self.graphed = GraphedFlood(device)
        return True

    def step_key(self, device: torch.device) -> Tensor:
        """A fresh 256-bit key per step (or, in tests, the fixed key's step key) on ``device``. A CUDA copy
        leaves from pinned memory without blocking: a blocking copy waits for the backward."""
        key = ref.derive_key(self.fixed_key, self.step) if self.fixed_key is not None else ref.new_key()
        key = ranks.shared_key(key)
        if device.type != "cuda":
            return key.to(device)
        return key.pin_memory().to(device, non_blocking=True)

    def master_words(self) -> list[int]:
        """The graph derives the step key from this and the step (a fixed test key: as eagerly)."""
        return ranks.shared_key(self.fixed_key if self.fixed_key is not None else ref.new_key()).tolist()

    def device_state(self, device: torch.device) -> Tensor:
        """[master key x 8, step] on the gradients' device, advanced by the op itself (CUDA-graph replay);
        redrawn in a forked child so two processes never share a key."""
        if ranks.distributed():
            raise RuntimeError("AegisConfig(device_seed=True) under torch.distributed: each rank would draw its own "
                               "master key and the replicas would drift apart; use device_seed=False (rank 0's "
                               "host key is shared with every rank)")
        held = _DEVICE_STATES.get(self)
        if held is None or held[1] != os.getpid() or held[0].device != device:
            fresh = self.fixed_key is None
            master = ref.new_key() if self.fixed_key is None else self.fixed_key
            held = _DEVICE_STATES[self] = (torch.cat([master, torch.tensor([self.step])]).to(device), os.getpid())
            if fresh:
                master.zero_()  # the host copy; the key lives on in the device state only
        return held[0]


# The device-seed state [master key x 8, step] of each Flood, kept off the shield and its Flood so that
# their attributes, vars(), gc.get_referents() and pickling never reach the key; gone with the Flood.
_DEVICE_STATES: weakref.WeakKeyDictionary[Flood, tuple[Tensor, int]] = weakref.WeakKeyDictionary()


def device_state_of(flood: Flood) -> Tensor | None:
    """The device-seed state of ``flood`` (tests read the step counter the op advances)."""
    held = _DEVICE_STATES.get(flood)
    return None if held is None else held[0]


def norms(tensors: list[Tensor]) -> Tensor | None:
    """Per-tensor fp32 L2 norms on the device (non-finite for a non-finite tensor): their bits are export()'s
    checksum against mask_()'s. On CUDA two launches from an address table (``torch._foreach_norm`` allocates
    a tensor per input, host time a launch-bound step pays); elsewhere ``torch._foreach_norm``."""
    if not tensors:
        return None
    if aegis_kernels.HAS_TRITON and tensors[0].is_cuda:
        from aegis_kernels.triton import norms as grouped

        out = grouped(tensors)
        if out is not None:
            return out
    return torch.stack([n.to(tensors[0].device) for n in torch._foreach_norm(tensors, 2, dtype=torch.float32)])
