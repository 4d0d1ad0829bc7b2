"""Exposure budget: how many times one training example may leave the client inside an export.

The noise of independent exports averages out as sqrt(K): an attacker who receives the same batch K
times (local epochs, rounds over the same client data, a server resending one model) divides the noise
by sqrt(K) and reads a signal a single export hides. Each preset promises its strength up to a number of
exposures per example (``PRESET_EXPOSURES``); the tracker counts them and the shield enforces the budget.

Examples are recognised by their token ids, read by a forward pre-hook on the model's input embedding
(every forward under grad mode since the gradients were last empty or masked), with padding stripped so that one
sentence padded to different lengths is one example. The digests are keyed by a per-tracker secret salt, so the
table kept in memory does not let anyone test a guessed sentence against it.
"""
from __future__ import annotations

import enum
import hashlib
import secrets
from collections import Counter
from collections.abc import Callable

import numpy as np
import torch
from torch import Tensor, nn


class ExposurePolicy(str, enum.Enum):
    """What ``mask_()`` does when a batch holds an example already exported ``exposure_budget`` times.

    REFUSE:  raise (the default): the gradient stays unmasked, so nothing can be exported or stepped.
    SILENCE: flood that step with rho = 0 (pure noise: the export carries nothing about the batch and
             does not count), so federated rounds go on while the budget holds.
    OFF:     no tracking; the preset's guarantee holds for one exposure only (``report()`` says so).
    """

    REFUSE = "refuse"
    SILENCE = "silence"
    OFF = "off"


class ExposureTracker:
    """Counts per example (token-id digest) how many masked exports carried it."""

    def __init__(self, model: nn.Module, budget: int, fresh: Callable[[], bool]):
        getter = getattr(model, "get_input_embeddings", None)
        embeddings = getter() if callable(getter) else None
        if embeddings is None:  # a plain module: its first embedding table sees the ids
            embeddings = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
        if embeddings is None:
            raise ValueError(
                "exposure tracking needs an nn.Embedding (or model.get_input_embeddings()) to see the token "
                "ids; pass "
                "AegisConfig(exposure=ExposurePolicy.OFF) and keep each batch to one export yourself"
            )
        config = getattr(model, "config", None)
        self.pad = getattr(config, "pad_token_id", None)
        self.budget = budget
        self._fresh = fresh  # True while no flooded gradient exists: a forward then starts a new step
        self._salt = secrets.token_bytes(16)
        self._counts: Counter[bytes] = Counter()
        self._pending: list[_HostCopy] = []  # token ids of this step's forwards, hashed at mask_() time
        self._step_digests: set[bytes] | None = None
        self._paused = 0
        self._handle = embeddings.register_forward_pre_hook(self._record)

    def _record(self, module: nn.Module, args: tuple) -> None:
        if self._paused or not torch.is_grad_enabled() or not args or not isinstance(args[0], Tensor):
            return
        ids = args[0]
        if ids.dtype not in (torch.int64, torch.int32):
            return
        if self._fresh():
            # forwards whose gradients were dropped (set_to_none) never left the client
            self._pending, self._step_digests = [], None
        self._pending.append(_HostCopy(ids.detach().reshape(-1, ids.shape[-1])))
        self._step_digests = None

    def _pending_digests(self) -> set[bytes]:
        # numpy rows: a few microseconds each, where tensor indexing costs tens per row on every step
        return {self._digest(row) for ids in self._pending for row in ids.wait().to(torch.int64).numpy()}

    def _digest(self, row: np.ndarray) -> bytes:
        if self.pad is not None:
            keep = np.flatnonzero(row != self.pad)
            row = row[keep[0] : keep[-1] + 1] if len(keep) else row[:0]
        return hashlib.blake2b(row.tobytes(), key=self._salt, digest_size=16).digest()

    def paused(self) -> _Pause:
        """Forwards inside this context (the public calibration's) are not the client's examples."""
        return _Pause(self)

    def over_budget(self) -> int:
        """How many examples of the pending step would exceed the budget if it were exported."""
        self._step_digests = self._pending_digests()
        return sum(self._counts[d] >= self.budget for d in self._step_digests)

    def commit(self, carried_signal: bool) -> None:
        """The pending step was masked: count its examples if the export carries their signal."""
        if carried_signal:
            self._counts.update(self._step_digests if self._step_digests is not None else self._pending_digests())
        self._pending, self._step_digests = [], None

    def discard(self) -> None:
        self._pending, self._step_digests = [], None

    @property
    def max_exposure(self) -> int:
        return max(self._counts.values(), default=0)

    def remove(self) -> None:
        self._handle.remove()


class _HostCopy:
    """Token ids on their way to the host. A CUDA tensor is copied asynchronously into pinned memory
    behind an event, so neither the forward (where the copy is queued) nor ``mask_()`` (long after the
    copy finished) waits on the stream's later work; a blocking copy at ``mask_()`` would wait for the
    whole backward and leave the GPU idle while the host queues the flood and the optimizer step."""

    def __init__(self, ids: Tensor):
        if ids.is_cuda:
            self.host = torch.empty(ids.shape, dtype=ids.dtype, pin_memory=True)
            self.host.copy_(ids, non_blocking=True)
            self.ready: torch.cuda.Event | None = torch.cuda.Event()
            self.ready.record()
        else:
            self.host, self.ready = ids.clone(), None

    def wait(self) -> Tensor:
        if self.ready is not None:
            self.ready.synchronize()
        return self.host


class _Pause:
    def __init__(self, tracker: ExposureTracker):
        self.tracker = tracker

    def __enter__(self) -> None:
        self.tracker._paused += 1

    def __exit__(self, *exc) -> None:
        self.tracker._paused -= 1
