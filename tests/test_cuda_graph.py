"""The lifetime of what a captured CUDA graph reads (aegis_kernels.cuda_graph): the grouped launch
tables a graph reads by address live exactly as long as that graph, not as long as the process.

CPU: the mechanism, with the capture state faked. GPU (``-m gpu``): GraphedFlood drops its oldest
graph for a fifth layout of gradients, and with it the tables that graph read; the graphs it keeps
still replay correctly after the launch caches forgot every table.
"""
from __future__ import annotations

import gc
import weakref

import pytest
import torch

pytest.importorskip("triton")

import aegis_kernels  # noqa: E402,F401  (registers the CUDA kernels)
from aegis_kernels import cuda_graph  # noqa: E402
from aegis_kernels import reference as ref  # noqa: E402
from aegis_kernels import triton as TF  # noqa: E402
from aegis_kernels.triton import tables  # noqa: E402


def _bbases(grads):
    return [o // ref.BLOCK_WORDS for o in ref.stream_offsets([(g.numel(), g.dtype) for g in grads])]


def test_tables_read_by_a_graph_live_as_long_as_its_resources(monkeypatch):
    grads = [torch.zeros(3, 7000), torch.zeros(40000)]
    bbases = _bbases(grads)
    tables.clear_caches()
    entry = tables.group_tables(grads, bbases)  # eager warm-up: cached
    meta = weakref.ref(entry.meta)
    resources = cuda_graph.GraphResources()
    monkeypatch.setattr(cuda_graph, "is_capturing", lambda device: True)
    with resources.recording():
        assert tables.group_tables(grads, bbases) is entry  # "captured": recorded for this graph
    monkeypatch.undo()
    assert len(resources) == 1
    del entry
    tables.clear_caches()
    gc.collect()
    assert meta() is not None  # the caches forgot it; the graph's resources keep it
    del resources  # the graph is dropped with its resources
    gc.collect()
    assert meta() is None


def test_capture_without_recording_keeps_tables_for_the_process(monkeypatch):
    """A bare torch.cuda.graph around the op: nothing says when that graph goes, so its tables stay."""
    grads = [torch.zeros(129), torch.zeros(20000)]
    bbases = _bbases(grads)
    tables.clear_caches()
    meta = weakref.ref(tables.group_tables(grads, bbases).meta)
    monkeypatch.setattr(cuda_graph, "_UNOWNED", {})
    monkeypatch.setattr(cuda_graph, "is_capturing", lambda device: True)
    tables.group_tables(grads, bbases)
    tables.group_tables(grads, bbases)  # the same tables again: kept once
    assert cuda_graph.unowned_count() == 1
    tables.clear_caches()
    gc.collect()
    assert meta() is not None


def test_capture_of_unseen_gradients_is_refused(monkeypatch):
    tables.clear_caches()
    monkeypatch.setattr(cuda_graph, "is_capturing", lambda device: True)
    with pytest.raises(RuntimeError, match="warm-up"):
        tables.group_tables([torch.zeros(10)], [0])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_graphed_flood_frees_the_tables_of_dropped_graphs():
    dev = torch.device("cuda")
    flood = cuda_graph.GraphedFlood(dev)
    modes = "rows,matrix"
    params = torch.tensor([[0.5, 1.0, 10.0, 0.0]] * 2, device=dev)
    master = [0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344, 0xA4093822, 0x299F31D0, 0x082EFA98, 0xEC4E6C89]
    gen = torch.Generator(device=dev).manual_seed(0)

    def layout(k):  # a new layout per k: other shapes
        return [torch.randn(300 + k, 512, device=dev, generator=gen), torch.randn(20000 + 16 * k, device=dev,
                                                                                 generator=gen)]

    kept = []
    for k in range(cuda_graph._MAX_LAYOUTS + 2):
        flood(layout(k), modes, params, master, 2 * k)  # eager
        kept.append(weakref.ref(list(flood._layouts.values())[-1]))
        flood(layout(k), modes, params, master, 2 * k + 1)  # captured, at other addresses
    torch.cuda.synchronize()
    assert flood.captures == cuda_graph._MAX_LAYOUTS + 2 and flood.disabled is None
    tables.clear_caches()
    gc.collect()
    alive = [r() is not None for r in kept]
    assert alive == [False] * 2 + [True] * cuda_graph._MAX_LAYOUTS  # the dropped graphs and their tables are freed
    # the oldest graph kept still reads valid tables: its replay equals an eager flood under the same key
    grads = layout(2)
    clean = [g.clone() for g in grads]
    flood(grads, modes, params, master, 99)
    assert flood.replays == 1
    TF.flood_(clean, modes, params, ref.derive_key(torch.tensor(master), 99).to(dev))
    assert all(torch.equal(a, b) for a, b in zip(grads, clean))
