"""``aegis exposure show|path|reset``: the exposure counts a client keeps (:mod:`aegis.exposure_store`): where
they are, what they hold, and forgetting them (only with ``--yes``, after saying what is forgotten)."""

from __future__ import annotations

from pathlib import Path

import click
import typer

from .main import Command, Group, app, fail

exposure_app = typer.Typer(
    cls=Group,
    no_args_is_help=True,
    rich_markup_mode=None,
    add_completion=False,
    help="The exposure counts: where they are kept (path), what they hold (show), forgetting them (reset).",
)
app.add_typer(exposure_app, name="exposure")

STATE_HELP = ("an exposure store other than the default one (what AegisConfig(exposure_state=PATH) names; default: "
              "$AEGIS_CACHE_DIR/exposure/default.sqlite, $AEGIS_CACHE_DIR defaulting to ~/.cache/aegis)")


def _where(state: str | None) -> Path:
    """The store ``--state`` names, or the default one; a one-line error for a relative $AEGIS_CACHE_DIR."""
    from ..exposure_store import default_state_path

    if state is not None:
        return Path(state).expanduser()
    try:
        return default_state_path()
    except ValueError as err:
        raise fail(f"AEGIS_CACHE_DIR: {err}") from None


def _summary(path: Path, option: str):
    """The store's summary; None when there is no store at the default path; errors in one line."""
    from ..exposure_store import ExposureStore

    if not path.exists():
        if option == "--state":
            raise fail(f"--state: {path} does not exist: name an exposure store (create_state makes one)")
        return None
    try:
        return ExposureStore(path).summary()
    except (OSError, ValueError, RuntimeError) as err:  # not a store, not the user's, a damaged file
        raise fail(f"{option}: {path}: {' '.join(str(err).split())}") from None


def _nothing(path: Path) -> str:
    legacy = path.with_suffix(".json")
    if legacy.exists():
        return f"no exposure store at {path}; an earlier JSON state at {legacy} is migrated by the next export"
    return f"no exposure store at {path}: nothing was exported with it yet (the first export creates it)"


@exposure_app.command(cls=Command)
def path(state: str | None = typer.Option(None, "--state", metavar="PATH", help=STATE_HELP)) -> None:
    """Print where the exposure counts are kept (whether or not the store exists yet)."""
    where = _where(state)
    click.echo(str(where))
    if not where.exists():
        click.echo(f"note: {_nothing(where)}", err=True)


@exposure_app.command(cls=Command)
def show(state: str | None = typer.Option(None, "--state", metavar="PATH", help=STATE_HELP)) -> None:
    """What the store holds: windows counted, the most exports of any one, exports, size."""
    where = _where(state)
    found = _summary(where, "--state" if state is not None else "store")
    if found is None:
        click.echo(_nothing(where))
        return
    click.echo(f"exposure store {found.path} (id {found.store_id})\n"
               f"  token windows counted:        {found.windows:,}\n"
               f"  most exports of one window:   {found.max_count}\n"
               f"  exports counted:              {found.exports:,}\n"
               f"  size on disk:                 {found.bytes / 1024:,.0f} KiB")


@exposure_app.command(cls=Command)
def reset(
    state: str | None = typer.Option(None, "--state", metavar="PATH", help=STATE_HELP),
    yes: bool = typer.Option(False, "--yes", help="confirm: forget every count (the text already exported stays "
                             "exported; only the budget forgets it)"),
) -> None:
    """Forget every count: a new, empty store with a new salt. Text exported before can then leave again up to
    the full budget, so only reset for a new data set or a new client."""
    from ..exposure_store import reset_state

    where = _where(state)
    found = _summary(where, "--state" if state is not None else "store")
    if found is None:
        click.echo(_nothing(where) + ": nothing to reset")
        return
    what = (f"{found.windows:,} token windows' counts ({found.exports:,} exports, up to {found.max_count} of one "
            f"window) in {found.path}")
    if not yes:
        raise fail(f"--yes: reset forgets {what}; add --yes to confirm")
    try:
        reset_state(where)
    except (OSError, ValueError) as err:
        raise fail(f"{'--state' if state is not None else 'store'}: {where}: {' '.join(str(err).split())}") from None
    click.echo(f"forgot {what}; {where} is a new, empty store")
