"""What the commands share: how each is added to the parser, the settings, the catalog
they open, and usage errors."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, NoReturn, TypeAlias

from ckpt.cli.text import paragraphs
from service.settings import Settings

if TYPE_CHECKING:
    from service.context import Context

Handler = Callable[[argparse.Namespace], int]
Commands: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"

CATALOG = (
    "The catalog is the database at CKPT_DATABASE_URL (default "
    "sqlite:///.ckpt/catalog.db; a shared one is postgresql+psycopg://...). "
    "No server needs to run."
)


def add_command(
    commands: Commands,
    name: str,
    *,
    summary: str,
    description: str,
    parents: Sequence[argparse.ArgumentParser] = (),
) -> argparse.ArgumentParser:
    """A subcommand listed with ``summary`` whose ``--help`` shows ``description``.

    ``description`` is one or more paragraphs separated by blank lines; each is wrapped
    to the width of a terminal.
    """
    return commands.add_parser(
        name,
        help=summary,
        description=paragraphs(description),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        parents=list(parents),
    )


def add_group(commands: Commands, name: str, *, summary: str, description: str) -> Commands:
    """A command whose subcommands (its actions) are added to what this returns; without
    one it prints its help to standard error and exits 2."""
    group = add_command(commands, name, summary=summary, description=description)

    def explain(_: argparse.Namespace) -> int:
        group.print_help(sys.stderr)
        return 2

    group.set_defaults(handler=explain)
    return group.add_subparsers(dest=f"{name}_command", metavar="ACTION")


def settings(**overrides: object) -> Settings:
    """The control plane's settings from ``CKPT_*``; a bad value exits with what is wrong."""
    try:
        return Settings.from_env(**overrides)
    except ValueError as err:
        raise SystemExit(f"ckpt: bad configuration: {err}") from None


def open_context() -> Context:
    """The catalog and the store the settings name, the schema upgraded where that is the
    default (the embedded SQLite catalog)."""
    from service.context import Context
    from service.db import upgrade

    current = settings()
    if current.migrate_at_start:
        upgrade(current.database_url)
    return Context.create(current)


def redact(url: str) -> str:
    """A database URL without its password."""
    from sqlalchemy import make_url

    return make_url(url).render_as_string(hide_password=True)


def usage_error(command: str, message: str) -> NoReturn:
    """Exit 2 (a usage error, as argparse's own) after saying what to fix."""
    print(f"{command}: {message}", file=sys.stderr)
    raise SystemExit(2)
