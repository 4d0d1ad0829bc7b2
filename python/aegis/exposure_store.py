"""The exposure store: how many exports carried each salted token-window digest, kept in SQLite.

One file per client (``AegisConfig.exposure_state``), shared by every process and shield that names it.
The budget decision of an export is one ``BEGIN IMMEDIATE`` transaction (:meth:`ExposureStore.reserve`):
read the step's digests' counts, then either refuse (nothing written) or add one to each and commit. Only
after the commit does the flooded gradient leave, so two shields, two processes or two Flower runs on one
store can never export the same text past the budget; a crash after the commit over-counts (safe).

Cost: O(digests of the step), independent of the history: one B-tree lookup and one upsert per digest, one
WAL append per export (``synchronous=NORMAL``: the commit survives a crash of the process at once), then an
``fsync`` of the WAL on a worker thread that ``export()`` waits for (the commit survives a power loss before
anything leaves; the wait overlaps the flood and the optimizer step). After that fsync the same worker
checkpoints the WAL into the file once it holds ``CHECKPOINT_PAGES``: off the decision's path (the next
decision waits for it only if it comes before the checkpoint ends), and the WAL stays bounded by that plus
one export's pages.

Tables: ``counts(digest INTEGER PRIMARY KEY, n)`` (the first 64 bits of the window's blake2b digest keyed by
the salt, so the file does not let anyone without the salt test a guessed sentence; a collision can only
over-count) and ``meta(key, value)``: format, schema version, window, salt, store id and ``exports``, a count
of reservations that only grows.

Fail closed: a named store that is missing is an error (``create_state`` makes one); the default store
(``$AEGIS_CACHE_DIR`` or the user's cache folder) is created with a warning that it holds no earlier counts;
the file and its folder must belong to the user, be writable by nobody else and not be symbolic links; a
store whose salt or id changed, or whose ``exports`` went down, under a live shield is an error.
"""
from __future__ import annotations

import json
import logging
import os
import secrets
import sqlite3
import stat
import threading
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

log = logging.getLogger("aegis.exposure")
T = TypeVar("T")

IN_MEMORY = ":memory:"  # exposure_state for simulations: counts live as long as the shield
CACHE_ENV = "AEGIS_CACHE_DIR"  # the cache folder (default: $XDG_CACHE_HOME/aegis or ~/.cache/aegis)
FORMAT, SCHEMA_VERSION = "aegis-exposure", 2
WINDOW = 8  # tokens per fingerprint window (aegis.exposure's counting rule): part of the store's format
CHECKPOINT_PAGES = 4096  # WAL pages (16 MiB) past which the worker checkpoints them into the file
_CHUNK = 900  # host parameters per IN (...) query, under SQLite's default limit of 999


def digest_key(digest: bytes) -> int:
    """A window's key in the store: the first 64 bits of its salted digest, as SQLite's signed integer."""
    return int.from_bytes(digest[:8], "little", signed=True)


def cache_dir() -> Path:
    """The project's cache folder; an absolute ``$AEGIS_CACHE_DIR`` or the user's cache folder."""
    root = os.environ.get(CACHE_ENV)
    if root:
        if not os.path.isabs(root):
            raise ValueError(f"{CACHE_ENV}={root!r} is relative, so the exposure counts would follow the working "
                             f"directory: set {CACHE_ENV} to an absolute path")
        return Path(root)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "aegis"


def default_state_path() -> Path:
    return cache_dir() / "exposure" / "default.sqlite"


