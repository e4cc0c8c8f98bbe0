"""The provider seam: retries, their bounds, header hygiene and chunk-by-chunk streams."""

from __future__ import annotations

import asyncio
import email.utils
import gzip
import time
from collections.abc import AsyncIterator, Iterator

import httpx
import pytest
import respx

from proxy.sse import SSEDecoder
from proxy.upstream import (
    Closer,
    EventFrames,
    ProviderAnswerTooLarge,
    RetrySettings,
    Scrubber,
    Upstream,
    UpstreamRequest,
    UpstreamUnavailable,
    retry_after_seconds,
)

URL = "https://provider.test/v1/chat/completions"
BODY = b'{"model": "gpt-4o-mini", "messages": []}'
FAST = RetrySettings(max_attempts=3, max_seconds=30.0, initial_backoff=0.01, max_backoff=0.02)


class SleepRecorder:
    """Stands in for asyncio.sleep: records each wait without taking it."""

    def __init__(self) -> None:
        self.waits: list[float] = []

    async def __call__(self, seconds: float) -> None:
        self.waits.append(seconds)


@pytest.fixture
def router() -> Iterator[respx.MockRouter]:
    with respx.mock(assert_all_called=False) as mock:
        yield mock


@pytest.fixture
def sleeps() -> SleepRecorder:
    return SleepRecorder()


@pytest.fixture
async def upstream(sleeps: SleepRecorder) -> AsyncIterator[Upstream]:
    client = httpx.AsyncClient()
    yield Upstream(client, sleep=sleeps)
    await client.aclose()


def post(
    stream: bool = False, body: bytes | None = BODY, headers: dict[str, str] | None = None
) -> UpstreamRequest:
    headers = {"authorization": "Bearer sk-test", **(headers or {})}
    return UpstreamRequest("POST", URL, headers, body, stream=stream)


def ok(text: str = "done") -> httpx.Response:
    return httpx.Response(200, json={"text": text}, headers={"x-request-id": "req_ok"})


async def test_429_then_200_is_retried_after_the_providers_retry_after(
    router: respx.MockRouter, upstream: Upstream, sleeps: SleepRecorder
) -> None:
    route = router.post(URL).mock(
        side_effect=[httpx.Response(429, headers={"retry-after": "0.01"}), ok()]
    )
    response = await upstream.send(post(), FAST)
    assert response.status == 200
    assert await response.aread() == b'{"text":"done"}'
    assert (response.attempts, response.retries, route.call_count) == (2, 1, 2)
    assert sleeps.waits == [0.01]


async def test_retry_after_ms_wins_over_retry_after(
    router: respx.MockRouter, upstream: Upstream, sleeps: SleepRecorder
) -> None:
    hinted = httpx.Response(503, headers={"retry-after-ms": "250", "retry-after": "5"})
    router.post(URL).mock(side_effect=[hinted, ok()])
    response = await upstream.send(post(), FAST)
    assert response.status == 200
    assert sleeps.waits == [0.25]


def test_retry_after_as_an_http_date() -> None:
    now = time.time()
    date = email.utils.formatdate(now + 30, usegmt=True)
    waited = retry_after_seconds(httpx.Headers({"retry-after": date}), now=now)
    assert waited is not None and 28 <= waited <= 31
    assert retry_after_seconds(httpx.Headers({"retry-after": "soon"})) is None
    assert retry_after_seconds(httpx.Headers({})) is None


async def test_without_a_hint_backoff_grows_and_is_capped(
    router: respx.MockRouter, upstream: Upstream, sleeps: SleepRecorder
) -> None:
    router.post(URL).mock(return_value=httpx.Response(502))
    settings = RetrySettings(max_attempts=5, initial_backoff=1.0, max_backoff=3.0)
    response = await upstream.send(post(), settings)
    assert response.status == 502
    assert len(sleeps.waits) == 4
    # base 1, 2, 4->3, 8->3, each shortened by at most 25% jitter
    for wait, base in zip(sleeps.waits, [1.0, 2.0, 3.0, 3.0], strict=True):
        assert base * 0.75 <= wait <= base


