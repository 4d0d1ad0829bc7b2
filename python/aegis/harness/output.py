"""An output folder that never loses finished work: files are written atomically (temporary file, then
rename), and if the folder stops being writable mid-run the writer moves to a fresh temporary folder and
says where (``failure``)."""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


def clean(value: Any) -> Any:
    """JSON has no NaN/inf: None for those."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [clean(v) for v in value]
    return value


def write_json(data: dict[str, Any], path: Path) -> None:
    """``data`` as JSON at ``path``, atomically (a reader sees the old file or the new one, never half)."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(clean(data), indent=1))
    os.replace(tmp, path)


class OutputFolder:
    """Writes into ``folder``; falls back to a temporary folder when ``folder`` fails."""

    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)
        self.failure: str | None = None  # why the requested folder failed, if it did

    def _fallback(self, err: OSError) -> None:
        if self.failure is None:
            self.failure = f"{self.folder}: {err.strerror or type(err).__name__}"
            self.folder = Path(tempfile.mkdtemp(prefix="aegis-report-"))

    def write(self, write: Callable[[Path], T]) -> T:
        """``write(folder)``; on an OSError, once more in the fallback folder (a second failure raises)."""
        for _ in range(2):
            try:
                self.folder.mkdir(parents=True, exist_ok=True)
                return write(self.folder)
            except OSError as err:
                if self.failure is not None:
                    raise
                self._fallback(err)
        raise AssertionError("unreachable")
