"""OpenAI's error envelope, and `error_for`, which puts every failure into it.

Every error leaves the proxy as `{"error": {"message", "type", "param", "code"}}` with the
matching status (SPEC section 1). Bad input is a 4xx naming the problem; a store that
cannot serve (StoreUnavailable: unreachable, past the store timeouts, disk full) is a 503
with Retry-After; an unexpected exception is a logged 500 carrying the request id, and the
server keeps serving.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable

import structlog
from aiohttp import web

# OpenAI's error as a value is pure (the CLI raises it too); handlers import it from here.
from proxy.core.validate import ApiError as ApiError
from proxy.core.validate import error_body as error_body
from proxy.core.validate import invalid as invalid
from proxy.server.state import REQUEST_ID
from proxy.store.base import StoreUnavailable

log = structlog.get_logger("threadkeeper.http")

STORE_RETRY_AFTER_SECONDS = 1

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def error_response(error: ApiError, request_id: str | None = None) -> web.Response:
    headers = dict(error.headers)
    if request_id:
        headers["x-threadkeeper-request-id"] = request_id
    return web.Response(
        status=error.status,
        body=json.dumps(error.body()).encode(),
        content_type="application/json",
        headers=headers,
    )


_HTTP_ERRORS: dict[int, tuple[str, str | None]] = {
    404: ("invalid_request_error", "unknown_url"),
    405: ("invalid_request_error", "method_not_allowed"),
    413: ("invalid_request_error", "request_too_large"),
}


def from_http_exception(exc: web.HTTPException, request: web.Request) -> ApiError:
    kind, code = _HTTP_ERRORS.get(exc.status, ("invalid_request_error", None))
    if exc.status == 404:
        message = f"Invalid URL ({request.method} {request.path})"
    elif exc.status == 405:
        message = f"Method {request.method} is not allowed on {request.path}"
    elif exc.status == 413:
        message = f"Request body too large: {exc.text or 'the limit is exceeded'}"
    else:
        message = exc.reason
    if exc.status >= 500:
        kind = "server_error"
    return ApiError(exc.status, message, type=kind, code=code)


def store_unavailable(exc: StoreUnavailable, request_id: str | None) -> ApiError:
    """The 503 for a store that cannot serve now; the cause is logged, not sent."""
    log.warning("store_unavailable", request_id=request_id, error=str(exc))
    return ApiError(
        503,
        f"The proxy's store is temporarily unavailable; retry shortly (request id {request_id}).",
        type="server_error",
        code="store_unavailable",
        headers={"Retry-After": str(STORE_RETRY_AFTER_SECONDS)},
    )


def error_for(request: web.Request, exc: Exception) -> web.Response | None:
    """OpenAI's error answer to what a request's steps raised (app.request_middleware
    calls this in its `except`); None: the exception must propagate (a redirect, or a
    connection error of a client that is gone: nobody to answer, aiohttp ends it)."""
    request_id = request.get(REQUEST_ID)
    if isinstance(exc, ApiError):
        return error_response(exc, request_id)
    if isinstance(exc, web.HTTPException):
        if exc.status < 400:
            return None
        return error_response(from_http_exception(exc, request), request_id)
    if isinstance(exc, StoreUnavailable):
        return error_response(store_unavailable(exc, request_id), request_id)
    if isinstance(exc, ConnectionError) and _client_gone(request):
        return None
    return _unhandled(request, request_id)


def _client_gone(request: web.Request) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()


def _unhandled(request: web.Request, request_id: str | None) -> web.Response:
    log.exception("unhandled_error", request_id=request_id, path=request.path)
    error = ApiError(
        500,
        f"The server had an error while processing your request (request id {request_id}).",
        type="server_error",
    )
    return error_response(error, request_id)
