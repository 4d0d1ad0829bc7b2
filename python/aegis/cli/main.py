"""The ``aegis`` application and what every command shares: one-line usage errors (exit code 2).

Nothing here imports torch: each command imports what it needs when it runs, so ``aegis --help`` is fast.
"""

from __future__ import annotations

import re

import click
import typer
from typer.core import TyperCommand, TyperGroup


class OneLineError(click.ClickException):
    """``error: <option>: <what and the fix>`` on stderr, exit code 2."""

    exit_code = 2

    def show(self, file=None) -> None:  # noqa: ARG002
        click.echo(f"error: {self.format_message()}", err=True)


def _one_line(err: click.UsageError, command: str) -> click.ClickException:
    if isinstance(err, click.exceptions.NoArgsIsHelpError):
        return err  # a bare group: click prints its help
    message = " ".join(err.format_message().split())
    message = re.sub(r"(Did you mean [^?]+\?)( \1)+", r"\1", message)  # click and typer both suggest
    return OneLineError(f"{message} (see aegis {command} --help)".replace("aegis  ", "aegis "))


class Command(TyperCommand):
    def make_context(self, info_name, args, parent=None, **extra):
        try:
            return super().make_context(info_name, args, parent=parent, **extra)
        except click.UsageError as err:
            path = f"{parent.info_name} {info_name}" if parent is not None and parent.parent is not None else info_name
            raise _one_line(err, path or "") from None


class Group(TyperGroup):
    def make_context(self, info_name, args, parent=None, **extra):
        try:
            return super().make_context(info_name, args, parent=parent, **extra)
        except click.UsageError as err:
            raise _one_line(err, "") from None

    def resolve_command(self, ctx, args):
        try:
            return super().resolve_command(ctx, args)
        except click.UsageError as err:
            raise _one_line(err, ctx.info_name if ctx.parent is not None else "") from None


app = typer.Typer(
    help="AEGIS: keep private text private in federated fine-tuning.",
    no_args_is_help=True,
    cls=Group,
    rich_markup_mode=None,
    pretty_exceptions_enable=False,
    add_completion=False,
)


@app.callback()
def _root() -> None:
    """Keep sub-commands explicit (``aegis inspect``, ``aegis audit``)."""


def fail(message: str) -> typer.Exit:
    click.echo(f"error: {message}", err=True)
    return typer.Exit(2)


def choices(values) -> str:
    return ", ".join(values)


def set_threads(threads: int | None = None, *, say_busy: bool = False) -> None:
    """Torch's intra-op threads: ``threads``, else one per core on an idle machine and 1 on a busy one."""
    import os

    import torch

    from aegis_kernels.cpu import default_threads

    if threads is None:
        threads = default_threads()
        if say_busy and threads < torch.get_num_threads():
            click.echo(
                f"note: the cores are busy (load {os.getloadavg()[0]:.1f}): 1 torch thread (--threads N to choose)",
                err=True,
            )
    torch.set_num_threads(threads)
