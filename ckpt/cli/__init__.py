"""The ``ckpt`` command.

Each subcommand imports what it needs when it runs, so the command works in a training
image (no FastAPI) and in a control-plane image (no torch) alike.

    ckpt demo                      train, kill, resume, compare (needs the agent extra)
    ckpt launch -- COMMAND...      run a trainer, restart it after a preemption or a crash
    ckpt server | migrate | gc     run the control plane, upgrade its schema, collect garbage
    ckpt token create              mint a bearer token in the catalog
    ckpt catalog rebuild           recreate the catalog from the manifests in the store
    ckpt runs | resumable | bundle ask a running control plane (CKPT_SERVER, CKPT_TOKEN)
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from ckpt.core.version import __version__
from ckpt.service.settings import Settings

if TYPE_CHECKING:
    from ckpt.service.context import Context

Handler = Callable[[argparse.Namespace], int]


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``ckpt`` command line; returns the exit code."""
    parser = argparse.ArgumentParser(
        prog="ckpt", description="Bit-exact checkpoints for PyTorch training."
    )
    parser.add_argument("--version", action="version", version=f"ckpt {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    commands.add_parser(
        "demo",
        add_help=False,
        help="train, kill, resume in a new process, and check the result is bit-exact",
    )
    commands.add_parser(
        "launch",
        add_help=False,
        help="run a training command; restart it after a preemption or a crash",
    )
    _add_server_commands(commands)
    _add_client_commands(commands)
    args, rest = parser.parse_known_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    if args.command == "demo":
        try:
            from ckpt.agent.demo.run import main as demo
        except ImportError as err:
            parser.exit(
                2, f"ckpt demo needs the training extra: pip install 'ckpt[agent]' ({err})\n"
            )
        return demo(rest)
    if args.command == "launch":
        from ckpt.agent.launch import main as launch

        return launch(rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    handler: Handler | None = getattr(args, "handler", None)
    if handler is None:  # a command group without its subcommand
        parser.parse_args([args.command, "--help"])
        return 2
    try:
        return handler(args)
    except ImportError as err:
        parser.exit(
            2, f"ckpt {args.command} needs the server extra: pip install 'ckpt[server]' ({err})\n"
        )


def _add_server_commands(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    server = commands.add_parser(
        "server", help="run the control plane (embedded default: SQLite + ./.ckpt/store)"
    )
    server.add_argument("--host", help="listen address (CKPT_HOST, default 127.0.0.1)")
    server.add_argument("--port", type=int, help="port (CKPT_PORT, default 8470)")
    server.set_defaults(handler=_server)

    migrate = commands.add_parser("migrate", help="upgrade the catalog schema (CKPT_DATABASE_URL)")
    migrate.add_argument("--revision", default="head", help="target revision (default: head)")
    migrate.set_defaults(handler=_migrate)

    gc = commands.add_parser("gc", help="apply retention and delete unreferenced blobs now")
    gc.add_argument("--dry-run", action="store_true", help="report what would go; change nothing")
    gc.set_defaults(handler=_gc)

    token = commands.add_parser("token", help="manage bearer tokens").add_subparsers(
        dest="token_command", metavar="ACTION"
    )
    create = token.add_parser("create", help="create a token in the catalog and print it once")
    create.add_argument("--role", required=True, choices=["admin", "run", "read"])
    create.add_argument("--run", help="the run a 'run' token may read and write")
    create.add_argument("--name", default="cli", help="a label shown in listings")
    create.set_defaults(handler=_token_create)

    catalog = commands.add_parser("catalog", help="maintain the catalog").add_subparsers(
        dest="catalog_command", metavar="ACTION"
    )
    rebuild = catalog.add_parser(
        "rebuild", help="recreate missing runs and bundles from the manifests in the store"
    )
    rebuild.set_defaults(handler=_catalog_rebuild)

    verify = commands.add_parser(
        "verify", help="read a bundle's blobs back from the store and check every SHA-256"
    )
    verify.add_argument("run")
    verify.add_argument("--step", type=int, help="the bundle's step (default: the newest)")
    verify.add_argument("--store", help="the store (CKPT_STORE, default ./.ckpt/store)")
    verify.set_defaults(handler=_verify)


def _add_client_commands(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--server", help="control plane URL (CKPT_SERVER, default http://127.0.0.1:8470)"
    )
    common.add_argument("--token", help="bearer token (CKPT_TOKEN, else ./.ckpt/admin-token)")
    common.add_argument("--json", action="store_true", help="print the raw JSON answer")

    runs = commands.add_parser("runs", parents=[common], help="list runs and their heads")
    runs.add_argument("--prefix", help="only runs whose name starts with this")
    runs.add_argument("--limit", type=int, default=50)
    runs.add_argument("--after", help="start after this run name (the previous page's end)")
    runs.set_defaults(handler=_runs)

    resumable = commands.add_parser(
        "resumable", parents=[common], help="the latest resumable bundle of a run"
    )
    resumable.add_argument("run")
    resumable.set_defaults(handler=_resumable)

    bundle = commands.add_parser("bundle", parents=[common], help="one bundle and its layers")
    bundle.add_argument("id", type=int)
    bundle.set_defaults(handler=_bundle)


def _settings(**overrides: object) -> Settings:
    try:
        return Settings.from_env(**overrides)
    except ValueError as err:
        raise SystemExit(f"ckpt: bad configuration: {err}") from None


def _server(args: argparse.Namespace) -> int:
    import logging

    import uvicorn

    from ckpt.service.app import create_app

    settings = _settings(host=args.host, port=args.port)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    logging.getLogger("alembic.runtime.plugins").setLevel(logging.WARNING)
    app = create_app(settings)
    where = f"http://{settings.host}:{settings.port}"
    print(f"ckpt control plane {__version__} on {where}", flush=True)
    print(f"  catalog: {_redact(settings.database_url)}", flush=True)
    print(f"  store:   {app.state.context.store.url}", flush=True)
    if settings.embedded and not settings.admin_token:
        print(f"  admin token: in {settings.admin_token_file}", flush=True)
    uvicorn.run(app, host=settings.host, port=settings.port, log_level="warning")
    return 0


def _redact(url: str) -> str:
    from sqlalchemy import make_url

    return make_url(url).render_as_string(hide_password=True)


def _migrate(args: argparse.Namespace) -> int:
    from ckpt.service.db import upgrade

    settings = _settings()
    upgrade(settings.database_url, args.revision)
    print(f"catalog {_redact(settings.database_url)} is at {args.revision}")
    return 0


def _context() -> Context:
    from ckpt.service.context import Context
    from ckpt.service.db import upgrade

    settings = _settings()
    if settings.migrate_at_start:
        upgrade(settings.database_url)
    return Context.create(settings)


def _gc(args: argparse.Namespace) -> int:
    from ckpt.service.gc.service import collect

    context = _context()
    try:
        report = collect(context, dry_run=args.dry_run)
    finally:
        context.close()
    print(report.model_dump_json(indent=2))
    return 0


def _token_create(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from ckpt.service.auth.schemas import TokenCreate
    from ckpt.service.auth.service import create_token

    try:
        request = TokenCreate(role=args.role, run=args.run, name=args.name)
    except ValidationError as err:
        raise SystemExit(f"ckpt token create: {err.errors()[0]['msg']}") from None
    context = _context()
    try:
        created = create_token(context, request)
    finally:
        context.close()
    scope = f" for run {created.run}" if created.run else ""
    print(f"created {created.role} token {created.id} ({created.name}){scope}:", file=sys.stderr)
    print(created.token)
    return 0


def _catalog_rebuild(_: argparse.Namespace) -> int:
    from ckpt.service.rebuild import rebuild

    context = _context()
    try:
        report = rebuild(context)
    finally:
        context.close()
    print(report.model_dump_json(indent=2))
    return 0


def _verify(args: argparse.Namespace) -> int:
    from ckpt.core.progress import Progress
    from ckpt.core.storage import open_store
    from ckpt.core.storage.keys import blob_key
    from ckpt.core.verify import find_manifest, verify

    store = open_store(args.store or _settings().store)
    try:
        manifest = find_manifest(store, args.run, step=args.step)
    except (LookupError, ValueError) as err:
        print(f"ckpt verify: {err}", file=sys.stderr)
        return 2
    blobs = {b.sha256: b.size for r in manifest.ranks for x in r.layers.values() for b in x.blobs}
    progress = Progress(f"verifying {args.run} step {manifest.step}", sum(blobs.values()))
    try:
        report = verify(store, manifest, progress=progress.advance)
    finally:
        progress.close()
    for sha256, problem in sorted(report.bad.items()):
        print(f"BAD  {blob_key(sha256)}: {problem}")
    verdict = "intact" if not report.bad else f"{len(report.bad)} bad blob(s)"
    print(f"{report.bundle}: {report.blobs} blobs, {report.bytes} bytes, {verdict}")
    return 0 if not report.bad else 1


def _runs(args: argparse.Namespace) -> int:
    from ckpt.cli.ask import format_runs

    params: dict[str, object] = {"limit": args.limit}
    for name in ("prefix", "after"):
        if getattr(args, name):
            params[name] = getattr(args, name)
    return _ask(args, "/v1/runs", params, format_runs)


def _resumable(args: argparse.Namespace) -> int:
    from ckpt.cli.ask import format_resumable

    return _ask(args, f"/v1/runs/{args.run}/resumable", {}, format_resumable)


def _bundle(args: argparse.Namespace) -> int:
    from ckpt.cli.ask import format_bundle

    return _ask(args, f"/v1/bundles/{args.id}", {}, format_bundle)


def _ask(
    args: argparse.Namespace,
    path: str,
    params: dict[str, object],
    formatter: Callable[[dict[str, object]], str],
) -> int:
    from ckpt.cli.ask import get

    status, body = get(server=args.server, token=args.token, path=path, params=params)
    if status >= 400:
        print(f"ckpt: {status}: {body.get('message', body)}", file=sys.stderr)
        return 1
    print(_json(body) if args.json else formatter(body))
    return 0


def _json(body: object) -> str:
    import json

    return json.dumps(body, indent=2)


if __name__ == "__main__":
    sys.exit(main())
