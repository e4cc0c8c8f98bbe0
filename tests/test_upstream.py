"""The provider seam: retries, their bounds, header hygiene and chunk-by-chunk streams.

The provider is a small aiohttp app on port 0 that answers from a script of handlers."""

from __future__ import annotations

import asyncio
import email.utils
import gzip
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import pytest
from aiohttp import web
from multidict import CIMultiDict

from proxy.upstream import (
    Deadline,
    DeadlineExceeded,
    ProviderAnswerTooLarge,
    RetrySettings,
    Scrubber,
    Upstream,
    UpstreamRequest,
    UpstreamResponse,
    UpstreamUnavailable,
    retry_after_seconds,
)

BODY = b'{"model": "gpt-4o-mini", "messages": []}'
FAST = RetrySettings(max_attempts=3, max_seconds=30.0, initial_backoff=0.01, max_backoff=0.02)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass
class Call:
    method: str
    path_qs: str  # raw, as it came on the request line
    headers: CIMultiDict[str]
    raw_headers: tuple[tuple[bytes, bytes], ...]
    body: bytes


class Provider:
    """Answers each request with the next handler of `script` (the last one repeats) and
    records what it received. Handlers that wait, wait for `release` (set at teardown)."""

    def __init__(self) -> None:
        self.script: list[Handler] = []
        self.calls: list[Call] = []
        self.release = asyncio.Event()
        self.url = ""
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        app = web.Application(client_max_size=16 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.1)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}/v1/chat/completions"

    async def stop(self) -> None:
        self.release.set()
        if self._runner is not None:
            await self._runner.cleanup()

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        self.calls.append(
            Call(
                request.method,
                request.raw_path,
                CIMultiDict(request.headers),
                tuple(request.raw_headers),
                body,
            )
        )
        handler = self.script.pop(0) if len(self.script) > 1 else self.script[0]
        return await handler(request)


def reply(status: int = 200, body: bytes = b"", headers: dict[str, str] | None = None) -> Handler:
    async def handler(request: web.Request) -> web.StreamResponse:
        return web.Response(status=status, body=body, headers=headers)

    return handler


def ok(text: str = "done") -> Handler:
    body = b'{"text":"%s"}' % text.encode()
    return reply(200, body, {"content-type": "application/json", "x-request-id": "req_ok"})


def drop() -> Handler:
    """Closes the connection without an answer."""

    async def handler(request: web.Request) -> web.StreamResponse:
        assert request.transport is not None
        request.transport.close()
        response = web.Response()
        response.force_close()
        return response

    return handler


