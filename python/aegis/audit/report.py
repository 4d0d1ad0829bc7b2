"""The audit's outputs: report.json (rewritten after every defence), a privacy/utility PNG and an HTML page.

:class:`ReportWriter` owns the output folder (:class:`aegis.harness.output.OutputFolder`: atomic writes,
and a fresh temporary folder it names if the requested one stops being writable), so what finished is
never lost.
"""

from __future__ import annotations

import math
from pathlib import Path

from ..harness.output import OutputFolder, write_json
from ..harness.style import CSS, dodge, shift
from ..harness.style import escape as _e
from ..harness.style import number_cell as _num
from .advice import TRAINS_SHARE, UtilityVerdict, advice
from .records import FLOOR, MARGIN, AttackRecord, AuditReport

# the recommendation kinds the shared style lacks (aegis.audit.advice.recommendation)
KINDS_CSS = ".unusable{color:#7a2e8e;font-weight:600}.reference{color:#555}"
BROKEN_ATTACK = FLOOR  # ROUGE-1 at or below this: the attack recovers nothing usable (the paper's bar)
TEXT_METRIC = "rouge1"


# -- report.json ---------------------------------------------------------------------------------------------------


def report_json(report: AuditReport) -> dict:
    """``report.json``: the report's records, and per defence its utility verdict and recommendation."""
    data = report.to_json()
    data["advice"] = [
        {"model": a.model, "defence": a.defence, "trains": a.utility.trains, "utility_ratio": a.utility.ratio,
         "utility_verdict": a.utility.text(), "recommendation": a.recommendation, "kind": a.kind}
        for a in advice(report)
    ]
    return data


class ReportWriter(OutputFolder):
    """Writes the audit's report into ``folder`` (or, when that fails, a temporary folder it names)."""

    def save(self, report: AuditReport) -> Path:
        def write(folder: Path) -> Path:
            write_json(report_json(report), folder / "report.json")
            return folder / "report.json"

        return self.write(write)

    def finish(self, report: AuditReport) -> list[Path]:
        """report.json, privacy_utility.png and report.html."""
        return [self.save(report), *self.render(report)]

    def render(self, report: AuditReport) -> list[Path]:
        """privacy_utility.png and report.html of ``report`` (finished or not), report.json untouched."""

        def write(folder: Path) -> list[Path]:
            plot(report, folder / "privacy_utility.png")
            write_html(report, folder / "report.html", plot_name="privacy_utility.png")
            return [folder / "privacy_utility.png", folder / "report.html"]

        return self.write(write)


def _partial(report: AuditReport) -> str:
    if report.complete:
        return ""
    done, planned = rows_done(report)
    return (f"<b>Partial report</b>: {done} of {planned} (model, defence) rows finished; "
            "<code>aegis audit --resume &lt;this folder&gt;</code> runs the rest. ")


def rows_done(report: AuditReport) -> tuple[int, int]:
    """(model, defence) rows finished, and planned by the run's settings (at least those finished)."""
    config = report.meta.get("config", {})
    planned = len(config.get("models", [])) * len(config.get("defences", []))
    return len(report.verdicts), max(planned, len(report.verdicts))


# -- helpers -------------------------------------------------------------------------------------------------------


def worst_text(report: AuditReport, model: str, defence: str) -> float:
    """The strongest reconstruction attack on its worst axis (ROUGE-1 or token recall)."""
    rows = [r.privacy for r in report.results if (r.model, r.defence) == (model, defence) and r.metric == TEXT_METRIC]
    return max(rows) if rows else float("nan")


def worst_identification(report: AuditReport, model: str, defence: str) -> tuple[float, str | None]:
    """The strongest label / 1-of-N attack as its advantage over chance, (acc - null) / (1 - null)."""
    best, name = float("nan"), None
    for r in report.results:
        if (r.model, r.defence) == (model, defence) and r.metric == "accuracy":
            adv = (r.score - r.null) / max(1e-9, 1 - r.null)
            if math.isnan(best) or adv > best:
                best, name = adv, r.attack
    return best, name


