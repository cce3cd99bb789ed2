"""Per-token limits, applied before a request's body is read, so that one token cannot take
the server from the others (nor from its probes).

- **Rate**: a token bucket per bearer token: ``CKPT_RATE_LIMIT_PER_SECOND`` requests a second
  on average, ``CKPT_RATE_LIMIT_BURST`` at once after a quiet spell. Beyond: 429
  ``rate_limited`` with ``Retry-After``.
- **Expensive requests in flight**: at most ``CKPT_MAX_EXPENSIVE_PER_TOKEN`` per token: the
  routes of ``EXPENSIVE``, and any request with a body over ``LARGE_BODY_BYTES``; one with a
  large body counts as several (``Head.weight``). Beyond: 429 ``too_many_in_flight`` at
  once, with ``Retry-After: 1``.
- **Blob queries**: a ``/v1/blobs/missing`` body of more than ``MAX_BLOBS_QUERY_BYTES`` is
  refused (413) before it is parsed; the schema then caps the list at 10,000 blobs.

A token is known by the secret it sends, before authentication (which needs the database):
an unknown token gets a bucket too, and a 401. Requests without a token (probes, the API
description, and 401s) are not limited. The limits are per process: with N replicas behind
a load balancer, a token may make N times as many requests.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import re
import time
from dataclasses import dataclass

from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.bundles.schemas import MAX_BLOBS_PER_QUERY
from service.errors import (
    PayloadTooLargeError,
    RateLimitedError,
    ServiceError,
    TooManyInFlightError,
)
from service.settings import Settings

PROBES = frozenset({"/healthz", "/readyz", "/metrics"})
BLOBS_QUERY = "/v1/blobs/missing"
# A blob reference is about 90 bytes of JSON; 128 leaves room for spaces.
MAX_BLOBS_QUERY_BYTES = MAX_BLOBS_PER_QUERY * 128
# A body larger than this costs real time to parse (an agent's queries and records are
# smaller): the request counts as expensive, whatever its route.
LARGE_BODY_BYTES = 64 << 10
# Parsing and answering a large body costs in proportion to its size: a request counts as
# one more expensive request per this many bytes of body (a query of 10,000 blobs as 4).
WEIGHT_BYTES = 256 << 10
MAX_WEIGHT = 64
# A token over its rate, or that sends again before the Retry-After of its last refusal,
# gets its 429 after this long at most (see Limits.__call__).
MAX_PAUSE_SECONDS = 1.0

# Requests whose work grows with the catalog or the store, not with the request line:
# commits and re-verification read blobs back, gc and the scrubber walk everything.
EXPENSIVE: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("POST", re.compile(r"/v1/bundles/[^/]+/(commit|unquarantine)")),
    ("POST", re.compile(r"/v1/(gc|scrub)")),
    ("GET", re.compile(r"/v1/runs/[^/]+/(lineage|events)")),
    ("GET", re.compile(r"/v1/bundles/[^/]+/events")),
)


@dataclass
class _Bucket:
    tokens: float  # requests the token may make now
    at: float  # when ``tokens`` was computed (monotonic seconds)
    in_flight: int = 0  # expensive requests being served (by weight)
    refused_until: float = 0.0  # the end of the Retry-After of its last refusal


class TokenLimits:
    """The books of the limits: a token bucket and a count of expensive requests in flight
    per token. Time comes in as ``now``; one event loop uses it, so it takes no lock."""

    def __init__(
        self, *, rate: float, burst: int, max_in_flight: int, max_tokens: int = 10_000
    ) -> None:
        self.rate = rate  # 0: no rate limit
        self.burst = burst
        self.max_in_flight = max_in_flight  # 0: no cap
        self._buckets: dict[bytes, _Bucket] = {}
        self._prune_above = max_tokens

    def admit(self, key: bytes, *, now: float) -> None:
        """Take one request from the token's bucket, or raise ``RateLimitedError``."""
        if self.rate <= 0:
            return
        bucket = self._bucket(key, now)
        bucket.tokens = min(self.burst, bucket.tokens + (now - bucket.at) * self.rate)
        bucket.at = now
        if bucket.tokens < 1:
            wait = max(1, math.ceil((1 - bucket.tokens) / self.rate))
            raise RateLimitedError(
                f"too many requests from this token: at most {self.rate:g} a second "
                f"(CKPT_RATE_LIMIT_PER_SECOND) in bursts of {self.burst} "
                f"(CKPT_RATE_LIMIT_BURST) on this server; retry after {wait} s",
                retry_after=wait,
                pause=min(wait, MAX_PAUSE_SECONDS),
            )
        bucket.tokens -= 1

    def enter(self, key: bytes, *, what: str, now: float, weight: int = 1) -> int:
        """Count an expensive request in, as ``weight`` requests (at most the cap, so that
        the heaviest request may run alone), or raise ``TooManyInFlightError``. Returns the
        weight counted, for ``leave``."""
        if self.max_in_flight <= 0:
            return 0
        weight = min(weight, self.max_in_flight)
        bucket = self._bucket(key, now)
        if bucket.in_flight + weight > self.max_in_flight:
            # At once, unless the token did not wait the Retry-After of its last refusal.
            impatient = now < bucket.refused_until
            bucket.refused_until = now + 1
            raise TooManyInFlightError(
                f"this token already has expensive requests worth {bucket.in_flight} in "
                f"flight, and {what} is worth {weight}: one token may have "
                f"{self.max_in_flight} (CKPT_MAX_EXPENSIVE_PER_TOKEN) on this server. Send it "
                "again when one of them is answered; retry after 1 s",
                retry_after=1,
                pause=MAX_PAUSE_SECONDS if impatient else 0.0,
            )
        bucket.in_flight += weight
        return weight

    def leave(self, key: bytes, weight: int) -> None:
        """Count an expensive request out (it was answered, or its client went away)."""
        if weight:
            self._buckets[key].in_flight -= weight

    def in_flight(self, key: bytes) -> int:
        bucket = self._buckets.get(key)
        return bucket.in_flight if bucket else 0

    def __len__(self) -> int:
        return len(self._buckets)

    def _bucket(self, key: bytes, now: float) -> _Bucket:
        bucket = self._buckets.get(key)
        if bucket is None:
            if len(self._buckets) >= self._prune_above:
                self._prune(now)
            bucket = self._buckets[key] = _Bucket(tokens=self.burst, at=now)
        return bucket

    def _prune(self, now: float) -> None:
        """Forget the tokens a fresh bucket would stand for: none in flight, bucket refilled.
        Prune again only once the books have doubled, so that pruning stays amortized O(1)."""
        for key, bucket in list(self._buckets.items()):
            refilled = self.rate <= 0 or bucket.tokens + (now - bucket.at) * self.rate >= self.burst
            if bucket.in_flight == 0 and refilled:
                del self._buckets[key]
        self._prune_above = max(self._prune_above, 2 * len(self._buckets))


