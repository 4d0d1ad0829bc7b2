"""Progress the user sees wherever the output goes: a live bar on a terminal, plain lines elsewhere (a log
file, CI), each with the elapsed time and an ETA, and a heartbeat line at least every 30 s while one long
stage (an attack's search) runs.

The ETA comes from the plan: every stage's predicted CPU seconds (:mod:`aegis.audit.costs`), scaled by how
this run compares with the prediction so far (its measured CPU over the predicted CPU of the finished
stages) and by the wall seconds one CPU second takes here over the last minute (threads, other processes on
the cores: the load of a shared machine changes within a run).
"""

from __future__ import annotations

import collections
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TextIO

from .costs import Stage

WINDOW = 60.0  # seconds of wall time over which the ETA measures how long a CPU second takes


def _noop(*args) -> None:
    return None


@dataclass
class Progress:
    """What the runner reports: ``plan(stages, predicted CPU seconds)`` once, then each stage's
    ``start(stage)``, ``step(text)`` within it (a round, a gradient) and ``finish(stage, cpu_seconds)``."""

    plan: Callable[[list[Stage], list[float]], None] = field(default=_noop)
    start: Callable[[Stage], None] = field(default=_noop)
    step: Callable[[str], None] = field(default=_noop)
    finish: Callable[[Stage, float], None] = field(default=_noop)


def clock(seconds: float) -> str:
    seconds = int(round(seconds))
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


class Tracker:
    """The plan's bookkeeping: share done and the ETA. ``wall`` and ``cpu`` are clocks (tests pass fakes)."""

    def __init__(self, wall: Callable[[], float] = time.monotonic, cpu: Callable[[], float] = time.process_time):
        self.wall, self.cpu = wall, cpu
        self.started, self.cpu_started = wall(), cpu()
        self.total = 0.0  # predicted CPU seconds of the whole plan
        self.predicted: dict[str, float] = {}
        self.done_predicted = self.done_measured = 0.0
        self.current: Stage | None = None
        self.current_cpu = 0.0
        self.current_wall = self.started
        self.samples: collections.deque[tuple[float, float]] = collections.deque()  # (wall, cpu), newest last

    def plan(self, stages: list[Stage], predicted: list[float]) -> None:
        self.predicted = {s.key: p for s, p in zip(stages, predicted)}
        self.total = sum(predicted)

    def start(self, stage: Stage) -> None:
        self.current, self.current_cpu, self.current_wall = stage, self.cpu(), self.wall()

    def finish(self, stage: Stage, cpu_seconds: float) -> None:
        self.done_predicted += self.predicted.get(stage.key, 0.0)
        self.done_measured += cpu_seconds
        self.current = None

    def _in_stage(self) -> tuple[float, float]:
        """(predicted CPU of the current stage, CPU spent on it so far)."""
        if self.current is None:
            return 0.0, 0.0
        return self.predicted.get(self.current.key, 0.0), self.cpu() - self.current_cpu

    def share(self) -> float:
        expected, spent = self._in_stage()
        done = self.done_predicted + min(spent / self._ratio(), 0.95 * expected)
        return min(1.0, done / self.total) if self.total else 0.0

    def _ratio(self) -> float:
        """Measured over predicted CPU of the finished stages, pulled towards 1 while little is finished."""
        prior = 0.05 * self.total
        return (self.done_measured + prior) / (self.done_predicted + prior) if self.total else 1.0

    def sample(self, window: float = WINDOW) -> None:
        """Note the clocks (the heartbeat does, every second): the ETA's wall-per-CPU rate is the window's."""
        now = (self.wall(), self.cpu())
        self.samples.append(now)
        while len(self.samples) > 2 and now[0] - self.samples[1][0] >= window:
            self.samples.popleft()

    def _wall_per_cpu(self) -> float | None:
        wall, cpu = self.wall(), self.cpu()
        if self.samples and cpu - self.samples[0][1] >= 1.0:
            return (wall - self.samples[0][0]) / (cpu - self.samples[0][1])
        spent = cpu - self.cpu_started
        return (wall - self.started) / spent if spent > 0 else None

    def eta(self) -> float | None:
        """Wall seconds left, None before any CPU time was spent."""
        rate = self._wall_per_cpu()
        if rate is None or not self.total:
            return None
        expected, spent = self._in_stage()
        ratio = self._ratio()
        # a stage past its prediction is taken to need as long again as it has overrun so far
        left = max(0.0, self.total - self.done_predicted - expected) * ratio + abs(expected * ratio - spent)
        return left * rate

    def line(self, text: str) -> str:
        eta = self.eta()
        return (f"[{clock(self.wall() - self.started):>6}] {round(100 * self.share()):3d}% {text} "
                f"(ETA {'?' if eta is None else clock(eta)})")


