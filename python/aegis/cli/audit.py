"""``aegis audit`` (the main job: federate, attack, score, report), its ``--resume``, and ``aegis report``
(the page and the plot of any report.json, finished or not).

Bad input is refused before any model loads, in one line that names the option and the fix, with exit
code 2. A failure during the run prints one line and keeps what finished (``--debug``: the traceback).
Ctrl-C and SIGTERM stop the run the same way: the finished (model, defence) rows stay in report.json,
the page and the plot are drawn from them, and ``aegis audit --resume DIR`` runs the rest.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import click
import typer
from rich.console import Console

from ..audit.options import (
    ATTACKS,
    DEFAULT_ATTACKS,
    DEFENCES,
    EMBEDDED_DECODERS,
    FULL_DEFENCES,
    MODELS,
    QUICK_DEFENCES,
)
from .main import Command, app, choices, fail, set_threads

# what --resume may come with: everything else is read from the report it continues
RESUME_KEEPS = {"resume", "threads", "debug"}


@app.command(cls=Command)
def audit(
    ctx: typer.Context,
    out: str = typer.Option(
        "aegis-report",
        show_default=False,
        help="folder for report.json (rewritten after every finished defence), privacy_utility.png and "
        "report.html; created if missing (default aegis-report)",
    ),
    quick: bool = typer.Option(
        False,
        "--quick",
        help=f"under 3 CPU-minutes: the decoder alone, batch 1, {choices(QUICK_DEFENCES)}",
    ),
    full: bool = typer.Option(
        False,
        "--full",
        help=f"the full study (about 80 CPU-minutes): both models, 3 rounds, batch 4, {choices(FULL_DEFENCES)}",
    ),
    resume: str | None = typer.Option(
        None,
        "--resume",
        metavar="DIR",
        help="continue the unfinished audit in DIR (its report.json): the finished rows are kept, the rest run "
        "with the same settings",
    ),
    models: str | None = typer.Option(None, help=f"comma-separated, from: {choices(MODELS)}"),
    model: str | None = typer.Option(
        None,
        "--model",
        help="the decoder: a HF causal-LM name or local folder, or decoder-random (GPT-2 blocks with random "
        "attention); default: MiniLM's pretrained layers run causally",
    ),
    encoder: str | None = typer.Option(None, help="HF sequence-classification name or folder for the encoder"),
    dataset: str | None = typer.Option(
        None,
        help="a .txt (one sentence per line), .csv or .jsonl file, or a HF dataset name (default: the shipped corpus)",
    ),
    text_field: str | None = typer.Option(None, "--text-field", help="the dataset's text column"),
    label_field: str | None = typer.Option(None, "--label-field", help="the dataset's label column (encoder)"),
    validation_share: float = typer.Option(
        0.2,
        "--validation-share",
        show_default=False,
        help="share held out for validation when the dataset has no validation split (seeded; default 0.2)",
    ),
    defences: str | None = typer.Option(
        None,
        help=f"comma-separated defence names (default: {choices(DEFENCES)}; --quick, --full: theirs above); others "
        "such as dp-noise-0.05, or aegis-sentences with --batch-size 8, the batch its promise is stated for (its "
        "spectral search alone runs past 15 CPU-minutes there)",
    ),
    attacks: str | None = typer.Option(
        None, help=f"comma-separated, from: {choices(ATTACKS)} (default: {choices(DEFAULT_ATTACKS)})"
    ),
    clients: int | None = typer.Option(None, help="clients per round (default 2)"),
    rounds: int | None = typer.Option(None, help="FedSGD rounds (default 2; --full 3)"),
    batch_size: int | None = typer.Option(
        None, "--batch-size", help="sentences per client batch (default 2; --quick 1, --full 4)"
    ),
    attack_rounds: int | None = typer.Option(
        None, "--attack-rounds", help="attack the first N rounds' gradients (default 1; 0: every round)"
    ),
    secret_trials: int | None = typer.Option(
        None, "--secret-trials", help="secret-completion trials per AEGIS defence (default 2; --full 4)"
    ),
    seed: int = typer.Option(
        0, show_default=False, help="seed of data order, split and model init (never of the flood noise; default 0)"
    ),
    threads: int | None = typer.Option(
        None,
        "--threads",
        help="torch intra-op threads (default: one per core on an idle machine, 1 when other processes keep the "
        "cores busy)",
    ),
    debug: bool = typer.Option(False, "--debug", help="show tracebacks"),
) -> None:
    """Federated rounds with each defence; the server attacks the shared gradients; a privacy/utility report
    (about 7 CPU-minutes; --quick 3, --full 80)."""
    from ..audit import dataset as audit_data
    from ..audit.options import AuditConfig, UsageError, check_model_name, check_out, split_names

    console = Console()
    changes: dict[str, Any] = {  # AuditConfig fields of every kind
        key: value
        for key, value in dict(
            models=split_names(models),
            decoder=model,
            encoder=encoder,
            dataset=dataset,
            text_field=text_field,
            label_field=label_field,
            validation_share=validation_share,
            defences=split_names(defences),
            attacks=split_names(attacks),
            clients=clients,
            rounds=rounds,
            batch_size=batch_size,
            attack_rounds=attack_rounds,
            secret_trials=secret_trials,
            seed=seed,
        ).items()
        if value is not None
    }
    earlier = None
    try:
        if quick and full:
            raise UsageError("--full", "runs the full study, --quick the smallest: choose one")
        if threads is not None and not 1 <= threads <= (os.cpu_count() or 1) * 4:
            raise UsageError("--threads", f"{threads}: use a whole number from 1 to {(os.cpu_count() or 1) * 4}")
        if resume is not None:
            config, earlier, folder = _resumed(ctx, resume)
        else:
            config = (AuditConfig.quick if quick else AuditConfig.full if full else AuditConfig)(**changes)
            folder = check_out(out)
        if config.decoder is not None and config.decoder not in EMBEDDED_DECODERS:
            check_model_name("--model", config.decoder)
        if config.encoder is not None:
            check_model_name("--encoder", config.encoder)
        data = audit_data.load(config)
    except UsageError as err:
        if debug:
            raise
        raise fail(str(err)) from None
    if earlier is not None and earlier.complete:
        click.echo(f"{folder / 'report.json'} is complete: nothing to resume (aegis report {folder} redraws it)")
        return
    set_threads(threads, say_busy=True)
    _run(config, data, folder, console, debug, earlier)


def _resumed(ctx: typer.Context, resume: str):
    """The settings and the report of the audit in ``resume``; only --threads and --debug may come along."""
    from ..audit.options import AuditConfig, UsageError, check_out
    from ..audit.records import report_from_json

    given = [name for name, value in ctx.params.items() if name not in RESUME_KEEPS
             and ctx.get_parameter_source(name) is not click.core.ParameterSource.DEFAULT and value is not None]
    if given:
        flag = "--" + given[0].replace("_", "-")
        raise UsageError(flag, f"--resume takes every setting from the report it continues: drop {flag}")
    folder = Path(resume).expanduser()
    data = read_report(folder, "--resume")
    try:
        config = AuditConfig.from_dict(data.get("meta", {}).get("config", {}))
    except (TypeError, ValueError) as err:
        raise UsageError("--resume", f"{folder / 'report.json'} holds no audit settings this version reads ({err}): "
                         "start a new audit with --out") from None
    return config, report_from_json(data), check_out(folder)


def read_report(folder: Path, option: str) -> dict:
    """``folder/report.json`` as a dict, or a :class:`UsageError` naming ``option`` and the fix."""
    from ..audit.options import UsageError

    path = folder / "report.json" if folder.is_dir() or not folder.suffix else folder
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise UsageError(option, f"{path} does not exist: name the --out folder of an earlier aegis audit") from None
    except (OSError, ValueError) as err:
        raise UsageError(option, f"cannot read {path} ({type(err).__name__}): name an audit's report.json") from None
    if not isinstance(data, dict) or not isinstance(data.get("verdicts", []), list):
        raise UsageError(option, f"{path} is not an audit report: name the --out folder of an aegis audit")
    return data


class Stopped(KeyboardInterrupt):
    """SIGTERM, handled as Ctrl-C is."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


