"""Bearer token -> tenant policy and store namespace (SPEC section 1, "Tenants and policy
files").

Every store call of a request reads and writes under `request[NAMESPACE]`, set here and
nowhere else: a keyed tenant's id, or, for a key no policy lists (passthrough mode,
`allow_unknown_keys: true`), a namespace of that key alone, so callers of unknown keys
never see each other's conversations, responses, threads, ledger entries or
Idempotency-Key records. The naming is proxy/namespaces.py's: the log line carries
`tenant` and `namespace`, metrics the tenant only (low cardinality).
"""

from __future__ import annotations

from aiohttp import web

from proxy.logs import register_secret
from proxy.namespaces import caller_namespace, fields
from proxy.policy import Policy, hash_key
from proxy.server.errors import ApiError
from proxy.server.state import LOG_FIELDS, NAMESPACE, POLICIES, TENANT_POLICY, TRACING


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


def store_namespace(policy: Policy, token: str | None) -> str:
    """The tenant id this caller's local state lives under: the policy's tenant when the
    key is one the policy lists, else `<tenant>:<caller hash>` (as if the key were a
    tenant of its own)."""
    if token is not None and hash_key(token) in policy.api_keys:
        return policy.tenant
    return caller_namespace(policy.tenant, token)


def authorize(request: web.Request) -> None:
    """The auth step of every request (app.request_middleware): the API paths need a
    known bearer token; health, readiness and metrics do not."""
    if request.path.startswith(("/v1/", "/threadkeeper/v1/")):
        with request.app[TRACING].span("auth"):
            authenticate(request)


def authenticate(request: web.Request) -> None:
    """The tenant policy and store namespace of the request's bearer token, or a 401."""
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
    namespace = store_namespace(policy, token)
    request[NAMESPACE] = namespace
    request[LOG_FIELDS].update(fields(namespace))  # metrics read its "tenant" only
