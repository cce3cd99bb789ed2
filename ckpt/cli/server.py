"""``ckpt server``, ``worker``, ``migrate``, ``gc``, ``scrub`` and ``catalog rebuild``:
running the control plane and maintaining its catalog."""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import tempfile
from collections.abc import Iterator
from typing import TYPE_CHECKING

from ckpt.cli.config import (
    CATALOG,
    Commands,
    add_command,
    add_group,
    open_context,
    redact,
    settings,
)
from ckpt.core.version import __version__
from service.bulk_child import exit_on_signal
from service.settings import KEEP_ALIVE_SECONDS, MULTIPROCESS_DIR

if TYPE_CHECKING:
    from service.settings import Settings

SERVER = """
    Run the control plane: the REST API through which training jobs register attempts
    and commit bundles, and which answers where a run resumes. It also collects garbage
    every CKPT_GC_INTERVAL_SECONDS (default 600) and re-reads stored blobs (the scrubber)
    every CKPT_SCRUB_INTERVAL_SECONDS (default 3600).

    With nothing configured it is the embedded default: a SQLite catalog in
    ./.ckpt/catalog.db, the directory store ./.ckpt/store, and an admin token it
    generates into ./.ckpt/admin-token. For a shared deployment set CKPT_DATABASE_URL
    (postgresql+psycopg://...), CKPT_STORE (a directory, or s3://bucket/prefix with
    CKPT_S3_ENDPOINT for MinIO) and CKPT_ADMIN_TOKEN.

    Prints its address, the catalog, the store and where the admin token is, then serves
    until stopped.
"""

WORKER = f"""
    Run the control plane's periodic tasks in a process of their own: marking lost
    attempts (every min(30, CKPT_LOST_AFTER_SECONDS / 2) s), garbage collection (every
    CKPT_GC_INTERVAL_SECONDS) and the scrubber (every CKPT_SCRUB_INTERVAL_SECONDS), for
    servers started with CKPT_MAINTENANCE=worker, which then run none of them: a long GC
    pass over a large catalog no longer takes interpreter time from the API's requests.
    One worker is enough; more are safe (one pass of each task runs at a time). {CATALOG}

    Runs until SIGTERM or SIGINT, letting a pass in flight end (the scrubber's early).
"""

MIGRATE = f"""
    Upgrade the catalog's schema to --revision (default: the newest). {CATALOG}

    The embedded SQLite catalog upgrades itself when the server starts; a shared
    PostgreSQL catalog does not (CKPT_AUTO_MIGRATE is off for it), so run this once per
    release before starting the servers. Prints the revision reached.
"""

GC = f"""
    Collect garbage once, now: fail bundles pending for longer than
    CKPT_PENDING_TTL_SECONDS, delete the bundles each run's retention policy lets go
    (CKPT_KEEP_LAST and CKPT_KEEP_EVERY for runs that set none), and delete from the store
    (CKPT_STORE) the blobs no bundle references once CKPT_BLOB_GRACE_SECONDS have passed.
    {CATALOG}

    A running server does the same every CKPT_GC_INTERVAL_SECONDS. Prints the report as
    JSON (failed_bundles, deleted_bundles, deleted_blobs, deleted_bytes, young_blobs).
"""

SCRUB = f"""
    Scrub once, now: re-read and re-hash the blobs of every run's resumable bundle, then of
    the other complete bundles, newest first, at CKPT_SCRUB_BYTES_PER_SECOND (0: as fast
    as the store answers). A blob found absent or damaged is marked so in the catalog and
    every complete bundle using it is quarantined: the run resumes from the newest bundle
    that is still whole, and its next save writes the blob again. A store that fails to
    answer ends the pass and quarantines nothing. {CATALOG}

    A running server does the same every CKPT_SCRUB_INTERVAL_SECONDS; one pass runs at a
    time across replicas. Prints the report as JSON (bundles, blobs, bytes, damaged,
    quarantined); exits 1 if the store failed.
"""

