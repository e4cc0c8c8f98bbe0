"""Health, readiness and Prometheus metrics."""

from __future__ import annotations

import asyncio
import hmac

import structlog
from aiohttp import web

from proxy.logs import register_secret
from proxy.server.auth import bearer_token
from proxy.server.errors import ApiError
from proxy.server.recovery import heartbeat
from proxy.server.state import CLOCK, METRICS, OWNER, POLICIES, SETTINGS, STORE

log = structlog.get_logger("threadkeeper.ops")


async def healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def readyz(request: web.Request) -> web.Response:
    checks = {"policies": bool(request.app[POLICIES].tenants()), "store": await _store_ok(request)}
    ready = all(checks.values())
    return web.json_response(
        {"status": "ready" if ready else "not_ready", "checks": checks},
        status=200 if ready else 503,
    )


async def _store_ok(request: web.Request) -> bool:
    """The store is reachable and takes a write: ping, then this process's heartbeat row
    is upserted (a real write transaction), within store_connect_timeout."""
    store = request.app[STORE]
    try:
        async with asyncio.timeout(request.app[SETTINGS].store_connect_timeout):
            await store.ping()
            await heartbeat(store, request.app[OWNER], now=request.app[CLOCK].now())
    except Exception as exc:  # readiness reports, it does not raise
        log.warning("store_not_ready", error=repr(exc))
        return False
    return True


async def metrics(request: web.Request) -> web.Response:
    """Prometheus text; with `metrics_token` set, only for `Authorization: Bearer <it>`."""
    _check_metrics_token(request)
    body, content_type = request.app[METRICS].render()
    response = web.Response(body=body)
    response.headers["Content-Type"] = content_type
    return response


def _check_metrics_token(request: web.Request) -> None:
    expected = request.app[SETTINGS].metrics_token
    if expected is None:
        return
    register_secret(expected)
    given = bearer_token(request)
    if given is None or not hmac.compare_digest(_bytes(given), _bytes(expected)):
        raise ApiError(
            401,
            "GET /metrics needs the metrics token: Authorization: Bearer <metrics_token>.",
            code="invalid_api_key",
            headers={"WWW-Authenticate": 'Bearer realm="metrics"'},
        )


def _bytes(text: str) -> bytes:
    return text.encode("utf-8", "surrogateescape")