def _check_owned(path: Path, what: str) -> None:
    """Refuse a store another local user could plant, roll back or redirect."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISLNK(info.st_mode):
        raise PermissionError(f"exposure {what} {path} is a symbolic link: another user could redirect the counts. "
                              "Replace it by the real file or folder")
    if info.st_uid != os.getuid():
        raise PermissionError(f"exposure {what} {path} belongs to uid {info.st_uid}, not to this user ({os.getuid()}): "
                              "it may be planted. Use a store you created (aegis.exposure.create_state)")
    if info.st_mode & 0o022:
        raise PermissionError(f"exposure {what} {path} is writable by group or others (mode {info.st_mode & 0o777:o}): "
                              f"another user could roll the counts back. chmod go-w {path}")


def _check_location(path: Path) -> None:
    _check_owned(path.parent, "folder")
    for suffix in ("", "-wal", "-shm"):
        _check_owned(Path(str(path) + suffix), "store")


def create_state(path: str | os.PathLike) -> Path:
    """Write a new, empty exposure store (fresh salt and id) at ``path``; refuses to overwrite one."""
    path = Path(path)
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as err:
        raise OSError(f"exposure state {path}: its folder cannot be made ({err.strerror}): set {CACHE_ENV} to a "
                      "writable folder of yours, or name a store with AegisConfig(exposure_state=PATH)") from None
    _check_owned(path.parent, "folder")
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:
        raise FileExistsError(f"exposure state {path} exists: load it (AegisConfig(exposure_state=...)); "
                              "deleting it would restart every count from zero") from None
    os.close(fd)
    try:
        with _connect(path) as db:
            _create_schema(db, secrets.token_bytes(16), secrets.token_hex(8))
    except BaseException:
        path.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)
    return path


def reset_state(path: str | os.PathLike) -> Path:
    """Forget every count at ``path``: a new store with a new salt and id (callers confirm first)."""
    path = Path(path)
    _check_location(path)
    _SHARED.pop(path.resolve(), None)
    for suffix in ("-wal", "-shm", ""):
        Path(str(path) + suffix).unlink(missing_ok=True)
    return create_state(path)


def migrate(json_path: str | os.PathLike, sqlite_path: str | os.PathLike | None = None) -> Path:
    """Convert an exposure state of the earlier JSON format (salt and counts kept) into a store."""
    source = Path(json_path)
    target = Path(sqlite_path) if sqlite_path is not None else source.with_suffix(".sqlite")
    try:
        data = json.loads(source.read_text())
        if data["format"] != FORMAT or data["version"] != 1 or data["window"] != 8:
            raise ValueError(f"format {data['format']!r} v{data['version']} window {data['window']}")
        salt = bytes.fromhex(data["salt"])
        counts = [(digest_key(bytes.fromhex(d)), int(n)) for d, n in data["counts"].items()]
    except (ValueError, KeyError, TypeError) as err:
        raise ValueError(f"{source} is not an AEGIS JSON exposure state ({err})") from None
    create_state(target)
    with _connect(target) as db:
        db.execute("UPDATE meta SET value = ? WHERE key = 'salt'", (salt,))
        db.executemany("INSERT INTO counts(digest, n) VALUES (?, ?) ON CONFLICT(digest) DO UPDATE SET n = max(n, "
                       "excluded.n)", counts)
        db.execute("UPDATE meta SET value = ? WHERE key = 'exports'", (max((n for _, n in counts), default=0),))
    return target


def _connect(path: Path) -> sqlite3.Connection:
    db = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False, timeout=60.0)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=NORMAL")
    db.execute("PRAGMA wal_autocheckpoint=0")  # checkpoints run on the worker, after the commit's fsync
    db.execute("PRAGMA journal_size_limit=0")  # a restarted WAL starts empty: its size counts its frames
    db.execute("PRAGMA cache_size=-65536")
    db.execute(f"PRAGMA mmap_size={1 << 30}")
    return db


def _create_schema(db: sqlite3.Connection, salt: bytes, store_id: str) -> None:
    db.execute("BEGIN IMMEDIATE")
    db.execute("CREATE TABLE meta(key TEXT PRIMARY KEY, value) WITHOUT ROWID")
    db.execute("CREATE TABLE counts(digest INTEGER PRIMARY KEY, n INTEGER NOT NULL)")
    db.executemany("INSERT INTO meta VALUES (?, ?)", [("format", FORMAT), ("version", SCHEMA_VERSION),
                                                      ("window", WINDOW), ("salt", salt), ("store_id", store_id),
                                                      ("exports", 0)])
    db.execute("COMMIT")


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclass(frozen=True)
class StoreSummary:
    path: str
    store_id: str
    windows: int  # distinct digests stored
    max_count: int  # the most exports any one window has had
    exports: int  # reservations committed
    bytes: int  # the file's size on disk (WAL included)


class _Database:
    """One connection per resolved path and process, shared by every shield that names it."""

    def __init__(self, path: Path):
        self.path = path
        self.lock = threading.Lock()
        self.pid = os.getpid()
        _check_location(path)
        if path.read_bytes()[:1] == b"{":
            raise ValueError(f"exposure state {path} is in the earlier JSON format: convert it once with "
                             f"`python -m aegis.exposure_store migrate {path}` and name the .sqlite file it writes")
        try:
            self.db = _connect(path)
        except sqlite3.DatabaseError as err:
            raise ValueError(f"exposure state {path} is corrupt ({err}): restore it from a backup. Starting a new "
                             "one (aegis.exposure.create_state) would forget every export so far") from None
        meta = self.validate()
        self.salt, self.store_id = bytes(meta["salt"]), str(meta["store_id"])
        self.exports = int(meta["exports"])  # the highest value seen: it may only grow
        self.exports_here = 0  # reservations committed by this process
        self.identity = _identity(path)
        self.durable: Future[None] | None = None  # the fsync of the last reservation's WAL frames
        self.page_size = int(self.db.execute("PRAGMA page_size").fetchone()[0])

    def committed(self) -> None:
        """A reservation was committed (in the OS cache): make it durable before anything leaves."""
        self.durable = _DURABILITY.submit(self._sync)

    def _sync(self) -> None:
        wal = 0
        try:
            fd = os.open(f"{self.path}-wal", os.O_RDONLY | os.O_NOFOLLOW)
        except FileNotFoundError:  # checkpointed and removed: the frames are in the database file
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW)
        else:
            wal = os.fstat(fd).st_size  # its frames: a restarted WAL is cut to nothing (journal_size_limit)
        try:
            os.fsync(fd)  # a checkpoint syncs the file itself before it lets the WAL restart
        finally:
            os.close(fd)
        if wal >= CHECKPOINT_PAGES * self.page_size:  # queued after this future: export() does not wait for it
            _DURABILITY.submit(self._checkpoint)

    def _checkpoint(self) -> None:
        """Copy the WAL's pages into the file (the next write restarts the WAL)."""
        with self.lock:
            self.db.execute("PRAGMA wal_checkpoint(PASSIVE)")

    def validate(self) -> dict:
        """The store's metadata, once its format is checked (a new shield on the store checks it again)."""
        try:
            meta = dict(self.db.execute("SELECT key, value FROM meta").fetchall())
            self.db.execute("SELECT n FROM counts WHERE digest = 0").fetchone()
        except sqlite3.DatabaseError as err:
            raise ValueError(f"exposure state {self.path} is corrupt ({err}): restore it from a backup. Starting a "
                             "new one (aegis.exposure.create_state) would forget every export so far") from None
        if (meta.get("format"), meta.get("version"), meta.get("window")) != (FORMAT, SCHEMA_VERSION, WINDOW):
            raise ValueError(f"exposure state {self.path} has format {meta.get('format')!r} v{meta.get('version')} "
                             f"window {meta.get('window')}; this AEGIS reads {FORMAT!r} v{SCHEMA_VERSION} window "
                             f"{WINDOW}: restore the file this client wrote")
        if not isinstance(meta.get("salt"), bytes) or len(meta["salt"]) != 16:
            raise ValueError(f"exposure state {self.path} is corrupt (its salt): restore it from a backup")
        return meta

    def check_file(self) -> None:
        """The name still holds the file this connection opened (not deleted, not replaced by another)."""
        try:
            identity = _identity(self.path)
        except FileNotFoundError:
            raise RuntimeError(f"exposure state {self.path} was deleted under a live shield: restore it; nothing "
                               "was exported") from None
        if identity != self.identity:
            raise RuntimeError(f"exposure state {self.path} was replaced under a live shield (another file holds its "
                               "name): restore the original file; nothing was exported")
        with open(self.path, "rb") as f:  # overwritten in place: this connection's cache would not notice
            if f.read(16) != b"SQLite format 3\x00":
                raise ValueError(f"exposure state {self.path} is corrupt (not an SQLite database): restore it from a "
                                 "backup; nothing was exported")

    def check_identity(self) -> None:
        """Inside a transaction: the file is still the store this process opened, not rolled back."""
        meta = dict(self.db.execute("SELECT key, value FROM meta WHERE key IN ('salt', 'store_id', 'exports')"))
        if bytes(meta.get("salt", b"")) != self.salt or meta.get("store_id") != self.store_id:
            raise RuntimeError(f"exposure state {self.path} was replaced under a live shield (its salt or id changed): "
                               "restore the original file; nothing was exported")
        exports = int(meta.get("exports", -1))
        if exports < self.exports:
            raise RuntimeError(f"exposure state {self.path} was rolled back under a live shield ({exports} exports "
                               f"recorded, {self.exports} seen): restore the newest copy; nothing was exported")
        self.exports = exports


