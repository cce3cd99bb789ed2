"""FastAPI dependencies, as typed aliases so that route signatures read like sentences."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Header, Path, Request

from ckpt.service.auth.service import Principal, authenticate
from ckpt.service.context import Context
from ckpt.service.names import MAX_ID, RUN_NAME_PATTERN


def get_context(request: Request) -> Context:
    context: Context = request.app.state.context
    return context


ContextDep = Annotated[Context, Depends(get_context)]


def get_principal(
    request: Request,
    context: ContextDep,
    authorization: Annotated[str | None, Header()] = None,
) -> Principal:
    return authenticate(
        context, authorization=authorization, admin_token=request.app.state.admin_token
    )


PrincipalDep = Annotated[Principal, Depends(get_principal)]


IdPath = Annotated[int, Path(ge=1, le=MAX_ID, description="a catalog id")]
RunPath = Annotated[str, Path(pattern=RUN_NAME_PATTERN, description="the run's name")]
