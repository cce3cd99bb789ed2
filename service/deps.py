"""FastAPI dependencies, as typed aliases so that route signatures read like sentences."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Annotated, TypeVar

import anyio.to_thread
from anyio import CapacityLimiter
from fastapi import Depends, Path, Request, Security
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BeforeValidator

from service.auth.principal import Principal
from service.auth.service import Bearer, authenticate
from service.context import Context
from service.names import MAX_ID, MAX_RANK, RUN_NAME_PATTERN
from service.settings import admin_tokens

T = TypeVar("T")


async def get_context(request: Request) -> Context:
    """``async``: a plain attribute, not worth a trip to a worker thread."""
    context: Context = request.app.state.context
    return context


ContextDep = Annotated[Context, Depends(get_context)]


# The API description's security scheme. It refuses nothing itself (``auto_error=False``):
# ``authenticate`` answers a missing or malformed token with the API's own 401 body.
bearer = HTTPBearer(
    scheme_name="bearer",
    description="a token from 'ckpt token create', or the admin token (CKPT_ADMIN_TOKEN)",
    auto_error=False,
)


def get_principal(
    request: Request,
    context: ContextDep,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Security(bearer)],
) -> Principal:
    authorization = f"{credentials.scheme} {credentials.credentials}" if credentials else None
    return authenticate(
        context,
        authorization=authorization,
        admin_tokens=admin_tokens(request.app.state.admin_token),
    )


PrincipalDep = Annotated[Principal, Depends(get_principal)]


@dataclass(frozen=True)
class Priority:
    """A request of the priority class (``service.admission``: what a training job and a
    restarting one wait on), served in a worker thread of the class's own
    (``CKPT_PRIORITY_THREADS``), which no other request takes: bulk and other requests
    that hold every other thread (a slow lineage, a flood waiting on a lock) leave it
    served. Authenticated in the same thread as its work: one trip to a thread, not two."""

    context: Context
    token: Bearer
    threads: CapacityLimiter

    async def serve(self, work: Callable[[Context, Principal], T]) -> T:
        """``work(context, principal)`` in a priority thread."""

        def authenticated() -> T:
            return work(self.context, self.token.principal())

        return await anyio.to_thread.run_sync(authenticated, limiter=self.threads)

    async def serve_bearer(self, work: Callable[[Context, Bearer], T]) -> T:
        """``work(context, token)`` in a priority thread, for work that checks the token
        itself: a heartbeat, in its one statement (``runs.beats``)."""
        authenticating = partial(work, self.context, self.token)
        return await anyio.to_thread.run_sync(authenticating, limiter=self.threads)


async def get_priority(
    request: Request,
    context: ContextDep,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Security(bearer)],
) -> Priority:
    authorization = f"{credentials.scheme} {credentials.credentials}" if credentials else None
    token = Bearer(context, authorization, admin_tokens(request.app.state.admin_token))
    return Priority(context=context, token=token, threads=request.app.state.priority_threads)


PriorityDep = Annotated[Priority, Depends(get_priority)]


def _digits(text: object) -> object:
    """A path number as plain decimal digits: ``1.0``, `` 1``, ``+1``, ``01`` and ``1_0``
    would all be read as 1 (or 10) by a lax integer parser, and name one row many ways. (A
    minus sign passes, for the range check to refuse with its own message.)"""
    if isinstance(text, str) and not re.fullmatch(r"-?(0|[1-9][0-9]*)", text):
        raise ValueError(f"{text!r} is not a number: write it in decimal digits only")
    return text


# The bounds before the validator: after it, FastAPI writes them into the API description as
# "ge"/"le" (which JSON Schema ignores), not as "minimum"/"maximum".
IdPath = Annotated[int, Path(ge=1, le=MAX_ID, description="a catalog id"), BeforeValidator(_digits)]
RankPath = Annotated[
    int, Path(ge=0, le=MAX_RANK, description="a rank of the bundle"), BeforeValidator(_digits)
]
RunPath = Annotated[str, Path(pattern=RUN_NAME_PATTERN, description="the run's name")]
