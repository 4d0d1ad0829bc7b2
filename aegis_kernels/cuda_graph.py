"""CUDA-graph capture of the flood, and the lifetime of what a captured graph reads.

A captured graph reads some buffers by address that its own memory pool does not own: the grouped
launch tables and plan index tensors that the Triton launchers cache across steps
(``aegis_kernels.triton.tables``). Those must live exactly as long as the graph. This module owns
that rule:

- ``GraphResources``: the buffers one graph reads. Capture inside ``with resources.recording():``
  and keep ``resources`` next to the graph; dropping both frees them.
- ``keep_alive(obj)``: what a launcher calls for such a buffer while the current stream captures.
  It goes to the recording ``GraphResources`` of this thread; with none (a graph captured by a
  caller that does not record, e.g. a bare ``torch.cuda.graph`` around ``torch.ops.aegis.flood_``),
  to a process-lifetime registry, since nothing then tells when that graph is gone.
- ``GraphedFlood``: the shield's ``flood_keyed_`` captured once per set of gradient addresses and
  replayed on later steps; each graph holds its own ``GraphResources``.

Why graphs at all: a small model's step is launch-bound (GPT-2 at batch 8: ~22 ms on an H200, GPU
waiting on the host), and the flood's ~20 kernel launches plus the custom op's Python dispatch cost
more host time than its kernels take on the GPU. A replay is one launch.

The key is still chosen on the host per step (a fresh 256-bit secret) and reaches the graph as the
``flood_keyed_`` state [master key x 8, step], copied from a pinned slot; the graph derives the
step key from it through the cipher. Slots rotate and each waits for its previous copy, so a host
running ahead of the GPU never overwrites a key not yet read (two steps sharing noise would cancel
it in their difference). The parameter table is read by address: the shield updates it in place.
"""
from __future__ import annotations

import contextlib
import threading
from collections import OrderedDict
from collections.abc import Iterator
from typing import NamedTuple

import torch
from torch import Tensor

# ----------------------------------------------------------------------------- what a graph reads
_local = threading.local()
_UNOWNED: dict[int, object] = {}  # read by graphs captured without a recording GraphResources


class GraphResources:
    """The buffers a captured CUDA graph reads by address outside its memory pool. Keep this object
    exactly as long as the graph."""

    def __init__(self) -> None:
        self._held: dict[int, object] = {}

    def __len__(self) -> int:
        return len(self._held)

    @contextlib.contextmanager
    def recording(self) -> Iterator[GraphResources]:
        """Within: ``keep_alive`` calls of this thread add to this object."""
        outer = getattr(_local, "recording", None)
        _local.recording = self
        try:
            yield self
        finally:
            _local.recording = outer


def is_capturing(device: torch.device) -> bool:
    """Whether the current CUDA stream is being captured (launches on ``device`` then go into a graph)."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def keep_alive(obj: object) -> None:
    """Keep ``obj`` (a buffer the graph being captured reads) alive as long as that graph."""
    held = getattr(_local, "recording", None)
    (_UNOWNED if held is None else held._held).setdefault(id(obj), obj)


def unowned_count() -> int:
    """How many objects graphs captured without a recording GraphResources keep for the process."""
    return len(_UNOWNED)


# ----------------------------------------------------------------------------- the shield's graphs
_SLOTS = 4
_STATE = 9  # master key words x 8, step
_MAX_GRAPHS = 4  # e.g. gradients alternating between two sets of buffers
_MAX_SEEN = 64


class _Captured(NamedTuple):
    graph: torch.cuda.CUDAGraph
    resources: GraphResources  # dropped with the graph


class GraphedFlood:
    """``flood_keyed_`` over one device's gradients; captured on the second call that sees a set of
    gradient addresses (the first, eager, warms the kernels' launch tables) and replayed whenever that
    set comes back (up to four sets; the oldest graph and what it reads are dropped for a fifth).
    A new set runs eagerly."""

    def __init__(self, device: torch.device) -> None:
        self.state = torch.zeros(_STATE, dtype=torch.int64, device=device)
        self._slots = [torch.zeros(_STATE, dtype=torch.int64).pin_memory() for _ in range(_SLOTS)]
        self._views = [slot.numpy() for slot in self._slots]  # host writes without torch dispatch
        self._copied = [torch.cuda.Event() for _ in range(_SLOTS)]
        self._calls = 0
        self._graphs: OrderedDict[tuple, _Captured] = OrderedDict()  # by gradient layout
        self._seen: set[tuple] = set()
        self.disabled: str | None = None  # why capture was given up (then every call is eager)
        self.replays = self.captures = 0

    def __call__(self, tensors: list[Tensor], modes: str, params: Tensor, master: list[int], step: int) -> None:
        self._load_state(master, step)
        sig = (params.data_ptr(), *((t.data_ptr(), t.numel(), t.dtype) for t in tensors))
        captured = self._graphs.get(sig)
        if captured is not None:
            captured.graph.replay()
            self.replays += 1
            return

        def run() -> None:
            torch.ops.aegis.flood_keyed_(tensors, modes, params, self.state)

        if self.disabled or sig not in self._seen:
            if len(self._seen) >= _MAX_SEEN:
                self._seen.clear()
            self._seen.add(sig)
            run()
            return
        graph = torch.cuda.CUDAGraph()
        resources = GraphResources()
        # Captured on a side stream by hand: torch.cuda.graph() would also synchronize and empty the
        # allocator's cache, which moves the next step's gradients and so defeats the replay.
        current = torch.cuda.current_stream(self.state.device)
        side = torch.cuda.Stream(self.state.device)
        side.wait_stream(current)
        try:
            with resources.recording(), torch.cuda.device(self.state.device), torch.cuda.stream(side):
                graph.capture_begin()
                try:
                    run()
                finally:
                    graph.capture_end()
        except RuntimeError as err:  # e.g. another thread's work during capture: stay eager, still flooded
            self.disabled = f"{type(err).__name__}: {err}"[:200]
            run()
            return
        current.wait_stream(side)
        graph.replay()
        self._graphs[sig] = _Captured(graph, resources)
        if len(self._graphs) > _MAX_GRAPHS:
            self._graphs.popitem(last=False)
        self.captures += 1

    def _load_state(self, master: list[int], step: int) -> None:
        i = self._calls % _SLOTS
        self._calls += 1
        self._copied[i].synchronize()  # the copy that last read this slot has run
        self._views[i][:-1] = master
        self._views[i][-1] = step
        self.state.copy_(self._slots[i], non_blocking=True)
        self._copied[i].record()