def events(*frames: bytes, gate: asyncio.Event | None = None, endless: bool = False) -> Handler:
    """An event stream: the frames (after the first, each waits for `gate` when given),
    then, when `endless`, ticks until the client goes away."""

    async def handler(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        for n, frame in enumerate(frames):
            if n and gate is not None:
                await gate.wait()
            await response.write(frame)
        while endless:
            await response.write(b"data: tick\n\n")
            await asyncio.sleep(0.001)
        await response.write_eof()
        return response

    return handler


def stalled(provider: Provider) -> Handler:
    """Sends nothing until the test ends."""

    async def handler(request: web.Request) -> web.StreamResponse:
        await provider.release.wait()
        return web.Response()

    return handler


class SleepRecorder:
    """Stands in for asyncio.sleep: records each wait without taking it."""

    def __init__(self) -> None:
        self.waits: list[float] = []

    async def __call__(self, seconds: float) -> None:
        self.waits.append(seconds)


@pytest.fixture
async def provider() -> AsyncIterator[Provider]:
    provider = Provider()
    await provider.start()
    yield provider
    await provider.stop()


@pytest.fixture
def sleeps() -> SleepRecorder:
    return SleepRecorder()


@pytest.fixture
async def upstream(sleeps: SleepRecorder) -> AsyncIterator[Upstream]:
    upstream = Upstream(sleep=sleeps)
    yield upstream
    await upstream.aclose()


def post(
    provider: Provider,
    stream: bool = False,
    body: bytes | None = BODY,
    headers: dict[str, str] | None = None,
) -> UpstreamRequest:
    headers = {"authorization": "Bearer sk-test", **(headers or {})}
    return UpstreamRequest("POST", provider.url, headers, body, stream=stream)


def lowered(headers: list[tuple[str, str]]) -> list[tuple[str, str]]:
    return [(name.lower(), value) for name, value in headers]


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def test_429_then_200_is_retried_after_the_providers_retry_after(
    provider: Provider, upstream: Upstream, sleeps: SleepRecorder
) -> None:
    provider.script[:] = [reply(429, headers={"retry-after": "0.01"}), ok()]
    response = await upstream.send(post(provider), FAST)
    assert response.status == 200
    assert await response.aread() == b'{"text":"done"}'
    assert (response.attempts, response.retries, len(provider.calls)) == (2, 1, 2)
    assert sleeps.waits == [0.01]


async def test_retry_after_ms_wins_over_retry_after(
    provider: Provider, upstream: Upstream, sleeps: SleepRecorder
) -> None:
    hinted = reply(503, headers={"retry-after-ms": "250", "retry-after": "5"})
    provider.script[:] = [hinted, ok()]
    response = await upstream.send(post(provider), FAST)
    assert response.status == 200
    assert sleeps.waits == [0.25]


def test_retry_after_as_an_http_date() -> None:
    now = time.time()
    date = email.utils.formatdate(now + 30, usegmt=True)
    waited = retry_after_seconds(CIMultiDict({"Retry-After": date}), now=now)
    assert waited is not None and 28 <= waited <= 31
    assert retry_after_seconds(CIMultiDict({"retry-after": "soon"})) is None
    assert retry_after_seconds(CIMultiDict()) is None


async def test_without_a_hint_backoff_grows_and_is_capped(
    provider: Provider, upstream: Upstream, sleeps: SleepRecorder
) -> None:
    provider.script[:] = [reply(502)]
    settings = RetrySettings(max_attempts=5, initial_backoff=1.0, max_backoff=3.0)
    response = await upstream.send(post(provider), settings)
    assert response.status == 502
    assert len(sleeps.waits) == 4
    # base 1, 2, 4->3, 8->3, each shortened by at most 25% jitter
    for wait, base in zip(sleeps.waits, [1.0, 2.0, 3.0, 3.0], strict=True):
        assert base * 0.75 <= wait <= base


async def test_500_forever_returns_the_last_provider_response_unchanged(
    provider: Provider, upstream: Upstream
) -> None:
    provider.script[:] = [
        reply(
            500,
            b'{"error": {"message": "boom %d", "type": "server_error"}}' % n,
            {"x-request-id": f"req_{n}"},
        )
        for n in (1, 2, 3, 4)
    ]
    response = await upstream.send(post(provider), FAST)
    assert len(provider.calls) == 3
    assert (response.status, response.attempts) == (500, 3)
    assert ("x-request-id", "req_3") in lowered(response.headers)
    assert b"boom 3" in await response.aread()


async def test_a_wait_past_the_deadline_is_not_taken(
    provider: Provider, upstream: Upstream, sleeps: SleepRecorder
) -> None:
    provider.script[:] = [reply(429, headers={"retry-after": "60", "x-request-id": "r"})]
    settings = RetrySettings(max_attempts=5, max_seconds=0.5)
    response = await upstream.send(post(provider), settings)
    assert (response.status, len(provider.calls), sleeps.waits) == (429, 1, [])
    assert ("x-request-id", "r") in lowered(response.headers)


async def test_a_wait_past_the_requests_deadline_is_not_taken(
    provider: Provider, upstream: Upstream, sleeps: SleepRecorder
) -> None:
    provider.script[:] = [reply(503, headers={"retry-after": "5"})]
    request = UpstreamRequest("POST", provider.url, {}, BODY, deadline=Deadline.after(2.0))
    response = await upstream.send(request, RetrySettings(max_attempts=5, max_seconds=30))
    assert (response.status, len(provider.calls), sleeps.waits) == (503, 1, [])


async def test_connection_errors_are_retried_then_reported_as_502(upstream: Upstream) -> None:
    url = f"http://127.0.0.1:{closed_port()}/v1/chat/completions"
    with pytest.raises(UpstreamUnavailable) as caught:
        await upstream.send(UpstreamRequest("POST", url, {}, BODY), FAST)
    assert (caught.value.status, caught.value.attempts) == (502, 3)
    assert "Cannot connect" in caught.value.message
    assert upstream.connections_in_use() == 0


async def test_a_connection_error_then_success_recovers(
    provider: Provider, upstream: Upstream
) -> None:
    provider.script[:] = [drop(), ok()]
    response = await upstream.send(post(provider), FAST)
    assert (response.status, response.retries) == (200, 1)


async def test_a_body_cut_off_is_retried(provider: Provider, upstream: Upstream) -> None:
    async def cut(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"content-length": "100"})
        await response.prepare(request)
        await response.write(b'{"half')
        assert request.transport is not None
        request.transport.close()
        return response

    provider.script[:] = [cut, ok()]
    response = await upstream.send(post(provider), FAST)
    assert (response.status, response.retries) == (200, 1)
    assert await response.aread() == b'{"text":"done"}'


