"""The counting rule's digests are the store's format: ``digest_key(blake2b(window's int64 tokens,
key=salt, digest_size=16))`` for every window and short segment of a row."""
import hashlib

import numpy as np

from aegis.exposure_counting import Counting, fingerprints
from aegis.exposure_store import WINDOW, digest_key


def _reference(salt, row, special):
    """The counting rule's digests one window at a time, with hashlib."""
    windows, lengths = fingerprints(row, special)
    return frozenset(digest_key(hashlib.blake2b(w[:n].astype("<i8").tobytes(), key=salt, digest_size=16).digest())
                     for w, n in zip(windows, lengths))


def test_the_counting_rule_hashes_every_window_as_the_store_expects():
    rng = np.random.default_rng(0)
    salt, special, pad = rng.bytes(16), frozenset({0, 1}), 2
    ids = rng.integers(3, 50, (6, 40))
    ids[0, 10] = ids[1, 3] = ids[1, 9] = 1  # separators: short segments (1..8 tokens) and long ones
    ids[2, 30:] = pad  # padding at the end
    ids[3, :] = pad  # nothing left to count
    ids[4, 5] = 0
    ids[4, 7] = 0  # a segment of one token
    rows = Counting(salt, pad, special).rows(ids, None)
    expect = []
    for row in ids:
        keep = np.flatnonzero(row != pad)
        expect.append(_reference(salt, row[keep[0] : keep[-1] + 1] if len(keep) else row[:0], special))
    assert rows == expect
    assert rows[3] == frozenset() and len(rows[5]) == 40 - WINDOW + 1
    single = fingerprints(np.array([7]), frozenset())
    assert single[0].tolist() == [[7] + [0] * (WINDOW - 1)] and single[1].tolist() == [1]
