"""Probes and metrics: ``/healthz`` (the process), ``/readyz`` (its dependencies), ``/metrics``."""

from __future__ import annotations

import gc
import logging
import sys

from fastapi import APIRouter, Response
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from service.context import Context
from service.db import ping, schema_revision
from service.deps import ContextDep
from service.metrics import CONTENT_TYPE, exposition

log = logging.getLogger("ckpt.service")
router = APIRouter(tags=["health"])


class Readiness(BaseModel):
    """The answer of ``/readyz``."""

    status: str = Field(description="'ready' or 'not ready'")
    checks: dict[str, str] = Field(
        description="each dependency ('database', 'schema', 'store'): 'ok', or what is wrong"
    )


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    """The process is up (no dependency is checked: a liveness probe).

    ``async``: it answers on the event loop, never queued behind the worker threads that
    serve the catalog, so a flood of slow requests cannot make the process look dead.
    """
    return {"status": "ok"}


@router.get(
    "/readyz",
    response_model=None,
    responses={
        200: {"model": Readiness, "description": "every check is ok"},
        503: {"model": Readiness, "description": "a check failed: the checks say which"},
    },
)
async def readyz(context: ContextDep) -> JSONResponse:
    """The database answers, its schema is at the migrations' head, the store answers.

    Unauthenticated, so it names the check that failed and never the error (a driver's
    message names hosts and ports): the details go to the server's log.
    """
    checks = await run_in_threadpool(_checks, context)
    ready = all(check == "ok" for check in checks.values())
    return JSONResponse(
        {"status": "ready" if ready else "not ready", "checks": checks},
        status_code=200 if ready else 503,
    )


def _checks(context: Context) -> dict[str, str]:
    checks: dict[str, str] = {}
    try:
        ping(context.engine)
        checks["database"] = "ok"
        current, head = schema_revision(context.engine)
        checks["schema"] = (
            "ok" if current == head else f"at {current}, migrations at {head}: run 'ckpt migrate'"
        )
    except Exception as err:  # the probe reports any failure rather than raising it
        log.warning("readiness: the database is unreachable: %s: %s", type(err).__name__, err)
        checks.setdefault("database", "unreachable")
        checks.setdefault("schema", "unknown")
    try:
        context.store.size("healthz/probe")
        checks["store"] = "ok"
    except Exception as err:
        log.warning("readiness: the store is unreachable: %s: %s", type(err).__name__, err)
        checks["store"] = "unreachable"
    return checks


@router.get(
    "/metrics",
    response_class=Response,
    responses={
        200: {
            "description": "the Prometheus text format",
            "content": {"text/plain": {"schema": {"type": "string"}}},
        }
    },
)
def metrics(context: ContextDep) -> Response:
    """Prometheus metrics of the server: of all its processes, whichever one answers."""
    return Response(exposition(context.metrics), media_type=CONTENT_TYPE)


# How long a thread may hold the GIL while another waits for it (Python's default: 5 ms).
GIL_SLICE_SECONDS = 0.0005


def steady_process() -> None:
    """Keep the garbage collector's pauses and the GIL's turns short, for a long-running
    server process.

    A request of the priority class waits for the GIL at each of its queries; while a bulk
    request runs Python, each wait lasts up to the switch interval: 5 ms by default, 0.5 ms
    here. ``bench/flood.py --probe resumable --mix`` measured ``/resumable``'s p99 under the
    flood at 3.2 and 5.6 times idle with it, 4.7 and 8.5 times without (docs/performance.md).

    A full collection walks every object (the app, its schemas, the ORM: about a million),
    holding the GIL for 50-100 ms: every request then waits, ``/healthz`` included, and a
    request that allocates much (a query of 10,000 blobs) triggers one after another. What
    exists once the app is built lives as long as the process: frozen, collections skip it;
    and the youngest generation is collected every 10,000 allocations rather than 700.
    """
    gc.collect()
    gc.freeze()
    gc.set_threshold(10_000, 50, 100)
    sys.setswitchinterval(GIL_SLICE_SECONDS)
