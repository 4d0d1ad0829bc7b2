"""Run a utility study into a folder: report.json rewritten after every run (merged into the folder's
previous study with ``append``, so several short GPU calls build one result), then the figures and the page."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from ..audit.options import check_out
from ..errors import UsageError
from ..harness.output import OutputFolder, write_json
from . import plots
from .config import UtilityConfig
from .harness import run_utility
from .page import utility_html
from .results import merge


def previous(folder: Path) -> dict | None:
    """The study already in ``folder`` (None: none)."""
    path = folder / "report.json"
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise UsageError("--append", f"cannot read {path} ({err}): remove it or use another --out") from None
    if "utility" not in data:
        raise UsageError("--append", f"{path} is not a utility study (an audit report?): use another --out")
    return data["utility"]


def study(
    config: UtilityConfig, device: str, out: str | Path, *, append: bool = False, say: Callable[[str], None] = print
) -> tuple[dict, list[Path]]:
    folder = check_out(out)
    old = previous(folder) if append else None

    def combined(result: dict) -> dict:
        return result if old is None else merge(old, result)

    if old is not None:  # settings that differ fail now, not after the first run
        merge(old, {"settings": config.as_dict(), "runs": [], "references": [], "nulls": [], "machine": {}})

    def sink(result: dict) -> None:
        write_json({"utility": combined(result)}, folder / "report.json")

    result = combined(run_utility(config, device, sink=sink, progress=say))
    return result, write_outputs(result, folder)


def write_outputs(result: dict, out: Path | OutputFolder) -> list[Path]:
    """The study's files: report.json (its data under "utility"), learning_curves.png, frontier.png and
    report.html (into a temporary folder it names if ``out`` fails)."""
    folder = out if isinstance(out, OutputFolder) else OutputFolder(out)

    def write(path: Path) -> list[Path]:
        write_json({"utility": result}, path / "report.json")
        plots.learning_curves(result, path / "learning_curves.png")
        plots.frontier(result, path / "frontier.png")
        (path / "report.html").write_text(utility_html(result, "learning_curves.png", "frontier.png"))
        return [path / name for name in ("report.json", "learning_curves.png", "frontier.png", "report.html")]

    return folder.write(write)
