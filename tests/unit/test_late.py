"""A save's calls are waited for at most twice their patience (``agent.catalog.late``): a
call the control plane holds longer goes on in the background and its answer still comes;
meanwhile the save's other calls are not tried. Against a real HTTP server on loopback."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from agent.catalog.client import ControlPlane
from agent.catalog.late import LateError, SaveCalls, within
from ckpt.core.errors import ControlPlaneError


class _Held(BaseHTTPRequestHandler):
    """Answers every request once the test lets it go (a busy control plane, alive)."""

    go = threading.Event()

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        self.go.wait(60)
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, *args: object) -> None:
        return None


@pytest.fixture
def held() -> Iterator[ControlPlane]:
    _Held.go.clear()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Held)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    client = ControlPlane(f"http://127.0.0.1:{server.server_address[1]}", token=None)
    yield client
    _Held.go.set()
    client.close()
    server.shutdown()
    server.server_close()


def test_a_call_held_past_twice_its_patience_goes_on_and_its_answer_comes(
    held: ControlPlane,
) -> None:
    calls = SaveCalls(held)
    with pytest.raises(LateError, match="no answer from the control plane in 1 s") as late:
        calls.answer(
            lambda: held.heartbeat(1, step=3, rank=0, patience=0.5), patience=0.5, what="beat"
        )
    assert calls.silent  # the save's other calls are not tried while it has no answer
    assert not held.unreachable  # nor is the control plane taken for down
    _Held.go.set()
    assert late.value.call.result(timeout=60) is None  # the answer, in the background
    assert not calls.silent and not held.unreachable


def test_an_answer_or_a_refusal_in_time_is_the_callers() -> None:
    assert within(lambda: 7, seconds=60, what="seven") == 7

    def refused() -> None:
        raise ControlPlaneError("refused", status=409)

    with pytest.raises(ControlPlaneError, match="refused"):
        within(refused, seconds=60, what="refused")


def test_a_call_without_patience_is_waited_for_as_the_client_retries(held: ControlPlane) -> None:
    calls = SaveCalls(held)
    threading.Timer(1.5, _Held.go.set).start()  # longer than any save's wait
    calls.answer(lambda: held.heartbeat(1, step=3, rank=0, patience=60), patience=None, what="b")
    assert not calls.silent
