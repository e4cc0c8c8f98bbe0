"""Bearer token -> tenant policy (SPEC section 1, "Tenants and policy files")."""

from __future__ import annotations

from aiohttp import web

from proxy.logs import register_secret
from proxy.server.errors import ApiError, Handler
from proxy.server.state import LOG_FIELDS, POLICIES, TENANT_POLICY


def bearer_token(request: web.Request) -> str | None:
    header = request.headers.get("Authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def is_utf8(value: str) -> bool:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


@web.middleware
async def auth_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    if not request.path.startswith(("/v1/", "/threadkeeper/v1/")):
        return await handler(request)
    token = bearer_token(request)
    if token is not None and not is_utf8(token):
        # aiohttp hands undecodable header bytes over as lone surrogates (surrogateescape)
        raise ApiError(
            401, "Incorrect API key provided: the key is not valid UTF-8.", code="invalid_api_key"
        )
    if token is not None:
        register_secret(token)
    policy = request.app[POLICIES].resolve(token)
    if policy is None:
        if token is None:
            message = (
                "You didn't provide an API key. You need to provide your API key in an "
                "Authorization header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY)."
            )
        else:
            message = "Incorrect API key provided. This key is not known to this proxy."
        raise ApiError(401, message, code="invalid_api_key")
    request[TENANT_POLICY] = policy
    request[LOG_FIELDS]["tenant"] = policy.tenant
    return await handler(request)