async def test_500_forever_returns_the_last_provider_response_unchanged(
    router: respx.MockRouter, upstream: Upstream
) -> None:
    replies = [
        httpx.Response(
            500,
            json={"error": {"message": f"boom {n}", "type": "server_error"}},
            headers={"x-request-id": f"req_{n}"},
        )
        for n in (1, 2, 3, 4)
    ]
    route = router.post(URL).mock(side_effect=replies)
    response = await upstream.send(post(), FAST)
    assert route.call_count == 3
    assert (response.status, response.attempts) == (500, 3)
    assert ("x-request-id", "req_3") in response.headers
    assert b"boom 3" in await response.aread()


async def test_a_wait_past_the_deadline_is_not_taken(
    router: respx.MockRouter, upstream: Upstream, sleeps: SleepRecorder
) -> None:
    route = router.post(URL).mock(
        return_value=httpx.Response(429, headers={"retry-after": "60", "x-request-id": "r"})
    )
    settings = RetrySettings(max_attempts=5, max_seconds=0.5)
    response = await upstream.send(post(), settings)
    assert (response.status, route.call_count, sleeps.waits) == (429, 1, [])
    assert ("x-request-id", "r") in response.headers


async def test_connection_errors_are_retried_then_reported_as_502(
    router: respx.MockRouter, upstream: Upstream
) -> None:
    route = router.post(URL).mock(side_effect=httpx.ConnectError("refused"))
    with pytest.raises(UpstreamUnavailable) as caught:
        await upstream.send(post(), FAST)
    assert route.call_count == 3
    assert (caught.value.status, caught.value.attempts) == (502, 3)
    assert "refused" in caught.value.message


async def test_a_connection_error_then_success_recovers(
    router: respx.MockRouter, upstream: Upstream
) -> None:
    router.post(URL).mock(side_effect=[httpx.RemoteProtocolError("reset"), ok()])
    response = await upstream.send(post(), FAST)
    assert (response.status, response.retries) == (200, 1)


async def test_timeouts_are_reported_as_504(router: respx.MockRouter, upstream: Upstream) -> None:
    router.post(URL).mock(side_effect=httpx.ConnectTimeout("slow"))
    with pytest.raises(UpstreamUnavailable) as caught:
        await upstream.send(post(), FAST)
    assert caught.value.status == 504


async def test_a_read_timeout_is_not_retried(router: respx.MockRouter, upstream: Upstream) -> None:
    # The provider may be generating: sending again would pay for the answer twice.
    route = router.post(URL).mock(side_effect=httpx.ReadTimeout("slow model"))
    with pytest.raises(UpstreamUnavailable) as caught:
        await upstream.send(post(), FAST)
    assert (route.call_count, caught.value.status) == (1, 504)


@pytest.mark.parametrize("status", [400, 401, 404, 422])
async def test_client_errors_are_not_retried(
    router: respx.MockRouter, upstream: Upstream, status: int
) -> None:
    route = router.post(URL).mock(return_value=httpx.Response(status, json={"error": {}}))
    response = await upstream.send(post(), FAST)
    assert (response.status, route.call_count, response.retries) == (status, 1, 0)


async def test_a_body_that_cannot_be_replayed_gets_one_attempt(
    router: respx.MockRouter, upstream: Upstream
) -> None:
    async def body() -> AsyncIterator[bytes]:
        yield BODY

    route = router.post(URL).mock(return_value=httpx.Response(503))
    response = await upstream.send(UpstreamRequest("POST", URL, {}, body()), FAST)
    assert (response.status, route.call_count) == (503, 1)


async def test_stream_body_is_relayed_chunk_by_chunk(
    router: respx.MockRouter, upstream: Upstream
) -> None:
    first_seen = asyncio.Event()

    async def provider_stream() -> AsyncIterator[bytes]:
        yield b"data: one\n\n"
        # The second chunk only exists once the caller has received the first one, so
        # this test hangs if send() or aiter_bytes() waited for the whole body.
        await first_seen.wait()
        yield b"data: two\n\n"

    router.post(URL).mock(return_value=httpx.Response(200, content=provider_stream()))
    chunks = []
    async with asyncio.timeout(10):  # a buffering relay deadlocks: fail instead of hanging
        response = await upstream.send(post(stream=True), FAST)
        async for chunk in response.aiter_bytes():
            chunks.append(chunk)
            first_seen.set()
    assert chunks == [b"data: one\n\n", b"data: two\n\n"]
    assert response.closed


