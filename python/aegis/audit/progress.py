"""Progress the user sees wherever the output goes: a live bar on a terminal, plain lines elsewhere
(a log file, CI), each with the elapsed time and an ETA."""

from __future__ import annotations

import sys
import time
from typing import TextIO

from .runner import Progress


def _clock(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


class PlainProgress:
    """``[  1m05s]  37% decoder · aegis-verification · round 2/3 (ETA 1m50s)`` lines, at most one per ``every``
    seconds (and always at the start and the end), flushed at once. The share is of the estimated cost."""

    def __init__(self, stream: TextIO | None = None, every: float = 5.0) -> None:
        self.stream = stream or sys.stderr
        self.every = every
        self.started = time.monotonic()
        self.done, self.units, self._last, self._count = 0.0, 0.0, -1e9, 0

    def total(self, units: float) -> None:
        self.units = units

    def eta(self) -> str:
        if not self.done or not self.units:
            return "?"
        elapsed = time.monotonic() - self.started
        return _clock(elapsed / self.done * max(0, self.units - self.done))

    def advance(self, label: str, cost: float = 1.0) -> None:
        self.done += cost
        self._count += 1
        now = time.monotonic()
        finished = self.done >= self.units - 1e-9
        if now - self._last < self.every and self._count > 1 and not finished:
            return
        self._last = now
        share = min(100, round(100 * self.done / self.units)) if self.units else 0
        self.stream.write(f"[{_clock(now - self.started):>6}] {share:3d}% {label} (ETA {self.eta()})\n")
        self.stream.flush()

    def hooks(self) -> Progress:
        return Progress(total=self.total, advance=self.advance)


class BarProgress:
    """A rich progress bar with elapsed time and ETA (terminals only)."""

    def __init__(self, console) -> None:
        from rich.progress import BarColumn, TaskProgressColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn
        from rich.progress import Progress as Bar

        self.bar = Bar(
            TextColumn("{task.description}"),
            BarColumn(bar_width=20),
            TaskProgressColumn(),
            TimeElapsedColumn(),
            TextColumn("ETA"),
            TimeRemainingColumn(),
            console=console,
            transient=True,
        )
        self.task = self.bar.add_task("audit", total=None)

    def __enter__(self):
        self.bar.__enter__()
        return self

    def __exit__(self, *exc):
        return self.bar.__exit__(*exc)

    def hooks(self) -> Progress:
        return Progress(
            total=lambda n: self.bar.update(self.task, total=n),
            advance=lambda label, cost=1.0: self.bar.update(self.task, advance=cost, description=label[:38]),
        )
