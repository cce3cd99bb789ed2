"""A cloud instance metadata service on 127.0.0.1 that answers in each cloud's real shapes:
AWS IMDSv2 (token required), GCP's metadata server (``Metadata-Flavor: Google``
required) and Azure's Scheduled Events (``Metadata: true`` required). ``announce``
switches it to a notice; it counts the requests it answered and remembers which of them
carried the notice first."""

from __future__ import annotations

import json
import secrets
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

AWS_ACTION = {"action": "terminate", "time": "2026-12-01T03:30:00Z"}
AWS_REBALANCE = {"noticeTime": "2026-12-01T03:25:00Z"}
AZURE_EVENT = {
    "EventId": "602d9444-d2cd-49c7-8624-8643e7171297",
    "EventStatus": "Scheduled",
    "EventType": "Preempt",
    "ResourceType": "VirtualMachine",
    "Resources": ["trainer-vm-0"],
    "NotBefore": "Tue, 01 Dec 2026 03:30:00 GMT",
    "Description": "The virtual machine is being evicted.",
    "EventSource": "Platform",
    "DurationInSecs": -1,
}
AZURE_FREEZE = {**AZURE_EVENT, "EventId": "c5f5-freeze", "EventType": "Freeze"}


class MetadataServer:
    def __init__(self, cloud: str, *, notice: str = "") -> None:
        self.cloud = cloud
        self.notice = notice  # "" (none), or which: aws instance-action|rebalance, gcp ...
        self.requests = 0
        self.first_notice_request: int | None = None  # which request carried it first
        self.announced_at_request: int | None = None
        self.token = secrets.token_hex(8)
        self.expire_token = False  # answer 401 to the current token once
        self.fail = False  # answer 500
        self.lock = threading.Condition()
        self.extra_events: list[dict[str, Any]] = []

    def announce(self, notice: str) -> None:
        with self.lock:
            self.notice = notice
            self.announced_at_request = self.requests

    def wait_for_requests(self, count: int, timeout: float = 30) -> None:
        with self.lock:
            if not self.lock.wait_for(lambda: self.requests >= count, timeout):
                raise TimeoutError(f"{self.requests} requests, waited for {count}")

    def answer(self, method: str, path: str, headers: Any) -> tuple[int, str, str]:
        """(status, content type, body) for one request."""
        status, kind, body, noticed = self._answer(method, path, headers)
        with self.lock:
            self.requests += 1
            if noticed and self.first_notice_request is None:
                self.first_notice_request = self.requests
            self.lock.notify_all()
        return status, kind, body

    def _answer(self, method: str, path: str, headers: Any) -> tuple[int, str, str, bool]:
        if self.fail:
            return 500, "text/plain", "internal error", False
        if self.cloud == "aws":
            return self._aws(method, path, headers)
        if self.cloud == "gcp":
            return self._gcp(path, headers)
        return self._azure(path, headers)

    def _aws(self, method: str, path: str, headers: Any) -> tuple[int, str, str, bool]:
        if path == "/latest/api/token":
            if method != "PUT" or not headers.get("X-aws-ec2-metadata-token-ttl-seconds"):
                return 400, "text/plain", "Missing or invalid parameters", False
            return 200, "text/plain", self.token, False
        if headers.get("X-aws-ec2-metadata-token") != self.token:
            return 401, "text/plain", "Unauthorized", False
        if self.expire_token:
            self.expire_token = False
            self.token = secrets.token_hex(8)
            return 401, "text/plain", "Unauthorized", False
        if path == "/latest/meta-data/spot/instance-action" and self.notice == "instance-action":
            return 200, "text/plain", json.dumps(AWS_ACTION), True
        if (
            path == "/latest/meta-data/events/recommendations/rebalance"
            and self.notice == "rebalance"
        ):
            return 200, "text/plain", json.dumps(AWS_REBALANCE), True
        return 404, "text/html", "<html><body>404 - Not Found</body></html>", False

    def _gcp(self, path: str, headers: Any) -> tuple[int, str, str, bool]:
        if headers.get("Metadata-Flavor") != "Google":
            return 403, "text/html", "Missing Metadata-Flavor:Google header.", False
        if path == "/computeMetadata/v1/instance/preempted":
            preempted = self.notice == "preempted"
            return 200, "application/text", "TRUE" if preempted else "FALSE", preempted
        if path == "/computeMetadata/v1/instance/maintenance-event":
            event = "TERMINATE_ON_HOST_MAINTENANCE" if self.notice == "maintenance" else "NONE"
            return 200, "application/text", event, event != "NONE"
        return 404, "text/html", "Not Found", False

    def _azure(self, path: str, headers: Any) -> tuple[int, str, str, bool]:
        if headers.get("Metadata") != "true":
            return (
                400,
                "application/json",
                '{"error": "Bad request. Required metadata header not specified"}',
                False,
            )
        if path != "/metadata/scheduledevents?api-version=2020-07-01":
            return 404, "application/json", '{"error": "Not found"}', False
        events = list(self.extra_events) + ([AZURE_EVENT] if self.notice == "preempt" else [])
        body = {"DocumentIncarnation": len(events), "Events": events}
        return 200, "application/json", json.dumps(body), self.notice == "preempt"


@contextmanager
def metadata_server(cloud: str) -> Iterator[tuple[MetadataServer, str]]:
    """The server and its base URL, on a free port of 127.0.0.1."""
    state = MetadataServer(cloud)

    class Handler(BaseHTTPRequestHandler):
        def _reply(self, method: str) -> None:
            status, kind, body = state.answer(method, self.path, self.headers)
            data = body.encode()
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            self._reply("GET")

        def do_PUT(self) -> None:
            self._reply("PUT")

        def log_message(self, fmt: str, *args: Any) -> None:
            return None

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield state, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