async def test_a_streamed_error_is_read_whole_and_retried(
    router: respx.MockRouter, upstream: Upstream
) -> None:
    router.post(URL).mock(
        side_effect=[httpx.Response(500, json={"error": {"message": "try again"}}), ok("s")]
    )
    response = await upstream.send(post(stream=True), FAST)
    assert response.status == 200
    assert b"".join([c async for c in response.aiter_bytes()]) == b'{"text":"s"}'


async def test_cancelling_the_reader_closes_the_provider_stream(
    router: respx.MockRouter, upstream: Upstream
) -> None:
    async def endless() -> AsyncIterator[bytes]:
        while True:
            yield b"data: tick\n\n"
            await asyncio.sleep(0.001)

    router.post(URL).mock(return_value=httpx.Response(200, content=endless()))
    response = await upstream.send(post(stream=True), FAST)
    got_one = asyncio.Event()

    async def relay() -> None:
        async for _ in response.aiter_bytes():
            got_one.set()

    task = asyncio.create_task(relay())
    await got_one.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert response.closed


async def test_cancelling_during_a_retry_wait_stops_retrying(
    router: respx.MockRouter, sleeps: SleepRecorder
) -> None:
    waiting = asyncio.Event()

    async def blocking_sleep(seconds: float) -> None:
        waiting.set()
        await asyncio.Event().wait()

    route = router.post(URL).mock(return_value=httpx.Response(503))
    async with httpx.AsyncClient() as client:
        task = asyncio.create_task(Upstream(client, sleep=blocking_sleep).send(post(), FAST))
        await waiting.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    assert route.call_count == 1


async def test_hop_by_hop_headers_never_cross_the_proxy(
    router: respx.MockRouter, upstream: Upstream
) -> None:
    route = router.post(URL).mock(
        return_value=httpx.Response(
            200,
            content=b"{}",
            headers={"x-request-id": "req_9", "keep-alive": "timeout=5", "openai-model": "m"},
        )
    )
    request = post(
        headers={
            "Host": "evil.test",
            "Connection": "keep-alive, X-Private",
            "x-private": "1",
            "Content-Length": "999",
            "proxy-authorization": "p",
            "te": "trailers",
        }
    )
    response = await upstream.send(request, FAST)
    sent = route.calls.last.request.headers
    assert sent["authorization"] == "Bearer sk-test"
    assert sent["host"] == "provider.test"
    assert sent["content-length"] == str(len(BODY))
    assert sent.get("connection") in (None, "keep-alive")  # httpx's own, not ours
    for name in ("x-private", "proxy-authorization", "te"):
        assert name not in sent
    names = {name for name, _ in response.headers}
    assert {"x-request-id", "openai-model"} <= names
    assert not names & {"keep-alive", "content-length"}


async def test_compressed_answers_are_relayed_decoded(
    router: respx.MockRouter, upstream: Upstream
) -> None:
    router.post(URL).mock(
        return_value=httpx.Response(
            200, content=gzip.compress(b'{"a":1}'), headers={"content-encoding": "gzip"}
        )
    )
    response = await upstream.send(post(), FAST)
    assert await response.aread() == b'{"a":1}'
    assert all(name != "content-encoding" for name, _ in response.headers)


async def test_the_raw_query_string_is_forwarded(
    router: respx.MockRouter, upstream: Upstream
) -> None:
    route = router.get(url__startswith="https://provider.test/v1/files").mock(
        return_value=httpx.Response(200, json={})
    )
    request = UpstreamRequest(
        "GET", "https://provider.test/v1/files", {}, None, params="purpose=a%2Fb&limit=2"
    )
    await upstream.send(request, FAST)
    assert route.calls.last.request.url.query == b"purpose=a%2Fb&limit=2"


async def test_create_builds_a_working_pooled_client(router: respx.MockRouter) -> None:
    router.post(URL).mock(return_value=ok())
    upstream = Upstream.create(connect_timeout=1.0, read_timeout=5.0, pool_size=4)
    try:
        response = await upstream.send(post(), FAST)
        assert response.status == 200
    finally:
        await upstream.aclose()


