"""Hostile providers (issue 8): answers above the buffering cap (item 11), a provider that
drips past the request's deadline (item 13), one that echoes the tenant's provider key
(item 15), and stream error events that never carry internal exception text (item 16)."""

from __future__ import annotations

import asyncio
import json
import sqlite3
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from aiohttp import web

from proxy.server.state import STORE
from proxy.store.base import VersionConflict

from .conftest import PROVIDER_KEY, TENANT_KEY, Proxy

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
CAP = 4096
CHAT = {"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]}


class RawProvider:
    """A provider whose every answer is the test's own handler (exact bytes, timing)."""

    def __init__(self) -> None:
        self.handle: Handler | None = None
        self.cancelled = asyncio.Event()

    async def dispatch(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        assert self.handle is not None
        try:
            return await self.handle(request)
        except (asyncio.CancelledError, ConnectionResetError):
            self.cancelled.set()
            raise


@pytest.fixture
async def raw() -> AsyncIterator[tuple[RawProvider, str]]:
    provider = RawProvider()
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", provider.dispatch)
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    yield provider, f"http://127.0.0.1:{port}/v1"
    await runner.cleanup()


def sse(payload: Any, event: str | None = None) -> bytes:
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {json.dumps(payload)}\n\n".encode()


def chunk(text: str) -> dict[str, Any]:
    return {
        "id": "c1",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "gpt-4o",
        "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}],
    }


async def stream_of(request: web.Request, *frames: bytes) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    for frame in frames:
        await response.write(frame)
    return response


def events(body: bytes) -> list[str]:
    return [block for block in body.decode().split("\n\n") if block.strip()]


def last_error(body: bytes) -> dict[str, Any]:
    last = events(body)[-1]
    payload = json.loads(last.split("data: ", 1)[1])
    return payload["error"]  # type: ignore[no-any-return]


async def post(proxy: Proxy, path: str, body: Any, **headers: str) -> httpx.Response:
    auth = {"Authorization": f"Bearer {TENANT_KEY}", **headers}
    async with proxy.http() as http:
        return await http.post(path, json=body, headers=auth)


# -- item 11: what is buffered from the provider is capped -----------------------------------


async def test_a_provider_body_above_the_cap_is_a_502_naming_it(make_proxy, raw) -> None:
    provider, url = raw

    async def huge(request: web.Request) -> web.StreamResponse:
        return web.json_response({"choices": [], "padding": "x" * (4 * CAP)})

    provider.handle = huge
    proxy = await make_proxy(upstream_url=url, settings={"max_provider_body_bytes": CAP})
    for path, body in (("/v1/chat/completions", CHAT), ("/v1/responses", {"model": "m"})):
        response = await post(proxy, path, body)
        assert response.status_code == 502
        error = response.json()["error"]
        assert error["code"] == "upstream_response_too_large"
        assert "max_provider_body_bytes" in error["message"]


async def test_a_stream_line_above_the_cap_ends_with_an_error_event(make_proxy, raw) -> None:
    """The provider sends one `data:` line that never ends: the proxy stops at the cap
    instead of buffering it until the provider gives up (it never does here)."""
    provider, url = raw

    async def endless_line(request: web.Request) -> web.StreamResponse:
        response = await stream_of(request, sse(chunk("first")), b"data: ")
        while True:
            await response.write(b"x" * 1024)
            await asyncio.sleep(0.001)

    provider.handle = endless_line
    proxy = await make_proxy(upstream_url=url, settings={"max_provider_body_bytes": CAP})
    for path, body in (
        ("/v1/chat/completions", {**CHAT, "stream": True}),
        ("/v1/chat/completions", {**CHAT, "stream": True, "tools": []}),
    ):
        response = await asyncio.wait_for(post(proxy, path, body), timeout=30)
        assert response.status_code == 200
        assert "first" in events(response.content)[0]
        error = last_error(response.content)
        assert error["code"] == "upstream_stream_error"
        assert "max_provider_body_bytes" in error["message"]
        assert len(response.content) < 2 * CAP
    await asyncio.wait_for(provider.cancelled.wait(), timeout=10)


async def test_events_below_the_cap_pass_however_long_the_stream(make_proxy, raw) -> None:
    provider, url = raw
    frames = [sse(chunk(f"w{i} " + "y" * 100)) for i in range(100)]  # 13 KB > CAP in total

    async def long_stream(request: web.Request) -> web.StreamResponse:
        response = await stream_of(request, *frames, b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    provider.handle = long_stream
    proxy = await make_proxy(upstream_url=url, settings={"max_provider_body_bytes": CAP})
    client = proxy.client()
    stream = await client.chat.completions.create(**CHAT, stream=True)
    texts = [c.choices[0].delta.content async for c in stream]
    assert len(texts) == 100


async def test_passthrough_bodies_above_the_cap_are_relayed_not_buffered(make_proxy, raw) -> None:
    provider, url = raw
    content = bytes(range(256)) * (4 * CAP // 256)

    async def download(request: web.Request) -> web.StreamResponse:
        return web.Response(body=content, content_type="application/octet-stream")

    provider.handle = download
    proxy = await make_proxy(upstream_url=url, settings={"max_provider_body_bytes": CAP})
    async with proxy.http() as http:
        response = await http.get(
            "/v1/files/file-1/content", headers={"Authorization": f"Bearer {TENANT_KEY}"}
        )
    assert response.status_code == 200
    assert response.content == content


async def test_a_passthrough_body_cut_midway_does_not_look_complete(make_proxy, raw) -> None:
    provider, url = raw

    async def cut(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "application/octet-stream"})
        await response.prepare(request)
        await response.write(b"a" * 1000)
        assert request.transport is not None
        request.transport.close()
        return response

    provider.handle = cut
    proxy = await make_proxy(upstream_url=url)
    async with proxy.http() as http:
        with pytest.raises(httpx.RemoteProtocolError):
            await http.get(
                "/v1/files/file-1/content", headers={"Authorization": f"Bearer {TENANT_KEY}"}
            )


# -- item 13: the request's deadline with the provider ----------------------------------------


def deadline_policies(directory: Path, seconds: float) -> Path:
    directory.mkdir()
    (directory / "default.yaml").write_text(
        "tenant: default\nallow_unknown_keys: true\n"
        f"upstream: {{deadline_seconds: {seconds}}}\n"
        "retry: {max_attempts: 3, max_seconds: 10, initial_backoff: 0.01, max_backoff: 0.05}\n"
    )
    return directory


async def drip(request: web.Request, first: bytes = b"") -> web.StreamResponse:
    """Headers at once, then one byte every 50 ms, forever."""
    sse_stream = first != b""
    content_type = "text/event-stream" if sse_stream else "application/json"
    response = web.StreamResponse(headers={"Content-Type": content_type})
    await response.prepare(request)
    await response.write(first or b"{")
    while True:
        await asyncio.sleep(0.05)
        await response.write(b" ")


async def test_a_dripping_provider_is_cut_at_the_deadline(make_proxy, raw, tmp_path) -> None:
    provider, url = raw
    policies = deadline_policies(tmp_path / "deadline", 0.5)
    proxy = await make_proxy(upstream_url=url, settings={"policies_dir": policies})
    auth = {"Authorization": "Bearer sk-client-own"}
    async with proxy.http() as http:
        # Before the first byte reached the client: a 504 naming the deadline.
        provider.handle = drip
        started = time.monotonic()
        response = await asyncio.wait_for(
            http.post("/v1/chat/completions", json=CHAT, headers=auth), timeout=30
        )
        took = time.monotonic() - started
        assert response.status_code == 504
        assert response.json()["error"]["code"] == "upstream_deadline_exceeded"
        assert "deadline_seconds" in response.json()["error"]["message"]

        # After: the stream ends with an error event.
        async def drip_stream(request: web.Request) -> web.StreamResponse:
            return await drip(request, sse(chunk("first")))

        provider.handle = drip_stream
        response = await asyncio.wait_for(
            http.post("/v1/chat/completions", json={**CHAT, "stream": True}, headers=auth),
            timeout=30,
        )
        assert response.status_code == 200
        assert "first" in events(response.content)[0]
        error = last_error(response.content)
        assert error["code"] == "upstream_stream_error"
        assert "deadline" in error["message"]
    print(f"dripping provider, deadline 0.5 s: the 504 came after {took:.2f} s")


async def test_a_provider_that_never_sends_headers_is_cut_at_the_deadline(
    make_proxy, raw, tmp_path
) -> None:
    provider, url = raw

    async def silent(request: web.Request) -> web.StreamResponse:
        await asyncio.sleep(3600)
        raise AssertionError("unreachable")

    provider.handle = silent
    policies = deadline_policies(tmp_path / "deadline", 0.3)
    proxy = await make_proxy(upstream_url=url, settings={"policies_dir": policies})
    async with proxy.http() as http:
        response = await asyncio.wait_for(
            http.post(
                "/v1/responses",
                json={"model": "m", "input": "hi", "store": False},
                headers={"Authorization": "Bearer sk-client-own"},
            ),
            timeout=30,
        )
    assert response.status_code == 504
    assert response.json()["error"]["code"] == "upstream_deadline_exceeded"


# -- item 15: the tenant's provider key never reaches the client ------------------------------


def echo_of(request: web.Request) -> str:
    return request.headers["Authorization"]


async def test_an_echoed_provider_key_is_scrubbed_from_error_bodies_and_headers(
    make_proxy, raw
) -> None:
    provider, url = raw

    async def echo_error(request: web.Request) -> web.StreamResponse:
        message = f"Incorrect API key provided: {echo_of(request)}"
        body = {"error": {"message": message, "type": "invalid_request_error", "code": None}}
        return web.json_response(body, status=401, headers={"x-echo": echo_of(request)})

    provider.handle = echo_error
    proxy = await make_proxy(upstream_url=url)
    for path, body in (
        ("/v1/chat/completions", CHAT),
        ("/v1/responses", {"model": "m", "input": "hi"}),
        ("/v1/embeddings", {"model": "m", "input": "hi"}),
    ):
        for attempt in range(2):  # the second answer is the stored Idempotency-Key replay
            response = await post(proxy, path, body, **{"Idempotency-Key": f"k-{path}"})
            assert response.status_code == 401
            assert response.headers.get("idempotent-replayed") == ["false", "true"][attempt]
            assert PROVIDER_KEY not in response.text
            assert PROVIDER_KEY not in str(response.headers)
            assert "Bearer [redacted]" in response.json()["error"]["message"]
            assert response.headers["x-echo"] == "Bearer [redacted]"


@pytest.mark.parametrize("split", [3, 10, len(PROVIDER_KEY) - 1])
async def test_an_echoed_key_split_across_stream_chunks_is_scrubbed(
    make_proxy, raw, split: int
) -> None:
    provider, url = raw

    async def echo_stream(request: web.Request) -> web.StreamResponse:
        frame = sse(chunk(f"your key is {PROVIDER_KEY}!"))
        cut = frame.index(PROVIDER_KEY.encode()) + split
        response = await stream_of(request, frame[:cut])
        await asyncio.sleep(0.05)  # two reads on the proxy's side
        finish = chunk("")
        finish["choices"][0]["finish_reason"] = "stop"
        await response.write(frame[cut:] + sse(finish) + b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    provider.handle = echo_stream
    proxy = await make_proxy(upstream_url=url)
    for attempt in range(2):  # the second answer is the stored Idempotency-Key replay
        response = await post(
            proxy, "/v1/chat/completions", {**CHAT, "stream": True}, **{"Idempotency-Key": "s"}
        )
        assert response.status_code == 200
        assert response.headers.get("idempotent-replayed") == ["false", "true"][attempt]
        assert PROVIDER_KEY.encode() not in response.content
        first = json.loads(events(response.content)[0].split("data: ", 1)[1])
        assert first["choices"][0]["delta"]["content"] == "your key is [redacted]!"


async def test_a_clients_own_key_is_forwarded_and_not_scrubbed(make_proxy, raw) -> None:
    """Passthrough mode: the key is the client's, so an echo of it is the provider's
    business (nothing of the proxy's leaks)."""
    provider, url = raw

    async def echo(request: web.Request) -> web.StreamResponse:
        return web.json_response({"seen": echo_of(request)})

    provider.handle = echo
    proxy = await make_proxy(upstream_url=url)
    async with proxy.http() as http:
        response = await http.get("/v1/models", headers={"Authorization": "Bearer sk-own-key-1"})
    assert response.json() == {"seen": "Bearer sk-own-key-1"}


# -- item 16: stream error events carry no internal exception text ----------------------------


@pytest.mark.parametrize(
    ("failure", "code"),
    [
        (sqlite3.OperationalError("database or disk is full"), "store_error"),
        (VersionConflict("thread conv_secret_internals"), "store_error"),
        (TypeError("unsupported operand internals"), "internal_error"),
    ],
    ids=["disk_full", "version_conflict", "type_error"],
)
async def test_a_failure_while_keeping_a_stream_is_a_generic_error_event(
    make_proxy, failure: Exception, code: str
) -> None:
    proxy = await make_proxy()

    async def fail(*args: object, **kwargs: object) -> None:
        raise failure

    proxy.app[STORE].commit_turn = fail  # type: ignore[index,attr-defined]
    response = await post(proxy, "/v1/responses", {"model": "m", "input": "hi", "stream": True})
    assert response.status_code == 200
    error = last_error(response.content)
    assert error["code"] == code
    request_id = response.headers["x-threadkeeper-request-id"]
    assert error["message"].endswith(f"(request id {request_id}).")
    for internal in (type(failure).__name__, str(failure), "internals", "disk is full"):
        assert internal not in response.text


async def test_a_provider_cut_is_an_upstream_error_event_without_transport_text(
    make_proxy, raw
) -> None:
    provider, url = raw

    async def cut(request: web.Request) -> web.StreamResponse:
        response = await stream_of(request, sse(chunk("first")))
        assert request.transport is not None
        request.transport.close()
        return response

    provider.handle = cut
    proxy = await make_proxy(upstream_url=url, acme_extra="tools: {refund: {side_effect: true}}\n")
    for path, body in (
        ("/v1/chat/completions", {**CHAT, "stream": True}),  # guarded (acme has a tool)
        ("/v1/responses", {"model": "m", "input": "hi", "stream": True}),  # stored
    ):
        response = await post(proxy, path, body)
        error = last_error(response.content)
        assert error["code"] == "upstream_stream_error"
        assert error["message"].startswith("The connection to the provider was lost")
        for internal in ("RemoteProtocolError", "UpstreamUnavailable", "peer closed", "("):
            assert internal not in error["message"].split(" (request id")[0]
