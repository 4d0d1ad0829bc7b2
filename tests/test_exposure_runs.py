"""The exposure store's log-structured layout: sorted runs, folds and merges keep every count exact, across
views of one store (processes), through damage and crashes; an export writes O(its digests), not O(history)."""
import multiprocessing as mp
import os
import sqlite3
import sys
from collections import Counter

import numpy as np
import pytest

from aegis import exposure_db, exposure_runs
from aegis.exposure_store import (
    MERGES,
    ExposureStore,
    StoreDatabase,
    bulk_load,
    create_state,
    migrate,
    runs_folder,
)

TESTS = os.path.dirname(__file__)


@pytest.fixture
def small(monkeypatch):
    """Folds every 40 log rows, a level of 2 runs merges: many folds and cascades in a few exports."""
    monkeypatch.setattr(exposure_db, "FOLD_WINDOWS", 40)
    monkeypatch.setattr(exposure_db, "FANOUT", 2)


def settle():
    MERGES.submit(lambda: None).result()


def test_merge_and_lookup_agree_with_a_counter():
    rng = np.random.default_rng(0)
    uniform = rng.integers(-(2**63), 2**63 - 1, 20_000, dtype=np.int64)  # digests: the radix index's case
    parts = [(np.zeros(0, np.int64), np.zeros(0, np.int64)),
             (uniform[:5000], np.ones(5000, np.int64)),
             (np.concatenate([uniform[3000:20_000], [-(2**63), 2**63 - 1]]), rng.integers(1, 4, 17_002)),
             (rng.permutation(300) - 150, rng.integers(1, 4, 300))]  # skewed keys: bisected
    truth = Counter()
    for keys, counts in parts:
        for k, c in zip(keys.tolist(), counts.tolist()):
            truth[k] += c
    keys, counts = exposure_runs.merge(parts)
    assert keys.tolist() == sorted(truth) and counts.tolist() == [truth[k] for k in sorted(truth)]
    runs = [exposure_runs.Run(str(i), 0, *exposure_runs.merge([p])) for i, p in enumerate(parts)]
    assert runs[1].width <= exposure_runs.MAX_WIDTH < runs[3].width
    queries = np.concatenate([rng.choice(keys, 3000), rng.integers(-(2**63), 2**63 - 1, 3000, dtype=np.int64),
                              [-(2**63), 2**63 - 1, 0, -151, 150]])
    assert exposure_runs.lookup(runs, queries).tolist() == [truth.get(q, 0) for q in queries.tolist()]


def test_a_count_saturates_instead_of_wrapping():
    big = np.array([exposure_runs.MAX_COUNT], np.int64)
    keys, counts = exposure_runs.merge([(np.array([3]), big), (np.array([3]), big)])
    assert counts.tolist() == [exposure_runs.MAX_COUNT]


def test_folds_and_cascades_keep_every_count_exact(tmp_path, small):
    path = create_state(tmp_path / "client.sqlite")
    store = ExposureStore(str(path))
    rng = np.random.default_rng(1)
    truth = Counter()
    for step in range(120):
        digests = set(rng.integers(0, 300, 12).tolist())  # a small universe: counts climb past one
        over = store.reserve([digests], budget=6)
        expect = int(any(truth[d] >= 6 for d in digests))
        assert over == expect, step
        if not over:
            truth.update(digests)
        settle()
    db = store._db
    assert db is not None and db.generation > 10  # many folds happened
    assert len(db.runs) <= 8 and max(run.level for run in db.runs) >= 3  # and cascaded
    keys, counts = db.merged()
    assert dict(zip(keys.tolist(), counts.tolist())) == dict(truth)
    assert store.max_count == max(truth.values())
    on_disk = sorted(p.name for p in runs_folder(path).iterdir())
    assert on_disk == sorted(run.name for run in db.runs)  # merged runs deleted, nothing else left
    fresh = StoreDatabase(path)  # another process's view, from the files alone
    fresh.db.execute("BEGIN")
    fresh.refresh(fresh.check_identity())
    assert fresh.counts(sorted(truth)).tolist() == [truth[d] for d in sorted(truth)]
    fresh.db.execute("COMMIT")


def test_two_views_of_one_store_agree_through_each_others_merges(tmp_path, small):
    """Two connections, as two processes have: each decision sees the other's exports and merges; a merge
    computed on a manifest the other replaced is dropped, not committed."""
    path = create_state(tmp_path / "client.sqlite")
    a, b = StoreDatabase(path), StoreDatabase(path)
    reserve = {"a": a, "b": b}
    for i in range(30):
        first, second = ("a", "b") if i % 2 else ("b", "a")
        row = {1000 + 3 * i, 1001 + 3 * i, 1002 + 3 * i}
        with reserve[first].lock:
            assert reserve[first].reserve([row], sorted(row), 1) == 0
        with reserve[second].lock:
            assert reserve[second].reserve([row], sorted(row), 1) == 1  # the other one exported it
        if i % 7 == 3:
            assert reserve[first].fold()
    assert b.fold()
    assert a.chunks and a.generation != b.generation
    assert not a.fold()  # a's snapshot is of a manifest b replaced
    with a.lock:
        assert a.reserve([{1000}], [1000], 1) == 1 and a.generation == b.generation


def _exporter(path, seed, barrier, results):
    sys.path.insert(0, TESTS)
    from aegis import exposure_db as db_module
    from aegis.exposure_store import MERGES as merges
    from aegis.exposure_store import ExposureStore as Store

    db_module.FOLD_WINDOWS, db_module.FANOUT = 50, 2
    store = Store(path)
    rng = np.random.default_rng(seed)
    barrier.wait()
    exported = []
    for _ in range(80):
        row = set(rng.integers(0, 2000, 6).tolist())
        if store.reserve([row], budget=1) == 0:
            exported.append(sorted(row))
    merges.submit(lambda: None).result()
    results.put(exported)


