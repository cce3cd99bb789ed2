"""The control-plane client's retries are bounded in all, whatever the control plane does."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import httpx
import pytest

from agent.catalog.client import ControlPlane, IntactBlobError
from ckpt.core.errors import ControlPlaneError

WINDOW = 2.0


@pytest.fixture
def silent_server() -> Iterator[str]:
    """A port that accepts connections (the kernel's backlog does) and never answers: a
    control plane that hangs."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(64)
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"


@pytest.fixture
def closed_port() -> str:
    """A port nothing listens on: a control plane that is down."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    return f"http://127.0.0.1:{port}"


@pytest.mark.parametrize("server", ["silent_server", "closed_port"])
def test_a_call_gives_up_within_its_retry_window(
    server: str, request: pytest.FixtureRequest
) -> None:
    # The per-try timeout (60 s) is far longer than the window: before the window bounded
    # every try, a hung control plane held this call for a whole try past the window.
    client = ControlPlane(request.getfixturevalue(server), token=None, retry_seconds=WINDOW)
    started = time.monotonic()
    with pytest.raises(ControlPlaneError, match=r"gave up after 2 s of retries"):
        client.resumable("run")
    elapsed = time.monotonic() - started
    client.close()
    assert elapsed < WINDOW + 10  # far below the 60 s one try could take before


def test_patience_bounds_one_call_below_the_client_window(silent_server: str) -> None:
    client = ControlPlane(silent_server, token=None, retry_seconds=600)
    started = time.monotonic()
    with pytest.raises(ControlPlaneError, match=r"gave up after 0.5 s"):
        client.heartbeat(1, step=3, rank=0, patience=0.5)
    assert time.monotonic() - started < 10
    client.close()


def test_a_quarantine_names_the_blob_and_epoch_and_hears_intact() -> None:
    sent: list[dict[str, object]] = []

    def answer(request: httpx.Request) -> httpx.Response:
        sent.append(json.loads(request.content))
        body = {"error": "intact", "message": "reads back intact", "blob": "ab" * 32}
        return httpx.Response(409, json=body)

    client = ControlPlane("http://cp", token=None, transport=httpx.MockTransport(answer))
    with pytest.raises(IntactBlobError, match="reads back intact"):
        client.quarantine(7, reason="bad\nblob\x1b[2J", epoch=3, blob="ab" * 32)
    client.close()
    # Control characters would be refused (and could forge a log line): sent as spaces.
    assert sent == [{"reason": "bad blob [2J", "epoch": 3, "blob": "ab" * 32}]


class _Busy(BaseHTTPRequestHandler):
    """Answers 429 (Retry-After: 0.1) until ``refusals`` run out, then a resumable bundle's
    absence (404, which ``resumable`` reads as None)."""

    refusals = 2
    seen: ClassVar[list[str]] = []

    def do_GET(self) -> None:
        self.seen.append(self.path)
        if type(self).refusals > 0:
            type(self).refusals -= 1
            self._answer(429, {"error": "rate_limited", "message": "slow down"}, retry="0.1")
        else:
            self._answer(404, {"error": "not_found", "message": "no bundle"})

    def _answer(self, status: int, body: dict[str, str], *, retry: str | None = None) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if retry:
            self.send_header("Retry-After", retry)
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        return None


def test_a_rate_limited_call_waits_as_asked_and_goes_through() -> None:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Busy)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    client = ControlPlane(f"http://127.0.0.1:{server.server_address[1]}", token=None)
    try:
        assert client.resumable("run") is None
        assert len(_Busy.seen) == 3  # two 429s, then the answer
        assert not client.unreachable  # a 429 is an answer: the control plane is up
    finally:
        client.close()
        server.shutdown()
        server.server_close()


class _Slow(_Busy):
    """Answers every heartbeat, after a pause longer than a save's patience."""

    pause = 1.5

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        time.sleep(self.pause)  # the control plane's own slowness, not the test's waiting
        self._answer(200, {})


def test_a_slow_answer_within_the_try_floor_is_an_answer() -> None:
    # A save's calls are patient for 0.5 s; a busy control plane answering in 1.5 s must
    # not be taken for one that is down (the save would defer its commit for nothing).
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Slow)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    client = ControlPlane(f"http://127.0.0.1:{server.server_address[1]}", token=None)
    try:
        client.heartbeat(1, step=3, rank=0, patience=0.5)
        assert not client.unreachable
    finally:
        client.close()
        server.shutdown()
        server.server_close()