def utility_text(u) -> str:
    if u is None or u.value is None or (isinstance(u.value, float) and math.isnan(u.value)):
        return "–"
    if u.metric == "perplexity":
        return f"ppl {u.value:.0f}" if u.value >= 100 else f"ppl {u.value:.1f}"
    return f"acc {u.value:.2f}"


# -- the plot ------------------------------------------------------------------------------------------------------

# Twelve hues that stay apart (and from the reference lines' greys).
PALETTE = (
    "#000000",
    "#1f77b4",
    "#2ca02c",
    "#d62728",
    "#ff7f0e",
    "#9467bd",
    "#8c564b",
    "#e377c2",
    "#17becf",
    "#bcbd22",
    "#7f7f7f",
    "#aec7e8",
    "#98df8a",
    "#ff9896",
    "#c5b0d5",
)
MARKERS = ("o", "*", "P", "X", "s", "D", "^", "v", "<", ">", "h", "p", "8", "d", "H")


def plot(report: AuditReport, path: Path) -> None:
    """Per model: reconstruction (worst of ROUGE-1 and token recall over the text attacks) and
    identification (labels / fingerprint advantage over chance) against utility, one colour and marker
    per defence, with the undefended, untrained-model and chance references."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    models = report.models()
    if not models:
        fig = plt.figure(figsize=(6, 1.5))
        fig.text(0.5, 0.5, "no (model, defence) row has finished yet", ha="center", va="center")
        fig.savefig(path, dpi=100)
        plt.close(fig)
        return
    defences = list(dict.fromkeys(u.defence for u in report.utility))
    style = {d: (PALETTE[i % len(PALETTE)], MARKERS[i % len(MARKERS)]) for i, d in enumerate(defences)}
    fig, axes = plt.subplots(len(models), 2, figsize=(15, 5.2 * len(models)), squeeze=False)
    for row, model in enumerate(models):
        utility = [u for u in report.utility if u.model == model]
        metric = utility[0].metric
        xs = [u.value for u in utility if u.value is not None and math.isfinite(u.value)]
        refs = [utility[0].before] + [u.value for u in utility if u.defence == "none"]
        span = (min(xs + refs), max(xs + refs)) if xs else (0.0, 1.0)
        verdict = {v.defence: v for v in report.verdicts if v.model == model}
        for col, (title, ylabel) in enumerate(
            (
                ("reconstruction", "worst of ROUGE-1 and token recall\n(strongest text attack; lower is more private)"),
                (
                    "identification",
                    "labels / 1-of-N fingerprint:\naccuracy above chance, (acc − chance) / (1 − chance)",
                ),
            )
        ):
            ax = axes[row][col]
            points, keep = [], []
            for u in utility:
                if col == 0:
                    y = worst_text(report, model, u.defence)
                else:
                    y, _ = worst_identification(report, model, u.defence)
                if y is None or math.isnan(y) or u.value is None or not math.isfinite(u.value):
                    continue
                points.append((u.value, y))
                keep.append(u)
            offsets = dodge(points, metric == "perplexity", span)
            for (x, y), dx, u in zip(points, offsets, keep):
                colour, marker = style[u.defence]
                v = verdict.get(u.defence)
                leaking = v is not None and not v.holds
                x = shift(x, dx, metric == "perplexity", span)
                ax.scatter(
                    x,
                    y,
                    marker=marker,
                    s=170 if marker == "*" else 95,
                    facecolors=colour,
                    edgecolors="red" if leaking else "white",
                    linewidths=1.8 if leaking else 0.8,
                    zorder=4,
                )
            ax.axhline(BROKEN_ATTACK if col == 0 else MARGIN, color="tab:red", linestyle="--", linewidth=1)
            before = utility[0].before
            undefended = next((u.value for u in utility if u.defence == "none"), None)
            ax.axvline(before, color="0.35", linestyle=":", linewidth=1.2)
            if undefended is not None and math.isfinite(undefended):
                ax.axvline(undefended, color="0.55", linestyle="--", linewidth=1.0)
            chance = utility[0].chance
            if chance is not None:
                ax.axvline(chance, color="#8c564b", linestyle="-.", linewidth=1.0)
            if metric == "perplexity":
                ax.set_xscale("log")
                ax.xaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
                ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:g}"))
                ax.xaxis.set_minor_formatter(NullFormatter())
                ax.set_xlabel("validation perplexity (lower is better)")
            else:
                ax.set_xlabel("validation accuracy (higher is better)")
            ax.set_ylabel(ylabel)
            ax.set_ylim(-0.05, 1.1)
            ax.set_title(f"{model}: {title} vs utility")
            if any(offsets):
                ax.text(
                    0.99,
                    0.99,
                    "markers at the same place are set side by side",
                    transform=ax.transAxes,
                    ha="right",
                    va="top",
                    fontsize=7,
                    color="0.4",
                )
            ax.grid(alpha=0.3)
        handles = []
        for u in utility:
            colour, marker = style[u.defence]
            v = verdict.get(u.defence)
            label = u.defence + (
                "" if v is None else ("  LEAKS" if not v.holds else "  suspect" if v.suspect else "  holds")
            )
            handles.append(
                Line2D(
                    [],
                    [],
                    linestyle="",
                    marker=marker,
                    markersize=11 if marker == "*" else 8,
                    markerfacecolor=colour,
                    markeredgecolor="red" if v is not None and not v.holds else "white",
                    markeredgewidth=1.8 if v is not None and not v.holds else 0.8,
                    label=label,
                )
            )
        handles += [
            Line2D([], [], color="tab:red", linestyle="--", label="leak threshold (0.05)"),
            Line2D(
                [],
                [],
                color="0.35",
                linestyle=":",
                label=f"untrained model ({utility_text(_Ref(metric, utility[0].before))})",
            ),
        ]
        reference = next((u for u in utility if u.defence == "none"), None)
        if reference is not None:
            handles.append(
                Line2D([], [], color="0.55", linestyle="--", label=f"undefended ({utility_text(reference)})")
            )
        if utility[0].chance is not None:
            handles.append(
                Line2D([], [], color="#8c564b", linestyle="-.", label=f"chance accuracy ({utility[0].chance:.2f})")
            )
        axes[row][1].legend(
            handles=handles,
            fontsize=8,
            loc="center left",
            bbox_to_anchor=(1.02, 0.5),
            frameon=False,
            title="red edge: leaks",
            title_fontsize=8,
        )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


class _Ref:
    def __init__(self, metric: str, value: float) -> None:
        self.metric, self.value = metric, value


# -- the HTML page -------------------------------------------------------------------------------------------------

MAX_CELL_TOKENS = 60


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



def _scope(config: dict) -> str:
    rounds, attacked = config.get("rounds"), config.get("attack_rounds")
    if not attacked or attacked >= (rounds or 0):
        return "every round's"
    return "the first round's" if attacked == 1 else f"the first {attacked} rounds'"


def write_html(report: AuditReport, path: Path, plot_name: str | None = None) -> None:
    meta = report.meta
    config = meta.get("config", {})
    data = meta.get("data", {})
    parts = [
        f"<!doctype html><html><head><meta charset='utf-8'><title>AEGIS audit</title><style>{CSS}{KINDS_CSS}</style>"
        "</head><body><h1>AEGIS audit</h1>"
    ]
    parts.append(
        f"<p>Data: {_e(data.get('source', ''))}; validation: {_e(data.get('validation', ''))}. "
        f"{config.get('clients')} clients, {config.get('rounds')} rounds, batch {config.get('batch_size')}, "
        f"seed {config.get('seed')}. {_partial(report)}"
        f"{meta.get('seconds', 0):.0f} s.</p>"
    )
    parts.append(
        "<h2>Verdicts</h2><table><tr><th>model</th><th>defence</th><th>privacy verdict</th>"
        "<th>utility verdict</th><th>recommendation</th><th>utility</th><th>undefended</th><th>untrained</th>"
        "<th>chance</th><th>DP ε</th></tr>"
    )
    for a in advice(report, lambda kind, text: f"<span class='{kind}'>{_e(text)}</span>", _e):
        u = report.utility_of(a.model, a.defence)
        none = report.utility_of(a.model, "none")
        eps = "–" if u is None or u.epsilon is None else f"{u.epsilon:.3g} (δ {u.delta:g})"
        parts.append(
            f"<tr><td>{_e(a.model)}</td><td>{_e(a.defence)}</td><td class='privacy'>{a.privacy}</td>"
            f"<td class='utility'>{_utility_cell(a.utility)}</td>"
            f"<td class='advice'><span class='{a.kind}'>{_e(a.recommendation)}</span></td>"
            f"<td>{_e(utility_text(u))}</td>"
            f"<td>{_e(utility_text(none))}</td><td>{_e(utility_text(_Ref(u.metric, u.before)) if u else '–')}</td>"
            f"<td>{'–' if u is None or u.chance is None else f'{u.chance:.2f}'}</td><td>{eps}</td></tr>"
        )
    parts.append("</table>")
    parts.append(
        "<div class='how'><b>How to read this.</b> Each defence trained the models federatedly; the server kept "
        f"every gradient a client shared and attacked {_scope(config)} gradients. A defence "
        f"<span class='holds'>holds</span> when every attack stays within {MARGIN} of its <i>null baseline</i> "
        "(what the attack scores on a gradient "
        "that holds nothing of the batch: a Gaussian gradient of matched norms for the reconstruction attacks, "
        "1/N for the 1-of-N attacks, and for the label attack the chance level of its own guesses, scored against "
        "batches they were not made from); otherwise it <span class='leak'>leaks</span>, and the verdict names "
        "the attack. Each AEGIS preset states what it stops (sentences: a sentence, its words in order; "
        "reconstruction: also its bag of words or its labels; "
        "candidate verification: which of some candidate texts a client trained on); its verdict says that "
        "promise, and the promise is <i>broken</i> when an attack on a threat it stops leaks at a batch size it is "
        "stated for. The 1-of-N and label attacks leak only when the excess is also unlikely by chance (rank-sum "
        "or permutation p &lt; 0.01, Bonferroni over their variants); otherwise they are "
        "<span class='suspect'>suspect</span> (rerun with more trials). Reconstruction attacks count on their "
        "worst axis: ROUGE-1 (word order) or token recall (the bag of words). Utility is the global model after "
        "the last round beside the undefended run and the untrained model "
        "(and chance accuracy for the classifier); a defence <i>trains</i> when it keeps at least "
        f"{TRAINS_SHARE:.0%} of what the undefended run gained over the untrained model (log perplexity, or "
        "accuracy points), and the ratio to the undefended run is what it costs. The recommendation weighs both: "
        "a defence that is private only because it does not train is not usable. <code>aegis-*-batch</code> is "
        "the paper's batch calibration, kept to reproduce the paper: its noise level fingerprints the batch. "
        "<i>K</i> is how many exports of one batch an attack read: the federated rounds export each batch once; "
        "the secret-completion attack reads K = the configuration's exposure budget jointly and then checks that "
        "the shield refuses export K + 1. <i>DP ε</i> per example: DP-SGD's from Opacus's RDP accountant; an AEGIS "
        "preset's is its exposure budget's exports composed at the noise multiplier of one export "
        "(<code>aegis.accounting</code>; ∞ with the budget off or a tensor exported clean).</div>"
    )
    if plot_name:
        parts.append(f"<img src='{_e(plot_name)}' alt='privacy/utility plot' style='max-width:100%'>")
    parts.append(
        "<h2>Null baselines</h2><table><tr><th>model</th><th>attack</th><th>null score</th>"
        "<th>null token recall</th><th>how</th></tr>"
    )
    for n in report.nulls:
        parts.append(
            f"<tr><td>{_e(n.model)}</td><td>{_e(n.attack)}</td>{_num(n.score)}{_num(n.token_recall)}"
            f"<td>{_e(n.how)}</td></tr>"
        )
    parts.append(
        "</table><h2>Scores</h2><table><tr><th>model</th><th>defence</th><th>attack</th><th>score</th>"
        "<th>null</th><th>ROUGE-1</th><th>ROUGE-2</th><th>ROUGE-L</th><th>token recall</th><th>exact</th>"
        "<th>N</th><th>gradients</th><th>notes</th></tr>"
    )
    for r in report.results:
        score = f"<span class='{'leak' if r.leaks else 'suspect' if r.suspect else 'holds'}'>{r.score:.3f}</span>"
        notes = r.note
        if r.variants:
            notes = ", ".join(f"{k} {v:.2f}" for k, v in r.variants.items()) + ("; " + notes if notes else "")
        if r.p_value is not None:
            notes += f"; ranks {', '.join(f'{x:g}' for x in r.ranks)}; p {r.p_value:.2g}"
        parts.append(
            f"<tr><td>{_e(r.model)}</td><td>{_e(r.defence)}</td><td>{_e(r.attack)} ({_e(_metric_name(r))})</td>"
            f"<td class='n'>{score}</td>{_num(r.null)}{_num(r.rouge1)}{_num(r.rouge2)}{_num(r.rougeL)}"
            f"{_num(r.token_recall)}{_num(r.exact_rate)}<td class='n'>{r.candidates or '–'}</td>"
            f"<td class='n'>{r.gradients}</td><td>{_e(notes)}</td></tr>"
        )
    parts.append(
        "</table><h2>Reconstructions</h2><p><span class='hit'>green</span>: right token, right place; "
        "<span class='moved'>orange</span>: right token, wrong place; grey: wrong token. Long "
        f"reconstructions are cut at {MAX_CELL_TOKENS} tokens, with the count of the rest.</p>"
        "<table><tr><th>model / defence / attack</th><th>private sentence</th><th>reconstruction</th></tr>"
    )
    for rec in report.reconstructions:
        shown = rec.prediction_tokens[:MAX_CELL_TOKENS]
        more = rec.prediction_more + max(0, len(rec.prediction_tokens) - MAX_CELL_TOKENS)
        marked = " ".join(
            f"<span class='{cls}'>{_e(tok)}</span>" for tok, cls in token_marks(rec.reference_tokens, shown)
        )
        if more:
            marked += f" <span class='more'>… (+{more:,} more tokens)</span>"
        parts.append(
            f"<tr><td>{_e(rec.model)} / {_e(rec.defence)} / {_e(rec.attack)}</td>"
            f"<td class='ref'>{_e(rec.reference)}</td>"
            f"<td>{marked or '<span class=empty>(nothing recovered)</span>'}</td></tr>"
        )
    parts.append("</table></body></html>")
    path.write_text("\n".join(parts))


def _utility_cell(u: UtilityVerdict) -> str:
    kind = "suspect" if u.trains is None else "holds" if u.trains else "leak"
    word, _, rest = u.text().partition(" (")
    if u.trains is None:
        return f"<span class='{kind}'>{_e(u.text())}</span>"
    return f"<span class='{kind}'>{_e(word)}</span>" + (f" ({_e(rest)}" if rest else "")


def _metric_name(r: AttackRecord) -> str:
    return "ROUGE-1" if r.metric == TEXT_METRIC else "accuracy"
