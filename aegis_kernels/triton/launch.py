"""Launch planning: block sizes, which kernels serve a device, rows-flood tiling, and the plan of an
in-place ``flood_`` (which tensors go to rows floods, grouped matrix launches or per-tensor chains).

Nothing here launches a kernel; rows.py, matrix.py and flood.py do, with what this module decides.
"""
from __future__ import annotations

import collections
import dataclasses
import importlib
from typing import Any, NamedTuple

import torch
from torch import Tensor

from .. import reference as ref
from .interpret import INTERPRETED, InterpretedKernels, interpreted_module

SPAN = 16384  # elements per matrix tile; pass 1 and pass 2 share the tile table
STATS_BLOCK = 1024  # tiles reduced per step by the matrix stats kernel
CACHE_MAX = 32  # entries of each launch cache (plans, tables, layouts)


@dataclasses.dataclass
class LaunchConfig:
    """Block sizes, warps and math of one kind of launch. The interpreter pays per operation, not per
    element: it gets bigger tiles. Mutable so that a benchmark sweep can try variants."""

    fast_math: bool  # hardware log / sin / cos (stream.py)
    sum_block: int  # matrix pass 1: elements per step of a tile
    sum_iters: int
    sum_unroll: int
    flood_block: int  # matrix pass 2: elements per step of a tile
    flood_iters: int
    noise_block: int  # elements per noise-kernel program
    flat_block: int  # rows pass 2 for any row length: elements per program
    rows_tile1: int  # elements per [BLOCK_R, BLOCK_D] tile, rows pass 1
    rows_warps1: int
    rows_tile2: int  # rows pass 2, short rows (several per program)
    rows_warps: int
    row_split: int  # rows pass 2 takes one row per program from this row length on
    rows_bd2: int  # its column block (at most; / words per element squared)
    rows_warps2: int | None  # None: one keystream block per thread (more threads would replicate ChaCha work)
    reduce_chunk: int  # rows per program when the one-pass rows flood's per-row parts are reduced
    pipe_warps: int
    pipe_chunks: int  # pipeline stages of a grouped matrix flood (at most; 4 beat 1 and 8 on H100 and H200)
    pipe_min_bytes: int  # bytes of gradient per stage (at least)


GPU = LaunchConfig(
    fast_math=True, sum_block=2048, sum_iters=SPAN // 2048, sum_unroll=2, flood_block=2048,
    flood_iters=SPAN // 2048, noise_block=2048, flat_block=2048, rows_tile1=2048, rows_warps1=4, rows_tile2=2048,
    rows_warps=4, row_split=512, rows_bd2=1024, rows_warps2=None, reduce_chunk=1024, pipe_warps=4, pipe_chunks=4,
    pipe_min_bytes=128 << 20,
)
INTERPRETER = LaunchConfig(
    fast_math=False, sum_block=16384, sum_iters=SPAN // 16384, sum_unroll=1, flood_block=8192,
    flood_iters=SPAN // 8192, noise_block=16384, flat_block=8192, rows_tile1=16384, rows_warps1=4, rows_tile2=16384,
    rows_warps=4, row_split=512, rows_bd2=16384, rows_warps2=None, reduce_chunk=4, pipe_warps=4, pipe_chunks=4,
    pipe_min_bytes=1,
)
# the configuration of launches in this process's own mode (grouped tables built outside a launch)
PROCESS = INTERPRETER if INTERPRETED else GPU


# ----------------------------------------------------------------------------- backends
class Backend(NamedTuple):
    """The kernel modules (compiled, or interpreted copies) and the launch configuration for a device."""

    stream: Any
    rows: Any
    matrix: Any
    config: LaunchConfig
    interpreted: bool

    def module(self, name: str) -> Any:
        """Another kernel module of the package (e.g. ``testing``) of the same kind."""
        return _load(name, self.interpreted)


_BACKENDS: dict[bool, Backend] = {}


def _load(name: str, interpreted: bool) -> Any:
    if interpreted:
        return InterpretedKernels(interpreted_module(name))
    return importlib.import_module(f"{__package__}.{name}")


def _build(interpreted: bool) -> Backend:
    stream, rows, matrix = (_load(n, interpreted) for n in ("stream", "rows", "matrix"))
    config = INTERPRETER if interpreted else GPU
    return _BACKENDS.setdefault(interpreted, Backend(stream, rows, matrix, config, interpreted))


def backend(device: torch.device) -> Backend:
    """Kernels (and their launch configuration) for tensors on ``device``: compiled on CUDA, else
    (CPU, or any device in a process started with TRITON_INTERPRET=1) interpreted."""
    if device.type == "cuda" and not INTERPRETED:
        return _BACKENDS.get(False) or _build(False)
    if device.type in ("cpu", "cuda"):
        return _BACKENDS.get(True) or _build(True)
    raise ValueError(f"aegis Triton kernels run on CUDA (or CPU through the interpreter), not {device}")


class on_device:
    """Launch on the tensor's GPU (Triton launches on the current device)."""

    def __init__(self, device: torch.device):
        self.ctx = torch.cuda.device(device) if device.type == "cuda" else None

    def __enter__(self):
        if self.ctx is not None:
            self.ctx.__enter__()

    def __exit__(self, *exc):
        if self.ctx is not None:
            self.ctx.__exit__(*exc)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def pow2_floor(n: int) -> int:
    return 1 << (max(int(n), 1).bit_length() - 1)


# ----------------------------------------------------------------------------- rows tiling
class Tile(NamedTuple):
    rows: int  # BLOCK_R
    cols: int  # BLOCK_D
    warps: int | None


