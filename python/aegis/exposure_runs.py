"""Sorted runs: the bulk of an exposure store's counts, in immutable files merged in the background.

A run holds ``(digest, count)`` pairs sorted by digest. A lookup is one binary search per run
(``numpy.searchsorted`` over a memory-mapped file, which processes on one store share through the page
cache); new counts reach a run only by a merge, which writes a new file sequentially. So an export never
rewrites the history: its decision reads O(digests x runs) entries and appends O(digests) log rows, and
each stored window is rewritten about log_FANOUT(history / first run) times over its life, in the
background (a log-structured merge tree, tiered).

File: a 64-byte header (magic, format version, windows, the store's id), then ``windows`` little-endian
int64 digests in ascending order, then as many uint32 counts: 12 bytes a window. Its blake2b checksum is
kept in the store's manifest and checked when a process maps the file.
"""
from __future__ import annotations

import hashlib
import mmap
import os
import struct
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from .exposure_files import check_stat

MAGIC, VERSION = b"AEGISRUN", 1
HEADER = struct.Struct("<8sIQ16s28x")  # magic, version, windows, store id (16 hex digits): 64 bytes
KEY, COUNT = np.dtype("<i8"), np.dtype("<u4")
MAX_COUNT = np.iinfo(COUNT).max  # a count saturates here (over-counting is safe; no budget comes near it)
_HASH_CHUNK = 1 << 24
BUCKET = 8  # mean keys per bucket of a run's radix index (about 1 byte of index a window, in memory)
MAX_WIDTH = 64  # a fuller bucket means keys that are not digests: such a run is bisected


