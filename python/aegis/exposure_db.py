"""One exposure store's database: its SQLite connection, this process's view of the counts, the budget
decision and the background merges (the layout and its cost are in :mod:`aegis.exposure_store`)."""
from __future__ import annotations

import contextlib
import logging
import os
import sqlite3
import threading
from collections.abc import Callable, Collection, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

import numpy as np

from . import exposure_runs as runs_io
from .exposure_files import check_location, fsync_dir, runs_folder
from .exposure_runs import Run

log = logging.getLogger("aegis.exposure")
T = TypeVar("T")

FORMAT, SCHEMA_VERSION = "aegis-exposure", 3
WINDOW = 8  # tokens per fingerprint window (aegis.exposure's counting rule): part of the store's format
CHECKPOINT_PAGES = 4096  # WAL pages (16 MiB) past which the worker checkpoints them into the file
FOLD_WINDOWS = 1 << 16  # digests in the log past which a worker folds it into a sorted run
FANOUT = 4  # runs of one level that merge into one run of the next
_COUNTERS = ("exports", "generation", "max_count", "next_run", "folded")
SCHEMA = """
CREATE TABLE meta(key TEXT PRIMARY KEY, value) WITHOUT ROWID;
CREATE TABLE log(seq INTEGER PRIMARY KEY, digests BLOB NOT NULL);
CREATE TABLE runs(name TEXT PRIMARY KEY, level INTEGER NOT NULL, windows INTEGER NOT NULL, checksum BLOB NOT NULL)
    WITHOUT ROWID;
"""


class Worker:
    """One thread, started on first use and forgotten in a forked child (which has none of the parent's)."""

    def __init__(self, name: str):
        self.name = name
        self._pool: ThreadPoolExecutor | None = None
        os.register_at_fork(after_in_child=self._forget)

    def submit(self, fn: Callable[..., T], *args: object) -> Future[T]:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=self.name)
        return self._pool.submit(fn, *args)

    def _forget(self) -> None:
        self._pool = None


DURABILITY = Worker("aegis-exposure-sync")  # the WAL's fsync before an export leaves, then checkpoints
MERGES = Worker("aegis-exposure-merge")  # folds and merges: seconds at 10^7 windows, never on a decision's path


def connect(path: Path) -> sqlite3.Connection:
    db = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False, timeout=60.0)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=NORMAL")
    db.execute("PRAGMA wal_autocheckpoint=0")  # checkpoints run on the worker, after the commit's fsync
    db.execute("PRAGMA journal_size_limit=0")  # a restarted WAL starts empty: its size counts its frames
    return db


def create_schema(db: sqlite3.Connection, salt: bytes, store_id: str) -> None:
    db.execute("BEGIN IMMEDIATE")
    for statement in SCHEMA.split(";")[:-1]:
        db.execute(statement)
    db.executemany("INSERT INTO meta VALUES (?, ?)", [("format", FORMAT), ("version", SCHEMA_VERSION),
                                                      ("window", WINDOW), ("salt", salt), ("store_id", store_id)]
                   + [(key, 0) for key in _COUNTERS])
    db.execute("COMMIT")


def _corrupt(path: Path, err: Exception) -> ValueError:
    return ValueError(f"exposure state {path} is corrupt ({err}): restore it from a backup. Starting a new one "
                      "(aegis.exposure.create_state) would forget every export so far; nothing was exported")