CATALOG_GROUP = "Maintain the catalog of runs and bundles. " + CATALOG

REBUILD = f"""
    Recreate the catalog from the store (CKPT_STORE): every manifest found there becomes
    a run and a complete bundle again, with its lineage; a bundle whose blobs are missing
    from the store is added as failed. Bundles already in the catalog are kept. For a lost
    or damaged database. {CATALOG}

    Prints the report as JSON (runs, added, failed, skipped, unreadable).
"""


def add_commands(commands: Commands) -> None:
    """``server``, ``migrate``, ``gc`` and ``scrub``."""
    server = add_command(
        commands,
        "server",
        summary="run the control plane (embedded default: SQLite + ./.ckpt/store)",
        description=SERVER,
    )
    server.add_argument("--host", help="listen address (CKPT_HOST, default 127.0.0.1)")
    server.add_argument("--port", type=int, help="port (CKPT_PORT, default 8470)")
    server.add_argument(
        "--workers", type=int, help="processes serving the API (CKPT_WORKERS, default 1)"
    )
    server.set_defaults(handler=_server)

    worker = add_command(
        commands,
        "worker",
        summary="run GC, the scrubber and the lost-attempt check apart from the servers",
        description=WORKER,
    )
    worker.set_defaults(handler=_worker)

    migrate = add_command(
        commands,
        "migrate",
        summary="upgrade the catalog schema (CKPT_DATABASE_URL)",
        description=MIGRATE,
    )
    migrate.add_argument("--revision", default="head", help="target revision (default: head)")
    migrate.set_defaults(handler=_migrate)

    gc = add_command(
        commands,
        "gc",
        summary="apply retention and delete unreferenced blobs now",
        description=GC,
    )
    gc.add_argument("--dry-run", action="store_true", help="report what would go; change nothing")
    gc.set_defaults(handler=_gc)

    scrub = add_command(
        commands,
        "scrub",
        summary="re-read stored blobs now; quarantine bundles with a damaged one",
        description=SCRUB,
    )
    scrub.set_defaults(handler=_scrub)


def add_catalog_commands(commands: Commands) -> None:
    """``catalog rebuild``."""
    actions = add_group(
        commands, "catalog", summary="maintain the catalog", description=CATALOG_GROUP
    )
    rebuild = add_command(
        actions,
        "rebuild",
        summary="recreate missing runs and bundles from the manifests in the store",
        description=REBUILD,
    )
    rebuild.set_defaults(handler=_catalog_rebuild)


WORKER_HEALTHCHECK_SECONDS = 30


def _server(args: argparse.Namespace) -> int:
    current = settings(host=args.host, port=args.port, workers=args.workers)
    port_free(current.host, current.port)  # before the catalog, the store or a token is made
    # Several processes (workers, a bulk process beside each) count into one /metrics: the
    # directory is named before prometheus_client is imported.
    shared = current.workers > 1 or current.bulk_in_own_process
    with worker_metrics() if shared else contextlib.nullcontext():
        _serve(current)
    return 0


def _serve(current: Settings) -> None:
    import logging

    import uvicorn

    from service.app import create_app
    from service.health import steady_process

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    logging.getLogger("alembic.runtime.plugins").setLevel(logging.WARNING)
    app = create_app(current)
    steady_process()  # after the app is built: see its docstring
    print(f"ckpt control plane {__version__} on http://{current.host}:{current.port}", flush=True)
    print(f"  catalog: {redact(current.database_url)}", flush=True)
    print(f"  store:   {app.state.context.store.url}", flush=True)
    if current.embedded and not current.admin_token:
        print(f"  admin token: in {current.admin_token_file}", flush=True)
    if current.bulk_in_own_process:
        print("  bulk requests: in a process of their own beside each worker", flush=True)
    if current.workers == 1:
        uvicorn.run(
            app,
            host=current.host,
            port=current.port,
            log_level="warning",
            timeout_keep_alive=KEEP_ALIVE_SECONDS,
        )
        return
    # Each process builds its own app from the same settings (the checks above ran once).
    app.state.context.close()
    print(f"  workers: {current.workers} processes", flush=True)
    _serve_workers(current)


