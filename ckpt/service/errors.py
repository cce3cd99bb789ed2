"""Errors the control plane raises on purpose, each mapped to one HTTP status by one handler.

    ServiceError                  -- 500; the base of everything below
    ├── InvalidRequestError       422  the request is well-formed JSON but asks for something impossible
    ├── UnauthorizedError         401  no bearer token, or an unknown or revoked one
    ├── ForbiddenError            403  the token may not do this (read-only, another run's)
    ├── NotFoundError             404  no such run, attempt, bundle or token
    ├── ConflictError             409  the request disagrees with the catalog's state
    │   ├── FencedError           409  a newer attempt of the run registered; this one must stop
    │   ├── IncompleteError       409  commit: parts of the bundle are missing (listed in the body)
    │   └── IntactError           409  quarantine: the blob named as damaged reads back intact
    ├── PayloadTooLargeError      413  the body exceeds CKPT_MAX_BODY_BYTES (or the route's own cap)
    ├── RateLimitedError          429  the token sent too many requests: retry after Retry-After
    │   └── TooManyInFlightError  429  the token has too many expensive requests in flight
    └── StoreUnavailableError     503  the object store could not be read or written

Services raise these, never ``HTTPException``; the body is always
``{"error": <code>, "message": <what happened and what to do>, ...details}``.
"""

from __future__ import annotations

from typing import Any


class ServiceError(Exception):
    status = 500
    code = "internal"

    def __init__(self, message: str, **details: Any) -> None:
        super().__init__(message)
        self.message = message
        self.details = details

    def body(self) -> dict[str, Any]:
        return {"error": self.code, "message": self.message, **self.details}


class InvalidRequestError(ServiceError):
    status = 422
    code = "invalid_request"


class UnauthorizedError(ServiceError):
    status = 401
    code = "unauthorized"


class ForbiddenError(ServiceError):
    status = 403
    code = "forbidden"


class NotFoundError(ServiceError):
    status = 404
    code = "not_found"


class ConflictError(ServiceError):
    status = 409
    code = "conflict"


class FencedError(ConflictError):
    code = "fenced"


class IncompleteError(ConflictError):
    code = "incomplete"


class IntactError(ConflictError):
    code = "intact"


class PayloadTooLargeError(ServiceError):
    status = 413
    code = "payload_too_large"


class RateLimitedError(ServiceError):
    """Refused before any work; ``retry_after`` (seconds) goes out as ``Retry-After``, after
    a ``pause`` (seconds) that slows a client down that does not wait by itself."""

    status = 429
    code = "rate_limited"

    def __init__(
        self, message: str, *, retry_after: int, pause: float = 0.0, **details: Any
    ) -> None:
        super().__init__(message, retry_after=retry_after, **details)
        self.retry_after = retry_after
        self.pause = pause


class TooManyInFlightError(RateLimitedError):
    code = "too_many_in_flight"


class StoreUnavailableError(ServiceError):
    status = 503
    code = "store_unavailable"
