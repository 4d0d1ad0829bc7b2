"""The shield's CUDA-graph-replayed flood: ``aegis_kernels.cuda_graph.GraphedFlood``, which owns the
capture, the replays and the lifetime of what each graph reads."""
from aegis_kernels.cuda_graph import GraphedFlood

__all__ = ["GraphedFlood"]
