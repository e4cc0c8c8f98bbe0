"""The proxy and its fake provider on an event loop of their own, for synchronous clients.

schemathesis and hypothesis drive their examples synchronously; running the servers in a
background thread (the same `make_proxy` as the end-to-end tests, through
`proxy_factory`) lets each example make a real request over a real socket without
sharing, or blocking, the servers' loop.

    with live_proxy(tmp_path) as live:
        status, headers, body = raw_request(live.port, "POST", "/v1/responses", body=b"{")
        live.store_path  # the SQLite file, for tests/reliability/storecheck.py
"""

from __future__ import annotations

import asyncio
import http.client
import socket
import threading
from collections.abc import Coroutine, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

from proxy.fake_provider import FakeProvider
from proxy.server.state import SETTINGS
from tests.reliability.storecheck import sqlite_file
from tests.server.conftest import Proxy, proxy_factory

T = TypeVar("T")
START_TIMEOUT = 30.0


@dataclass
class LiveProxy:
    proxy: Proxy
    provider: FakeProvider
    loop: asyncio.AbstractEventLoop

    @property
    def base_url(self) -> str:
        """`http://127.0.0.1:<port>/v1`."""
        return self.proxy.base_url

    @property
    def port(self) -> int:
        port = urlsplit(self.proxy.base_url).port
        assert port is not None
        return port

    @property
    def store_path(self) -> Path:
        return sqlite_file(self.proxy.app[SETTINGS].store_url)  # type: ignore[index]

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 60) -> T:
        """Run a coroutine on the servers' loop (e.g. to script the provider)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)


@contextmanager
def live_proxy(directory: Path, **options: Any) -> Iterator[LiveProxy]:
    """`make_proxy(**options)` serving from a background thread until the block exits."""
    ready = threading.Event()
    started: list[LiveProxy] = []
    failed: list[BaseException] = []
    stop: list[asyncio.Event] = []

    async def serve() -> None:
        stop.append(asyncio.Event())
        provider = FakeProvider()
        await provider.start()
        try:
            async with proxy_factory(directory, provider) as factory:
                proxy = await factory(**options)
                started.append(LiveProxy(proxy, provider, asyncio.get_running_loop()))
                ready.set()
                await stop[0].wait()
        finally:
            await provider.stop()

    def main() -> None:
        try:
            asyncio.run(serve())
        except BaseException as error:
            failed.append(error)
        finally:
            ready.set()

    thread = threading.Thread(target=main, name="live-proxy", daemon=True)
    thread.start()
    ready.wait(START_TIMEOUT)
    if not started:
        thread.join(START_TIMEOUT)
        raise RuntimeError("the live proxy did not start") from (failed[0] if failed else None)
    live = started[0]
    try:
        yield live
    finally:
        live.loop.call_soon_threadsafe(stop[0].set)
        thread.join(START_TIMEOUT)
        if failed:
            raise failed[0]


@dataclass(frozen=True)
class RawResponse:
    status: int
    headers: http.client.HTTPMessage
    body: bytes


def raw_request(
    port: int,
    method: str,
    path: str,
    *,
    headers: Sequence[tuple[bytes, bytes]] = (),
    body: bytes = b"",
    timeout: float = 60,
) -> RawResponse:
    """One HTTP/1.1 request written byte for byte (no client-side validation or
    re-encoding of headers or body), on its own connection."""
    lines = [f"{method} {path} HTTP/1.1".encode(), b"Host: 127.0.0.1", b"Connection: close"]
    lines += [name + b": " + value for name, value in headers]
    lines.append(b"Content-Length: " + str(len(body)).encode())
    request = b"\r\n".join(lines) + b"\r\n\r\n" + body
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        try:
            sock.sendall(request)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server answered (413, 400) before reading the whole body
        response = http.client.HTTPResponse(sock, method=method)
        response.begin()
        try:
            return RawResponse(response.status, response.headers, response.read())
        finally:
            response.close()
