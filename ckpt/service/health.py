"""Probes and metrics: ``/healthz`` (the process), ``/readyz`` (its dependencies), ``/metrics``."""

from __future__ import annotations

from fastapi import APIRouter, Response
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from ckpt.service.context import Context
from ckpt.service.db import ping, schema_revision
from ckpt.service.deps import ContextDep

router = APIRouter(tags=["health"])


@router.get("/healthz")
def healthz() -> dict[str, str]:
    """The process is up (no dependency is checked: a liveness probe)."""
    return {"status": "ok"}


@router.get("/readyz", response_model=None)
async def readyz(context: ContextDep) -> JSONResponse:
    """The database answers, its schema is at the migrations' head, the store answers."""
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
        checks.setdefault("database", f"unreachable: {type(err).__name__}: {err}")
        checks.setdefault("schema", "unknown")
    try:
        context.store.size("healthz/probe")
        checks["store"] = "ok"
    except Exception as err:
        checks["store"] = f"unreachable: {type(err).__name__}: {err}"
    return checks


@router.get("/metrics", response_class=Response)
def metrics(context: ContextDep) -> Response:
    """Prometheus metrics of this process."""
    return Response(generate_latest(context.metrics.registry), media_type=CONTENT_TYPE_LATEST)
