"""The FastAPI application: routers (the API; the dashboard under ``/ui/``), the error
handlers (one JSON body for every error), body limits, metrics, the interactive API page (Swagger UI, served from the package), and the
periodic tasks: garbage collection, the scrubber and marking lost attempts."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from anyio import CapacityLimiter
from fastapi import FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy.exc import DataError, DBAPIError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ckpt.core.version import __version__
from service.apidocs import serve_docs
from service.auth.endpoints import router as tokens_router
from service.bulk import not_json
from service.bulk_process import BulkProcess, ForwardBulk
from service.bundles.endpoints import router as bundles_router
from service.context import Context
from service.db import upgrade
from service.errors import (
    DatabaseUnavailableError,
    InvalidRequestError,
    PayloadTooLargeError,
    RetryError,
    ServiceError,
)
from service.events.endpoints import router as events_router
from service.gc.endpoints import router as gc_router
from service.health import router as health_router
from service.limits import Limits, token_limits
from service.logsafe import protect
from service.metrics import Metrics, process_exited
from service.periodic import Periodic, periodic_tasks, run_once
from service.runs.endpoints import router as runs_router
from service.scrub.endpoints import router as scrub_router
from service.settings import MULTIPROCESS_DIR, Settings, embedded_admin_token
from service.ui.endpoints import install as install_dashboard
from service.yielding import BulkTurns, MarkPriority, PriorityGate

log = logging.getLogger("ckpt.service")


def create_app(settings: Settings | None = None, *, context: Context | None = None) -> FastAPI:
    """The control plane for ``settings`` (default: from ``CKPT_*`` variables)."""
    settings = settings or (context.settings if context else Settings.from_env())
    if settings.migrate_at_start:
        upgrade(settings.database_url)
    context = context or Context.create(settings)
    protect()  # no client text forges a log line
    admin_token = embedded_admin_token(settings) if settings.embedded else settings.admin_token
    bulk = _bulk_process(settings, context)

    app = FastAPI(
        title="ckpt control plane",
        version=__version__,
        summary="Catalog, completeness, fencing and lineage of bit-exact training checkpoints",
        lifespan=_lifespan(settings, context, bulk),
        docs_url=None,  # served by serve_docs, from the package's own Swagger UI
        redoc_url=None,
    )
    app.state.context = context
    app.state.admin_token = admin_token
    app.state.priority_threads = CapacityLimiter(settings.priority_threads)  # deps.Priority
    for router in (
        health_router,
        runs_router,
        bundles_router,
        events_router,
        tokens_router,
        gc_router,
        scrub_router,
    ):
        app.include_router(router)
    serve_docs(app)  # /docs: Swagger UI, from the package
    install_dashboard(app)  # /ui/: the lineage dashboard, and / redirecting there
    _handle_errors(app)
    gate = PriorityGate()
    if settings.bulk_concurrency:  # innermost: a request's latency counts its wait
        app.add_middleware(
            BulkTurns,
            concurrency=settings.bulk_concurrency,
            metrics=context.metrics,
            gate=gate,
            yield_seconds=settings.bulk_yield_seconds,
        )
    app.add_middleware(_CountRequests, metrics=context.metrics)
    if bulk is not None:  # outside the counts: the bulk process counts what it serves
        app.add_middleware(ForwardBulk, bulk=bulk)
    app.add_middleware(_BodyLimit, max_bytes=settings.max_body_bytes)
    if settings.bulk_concurrency:  # a priority request is in flight from its admission
        app.add_middleware(MarkPriority, gate=gate)
    # Outermost: a request over its token's limits is refused before its body is read.
    app.add_middleware(Limits, limits=token_limits(settings), metrics=context.metrics)
    return app


def from_environment() -> FastAPI:
    """The app of one of several server processes (``CKPT_WORKERS``): uvicorn's factory."""
    from service.health import steady_process

    app = create_app(Settings.from_env())
    steady_process()  # after the app is built: see its docstring
    return app


def _bulk_process(settings: Settings, context: Context) -> BulkProcess | None:
    """The bulk process to forward bulk requests to, where there is one: on PostgreSQL
    (``CKPT_BULK_PROCESS``), under ``ckpt server``, whose metrics directory lets it count
    what it serves into the same ``/metrics``."""
    if not settings.bulk_in_own_process or not os.environ.get(MULTIPROCESS_DIR):
        return None
    return BulkProcess(settings, context.metrics)


def _lifespan(
    settings: Settings, context: Context, bulk: BulkProcess | None
) -> Callable[[FastAPI], contextlib.AbstractAsyncContextManager[None]]:
    """The periodic tasks, started with the app and stopped with it."""

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        stop = asyncio.Event()
        halt = threading.Event()  # ends a long pass (the scrubber's) in its worker thread
        inline = settings.maintenance == "inline"  # else ``ckpt worker`` runs them
        tasks = [
            asyncio.create_task(_periodically(task, context, stop=stop))
            for task in (periodic_tasks(settings, halt=halt) if inline else [])
        ]
        if bulk is not None:
            tasks.append(asyncio.create_task(bulk.supervise(stop)))
        try:
            yield
        finally:
            # Let a pass in flight finish: its thread would outlive a cancelled task and
            # keep using the database after the app is gone.
            stop.set()
            halt.set()
            await asyncio.gather(*tasks)
            process_exited(os.getpid())  # its gauges leave the sums of several workers

    return lifespan