class _Live:
    """A tracker and a heartbeat thread calling ``beat()`` every ``tick`` seconds until closed."""

    def __init__(self, tick: float) -> None:
        self.tracker = Tracker()
        self.lock = threading.Lock()
        self.label = ""
        self.tick = tick
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="aegis-heartbeat")

    def _run(self) -> None:
        while not self._stop.wait(self.tick):
            with self.lock:
                self.tracker.sample()
                self.beat()

    def beat(self) -> None:
        raise NotImplementedError

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def hooks(self) -> Progress:
        def plan(stages, predicted):
            with self.lock:
                self.tracker.plan(stages, predicted)

        def start(stage):
            with self.lock:
                self.tracker.start(stage)
                self.label = stage.label
                self.show(self.label)

        def step(text):
            with self.lock:
                self.show(f"{self.label} · {text}")

        def finish(stage, cpu_seconds):
            with self.lock:
                self.tracker.finish(stage, cpu_seconds)

        return Progress(plan, start, step, finish)

    def show(self, text: str) -> None:
        raise NotImplementedError


class PlainProgress(_Live):
    """``[  1m05s]  37% decoder · aegis-verification · spectral (ETA 1m50s)`` lines: at most one per
    ``every`` seconds as stages start, and a heartbeat after ``quiet`` seconds without a line (checked every
    ``tick`` seconds: a line at least every ``quiet + tick``)."""

    def __init__(self, stream: TextIO | None = None, every: float = 5.0, quiet: float = 25.0,
                 tick: float = 1.0) -> None:
        super().__init__(tick)
        self.stream = stream or sys.stderr
        self.every, self.quiet = every, quiet
        self._last = -1e9

    def _write(self, text: str) -> None:
        self._last = self.tracker.wall()
        self.stream.write(self.tracker.line(text) + "\n")
        self.stream.flush()

    def show(self, text: str) -> None:
        if self.tracker.wall() - self._last >= self.every:
            self._write(text)

    def beat(self) -> None:
        now = self.tracker.wall()
        if now - self._last >= self.quiet and self.tracker.current is not None:
            self._write(f"{self.label}: still working, {clock(now - self.tracker.current_wall)} in this stage")


class BarProgress(_Live):
    """A rich progress bar with the elapsed time and the tracker's ETA, redrawn every second (terminals)."""

    def __init__(self, console) -> None:
        from rich.progress import BarColumn, TaskProgressColumn, TextColumn, TimeElapsedColumn
        from rich.progress import Progress as Bar

        super().__init__(tick=1.0)
        self.bar = Bar(
            TextColumn("{task.description}"),
            BarColumn(bar_width=20),
            TaskProgressColumn(),
            TimeElapsedColumn(),
            TextColumn("ETA {task.fields[eta]}"),
            console=console,
            transient=True,
        )
        self.task = self.bar.add_task("audit", total=1000, eta="?")

    def __enter__(self):
        self.bar.__enter__()
        return super().__enter__()

    def __exit__(self, *exc) -> None:
        super().__exit__(*exc)
        self.bar.__exit__(*exc)

    def show(self, text: str) -> None:
        self.bar.update(self.task, description=text[:38])
        self.beat()

    def beat(self) -> None:
        eta = self.tracker.eta()
        self.bar.update(self.task, completed=1000 * self.tracker.share(), eta="?" if eta is None else clock(eta))