class RowsTiling(NamedTuple):
    norms: Tile  # pass 1 (row norms)
    flood: Tile  # pass 2; flood.rows == 1: one row per program (the one-pass kernel)


def block_d(D: int, cap: int) -> int:
    """Largest power of two <= cap whose padding wastes at most 1/8 of a row (16 at least)."""
    for b in (4096, 2048, 1024, 512, 256, 128, 64, 32, 16):
        if b <= cap and (cdiv(D, b) * b - D) * 8 <= D:
            return b
    return 16


def rows_tiling(cfg: LaunchConfig, V: int, D: int, per: int) -> RowsTiling:
    """Tiles of the two passes of a V x D rows flood with ``per`` keystream words per element.

    Long rows (>= row_split, whole keystream blocks): one row per program, one pass, one keystream
    block per thread; on an H100 a warp per 256 fp32 / two per 1024 bf16 elements measured best
    (more threads per row replicate the cipher; more elements per thread cost occupancy).
    Short rows: pass 1 ~16 elements per thread; pass 2 several rows per program."""
    bd1 = block_d(D, 1024)
    norms = Tile(max(1, min(cfg.rows_tile1 // bd1, pow2_floor(V))), bd1, cfg.rows_warps1)
    lanes = ref.BLOCK_WORDS // per
    if D % ref.BLOCK_WORDS == 0 and D >= cfg.row_split:
        cap = cfg.rows_bd2 // (per * per)
        bd2 = next((b for b in (2048, 1024, 512, 256, 128) if b <= cap and D % b == 0), None)
        bd2 = bd2 or block_d(D, cap)
        return RowsTiling(norms, Tile(1, bd2, cfg.rows_warps2 or max(1, bd2 // (32 * lanes))))
    bd2 = block_d(D, 1024)
    return RowsTiling(norms, Tile(max(1, min(cfg.rows_tile2 // bd2, pow2_floor(V))), bd2, cfg.rows_warps))


# ----------------------------------------------------------------------------- flood_ plans
class RowsStep(NamedTuple):
    """A rows flood of tensor ``index`` from keystream block ``bbase``."""

    device: torch.device
    tensor: int  # its position in ``grads`` (``index`` would shadow tuple.index)
    bbase: int


class GroupStep(NamedTuple):
    """Matrix floods of same (device, dtype, alignment) tensors from one address table."""

    device: torch.device
    indices: list[int]
    index_tensor: Tensor  # indices on the device (selects their parameter rows)
    bbases: list[int]
    vec: bool  # 16-byte aligned and numel % 16 == 0: vector accesses


class ChainStep(NamedTuple):
    """Per-tensor matrix floods of one device, pipelined tensor by tensor."""

    device: torch.device
    indices: list[int]
    bbases: list[int]


class FloodPlan(NamedTuple):
    steps: list  # RowsStep | GroupStep | ChainStep
    copies: list[int]  # non-contiguous tensors: flooded in a contiguous copy, then copied back


_PLANS: collections.OrderedDict[tuple, FloodPlan] = collections.OrderedDict()


def flood_plan(grads: list[Tensor], modes: str, grouped: bool | None) -> FloodPlan:
    """The validated launch plan of ``flood_(grads, modes)``, cached per set of tensors (alignment,
    dtype, device, shape, contiguity: the plan holds no pointers, and gradients move between steps),
    so a training loop pays the Python work once."""
    try:
        sig = (modes, grouped, tuple((g.data_ptr() % 16, g.dtype, g.device, g.shape, g.is_contiguous())
                                     for g in grads))
    except Exception:  # e.g. a sparse gradient: let the full checks below explain
        sig = None
    if sig is not None and sig in _PLANS:
        _PLANS.move_to_end(sig)
        return _PLANS[sig]
    plan = _make_plan(grads, ref.split_modes(modes), grouped)
    if sig is not None:
        _PLANS[sig] = plan
        while len(_PLANS) > CACHE_MAX:
            _PLANS.popitem(last=False)
    return plan


def _make_plan(grads, modes, grouped) -> FloodPlan:
    """Validate, assign stream offsets, and split into rows floods, grouped tables and chains."""
    if len(grads) != len(modes):
        raise ValueError("flood_: grads and modes must have the same length")
    for g, mode in zip(grads, modes):
        ref.check_grad(g, mode)
    offsets = ref.stream_offsets([(g.numel(), g.dtype) for g in grads])
    copies = [i for i, g in enumerate(grads) if not g.is_contiguous()]
    steps: list = []
    groups: dict[tuple, list[int]] = {}
    chain: dict[torch.device, list[int]] = {}
    for i, (g, mode) in enumerate(zip(grads, modes)):
        if g.numel() == 0:
            continue
        if mode == "rows":
            steps.append(RowsStep(g.device, i, offsets[i] // ref.BLOCK_WORDS))
            continue
        use_grouped = (g.device.type == "cuda" and not INTERPRETED) if grouped is None else grouped
        if use_grouped and i not in copies:
            # (temporary copies get new addresses every call: they stay out of the cached tables)
            vec = g.data_ptr() % 16 == 0 and g.numel() % 16 == 0
            groups.setdefault((g.device, g.dtype, vec), []).append(i)
        else:
            chain.setdefault(g.device, []).append(i)
    for (device, _, vec), idx in groups.items():
        index = torch.tensor(idx, dtype=torch.int64, device=device)
        steps.append(GroupStep(device, idx, index, [offsets[i] // ref.BLOCK_WORDS for i in idx], vec))
    for device, idx in chain.items():
        steps.append(ChainStep(device, idx, [offsets[i] // ref.BLOCK_WORDS for i in idx]))
    return FloodPlan(steps, copies)


def clear_plans() -> None:
    _PLANS.clear()