async def test_no_free_connection_within_the_connect_timeout_is_a_504(
    provider: Provider, sleeps: SleepRecorder
) -> None:
    provider.script[:] = [events(b"data: 1\n\n", endless=True)]
    upstream = Upstream(connect_timeout=0.2, pool_size=1, sleep=sleeps)
    try:
        held = await upstream.send(post(provider, stream=True), FAST)
        with pytest.raises(UpstreamUnavailable) as caught:
            await upstream.send(post(provider), FAST)
        assert (caught.value.status, caught.value.attempts) == (504, 3)  # retried
        assert "came free" in caught.value.message
        assert upstream.connections_in_use() == 1
        await held.aclose()
        assert upstream.connections_in_use() == 0
    finally:
        await upstream.aclose()


async def test_a_read_timeout_is_not_retried(provider: Provider, sleeps: SleepRecorder) -> None:
    # The provider may be generating: sending again would pay for the answer twice.
    provider.script[:] = [stalled(provider)]
    upstream = Upstream(read_timeout=0.05, sleep=sleeps)
    request = UpstreamRequest("POST", provider.url, {}, BODY, deadline=Deadline.after(600))
    try:
        with pytest.raises(UpstreamUnavailable) as caught:
            await upstream.send(request, FAST)
        # aiohttp's own timeout, not mistaken for the request's deadline
        assert type(caught.value) is UpstreamUnavailable
        assert (len(provider.calls), caught.value.status) == (1, 504)
        assert upstream.connections_in_use() == 0
    finally:
        await upstream.aclose()


async def test_the_requests_deadline_bounds_the_wait_for_an_answer(
    provider: Provider, upstream: Upstream
) -> None:
    provider.script[:] = [stalled(provider)]
    request = UpstreamRequest("POST", provider.url, {}, BODY, deadline=Deadline.after(0.05))
    with pytest.raises(DeadlineExceeded) as caught:
        await upstream.send(request, FAST)
    assert (caught.value.status, caught.value.code) == (504, "upstream_deadline_exceeded")
    assert upstream.connections_in_use() == 0


async def test_the_requests_deadline_bounds_a_stream(
    provider: Provider, upstream: Upstream
) -> None:
    provider.script[:] = [events(b"data: 1\n\n", b"data: 2\n\n", gate=provider.release)]
    request = UpstreamRequest(
        "POST", provider.url, {}, BODY, stream=True, deadline=Deadline.after(1.0)
    )
    response = await upstream.send(request, FAST)
    chunks = []
    with pytest.raises(DeadlineExceeded):
        async for chunk in response.aiter_bytes():
            chunks.append(chunk)
    assert chunks == [b"data: 1\n\n"]
    assert response.closed and upstream.connections_in_use() == 0


async def test_the_requests_deadline_bounds_a_stream_whose_events_have_arrived(
    provider: Provider, upstream: Upstream
) -> None:
    # The second event is in the buffer, no wait needed, when it is read past the deadline.
    first_seen = asyncio.Event()
    provider.script[:] = [events(b"data: 1\n\n", b"data: 2\n\n", gate=first_seen)]
    request = UpstreamRequest(
        "POST", provider.url, {}, BODY, stream=True, deadline=Deadline.after(0.5)
    )
    chunks = []
    with pytest.raises(DeadlineExceeded):
        response = await upstream.send(request, FAST)
        async for chunk in response.aiter_bytes():
            chunks.append(chunk)
            first_seen.set()
            await asyncio.sleep(0.6)  # past the deadline; the rest arrives meanwhile
    assert chunks in ([], [b"data: 1\n\n"])
    assert upstream.connections_in_use() == 0


