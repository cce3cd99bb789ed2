"""``ckpt token create | list | revoke``: the bearer tokens in the catalog, through the same
service functions as ``/v1/tokens``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import TYPE_CHECKING

from ckpt.cli.config import (
    CATALOG,
    Commands,
    add_command,
    add_group,
    open_context,
    usage_error,
)
from ckpt.cli.text import table

if TYPE_CHECKING:
    from pydantic import ValidationError

    from service.auth.schemas import TokenCreate, TokenOut

GROUP = f"""
    Manage the bearer tokens that the control plane accepts: create, list and revoke
    them. {CATALOG}
"""

CREATE = f"""
    Create a bearer token and print its secret on standard output, once: the catalog
    keeps only its SHA-256. An 'admin' token does everything, a 'read' token reads every
    run, a 'run' token reads and writes the one run named by --run (give it to a training
    job as CKPT_TOKEN). With --expires-in (30d, 12h, 90m, 3600s) the control plane refuses
    it from then on (401, saying it expired). {CATALOG}
"""

LIST = f"""
    List the tokens: id, name, role, run, and when each was created, expires and was
    revoked (UTC; an expired token is marked so). Never prints a secret: the catalog holds
    none. --json prints a JSON list of {{id, name, role, run, created_at, revoked_at,
    expires_at}}. {CATALOG}
"""

REVOKE = f"""
    Revoke the token with this id (see 'ckpt token list'): from then on the control
    plane refuses it (401). Revoking a revoked token changes nothing. Prints the token's
    id, name, role and when it was revoked; exits 1 when no token has this id. {CATALOG}
"""


def add_commands(commands: Commands) -> None:
    """``token create``, ``token list`` and ``token revoke``."""
    actions = add_group(commands, "token", summary="manage bearer tokens", description=GROUP)
    create = add_command(
        actions,
        "create",
        summary="create a token in the catalog and print it once",
        description=CREATE,
    )
    create.add_argument("--role", required=True, choices=["admin", "run", "read"])
    create.add_argument("--run", help="the run a 'run' token may read and write")
    create.add_argument("--name", default="cli", help="a label shown in listings")
    create.add_argument(
        "--expires-in",
        type=duration,
        metavar="DURATION",
        help="refuse the token after this long: 30d, 12h, 90m or 3600s (default: never)",
    )
    create.set_defaults(handler=_create)

    listing = add_command(
        actions, "list", summary="list the tokens (never their secrets)", description=LIST
    )
    listing.add_argument("--json", action="store_true", help="print a JSON list")
    listing.set_defaults(handler=_list)

    revoke = add_command(actions, "revoke", summary="revoke a token", description=REVOKE)
    revoke.add_argument("id", type=token_id, help="the token's id (see 'ckpt token list')")
    revoke.set_defaults(handler=_revoke)


def token_id(text: str) -> int:
    """A token id from the command line: a catalog id (1 to 2**31 - 1)."""
    from service.names import MAX_ID

    if not (text.isascii() and text.isdigit()) or not 1 <= int(text) <= MAX_ID:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a token id: ids are whole numbers from 1 to {MAX_ID}"
        )
    return int(text)


_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def duration(text: str) -> int:
    """Seconds from ``30d``, ``12h``, ``90m``, ``3600s`` or ``3600``."""
    number, unit = (text[:-1], text[-1]) if text[-1:] in _UNITS else (text, "s")
    if not (number.isascii() and number.isdigit()) or int(number) < 1:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a duration: write a whole number and a unit, e.g. 30d, 12h, "
            "90m or 3600s"
        )
    return int(number) * _UNITS[unit]


def _create(args: argparse.Namespace) -> int:
    from service.auth.service import create_token

    request = token_request(
        role=args.role, run=args.run, name=args.name, expires_in=args.expires_in
    )
    context = open_context()
    try:
        created = create_token(context, request)
    finally:
        context.close()
    scope = f" for run {created.run}" if created.run else ""
    until = f", valid until {_when(created.expires_at)} UTC" if created.expires_at else ""
    print(
        f"created {created.role} token {created.id} ({created.name}){scope}{until}:",
        file=sys.stderr,
    )
    print(created.token)
    return 0


def token_request(
    *, role: str, run: str | None, name: str, expires_in: int | None = None
) -> TokenCreate:
    """The request ``ckpt token create`` makes; a mistake exits 2 naming the option to fix."""
    from pydantic import ValidationError

    from service.auth.schemas import TokenCreate

    command = "ckpt token create"
    if role == "run" and run is None:
        usage_error(command, "--run is required for a 'run' token: name the run it may use")
    if role != "run" and run is not None:
        usage_error(command, f"--run is only for a 'run' token; a '{role}' token covers every run")
    try:
        return TokenCreate.model_validate(
            {"role": role, "run": run, "name": name, "expires_in_seconds": expires_in}
        )
    except ValidationError as err:
        usage_error(command, option_problem(err))


def option_problem(err: ValidationError) -> str:
    """The first problem pydantic found, named by its command-line option:
    ``--run: invalid run name ...`` rather than ``Value error, invalid run name ...``."""
    first = err.errors()[0]
    message = str(first["msg"]).removeprefix("Value error, ")
    if first["type"] == "string_pattern_mismatch":
        message = "use printable characters only (no tabs, newlines or other control characters)"
    names = [str(part) for part in first["loc"]]
    option = {"expires_in_seconds": "expires-in"}.get(names[0], names[0]) if names else None
    return f"--{option}: {message}" if option else message


def _list(args: argparse.Namespace) -> int:
    from service.auth.service import list_tokens

    context = open_context()
    try:
        tokens = list_tokens(context)
    finally:
        context.close()
    if args.json:
        import json

        print(json.dumps([token.model_dump(mode="json") for token in tokens], indent=2))
    else:
        print(format_tokens(tokens))
    return 0


def format_tokens(tokens: Sequence[TokenOut]) -> str:
    """The tokens as a table, oldest first; no secrets (a ``TokenOut`` holds none)."""
    if not tokens:
        return "no tokens (create one with 'ckpt token create')"
    now = datetime.now(UTC)
    rows: list[tuple[str, ...]] = [("ID", "NAME", "ROLE", "RUN", "CREATED", "EXPIRES", "REVOKED")]
    rows += [
        (
            str(token.id),
            token.name,
            str(token.role),
            token.run or "-",
            _when(token.created_at),
            _expiry(token.expires_at, now=now),
            _when(token.revoked_at),
        )
        for token in tokens
    ]
    return table(rows)


def _expiry(moment: datetime | None, *, now: datetime) -> str:
    """When a token expires: ``never``, a time, or a time marked ``(expired)``."""
    if moment is None:
        return "never"
    return _when(moment) + (" (expired)" if moment <= now else "")


def _when(moment: datetime | None) -> str:
    """A catalog time in UTC (a naive one already is)."""
    if moment is None:
        return "-"
    return f"{moment.astimezone(UTC) if moment.tzinfo else moment:%Y-%m-%d %H:%M:%S}"


def _revoke(args: argparse.Namespace) -> int:
    from service.auth.service import revoke_token
    from service.errors import NotFoundError

    context = open_context()
    try:
        token = revoke_token(context, token_id=args.id)
    except NotFoundError:
        print(
            f"ckpt token revoke: no token has id {args.id} (see 'ckpt token list')", file=sys.stderr
        )
        return 1
    finally:
        context.close()
    scope = f" for run {token.run}" if token.run else ""
    print(
        f"revoked {token.role} token {token.id} ({token.name}){scope} at {_when(token.revoked_at)} UTC"
    )
    return 0
