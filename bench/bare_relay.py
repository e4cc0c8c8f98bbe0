"""The floor any Python hop pays: a bare aiohttp reverse proxy (issue 23's baseline).

    python bench/bare_relay.py PORT UPSTREAM_BASE

It reads the body, forwards it with one `ClientSession`, and streams the answer back as it
comes. Nothing else: no parsing, no store, no policy. bench/overhead.py runs it beside
threadkeeper and reports threadkeeper's cost as a ratio to this one's.
"""

from __future__ import annotations

import sys

import aiohttp
from aiohttp import web

HOP_HEADERS = {"host", "content-length", "transfer-encoding", "connection"}


def create_app(upstream: str) -> web.Application:
    app = web.Application()

    async def session(app: web.Application):  # type: ignore[no-untyped-def]
        app["http"] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        yield
        await app["http"].close()

    async def relay(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_HEADERS}
        url = upstream + request.path_qs
        async with app["http"].request(request.method, url, data=body, headers=headers) as up:
            response = web.StreamResponse(status=up.status)
            if "Content-Type" in up.headers:
                response.content_type = up.content_type
            await response.prepare(request)
            async for chunk in up.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
            return response

    app.cleanup_ctx.append(session)
    app.router.add_route("*", "/{tail:.*}", relay)
    return app


def main() -> None:
    """On uvloop when it imports, as threadkeeper's `serve` is: the loop is not the difference."""
    try:
        import uvloop

        loop = uvloop.new_event_loop()
    except ImportError:
        loop = None
    app = create_app(sys.argv[2])
    web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), print=None, loop=loop)


if __name__ == "__main__":
    main()