@pytest.mark.parametrize("status", [400, 401, 404, 422])
async def test_client_errors_are_not_retried(
    provider: Provider, upstream: Upstream, status: int
) -> None:
    provider.script[:] = [reply(status, b'{"error": {}}')]
    response = await upstream.send(post(provider), FAST)
    assert (response.status, len(provider.calls), response.retries) == (status, 1, 0)


async def test_a_body_that_cannot_be_replayed_gets_one_attempt(
    provider: Provider, upstream: Upstream
) -> None:
    async def body() -> AsyncIterator[bytes]:
        yield BODY[:10]
        yield BODY[10:]

    provider.script[:] = [reply(503)]
    response = await upstream.send(UpstreamRequest("POST", provider.url, {}, body()), FAST)
    assert (response.status, len(provider.calls)) == (503, 1)
    assert provider.calls[0].body == BODY  # streamed up as it came
    assert provider.calls[0].headers["transfer-encoding"] == "chunked"


async def test_a_large_body_goes_out_whole(provider: Provider, upstream: Upstream) -> None:
    # Above 1 MiB aiohttp warns about raw bytes (an error under pytest): sent in pieces.
    big = b'{"input": "' + b"x" * (3 * 1024 * 1024) + b'"}'
    provider.script[:] = [reply(503), ok()]
    response = await upstream.send(post(provider, body=big), FAST)
    assert (response.status, response.retries) == (200, 1)  # sent twice, whole each time
    assert [call.body for call in provider.calls] == [big, big]
    assert provider.calls[-1].headers["content-length"] == str(len(big))


async def test_an_error_of_a_streamed_body_is_raised_as_it_is(
    provider: Provider, upstream: Upstream
) -> None:
    class ClientGone(Exception):
        pass

    async def body() -> AsyncIterator[bytes]:
        yield b"part"
        raise ClientGone

    provider.script[:] = [ok()]
    with pytest.raises(ClientGone):
        await upstream.send(UpstreamRequest("POST", provider.url, {}, body()), FAST)
    assert upstream.connections_in_use() == 0


async def test_stream_body_is_relayed_chunk_by_chunk(
    provider: Provider, upstream: Upstream
) -> None:
    # The second event only exists once the caller has received the first one, so this
    # test hangs if send() or aiter_bytes() waited for the whole body.
    first_seen = asyncio.Event()
    provider.script[:] = [events(b"data: one\n\n", b"data: two\n\n", gate=first_seen)]
    chunks = []
    async with asyncio.timeout(10):  # a buffering relay deadlocks: fail instead of hanging
        response = await upstream.send(post(provider, stream=True), FAST)
        assert upstream.connections_in_use() == 1
        async for chunk in response.aiter_bytes():
            chunks.append(chunk)
            first_seen.set()
    assert chunks == [b"data: one\n\n", b"data: two\n\n"]
    assert response.closed and upstream.connections_in_use() == 0


async def test_a_streamed_error_is_read_whole_and_retried(
    provider: Provider, upstream: Upstream
) -> None:
    provider.script[:] = [reply(500, b'{"error": {"message": "try again"}}'), ok("s")]
    response = await upstream.send(post(provider, stream=True), FAST)
    assert response.status == 200
    assert b"".join([c async for c in response.aiter_bytes()]) == b'{"text":"s"}'


async def test_cancelling_the_reader_releases_the_provider_stream(
    provider: Provider, sleeps: SleepRecorder
) -> None:
    """A client that goes away cancels the relay: the connection goes back (closed, as its
    body was not read to the end) and the next request gets the pool's only slot."""
    upstream = Upstream(pool_size=1, connect_timeout=5, sleep=sleeps)
    provider.script[:] = [events(endless=True), ok()]
    try:
        response = await upstream.send(post(provider, stream=True), FAST)
        got_one = asyncio.Event()

        async def relay() -> None:
            async for _ in response.aiter_bytes():
                got_one.set()

        task = asyncio.create_task(relay())
        await got_one.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert response.closed and upstream.connections_in_use() == 0
        after = await asyncio.wait_for(upstream.send(post(provider), FAST), 10)
        assert await after.aread() == b'{"text":"done"}'
    finally:
        await upstream.aclose()


