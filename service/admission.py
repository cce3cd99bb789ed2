"""What a request costs, told from its request line and headers before its body is read:
the class of its route, whether it is expensive, and how much it weighs. ``service.limits``
admits or refuses it by these.

- **Priority**: what a restarting job and a training job wait on: the latest resumable
  bundle, heartbeats, and commits. Never refused for a budget of bulk work; a commit still
  counts against its token's expensive requests.
- **Bulk**: reads and passes whose work grows with the catalog or the store, not with the
  request line: lineage and audit events, pages of more than ``BULK_PAGE`` runs, GC and
  scrub passes, unquarantines, and any request with a body over ``LARGE_BODY_BYTES``.
  Held to a budget per token and one per process, so that they cannot take the worker
  threads and the cores from the priority class.
- **Other**: the rest (an agent's small blob queries and records, a run's page).
"""

from __future__ import annotations

import enum
import functools
import re
from dataclasses import dataclass
from urllib.parse import parse_qs

from starlette.types import Scope

# A body larger than this costs real time to parse (an agent's queries and records are
# smaller): the request counts as expensive, whatever its route.
LARGE_BODY_BYTES = 64 << 10
# Parsing and answering a large body costs in proportion to its size: a request counts as
# one more expensive request per this many bytes of body (a query of 10,000 blobs as 4).
WEIGHT_BYTES = 256 << 10
MAX_WEIGHT = 64
# A page of more runs than this reads each one's head and resumable bundle: bulk, weighing
# one more per this many runs (a page of 500 weighs 3).
BULK_PAGE = 100
BULK_PAGE_WEIGHT_RUNS = 250
RUNS_PAGE = "/v1/runs"
_SCOPE_KEY = "ckpt.head"  # Head.of's answer, in the request's ASGI scope


class RouteClass(enum.StrEnum):
    PRIORITY = "priority"
    BULK = "bulk"
    OTHER = "other"


def _routes(*pairs: tuple[str, str]) -> tuple[tuple[str, re.Pattern[str]], ...]:
    return tuple((method, re.compile(path)) for method, path in pairs)


PRIORITY = _routes(
    ("GET", r"/v1/runs/[^/]+/resumable"),
    ("POST", r"/v1/attempts/[^/]+/heartbeat"),
    ("POST", r"/v1/bundles/[^/]+/commit"),
)
# Expensive: counted against the token's CKPT_MAX_EXPENSIVE_PER_TOKEN. Commits and
# re-verification read blobs back, gc and the scrubber walk everything.
EXPENSIVE = _routes(
    ("POST", r"/v1/bundles/[^/]+/(commit|unquarantine)"),
    ("POST", r"/v1/(gc|scrub)"),
    ("GET", r"/v1/runs/[^/]+/(lineage|events)"),
    ("GET", r"/v1/bundles/[^/]+/events"),
)


@dataclass(frozen=True)
class Head:
    """What the limits look at: the request line and headers, never the body."""

    method: str
    path: str
    body_bytes: int | None  # as declared; None: streamed (chunked) or unreadable
    page: int = 0  # the runs a GET /v1/runs asks for (its ``limit``); 0 for other routes

    @classmethod
    def of(cls, scope: Scope) -> Head:
        """The request's head, read once: kept in its scope for the middlewares after the
        first (the limits, the priority count, the bulk turns)."""
        head: Head | None = scope.get(_SCOPE_KEY)
        if head is None:
            head = scope[_SCOPE_KEY] = cls._read(scope)
        return head

    @classmethod
    def _read(cls, scope: Scope) -> Head:
        headers = dict(scope["headers"])
        declared = headers.get(b"content-length")
        if declared is not None:
            size = int(declared) if declared.isdigit() else None
        else:
            size = None if b"transfer-encoding" in headers else 0
        method, path = scope["method"], scope["path"]
        page = _page(scope) if (method, path) == ("GET", RUNS_PAGE) else 0
        return cls(method=method, path=path, body_bytes=size, page=page)

    @property
    def large(self) -> bool:
        """A body of unknown or large size: parsing it costs the server real time."""
        return self.body_bytes is None or self.body_bytes > LARGE_BODY_BYTES

    @functools.cached_property
    def route_class(self) -> RouteClass:
        if _matches(self, PRIORITY):
            return RouteClass.PRIORITY
        if self.expensive:
            return RouteClass.BULK
        return RouteClass.OTHER

    @property
    def expensive(self) -> bool:
        """A route of ``EXPENSIVE``, a large page of runs, or any request with a large body."""
        return self.large or self.page > BULK_PAGE or _matches(self, EXPENSIVE)

    @property
    def weight(self) -> int:
        """How many expensive requests it counts as: one, and one more per
        ``WEIGHT_BYTES`` of body (a streamed body counts as the largest) or per
        ``BULK_PAGE_WEIGHT_RUNS`` runs of a page."""
        if self.body_bytes is None:
            return MAX_WEIGHT
        extra = self.body_bytes // WEIGHT_BYTES + self.page // BULK_PAGE_WEIGHT_RUNS
        return min(MAX_WEIGHT, 1 + extra)


def _matches(head: Head, routes: tuple[tuple[str, re.Pattern[str]], ...]) -> bool:
    return any(head.method == verb and pattern.fullmatch(head.path) for verb, pattern in routes)


def _page(scope: Scope) -> int:
    """The ``limit`` a page of runs asks for; a value the route will refuse (422) counts 0."""
    query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
    text = query.get("limit", [""])[-1]
    return int(text) if text.isdigit() and len(text) < 7 else 0
