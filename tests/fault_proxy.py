"""A small HTTP proxy that injects faults between a client and an HTTP server (boto3 and the
S3 server, the agent and the control plane).

Each request is read whole, then, at the configured rates: answered ``503 SlowDown`` or
``500 InternalError``, cut off (the connection reset, no answer), stalled (held without an
answer), or forwarded to the server and its answer relayed.
"""

from __future__ import annotations

import http.client
import random
import re
import socket
import socketserver
import struct
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

FAULTS = ("slowdown", "error", "reset", "stall")
_XML = (
    '<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code>'
    "<Message>injected by the test proxy</Message></Error>"
)


@dataclass
class Faults:
    """Probability of each fault per request (their sum at most 1), and the stall's length."""

    rates: dict[str, float] = field(default_factory=dict)
    stall_seconds: float = 30.0
    methods: frozenset[str] | None = None  # the HTTP methods faults apply to (None: all)
    paths: str | None = None  # a regular expression the paths faults apply to must match
    seed: int = 0
    seen: Counter[str] = field(default_factory=Counter)

    def __post_init__(self) -> None:
        self._random = random.Random(self.seed)
        self._lock = threading.Lock()

    def draw(self, method: str, path: str = "") -> str:
        with self._lock:
            if (self.methods is not None and method not in self.methods) or (
                self.paths is not None and not re.search(self.paths, path)
            ):
                self.seen["forwarded"] += 1
                return "forward"
            roll = self._random.random()
            for fault in FAULTS:
                roll -= self.rates.get(fault, 0.0)
                if roll < 0:
                    self.seen[fault] += 1
                    return fault
            self.seen["forwarded"] += 1
            return "forward"


class FaultProxy:
    def __init__(self, upstream: str, faults: Faults) -> None:
        host, port = upstream.removeprefix("http://").split(":")
        self.faults = faults
        proxy = self

        class Handler(socketserver.StreamRequestHandler):
            def handle(self) -> None:
                while proxy._serve_one(self, host, int(port)):
                    pass

        self._server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _serve_one(self, handler: socketserver.StreamRequestHandler, host: str, port: int) -> bool:
        line = handler.rfile.readline()
        if not line:
            return False
        method, path, _ = line.decode().split(" ", 2)
        headers: list[tuple[str, str]] = []
        while (header := handler.rfile.readline()) not in (b"\r\n", b"\n", b""):
            name, _, value = header.decode().partition(":")
            headers.append((name.strip(), value.strip()))
        named = {k.lower(): v for k, v in headers}
        if named.get("expect", "").lower() == "100-continue":  # botocore waits 1 s without it
            handler.wfile.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            handler.wfile.flush()
        length = int(named.get("content-length", 0))
        body = handler.rfile.read(length) if length else b""
        fault = self.faults.draw(method, path)
        if fault == "reset":
            handler.connection.setsockopt(
                socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)
            )
            return False
        if fault == "stall":
            time.sleep(self.faults.stall_seconds)
            return False
        if fault in ("slowdown", "error"):
            status, code = (503, "SlowDown") if fault == "slowdown" else (500, "InternalError")
            self._answer(
                handler,
                status,
                [("Content-Type", "application/xml")],
                _XML.format(code=code).encode(),
            )
            return True
        upstream = http.client.HTTPConnection(host, port, timeout=120)
        try:
            upstream.request(method, path, body=body, headers=dict(headers))
            response = upstream.getresponse()
            payload = response.read()
            kept = [
                (k, v)
                for k, v in response.getheaders()
                if k.lower() not in ("transfer-encoding", "content-length", "connection")
            ]
            self._answer(handler, response.status, kept, payload, reason=response.reason)
        finally:
            upstream.close()
        return True

    @staticmethod
    def _answer(
        handler: socketserver.StreamRequestHandler,
        status: int,
        headers: list[tuple[str, str]],
        body: bytes,
        *,
        reason: str = "",
    ) -> None:
        lines = [f"HTTP/1.1 {status} {reason or 'Injected'}"]
        lines += [f"{k}: {v}" for k, v in headers]
        lines += [f"Content-Length: {len(body)}", "", ""]
        handler.wfile.write("\r\n".join(lines).encode() + body)
        handler.wfile.flush()
