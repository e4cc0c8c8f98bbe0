"""A whole answer is written before the request's own bookkeeping (app.sent): the client
has every byte of it, headers included, before its metrics, log line and explain record
are made; a client gone during the write is logged and counted as 499."""

from __future__ import annotations

import asyncio
import io
import json
import socket
import struct
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from aiohttp import web

from proxy.fake_provider import Reply
from proxy.logs import configure_logging
from proxy.server import explain

from .conftest import TENANT_KEY, Proxy
from .hostile import address, request_bytes

CHAT = {"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]}
AUTH = {"Authorization": f"Bearer {TENANT_KEY}"}


async def exchange(proxy: Proxy, body: Any, headers: dict[str, str]) -> bytes:
    """One request on a raw socket; every byte of the answer (its Content-Length)."""
    reader, writer = await asyncio.open_connection(*address(proxy.base_url))
    try:
        writer.write(request_bytes("/v1/chat/completions", body, headers))
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(
            int(line.split(b":", 1)[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length:")
        )
        return head + await reader.readexactly(length)
    finally:
        writer.close()


def header(raw: bytes, name: str) -> str:
    for line in raw.split(b"\r\n\r\n", 1)[0].split(b"\r\n")[1:]:
        key, _, value = line.partition(b":")
        if key.decode().lower() == name:
            return value.decode().strip()
    raise AssertionError(f"no {name} header")


@pytest.mark.parametrize(
    ("body", "headers", "status"),
    [
        (CHAT, AUTH, 200),
        ({"model": "gpt-4o"}, AUTH, 400),  # OpenAI's error, from the handler
        (CHAT, {}, 401),  # from the auth step (no key)
    ],
)
async def test_the_whole_answer_is_sent_before_the_bookkeeping(
    make_proxy: Callable[..., Awaitable[Proxy]],
    monkeypatch: pytest.MonkeyPatch,
    body: Any,
    headers: dict[str, str],
    status: int,
) -> None:
    written: list[tuple[int, bool]] = []
    record = explain.record_request

    def spy(request: web.Request, *args: Any, **kwargs: Any) -> None:
        # The last bookkeeping step: what the socket had been handed by then.
        written.append((request.writer.output_size, request.transport is not None))
        record(request, *args, **kwargs)

    monkeypatch.setattr(explain, "record_request", spy)
    proxy = await make_proxy(allow_unknown=False)
    stream = io.StringIO()
    configure_logging("info", stream)
    try:
        raw = await exchange(proxy, body, headers)
    finally:
        configure_logging("info")
    assert raw.startswith(f"HTTP/1.1 {status} ".encode())
    assert written == [(len(raw), True)]
    request_id = header(raw, "x-threadkeeper-request-id")
    if status >= 400:
        error = json.loads(raw.split(b"\r\n\r\n", 1)[1])["error"]
        assert set(error) == {"message", "type", "param", "code"}
    lines = [json.loads(line) for line in stream.getvalue().splitlines() if line.startswith("{")]
    logged = [line for line in lines if line.get("event") == "request"]
    assert [(line["request_id"], line["status"]) for line in logged] == [(request_id, status)]


async def test_a_client_gone_during_the_write_is_logged_and_counted_as_499(
    proxy: Proxy,
) -> None:
    # An answer far larger than the sockets' buffers: its write is still under way when
    # the client, having read the status line, resets the connection.
    proxy.provider.script.append(Reply(text="word " * 4_000_000))
    stream = io.StringIO()
    configure_logging("info", stream)
    try:
        reader, writer = await asyncio.open_connection(*address(proxy.base_url))
        sock = writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        writer.write(request_bytes("/v1/chat/completions", CHAT, AUTH))
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout=30)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.transport.abort()
        assert head.startswith(b"HTTP/1.1 200 ")
        logged = await _request_line(stream)
    finally:
        configure_logging("info")
    assert logged["status"] == 499 and logged["route"] == "chat.completions"
    async with proxy.http() as http:
        metrics = (await http.get("/metrics")).text
    assert 'threadkeeper_requests_total{route="chat.completions",status="499",tenant="acme"}' in (
        metrics
    )
    assert 'route="chat.completions",status="200"' not in metrics


async def _request_line(stream: io.StringIO) -> dict[str, Any]:
    """The request's log line, once the proxy has finished with the request."""
    for _ in range(3000):
        for line in stream.getvalue().splitlines():
            if line.startswith("{") and json.loads(line).get("event") == "request":
                return dict(json.loads(line))
        await asyncio.sleep(0.01)
    raise AssertionError("the request was never logged")


async def test_an_answer_that_cannot_be_written_is_openais_500(
    proxy: Proxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    from proxy.server import relay

    made = relay.relay_headers

    def unwritable(*args: Any) -> Any:
        headers = made(*args)
        headers["X-Broken"] = "a\r\nb"  # aiohttp refuses to write such a header
        return headers

    monkeypatch.setattr(relay, "relay_headers", unwritable)
    stream = io.StringIO()
    configure_logging("info", stream)
    try:
        raw = await exchange(proxy, CHAT, AUTH)
    finally:
        configure_logging("info")
    assert raw.startswith(b"HTTP/1.1 500 ")
    request_id = header(raw, "x-threadkeeper-request-id")
    error = json.loads(raw.split(b"\r\n\r\n", 1)[1])["error"]
    assert error["type"] == "server_error" and request_id in error["message"]
    lines = [json.loads(line) for line in stream.getvalue().splitlines() if line.startswith("{")]
    assert [line["status"] for line in lines if line.get("event") == "request"] == [500]
    monkeypatch.undo()
    assert (await exchange(proxy, CHAT, AUTH)).startswith(b"HTTP/1.1 200 ")
