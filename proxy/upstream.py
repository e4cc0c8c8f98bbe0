"""The provider seam: one `send()` that forwards a request and retries safely (SPEC 1, 3).

Retries happen only inside `send()`, that is before a single byte has reached the client:
once `send()` returns, the caller relays what it got. A stream request returns as soon as
the provider's headers arrive; its body is then read chunk by chunk as the network
delivers it.

>>> upstream = Upstream.create(connect_timeout=5, read_timeout=600, pool_size=100)
>>> response = await upstream.send(
...     UpstreamRequest("POST", "https://api.openai.com/v1/chat/completions",
...                     {"authorization": "Bearer sk-..."}, body, stream=True),
...     RetrySettings(),
... )
>>> async for chunk in response.aiter_bytes():
...     ...  # write chunk to the client

Everything the provider sends back passes `UpstreamResponse`, so the guarantees about it
live there: what is buffered is capped (`max_body_bytes`; one event of an event stream
too), the request's `Deadline` bounds the whole exchange, the tenant's provider key
(`UpstreamRequest.secrets`) is scrubbed from headers, bodies and streams, and closing runs
to the end even when the task that closes is cancelled (a client that went away), so the
connection always returns to the pool.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import re
import time
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from email.utils import parsedate_to_datetime
from typing import Any
from urllib.parse import quote

import httpcore
import httpx
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception_type, retry_if_result

from proxy.logs import MIN_SECRET_LENGTH, REDACTED

log = logging.getLogger(__name__)

# RFC 9110 section 7.6.1 hop-by-hop fields, never forwarded in either direction.
HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
    }
)
# httpx sets these itself; accept-encoding too, so the body is one it can decode.
REQUEST_DROP = HOP_BY_HOP | {"host", "content-length", "accept-encoding"}
# The proxy relays decoded bytes, so length and encoding no longer describe them.
RESPONSE_DROP = HOP_BY_HOP | {"content-length", "content-encoding"}

RETRY_STATUSES = frozenset({429, 500, 502, 503, 504})
RETRY_ERRORS = (
    httpx.ConnectError,
    httpx.RemoteProtocolError,
    httpx.ReadError,
    httpx.ConnectTimeout,
    httpx.PoolTimeout,
)
JITTER = 0.25  # backoff is shortened by up to this fraction so clients do not stampede
DEFAULT_MAX_BODY_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True)
class RetrySettings:
    max_attempts: int = 3  # total tries, the first included
    max_seconds: float = 30.0  # overall bound: never sleep past it
    initial_backoff: float = 0.5
    max_backoff: float = 8.0


@dataclass(frozen=True)
class Deadline:
    """When the whole exchange with the provider must be over (policy
    `upstream.deadline_seconds`): retries, headers and the last byte of the body."""

    at: float  # time.monotonic()
    seconds: float  # as configured, for messages

    @classmethod
    def after(cls, seconds: float) -> Deadline:
        return cls(time.monotonic() + seconds, seconds)

    def remaining(self) -> float:
        return self.at - time.monotonic()


@dataclass(frozen=True)
class UpstreamRequest:
    method: str
    url: str  # absolute
    headers: Mapping[str, str]
    body: bytes | AsyncIterable[bytes] | None = None
    stream: bool = False
    params: str | None = None  # raw query string, forwarded as is
    deadline: Deadline | None = None
    # Never relayed back: replaced by "[redacted]" wherever the provider echoes them.
    secrets: tuple[str, ...] = field(default=(), repr=False)


class UpstreamUnavailable(Exception):
    """The provider could not be reached: 502 for connection errors, 504 for timeouts.

    `message` may quote the transport error (logs, non-stream error bodies); `reason` is
    the proxy's own words, safe in a stream's error event."""

    code = "upstream_unavailable"

    def __init__(
        self, status: int, message: str, attempts: int = 1, reason: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.attempts = attempts
        self.reason = reason or message

    @classmethod
    def from_error(cls, error: BaseException, attempts: int = 1) -> UpstreamUnavailable:
        status = 504 if isinstance(error, httpx.TimeoutException) else 502
        reason = "timed out" if status == 504 else "unreachable"
        detail = str(error) or type(error).__name__
        said = "timed out" if status == 504 else "was lost"
        return cls(
            status,
            f"upstream provider {reason}: {detail}",
            attempts,
            f"The connection to the provider {said}.",
        )


class ProviderAnswerTooLarge(UpstreamUnavailable):
    """A 502: the provider's answer, or one event of its stream, is above the cap on what
    the proxy buffers (setting max_provider_body_bytes)."""

    code = "upstream_response_too_large"

    def __init__(self, limit: int, what: str = "answer") -> None:
        super().__init__(
            502,
            f"The provider's {what} is larger than the proxy accepts "
            f"(max_provider_body_bytes = {limit} bytes); it was not relayed.",
        )


class DeadlineExceeded(UpstreamUnavailable):
    """A 504: the provider did not finish within the request's deadline."""

    code = "upstream_deadline_exceeded"

    def __init__(self, seconds: float) -> None:
        super().__init__(
            504,
            f"The provider did not finish its answer within the deadline of {seconds:g} s "
            "(policy upstream.deadline_seconds).",
        )


