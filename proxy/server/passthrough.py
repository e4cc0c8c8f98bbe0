"""Every other /v1/* path: method, query, headers and body relayed, streamed both ways."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from aiohttp import web

from proxy.server.errors import ApiError
from proxy.server.relay import Passthrough, relay_answer, send_upstream
from proxy.server.state import SETTINGS, TENANT_POLICY

# Bodies up to this size are read so a failed attempt can be retried; larger ones (and
# those of unknown size) stream upstream as they arrive.
MAX_BUFFERED_BODY = 1024 * 1024


class ClientTooSlow(ApiError):
    """A 408: the client's body did not arrive within client_header_timeout. The
    connection is closed after it (app.read_body_in_time), not drained."""

    def __init__(self, seconds: float, what: str = "did not arrive within") -> None:
        super().__init__(
            408,
            f"The request body {what} {seconds:g} s (client_header_timeout).",
            code="request_timeout",
        )


def streams_upload(request: web.Request) -> bool:
    """Whether this request's body streams upstream instead of being read first."""
    if not request.body_exists or request.match_info.route.name != "passthrough":
        return False
    length = request.content_length
    return length is None or length > MAX_BUFFERED_BODY


async def _request_body(request: web.Request) -> AsyncIterator[bytes]:
    """The upload as it arrives; a client that pauses longer than client_header_timeout
    between two chunks is cut off."""
    timeout = request.app[SETTINGS].client_header_timeout
    while True:
        try:
            async with asyncio.timeout(timeout):
                chunk = await request.content.readany()
        except TimeoutError:
            raise ClientTooSlow(timeout, "paused for more than") from None
        if not chunk:
            return
        yield chunk


async def passthrough(request: web.Request) -> web.StreamResponse:
    """Also serves a local route's request that its tenant's policy sends upstream
    (compaction.mode: upstream), which has no `tail`."""
    path = request.match_info.get("tail") or request.path.removeprefix("/v1/")
    body: bytes | AsyncIterator[bytes] | None = None
    if request.body_exists:
        body = _request_body(request) if streams_upload(request) else await request.read()
    upstream = await send_upstream(
        request,
        request[TENANT_POLICY],
        path="/" + path,
        body=body,
        stream=True,
        route="passthrough",
        retry=isinstance(body, bytes | None),
    )
    return await relay_answer(request, upstream, None, Passthrough(None), extra_headers={})
