"""Where the exposure store lives, and the file checks that keep another local user from planting it.

A store is an SQLite file (``client.sqlite``), its WAL and shared memory (``-wal``, ``-shm``) and a folder of
sorted runs (``-runs``). Every one of them, and the folder that holds them, must belong to this user, be
writable by nobody else and not be a symbolic link: otherwise another user could redirect the counts or
roll them back.
"""
from __future__ import annotations

import os
import stat
from pathlib import Path

CACHE_ENV = "AEGIS_CACHE_DIR"  # the cache folder (default: $XDG_CACHE_HOME/aegis or ~/.cache/aegis)
SIDECARS = ("-wal", "-shm", "-runs")


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


def runs_folder(path: Path) -> Path:
    """The folder of the store's sorted runs, beside its database file."""
    return Path(f"{path}-runs")


def check_owned(path: Path, what: str) -> None:
    """Refuse a store another local user could plant, roll back or redirect."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return
    check_stat(info, path, what)


def check_stat(info: os.stat_result, path: Path, what: str) -> None:
    if stat.S_ISLNK(info.st_mode):
        raise PermissionError(f"exposure {what} {path} is a symbolic link: another user could redirect the counts. "
                              "Replace it by the real file or folder")
    if info.st_uid != os.getuid():
        raise PermissionError(f"exposure {what} {path} belongs to uid {info.st_uid}, not to this user ({os.getuid()}): "
                              "it may be planted. Use a store you created (aegis.exposure.create_state)")
    if info.st_mode & 0o022:
        raise PermissionError(f"exposure {what} {path} is writable by group or others (mode {info.st_mode & 0o777:o}): "
                              f"another user could roll the counts back. chmod go-w {path}")


def check_location(path: Path) -> None:
    check_owned(path.parent, "folder")
    check_owned(path, "store")
    for suffix in SIDECARS:
        check_owned(Path(f"{path}{suffix}"), "store")


def fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
