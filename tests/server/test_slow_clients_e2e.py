"""Slow and idle clients are bounded by client_header_timeout (issue 8, item 13): a
connection that never finishes its headers is closed, a buffered body that does not
arrive in time is a 408, and a streamed upload may not pause longer than that."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable

import pytest

from .conftest import TENANT_KEY, Proxy
from .hostile import address, request_bytes

TIMEOUT = 0.5


@pytest.fixture
async def strict(make_proxy: Callable[..., Awaitable[Proxy]]) -> Proxy:
    return await make_proxy(settings={"client_header_timeout": TIMEOUT})


async def closed_by_server(proxy: Proxy, sent: bytes) -> bytes:
    """Send `sent` and nothing more; what the server answers before closing."""
    reader, writer = await asyncio.open_connection(*address(proxy.base_url))
    try:
        writer.write(sent)
        await writer.drain()
        return await asyncio.wait_for(reader.read(), timeout=30)  # b"" = closed, no answer
    finally:
        writer.close()


async def test_a_connection_that_sends_nothing_is_closed(strict: Proxy) -> None:
    assert await closed_by_server(strict, b"") == b""


async def test_headers_that_never_finish_are_closed(strict: Proxy) -> None:
    partial = b"POST /v1/chat/completions HTTP/1.1\r\nHost: proxy\r\nX-Slow: 1\r\n"
    assert await closed_by_server(strict, partial) == b""


async def test_an_idle_keep_alive_connection_is_closed_after_its_answer(strict: Proxy) -> None:
    reader, writer = await asyncio.open_connection(*address(strict.base_url))
    try:
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: proxy\r\n\r\n")
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout=30)
        assert head.startswith(b"HTTP/1.1 200")
        rest = await asyncio.wait_for(reader.read(), timeout=30)  # body, then the close
        assert rest.endswith(b'{"status": "ok"}')
    finally:
        writer.close()


@pytest.mark.parametrize(
    "path",
    ["/v1/chat/completions", "/v1/responses", "/v1/conversations", "/v1/embeddings"],
)
async def test_a_body_that_never_finishes_is_a_408(strict: Proxy, path: str) -> None:
    whole = request_bytes(
        path, {"model": "gpt-4o", "input": "x"}, {"Authorization": f"Bearer {TENANT_KEY}"}
    )
    answer = await closed_by_server(strict, whole[:-5])  # the body's last bytes never come
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    error = json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]
    assert error["code"] == "request_timeout"
    assert "client_header_timeout" in error["message"]
    assert strict.provider.requests == []


async def test_a_streamed_upload_that_pauses_is_a_408(strict: Proxy) -> None:
    head = (
        b"POST /v1/files HTTP/1.1\r\nHost: proxy\r\n"
        b"Authorization: Bearer " + TENANT_KEY.encode() + b"\r\n"
        b"Content-Type: application/octet-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"5\r\nhello\r\n"
    )
    answer = await closed_by_server(strict, head)
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert b"request_timeout" in answer


async def test_a_client_within_the_timeout_is_served(strict: Proxy) -> None:
    client = strict.client()
    completion = await client.chat.completions.create(
        model="gpt-4o", messages=[{"role": "user", "content": "hi"}]
    )
    assert completion.choices[0].message.content == "ok: hi"
