"""The exposure store: how many exports carried each salted token-window digest.

One store per client (``AegisConfig.exposure_state``), shared by every process and shield that names it.
The budget decision of an export is one ``BEGIN IMMEDIATE`` SQLite transaction (:meth:`ExposureStore.reserve`):
read the step's digests' counts, then either refuse (nothing written) or add one to each and commit. Only
after the commit does the flooded gradient leave, so two shields, two processes or two Flower runs on one
store can never export the same text past the budget; a crash after the commit over-counts (safe).

**Layout: a log-structured merge tree.** A B-tree keyed by random digests dirties one page per new window
once it outgrows the cache, so its commits grow with the history. Here an export appends one row to a
``log`` table, its digests as one blob (rows in sequence order: a few pages per export, whatever the
history), and the counts live in *sorted runs* (:mod:`aegis.exposure_runs`): immutable files of (digest,
count) pairs, memory-mapped and searched through a radix index. Once the log holds ``FOLD_WINDOWS`` digests,
a background thread folds it into a new run, merged with the runs of every level that then holds ``FANOUT``
of them, writes the file, and commits the swap (new run in the manifest, old runs and folded log rows out)
in one transaction, only if no other process merged first. Each process keeps a view of the counts: the
mapped runs and the log's rows since (read incrementally inside each decision; the whole log again after a
merge elsewhere).

**Cost per export**: O(digests x runs) index lookups and one appended row of O(digests) bytes; one WAL
append, made durable by an ``fsync`` on a worker thread that ``export()`` waits for (overlapping the flood
and the optimizer step); the WAL is checkpointed on that worker once it holds ``CHECKPOINT_PAGES``. On disk:
12 bytes a window in runs, plus the log. The merges, off the decision's path, rewrite each window about
log_FANOUT(windows / FOLD_WINDOWS) times over its life.

**Tables**: ``log(seq, digests)``, ``runs(name, level, windows, checksum)`` (the manifest) and ``meta(key,
value)``: format, schema version, window, salt, store id, and counters that only grow (``exports``,
``generation`` of the manifest, ``max_count``, ``next_run``, ``folded``: the last log row in a run). A
digest is the first 64 bits of the window's blake2b digest keyed by the salt, so the store does not let
anyone without the salt test a guessed sentence; a collision can only over-count.

**Fail closed**: a named store that is missing is an error (``create_state`` makes one); the default store
(``$AEGIS_CACHE_DIR`` or the user's cache folder) is created with a warning that it holds no earlier counts;
the file, its sidecars and their folder must belong to the user, be writable by nobody else and not be
symbolic links (:mod:`aegis.exposure_files`); a run that is missing, foreign or fails its checksum, and a
store whose salt or id changed or whose counters went down under a live shield, are errors.
"""
from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import sqlite3
import threading
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .exposure_db import (  # noqa: F401  (re-exported: the store's constants and its workers)
    CHECKPOINT_PAGES,
    DURABILITY,
    FANOUT,
    FOLD_WINDOWS,
    FORMAT,
    MERGES,
    SCHEMA,
    SCHEMA_VERSION,
    WINDOW,
    StoreDatabase,
    Worker,
    bulk_load,
    connect,
    create_schema,
    identity,
)
from .exposure_files import (  # noqa: F401  (re-exported)
    CACHE_ENV,
    cache_dir,
    check_location,
    check_owned,
    default_state_path,
    fsync_dir,
    runs_folder,
)

log = logging.getLogger("aegis.exposure")

IN_MEMORY = ":memory:"  # exposure_state for simulations: counts live as long as the shield


def digest_key(digest: bytes) -> int:
    """A window's key in the store: the first 64 bits of its salted digest, as a signed 64-bit integer."""
    return int.from_bytes(digest[:8], "little", signed=True)


def create_state(path: str | os.PathLike) -> Path:
    """Write a new, empty exposure store (fresh salt and id) at ``path``; refuses to overwrite one."""
    path = Path(path)
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as err:
        raise OSError(f"exposure state {path}: its folder cannot be made ({err.strerror}): set {CACHE_ENV} to a "
                      "writable folder of yours, or name a store with AegisConfig(exposure_state=PATH)") from None
    check_owned(path.parent, "folder")
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:
        raise FileExistsError(f"exposure state {path} exists: load it (AegisConfig(exposure_state=...)); "
                              "deleting it would restart every count from zero") from None
    os.close(fd)
    try:
        # what a store deleted by itself left: its runs, and sidecars another process may still map (a stale
        # shared-memory index would be trusted by the new connection, a stale WAL replayed into it)
        for suffix in ("-wal", "-shm"):
            Path(f"{path}{suffix}").unlink(missing_ok=True)
        shutil.rmtree(runs_folder(path), ignore_errors=True)
        runs_folder(path).mkdir(mode=0o700)
        with connect(path) as db:
            create_schema(db, secrets.token_bytes(16), secrets.token_hex(8))
    except BaseException:
        path.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
    return path