async def test_cancelling_during_a_retry_wait_stops_retrying(provider: Provider) -> None:
    waiting = asyncio.Event()

    async def blocking_sleep(seconds: float) -> None:
        waiting.set()
        await asyncio.Event().wait()

    provider.script[:] = [reply(503)]
    upstream = Upstream(sleep=blocking_sleep)
    try:
        task = asyncio.create_task(upstream.send(post(provider), FAST))
        await waiting.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    finally:
        await upstream.aclose()
    assert len(provider.calls) == 1
    assert upstream.connections_in_use() == 0


async def test_hop_by_hop_headers_never_cross_the_proxy(
    provider: Provider, upstream: Upstream
) -> None:
    provider.script[:] = [
        reply(
            200,
            b"{}",
            {"x-request-id": "req_9", "keep-alive": "timeout=5", "openai-model": "m"},
        )
    ]
    request = post(
        provider,
        headers={
            "Host": "evil.test",
            "Connection": "keep-alive, X-Private",
            "x-private": "1",
            "Content-Length": "999",
            "proxy-authorization": "p",
            "te": "trailers",
        },
    )
    response = await upstream.send(request, FAST)
    sent = provider.calls[-1].headers
    assert sent["authorization"] == "Bearer sk-test"
    assert sent["host"] == provider.url.split("/")[2]
    assert sent["content-length"] == str(len(BODY))
    assert sent.get("connection") in (None, "keep-alive")  # aiohttp's own, not ours
    for name in ("x-private", "proxy-authorization", "te"):
        assert name not in sent
    assert "content-type" not in sent  # none was sent, none is made up
    names = {name.lower() for name, _ in response.headers}
    assert {"x-request-id", "openai-model"} <= names
    assert not names & {"keep-alive", "content-length"}


async def test_header_values_go_out_as_the_clients_utf8_bytes(
    provider: Provider, upstream: Upstream
) -> None:
    # aiohttp hands the proxy header bytes decoded as UTF-8 with surrogateescape.
    note = "caf\u00e9 \u2603"
    broken = b"json; charset=\xff".decode("utf-8", "surrogateescape")
    provider.script[:] = [ok()]
    headers = {"x-note": note, "content-type": broken}
    response = await upstream.send(post(provider, headers=headers), FAST)
    assert response.status == 200
    raw = dict(provider.calls[-1].raw_headers)
    assert raw[b"x-note"] == note.encode()  # byte for byte
    assert raw[b"content-type"] == "json; charset=\ufffd".encode()  # not UTF-8: replaced


async def test_compressed_answers_are_relayed_decoded(
    provider: Provider, upstream: Upstream
) -> None:
    provider.script[:] = [reply(200, gzip.compress(b'{"a":1}'), {"content-encoding": "gzip"})]
    response = await upstream.send(post(provider), FAST)
    assert await response.aread() == b'{"a":1}'
    assert all(name.lower() != "content-encoding" for name, _ in response.headers)


async def test_the_raw_query_string_is_forwarded(provider: Provider, upstream: Upstream) -> None:
    provider.script[:] = [reply(200, b"{}")]
    base = provider.url.replace("/chat/completions", "/files")
    request = UpstreamRequest("GET", base, {}, None, params="purpose=a%2Fb&limit=2&q=\u00e9 x")
    await upstream.send(request, FAST)
    assert provider.calls[-1].path_qs == "/v1/files?purpose=a%2Fb&limit=2&q=%C3%A9%20x"


async def test_create_builds_a_working_pooled_client(provider: Provider) -> None:
    provider.script[:] = [ok()]
    upstream = Upstream.create(connect_timeout=1.0, read_timeout=5.0, pool_size=4)
    try:
        for _ in range(3):
            response = await upstream.send(post(provider), FAST)
            assert (response.status, await response.aread()) == (200, b'{"text":"done"}')
        assert upstream.connections_in_use() == 0
    finally:
        await upstream.aclose()


async def test_a_closed_upstream_opens_no_new_pool(provider: Provider) -> None:
    upstream = Upstream()
    await upstream.aclose()
    with pytest.raises(UpstreamUnavailable) as caught:
        await upstream.send(post(provider), RetrySettings(max_attempts=1))
    assert caught.value.status == 502
    assert provider.calls == []


