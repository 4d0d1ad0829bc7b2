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
- ``GraphedFlood``: the shield's ``flood_keyed_`` and checksum captured once per layout of gradients
  and replayed on every later step, wherever the gradients are (``aegis_kernels.triton.addressed``).

Why graphs at all: a small model's step is launch-bound (GPT-2 at batch 8: the GPU waits on the host),
and the flood's launches, its plan and the custom op's Python dispatch cost more host time than its
kernels take on the GPU. A replay is one launch.

The key is still chosen on the host per step (a fresh 256-bit secret) and reaches the graph with the
gradients' addresses as int64 [master key x 8, step, address x T], copied from a pinned slot; the graph
derives the step key from it through the cipher. Slots rotate and each waits for its previous copy, so
a host running ahead of the GPU never overwrites a key not yet read (two steps sharing noise would
cancel it in their difference). The parameter table is read by address: the shield updates it in place.
"""
from __future__ import annotations

import contextlib
import threading
from collections import OrderedDict
from collections.abc import Iterator

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
_MAX_LAYOUTS = 4
_STATE = 9  # master key words x 8, step


class _Staging:
    """A device int64 buffer written from a ring of pinned host slots: the host writes slot k only after the
    copy that last read it ran."""

    def __init__(self, device: torch.device, size: int) -> None:
        self.device = torch.empty(size, dtype=torch.int64, device=device)
        self._slots = [torch.zeros(size, dtype=torch.int64).pin_memory() for _ in range(_SLOTS)]
        self._views = [slot.numpy() for slot in self._slots]  # host writes without torch dispatch
        self._copied = [torch.cuda.Event() for _ in range(_SLOTS)]
        self._calls = 0

    def load(self, values: list[int]) -> Tensor:
        i = self._calls % _SLOTS
        self._calls += 1
        self._copied[i].synchronize()
        self._views[i][:] = values
        self.device.copy_(self._slots[i], non_blocking=True)
        self._copied[i].record()
        return self.device


class _Layout:
    """One layout's addressed launches, its staging buffer and, from its second step, its graph."""

    def __init__(self, tensors: list[Tensor], modes: str, params: Tensor) -> None:
        from .triton.addressed import STATE, AddressedFlood

        self.staging = _Staging(tensors[0].device, STATE + len(tensors))
        self.flood = AddressedFlood(tensors, modes, params, self.staging.device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.norms: Tensor | None = None  # the graph's output buffer


class GraphedFlood:
    """``flood_keyed_`` plus the flooded tensors' norms over one device's gradients. The first call of a layout
    (shapes, dtype, modes, parameter table) runs the addressed launches eagerly, the second captures them as
    a CUDA graph, and later calls replay it whatever the gradients' addresses (up to four layouts; the
    oldest graph is dropped for a fifth). A layout no table can address (``unaddressable``) runs
    ``flood_keyed_`` eagerly, as does every call once capture failed (``disabled`` says why)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._layouts: OrderedDict[tuple, _Layout | None] = OrderedDict()
        self._eager: _Staging | None = None
        self.disabled: str | None = None  # why capture was given up (then every call is eager)
        self.replays = self.captures = 0

    def __call__(self, tensors: list[Tensor], modes: str, params: Tensor, master: list[int], step: int
                 ) -> Tensor | None:
        """Flood ``tensors`` in place under derive_key(master, step); their fp32 norms after the flood (a fresh
        tensor), or None when the flood ran as eager ``flood_keyed_`` (the caller takes the norms)."""
        from .triton.addressed import unaddressable

        ptrs = [t.data_ptr() for t in tensors]
        sig = (modes, params.data_ptr(), tuple(t.shape for t in tensors), tensors[0].dtype)
        if sig not in self._layouts:
            self._layouts[sig] = None if unaddressable(tensors, modes) else _Layout(tensors, modes, params)
            if len(self._layouts) > _MAX_LAYOUTS:
                self._layouts.popitem(last=False)
        layout = self._layouts[sig]
        if (self.disabled or layout is None or any(p % 16 for p in ptrs)
                or any(t.dtype != tensors[0].dtype or not t.is_contiguous() for t in tensors)):
            self._run_eagerly(tensors, modes, params, master, step)
            return None
        layout.staging.load([*master, step, *ptrs])
        if layout.graph is not None:
            layout.graph.replay()
            self.replays += 1
        elif layout.norms is None:  # first step: eager, which compiles the kernels before a capture
            layout.norms = layout.flood.launch()
            return layout.norms.clone()
        else:
            self._capture(layout)
        assert layout.norms is not None
        return layout.norms.clone()

    def _run_eagerly(self, tensors: list[Tensor], modes: str, params: Tensor, master: list[int], step: int) -> None:
        if self._eager is None:
            self._eager = _Staging(self.device, _STATE)
        torch.ops.aegis.flood_keyed_(tensors, modes, params, self._eager.load([*master, step]))

    def _capture(self, layout: _Layout) -> None:
        graph = torch.cuda.CUDAGraph()
        # Captured on a side stream by hand: torch.cuda.graph() would also synchronize and empty the
        # allocator's cache, a stall on every layout's capture.
        current = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(current)
        try:
            with torch.cuda.device(self.device), torch.cuda.stream(side):
                # thread_local: the exposure decider's worker thread may wait on a CUDA event meanwhile
                graph.capture_begin(capture_error_mode="thread_local")
                try:
                    norms = layout.flood.launch()
                finally:
                    graph.capture_end()
        except RuntimeError as err:  # e.g. another thread's work during capture: stay eager, still flooded
            self.disabled = f"{type(err).__name__}: {err}"[:200]
            layout.norms = layout.flood.launch()
            return
        current.wait_stream(side)
        graph.replay()
        layout.graph, layout.norms = graph, norms
        self.captures += 1

