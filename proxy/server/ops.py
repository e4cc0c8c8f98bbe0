"""Health, readiness and Prometheus metrics."""

from __future__ import annotations

import structlog
from aiohttp import web

from proxy.server.state import METRICS, POLICIES, STORE

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
    try:
        await request.app[STORE].ping()
    except Exception as exc:  # readiness reports, it does not raise
        log.warning("store_unreachable", error=repr(exc))
        return False
    return True


async def metrics(request: web.Request) -> web.Response:
    body, content_type = request.app[METRICS].render()
    response = web.Response(body=body)
    response.headers["Content-Type"] = content_type
    return response