async def test_one_pool_per_provider_origin(provider: Provider) -> None:
    """A second provider (another tenant's base_url) gets a pool of its own: a held
    connection to one leaves the other's slots free."""
    other = Provider()
    await other.start()
    provider.script[:] = [events(b"data: 1\n\n", endless=True)]
    other.script[:] = [ok("other")]
    upstream = Upstream(pool_size=1, connect_timeout=5)
    try:
        held = await upstream.send(post(provider, stream=True), FAST)
        response = await asyncio.wait_for(upstream.send(post(other), FAST), 10)
        assert await response.aread() == b'{"text":"other"}'
        assert upstream.connections_in_use() == 1
        await held.aclose()
    finally:
        await upstream.aclose()
        await other.stop()


# -- what comes back: scrubbed, cut into whole events, capped, released -------------------

KEY = "sk-provider-secret-0123456789"


def test_a_secret_split_anywhere_across_chunks_is_scrubbed() -> None:
    text = f'{{"error": "bad key {KEY}", "again": "{KEY}"}}'.encode()
    for cut in range(len(text) + 1):
        for second in range(cut, len(text) + 1):
            scrubber = Scrubber([KEY])
            parts = [text[:cut], text[cut:second], text[second:]]
            out = b"".join(scrubber.feed(part) for part in parts) + scrubber.flush()
            assert out == text.replace(KEY.encode(), b"[redacted]")


def test_the_scrubber_holds_back_only_what_could_begin_a_secret() -> None:
    scrubber = Scrubber([KEY])
    assert scrubber.feed(b'data: {"a": "s"}\n\n') == b'data: {"a": "s"}\n\n'
    assert scrubber.feed(b"token sk-prov") == b"token "
    assert scrubber.feed(b"ider-x") == b"sk-provider-x"
    assert Scrubber(["short"]).feed(b"short") == b"short"  # too short to be a key


async def test_a_stream_is_relayed_in_whole_events(provider: Provider, upstream: Upstream) -> None:
    frames = [b'data: {"n": 1}\n', b'\ndata: {"n"', b": 2}\r\n\r\n", b'data: {"n": 3}\n']
    provider.script[:] = [events(*frames)]
    response = await upstream.send(post(provider, stream=True), FAST)
    chunks = [chunk async for chunk in response.aiter_bytes()]
    assert b"".join(chunks) == b"".join(frames)
    for chunk in chunks[:-1]:  # whole events; the last one never got its blank line
        assert chunk.endswith((b"\n\n", b"\r\n\r\n")), chunks


async def test_one_stream_event_above_the_cap_is_refused(provider: Provider) -> None:
    first_seen = asyncio.Event()
    big = [b"data: " + b"x" * 60, b"x" * 60]
    provider.script[:] = [events(b"data: small\n\n", *big, gate=first_seen)]
    upstream = Upstream(max_body_bytes=100)
    try:
        response = await upstream.send(post(provider, stream=True), FAST)
        chunks = []
        with pytest.raises(ProviderAnswerTooLarge) as info:
            async for chunk in response.aiter_bytes():
                chunks.append(chunk)
                first_seen.set()
        assert chunks == [b"data: small\n\n"]
        assert info.value.status == 502
        assert "stream event" in info.value.message
        assert "max_provider_body_bytes = 100" in info.value.message
        assert upstream.connections_in_use() == 0
    finally:
        await upstream.aclose()


async def test_a_body_above_the_cap_is_refused(provider: Provider) -> None:
    provider.script[:] = [reply(200, b"x" * 101)]
    upstream = Upstream(max_body_bytes=100)
    try:
        with pytest.raises(ProviderAnswerTooLarge):
            await upstream.send(post(provider), FAST)
        assert upstream.connections_in_use() == 0
    finally:
        await upstream.aclose()


def pieces(first: bytes, rest: bytes, gate: asyncio.Event) -> Handler:
    """A JSON body whose rest follows `gate`: the headers and `first` arrive before it."""

    async def handler(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"content-type": "application/json"})
        await response.prepare(request)
        await response.write(first)
        await gate.wait()
        await response.write(rest)
        await response.write_eof()
        return response

    return handler


