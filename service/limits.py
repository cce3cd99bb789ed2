"""Per-token limits, applied before a request's body is read, so that one token cannot take
the server from the others (nor from its probes).

- **Rate**: a token bucket per bearer token: ``CKPT_RATE_LIMIT_PER_SECOND`` requests a second
  on average, ``CKPT_RATE_LIMIT_BURST`` at once after a quiet spell. Beyond: 429
  ``rate_limited`` with ``Retry-After``.
- **Expensive requests in flight**: at most ``CKPT_MAX_EXPENSIVE_PER_TOKEN`` per token (what
  ``service.admission`` calls expensive: bulk requests and commits); a heavy one counts as
  several (``Head.weight``). Beyond: 429 ``too_many_in_flight`` at once, with
  ``Retry-After: 1``.
- **Bulk requests in flight**: at most ``CKPT_MAX_BULK_IN_FLIGHT`` (by weight) in the
  process, whatever their tokens, so that the priority class (``/resumable``, heartbeats,
  commits) always finds worker threads and cores free. Beyond: the same 429.
- **Bulk requests running**: of those admitted, ``CKPT_BULK_CONCURRENCY`` (1) run at once,
  and the one that runs steps aside while a priority request is in flight
  (``service.yielding``).
- **Blob queries**: a ``/v1/blobs/missing`` body of more than ``MAX_BLOBS_QUERY_BYTES`` is
  refused (413) before it is parsed; the schema then caps the list at 10,000 blobs.

A refusal never cuts the connection: the server reads and drops a body it did not need,
so that the client, still sending it, reads its answer rather than a reset.

A token is known by the secret it sends, before authentication (which needs the database):
an unknown token gets a bucket too, and a 401. Requests without a token (probes, the API
description, and 401s) are not limited. The limits are per process: with N replicas behind
a load balancer, a token may make N times as many requests.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import time
from dataclasses import dataclass

from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.admission import Head, RouteClass
from service.bundles.schemas import MAX_BLOBS_PER_QUERY
from service.errors import (
    PayloadTooLargeError,
    RateLimitedError,
    ServiceError,
    TooManyInFlightError,
)
from service.metrics import Metrics
from service.settings import Settings

PROBES = frozenset({"/healthz", "/readyz", "/metrics"})
BLOBS_QUERY = "/v1/blobs/missing"
# A blob reference is about 90 bytes of JSON; 128 leaves room for spaces.
MAX_BLOBS_QUERY_BYTES = MAX_BLOBS_PER_QUERY * 128
# A token over its rate, or that sends again before the Retry-After of its last refusal,
# gets its 429 after this long at most (see Limits.__call__).
MAX_PAUSE_SECONDS = 1.0


@dataclass(frozen=True)
class Ticket:
    """What an admitted request counts in flight, until it is answered."""

    weight: int  # against its token's expensive requests
    bulk: int  # against the process's bulk requests


NOTHING = Ticket(weight=0, bulk=0)


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
        self,
        *,
        rate: float,
        burst: int,
        max_in_flight: int,
        max_bulk: int = 0,
        max_tokens: int = 10_000,
    ) -> None:
        self.rate = rate  # 0: no rate limit
        self.burst = burst
        self.max_in_flight = max_in_flight  # 0: no cap
        self.max_bulk = max_bulk  # 0: no cap
        self.bulk_in_flight = 0  # bulk requests being served, all tokens (by weight)
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
            raise self._refused(
                bucket,
                now,
                f"this token already has expensive requests worth {bucket.in_flight} in "
                f"flight, and {what} is worth {weight}: one token may have "
                f"{self.max_in_flight} (CKPT_MAX_EXPENSIVE_PER_TOKEN) on this server",
            )
        bucket.in_flight += weight
        return weight

    def enter_bulk(self, key: bytes, *, what: str, now: float, weight: int) -> int:
        """Count a bulk request in against the process's budget (at most the whole budget,
        so that the heaviest may run alone), or raise ``TooManyInFlightError``. Returns the
        weight counted, for ``leave_bulk``."""
        if self.max_bulk <= 0:
            return 0
        weight = min(weight, self.max_bulk)
        if self.bulk_in_flight + weight > self.max_bulk:
            raise self._refused(
                self._bucket(key, now),
                now,
                f"this server already has bulk requests worth {self.bulk_in_flight} in "
                f"flight, and {what} is worth {weight}: it serves {self.max_bulk} at once "
                "(CKPT_MAX_BULK_IN_FLIGHT), to keep room for resumes, heartbeats and commits",
            )
        self.bulk_in_flight += weight
        return weight

    def admit_ticket(self, key: bytes, head: Head, *, now: float) -> Ticket:
        """Count ``head``'s request in flight as its class and weight say; refused (raises
        ``TooManyInFlightError``) with nothing counted."""
        if not head.expensive:
            return NOTHING
        what = f"{head.method} {head.path}"
        weight = self.enter(key, what=what, now=now, weight=head.weight)
        if head.route_class is not RouteClass.BULK:
            return Ticket(weight=weight, bulk=0)
        try:
            bulk = self.enter_bulk(key, what=what, now=now, weight=head.weight)
        except TooManyInFlightError:
            self.leave(key, weight)
            raise
        return Ticket(weight=weight, bulk=bulk)

    def leave(self, key: bytes, weight: int) -> None:
        """Count an expensive request out (it was answered, or its client went away)."""
        if weight:
            self._buckets[key].in_flight -= weight

    def release(self, key: bytes, ticket: Ticket) -> None:
        """Count out what ``admit_ticket`` counted in."""
        self.leave(key, ticket.weight)
        self.bulk_in_flight -= ticket.bulk

    @staticmethod
    def _refused(bucket: _Bucket, now: float, why: str) -> TooManyInFlightError:
        # At once, unless the token did not wait the Retry-After of its last refusal.
        impatient = now < bucket.refused_until
        bucket.refused_until = now + 1
        return TooManyInFlightError(
            f"{why}. Send it again when one of them is answered; retry after 1 s",
            retry_after=1,
            pause=MAX_PAUSE_SECONDS if impatient else 0.0,
        )

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
    neither parsing the body nor a worker thread."""

    def __init__(self, app: ASGIApp, *, limits: TokenLimits, metrics: Metrics) -> None:
        self.app = app
        self.limits = limits
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        key = _limited(scope)
        if key is None:  # not limited: probes, public routes, and the 401s
            await self.app(scope, receive, send)
            return
        head = Head.of(scope)
        try:
            receive, ticket = await self._admit(key, head, receive)
        except ServiceError as err:
            if isinstance(err, RateLimitedError) and err.pause:
                # A client that ignores Retry-After waits anyway: its flood of refusals
                # slows to one per connection per pause, at no cost to the server.
                await asyncio.sleep(err.pause)
            self.metrics.refused.labels(err.code, head.route_class.value).inc()
            await _refuse(err, send)
            return
        if ticket == NOTHING:
            await self.app(scope, receive, send)
            return
        self.metrics.bulk_in_flight.set(self.limits.bulk_in_flight)
        # Counted out as soon as the response is sent: the client's next request may come
        # before this call returns, and must not find itself still in flight.
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self.limits.release(key, ticket)
                self.metrics.bulk_in_flight.set(self.limits.bulk_in_flight)

        async def sending(message: Message) -> None:
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body"):
                release()

        try:
            await self.app(scope, receive, sending)
        finally:
            release()

    async def _admit(self, key: bytes, head: Head, receive: Receive) -> tuple[Receive, Ticket]:
        """Count the request in, or raise the ``ServiceError`` that refuses it. Returns the
        receive to read its body with, and what it counts in flight."""
        now = time.monotonic()
        self.limits.admit(key, now=now)
        if head.method == "POST" and head.path == BLOBS_QUERY:
            receive = await _capped_body(receive, head.body_bytes, cap=MAX_BLOBS_QUERY_BYTES)
        return receive, self.limits.admit_ticket(key, head, now=now)


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


async def _refuse(err: ServiceError, send: Send) -> None:
    """Answer ``err`` without reading the body. The connection stays open: the server reads
    and drops the rest of the body once the answer is sent (uvicorn does, for any answer
    sent before the body was read), and the client reads its answer. Closing it instead
    (``Connection: close``) made the kernel reset a connection whose body was still coming,
    and a client still sending it could lose the answer with it: no HTTP status at all."""
    headers = {"Retry-After": str(err.retry_after)} if isinstance(err, RateLimitedError) else {}
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
        max_bulk=settings.max_bulk_in_flight,
    )