def reset_state(path: str | os.PathLike) -> Path:
    """Forget every count at ``path``: a new store with a new salt and id (callers confirm first)."""
    path = Path(path)
    check_location(path)
    _SHARED.pop(path.resolve(), None)
    for suffix in ("-wal", "-shm", ""):
        Path(f"{path}{suffix}").unlink(missing_ok=True)
    shutil.rmtree(runs_folder(path), ignore_errors=True)
    return create_state(path)


def migrate(source_path: str | os.PathLike, target_path: str | os.PathLike | None = None) -> Path:
    """Convert an exposure state of an earlier format, salt and counts kept: a JSON state (v1) into a new
    store at ``target_path`` (default: beside it, ``.sqlite``), or a one-table SQLite store (v2) in place."""
    source = Path(source_path)
    with open(source, "rb") as f:
        header = f.read(16)
    if header == b"SQLite format 3\x00":
        return _migrate_v2(source)
    target = Path(target_path) if target_path is not None else source.with_suffix(".sqlite")
    try:
        data = json.loads(source.read_text())
        if data["format"] != FORMAT or data["version"] != 1 or data["window"] != 8:
            raise ValueError(f"format {data['format']!r} v{data['version']} window {data['window']}")
        salt = bytes.fromhex(data["salt"])
        keys = np.array([digest_key(bytes.fromhex(d)) for d in data["counts"]], np.int64)
        counts = np.array([int(n) for n in data["counts"].values()], np.int64)
    except (ValueError, KeyError, TypeError) as err:
        raise ValueError(f"{source} is not an AEGIS JSON exposure state ({err})") from None
    create_state(target)
    db = connect(target)
    db.execute("UPDATE meta SET value = ? WHERE key = 'salt'", (salt,))
    db.execute("UPDATE meta SET value = ? WHERE key = 'exports'", (int(counts.max(initial=0)),))
    db.close()
    _load(target, keys, counts)
    return target


def _migrate_v2(path: Path) -> Path:
    check_location(path)
    db = connect(path)
    try:
        meta = dict(db.execute("SELECT key, value FROM meta"))
        if (meta.get("format"), meta.get("version")) != (FORMAT, 2):
            raise ValueError(f"{path} is not an AEGIS exposure store of format v2 ({meta.get('format')!r} "
                             f"v{meta.get('version')})")
        rows = db.execute("SELECT digest, n FROM counts ORDER BY digest").fetchall()
        exports = int(meta["exports"])
        runs_folder(path).mkdir(mode=0o700, exist_ok=True)
        db.execute("BEGIN IMMEDIATE")
        db.execute("DROP TABLE counts")
        for statement in SCHEMA.split(";")[1:-1]:  # the tables after meta
            db.execute(statement)
        db.execute("UPDATE meta SET value = ? WHERE key = 'version'", (SCHEMA_VERSION,))
        db.executemany("INSERT INTO meta VALUES (?, 0)", [(k,) for k in ("generation", "max_count", "next_run",
                                                                         "folded")])
        db.execute("UPDATE meta SET value = ? WHERE key = 'exports'", (exports,))
        db.execute("COMMIT")
    finally:
        db.close()
    keys = np.array([k for k, _ in rows], np.int64)
    _load(path, keys, np.array([n for _, n in rows], np.int64))
    log.warning("exposure store %s converted to format v%d: %d windows kept", path, SCHEMA_VERSION, len(rows))
    return path


def _load(path: Path, keys: np.ndarray, counts: np.ndarray) -> None:
    database = StoreDatabase(path)
    if len(keys):
        bulk_load(database, keys, counts)
    database.db.close()


@dataclass(frozen=True)
class StoreSummary:
    path: str
    store_id: str
    windows: int  # distinct digests stored
    max_count: int  # the most exports any one window has had
    exports: int  # reservations committed
    bytes: int  # the store's size on disk (WAL and runs included)


_SHARED: dict[Path, StoreDatabase] = {}
_SHARED_LOCK = threading.Lock()


def _database(path: Path) -> StoreDatabase:
    key = path.resolve()
    with _SHARED_LOCK:
        found = _SHARED.get(key)
        # a forked child opens its own connection; so does a shield opening a file that replaced the old one
        if found is None or found.pid != os.getpid() or found.identity != identity(path):
            found = _SHARED[key] = StoreDatabase(path)
        else:
            with found.lock:
                found.check_file()
                found.validate()
                found.check_identity()
        return found


