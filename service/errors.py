"""Errors the control plane raises on purpose, each mapped to one HTTP status by one handler.

    ServiceError                    -- 500; the base of everything below
    ├── InvalidRequestError         422  the request is malformed (not JSON, wrong types) or asks for something impossible
    ├── UnauthorizedError           401  no bearer token, or an unknown, revoked or expired one
    ├── ForbiddenError              403  the token may not do this (read-only, another run's)
    ├── NotFoundError               404  no such run, attempt, bundle or token
    ├── ConflictError               409  the request disagrees with the catalog's state
    │   ├── FencedError             409  a newer attempt of the run registered; this one must stop
    │   ├── IncompleteError         409  parts of the bundle are missing or bad (listed in the body)
    │   └── IntactError             409  quarantine: the blob named as damaged reads back intact
    ├── PayloadTooLargeError        413  the body exceeds CKPT_MAX_BODY_BYTES (or the route's own cap)
    ├── RateLimitedError            429  the token sent too many requests: retry after Retry-After
    │   └── TooManyInFlightError    429  the token has too many expensive requests in flight
    ├── StoreUnavailableError       503  the object store could not be read or written
    ├── RetryError                  503  the database aborted the request (a conflict, a dead connection)
    └── DatabaseUnavailableError    503  the catalog database failed

Services raise these, never ``HTTPException``; the body is always
``{"error": <code>, "message": <what happened and what to do>, ...details}``, documented in
the API description by the models below (``ErrorBody`` and, for the errors with details,
its subclasses). A route declares the errors it raises with ``responses(...)``.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from service.completeness import Missing


class ErrorBody(BaseModel):
    """The body of every error: a code to branch on, a sentence to show, and for some codes
    details (named by the code's own model)."""

    model_config = ConfigDict(extra="allow")

    error: str = Field(description="what went wrong, as a stable code: 'not_found', 'fenced'...")
    message: str = Field(description="what happened and what to check, for a person")


class InvalidRequestBody(ErrorBody):
    error: Literal["invalid_request"]
    problems: list[str] = Field(
        default_factory=list,
        description="each offending field and why ('body.step: Input should be greater than "
        "or equal to 0'); absent when the request is well-formed but impossible",
    )


class FencedBody(ErrorBody):
    error: Literal["fenced"]
    run_epoch: int = Field(description="the run's current epoch: the attempt that holds it")


class IncompleteBody(ErrorBody):
    error: Literal["incomplete"]
    missing: Missing


class IntactBody(ErrorBody):
    error: Literal["intact"]
    blob: str = Field(description="the blob named as damaged, which reads back whole")


class ConflictBody(ErrorBody):
    error: Literal["conflict"]


class RateLimitedBody(ErrorBody):
    error: Literal["rate_limited", "too_many_in_flight"]
    retry_after: int = Field(description="seconds to wait before sending again (Retry-After)")


# A response header as the API description documents it: its description and schema.
Headers = Mapping[str, Mapping[str, Any]]
RETRY_AFTER = {"description": "seconds to wait before sending again", "schema": {"type": "integer"}}


class ServiceError(Exception):
    """An unexpected failure of the service."""

    status = 500
    code = "internal"
    body_model: ClassVar[type[ErrorBody]] = ErrorBody
    headers: ClassVar[Headers] = {}  # documented response headers

    def __init__(self, message: str, **details: Any) -> None:
        super().__init__(message)
        self.message = message
        self.details = details

    def body(self) -> dict[str, Any]:
        return {"error": self.code, "message": self.message, **self.details}


class InvalidRequestError(ServiceError):
    """The request is malformed (not JSON, a field of the wrong type or out of range) or
    asks for something impossible; ``problems`` names the offending fields."""

    status = 422
    code = "invalid_request"
    body_model = InvalidRequestBody


class UnauthorizedError(ServiceError):
    """No bearer token, or an unknown, revoked or expired one."""

    status = 401
    code = "unauthorized"
    headers: ClassVar[Headers] = {
        "WWW-Authenticate": {"description": "Bearer", "schema": {"type": "string"}}
    }


class ForbiddenError(ServiceError):
    """The token may not do this (a read token writing, a run token touching another run,
    a non-admin on an admin endpoint)."""

    status = 403
    code = "forbidden"


class NotFoundError(ServiceError):
    """No such run, attempt, bundle or token."""

    status = 404
    code = "not_found"


class ConflictError(ServiceError):
    """The request disagrees with the catalog's state."""

    status = 409
    code = "conflict"
    body_model: ClassVar[type[ErrorBody]] = ConflictBody


class FencedError(ConflictError):
    """A newer attempt of the run registered, or the run was rolled back: this attempt must
    stop writing."""

    code = "fenced"
    body_model = FencedBody


class IncompleteError(ConflictError):
    """Parts of the bundle are missing or bad: exactly which, in ``missing``."""

    code = "incomplete"
    body_model = IncompleteBody


class IntactError(ConflictError):
    """The blob named as damaged reads back intact: nothing was quarantined."""

    code = "intact"
    body_model = IntactBody


class PayloadTooLargeError(ServiceError):
    """The body exceeds CKPT_MAX_BODY_BYTES, or the route's own cap."""

    status = 413
    code = "payload_too_large"


class RateLimitedError(ServiceError):
    """The token made more requests than its rate allows: retry after ``Retry-After``.

    Refused before any work; ``retry_after`` (seconds) goes out as ``Retry-After``, after a
    ``pause`` (seconds) that slows a client down that does not wait by itself.
    """

    status = 429
    code = "rate_limited"
    body_model = RateLimitedBody
    headers: ClassVar[Headers] = {"Retry-After": RETRY_AFTER}

    def __init__(
        self, message: str, *, retry_after: int, pause: float = 0.0, **details: Any
    ) -> None:
        super().__init__(message, retry_after=retry_after, **details)
        self.retry_after = retry_after
        self.pause = pause


class TooManyInFlightError(RateLimitedError):
    """The token already has CKPT_MAX_EXPENSIVE_PER_TOKEN expensive requests in flight:
    retry once one of them is answered."""

    code = "too_many_in_flight"


class StoreUnavailableError(ServiceError):
    """The object store could not be read or written."""

    status = 503
    code = "store_unavailable"


class RetryError(ServiceError):
    """The database aborted the request (a deadlock, a busy database, a pooled connection
    found dead): send it again after ``Retry-After``."""

    status = 503
    code = "retry"
    headers: ClassVar[Headers] = {"Retry-After": RETRY_AFTER}


class DatabaseUnavailableError(ServiceError):
    """The catalog database failed (the server's log says how)."""

    status = 503
    code = "database_unavailable"


# What any authenticated request may meet, whatever its route: its token refused or over its
# limits, its body too large, the database failing. (A route that reads or writes the store
# names StoreUnavailableError itself.)
EVERY_REQUEST: tuple[type[ServiceError], ...] = (
    UnauthorizedError,
    PayloadTooLargeError,
    RateLimitedError,
    TooManyInFlightError,
    RetryError,
    DatabaseUnavailableError,
)


def responses(*kinds: type[ServiceError]) -> dict[int | str, dict[str, Any]]:
    """The ``responses=`` of an authenticated route that raises ``kinds`` (and those of
    ``EVERY_REQUEST``): each status once, with what each of its codes means, its body (one
    model, or one of several told apart by ``error``) and its headers."""
    by_status: dict[int, list[type[ServiceError]]] = {}
    for kind in (*EVERY_REQUEST, *kinds):
        if kind not in by_status.setdefault(kind.status, []):
            by_status[kind.status].append(kind)
    return {status: _response(group) for status, group in sorted(by_status.items())}


def _response(kinds: list[type[ServiceError]]) -> dict[str, Any]:
    models = list(dict.fromkeys(kind.body_model for kind in kinds))
    headers = {name: header for kind in kinds for name, header in kind.headers.items()}
    return {
        "model": models[0] if len(models) == 1 else _one_of(models),
        "description": "\n\n".join(f"`{kind.code}`: {_summary(kind)}" for kind in kinds),
        **({"headers": headers} if headers else {}),
    }


def _one_of(models: list[type[ErrorBody]]) -> Any:
    """The models as one body, told apart by their ``error`` (each names its own codes)."""
    if ErrorBody in models:
        raise TypeError(f"give each of {models} its own error code to tell them apart")
    return Annotated[functools.reduce(operator.or_, models), Field(discriminator="error")]


def _summary(kind: type[ServiceError]) -> str:
    """The first paragraph of the kind's docstring, on one line, in Markdown."""
    first = (kind.__doc__ or kind.code).split("\n\n")[0]
    return " ".join(first.split()).replace("``", "`")
