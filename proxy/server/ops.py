"""Health, readiness and Prometheus metrics."""

from __future__ import annotations

from aiohttp import web

from proxy.server.state import METRICS, POLICIES


async def healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def readyz(request: web.Request) -> web.Response:
    checks = {"policies": bool(request.app[POLICIES].tenants())}
    ready = all(checks.values())
    return web.json_response(
        {"status": "ready" if ready else "not_ready", "checks": checks},
        status=200 if ready else 503,
    )


async def metrics(request: web.Request) -> web.Response:
    body, content_type = request.app[METRICS].render()
    response = web.Response(body=body)
    response.headers["Content-Type"] = content_type
    return response
