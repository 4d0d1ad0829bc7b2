"""What each stage of an audit costs, in CPU seconds: measured on this machine by earlier runs, else the
project's own measurements, else the rough :data:`~aegis.audit.attack_base.COST` units.

A stage is one piece of work with a key ``model/bB/defence/what`` (``what``: ``federate``, an attack, or
``null-ATTACK``) and a size in COST units (targets, candidates, rounds: what scales with the options).
A stage's *rate* is its CPU seconds per unit. Every finished stage's rate is kept in
``$AEGIS_CACHE_DIR/audit/stage-costs.json`` (default ``~/.cache/aegis``), so the next run's ETA starts from
what this machine did; a stage never measured borrows the rate of the nearest one measured (another batch
size, the same defence family, the same attack).
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .shipped_costs import SHIPPED


@dataclass(frozen=True)
class Stage:
    """One piece of the audit's work."""

    model: str
    batch: int
    defence: str  # "null" for the null baselines
    what: str  # "federate", an attack's name, or "null-" + an attack's name
    units: float

    @property
    def key(self) -> str:
        return f"{self.model}/b{self.batch}/{self.defence}/{self.what}"

    @property
    def label(self) -> str:
        what = self.what.removeprefix("null-")
        return f"{self.model} · {'null' if self.defence == 'null' else self.defence} · {what}"


def family(defence: str) -> str:
    """A defence's family, its name less its numbers (dp-noise-0.01 -> dp-noise, prune-90 -> prune)."""
    return re.sub(r"(-c?[\d.]+)+(-z[\d.]+)?$", "", defence.lower())


class StageCosts:
    """Rates (CPU seconds per unit) by stage key: this machine's, then the shipped ones."""

    def __init__(self, path: Path | None = None) -> None:
        from ..exposure_store import cache_dir

        self.local: dict[str, float] = {}
        self.writable = True
        try:
            self.path = path if path is not None else cache_dir() / "audit" / "stage-costs.json"
        except ValueError:  # a relative $AEGIS_CACHE_DIR (refused there): no history, the run goes on
            self.path, self.writable = Path(os.devnull), False
            return
        try:
            loaded = json.loads(self.path.read_text())
            self.local = {k: float(v) for k, v in loaded.items() if isinstance(v, int | float) and v > 0}
        except (OSError, ValueError, AttributeError):
            pass  # no history (or an unreadable one): the shipped rates stand in

    def rate(self, stage: Stage) -> float:
        for table in (self.local, SHIPPED):
            found = _nearest(table, stage)
            if found is not None:
                return found
        return 1.0

    def predict(self, stage: Stage) -> float:
        return stage.units * self.rate(stage)

    def record(self, stage: Stage, cpu_seconds: float) -> None:
        """Keep a finished stage's rate (the file is rewritten atomically; a read-only cache keeps none)."""
        if stage.units <= 0 or cpu_seconds <= 0:
            return
        self.local[stage.key] = round(cpu_seconds / stage.units, 5)
        if not self.writable:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile("w", dir=self.path.parent, delete=False, suffix=".tmp") as f:
                json.dump(self.local, f, indent=0, sort_keys=True)
            os.replace(f.name, self.path)
        except OSError:
            self.writable = False  # an estimate is not worth failing a run for


def _nearest(table: dict[str, float], stage: Stage) -> float | None:
    """The rate of ``stage`` in ``table``: its own key, else the same stage at the nearest batch size, the
    same defence family, then the same attack on any defence of that model; a rate measured at another batch
    size is scaled to this one (the work grows with the tokens of a batch)."""
    if not table:
        return None
    if stage.key in table:
        return table[stage.key]
    parsed = [(k.split("/"), v) for k, v in table.items() if k.count("/") == 3]
    for same in (
        lambda m, d, w: m == stage.model and d == stage.defence and w == stage.what,
        lambda m, d, w: m == stage.model and family(d) == family(stage.defence) and w == stage.what,
        lambda m, d, w: m == stage.model and w == stage.what,
    ):
        rows = [(abs(int(b[1:]) - stage.batch), int(b[1:]), v) for (m, b, d, w), v in parsed if same(m, d, w)]
        if rows:
            _, batch, rate = min(rows)
            return rate * stage.batch / batch
    return None