@pytest.mark.parametrize(("size", "refused"), [(100, False), (101, True)])
async def test_a_body_arriving_after_its_headers_is_read_whole_within_the_cap(
    provider: Provider, monkeypatch: pytest.MonkeyPatch, size: int, refused: bool
) -> None:
    gate = asyncio.Event()
    arriving = UpstreamResponse._read_arriving

    async def waited_for(response: UpstreamResponse) -> bytes:
        gate.set()  # the rest is sent only once the proxy waits for it
        return await arriving(response)

    monkeypatch.setattr(UpstreamResponse, "_read_arriving", waited_for)
    provider.script[:] = [pieces(b"x" * 10, b"y" * (size - 10), gate)]
    upstream = Upstream(max_body_bytes=100)
    try:
        if refused:
            with pytest.raises(ProviderAnswerTooLarge):
                await upstream.send(post(provider), FAST)
        else:
            response = await upstream.send(post(provider), FAST)
            assert await response.aread() == b"x" * 10 + b"y" * (size - 10)
        assert gate.is_set() and upstream.connections_in_use() == 0
    finally:
        await upstream.aclose()


async def test_the_requests_deadline_bounds_a_body_that_stalls(
    provider: Provider, upstream: Upstream
) -> None:
    provider.script[:] = [pieces(b'{"half', b'"}', provider.release)]
    request = UpstreamRequest("POST", provider.url, {}, BODY, deadline=Deadline.after(0.05))
    with pytest.raises(DeadlineExceeded):
        await upstream.send(request, FAST)
    assert upstream.connections_in_use() == 0


async def test_an_echoed_key_is_scrubbed_from_headers_and_body(
    provider: Provider, upstream: Upstream
) -> None:
    provider.script[:] = [reply(401, f"bad {KEY}".encode(), {"x-k": KEY})]
    request = UpstreamRequest(
        "POST", provider.url, {"authorization": f"Bearer {KEY}"}, BODY, secrets=(KEY,)
    )
    response = await upstream.send(request, FAST)
    assert await response.aread() == b"bad [redacted]"
    assert ("x-k", "[redacted]") in lowered(response.headers)


async def answer_ok(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """A minimal HTTP/1.1 server: `{}` to every request on the connection."""
    try:
        while await reader.readuntil(b"\r\n\r\n"):
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}")
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        writer.close()


@pytest.mark.parametrize("pool_size", [1, 2])
@pytest.mark.parametrize("yields", [0, 1, 2, 3, 5, 8])
async def test_requests_cancelled_while_waiting_for_a_connection_leave_no_slot_behind(
    yields: int, pool_size: int
) -> None:
    server = await asyncio.start_server(answer_ok, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    url = f"http://127.0.0.1:{port}/v1/models"
    upstream = Upstream(connect_timeout=2.0, read_timeout=5.0, pool_size=pool_size)
    try:
        for _ in range(5):
            request = UpstreamRequest("GET", url, {})
            tasks = [asyncio.create_task(upstream.send(request, FAST)) for _ in range(6)]
            for _ in range(yields):
                await asyncio.sleep(0)
            for task in tasks:
                task.cancel()
            for result in await asyncio.gather(*tasks, return_exceptions=True):
                if isinstance(result, BaseException):
                    continue
                await result.aclose()
        assert upstream.connections_in_use() == 0
        for _ in range(pool_size + 1):
            response = await asyncio.wait_for(
                upstream.send(UpstreamRequest("GET", url, {}), FAST), 10
            )
            assert await response.aread() == b"{}"
        assert upstream.connections_in_use() == 0
    finally:
        await upstream.aclose()
        server.close()
        await server.wait_closed()


async def test_a_waiter_cancelled_just_after_it_was_given_the_slot_passes_it_on(
    provider: Provider,
) -> None:
    """The slot a woken waiter would have taken goes to the next one in line (aiohttp's
    own connector limit leaves that one waiting until another release)."""
    provider.script[:] = [events(b"data: 1\n\n", endless=True), ok()]
    upstream = Upstream(pool_size=1, connect_timeout=30)
    try:
        held = await upstream.send(post(provider, stream=True), FAST)
        first = asyncio.create_task(upstream.send(post(provider), FAST))
        second = asyncio.create_task(upstream.send(post(provider), FAST))
        for _ in range(3):
            await asyncio.sleep(0)  # both are now waiting for the slot
        await held.aclose()  # wakes `first` ...
        first.cancel()  # ... which goes away before it runs
        response = await asyncio.wait_for(second, 10)
        assert await response.aread() == b'{"text":"done"}'
        assert first.cancelled()
        assert upstream.connections_in_use() == 0
    finally:
        await upstream.aclose()
