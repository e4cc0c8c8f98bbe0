"""Raw-socket clients for hostile tests: a client that vanishes mid-stream, one that never
finishes its request, and a reader of the proxy's /metrics."""

from __future__ import annotations

import asyncio
import json
import socket
import struct
from typing import Any
from urllib.parse import urlsplit

import httpx
from prometheus_client.parser import text_string_to_metric_families

IN_USE = "threadkeeper_upstream_connections_in_use"


def address(base_url: str) -> tuple[str, int]:
    parts = urlsplit(base_url)
    assert parts.hostname is not None and parts.port is not None
    return parts.hostname, parts.port


def request_bytes(path: str, body: Any, headers: dict[str, str]) -> bytes:
    payload = json.dumps(body).encode()
    lines = [f"POST {path} HTTP/1.1", "Host: proxy", "Content-Type: application/json"]
    lines += [f"{name}: {value}" for name, value in headers.items()]
    lines.append(f"Content-Length: {len(payload)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + payload


async def disconnect_mid_stream(
    base_url: str,
    path: str,
    body: Any,
    headers: dict[str, str],
    *,
    read: int = 1,
    before_headers: float | None = None,
) -> bytes:
    """Send a streaming request, read its headers and `read` body bytes, then reset the
    connection (RST, not FIN) while the proxy is still writing. Returns the head read.
    With `before_headers`, reset that many seconds after sending instead (the proxy is
    then still waiting for the provider, or reading the request)."""
    reader, writer = await asyncio.open_connection(*address(base_url))
    try:
        writer.write(request_bytes(path, body, headers))
        if before_headers is not None:
            await writer.drain()
            await asyncio.sleep(before_headers)
            return b""
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout=30)
        if read:
            head += await asyncio.wait_for(reader.readexactly(read), timeout=30)
        return head
    finally:
        sock = writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.transport.abort()


async def metric(base_url: str, name: str) -> float:
    """The value of one unlabelled sample on the proxy's /metrics."""
    async with httpx.AsyncClient(base_url=base_url.removesuffix("/v1"), timeout=30) as http:
        text = (await http.get("/metrics")).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and not sample.labels:
                return float(sample.value)
    raise AssertionError(f"{name} is not exported")


async def settled_metric(base_url: str, name: str, expected: float, within: float = 20) -> float:
    """Poll until the metric equals `expected` (closing runs after the client left);
    the last value seen when it never does, for the assertion message."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    value = await metric(base_url, name)
    while value != expected and loop.time() < deadline:
        await asyncio.sleep(0.05)
        value = await metric(base_url, name)
    return value