@contextlib.asynccontextmanager
async def within(deadline: Deadline | None) -> AsyncIterator[None]:
    """Raises DeadlineExceeded when the block runs past the deadline."""
    if deadline is None:
        yield
        return
    try:
        async with asyncio.timeout(deadline.remaining()):
            yield
    except TimeoutError:
        raise DeadlineExceeded(deadline.seconds) from None


class Closer:
    """Closes provider responses to the end even when the closing task is cancelled.

    httpx marks a response closed before its connection is released; a cancellation in
    between (aiohttp cancels the handler of a client that went away) would leave the
    connection ACTIVE in the pool forever, and later closes do nothing. So the close runs
    as its own task that the caller only waits for (shielded), and the tasks in flight
    are kept here so they finish before the pool closes."""

    def __init__(self) -> None:
        self._closing: set[asyncio.Task[None]] = set()

    async def close(self, response: httpx.Response) -> None:
        if response.is_closed:
            return
        task = asyncio.ensure_future(_close_quietly(response))
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)
        await asyncio.shield(task)

    async def wait(self) -> None:
        while self._closing:
            await asyncio.gather(*self._closing)


async def _close_quietly(response: httpx.Response) -> None:
    try:
        await response.aclose()
    except Exception as exc:  # the connection is dropped either way
        log.debug("closing an upstream response failed: %r", exc)


class Scrubber:
    """Replaces secrets in relayed bytes with "[redacted]", also one split across chunks:
    a chunk's tail that could begin a secret is held back until the next chunk shows
    whether it does (SSE events end in a blank line, so nothing is held in practice)."""

    def __init__(self, secrets: Iterable[str]) -> None:
        found = {s.encode() for s in secrets if len(s) >= MIN_SECRET_LENGTH}
        self._secrets = sorted(found, key=len, reverse=True)
        self._pattern = re.compile(b"|".join(map(re.escape, self._secrets))) if found else None
        self._held = b""

    def text(self, value: str) -> str:
        return self.whole(value.encode("utf-8", "surrogateescape")).decode(
            "utf-8", "surrogateescape"
        )

    def whole(self, data: bytes) -> bytes:
        return self._pattern.sub(REDACTED.encode(), data) if self._pattern else data

    def feed(self, chunk: bytes) -> bytes:
        if self._pattern is None:
            return chunk
        data = self.whole(self._held + chunk)
        keep = max((_partial_at_end(data, secret) for secret in self._secrets), default=0)
        self._held = data[len(data) - keep :] if keep else b""
        return data[: len(data) - keep]

    def flush(self) -> bytes:
        held, self._held = self._held, b""
        return held


def _partial_at_end(data: bytes, secret: bytes) -> int:
    """Length of the longest proper prefix of `secret` that ends `data`."""
    i = data.find(secret[:1], max(0, len(data) - len(secret) + 1))
    while i != -1:
        if secret.startswith(data[i:]):
            return len(data) - i
        i = data.find(secret[:1], i + 1)
    return 0


