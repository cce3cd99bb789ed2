"""Per-token limits: a token over its rate gets 429 with Retry-After; a token with too many
expensive requests in flight gets 429 at once; other tokens and the probes are not held up,
and ``/healthz`` answers while every worker thread is busy."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import httpx
import pytest

from service.admission import Head
from service.auth.schemas import TokenCreate
from service.auth.service import create_token
from service.errors import RateLimitedError, TooManyInFlightError
from service.limits import TokenLimits
from service.models import Role
from service.runs import service as runs_service
from tests.service.conftest import MakeServer, Server

WORKER_THREADS = 40  # anyio's default: what FastAPI runs sync routes and dependencies on


@pytest.fixture(params=["postgres", "sqlite"])
def backend(request: pytest.FixtureRequest) -> str:
    name: str = request.param
    return name


def read_token(server: Server, name: str = "reader") -> str:
    return create_token(server.context, TokenCreate(role=Role.READ, name=name)).token


# --- the books, with time passed in ------------------------------------------------------


def test_a_token_bucket_admits_its_burst_then_its_rate() -> None:
    limits = TokenLimits(rate=2.0, burst=3, max_in_flight=0)
    for _ in range(3):
        limits.admit(b"a", now=0.0)
    with pytest.raises(RateLimitedError) as refused:
        limits.admit(b"a", now=0.0)
    assert refused.value.retry_after == 1  # half a second, rounded up to whole seconds
    assert "CKPT_RATE_LIMIT_PER_SECOND" in refused.value.message
    limits.admit(b"b", now=0.0)  # another token has its own bucket
    limits.admit(b"a", now=0.5)  # one request refilled
    with pytest.raises(RateLimitedError):
        limits.admit(b"a", now=0.5)
    for _ in range(3):
        limits.admit(b"a", now=100.0)  # refilled to the burst, not beyond


def test_expensive_requests_in_flight_are_capped_per_token() -> None:
    limits = TokenLimits(rate=0, burst=1, max_in_flight=2)
    limits.enter(b"a", what="GET /lineage", now=0.0)
    limits.enter(b"a", what="GET /lineage", now=0.0)
    with pytest.raises(TooManyInFlightError) as refused:
        limits.enter(b"a", what="GET /lineage", now=0.0)
    assert refused.value.retry_after == 1
    assert "CKPT_MAX_EXPENSIVE_PER_TOKEN" in refused.value.message
    limits.enter(b"b", what="GET /lineage", now=0.0)
    limits.leave(b"a", 1)
    limits.enter(b"a", what="GET /lineage", now=0.0)
    assert limits.in_flight(b"a") == 2


def test_a_token_that_ignores_retry_after_is_answered_slowly() -> None:
    limits = TokenLimits(rate=2.0, burst=1, max_in_flight=1)
    limits.enter(b"a", what="x", now=0.0)
    with pytest.raises(TooManyInFlightError) as first:
        limits.enter(b"a", what="x", now=0.0)
    with pytest.raises(TooManyInFlightError) as impatient:
        limits.enter(b"a", what="x", now=0.5)  # before the Retry-After of the first
    with pytest.raises(TooManyInFlightError) as patient:
        limits.enter(b"a", what="x", now=2.0)  # after the Retry-After of the second
    assert (first.value.pause, impatient.value.pause, patient.value.pause) == (0, 1, 0)
    limits.admit(b"a", now=0.0)
    with pytest.raises(RateLimitedError) as over:
        limits.admit(b"a", now=0.0)
    assert over.value.pause == 1  # over its rate: always answered after a pause


def test_a_large_body_weighs_more_and_the_heaviest_may_run_alone() -> None:
    limits = TokenLimits(rate=0, burst=1, max_in_flight=8)
    query = Head(method="POST", path="/v1/blobs/missing", body_bytes=950_000)  # 10,000 blobs
    assert query.weight == 4
    assert limits.enter(b"a", what="q", now=0.0, weight=query.weight) == 4
    assert limits.enter(b"a", what="q", now=0.0, weight=query.weight) == 4
    with pytest.raises(TooManyInFlightError, match="worth 8 in flight"):
        limits.enter(b"a", what="q", now=0.0)
    limits.leave(b"a", 4)
    limits.leave(b"a", 4)
    huge = Head(method="PUT", path="/v1/bundles/1/layers/0/weights", body_bytes=16 << 20)
    assert limits.enter(b"a", what="record", now=0.0, weight=huge.weight) == 8  # alone
    with pytest.raises(TooManyInFlightError):
        limits.enter(b"a", what="commit", now=0.0)


def test_the_books_forget_idle_tokens() -> None:
    limits = TokenLimits(rate=10.0, burst=5, max_in_flight=1, max_tokens=100)
    limits.enter(b"busy", what="x", now=0.0)
    for i in range(300):
        limits.admit(b"%d" % i, now=float(i))  # each refilled long before the next
    assert len(limits) <= 201  # pruned as it grew; the busy token stays
    assert limits.in_flight(b"busy") == 1


@pytest.mark.parametrize(
    ("method", "path", "size", "expensive"),
    [
        ("POST", "/v1/blobs/missing", 100, False),  # an agent asks about one blob
        ("POST", "/v1/blobs/missing", 1 << 20, True),
        ("POST", "/v1/blobs/missing", None, True),  # streamed: size unknown
        ("POST", "/v1/bundles/12/commit", 20, True),
        ("POST", "/v1/bundles/12/unquarantine", 0, True),
        ("POST", "/v1/gc", 0, True),
        ("POST", "/v1/scrub", 0, True),
        ("GET", "/v1/runs/r/lineage", 0, True),
        ("GET", "/v1/runs/r/events", 0, True),
        ("GET", "/v1/bundles/3/events", 0, True),
        ("PUT", "/v1/bundles/3/layers/0/weights", 5_000, False),
        ("PUT", "/v1/bundles/3/layers/0/weights", 1 << 20, True),  # any large body
        ("GET", "/v1/runs/r", 0, False),
        ("POST", "/v1/attempts/1/heartbeat", 12, False),
    ],
)
def test_what_counts_as_expensive(
    method: str, path: str, size: int | None, expensive: bool
) -> None:
    assert Head(method=method, path=path, body_bytes=size).expensive is expensive


# --- over HTTP -----------------------------------------------------------------------------


def test_a_token_over_its_rate_gets_429_with_retry_after(
    backend: str, make_server: MakeServer
) -> None:
    # A bucket of 3 that refills once in 1000 s: the 4th request is over, whatever the timing.
    server = make_server(backend, rate_limit_per_second=0.001, rate_limit_burst=3)
    token = read_token(server)
    with server.client(token) as client:
        answers = [client.get("/v1/runs").status_code for _ in range(3)]
        over = client.get("/v1/runs")
        probes = [client.get(path).status_code for path in ("/healthz", "/readyz") * 3]
    with server.client() as admin:  # another token: its own bucket
        assert admin.get("/v1/runs").status_code == 200
    with httpx.Client(
        timeout=60, base_url=server.url
    ) as anonymous:  # no token: refused, not limited
        assert {anonymous.get("/v1/runs").status_code for _ in range(5)} == {401}
    assert answers == [200, 200, 200]
    assert over.status_code == 429, over.text
    assert over.json()["error"] == "rate_limited"
    assert over.json()["retry_after"] == int(over.headers["retry-after"]) == 1000
    assert "CKPT_RATE_LIMIT_PER_SECOND" in over.json()["message"]
    assert probes == [200] * 6


@contextmanager
def blocked_lineage(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[int], None]]:
    """``GET /lineage`` blocks in its worker thread until the block ends; yields a function
    that waits until ``n`` such requests are blocked."""
    release = threading.Event()
    entered = threading.Condition()
    count = [0]
    real = runs_service.get_lineage

    def blocking(*args: Any, **kwargs: Any) -> Any:
        with entered:
            count[0] += 1
            entered.notify_all()
        assert release.wait(60), "never released"
        return real(*args, **kwargs)

    def wait_for(n: int) -> None:
        with entered:
            assert entered.wait_for(lambda: count[0] >= n, timeout=60), count[0]

    monkeypatch.setattr(runs_service, "get_lineage", blocking)
    try:
        yield wait_for
    finally:
        release.set()


def test_too_many_expensive_requests_in_flight_get_429_at_once(
    backend: str, make_server: MakeServer, run_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Bulk requests all at once (no turns): the two admitted both reach the blocked lineage.
    server = make_server(backend, max_expensive_per_token=2, bulk_concurrency=0)
    token = read_token(server)
    with server.client() as admin:
        admin.post("/v1/runs", json={"name": run_name}).raise_for_status()
    lineage = f"/v1/runs/{run_name}/lineage"
    with ThreadPoolExecutor(3) as pool, blocked_lineage(monkeypatch) as wait_for:
        first = [pool.submit(_get, server, token, lineage) for _ in range(2)]
        wait_for(2)  # both are in flight
        with server.client(token) as client:
            over = client.get(lineage)
            cheap = client.get(f"/v1/runs/{run_name}")  # not expensive: not capped
        other = pool.submit(_get, server, server.admin_token, lineage)  # another token
        wait_for(3)
    assert [f.result().status_code for f in first] == [200, 200]
    assert other.result().status_code == 200
    assert over.status_code == 429, over.text
    assert over.json()["error"] == "too_many_in_flight"
    assert over.headers["retry-after"] == "1"
    assert "CKPT_MAX_EXPENSIVE_PER_TOKEN" in over.json()["message"]
    assert cheap.status_code == 200
    with server.client(token) as client:  # both answered: the token may send again
        assert [client.get(lineage).status_code for _ in range(3)] == [200] * 3


def test_healthz_answers_while_every_worker_thread_is_busy(
    backend: str, make_server: MakeServer, run_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: a sync /healthz waited for a free worker thread, behind the flood."""
    # No budget of bulk requests and no turns: with either, the flood could not take every
    # thread.
    server = make_server(backend, max_bulk_in_flight=0, bulk_concurrency=0)
    tokens = [read_token(server, f"reader-{i}") for i in range(WORKER_THREADS)]
    with server.client() as admin:
        admin.post("/v1/runs", json={"name": run_name}).raise_for_status()
    lineage = f"/v1/runs/{run_name}/lineage"
    with ThreadPoolExecutor(WORKER_THREADS) as pool, blocked_lineage(monkeypatch) as wait_for:
        flood = [pool.submit(_get, server, token, lineage) for token in tokens]
        wait_for(WORKER_THREADS)  # every worker thread is taken
        # An order of magnitude from failing: broken, it waits for the release (never).
        health = httpx.get(f"{server.url}/healthz", timeout=5)
    assert health.status_code == 200
    assert {f.result().status_code for f in flood} == {200}


def _get(server: Server, token: str, path: str) -> httpx.Response:
    with server.client(token) as client:
        return client.get(path)