class ExposureStore:
    """The salt and the counts of one client: in memory (``IN_MEMORY``), or in a store on disk."""

    def __init__(self, state: str | os.PathLike | None):
        self.path: Path | None = None
        self._memory: dict[int, int] = {}
        self._memory_exports = 0
        self._memory_lock = threading.Lock()
        if state == IN_MEMORY:
            self.salt, self.store_id = secrets.token_bytes(16), "in-memory"
            self._db: StoreDatabase | None = None
            return
        if state is None:
            self.path = default_state_path()
            legacy = self.path.with_suffix(".json")
            if not self.path.exists() and legacy.exists():
                migrate(legacy, self.path)
                log.warning("exposure counts migrated from %s to %s", legacy, self.path)
            elif not self.path.exists():
                create_state(self.path)
                log.warning("created a new exposure store at %s: no earlier counts (a deleted or moved store, or "
                            "a new %s, restarts every count from zero)", self.path, CACHE_ENV)
        else:
            self.path = Path(state)
            if not self.path.exists():
                raise FileNotFoundError(
                    f"exposure_state={str(state)!r} does not exist: a missing file would restart the counts. "
                    f"Create it once with aegis.exposure.create_state({str(state)!r}), or restore it")
        self._db = _database(self.path)
        self.salt, self.store_id = self._db.salt, self._db.store_id

    def _database(self) -> StoreDatabase:
        assert self._db is not None and self.path is not None
        if self._db.pid != os.getpid():  # a forked child: a connection must not cross a fork
            self._db = _database(self.path)
            if (self._db.salt, self._db.store_id) != (self.salt, self.store_id):
                raise RuntimeError(f"exposure state {self.path} was replaced (its salt or id changed): restore the "
                                   "original file; nothing was exported")
        return self._db

    def reserve(self, rows: Sequence[Collection[int]], budget: int) -> int:
        """The budget decision of one export, atomic across every process on the store: the number of rows
        holding a digest already exported ``budget`` times; when 0, every digest was counted once more."""
        digests = list(set().union(*rows)) if rows else []
        if self._db is None:
            with self._memory_lock:
                hot = {d for d in digests if self._memory.get(d, 0) >= budget}
                over = sum(not hot.isdisjoint(row) for row in rows)
                if not over and digests:
                    for d in digests:
                        self._memory[d] = self._memory.get(d, 0) + 1
                    self._memory_exports += 1
                return over
        db = self._database()
        with db.lock:
            check_location(db.path)
            db.check_file()
            try:
                return db.reserve(rows, digests, budget)
            except sqlite3.DatabaseError as err:
                raise ValueError(f"exposure state {self.path} is corrupt ({err}): restore it from a backup; nothing "
                                 "was exported") from None

    def wait_durable(self) -> None:
        """Block until the last reservation survives a power loss (``export()`` calls this)."""
        durable = None if self._db is None else self._db.durable
        if durable is not None:
            durable.result()

    def fold(self) -> bool:
        """Fold the log into the sorted runs now (the store does so by itself past ``FOLD_WINDOWS`` digests)."""
        return False if self._db is None else self._database().fold()

    @property
    def exports_here(self) -> int:
        """Exports this process counted in the store (the rest came from other processes or earlier runs)."""
        return self._memory_exports if self._db is None else self._db.exports_here

    def count(self, digest: int) -> int:
        if self._db is None:
            return self._memory.get(digest, 0)
        db = self._database()
        with db.lock, db.reading():
            return int(db.counts([digest])[0])

    @property
    def max_count(self) -> int:
        """The most exports any one window has had (a counter the decisions keep: no scan)."""
        if self._db is None:
            return max(self._memory.values(), default=0)
        db = self._database()
        with db.lock:
            return int(db.db.execute("SELECT value FROM meta WHERE key = 'max_count'").fetchone()[0])

    def summary(self) -> StoreSummary:
        """What the store holds (a full merge of its runs: seconds at 10^7 windows)."""
        if self._db is None:
            return StoreSummary(IN_MEMORY, self.store_id, len(self._memory), self.max_count, 0, 0)
        assert self.path is not None
        db = self._database()
        keys, _ = db.merged()
        with db.lock:
            exports = int(db.db.execute("SELECT value FROM meta WHERE key = 'exports'").fetchone()[0])
        files = [self.path, Path(f"{self.path}-wal"), *runs_folder(self.path).glob("*.run")]
        size = sum(p.stat().st_size for p in files if p.exists())
        return StoreSummary(str(self.path), self.store_id, len(keys), self.max_count, exports, size)


def _main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m aegis.exposure_store")
    sub = parser.add_subparsers(dest="command", required=True)
    convert = sub.add_parser("migrate", help="convert an exposure state of an earlier format, salt and counts kept: "
                                             "a JSON state into a new store, a v2 SQLite store in place")
    convert.add_argument("path")
    convert.add_argument("target", nargs="?", help="where a JSON state's store goes (default: beside it, .sqlite)")
    args = parser.parse_args(argv)
    print(migrate(args.path, args.target))


if __name__ == "__main__":
    _main()