class EventFrames:
    """Cuts an event stream at event boundaries: what is relayed is whole events, and the
    event being received is held (up to the cap, then ProviderAnswerTooLarge), so an error
    event the proxy appends never lands inside a half-sent one. An event ends at a blank
    line: "\n\n", "\r\r" or "\n\r" (CRLF pairs contain the last). Linear: each byte is
    searched once."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._held: list[bytes] = []
        self._size = 0
        self._last = b""  # the previous chunk's last byte: a boundary may straddle chunks

    def feed(self, chunk: bytes) -> bytes:
        window = self._last + chunk
        self._last = chunk[-1:]
        end = max(window.rfind(b"\n\n"), window.rfind(b"\r\r"), window.rfind(b"\n\r"))
        if end == -1:
            return self._hold(chunk)
        cut = end + 2 - (len(window) - len(chunk))
        if window[end + 1 : end + 2] == b"\r" and chunk[cut : cut + 1] == b"\n":
            cut += 1  # the LF of a closing CRLF goes with its event
        done = b"".join([*self._held, chunk[:cut]])
        self._held, self._size = [], 0
        self._hold(chunk[cut:])
        return done

    def _hold(self, data: bytes) -> bytes:
        if data:
            self._held.append(data)
            self._size += len(data)
        if self._size > self.limit:
            raise ProviderAnswerTooLarge(self.limit, "stream event")
        return b""

    def flush(self) -> bytes:
        """At the end of the stream: an unfinished last event, as it came."""
        held, self._held, self._size = b"".join(self._held), [], 0
        return held


class UpstreamResponse:
    """The provider's answer. Close it (`aclose`) when not read to the end."""

    def __init__(
        self,
        response: httpx.Response,
        attempts: int = 1,
        *,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        deadline: Deadline | None = None,
        secrets: Iterable[str] = (),
        closer: Closer | None = None,
    ) -> None:
        self._response = response
        self._max_body_bytes = max_body_bytes
        self._deadline = deadline
        self._scrubber = Scrubber(secrets)
        self._closer = closer or Closer()
        self._body: bytes | None = None
        self.status: int = response.status_code
        self.headers: list[tuple[str, str]] = [
            (name, self._scrubber.text(value))
            for name, value in relayable_headers(response.headers.multi_items())
        ]
        self.attempts = attempts

    @property
    def retries(self) -> int:
        return self.attempts - 1

    @property
    def provider_headers(self) -> httpx.Headers:
        """Every header the provider sent, hop-by-hop ones included (read-only use, never
        relayed: not scrubbed)."""
        return self._response.headers

    @property
    def closed(self) -> bool:
        return self._response.is_closed

    @property
    def is_event_stream(self) -> bool:
        return "text/event-stream" in self._response.headers.get("content-type", "")

    async def aread(self) -> bytes:
        """The whole body, scrubbed; ProviderAnswerTooLarge above max_body_bytes."""
        try:
            return await self._read()
        except httpx.RequestError as exc:
            raise UpstreamUnavailable.from_error(exc, self.attempts) from exc

    async def _read(self) -> bytes:
        if self._body is None:
            chunks: list[bytes] = []
            size = 0
            async for chunk in self._chunks():
                size += len(chunk)
                if size > self._max_body_bytes:
                    raise ProviderAnswerTooLarge(self._max_body_bytes)
                chunks.append(chunk)
            self._body = self._scrubber.whole(b"".join(chunks))
        return self._body

    async def aiter_bytes(self) -> AsyncIterator[bytes]:
        """Decoded chunks as they arrive, scrubbed; an event stream's in whole events, none
        above max_body_bytes. The connection is closed however this ends."""
        events = EventFrames(self._max_body_bytes) if self.is_event_stream else None
        scrubber = Scrubber(()) if self._body is not None else self._scrubber
        source = _once(self._body) if self._body is not None else self._chunks()
        try:
            async for chunk in source:
                if events is not None:
                    chunk = events.feed(chunk)
                if out := scrubber.feed(chunk):
                    yield out
        except httpx.RequestError as exc:
            raise UpstreamUnavailable.from_error(exc, self.attempts) from exc
        rest = events.flush() if events is not None else b""
        if tail := scrubber.feed(rest) + scrubber.flush():
            yield tail

    async def _chunks(self) -> AsyncIterator[bytes]:
        """The raw decoded body, each read within the deadline; closed however it ends."""
        chunks = self._response.aiter_bytes()
        try:
            while True:
                async with within(self._deadline):
                    chunk = await anext(chunks, None)
                if chunk is None:
                    return
                if chunk:
                    yield chunk
        finally:
            await self.aclose()

    async def aclose(self) -> None:
        await self._closer.close(self._response)


async def _once(body: bytes) -> AsyncIterator[bytes]:
    if body:
        yield body