def _identity(path: Path) -> tuple[int, int]:
    info = os.stat(path)
    return info.st_dev, info.st_ino


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


_SHARED: dict[Path, _Database] = {}
_SHARED_LOCK = threading.Lock()
_DURABILITY = Worker("aegis-exposure-sync")  # the WAL's fsync before an export leaves


def _database(path: Path) -> _Database:
    key = path.resolve()
    with _SHARED_LOCK:
        found = _SHARED.get(key)
        # a forked child opens its own connection; so does a shield opening a file that replaced the old one
        if found is None or found.pid != os.getpid() or found.identity != _identity(path):
            found = _SHARED[key] = _Database(path)
        else:
            with found.lock:
                found.check_file()
                found.validate()
                found.check_identity()
        return found


class ExposureStore:
    """The salt and the counts of one client: in memory (``IN_MEMORY``), or in an SQLite file."""

    def __init__(self, state: str | os.PathLike | None):
        self.path: Path | None = None
        self._memory: dict[int, int] = {}
        self._memory_exports = 0
        self._memory_lock = threading.Lock()
        if state == IN_MEMORY:
            self.salt, self.store_id = secrets.token_bytes(16), "in-memory"
            self._db: _Database | None = None
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

    def reserve(self, rows: Sequence[Collection[int]], budget: int) -> int:
        """The budget decision of one export, atomic across every process on the store: the number of rows
        holding a digest already exported ``budget`` times; when 0, every digest was counted once more."""
        digests = list(set().union(*rows)) if rows else []
        if self._db is None:
            with self._memory_lock:
                over = _over(rows, self._memory, budget)
                if not over and digests:
                    for d in digests:
                        self._memory[d] = self._memory.get(d, 0) + 1
                    self._memory_exports += 1
                return over
        if self._db.pid != os.getpid():  # a forked child: a connection must not cross a fork
            assert self.path is not None
            self._db = _database(self.path)
            if (self._db.salt, self._db.store_id) != (self.salt, self.store_id):
                raise RuntimeError(f"exposure state {self.path} was replaced (its salt or id changed): restore the "
                                   "original file; nothing was exported")
        db = self._db
        with db.lock:
            _check_location(db.path)
            db.check_file()
            try:
                return self._reserve(db, rows, digests, budget)
            except sqlite3.DatabaseError as err:
                raise ValueError(f"exposure state {self.path} is corrupt ({err}): restore it from a backup; nothing "
                                 "was exported") from None

    @staticmethod
    def _reserve(db: _Database, rows: Sequence[Collection[int]], digests: list[int], budget: int) -> int:
        db.db.execute("BEGIN IMMEDIATE")
        try:
            db.check_identity()
            over = _over(rows, _read(db.db, digests), budget)
            if not over and digests:
                db.db.executemany("INSERT INTO counts(digest, n) VALUES (?, 1) "
                                  "ON CONFLICT(digest) DO UPDATE SET n = n + 1", ((d,) for d in digests))
                db.db.execute("UPDATE meta SET value = value + 1 WHERE key = 'exports'")
            db.db.execute("COMMIT")
        except BaseException:
            if db.db.in_transaction:
                db.db.execute("ROLLBACK")
            raise
        if not over and digests:
            db.exports += 1
            db.exports_here += 1
            db.committed()
        return over

    def wait_durable(self) -> None:
        """Block until the last reservation survives a power loss (``export()`` calls this)."""
        durable = None if self._db is None else self._db.durable
        if durable is not None:
            durable.result()

    @property
    def exports_here(self) -> int:
        """Exports this process counted in the store (the rest came from other processes or earlier runs)."""
        return self._memory_exports if self._db is None else self._db.exports_here

    def count(self, digest: int) -> int:
        if self._db is None:
            return self._memory.get(digest, 0)
        with self._db.lock:
            return _read(self._db.db, [digest]).get(digest, 0)

    @property
    def max_count(self) -> int:
        if self._db is None:
            return max(self._memory.values(), default=0)
        with self._db.lock:
            return int(self._db.db.execute("SELECT coalesce(max(n), 0) FROM counts").fetchone()[0])

    def summary(self) -> StoreSummary:
        if self._db is None:
            return StoreSummary(IN_MEMORY, self.store_id, len(self._memory), self.max_count, 0, 0)
        assert self.path is not None
        with self._db.lock:
            windows, top = self._db.db.execute("SELECT count(*), coalesce(max(n), 0) FROM counts").fetchone()
            exports = int(self._db.db.execute("SELECT value FROM meta WHERE key = 'exports'").fetchone()[0])
        size = sum(p.stat().st_size for p in (self.path, Path(f"{self.path}-wal")) if p.exists())
        return StoreSummary(str(self.path), self.store_id, int(windows), int(top), exports, size)


def _read(db: sqlite3.Connection, digests: list[int]) -> dict[int, int]:
    counts: dict[int, int] = {}
    for start in range(0, len(digests), _CHUNK):
        chunk = digests[start : start + _CHUNK]
        marks = ",".join("?" * len(chunk))
        counts.update(db.execute(f"SELECT digest, n FROM counts WHERE digest IN ({marks})", chunk).fetchall())
    return counts


def _over(rows: Sequence[Collection[int]], counts: dict[int, int], budget: int) -> int:
    return sum(any(counts.get(d, 0) >= budget for d in row) for row in rows)


def _main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m aegis.exposure_store")
    sub = parser.add_subparsers(dest="command", required=True)
    convert = sub.add_parser("migrate", help="convert a JSON exposure state into an SQLite store (salt, counts kept)")
    convert.add_argument("json_path")
    convert.add_argument("sqlite_path", nargs="?")
    args = parser.parse_args(argv)
    print(migrate(args.json_path, args.sqlite_path))


if __name__ == "__main__":
    _main()