# -- what comes back: scrubbed, cut into whole events, capped, closed to the end ------------

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


@pytest.mark.parametrize("newline", ["\n", "\r\n", "\r"])
def test_event_frames_relay_whole_events_only(newline: str) -> None:
    stream = "".join(f'data: {{"n": {i}}}{newline}{newline}' for i in range(3)).encode()
    for cut in range(len(stream) + 1):
        frames = EventFrames(limit=1000)
        out = [frames.feed(stream[:cut]), frames.feed(stream[cut:]), frames.flush()]
        assert b"".join(out) == stream
        decoder = SSEDecoder()
        for part in out[:2]:  # what is relayed before the end is whole events
            assert len(decoder.feed(part)) == part.count(b"data:"), (cut, part)


def test_one_event_above_the_cap_is_refused_however_it_is_cut() -> None:
    frames = EventFrames(limit=100)
    assert frames.feed(b"data: small\n\n") == b"data: small\n\n"
    frames.feed(b"data: " + b"x" * 60)
    with pytest.raises(ProviderAnswerTooLarge) as info:
        frames.feed(b"x" * 60)
    assert info.value.status == 502
    assert "max_provider_body_bytes = 100" in info.value.message


async def test_a_body_above_the_cap_is_refused(router: respx.MockRouter) -> None:
    router.post(URL).mock(return_value=httpx.Response(200, content=b"x" * 101))
    async with httpx.AsyncClient() as client:
        with pytest.raises(ProviderAnswerTooLarge):
            await Upstream(client, max_body_bytes=100).send(post(), FAST)


async def test_an_echoed_key_is_scrubbed_from_headers_and_body(router: respx.MockRouter) -> None:
    router.post(URL).mock(
        return_value=httpx.Response(401, content=f"bad {KEY}".encode(), headers={"x-k": KEY})
    )
    async with httpx.AsyncClient() as client:
        request = UpstreamRequest("POST", URL, {"authorization": f"Bearer {KEY}"}, BODY)
        response = await Upstream(client).send(
            UpstreamRequest(**{**request.__dict__, "secrets": (KEY,)}), FAST
        )
    assert await response.aread() == b"bad [redacted]"
    assert ("x-k", "[redacted]") in response.headers


class SlowClose:
    """An httpx response whose close takes a while and records whether it finished."""

    def __init__(self) -> None:
        self.is_closed = False
        self.finished = asyncio.Event()
        self.started = asyncio.Event()

    async def aclose(self) -> None:
        self.is_closed = True  # as httpx does, before the connection is released
        self.started.set()
        await asyncio.sleep(0.01)
        self.finished.set()


async def test_a_close_runs_to_the_end_when_its_caller_is_cancelled() -> None:
    closer = Closer()
    response = SlowClose()
    task = asyncio.create_task(closer.close(response))  # type: ignore[arg-type]
    await response.started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.wait_for(response.finished.wait(), timeout=10)
    await closer.wait()


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


@pytest.mark.parametrize("yields", [0, 1, 2, 3, 5, 8])
async def test_requests_cancelled_while_waiting_for_a_connection_leave_no_slot_behind(
    yields: int,
) -> None:
    """httpcore leaves the connection it created for a request cancelled before using it
    in the pool (encode/httpcore#1093); the pool must reclaim it."""
    server = await asyncio.start_server(answer_ok, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    url = f"http://127.0.0.1:{port}/v1/models"
    upstream = Upstream.create(connect_timeout=2.0, read_timeout=5.0, pool_size=1)
    try:
        for _ in range(5):
            request = UpstreamRequest("GET", url, {})
            tasks = [asyncio.create_task(upstream.send(request, FAST)) for _ in range(3)]
            for _ in range(yields):
                await asyncio.sleep(0)
            for task in tasks:
                task.cancel()
            for result in await asyncio.gather(*tasks, return_exceptions=True):
                if isinstance(result, BaseException):
                    continue
                await result.aclose()
        assert upstream.connections_in_use() == 0
        response = await asyncio.wait_for(upstream.send(UpstreamRequest("GET", url, {}), FAST), 10)
        assert await response.aread() == b"{}"
    finally:
        await upstream.aclose()
        server.close()
        await server.wait_closed()
