"""Every other /v1/* path: method, query, headers and body relayed, streamed both ways."""

from __future__ import annotations

from collections.abc import AsyncIterator

from aiohttp import web

from proxy.server.relay import relay_response, send_upstream
from proxy.server.state import TENANT_POLICY


async def _request_body(request: web.Request) -> AsyncIterator[bytes]:
    async for chunk in request.content.iter_any():
        yield chunk


async def passthrough(request: web.Request) -> web.StreamResponse:
    path = request.match_info["tail"]
    body: bytes | AsyncIterator[bytes] | None = None
    if request.body_exists:
        # Small bodies are read so a failed attempt can be retried; uploads stream.
        length = request.content_length
        if length is not None and length <= 1024 * 1024:
            body = await request.read()
        else:
            body = _request_body(request)
    upstream = await send_upstream(
        request,
        request[TENANT_POLICY],
        path="/" + path,
        body=body,
        stream=True,
        route="passthrough",
        retry=isinstance(body, bytes | None),
    )
    return await relay_response(request, upstream, family=None, extra_headers={})