def relayable_headers(headers: Iterable[tuple[str, str]]) -> list[tuple[str, str]]:
    headers = list(headers)
    dropped = RESPONSE_DROP | _connection_tokens(headers)
    return [(name, value) for name, value in headers if name.lower() not in dropped]


def forwardable_headers(headers: Mapping[str, str]) -> dict[bytes, bytes]:
    """Values go out as the bytes the client sent: aiohttp decodes header bytes as UTF-8
    with surrogateescape, and httpx would refuse (a 500) any value that is not ASCII."""
    dropped = REQUEST_DROP | _connection_tokens(headers.items())
    return {
        name.encode("utf-8", "surrogateescape"): value.encode("utf-8", "surrogateescape")
        for name, value in headers.items()
        if name.lower() not in dropped and not name.lower().startswith("proxy-")
    }


def _connection_tokens(headers: Iterable[tuple[str, str]]) -> set[str]:
    """Fields named in `Connection` are hop-by-hop too (RFC 9110 section 7.6.1)."""
    return {
        token.strip().lower()
        for name, value in headers
        if name.lower() == "connection"
        for token in value.split(",")
        if token.strip()
    }


def retry_after_seconds(headers: httpx.Headers, now: float | None = None) -> float | None:
    """The provider's requested wait: `retry-after-ms`, then `Retry-After` (secs or date)."""
    millis = headers.get("retry-after-ms")
    if millis is not None:
        try:
            return max(0.0, float(millis) / 1000)
        except ValueError:
            pass
    value = headers.get("retry-after")
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    now = time.time() if now is None else now
    return max(0.0, when.timestamp() - now)


def backoff_seconds(retry: RetrySettings, retries_done: int) -> float:
    delay = min(retry.max_backoff, retry.initial_backoff * 2**retries_done)
    return delay * (1 - JITTER * random.random())


class _RetryPolicy:
    """tenacity's wait and stop for one `send()`: provider hints, backoff, a deadline."""

    def __init__(
        self, retry: RetrySettings, replayable: bool, deadline: Deadline | None = None
    ) -> None:
        self.retry = retry
        self.max_attempts = retry.max_attempts if replayable else 1
        self.deadline = time.monotonic() + retry.max_seconds
        if deadline is not None:
            self.deadline = min(self.deadline, deadline.at)

    def wait(self, state: RetryCallState) -> float:
        outcome = state.outcome
        if outcome is not None and not outcome.failed:
            hinted = retry_after_seconds(outcome.result().provider_headers)
            if hinted is not None:
                return hinted
        return backoff_seconds(self.retry, state.attempt_number - 1)

    def stop(self, state: RetryCallState) -> bool:
        if state.attempt_number >= self.max_attempts:
            return True
        # A wait that would end past the deadline is not started: the last answer stands.
        return time.monotonic() + state.upcoming_sleep > self.deadline


def _log_retry(state: RetryCallState) -> None:
    outcome = state.outcome
    if outcome is None:
        return
    if outcome.failed:
        reason = repr(outcome.exception())
    else:
        reason = f"status {outcome.result().status}"
    log.warning(
        "retrying upstream request after %s (attempt %d, sleeping %.2fs)",
        reason,
        state.attempt_number,
        state.upcoming_sleep,
    )


def _last_outcome(state: RetryCallState) -> Any:
    """When retries are exhausted, hand back the last response (or raise the last error)."""
    assert state.outcome is not None
    return state.outcome.result()


