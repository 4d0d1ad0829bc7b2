"""The audit's terminal tables (``aegis audit`` prints them at the end): per model, one line per defence with
its privacy verdict, utility verdict and recommendation, then every attack's score against its null."""

from __future__ import annotations

from rich import box
from rich.markup import escape
from rich.table import Table

from .advice import advice
from .report import utility_text

VERDICT_COLOURS = {"holds": "green", "leak": "red", "suspect": "yellow", "unusable": "magenta", "reference": "dim"}
ABBREVIATIONS = {
    "embedding_norm": "emb",
    "mlp_span": "mlp",
    "spectral": "spec",
    "labels": "label",
    "fingerprint_pool": "pool",
    "fingerprint_secret": "pin",
    "loss_oracle": "loss",
}


def results_tables(report) -> list:
    """Per model: verdict and utility per defence, and every attack's score (narrow enough for 80 columns)."""
    def mark(kind: str, text: str) -> str:
        return f"[{VERDICT_COLOURS[kind]}]{escape(text)}[/]"

    tables: list[Table | str] = []
    for model in report.models():
        verdicts = [v for v in report.verdicts if v.model == model]
        none = report.utility_of(model, "none")
        first = report.utility_of(model, verdicts[0].defence) if verdicts else None
        refs = [
            f"undefended {utility_text(none)}" if none else "",
            f"untrained {utility_text(_Ref(first))}" if first else "",
        ]
        if first is not None and first.chance is not None:
            refs.append(f"chance acc {first.chance:.2f}")
        t = Table(
            title=f"{model}: verdicts ({', '.join(r for r in refs if r)})",
            box=box.SIMPLE_HEAD,
            padding=(0, 1),
            title_justify="left",
        )
        t.expand = True  # the verdict columns share the width by their ratios
        t.add_column("defence", no_wrap=True)
        t.add_column("privacy verdict", overflow="fold", ratio=5)
        t.add_column("utility verdict", overflow="fold", ratio=3)
        t.add_column("recommendation", overflow="fold", ratio=4)
        for a in advice(report, mark, escape):
            if a.model == model:
                u = report.utility_of(model, a.defence)
                eps = "" if u is None or u.epsilon is None else escape(f" (ε {u.epsilon:.3g})")
                util = escape(f"{utility_text(u)}: {a.utility.text()}")
                t.add_row(a.defence, a.privacy + eps, util, mark(a.kind, a.recommendation))
        tables.append(t)

        attacks = list(dict.fromkeys(r.attack for r in report.results if r.model == model))
        s = Table(title=f"{model}: attack scores", box=box.SIMPLE_HEAD, padding=(0, 1), title_justify="left")
        s.add_column("defence", no_wrap=True)
        for a in attacks:
            s.add_column(ABBREVIATIONS.get(a, a), justify="right", no_wrap=True)
        nulls = {n.attack: n for n in report.nulls if n.model == model}
        s.add_row("[dim]null[/dim]", *[f"[dim]{_null_value(nulls.get(a))}[/dim]" for a in attacks])
        for v in verdicts:
            cells = []
            for a in attacks:
                r = next((r for r in report.results if (r.model, r.defence, r.attack) == (model, v.defence, a)), None)
                colour = "red" if r is not None and r.leaks else "yellow" if r is not None and r.suspect else "green"
                cells.append("–" if r is None or not r.applicable else f"[{colour}]{r.privacy:.2f}[/]")
            s.add_row(v.defence, *cells)
        tables.append(s)
        tables.append(LEGEND)
    return tables


LEGEND = (
    "text attacks (dager, emb, mlp, spec, tag): the worst of ROUGE-1 and token recall; label, pool, pin "
    "(fingerprint 1-of-N: which batch, which secret), loss (1-of-N from a reported loss): accuracy; red: "
    "leaks (more than 0.05 above the null; 1-of-N and label: and unlikely by chance, p < 0.01); yellow: "
    "suspect (above the bar on too few trials); –: not applicable (the flood-level attacks read AEGIS floods "
    "only; labels: the encoder's head; loss: no reply carried a loss)\n"
)


def _null_value(n) -> str:
    if n is None:
        return "–"
    return f"{max(n.score, n.token_recall or 0.0):.2f}"


class _Ref:
    def __init__(self, u) -> None:
        self.metric, self.value = u.metric, u.before