class StoreDatabase:
    """One connection per resolved path and process, shared by every shield that names it, with this
    process's view of the counts: the mapped runs of the manifest's generation, and the log rows after them
    (``tail``). Every use holds ``lock``."""

    def __init__(self, path: Path):
        self.path = path
        self.lock = threading.Lock()
        self.pid = os.getpid()
        check_location(path)
        with open(path, "rb") as f:
            json_state = f.read(1) == b"{"
        if json_state:
            raise ValueError(f"exposure state {path} is in the earlier JSON format: convert it once with "
                             f"`python -m aegis.exposure_store migrate {path}` and name the .sqlite file it writes")
        try:
            self.db = connect(path)
        except sqlite3.DatabaseError as err:
            raise _corrupt(path, err) from None
        meta = self.validate()
        self.salt, self.store_id = bytes(meta["salt"]), str(meta["store_id"])
        self.seen = {key: int(meta[key]) for key in ("exports", "generation")}  # they may only grow
        self.exports_here = 0  # reservations committed by this process
        self.identity = identity(path)
        self.durable: Future[None] | None = None  # the fsync of the last reservation's WAL frames
        self.page_size = int(self.db.execute("PRAGMA page_size").fetchone()[0])
        self.generation = -1  # of the manifest the view holds (-1: none yet)
        self.runs: list[Run] = []
        self.tail: dict[int, int] = {}  # counts of the log rows not yet folded into a run
        self.tail_rows = 0
        self.chunks: list[tuple[int, np.ndarray]] = []  # those rows (one an export) as (seq, digests), in order
        self.last_seq = 0
        self.merging = False

    # -- checks -----------------------------------------------------------------------------------
    def validate(self) -> dict:
        """The store's metadata, once its format is checked (a new shield on the store checks it again)."""
        try:
            meta = dict(self.db.execute("SELECT key, value FROM meta").fetchall())
            if meta.get("version") == SCHEMA_VERSION:
                self.db.execute("SELECT seq FROM log WHERE seq = 0").fetchone()
                self.db.execute("SELECT name FROM runs WHERE name = ''").fetchone()
        except sqlite3.DatabaseError as err:
            raise _corrupt(self.path, err) from None
        if meta.get("format") == FORMAT and meta.get("version") == 2:
            raise ValueError(f"exposure state {self.path} is in the earlier one-table format (v2): convert it once, "
                             f"counts and salt kept, with `python -m aegis.exposure_store migrate {self.path}`")
        if (meta.get("format"), meta.get("version"), meta.get("window")) != (FORMAT, SCHEMA_VERSION, WINDOW):
            raise ValueError(f"exposure state {self.path} has format {meta.get('format')!r} v{meta.get('version')} "
                             f"window {meta.get('window')}; this AEGIS reads {FORMAT!r} v{SCHEMA_VERSION} window "
                             f"{WINDOW}: restore the file this client wrote")
        if not isinstance(meta.get("salt"), bytes) or len(meta["salt"]) != 16:
            raise ValueError(f"exposure state {self.path} is corrupt (its salt): restore it from a backup")
        if not runs_folder(self.path).is_dir():
            raise ValueError(f"exposure state {self.path}: its folder of sorted runs {runs_folder(self.path)} is "
                             "missing: restore it beside the file; nothing was exported")
        return meta

    def check_file(self) -> None:
        """The name still holds the file this connection opened (not deleted, not replaced by another)."""
        try:
            found = identity(self.path)
        except FileNotFoundError:
            raise RuntimeError(f"exposure state {self.path} was deleted under a live shield: restore it; nothing "
                               "was exported") from None
        if found != self.identity:
            raise RuntimeError(f"exposure state {self.path} was replaced under a live shield (another file holds its "
                               "name): restore the original file; nothing was exported")
        with open(self.path, "rb") as f:  # overwritten in place: this connection's cache would not notice
            if f.read(16) != b"SQLite format 3\x00":
                raise ValueError(f"exposure state {self.path} is corrupt (not an SQLite database): restore it from a "
                                 "backup; nothing was exported")

    def check_identity(self) -> dict[str, int]:
        """Inside a transaction: the file is still the store this process opened, not rolled back. Returns
        the counters."""
        meta = dict(self.db.execute(f"SELECT key, value FROM meta WHERE key IN ('salt', 'store_id', "
                                    f"{', '.join(repr(k) for k in _COUNTERS)})"))
        if bytes(meta.get("salt", b"")) != self.salt or meta.get("store_id") != self.store_id:
            raise RuntimeError(f"exposure state {self.path} was replaced under a live shield (its salt or id changed): "
                               "restore the original file; nothing was exported")
        counters = {key: int(meta.get(key, -1)) for key in _COUNTERS}
        for key, seen in self.seen.items():
            if counters[key] < seen:
                raise RuntimeError(f"exposure state {self.path} was rolled back under a live shield ({key} "
                                   f"{counters[key]}, {seen} seen): restore the newest copy; nothing was exported")
            self.seen[key] = counters[key]
        return counters

    # -- the view ---------------------------------------------------------------------------------
    def refresh(self, counters: dict[str, int]) -> None:
        """Inside a transaction: bring the view to the store's state (a merge elsewhere reloads the manifest;
        otherwise only the log rows other processes appended are read)."""
        if counters["generation"] != self.generation:
            manifest = self.db.execute("SELECT name, level, windows, checksum FROM runs ORDER BY name").fetchall()
            mapped = {run.name: run for run in self.runs}
            folder = runs_folder(self.path)
            self.runs = [mapped.get(name) or runs_io.open_run(folder / name, name, level, windows, bytes(checksum),
                                                              self.store_id)
                         for name, level, windows, checksum in manifest]
            self.tail, self.chunks, self.tail_rows, self.last_seq = {}, [], 0, counters["folded"]
            self.generation = counters["generation"]
        for seq, digests in self.db.execute("SELECT seq, digests FROM log WHERE seq > ? ORDER BY seq",
                                            (self.last_seq,)).fetchall():
            self._append(seq, np.frombuffer(digests, "<i8").astype(np.int64))

    def _append(self, seq: int, digests: np.ndarray) -> None:
        self.chunks.append((seq, digests))
        for d in digests.tolist():
            self.tail[d] = self.tail.get(d, 0) + 1
        self.tail_rows += len(digests)
        self.last_seq = max(self.last_seq, seq)

    def counts(self, digests: Sequence[int]) -> np.ndarray:
        """Inside a transaction, after ``refresh``: each digest's count."""
        queries = np.fromiter(digests, np.int64, len(digests))
        total = runs_io.lookup(self.runs, queries)
        if self.tail:
            total += np.fromiter((self.tail.get(d, 0) for d in digests), np.int64, len(digests))
        return total

    @contextlib.contextmanager
    def reading(self) -> Iterator[dict[str, int]]:
        """Holding ``lock``, outside decisions: a read transaction with the view brought up to date; yields
        the counters."""
        self.db.execute("BEGIN")
        try:
            counters = self.check_identity()
            self.refresh(counters)
            yield counters
        finally:
            self.db.execute("COMMIT")

    def forget_view(self) -> None:
        """After a failed transaction: reload everything at the next one."""
        self.generation = -1

    # -- the decision -----------------------------------------------------------------------------
    def reserve(self, rows: Sequence[Collection[int]], digests: list[int], budget: int) -> int:
        """Holding ``lock``: refuse, or add one to every digest's count, in one ``BEGIN IMMEDIATE``."""
        db = self.db
        with self.writing():
            counters = self.check_identity()
            self.refresh(counters)
            counts = self.counts(digests).tolist()
            hot = {d for d, n in zip(digests, counts) if n >= budget}
            over = sum(not hot.isdisjoint(row) for row in rows)
            seq, appended = self.last_seq + 1, np.array(digests, np.int64)
            if not over and digests:  # one row, one statement: the lock is not given up and retaken per digest
                db.execute("INSERT INTO log(seq, digests) VALUES (?, ?)", (seq, appended.astype("<i8").tobytes()))
                db.execute("UPDATE meta SET value = value + 1 WHERE key = 'exports'")
                self.raise_max_count(max(counts) + 1, counters)
        if not over and digests:
            self._append(seq, appended)
            self.seen["exports"] += 1
            self.exports_here += 1
            self.durable = DURABILITY.submit(self._sync)
            if self.tail_rows >= FOLD_WINDOWS and not self.merging:
                self.merging = True
                MERGES.submit(self._merge)
        return over

    @contextlib.contextmanager
    def writing(self) -> Iterator[None]:
        """One ``BEGIN IMMEDIATE`` transaction, committed unless the body rolled it back; on an error, rolled
        back and the view reloaded at the next one."""
        self.db.execute("BEGIN IMMEDIATE")
        try:
            yield
            if self.db.in_transaction:
                self.db.execute("COMMIT")
        except BaseException:
            if self.db.in_transaction:
                self.db.execute("ROLLBACK")
            self.forget_view()
            raise

    def raise_max_count(self, top: int, counters: dict[str, int]) -> None:
        if top > counters["max_count"]:
            self.db.execute("UPDATE meta SET value = ? WHERE key = 'max_count'", (top,))

    def _sync(self) -> None:
        """Make the last commit durable before anything leaves, then checkpoint a WAL grown past its limit."""
        wal = self.fsync()
        if wal >= CHECKPOINT_PAGES * self.page_size:  # queued after this future: export() does not wait for it
            DURABILITY.submit(self._checkpoint)

    def fsync(self) -> int:
        """fsync the WAL (or, once checkpointed and removed, the file); returns the WAL's size."""
        wal = 0
        try:
            fd = os.open(f"{self.path}-wal", os.O_RDONLY | os.O_NOFOLLOW)
        except FileNotFoundError:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW)
        else:
            wal = os.fstat(fd).st_size  # its frames: a restarted WAL is cut to nothing (journal_size_limit)
        try:
            os.fsync(fd)  # a checkpoint syncs the file itself before it lets the WAL restart
        finally:
            os.close(fd)
        return wal

    def _checkpoint(self) -> None:
        with self.lock:
            self.db.execute("PRAGMA wal_checkpoint(PASSIVE)")

    # -- merges -----------------------------------------------------------------------------------
    def _merge(self) -> None:
        try:
            self.fold()
        except Exception:  # the counts stay exact without the merge, only slower to read
            log.exception("exposure store %s: folding the log into a sorted run failed", self.path)
        finally:
            self.merging = False

    def fold(self) -> bool:
        """Fold the log this process has seen into a level-0 run, merged with the runs its level cascades into
        (``exposure_runs.plan``). The work runs outside the lock; the commit checks that no other merge came
        first (else it drops its file: the counts are unchanged). Returns whether it committed."""
        with self.lock:
            if self.generation < 0 or not self.chunks:
                return False
            generation, upto, current = self.generation, self.last_seq, list(self.runs)
            fresh = np.concatenate([digests for _, digests in self.chunks])
        level, inputs = runs_io.plan(current, FANOUT)
        keys, counts = runs_io.merge([(fresh, np.ones(len(fresh), np.int64))] + [(r.keys, r.counts) for r in inputs])
        return self.add_run(keys, counts, level, inputs, generation, upto)

    def add_run(self, keys: np.ndarray, counts: np.ndarray, level: int, inputs: Sequence[Run], generation: int,
                upto: int) -> bool:
        """Commit a run that replaces ``inputs`` and the log up to ``upto``, if the manifest is still at
        ``generation``."""
        folder = runs_folder(self.path)
        temporary = folder / f".{os.getpid()}-{threading.get_ident()}.tmp"
        temporary.unlink(missing_ok=True)
        checksum = runs_io.write(temporary, self.store_id, keys, counts)
        try:
            with self.lock:
                committed = self._commit_run(temporary, checksum, keys, counts, level, inputs, generation, upto)
        finally:
            temporary.unlink(missing_ok=True)
        if committed:
            for run in inputs:
                (folder / run.name).unlink(missing_ok=True)
        return committed

    def _commit_run(self, temporary: Path, checksum: bytes, keys: np.ndarray, counts: np.ndarray, level: int,
                    inputs: Sequence[Run], generation: int, upto: int) -> bool:
        db, folder = self.db, runs_folder(self.path)
        check_location(self.path)
        self.check_file()
        with self.writing():
            counters = self.check_identity()
            if counters["generation"] != generation:
                db.execute("ROLLBACK")
                return False
            name = f"{counters['next_run']:012d}.run"
            _collect_orphans(folder, {row[0] for row in db.execute("SELECT name FROM runs")})
            os.replace(temporary, folder / name)
            fsync_dir(folder)
            db.execute("DELETE FROM log WHERE seq <= ?", (upto,))
            db.executemany("DELETE FROM runs WHERE name = ?", ((run.name,) for run in inputs))
            db.execute("INSERT INTO runs VALUES (?, ?, ?, ?)", (name, level, len(keys), checksum))
            db.executemany("UPDATE meta SET value = ? WHERE key = ?",
                           [(generation + 1, "generation"), (counters["next_run"] + 1, "next_run"),
                            (max(upto, counters["folded"]), "folded")])
            self.raise_max_count(int(counts.max(initial=0)), counters)  # a loaded run's counts are new
        self.fsync()  # durable before the inputs it replaces are deleted
        self.seen["generation"] = self.generation = generation + 1
        gone = {run.name for run in inputs}
        self.runs = [run for run in self.runs if run.name not in gone]
        self.runs.append(runs_io.open_run(folder / name, name, level, len(keys), None, self.store_id))
        kept, self.chunks, self.tail, self.tail_rows = self.chunks, [], {}, 0
        for seq, digests in kept:
            if seq > upto:
                self._append(seq, digests)
        return True

    def merged(self) -> runs_io.Counts:
        """Every stored window with its count (a full merge: for summaries, not for decisions)."""
        with self.lock, self.reading():
            parts = [(run.keys, run.counts) for run in self.runs]
            parts.append((np.fromiter(self.tail, np.int64, len(self.tail)),
                          np.fromiter(self.tail.values(), np.int64, len(self.tail))))
        return runs_io.merge(parts)