def _serve_workers(current: Settings) -> None:
    import uvicorn

    uvicorn.run(
        "service.app:from_environment",
        factory=True,
        workers=current.workers,
        host=current.host,
        port=current.port,
        # The supervisor says at info when a worker died and was replaced; requests are not
        # logged one by one.
        log_level="info",
        access_log=False,
        # The supervisor SIGKILLs a worker that does not answer its ping in time, with the
        # requests it holds. Uvicorn's 5 s is short on a saturated host, where a worker that
        # is only slow would be killed mid-request; a hung worker is the liveness probe's.
        timeout_worker_healthcheck=WORKER_HEALTHCHECK_SECONDS,
        timeout_keep_alive=KEEP_ALIVE_SECONDS,
    )


@contextlib.contextmanager
def worker_metrics() -> Iterator[None]:
    """A fresh directory for the server processes' metrics (``service.metrics``), named in
    ``PROMETHEUS_MULTIPROC_DIR`` before they import prometheus_client (which reads it
    then: this process's too), and removed with what they wrote when the server stops: a
    count of an earlier server must never add to this one's."""
    with tempfile.TemporaryDirectory(prefix="ckpt-metrics-") as directory:
        os.environ[MULTIPROCESS_DIR] = directory
        # Uvicorn stops on SIGTERM and then raises it again with the handler it found: the
        # default one would end the process here, the directory left behind.
        previous = signal.signal(signal.SIGTERM, exit_on_signal)
        try:
            yield
        finally:
            signal.signal(signal.SIGTERM, previous)
            del os.environ[MULTIPROCESS_DIR]


def port_free(host: str, port: int) -> None:
    """Exit with what to change when ``host:port`` cannot be listened on (another process
    holds it), rather than after the catalog and the store were set up."""
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            probe.bind((host, port))
        except OSError as err:
            raise SystemExit(
                f"ckpt server: cannot listen on {host}:{port}: {err.strerror}; stop what holds "
                "it or choose another port (--port or CKPT_PORT)"
            ) from None


def _worker(_: argparse.Namespace) -> int:
    import logging
    import signal
    import threading

    from service.periodic import work_until

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    context = open_context()
    stop = threading.Event()
    for caught in (signal.SIGTERM, signal.SIGINT):
        signal.signal(caught, lambda *_: stop.set())
    print(f"ckpt worker {__version__}: catalog {redact(context.settings.database_url)}", flush=True)
    try:
        work_until(context, stop)
    finally:
        context.close()
    return 0


def _migrate(args: argparse.Namespace) -> int:
    from service.db import upgrade

    current = settings()
    upgrade(current.database_url, args.revision)
    print(f"catalog {redact(current.database_url)} is at {args.revision}")
    return 0


def _gc(args: argparse.Namespace) -> int:
    from service.gc.service import collect

    context = open_context()
    try:
        report = collect(context, dry_run=args.dry_run)
    finally:
        context.close()
    print(report.model_dump_json(indent=2))
    return 0


def _scrub(_: argparse.Namespace) -> int:
    import sys

    from service.errors import StoreUnavailableError
    from service.scrub.service import scrub

    context = open_context()
    try:
        report = scrub(context)
    except StoreUnavailableError as err:
        print(f"ckpt scrub: {err.message}", file=sys.stderr)
        return 1
    finally:
        context.close()
    print(report.model_dump_json(indent=2))
    return 0


def _catalog_rebuild(_: argparse.Namespace) -> int:
    from service.rebuild import rebuild

    context = open_context()
    try:
        report = rebuild(context)
    finally:
        context.close()
    print(report.model_dump_json(indent=2))
    return 0
