"""The two figures of a utility study (matplotlib, imported when drawing):

* learning curves: the validation metric against the round, one panel per model x algorithm, one line per
  defence, with the untrained model and the utility bar (1.05x undefended perplexity, 0.98x accuracy);
* the privacy-utility frontier: final utility against the worst attack's excess over its null baseline
  (0 = the attack reads nothing), one marker per defence, with both bars.
"""

from __future__ import annotations

import math
from pathlib import Path

from ..audit.records import MARGIN
from ..harness.style import dodge, shift
from .results import ACC_BAR, PPL_BAR

COLOURS = ("#000000", "#1f77b4", "#2ca02c", "#d62728", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf")
MARKERS = ("o", "*", "P", "X", "s", "D", "^", "v", "<")


def _panels(result: dict) -> list[tuple[str, str]]:
    return list(dict.fromkeys((r["model"], r["algorithm"]) for r in result["runs"]))


def _styles(result: dict) -> dict[str, tuple[str, str]]:
    defences = list(dict.fromkeys(r["defence"] for r in result["runs"]))
    return {d: (COLOURS[i % len(COLOURS)], MARKERS[i % len(MARKERS)]) for i, d in enumerate(defences)}


def _bar(metric: str, undefended: float | None) -> float | None:
    if undefended is None or not math.isfinite(undefended):
        return None
    return undefended * (PPL_BAR if metric == "perplexity" else ACC_BAR)


def _figure(panels: list[tuple[str, str]]):
    """One 8.4 x 4.8 inch panel per (model, algorithm), side by side (matplotlib's headless backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(8.4 * len(panels), 4.8), squeeze=False)
    return fig, axes[0]


def _save(fig, path: Path) -> None:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def learning_curves(result: dict, path: Path) -> None:
    panels = _panels(result)
    if not panels:
        return
    style = _styles(result)
    untrained = {r["model"]: r["untrained"][r["metric"]] for r in result["references"]}
    fig, axes = _figure(panels)
    for ax, (model, algorithm) in zip(axes, panels):
        runs = [r for r in result["runs"] if (r["model"], r["algorithm"]) == (model, algorithm) and "curve" in r]
        if not runs:
            continue
        metric = runs[0]["metric"]
        for run in runs:
            colour, marker = style[run["defence"]]
            xs = [p["round"] for p in run["curve"]]
            ys = [p.get(metric) for p in run["curve"]]
            label = run["defence"] + (f" (ε {run['epsilon']:.3g})" if run.get("epsilon") is not None else "")
            share = run.get("silenced_export_share") or 0.0
            if share:
                label += f" ({share:.0%} silenced)"
            undefended = run["defence"] == "none"  # drawn wide and underneath: a defence equal to it stays visible
            ax.plot(xs, ys, color=colour, marker=marker, markersize=4, linewidth=3.0 if undefended else 1.4,
                    alpha=0.45 if undefended else 1.0, zorder=1 if undefended else 2, label=label)
        if model in untrained:
            ax.axhline(untrained[model], color="0.4", linestyle=":", linewidth=1.2, label="untrained")
        none = next((r for r in runs if r["defence"] == "none"), None)
        bar = _bar(metric, none["final"].get(metric) if none else None)
        if bar is not None:
            ax.axhline(bar, color="tab:red", linestyle="--", linewidth=1,
                       label=f"utility bar ({PPL_BAR:g}x undefended)" if metric == "perplexity"
                       else f"utility bar ({ACC_BAR:g}x undefended)")
        if metric == "perplexity":
            ax.set_yscale("log")
            ax.set_ylabel("validation perplexity (lower is better)")
        else:
            ax.set_ylabel("validation accuracy (higher is better)")
        ax.set_xlabel("round")
        ax.set_title(f"{model} · {algorithm}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    _save(fig, path)


def frontier(result: dict, path: Path) -> None:
    panels = _panels(result)
    if not panels:
        return
    style = _styles(result)
    summary = result.get("summary", [])
    fig, axes = _figure(panels)
    for ax, (model, algorithm) in zip(axes, panels):
        rows = [s for s in summary if (s["model"], s["algorithm"]) == (model, algorithm)]
        if not rows:
            continue
        metric = rows[0]["metric"]
        shown = [s for s in rows if s["final"] is not None and s["worst_excess"] is not None
                 and math.isfinite(s["final"])]
        points = [(s["final"], max(0.0, s["worst_excess"])) for s in shown]
        log_x = metric == "perplexity"
        xs = [x for x, _ in points] + [v for v in (rows[0]["undefended"], rows[0]["untrained"]) if v]
        span = (min(xs), max(xs)) if xs else (0.0, 1.0)
        for s, (x, y), dx in zip(shown, points, dodge(points, log_x, span)):
            colour, marker = style[s["defence"]]
            ax.scatter(shift(x, dx, log_x, span), y, color=colour, marker=marker, s=170 if marker == "*" else 90,
                       edgecolors="red" if not s["meets_privacy"] else "white", linewidths=1.5,
                       label=s["defence"] + ("  meets both bars" if s["meets_both"] else ""), zorder=3)
        ax.axhline(MARGIN, color="tab:red", linestyle="--", linewidth=1, label=f"privacy bar (null + {MARGIN})")
        bar = _bar(metric, rows[0]["undefended"])
        if bar is not None:
            ax.axvline(bar, color="tab:red", linestyle="-.", linewidth=1, label="utility bar")
        untrained = rows[0]["untrained"]
        if untrained is not None:
            ax.axvline(untrained, color="0.4", linestyle=":", linewidth=1.2, label="untrained")
        if metric == "perplexity":
            ax.set_xscale("log")
            ax.set_xlabel("final validation perplexity (lower is better)")
        else:
            ax.set_xlabel("final validation accuracy (higher is better)")
        ax.set_ylabel("worst attack: excess over its null baseline\n(any attacked round; lower is more private)")
        ax.set_ylim(-0.05, 1.05)
        ax.set_title(f"{model} · {algorithm}: privacy-utility frontier\n(markers at one place are set side by side)",
                     fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    _save(fig, path)