def _collect_orphans(folder: Path, listed: set[str]) -> None:
    """Inside a write transaction (no other process is between its rename and its commit): delete the runs
    a crash left unlisted, and the temporary files of processes that are gone."""
    for entry in os.scandir(folder):
        if entry.name.endswith(".run") and entry.name not in listed:
            os.unlink(entry.path)
        elif entry.name.endswith(".tmp") and not _alive(entry.name[1:].split("-")[0]):
            os.unlink(entry.path)


def _alive(pid: str) -> bool:
    """Whether the process a temporary file names may still be writing it (a name of no pid: yes)."""
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except (ValueError, PermissionError):
        return True
    return True


def identity(path: Path) -> tuple[int, int]:
    info = os.stat(path)
    return info.st_dev, info.st_ino


def bulk_load(database: StoreDatabase, keys: np.ndarray, counts: np.ndarray) -> None:
    """Add counts to a store as one run (migrations; a benchmark's history)."""
    keys, counts = runs_io.merge([(keys, counts)])
    level = 0
    while FOLD_WINDOWS * FANOUT ** (level + 1) <= len(keys):
        level += 1
    with database.lock, database.reading() as counters:
        pass
    if not database.add_run(keys, counts, level, [], counters["generation"], counters["folded"]):
        raise RuntimeError(f"exposure state {database.path}: another process merged during the load; load again")