@contextlib.contextmanager
def _terminate_as_interrupt():
    def stop(signum, frame):
        raise Stopped(signum)

    before = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)


def _run(config, data, folder: Path, console: Console, debug: bool, earlier=None) -> None:
    from ..audit import run_audit
    from ..audit.progress import BarProgress, PlainProgress
    from ..audit.report import ReportWriter
    from ..audit.terminal import results_tables

    writer = ReportWriter(folder)
    progress = BarProgress(console) if console.is_terminal else PlainProgress(sys.stderr)
    try:
        with _terminate_as_interrupt(), progress:
            report = run_audit(config, progress.hooks(), data=data, sink=writer.save, resume=earlier)
        paths = writer.finish(report)
    except KeyboardInterrupt as stop:
        code = 128 + (stop.signum if isinstance(stop, Stopped) else signal.SIGINT)
        click.echo(f"interrupted: {_kept(writer.folder)}", err=True)
        raise typer.Exit(code) from None
    except Exception as err:  # a failure mid-run: one line, and what finished stays on disk
        if debug:
            raise
        first = " ".join(str(err).split())[:300]
        click.echo(f"error: {type(err).__name__}: {first}; {_kept(writer.folder)} (rerun with --debug for the "
                   "traceback)", err=True)
        raise typer.Exit(1) from None
    for table in results_tables(report):
        console.print(table)
    console.print(f"wrote {', '.join(str(p) for p in paths)} in {report.meta['seconds']:.0f} s "
                  f"({report.meta['cpu_seconds']:.0f} CPU-s)")
    if writer.failure is not None:
        click.echo(f"error: --out: could not write to {writer.failure}; the full report is in {writer.folder}",
                   err=True)
        raise typer.Exit(1)


