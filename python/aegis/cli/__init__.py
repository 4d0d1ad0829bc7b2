"""The ``aegis`` command line: ``inspect`` (coverage report), ``audit`` (the main job) and ``report`` (its page
and plot from report.json), ``utility`` (long federated runs), ``calibrate`` (which preset, or a search),
``exposure`` (the exposure counts: show, path, reset).

Bad input is refused before any model loads, in one line that names the option and the fix, with exit
code 2; a failure during the run prints one line and keeps what finished (``--debug``: the traceback).
"""

from __future__ import annotations

from . import audit, exposure, model  # noqa: F401 (each registers its commands on the app)
from .main import app


def main() -> None:  # pragma: no cover - console entry point
    app()


__all__ = ["app", "main"]