def test_two_processes_merging_one_store_never_export_a_window_twice(tmp_path):
    path = str(create_state(tmp_path / "client.sqlite"))
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=_exporter, args=(path, seed, barrier, results)) for seed in (1, 2)]
    for p in procs:
        p.start()
    exported = [results.get(timeout=240) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    windows = [d for rows in exported for row in rows for d in row]
    assert len(windows) == len(set(windows))  # budget 1: each window left once in total
    assert min(len(rows) for rows in exported) > 5  # both exported, in turns
    store = ExposureStore(path)
    assert store.summary().windows == len(windows) and store._db.generation >= 2  # merges happened


def _folded_store(tmp_path):
    path = create_state(tmp_path / "client.sqlite")
    store = ExposureStore(str(path))
    assert store.reserve([{1, 2, 3}], budget=1) == 0
    assert store.fold()
    (run,) = runs_folder(path).iterdir()
    return path, run


def _open(path):
    db = StoreDatabase(path)
    with db.lock:
        return db.reserve([{9}], [9], 1)


@pytest.mark.parametrize("damage", ["flipped", "truncated", "missing", "foreign"])
def test_a_damaged_run_is_an_error_not_a_restart(tmp_path, damage):
    path, run = _folded_store(tmp_path)
    if damage == "flipped":
        data = bytearray(run.read_bytes())
        data[-1] ^= 1
        run.write_bytes(bytes(data))
    elif damage == "truncated":
        run.write_bytes(run.read_bytes()[:-4])
    elif damage == "missing":
        run.unlink()
    else:
        other, other_run = _folded_store(tmp_path / "other")
        run.write_bytes(other_run.read_bytes())
    message = {"flipped": "checksum", "truncated": "bytes", "missing": "missing", "foreign": "does not belong"}
    with pytest.raises(ValueError, match=message[damage]):
        _open(path)


def test_a_group_writable_run_is_refused(tmp_path):
    path, run = _folded_store(tmp_path)
    run.chmod(0o664)
    with pytest.raises(PermissionError, match="exposure run"):
        _open(path)


def test_a_crash_mid_merge_leaves_nothing_behind(tmp_path):
    """A run renamed but never committed, and the temporary file of a dead process, go at the next merge."""
    path, run = _folded_store(tmp_path)
    folder = runs_folder(path)
    orphan, dead, unknown = folder / "000000000077.run", folder / ".999999999-1.tmp", folder / ".notes.tmp"
    for leftover in (orphan, dead, unknown):
        leftover.write_bytes(b"x")
    store = ExposureStore(str(path))
    assert store.reserve([{4}], budget=1) == 0 and store.fold()
    assert sorted(p.name for p in folder.iterdir()) == sorted([".notes.tmp"] + [r.name for r in store._db.runs])
    assert store.count(1) == 1 and store.count(4) == 1


def test_an_export_writes_a_few_pages_whatever_the_history(tmp_path):
    """The decision appends its digests: its WAL frames do not grow with the windows already stored (a
    B-tree of random keys would dirty one page per new window), and a window costs well under 100 bytes."""
    path = create_state(tmp_path / "client.sqlite")
    store = ExposureStore(str(path))
    rng = np.random.default_rng(3)
    frames = []
    for history in (0, 10**6):
        bulk_load(store._db, rng.integers(-(2**63), 2**63 - 1, history, dtype=np.int64), np.ones(history, np.int64))
        with sqlite3.connect(path) as db:
            db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        before = os.path.getsize(f"{path}-wal")
        assert store.reserve([set(rng.integers(-(2**63), 2**63 - 1, 456).tolist())], budget=1) == 0
        frames.append((os.path.getsize(f"{path}-wal") - before) // (4096 + 24))
    assert max(frames) <= 8, frames  # a B-tree of random digests would write one page per new window: 456
    summary = store.summary()
    assert summary.windows == 10**6 + 2 * 456 and summary.bytes / summary.windows < 20


def test_a_v2_store_names_its_conversion_and_migrate_keeps_counts_and_salt(tmp_path):
    path = tmp_path / "old.sqlite"
    salt = bytes(range(16))
    with sqlite3.connect(path) as db:  # the one-table layout of format v2
        db.execute("CREATE TABLE meta(key TEXT PRIMARY KEY, value) WITHOUT ROWID")
        db.execute("CREATE TABLE counts(digest INTEGER PRIMARY KEY, n INTEGER NOT NULL)")
        db.executemany("INSERT INTO meta VALUES (?, ?)", [("format", "aegis-exposure"), ("version", 2), ("window", 8),
                                                         ("salt", salt), ("store_id", "0123456789abcdef"),
                                                         ("exports", 5)])
        db.executemany("INSERT INTO counts VALUES (?, ?)", [(-(2**63), 2), (11, 1), (2**63 - 1, 5)])
    path.chmod(0o600)
    with pytest.raises(ValueError, match=f"migrate {path}"):
        ExposureStore(str(path))
    assert migrate(path) == path
    store = ExposureStore(str(path))
    assert store.salt == salt and store.store_id == "0123456789abcdef"
    assert [store.count(k) for k in (-(2**63), 11, 2**63 - 1, 12)] == [2, 1, 5, 0]
    assert store.max_count == 5 and store.summary().exports == 5
    assert store.reserve([{11}], budget=2) == 0 and store.reserve([{11}], budget=2) == 1
