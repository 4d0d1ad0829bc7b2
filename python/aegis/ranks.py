"""One client over several processes (torch.distributed): the ranks decide and draw together.

Under DDP every rank's gradient holds every rank's examples once the all-reduce ran, so the exposure
decision gathers every rank's rows and rank 0, the one writer of the client's store, decides for all; and
the flood key is rank 0's, so the replicas stay equal after the step.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor


def distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def gather(problem: str | None, rows: list[Any]) -> tuple[list[str | None], list[Any]]:
    """Every rank's (problem, rows): the problems, and all ranks' rows in rank order."""
    parts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, (problem, rows))
    return [p for p, _ in parts], [row for _, part in parts for row in part]


def decided_by_rank0(decide: Callable[[], int]) -> int:
    """``decide()`` on rank 0 (an exception there is raised on every rank), its result on every rank."""
    box: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            box[0] = ("ok", decide())
        except Exception as err:  # every rank must leave the collective, then all raise
            box[0] = ("error", f"{type(err).__name__}: {err}")
    dist.broadcast_object_list(box, src=0)
    kind, value = box[0]
    if kind == "error":
        raise RuntimeError(f"rank 0's exposure decision failed: {value}")
    return int(value)


def shared_key(key: Tensor) -> Tensor:
    """Rank 0's key on every rank (the same flood on every replica); ``key`` unchanged outside DDP."""
    if not distributed():
        return key
    box = [key.cpu().tolist() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return torch.tensor(box[0], dtype=key.dtype, device=key.device)