async def _periodically(task: Periodic, context: Context, *, stop: asyncio.Event) -> None:
    """Run ``task`` in a worker thread every ``task.every`` seconds until ``stop``."""
    while True:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=task.every)
        if stop.is_set():
            return
        await run_in_threadpool(run_once, task, context)


def _handle_errors(app: FastAPI) -> None:
    """Every error leaves as the same JSON body: ``{"error": code, "message": ...}``."""
    app.exception_handler(ServiceError)(_service_error)
    app.exception_handler(RequestValidationError)(_invalid)
    app.exception_handler(DBAPIError)(_database_error)
    app.exception_handler(StarletteHTTPException)(_http_error)


async def _service_error(_: Request, err: ServiceError) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if err.status == 401 else None
    return JSONResponse(err.body(), status_code=err.status, headers=headers)


async def _invalid(_: Request | None, err: RequestValidationError) -> JSONResponse:
    problems = [_describe(problem) for problem in err.errors()]
    return JSONResponse(
        {
            "error": "invalid_request",
            "message": "; ".join(problems) or "invalid request",
            "problems": problems,
        },
        status_code=422,
    )


async def _database_error(_: Request, err: DBAPIError) -> JSONResponse:
    if isinstance(err, DataError):  # a value the database cannot store
        body = InvalidRequestError(f"the database refused a value: {err.orig}").body()
        return JSONResponse(body, status_code=422)
    if _retryable(err):
        log.warning("database aborted a request, the client will retry: %s", err.orig)
        retry = RetryError(
            "the database aborted this request (a conflict, or a connection lost); retry it"
        )
        return JSONResponse(retry.body(), status_code=retry.status, headers={"Retry-After": "1"})
    log.error("database error", exc_info=err)
    failed = DatabaseUnavailableError("the catalog database failed; see the server log")
    return JSONResponse(failed.body(), status_code=failed.status)


async def _http_error(_: Request, err: StarletteHTTPException) -> JSONResponse:
    if err.status_code == 400 and isinstance(err.__cause__, ValueError | RecursionError):
        # FastAPI's answer to a body it cannot decode as JSON beyond a syntax error (bytes
        # that are not UTF-8, nesting deeper than the parser goes): malformed JSON like any
        # other, so the same 422 (docs/rest-api.md).
        return await _invalid(None, not_json(err.__cause__))
    code = {
        404: "not_found",
        405: "method_not_allowed",
        413: PayloadTooLargeError.code,
    }.get(err.status_code, "http_error")
    return JSONResponse(
        {"error": code, "message": str(err.detail)},
        status_code=err.status_code,
        headers=getattr(err, "headers", None),
    )


def _retryable(err: DBAPIError) -> bool:
    """A deadlock or serialization failure (Postgres), a busy database (SQLite), or a pooled
    connection found dead by its first statement (the pool is renewed: a retry finds it)."""
    code = getattr(err.orig, "sqlstate", None)
    return (
        code in ("40P01", "40001")
        or "database is locked" in str(err.orig)
        or err.connection_invalidated
    )


def _describe(problem: Any) -> str:
    where = ".".join(str(part) for part in problem.get("loc", ()))
    return f"{where}: {problem.get('msg', 'invalid')}"


class _CountRequests:
    """Requests by route template and status, and their latency, into the metrics. Plain
    ASGI: Starlette's ``BaseHTTPMiddleware`` (``@app.middleware``) ran each request in a
    task group of its own with streams between them, a cost every request paid."""

    def __init__(self, app: ASGIApp, *, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        method = scope["method"]

        async def sending(message: Message) -> None:
            if message["type"] == "http.response.start":
                # Counted before a byte of the answer leaves: a client that has read it and
                # then scrapes /metrics (through another worker, say) finds it counted.
                template = getattr(scope.get("route"), "path", "unmatched")
                self.metrics.requests.labels(method, template, str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, sending)
        template = getattr(scope.get("route"), "path", "unmatched")
        self.metrics.latency.labels(method, template).observe(time.perf_counter() - started)


class _BodyLimit:
    """413 for a body over the limit, whether it declares its length or streams chunks.

    The body is read (FastAPI reads it whole anyway) before the app sees the request, so a
    refusal happens before anything runs.
    """

    def __init__(self, app: ASGIApp, *, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._refuse(send)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                await self.app(scope, _replay([], message, receive), send)
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                await self._refuse(send)
                return
            if not message.get("more_body", False):
                break
        await self.app(scope, _replay(chunks, None, receive), send)

    async def _refuse(self, send: Send) -> None:
        body = PayloadTooLargeError(
            f"the request body exceeds {self.max_bytes} bytes (CKPT_MAX_BODY_BYTES)"
        ).body()
        await JSONResponse(body, status_code=413)({"type": "http"}, _disconnected, send)


def _replay(chunks: list[bytes], last: Message | None, original: Receive) -> Receive:
    """A receive that hands the app the buffered body, then waits on the original."""
    messages: list[Message] = (
        [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]
        if last is None
        else [last]
    )

    async def receive() -> Message:
        return messages.pop(0) if messages else await original()

    return receive


async def _disconnected() -> Message:
    return {"type": "http.disconnect"}
