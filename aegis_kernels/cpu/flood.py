"""The CPU floods: ``flood`` (functional) and ``flood_`` (in place, many tensors under one key), what
``aegis_kernels.ops`` registers on the CPU key; and ``keystream``, the words on their own.

A tensor's stream is cut into chunks of CHUNK_BLOCKS blocks. Per chunk: the numba kernels make the
words and the Box-Muller operands, torch takes log / cos / sin / sqrt of them (in place, on
cache-resident buffers), the numba kernels make the normals and the fused multiply-adds into the
output. The per-tensor factors and stats (norms, clip, active rows) come from the reference's own
functions, computed just before the tensor's first chunk (it is then in cache for the flood). The chunks
of all tensors are shared among ``threads`` workers (threads.py), each with its own buffers; inside the
flood, torch runs one intra-op thread (restored on return).
"""
from __future__ import annotations

import math
import threading
from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from .. import reference as ref
from . import kernels as K
from .threads import flood_threads, torch_threads

CHUNK_BLOCKS = 4096  # 32 K pairs: a chunk's buffers (~1.5 MB) stay in a core's L2


class _Views:
    """The arrays of one chunk size (nb blocks), sliced once from a worker's buffers."""

    def __init__(self, buf: _Buffers, nb: int) -> None:
        n = K.PAIRS * nb
        self.words = buf.words[: ref.BLOCK_WORDS * nb].reshape(ref.BLOCK_WORDS, nb)
        self.x, self.theta, self.cos, self.sv = (a[:n] for a in (buf.x, buf.theta, buf.cos, buf.sv))
        self.x2, self.theta2, self.cos2, self.sv2 = (a.reshape(K.PAIRS, nb) for a in (self.x, self.theta, self.cos,
                                                                                        self.sv))
        self.tx, self.ttheta, self.tcos = (torch.from_numpy(a) for a in (self.x, self.theta, self.cos))


class _Buffers:
    """One worker's scratch arrays for a chunk of up to CHUNK_BLOCKS blocks (numpy, with torch views)."""

    def __init__(self) -> None:
        nb = CHUNK_BLOCKS
        self.words = np.empty(ref.BLOCK_WORDS * nb, np.uint32)
        self.x, self.theta, self.cos, self.sv = (np.empty(K.PAIRS * nb, np.float32) for _ in range(4))
        self.sig, self.g32, self.out32 = (np.empty(ref.BLOCK_WORDS * nb, np.float32) for _ in range(3))
        self.tg32, self.tout32 = torch.from_numpy(self.g32), torch.from_numpy(self.out32)
        self.full = _Views(self, nb)

    def wipe(self) -> None:
        """Zero every array: after a flood they hold the last chunk's signal rho clip(G), its gradient
        copy, its keystream words and its normals, which would outlive the export in the pool."""
        for a in (self.words, self.x, self.theta, self.cos, self.sv, self.sig, self.g32, self.out32):
            a.fill(0)

    def normals(self, key: np.ndarray, block0: int, nb: int) -> tuple[np.ndarray, np.ndarray]:
        """The (8, nb) cos / sin components of the pairs of blocks block0 .. block0 + nb - 1 (r cos theta and
        r sin theta: reference.normal_pair), made in place in this worker's buffers."""
        v = self.full if nb == CHUNK_BLOCKS else _Views(self, nb)
        K.words(key, block0, ref.NOISE_DOMAIN, v.words)
        K.operands(v.words, v.x2, v.theta2, v.sv2)
        torch.log(v.tx, out=v.tx)
        torch.cos(v.ttheta, out=v.tcos)
        torch.sin(v.ttheta, out=v.ttheta)
        K.radius_square(v.x, v.sv)
        torch.sqrt(v.tx, out=v.tx)
        K.polar(v.x, v.cos, v.theta)
        return v.cos2, v.theta2


# Reused between floods (allocating ~1.5 MB per worker per step costs more than the flood of a small
# tensor); wiped before it is returned, so the pool holds zeros between floods.
_POOL: list[_Buffers] = []
_POOL_LOCK = threading.Lock()


def _take() -> _Buffers:
    with _POOL_LOCK:
        return _POOL.pop() if _POOL else _Buffers()


def _give(buf: _Buffers) -> None:
    buf.wipe()
    with _POOL_LOCK:
        _POOL.append(buf)