class Run:
    """A sorted run and its radix index: digests are uniform (salted hashes), so their top ``bits`` bits cut
    the run into buckets of about ``BUCKET`` keys, and ``starts[b]`` is where bucket ``b`` begins. A lookup
    reads one index entry and one bucket (a few cache lines) instead of a chain of ~log2(windows) dependent
    reads across the file."""

    def __init__(self, name: str, level: int, keys: np.ndarray, counts: np.ndarray):
        self.name, self.level, self.keys, self.counts = name, level, keys, counts
        bits = int(np.clip(np.log2(max(len(keys), 1) / BUCKET), 1, 40))
        self.shift = np.uint64(64 - bits)
        top = (_unsigned(keys) >> self.shift).astype(np.intp)
        self.starts = np.zeros((1 << bits) + 1, np.int64)
        np.cumsum(np.bincount(top, minlength=1 << bits), out=self.starts[1:])
        self.width = int(np.diff(self.starts).max())  # the fullest bucket

    def __len__(self) -> int:
        return len(self.keys)

    def find(self, queries: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """For each query, whether the run holds it and where (``at`` is meaningful where found)."""
        n = len(self.keys)
        if not n:
            return np.zeros(len(queries), bool), np.zeros(len(queries), np.intp)
        if self.width > MAX_WIDTH:  # keys that are not uniform (never digests): bisect
            at = np.minimum(np.searchsorted(self.keys, queries), n - 1)
            return self.keys[at] == queries, at
        bucket = (_unsigned(queries) >> self.shift).astype(np.intp)
        lo, hi = self.starts[bucket], self.starts[bucket + 1]
        slots = lo[:, None] + np.arange(self.width)
        inside = slots < hi[:, None]
        below = (self.keys[np.minimum(slots, n - 1)] < queries[:, None]) & inside
        at = np.minimum(lo + below.sum(1), n - 1)
        return (at < hi) & (self.keys[at] == queries), at


def _unsigned(keys: np.ndarray) -> np.ndarray:
    """int64 keys mapped to uint64 in the same order."""
    return np.asarray(keys, KEY).view(np.uint64) ^ np.uint64(1 << 63)


Counts = tuple[np.ndarray, np.ndarray]  # (keys, counts) before they are a run


def lookup(runs: Sequence[Run], queries: np.ndarray) -> np.ndarray:
    """The summed count of each int64 query over the runs (0 where no run holds it)."""
    total = np.zeros(len(queries), np.int64)
    for run in runs:
        found, at = run.find(queries)
        total[found] += run.counts[at[found]]
    return total


def merge(parts: Sequence[Counts]) -> Counts:
    """One sorted, distinct set of keys with the summed counts of every part."""
    if not parts:
        return np.zeros(0, KEY), np.zeros(0, COUNT)
    keys = np.concatenate([np.asarray(k, KEY) for k, _ in parts])
    counts = np.concatenate([np.asarray(c, np.int64) for _, c in parts])
    order = np.argsort(keys, kind="stable")  # sorted parts: a merge of runs, linear per part
    keys, counts = keys[order], counts[order]
    if not len(keys):
        return keys, counts.astype(COUNT)
    first = np.empty(len(keys), bool)
    first[0] = True
    np.not_equal(keys[1:], keys[:-1], out=first[1:])
    starts = np.flatnonzero(first)
    summed = np.add.reduceat(counts, starts)
    return keys[starts], np.minimum(summed, MAX_COUNT).astype(COUNT)


def write(path: Path, store_id: str, keys: np.ndarray, counts: np.ndarray) -> bytes:
    """Write a run file (mode 600, refuses to overwrite) and make it durable; returns its checksum."""
    digest = hashlib.blake2b(digest_size=16)
    header = HEADER.pack(MAGIC, VERSION, len(keys), store_id.encode("ascii"))
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(fd, "wb", closefd=False) as f:
            f.write(header)
            for body in (np.ascontiguousarray(keys, KEY), np.ascontiguousarray(counts, COUNT)):
                data = body.data.cast("B")
                digest.update(data)
                f.write(data)
        os.fsync(fd)
    finally:
        os.close(fd)
    return digest.digest()


def open_run(path: Path, name: str, level: int, windows: int, checksum: bytes | None, store_id: str) -> Run:
    """Map a run file of this store; its checksum is verified unless ``None`` (this process wrote it)."""
    size = HEADER.size + windows * (KEY.itemsize + COUNT.itemsize)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        raise ValueError(f"exposure state: the run {path} its manifest lists is missing: restore the store's "
                         "folder from a backup; nothing was exported") from None
    try:
        info = os.fstat(fd)
        check_stat(info, path, "run")
        if info.st_size != size:
            raise ValueError(f"exposure state: the run {path} has {info.st_size} bytes, not {size}: restore "
                             "the store from a backup; nothing was exported")
        if windows == 0:
            return Run(name, level, np.zeros(0, KEY), np.zeros(0, COUNT))
        mapped = mmap.mmap(fd, size, access=mmap.ACCESS_READ)
    finally:
        os.close(fd)
    magic, version, n, owner = HEADER.unpack_from(mapped)
    if (magic, version, n, owner.decode("ascii", "replace")) != (MAGIC, VERSION, windows, store_id):
        raise ValueError(f"exposure state: the run {path} does not belong to this store (header {magic!r} v{version}, "
                         f"{n} windows, store {owner!r}): restore the store from a backup; nothing was exported")
    if checksum is not None:
        digest = hashlib.blake2b(digest_size=16)
        view = memoryview(mapped)
        for start in range(HEADER.size, size, _HASH_CHUNK):
            digest.update(view[start : min(start + _HASH_CHUNK, size)])
        view.release()
        if digest.digest() != checksum:
            raise ValueError(f"exposure state: the run {path} does not match its checksum (changed or damaged): "
                             "restore the store from a backup; nothing was exported")
    keys = np.frombuffer(mapped, KEY, windows, HEADER.size)
    counts = np.frombuffer(mapped, COUNT, windows, HEADER.size + windows * KEY.itemsize)
    return Run(name, level, keys, counts)


def plan(runs: Sequence[Run], fanout: int) -> tuple[int, list[Run]]:
    """Where a new level-0 run goes: the level it lands at and the runs it merges with. A level that would
    hold ``fanout`` runs merges them into one of the next level, which may cascade."""
    level, inputs = 0, list[Run]()
    while True:
        same = [r for r in runs if r.level == level]
        if len(same) + 1 < fanout:
            return level, inputs
        inputs += same
        level += 1
