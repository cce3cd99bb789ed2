"""Bulk requests served by a process of their own, with its own GIL.

A bulk request that runs (a query of 10,000 blobs, a long lineage, a page of 500 runs)
holds the process's GIL in slices, and ``/resumable`` or a heartbeat waits for it at each
of its statements. Pausing at points (``service.yielding``) shortens those waits and
cannot end them: under ``bench/flood.py --probe resumable --mix`` the p99 of
``/resumable`` stayed 1.5-2.6 times idle. The same flood sent to a second server process
(``--split``) left it 1.4-1.5 times idle: what is left then is the cores, not the GIL.

So ``ckpt server`` on PostgreSQL starts, beside each serving process, a **bulk process**
(``service.bulk_child``): the same app at nice 10, listening on a Unix socket in a
directory only its user can enter, with no token limits (the serving process admitted the request and counts it) and no periodic
tasks. The serving process forwards each admitted bulk request there (``ForwardBulk``),
its body already read under the body limit, and streams the answer back unread. Requests
and metrics: the bulk process writes its own into the same multiprocess directory, so
``/metrics`` counts each request once, where it was served.

- **Starting, restarting, gone**: until the bulk process answers, bulk requests are served
  in the serving process as before (``BulkTurns``, pausing for priority requests). One
  that exits is started again, after 1 s, doubling to 30 s while it keeps exiting; one
  that hangs (``/healthz`` unanswered ``WATCH_FAILURES`` times in a row) is killed first.
- **A request it could not be sent**, or a read it was sent and did not answer (it died
  meanwhile): served in the serving process. **Any other request it did not answer** is
  answered 503 with ``Retry-After``: it may have been carried out, and the client retries
  it as it would any 503.
- **The serving process exits**: the bulk process's stdin closes, and it exits too (after
  the requests it holds), even when the serving process was killed.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import shutil
import sys
import tempfile
import time

import httpx
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.admission import Head, RouteClass
from service.errors import RetryError
from service.metrics import Metrics, process_exited
from service.settings import KEEP_ALIVE_SECONDS, Settings

log = logging.getLogger("ckpt.service.bulk")

# Seconds before a bulk process that exited is started again: the first time, and at most.
RESTART_SECONDS = (1.0, 30.0)
# A bulk process not listening by then is stopped and started again: as long as a server
# may take to start on a saturated machine.
START_SECONDS = 300.0
READY_POLL_SECONDS = 0.05
# Once up, it is asked ``/healthz`` this often, on a connection of its own, with as long to
# answer; one that fails this many times in a row (hung) is killed and started again.
WATCH_SECONDS = 5.0
WATCH_FAILURES = 3
STOP_SECONDS = 30.0  # after SIGTERM, before SIGKILL
READS = frozenset(("GET", "HEAD"))  # served here when the bulk process died serving them
# Headers of one connection, not of the request or the answer: never forwarded. ``expect``:
# the serving process has read the body already.
HOP_BY_HOP = frozenset(
    (b"connection", b"keep-alive", b"transfer-encoding", b"te", b"upgrade", b"expect")
)
# An answer's headers the serving process's uvicorn writes itself, to every answer.
OWN_HEADERS = HOP_BY_HOP | {b"date", b"server"}


class BulkProcess:
    """The bulk process of one serving process: started, watched and restarted by
    ``supervise``, reached through ``forward``."""

    def __init__(self, settings: Settings, metrics: Metrics) -> None:
        self.settings = settings
        self.metrics = metrics
        self.socket = ""  # in a directory of its own, made by ``supervise``
        self.ready = False
        self._client: httpx.AsyncClient | None = None

    async def supervise(self, stop: asyncio.Event) -> None:
        """Run the bulk process until ``stop``, starting it again whenever it exits."""
        logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request
        delay = RESTART_SECONDS[0]
        directory = tempfile.mkdtemp(prefix="ckpt-bulk-")  # mode 0700
        self.socket = os.path.join(directory, "bulk.sock")
        self._client = httpx.AsyncClient(
            transport=httpx.AsyncHTTPTransport(
                uds=self.socket,
                # Shorter than the bulk process keeps an idle connection: the close is ours.
                limits=httpx.Limits(keepalive_expiry=KEEP_ALIVE_SECONDS / 2),
            ),
            # A bulk request (a GC pass) may run for minutes; reaching the socket may not.
            timeout=httpx.Timeout(None, connect=5.0),
        )
        try:
            while not stop.is_set():
                started = time.monotonic()
                try:
                    await self._run_once(stop)
                except Exception:  # it could not be started: as if it had exited
                    log.exception("the bulk process failed")
                if stop.is_set():
                    break
                self.metrics.bulk_process_exits.inc()
                lived = time.monotonic() - started
                delay = RESTART_SECONDS[0] if lived > RESTART_SECONDS[1] else delay
                log.warning("the bulk process exited; starting it again in %.0f s", delay)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), delay)
                delay = min(2 * delay, RESTART_SECONDS[1])
        finally:
            await self._client.aclose()
            shutil.rmtree(directory, ignore_errors=True)

    async def _run_once(self, stop: asyncio.Event) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.socket)
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "service.bulk_child",
            self.socket,
            stdin=asyncio.subprocess.PIPE,
            start_new_session=True,  # a terminal's Ctrl-C is the serving process's to pass on
        )
        assert process.stdin is not None
        # On stdin, not in the environment: the settings hold the database's password.
        process.stdin.write(json.dumps(dataclasses.asdict(self.settings)).encode() + b"\n")
        exited = asyncio.create_task(process.wait())
        stopping = asyncio.create_task(stop.wait())
        try:
            await process.stdin.drain()
            if await self._answers(exited, stop):
                self._up(True)
                log.info("bulk requests are served by process %d", process.pid)
                await self._watch(process, exited, stopping)
        finally:
            self._up(False)
            stopping.cancel()
            if not exited.done():
                process.terminate()
                try:
                    await asyncio.wait_for(asyncio.shield(exited), STOP_SECONDS)
                except TimeoutError:
                    process.kill()
                    await exited
            elif not stop.is_set():
                log.warning("the bulk process %d exited with %s", process.pid, exited.result())
            process_exited(process.pid)

    async def _answers(self, exited: asyncio.Task[int], stop: asyncio.Event) -> bool:
        """Whether the bulk process listens before it exits, ``stop`` or ``START_SECONDS``
        (uvicorn listens once the app has started)."""
        deadline = time.monotonic() + START_SECONDS
        while not exited.done() and not stop.is_set() and time.monotonic() < deadline:
            with contextlib.suppress(OSError):
                _, writer = await asyncio.open_unix_connection(self.socket)
                writer.close()
                return True
            await asyncio.sleep(READY_POLL_SECONDS)
        return False

    async def _watch(
        self,
        process: asyncio.subprocess.Process,
        exited: asyncio.Task[int],
        stopping: asyncio.Task[bool],
    ) -> None:
        """Until the bulk process exits or ``stopping``; one that hangs is killed."""
        failures = 0
        while True:
            done, _ = await asyncio.wait(
                (exited, stopping), timeout=WATCH_SECONDS, return_when=asyncio.FIRST_COMPLETED
            )
            if done:
                return
            failures = 0 if await self._healthy() else failures + 1
            if failures == WATCH_FAILURES:
                log.warning(
                    "the bulk process %d did not answer /healthz %d times in a row; killing it",
                    process.pid,
                    failures,
                )
                process.kill()
                await exited
                return

    async def _healthy(self) -> bool:
        """Whether the bulk process answers ``/healthz`` 200 within ``WATCH_SECONDS``, on a
        connection of its own (a request queued behind bulk work would say nothing)."""
        try:
            async with asyncio.timeout(WATCH_SECONDS):
                reader, writer = await asyncio.open_unix_connection(self.socket)
                try:
                    writer.write(
                        b"GET /healthz HTTP/1.1\r\nhost: bulk\r\nconnection: close\r\n\r\n"
                    )
                    await writer.drain()
                    status = await reader.readline()
                finally:
                    writer.close()
        except (OSError, TimeoutError):
            return False
        return status.split(b" ")[1:2] == [b"200"]

    def _up(self, up: bool) -> None:
        self.ready = up
        self.metrics.bulk_process_up.set(int(up))

    async def forward(self, scope: Scope, body: bytes, send: Send) -> bool:
        """Serve the request in the bulk process and stream its answer to ``send``; False
        when the request could not be sent (serve it here)."""
        assert self._client is not None
        # As the client sent it: the decoded path may hold what a URL cannot (%00), or
        # what would route elsewhere (%3F).
        raw = scope.get("raw_path") or scope["path"].encode()
        query = scope.get("query_string", b"")
        try:
            request = self._client.build_request(
                scope["method"],
                httpx.URL("http://bulk").copy_with(raw_path=raw + b"?" + query if query else raw),
                headers=[(k, v) for k, v in scope["headers"] if k.lower() not in HOP_BY_HOP],
                content=body,
            )
        except httpx.InvalidURL:  # served here, where the route says what is wrong
            return False
        try:
            response = await self._client.send(request, stream=True)
        except (httpx.ConnectError, httpx.ConnectTimeout):  # it never had the request
            return False
        except httpx.TransportError as err:
            if scope["method"] in READS:  # it may have read: so may we, again
                return False
            log.warning("the bulk process did not answer %s: %r", scope["path"], err)
            retry = RetryError("the server's bulk process exited while serving this; retry it")
            self.metrics.bulk_served.labels("retry").inc()
            answer = JSONResponse(retry.body(), retry.status, headers={"Retry-After": "1"})
            await answer(scope, _closed, send)
            return True
        try:
            await send(
                {
                    "type": "http.response.start",
                    "status": response.status_code,
                    "headers": [
                        (k, v) for k, v in response.headers.raw if k.lower() not in OWN_HEADERS
                    ],
                }
            )
            async for chunk in response.aiter_raw():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            # Counted before the answer ends: a client that then scrapes finds it counted.
            self.metrics.bulk_served.labels("bulk_process").inc()
            await send({"type": "http.response.body", "body": b""})
        finally:
            await response.aclose()
        return True


class ForwardBulk:
    """The ASGI middleware, inside the body limit, that sends a bulk request to the bulk
    process while it answers, and serves the rest (and bulk requests meanwhile) here."""

    def __init__(self, app: ASGIApp, *, bulk: BulkProcess) -> None:
        self.app = app
        self.bulk = bulk

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or Head.of(scope).route_class is not RouteClass.BULK:
            await self.app(scope, receive, send)
            return
        if not self.bulk.ready:  # starting, restarting: served here, as without one
            self.bulk.metrics.bulk_served.labels("here").inc()
            await self.app(scope, receive, send)
            return
        message = await receive()  # the whole body: the body limit read it
        if message["type"] == "http.request" and await self.bulk.forward(
            scope, message.get("body", b""), send
        ):
            return
        self.bulk.metrics.bulk_served.labels("here").inc()
        await self.app(scope, _again(message, receive), send)


async def _closed() -> Message:
    return {"type": "http.disconnect"}  # the answer reads nothing more of the request


def _again(message: Message, receive: Receive) -> Receive:
    """A receive that hands out ``message`` again, then waits on ``receive``."""
    pending = [message]

    async def again() -> Message:
        return pending.pop() if pending else await receive()

    return again
