"""Keyed BLAKE2b (RFC 7693) of many short messages at once, with numpy: the same digests as
``hashlib.blake2b(message, key=key, digest_size=...)``, for messages of 1 to 128 bytes.

Why not ``hashlib``: the exposure counting hashes every token window of a step (456 at B = 8 x 64) on a
worker thread while the training thread launches the backward. ``hashlib`` holds the interpreter lock for
inputs under 2 KiB, so a loop of window digests takes it for milliseconds at a stretch and every Python
hook of the backward waits for it. Here each step of the compression is one numpy operation over all
messages, which releases the lock while it computes; the lock changes hands between operations.

The key block is the same for every message, so it is compressed once; each message is then one final
block: F(h, m, t = 128 + len, last). The 8 G calls of a round run as two vectorised steps on the state's
rows (columns, then diagonals by rotating rows b, c, d).
"""
from __future__ import annotations

import numpy as np

IV = np.array([0x6A09E667F3BCC908, 0xBB67AE8584CAA73B, 0x3C6EF372FE94F82B, 0xA54FF53A5F1D36F1,
               0x510E527FADE682D1, 0x9B05688C2B3E6C1F, 0x1F83D9ABFB41BD6B, 0x5BE0CD19137E2179], np.uint64)
SIGMA = np.array([
    [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15],
    [14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3],
    [11, 8, 12, 0, 5, 2, 15, 13, 10, 14, 3, 6, 7, 1, 9, 4],
    [7, 9, 3, 1, 13, 12, 11, 14, 2, 6, 5, 10, 4, 0, 15, 8],
    [9, 0, 5, 7, 2, 4, 10, 15, 14, 1, 11, 12, 6, 8, 3, 13],
    [2, 12, 6, 10, 0, 11, 8, 3, 4, 13, 7, 5, 15, 14, 1, 9],
    [12, 5, 1, 15, 14, 13, 4, 10, 0, 7, 6, 3, 9, 2, 8, 11],
    [13, 11, 7, 14, 12, 1, 3, 9, 5, 0, 15, 4, 8, 6, 2, 10],
    [6, 15, 14, 9, 11, 3, 0, 8, 12, 2, 13, 7, 1, 4, 10, 5],
    [10, 2, 8, 4, 7, 6, 1, 5, 15, 11, 9, 14, 3, 12, 13, 0],
])
ROUNDS, BLOCK = 12, 128
_LEFT1, _LEFT2, _LEFT3 = [1, 2, 3, 0], [2, 3, 0, 1], [3, 0, 1, 2]  # row rotations between columns and diagonals
_ALL_ONES = np.uint64(0xFFFFFFFFFFFFFFFF)


def _rotr(x: np.ndarray, n: int, scratch: np.ndarray) -> None:
    """x = x rotated right by n bits, in place."""
    np.right_shift(x, np.uint64(n), out=scratch)
    np.left_shift(x, np.uint64(64 - n), out=x)
    np.bitwise_or(x, scratch, out=x)


def _g(a: np.ndarray, b: np.ndarray, c: np.ndarray, d: np.ndarray, x: np.ndarray, y: np.ndarray,
       scratch: np.ndarray) -> None:
    """RFC 7693's G on (4, n) rows: a = a + b + x; d = (d ^ a) >>> 32; c = c + d; b = (b ^ c) >>> 24;
    a = a + b + y; d = (d ^ a) >>> 16; c = c + d; b = (b ^ c) >>> 63 (arithmetic mod 2^64)."""
    for word, rd, rb in ((x, 32, 24), (y, 16, 63)):
        a += b
        a += word
        d ^= a
        _rotr(d, rd, scratch)
        c += d
        b ^= c
        _rotr(b, rb, scratch)


def _compress(h: np.ndarray, m: np.ndarray, t: np.ndarray, last: bool) -> np.ndarray:
    """F(h, m, t, f) for (8, n) states, (16, n) message words and (n,) byte counters below 2^64."""
    n = h.shape[1]
    v = np.empty((16, n), np.uint64)
    v[:8] = h
    v[8:] = IV[:, None]
    v[12] ^= t
    if last:
        v[14] ^= _ALL_ONES
    a, b, c, d = v[0:4], v[4:8].copy(), v[8:12].copy(), v[12:16].copy()
    a = a.copy()
    scratch = np.empty((4, n), np.uint64)
    for r in range(ROUNDS):
        s = SIGMA[r % 10]
        _g(a, b, c, d, m[s[0:8:2]], m[s[1:8:2]], scratch)  # columns
        b, c, d = b[_LEFT1], c[_LEFT2], d[_LEFT3]
        _g(a, b, c, d, m[s[8:16:2]], m[s[9:16:2]], scratch)  # diagonals
        b, c, d = b[_LEFT3], c[_LEFT2], d[_LEFT1]
    return h ^ np.concatenate([a, b]) ^ np.concatenate([c, d])


def blake2b_keyed(words: np.ndarray, lengths: np.ndarray, key: bytes, digest_size: int) -> np.ndarray:
    """Digests of n messages: ``words`` (n, 16) uint64, message i's bytes little-endian in its first
    ``lengths[i]`` bytes (1..128) and zero after them. Returns (n, digest_size) uint8."""
    if not 1 <= len(key) <= 64 or not 1 <= digest_size <= 64:
        raise ValueError(f"blake2b_keyed: key of {len(key)} bytes, digest_size {digest_size}: both must be 1..64")
    words = np.asarray(words, np.uint64)
    n = len(words)
    if n and (lengths.min() < 1 or lengths.max() > BLOCK):
        raise ValueError("blake2b_keyed: every message must hold 1..128 bytes")
    h = IV.copy()
    h[0] ^= np.uint64(0x01010000 | (len(key) << 8) | digest_size)
    key_block = np.frombuffer(key.ljust(BLOCK, b"\0"), "<u8").astype(np.uint64)
    h = _compress(h[:, None], key_block[:, None], np.array([BLOCK], np.uint64), last=False)[:, 0]
    state = _compress(np.repeat(h[:, None], n, 1), np.ascontiguousarray(words.T),
                      np.asarray(lengths, np.uint64) + np.uint64(BLOCK), last=True)
    return np.ascontiguousarray(state.T, "<u8").view(np.uint8)[:, :digest_size]