class Upstream:
    """The only place that talks to the provider.

    Retries 429/5xx answers and connection failures with the provider's `Retry-After`
    or exponential backoff, bounded by `RetrySettings`; other answers are returned as
    they are, for the caller to relay.
    """

    def __init__(
        self,
        client: httpx.AsyncClient,
        *,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    ) -> None:
        self._client = client
        self._sleep = sleep  # injectable so tests can see the waits without taking them
        self._max_body_bytes = max_body_bytes
        self._closer = Closer()

    @classmethod
    def create(
        cls,
        connect_timeout: float,
        read_timeout: float,
        pool_size: int,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    ) -> Upstream:
        client = httpx.AsyncClient(
            http1=True,
            http2=False,
            follow_redirects=False,
            timeout=httpx.Timeout(
                connect=connect_timeout,
                read=read_timeout,
                write=read_timeout,
                pool=connect_timeout,
            ),
            limits=httpx.Limits(
                max_connections=pool_size,
                max_keepalive_connections=pool_size,
                keepalive_expiry=30.0,
            ),
        )
        pool = _pool_of(client)
        if type(pool) is httpcore.AsyncConnectionPool:
            pool.__class__ = ReclaimingPool  # same state, one more rule (below)
        return cls(client, max_body_bytes=max_body_bytes)

    def connections_in_use(self) -> int:
        """Pool connections busy with a request (connecting, sending or answering): what
        a leaked response would hold forever. 0 for a client without httpcore's pool."""
        connections = getattr(_pool_of(self._client), "connections", ())
        return sum(1 for c in connections if not c.is_idle() and not c.is_closed())

    async def aclose(self) -> None:
        await self._closer.wait()
        await self._client.aclose()

    async def send(self, request: UpstreamRequest, retry: RetrySettings) -> UpstreamResponse:
        # A body that is an async iterable is consumed by the first try: it cannot be sent
        # twice, so such a request gets exactly one attempt.
        replayable = not isinstance(request.body, AsyncIterable)
        policy = _RetryPolicy(retry, replayable, request.deadline)
        attempts = 0

        async def attempt() -> UpstreamResponse:
            nonlocal attempts
            attempts += 1
            return await self._attempt(request, attempts)

        retrying = AsyncRetrying(
            sleep=self._sleep,
            retry=(
                retry_if_exception_type(RETRY_ERRORS)
                | retry_if_result(lambda response: response.status in RETRY_STATUSES)
            ),
            wait=policy.wait,
            stop=policy.stop,
            before_sleep=_log_retry,
            retry_error_callback=_last_outcome,
        )
        try:
            async with within(request.deadline):
                response: UpstreamResponse = await retrying(attempt)
        except httpx.RequestError as exc:
            raise UpstreamUnavailable.from_error(exc, attempts) from exc
        except UpstreamUnavailable as exc:
            exc.attempts = attempts
            raise
        response.attempts = attempts
        return response

    async def _attempt(self, request: UpstreamRequest, number: int) -> UpstreamResponse:
        outgoing = self._client.build_request(
            request.method,
            _url_with_query(request.url, request.params),
            headers=forwardable_headers(request.headers),
            content=request.body,
        )
        response = await self._client.send(outgoing, stream=True)
        answer = UpstreamResponse(
            response,
            number,
            max_body_bytes=self._max_body_bytes,
            deadline=request.deadline,
            secrets=request.secrets,
            closer=self._closer,
        )
        try:
            # Error bodies are small and decide the retry; a stream's success body is
            # left unread so it can be relayed as it arrives.
            if not request.stream or response.status_code >= 400:
                await answer._read()  # a failed read is retried like a failed connect
        except BaseException:
            await answer.aclose()
            raise
        return answer


def _pool_of(client: httpx.AsyncClient) -> Any:
    """httpcore's pool behind an httpx client (httpx has no public accessor), or None."""
    return getattr(getattr(client, "_transport", None), "_pool", None)


class ReclaimingPool(httpcore.AsyncConnectionPool):
    """httpcore's pool, minus a leak (httpcore 1.0.9, encode/httpcore#1093): a request
    cancelled after the pool gave it a connection, but before it used it (still
    connecting, or connected and NEW), leaves that connection in the pool forever: being
    neither closed, idle nor available, it holds a slot until the pool is full and every
    request times out. Every connection in use is held by a request of the pool (until
    its response is closed), so one that no request holds and that is neither idle nor
    closed is such an orphan: it is dropped and closed whenever the pool reassigns its
    requests, which httpcore does right after removing the cancelled one."""

    def _assign_requests_to_connections(self) -> list[httpcore.AsyncConnectionInterface]:
        held = {id(r.connection) for r in self._requests if r.connection is not None}
        orphans = [
            connection
            for connection in self._connections
            if id(connection) not in held
            and not connection.is_idle()
            and not connection.is_closed()
        ]
        for connection in orphans:
            self._connections.remove(connection)
        return [*orphans, *super()._assign_requests_to_connections()]


def _url_with_query(url: str, params: str | None) -> httpx.URL:
    parsed = httpx.URL(url)
    if params:
        # The raw query goes through as is (re-encoding could change what it means); only
        # characters a URL cannot carry literally are percent-encoded.
        raw = "".join(
            c if c.isascii() and c.isprintable() and c != " " else quote(c) for c in params
        )
        parsed = parsed.copy_with(query=raw.lstrip("?").encode("ascii"))
    return parsed
