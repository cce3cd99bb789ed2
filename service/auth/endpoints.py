from __future__ import annotations

from fastapi import APIRouter

from service.auth import service
from service.auth.schemas import TokenCreate, TokenCreated, TokenOut
from service.deps import ContextDep, IdPath, PrincipalDep
from service.errors import ForbiddenError, InvalidRequestError, NotFoundError, responses

router = APIRouter(prefix="/v1/tokens", tags=["tokens"])


@router.post("", status_code=201, responses=responses(ForbiddenError, InvalidRequestError))
def create_token(
    request: TokenCreate, principal: PrincipalDep, context: ContextDep
) -> TokenCreated:
    """Create a token (admin only). The secret is in this response and nowhere else."""
    service.require_admin(principal)
    return service.create_token(context, request)


@router.get("", responses=responses(ForbiddenError))
def list_tokens(principal: PrincipalDep, context: ContextDep) -> list[TokenOut]:
    service.require_admin(principal)
    return service.list_tokens(context)


@router.delete(
    "/{token_id}", responses=responses(ForbiddenError, NotFoundError, InvalidRequestError)
)
def revoke_token(token_id: IdPath, principal: PrincipalDep, context: ContextDep) -> TokenOut:
    service.require_admin(principal)
    return service.revoke_token(context, token_id=token_id)