def _kept(folder: Path) -> str:
    """Draw the page and the plot of the rows that finished, and say where they are and how to go on."""
    from ..audit.records import report_from_json
    from ..audit.report import ReportWriter, rows_done

    try:
        report = report_from_json(json.loads((folder / "report.json").read_text()))
    except (OSError, ValueError):
        return "no row had finished, nothing kept"
    done, planned = rows_done(report)
    paths = ReportWriter(folder).render(report)
    return (f"{done} of {planned} (model, defence) rows finished, in {', '.join(str(p) for p in paths)}; "
            f"continue with: aegis audit --resume {folder}")


@app.command(cls=Command)
def report(
    folder: str = typer.Argument(..., metavar="DIR", help="an audit's --out folder (or its report.json)"),
) -> None:
    """Draw report.html and privacy_utility.png from an audit's report.json, finished or not."""
    from ..audit.options import UsageError
    from ..audit.records import report_from_json
    from ..audit.report import ReportWriter, rows_done

    path = Path(folder).expanduser()
    try:
        data = read_report(path, "DIR")
    except UsageError as err:
        raise fail(str(err)) from None
    target = path if path.is_dir() else path.parent
    found = report_from_json(data)
    writer = ReportWriter(target)
    paths = writer.render(found)
    done, planned = rows_done(found)
    state = "complete" if found.complete else f"partial: {done} of {planned} rows (aegis audit --resume {target})"
    click.echo(f"wrote {', '.join(str(p) for p in paths)} ({state})")
    if writer.failure is not None:
        raise fail(f"DIR: could not write to {writer.failure}; the page and the plot are in {writer.folder}")
