"""The counting rule (the rule itself is stated in :mod:`aegis.exposure`): rows of token ids -> one set of
salted window digests per row, the store's keys. Torch-free: it runs in the decider process
(:mod:`aegis.exposure_decider`), beside the store."""
from __future__ import annotations

import hashlib

import numpy as np

from .exposure_db import WINDOW

Rows = list[frozenset[int]]  # one digest set per counted row (the store's 64-bit keys)


def fingerprints(row: np.ndarray, special: frozenset[int]) -> tuple[np.ndarray, np.ndarray]:
    """The token windows one row of ids is counted by: a (k, WINDOW) int64 array of windows, each
    zero-padded after its length, and the (k,) lengths in tokens."""
    if special:
        is_special = np.isin(row, list(special))
        cuts = np.flatnonzero(is_special)
        segments = [s[~np.isin(s, list(special))] for s in np.split(row, cuts)] if len(cuts) else [row]
    else:
        segments = [row]
    windows, lengths = [], []
    for segment in segments:
        n = len(segment)
        if n > WINDOW:
            windows.append(np.lib.stride_tricks.sliding_window_view(segment, WINDOW))
            lengths.append(np.full(n - WINDOW + 1, WINDOW))
        elif n:
            short = [segment, segment[1:], segment[:-1]] if n > 1 else [segment]
            padded = np.zeros((len(short), WINDOW), np.int64)
            for i, part in enumerate(short):
                padded[i, : len(part)] = part
            windows.append(padded)
            lengths.append(np.array([len(part) for part in short]))
    if not windows:
        return np.zeros((0, WINDOW), np.int64), np.zeros(0, np.int64)
    return np.concatenate(windows).astype(np.int64), np.concatenate(lengths)


class Counting:
    """The counting rule with the salt. A window's digest is ``blake2b(its int64 tokens, little-endian;
    key=salt, digest_size=16)``, its first 64 bits as the store's key (``exposure_store.digest_key``)."""

    def __init__(self, salt: bytes, pad: int | None, special: frozenset[int]):
        self.keyed = hashlib.blake2b(key=salt, digest_size=16)
        self.pad, self.special = pad, special

    def rows(self, ids: np.ndarray, mask: np.ndarray | None) -> Rows:
        """One digest set per row of the (rows, length) ``ids``; ``mask`` (nonzero: a real token) drops the
        padding, else the pad id at either end (a row whose mask is all zero counts by all its ids)."""
        ids = ids.astype(np.int64, copy=False)
        keep_mask = None if mask is None else mask != 0
        out = []
        for k, row in enumerate(ids):
            if keep_mask is not None and keep_mask[k].any():
                row = row[keep_mask[k]]
            elif self.pad is not None:
                keep = np.flatnonzero(row != self.pad)
                row = row[keep[0] : keep[-1] + 1] if len(keep) else row[:0]
            out.append(frozenset(self.digests(*fingerprints(row, self.special))))
        return out

    def digests(self, windows: np.ndarray, lengths: np.ndarray) -> list[int]:
        """The store's keys of (k, WINDOW) zero-padded windows of the given lengths (each window a slice of
        one bytes object)."""
        data = memoryview(windows.astype("<i8").tobytes())
        keys = []
        for i, n in enumerate(lengths.tolist()):
            h = self.keyed.copy()
            h.update(data[i * 8 * WINDOW : (i * WINDOW + n) * 8])
            keys.append(int.from_bytes(h.digest()[:8], "little", signed=True))
        return keys
