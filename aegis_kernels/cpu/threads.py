"""How many threads the CPU flood uses, and the one thing it does to torch's settings.

The flood runs its own workers (flood.py): ``threads`` of them, each taking a contiguous share of
the chunks. By default that number is the command line's rule (``aegis audit``): torch's intra-op
thread count on an idle machine, 1 when other processes already keep the cores busy (1-minute load
average >= 0.75). Every parallel region waits for its slowest thread, and a thread that loses its core
to another process stalls the region (on 2 shared cores, a flood of many small torch operations ran
about ten times slower with two threads than with one). The rule is read once per process, at the
first CPU flood (as the command line reads it once at its start); ``set_threads(n)`` fixes the number
instead, ``None`` reads the rule again.

Inside a flood, torch's own intra-op thread count is 1 (the workers are the flood's parallelism), and it
is restored on return: nothing is left changed in the caller's torch settings. Another Python thread
running torch operations at the same moment sees one intra-op thread for that time.
"""
from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch

BUSY_LOAD = 0.75  # 1-minute load average at which the cores count as busy

_fixed: int | None = None  # set_threads
_decided: int | None = None  # the rule, read at the first flood


def default_threads() -> int:
    """The command line's rule: torch.get_num_threads() on an idle machine, 1 on a busy one.

    Also the one call for a training loop's own forward and backward on a shared machine:
    ``torch.set_num_threads(aegis_kernels.cpu.default_threads())``."""
    cores = torch.get_num_threads()
    try:
        load = os.getloadavg()[0]
    except (OSError, AttributeError):  # no load average on this platform
        return cores
    return 1 if load >= BUSY_LOAD else cores


def _check(threads: int) -> int:
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ValueError(f"threads={threads!r}: the CPU flood needs a whole number of threads >= 1 (or None: the "
                         "busy-machine rule, aegis_kernels.cpu.default_threads())")
    return threads


def set_threads(threads: int | None) -> None:
    """Fix the CPU flood's thread count for this process (``None``: the busy-machine rule, read again)."""
    global _fixed, _decided
    _fixed = None if threads is None else _check(threads)
    _decided = None


def flood_threads(threads: int | None = None) -> int:
    """The thread count of one flood: ``threads`` if given, else set_threads's, else the rule (read once)."""
    global _decided
    if threads is not None:
        return _check(threads)
    if _fixed is not None:
        return _fixed
    if _decided is None:
        _decided = default_threads()
    return _decided


@contextlib.contextmanager
def torch_threads(threads: int) -> Iterator[None]:
    """torch's intra-op thread count set to ``threads`` inside the block, restored on leaving it."""
    before = torch.get_num_threads()
    if before == threads:
        yield
        return
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)
