"""The audit's outputs: report.json, a privacy/utility PNG and an HTML page of reconstructions."""
from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Any

BROKEN_ATTACK = 0.05  # ROUGE-1 at or below this: the attack recovers nothing usable (the paper's bar)


def write_json(report: dict[str, Any], path: Path) -> None:
    path.write_text(json.dumps(report, indent=1))


def worst_rouge1(results: list[dict], model: str, defence: str) -> float:
    """The strongest attack's ROUGE-1 against one defence: what a user should plan for."""
    scores = [r["rouge1"] for r in results if r["model"] == model and r["defence"] == defence]
    return max(scores) if scores else float("nan")


def plot(report: dict[str, Any], path: Path) -> None:
    """ROUGE-1 of the strongest attack against utility, one point per defence, one panel per model.

    A legend names the points (text labels collide: undefended and a useless defence sit on top of
    each other); AEGIS presets are stars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    models = sorted({u["model"] for u in report["utility"]})
    fig, axes = plt.subplots(1, len(models), figsize=(7.5 * len(models), 4.8), squeeze=False)
    markers = "osD^vPXh<>"
    for ax, model in zip(axes[0], models):
        utility = [u for u in report["utility"] if u["model"] == model]
        metric = "perplexity" if "perplexity" in utility[0] else "accuracy"
        others = 0
        for i, u in enumerate(utility):
            y = worst_rouge1(report["results"], model, u["defence"])
            if u["defence"].startswith("aegis"):
                style = {"marker": "*", "s": 220, "color": f"C{2 + 4 * (i % 2)}", "edgecolors": "black", "zorder": 4}
            else:
                style = {"marker": markers[others % len(markers)], "s": 70, "color": "tab:gray" if u["defence"] == "none"
                         else f"C{[0, 1, 3, 4, 5, 7, 8, 9][others % 8]}", "zorder": 3, "alpha": 0.85}
                others += 1
            ax.scatter(u[metric], y, label=u["defence"], **style)
        ax.axhline(BROKEN_ATTACK, color="tab:red", linestyle="--", linewidth=1, label="attack broken (ROUGE-1 ≤ 0.05)")
        if metric == "perplexity":
            ax.set_xscale("log")
            ax.xaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
            ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:g}"))
            ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel(f"validation {metric}" + (" (lower is better)" if metric == "perplexity" else " (higher is better)"))
        ax.set_ylabel("ROUGE-1 of the strongest attack (lower is more private)")
        ax.set_ylim(-0.04, 1.06)
        ax.set_title(f"{model}: privacy vs utility")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5), frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def token_marks(reference: list[str], prediction: list[str]) -> list[tuple[str, str]]:
    """Each predicted token with its class: 'hit' (right token, right place), 'moved' (in the sentence,
    elsewhere) or 'miss'."""
    marks = []
    for i, token in enumerate(prediction):
        if i < len(reference) and reference[i] == token:
            marks.append((token, "hit"))
        elif token in reference:
            marks.append((token, "moved"))
        else:
            marks.append((token, "miss"))
    return marks


_CSS = """
body{font-family:system-ui,sans-serif;margin:2em;max-width:1200px}
table{border-collapse:collapse;margin-bottom:2em;width:100%}td,th{border:1px solid #ccc;padding:4px 8px;vertical-align:top}
th{background:#f3f3f3}.hit{background:#b7e4b0}.moved{background:#ffd59e}.miss{color:#999}
.ref{color:#333}.empty{color:#aaa;font-style:italic}
"""


def write_html(report: dict[str, Any], path: Path, plot_name: str | None = None) -> None:
    """Reconstructions token by token, like the paper's qualitative table."""
    config = report.get("meta", {}).get("config", {})
    rounds, attacked = config.get("rounds"), config.get("attack_rounds")
    if not attacked or attacked >= (rounds or 0):
        scope = "every round's"
    else:
        scope = "the first round's" if attacked == 1 else f"the first {attacked} rounds'"
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>AEGIS audit</title><style>{_CSS}</style></head><body>",
             "<h1>AEGIS audit</h1>",
             f"<p>The server captured every shared gradient and attacked {scope} gradients. "
             "<span class='hit'>green</span>: right token, right place; "
             "<span class='moved'>orange</span>: right token, wrong place; grey: wrong token.</p>"]
    if plot_name:
        parts.append(f"<img src='{html.escape(plot_name)}' alt='privacy/utility plot' style='max-width:100%'>")
    parts.append("<h2>Scores</h2><table><tr><th>model</th><th>defence</th><th>attack</th><th>ROUGE-1</th>"
                 "<th>ROUGE-2</th><th>ROUGE-L</th><th>token recall</th><th>exact</th></tr>")
    for r in report["results"]:
        parts.append(
            "<tr>" + "".join(f"<td>{html.escape(str(r[k]))}</td>" for k in ("model", "defence", "attack"))
            + "".join(f"<td>{r[k]:.3f}</td>" for k in ("rouge1", "rouge2", "rougeL", "token_recall", "exact_rate")) + "</tr>"
        )
    parts.append("</table><h2>Reconstructions</h2><table><tr><th>model / defence / attack</th><th>private sentence</th><th>reconstruction</th></tr>")
    for rec in report["reconstructions"]:
        ref_tokens, pred_tokens = rec["reference_tokens"], rec["prediction_tokens"]
        marked = " ".join(f"<span class='{cls}'>{html.escape(tok)}</span>" for tok, cls in token_marks(ref_tokens, pred_tokens))
        parts.append(
            f"<tr><td>{html.escape(rec['model'])} / {html.escape(rec['defence'])} / {html.escape(rec['attack'])}</td>"
            f"<td class='ref'>{html.escape(rec['reference'])}</td>"
            f"<td>{marked or '<span class=empty>(nothing recovered)</span>'}</td></tr>"
        )
    parts.append("</table></body></html>")
    path.write_text("\n".join(parts))