class Limits:
    """The ASGI middleware that applies ``TokenLimits``; outermost, so that a refusal costs
    neither reading the body nor a worker thread."""

    def __init__(self, app: ASGIApp, *, limits: TokenLimits) -> None:
        self.app = app
        self.limits = limits

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        key = _limited(scope)
        if key is None:  # not limited: probes, public routes, and the 401s
            await self.app(scope, receive, send)
            return
        head = Head.of(scope)
        try:
            receive, weight = await self._admit(key, head, receive)
        except ServiceError as err:
            if isinstance(err, RateLimitedError) and err.pause:
                # A client that ignores Retry-After waits anyway: its flood of refusals
                # slows to one per connection per pause, at no cost to the server.
                await asyncio.sleep(err.pause)
            await _refuse(err, send, unread_body=head.large)
            return
        if not weight:
            await self.app(scope, receive, send)
            return
        # Counted out as soon as the response is sent: the client's next request may come
        # before this call returns, and must not find itself still in flight.
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self.limits.leave(key, weight)

        async def sending(message: Message) -> None:
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body"):
                release()

        try:
            await self.app(scope, receive, sending)
        finally:
            release()

    async def _admit(self, key: bytes, head: Head, receive: Receive) -> tuple[Receive, int]:
        """Count the request in, or raise the ``ServiceError`` that refuses it. Returns the
        receive to read its body with, and the weight it counts in flight (0: cheap)."""
        now = time.monotonic()
        self.limits.admit(key, now=now)
        if head.method == "POST" and head.path == BLOBS_QUERY:
            receive = await _capped_body(receive, head.body_bytes, cap=MAX_BLOBS_QUERY_BYTES)
        if not head.expensive:
            return receive, 0
        what = f"{head.method} {head.path}"
        return receive, self.limits.enter(key, what=what, now=now, weight=head.weight)


