"""The control-plane client's retries are bounded in all, whatever the control plane does."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import pytest

from ckpt.agent.client import ControlPlane
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
        client.heartbeat(1, step=3, patience=0.5)
    assert time.monotonic() - started < 10
    client.close()