class _Job:
    """One tensor to flood: ``grad`` as given (its factors and stats), its contiguous form ``src`` read
    into ``out`` (``src`` again in place; numpy views when fp32). The factors are computed by the first
    worker that reaches the tensor (``prepare``), just before its chunks, while it is in cache."""

    def __init__(self, grad: Tensor, src: Tensor, out: Tensor, mode: str, params: Tensor, offset: int) -> None:
        self.grad, self.mode, self.params = grad, mode, params
        self.src_t, self.dst_t = src.reshape(-1), out.reshape(-1)
        self.src = self.src_t.numpy() if self.src_t.dtype == torch.float32 else None
        self.dst = self.dst_t.numpy() if self.dst_t.dtype == torch.float32 else None
        self.per = ref.words_per_element(grad.dtype)
        self.block0 = offset // ref.BLOCK_WORDS
        self.per_chunk = CHUNK_BLOCKS * ref.BLOCK_WORDS // self.per
        self.chunks = -(-self.src_t.numel() // self.per_chunk)
        self.stats: Tensor | None = None
        self.bad = False
        self._lock = threading.Lock()

    def prepare(self) -> None:
        """scale (per row of length d; one row of numel in matrix mode), noise weight w and stats, from
        the reference's own functions on the gradient as given (a norm's summation order follows it)."""
        with self._lock:
            if self.stats is not None:
                return
            g = self.grad.detach().float()
            if self.mode == "rows":
                scale, stats = ref.rows_scale(g, self.params)
                self.d = max(self.grad.shape[1], 1)
            else:
                scale, stats = ref.matrix_scale(g, self.params)
                scale, self.d = scale.reshape(1), max(self.grad.numel(), 1)
            sigma = stats[0]
            w = sigma if self.per == 1 else (sigma * ref.INV_SQRT2).float()  # reference.add_noise's weight
            self.scale, self.w = scale.numpy(), np.float32(w.item())
            self.stats = stats

    def finish(self) -> Tensor:
        """reference._finish: a non-finite input element makes the whole output and the stats NaN."""
        self.prepare()  # an empty tensor has no chunks
        assert self.stats is not None
        if self.bad:
            self.dst_t.fill_(math.nan)
            self.stats.fill_(math.nan)
        return self.stats


def _run_chunk(job: _Job, chunk: int, key: np.ndarray, buf: _Buffers) -> None:
    if job.stats is None:
        job.prepare()
    first = chunk * job.per_chunk
    m = min(job.src_t.numel() - first, job.per_chunk)
    z0, z1 = buf.normals(key, job.block0 + chunk * CHUNK_BLOCKS, -(-m * job.per // ref.BLOCK_WORDS))
    if job.src is not None:  # fp32: read the tensor's own memory
        g = job.src[first : first + m]
    else:
        buf.tg32[:m].copy_(job.src_t[first : first + m])
        g = buf.g32[:m]
    sig = buf.sig[:m]
    if K.signal(sig, g, first, job.scale, job.d):
        job.bad = True
    if job.dst is not None:
        K.add_noise(job.dst[first : first + m], sig, z0, z1, job.w, job.per)
    else:
        K.add_noise(buf.out32[:m], sig, z0, z1, job.w, job.per)
        job.dst_t[first : first + m].copy_(buf.tout32[:m])  # rounds to nearest even, as reference's .to(dtype)


def _run(jobs: list[_Job], key: Tensor, threads: int) -> None:
    """All chunks of all jobs, shared among ``threads`` workers in contiguous runs of equal work."""
    k = key.detach().cpu().numpy().astype(np.uint32)
    work = [(job, c) for job in jobs for c in range(job.chunks)]
    if not work:
        return
    threads = max(1, min(threads, len(work)))

    def worker(part: Sequence[tuple[_Job, int]]) -> None:
        buf = _take()
        try:
            for job, c in part:
                _run_chunk(job, c, k, buf)
        finally:
            _give(buf)

    bounds = [len(work) * t // threads for t in range(threads + 1)]
    parts = [work[bounds[t] : bounds[t + 1]] for t in range(threads)]
    errors: list[BaseException] = []

    def guarded(part):
        try:
            worker(part)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the calling thread
            errors.append(exc)

    pool = [threading.Thread(target=guarded, args=(p,), daemon=True) for p in parts[1:]]
    for t in pool:
        t.start()
    guarded(parts[0])
    for t in pool:
        t.join()
    if errors:
        raise errors[0]


def flood(grad: Tensor, mode: str, params: Tensor, key: Tensor, offset: int = 0,
          threads: int | None = None) -> tuple[Tensor, Tensor]:
    """reference.flood with noise from (key, offset): (out, stats), bit for bit."""
    ref.check_grad(grad, mode)
    ref.check_offset(offset)
    ref.check_key(key)
    params = ref.as_params(params, grad.device)
    threads = flood_threads(threads)  # before torch_threads(1): the default reads torch's setting
    with torch_threads(1):
        g = grad.detach().contiguous()
        out = torch.empty_like(g, memory_format=torch.contiguous_format)
        job = _Job(grad, g, out, mode, params, offset)
        _run([job], key, threads)
        stats = job.finish()
        if g.data_ptr() != grad.data_ptr():
            g.zero_()  # a contiguous copy of the clean gradient: not left behind in freed memory
    return out, stats


def flood_(grads: list[Tensor], modes: str, params: Tensor, key: Tensor, threads: int | None = None) -> None:
    """reference.flood_many_ in place: tensor k under params[k] from word offset stream_offsets(...)[k]."""
    mode_list = ref.split_modes(modes)
    if len(grads) != len(mode_list):
        raise ValueError("flood_: grads and modes must have the same length")
    ref.check_params_table(params, len(grads))
    ref.check_key(key)
    for g, mode in zip(grads, mode_list):
        ref.check_grad(g, mode)
    offsets = ref.stream_offsets([(g.numel(), g.dtype) for g in grads])
    threads = flood_threads(threads)
    with torch_threads(1):
        jobs, copies = [], []
        for g, mode, p, offset in zip(grads, mode_list, params, offsets):
            work = g.detach() if g.is_contiguous() else g.detach().contiguous()  # flood a copy, write it back
            jobs.append(_Job(g, work, work, mode, p, offset))
            copies.append((g, work))
        _run(jobs, key, threads)
        for job in jobs:
            job.finish()
        for g, work in copies:
            if work.data_ptr() != g.data_ptr():
                g.copy_(work)


def keystream(key: Tensor, block0: int, count: int, domain: int = ref.NOISE_DOMAIN) -> Tensor:
    """reference.keystream(key, arange(block0, block0 + count)): (count, 16) int64 words; the 64-bit
    counter wraps, block0 in [0, 2^64)."""
    ref.check_key(key)
    w = np.empty((ref.BLOCK_WORDS, count), np.uint32)
    signed = block0 - 2**64 if block0 >= 2**63 else block0  # the kernel's int64 argument, same bits
    K.words(key.cpu().numpy().astype(np.uint32), signed, domain, w)
    return torch.from_numpy(w.T.astype(np.int64))