@dataclass(frozen=True)
class Head:
    """What the limits look at: the request line and headers, never the body."""

    method: str
    path: str
    body_bytes: int | None  # as declared; None: streamed (chunked) or unreadable

    @classmethod
    def of(cls, scope: Scope) -> Head:
        headers = dict(scope["headers"])
        declared = headers.get(b"content-length")
        if declared is not None:
            size = int(declared) if declared.isdigit() else None
        else:
            size = None if b"transfer-encoding" in headers else 0
        return cls(method=scope["method"], path=scope["path"], body_bytes=size)

    @property
    def large(self) -> bool:
        """A body of unknown or large size: parsing it costs the server real time."""
        return self.body_bytes is None or self.body_bytes > LARGE_BODY_BYTES

    @property
    def expensive(self) -> bool:
        """A route of ``EXPENSIVE``, or any request with a large body."""
        return self.large or any(
            self.method == verb and pattern.fullmatch(self.path) for verb, pattern in EXPENSIVE
        )

    @property
    def weight(self) -> int:
        """How many expensive requests it counts as: one, and one more per
        ``WEIGHT_BYTES`` of body (a streamed body counts as the largest)."""
        if self.body_bytes is None:
            return MAX_WEIGHT
        return min(MAX_WEIGHT, 1 + self.body_bytes // WEIGHT_BYTES)


def _limited(scope: Scope) -> bytes | None:
    """The key of the token an HTTP request is counted against; None when it is not."""
    if scope["type"] != "http" or scope["path"] in PROBES:
        return None
    return token_key(dict(scope["headers"]).get(b"authorization"))


def token_key(authorization: bytes | None) -> bytes | None:
    """Who the limits count a request against: a digest of its bearer token, if it has one."""
    scheme, _, token = (authorization or b"").partition(b" ")
    token = token.strip()
    if scheme.lower() != b"bearer" or not token:
        return None
    return hashlib.sha256(token).digest()[:16]


async def _capped_body(receive: Receive, declared: int | None, *, cap: int) -> Receive:
    """The body of a request whose route takes at most ``cap`` bytes: refused (413) when it
    declares more, else read here when it streams, and handed on as it came."""
    if declared is not None:
        if declared > cap:
            raise _too_large(cap)
        return receive
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return _replay(message, receive)
        chunks.append(message.get("body", b""))
        size += len(chunks[-1])
        if size > cap:
            raise _too_large(cap)
        if not message.get("more_body", False):
            body: Message = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return _replay(body, receive)


def _too_large(cap: int) -> PayloadTooLargeError:
    return PayloadTooLargeError(
        f"a {BLOBS_QUERY} body may hold at most {MAX_BLOBS_PER_QUERY} blobs ({cap} bytes): "
        "ask about the rest in further requests"
    )


def _replay(first: Message, original: Receive) -> Receive:
    """A receive that hands out ``first``, then waits on the original."""
    pending = [first]

    async def receive() -> Message:
        return pending.pop() if pending else await original()

    return receive


async def _refuse(err: ServiceError, send: Send, *, unread_body: bool) -> None:
    """Answer ``err`` without reading the body: one that is still coming is not read but cut
    off (``Connection: close``), which costs the server less than receiving it."""
    headers = {"Retry-After": str(err.retry_after)} if isinstance(err, RateLimitedError) else {}
    if unread_body:
        headers["Connection"] = "close"
    response = JSONResponse(err.body(), status_code=err.status, headers=headers)
    await response({"type": "http"}, _disconnected, send)


async def _disconnected() -> Message:
    return {"type": "http.disconnect"}


def token_limits(settings: Settings) -> TokenLimits:
    """The limits ``settings`` configure."""
    return TokenLimits(
        rate=settings.rate_limit_per_second,
        burst=settings.rate_limit_burst,
        max_in_flight=settings.max_expensive_per_token,
    )
