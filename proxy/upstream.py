"""The provider seam: one `send()` that forwards a request and retries safely (SPEC 1, 3).

Retries happen only inside `send()`, that is before a single byte has reached the client:
once `send()` returns, the caller relays what it got. A stream request returns as soon as
the provider's headers arrive; its body is then read chunk by chunk as the network
delivers it.

>>> upstream = Upstream(connect_timeout=5, read_timeout=600, pool_size=100)
>>> response = await upstream.send(
...     UpstreamRequest("POST", "https://api.openai.com/v1/chat/completions",
...                     {"authorization": "Bearer sk-..."}, body, stream=True),
...     RetrySettings(),
... )
>>> async for chunk in response.aiter_bytes():
...     ...  # write chunk to the client

The client is aiohttp's: one `ClientSession` per provider origin (scheme, host, port),
opened on first use and closed by `aclose()` (the app's cleanup). Each pool serves at most
`pool_size` requests at a time; the bound is a semaphore of this module rather than the
connector's limit, so a request cancelled while it waits for a slot gives the slot back
and `connections_in_use()` is exact.

Everything the provider sends back passes `UpstreamResponse`, so the guarantees about it
live there: what is buffered is capped (`max_body_bytes`; one event of an event stream
too), the request's `Deadline` bounds the whole exchange, the tenant's provider key
(`UpstreamRequest.secrets`) is scrubbed from headers, bodies and streams, and releasing
the connection is synchronous, so a cancelled caller (a client that went away) cannot cut
it short and the connection always goes back to the pool.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import io
import logging
import random
import re
import time
import urllib.request
from collections.abc import (
    AsyncGenerator,
    AsyncIterable,
    AsyncIterator,
    Awaitable,
    Callable,
    Iterable,
    Mapping,
)
from dataclasses import dataclass, field, replace
from email.utils import parsedate_to_datetime
from typing import Any
from urllib.parse import quote

import aiohttp
from multidict import CIMultiDictProxy
from tenacity import (
    AsyncRetrying,
    RetryCallState,
    retry_if_exception_type,
    retry_if_result,
    stop_after_attempt,
    stop_any,
    stop_before_delay,
)
from yarl import URL

from proxy.logs import MIN_SECRET_LENGTH, REDACTED
from proxy.sse import EventFramer, EventTooLarge
from proxy.tracing import NO_TRACING, set_attributes

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
# aiohttp sets these itself; accept-encoding too, so the body is one it can decode.
REQUEST_DROP = HOP_BY_HOP | {"host", "content-length", "accept-encoding"}
# The proxy relays decoded bytes, so length and encoding no longer describe them.
RESPONSE_DROP = HOP_BY_HOP | {"content-length", "content-encoding"}

RETRY_STATUSES = frozenset({429, 500, 502, 503, 504})


class PoolTimeout(aiohttp.ConnectionTimeoutError):
    """No connection of the pool came free within connect_timeout."""


# Failures before the provider could have acted on the request, or while reading a body
# that is read whole before `send()` returns: connecting (refused, reset, TLS), the
# connection dropped before the answer, a body cut off, a connect or pool timeout. A read
# timeout is not among them: the provider may be generating, and a second try pays twice.
RETRY_ERRORS: tuple[type[BaseException], ...] = (
    aiohttp.ClientOSError,  # ClientConnectorError included
    aiohttp.ClientConnectionResetError,
    aiohttp.ServerDisconnectedError,
    aiohttp.ClientPayloadError,
    aiohttp.ConnectionTimeoutError,  # PoolTimeout included
)
JITTER = 0.25  # backoff is shortened by up to this fraction so clients do not stampede
DEFAULT_MAX_BODY_BYTES = 64 * 1024 * 1024
KEEPALIVE_SECONDS = 30.0  # an idle pooled connection is closed after this
LARGE_BODY = 1024 * 1024  # aiohttp writes bytes whole (and warns) above this size


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
        status = 504 if isinstance(error, TimeoutError) else 502
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


def within(deadline: Deadline | None) -> _Within:
    """Raises DeadlineExceeded when the block runs past the deadline (and only then: a
    timeout of the block's own, aiohttp's read timeout say, passes through as it is)."""
    return _Within(deadline)


class _Within:
    """`within`'s scope: asyncio's timeout, a class rather than a generator (entered two
    or three times a request)."""

    __slots__ = ("_deadline", "_scope")

    def __init__(self, deadline: Deadline | None) -> None:
        self._deadline = deadline
        self._scope: asyncio.Timeout | None = None

    async def __aenter__(self) -> None:
        if self._deadline is not None:
            self._scope = asyncio.timeout(self._deadline.remaining())
            await self._scope.__aenter__()

    async def __aexit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: Any
    ) -> None:
        if self._scope is None:
            return
        try:
            await self._scope.__aexit__(kind, error, trace)
        except TimeoutError:
            if self._scope.expired():
                assert self._deadline is not None
                raise DeadlineExceeded(self._deadline.seconds) from None
            raise


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
        if self._pattern is None:
            return value
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


class UpstreamResponse:
    """The provider's answer. Close it (`aclose`) when not read to the end."""

    def __init__(
        self,
        response: aiohttp.ClientResponse,
        attempts: int = 1,
        *,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        deadline: Deadline | None = None,
        secrets: Iterable[str] = (),
        on_release: Callable[[], None] | None = None,
    ) -> None:
        self._response = response
        self._max_body_bytes = max_body_bytes
        self._deadline = deadline
        self._scrubber = Scrubber(secrets)
        self._on_release = on_release
        self._released = False
        self._body: bytes | None = None
        self.status: int = response.status
        self.headers: list[tuple[str, str]] = [
            (name, self._scrubber.text(value))
            for name, value in relayable_headers(response.headers.items())
        ]
        self.attempts = attempts

    @property
    def retries(self) -> int:
        return self.attempts - 1

    @property
    def provider_headers(self) -> CIMultiDictProxy[str]:
        """Every header the provider sent, hop-by-hop ones included (read-only use, never
        relayed: not scrubbed)."""
        return self._response.headers

    @property
    def closed(self) -> bool:
        return self._released

    @property
    def is_event_stream(self) -> bool:
        return "text/event-stream" in self._response.headers.get("content-type", "")

    async def aread(self) -> bytes:
        """The whole body, scrubbed; ProviderAnswerTooLarge above max_body_bytes."""
        try:
            return await self._read()
        except aiohttp.ClientError as exc:
            raise UpstreamUnavailable.from_error(exc, self.attempts) from exc

    async def _read(self) -> bytes:
        if self._body is None:
            content = self._response.content
            if content.is_eof() and content.exception() is None:
                # The whole body came with the headers (most answers): nothing to wait for.
                try:
                    body = content.read_nowait()
                finally:
                    self._release()
                if len(body) > self._max_body_bytes:
                    raise ProviderAnswerTooLarge(self._max_body_bytes)
            else:
                body = await self._read_arriving()
            self._body = self._scrubber.whole(body)
        return self._body

    async def _read_arriving(self) -> bytes:
        chunks: list[bytes] = []
        size = 0
        # One deadline scope for the whole body (nothing else runs between its reads).
        async with within(self._deadline), contextlib.aclosing(self._chunks(False)) as body:
            async for chunk in body:
                size += len(chunk)
                if size > self._max_body_bytes:
                    raise ProviderAnswerTooLarge(self._max_body_bytes)
                chunks.append(chunk)
        return b"".join(chunks)

    async def aiter_bytes(self) -> AsyncIterator[bytes]:
        """Decoded chunks as they arrive, scrubbed; an event stream's in whole events, none
        above max_body_bytes. The connection is released however this ends."""
        framer = EventFramer(self._max_body_bytes) if self.is_event_stream else None
        scrubber = Scrubber(()) if self._body is not None else self._scrubber
        source = _once(self._body) if self._body is not None else self._chunks()
        try:
            async for chunk in source:
                if framer is not None:
                    chunk = framer.feed(chunk)
                if out := scrubber.feed(chunk):
                    yield out
        except aiohttp.ClientError as exc:
            raise UpstreamUnavailable.from_error(exc, self.attempts) from exc
        except EventTooLarge as exc:
            raise ProviderAnswerTooLarge(exc.limit, "stream event") from None
        finally:
            await source.aclose()  # runs no awaits: the connection is released at once
            self._release()
        rest = framer.rest() if framer is not None else b""
        if tail := scrubber.feed(rest) + scrubber.flush():
            yield tail

    async def _chunks(self, timed: bool = True) -> AsyncGenerator[bytes]:
        """The raw decoded body, each read within the deadline (`timed` False: the caller
        reads it all within one); released however it ends. What has arrived already is
        taken without a timeout scope (a stream's events often have), the deadline
        checked instead."""
        content = self._response.content
        deadline = self._deadline
        try:
            while True:
                if deadline is None or not timed:
                    chunk = await content.readany()
                elif chunk := content.read_nowait():
                    if deadline.remaining() <= 0:
                        raise DeadlineExceeded(deadline.seconds)
                else:
                    async with within(deadline):
                        chunk = await content.readany()
                if not chunk:
                    return
                yield chunk
        finally:
            self._release()

    async def aclose(self) -> None:
        self._release()

    def _release(self) -> None:
        """Synchronous, so no cancellation can cut it short: before this returns, aiohttp
        has handed the connection back to its pool (or closed it, when the body was not
        read to its end) and the pool's slot is free."""
        if self._released:
            return
        self._released = True
        self._response.release()
        if self._on_release is not None:
            self._on_release()


async def _once(body: bytes) -> AsyncGenerator[bytes]:
    if body:
        yield body


def relayable_headers(headers: Iterable[tuple[str, str]]) -> list[tuple[str, str]]:
    headers = list(headers)
    dropped = RESPONSE_DROP | _connection_tokens(headers)
    return [(name, value) for name, value in headers if name.lower() not in dropped]


def forwardable_headers(headers: Mapping[str, str]) -> dict[str, str]:
    """The client's headers minus hop-by-hop ones. aiohttp decodes header bytes as UTF-8
    with surrogateescape and writes values as UTF-8, so a value the client sent in UTF-8
    goes out as the very bytes it sent; bytes that are not UTF-8 cannot be written and go
    out as U+FFFD (never a 500)."""
    dropped = REQUEST_DROP | _connection_tokens(headers.items())
    return {
        name: value if value.isascii() else _writable(value)
        for name, value in headers.items()
        if name.lower() not in dropped and not name.lower().startswith("proxy-")
    }


def _writable(value: str) -> str:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:  # lone surrogates: the client's bytes were not UTF-8
        return value.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
    return value


def _connection_tokens(headers: Iterable[tuple[str, str]]) -> set[str]:
    """Fields named in `Connection` are hop-by-hop too (RFC 9110 section 7.6.1)."""
    return {
        token.strip().lower()
        for name, value in headers
        if name.lower() == "connection"
        for token in value.split(",")
        if token.strip()
    }


def retry_after_seconds(headers: Mapping[str, str], now: float | None = None) -> float | None:
    """The provider's requested wait: `retry-after-ms`, then `Retry-After` (secs or date).
    `headers` looks names up case-insensitively (a CIMultiDict)."""
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


def retry_wait(retry: RetrySettings) -> Callable[[RetryCallState], float]:
    """tenacity's wait: the provider's Retry-After / retry-after-ms when its answer gives
    one, else exponential backoff with jitter."""

    def wait(state: RetryCallState) -> float:
        outcome = state.outcome
        if outcome is not None and not outcome.failed:
            hinted = retry_after_seconds(outcome.result().provider_headers)
            if hinted is not None:
                return hinted
        return backoff_seconds(retry, state.attempt_number - 1)

    return wait


def retry_stop(retry: RetrySettings, replayable: bool, deadline: Deadline | None) -> stop_any:
    """tenacity's stop: the attempts (one for a body that cannot be sent twice), and a wait
    that would end past max_seconds or the request's deadline is not started (the last
    answer stands)."""
    seconds = retry.max_seconds
    if deadline is not None:
        seconds = min(seconds, deadline.remaining())
    attempts = retry.max_attempts if replayable else 1
    return stop_any(stop_after_attempt(attempts), stop_before_delay(seconds))


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


class _Pool:
    """The connections to one provider origin: an aiohttp session, and a slot per request
    on it (at most `size` at a time). The slots are an asyncio.Semaphore, which gives a
    slot back when a request is cancelled while it waits, even just after it was woken;
    the connector itself is unbounded and so never makes a request wait."""

    def __init__(self, size: int, timeout: aiohttp.ClientTimeout, proxy: str | None) -> None:
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_SECONDS),
            timeout=timeout,
            cookie_jar=aiohttp.DummyCookieJar(),  # one client for every tenant: no cookies
            proxy=proxy,
        )
        self._slots = asyncio.Semaphore(size)
        self.in_use = 0

    async def acquire(self, wait: float) -> None:
        if self._slots.locked():
            try:
                async with asyncio.timeout(wait):
                    await self._slots.acquire()
            except TimeoutError:
                raise PoolTimeout(f"no upstream connection came free within {wait:g} s") from None
        else:
            await self._slots.acquire()  # free: returns at once
        self.in_use += 1

    def release(self) -> None:
        self.in_use -= 1
        self._slots.release()


class _Upload:
    """A streamed request body. aiohttp writes it from a task of its own and reports any
    failure as a lost connection; an error of the body itself (a client too slow, say) is
    kept here so `send()` raises it as it was."""

    def __init__(self, body: AsyncIterable[bytes]) -> None:
        self._body = body
        self.error: Exception | None = None

    async def __aiter__(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._body:
                yield chunk
        except Exception as exc:
            self.error = exc
            raise


class Upstream:
    """The only place that talks to the provider.

    Retries 429/5xx answers and connection failures with the provider's `Retry-After`
    or exponential backoff, bounded by `RetrySettings`; other answers are returned as
    they are, for the caller to relay.
    """

    def __init__(
        self,
        *,
        connect_timeout: float = 10.0,
        read_timeout: float = 600.0,
        pool_size: int = 100,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        # connect bounds DNS and connecting; sock_read each read, headers included.
        self._timeout = aiohttp.ClientTimeout(
            total=None,
            connect=connect_timeout,
            sock_connect=connect_timeout,
            sock_read=read_timeout,
        )
        self._connect_timeout = connect_timeout  # also how long to wait for a pool slot
        self._pool_size = pool_size
        self._max_body_bytes = max_body_bytes
        self._sleep = sleep  # injectable so tests can see the waits without taking them
        self.tracing = NO_TRACING  # the app sets its own (proxy/tracing.py)
        self._pools: dict[tuple[str, str | None, int | None], _Pool] = {}
        self._closed = False

    @classmethod
    def create(
        cls,
        connect_timeout: float,
        read_timeout: float,
        pool_size: int,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    ) -> Upstream:
        return cls(
            connect_timeout=connect_timeout,
            read_timeout=read_timeout,
            pool_size=pool_size,
            max_body_bytes=max_body_bytes,
        )

    def connections_in_use(self) -> int:
        """Pool connections busy with a request (connecting, sending or answering): what
        a leaked response would hold forever."""
        return sum(pool.in_use for pool in self._pools.values())

    async def aclose(self) -> None:
        self._closed = True
        pools, self._pools = list(self._pools.values()), {}
        await asyncio.gather(*(pool.session.close() for pool in pools))

    async def send(self, request: UpstreamRequest, retry: RetrySettings) -> UpstreamResponse:
        url = _url_with_query(request.url, request.params)
        # A body that is an async iterable is consumed by the first try: it cannot be sent
        # twice, so such a request gets exactly one attempt.
        replayable = not isinstance(request.body, AsyncIterable)
        attempts = 0
        first: UpstreamResponse | BaseException | None = None  # an attempt made, to retry

        async def attempt() -> UpstreamResponse:
            nonlocal attempts, first
            if first is not None:  # tenacity's first try is the one already made
                made, first = first, None
                if isinstance(made, BaseException):
                    raise made
                return made
            attempts += 1
            return await self._attempt(request, url, attempts)

        started = time.monotonic()
        try:
            async with within(request.deadline):
                # Most answers need no retry: tenacity is entered only for one that does,
                # with the time the first try took counted against max_seconds.
                try:
                    response: UpstreamResponse = await attempt()
                    if response.status in RETRY_STATUSES:
                        first = response
                except RETRY_ERRORS as exc:
                    first = exc
                if first is not None:
                    spent = time.monotonic() - started
                    left = replace(retry, max_seconds=max(0.0, retry.max_seconds - spent))
                    response = await self._retrying(left, replayable, request.deadline)(attempt)
        except aiohttp.ClientError as exc:
            raise UpstreamUnavailable.from_error(exc, attempts) from exc
        except UpstreamUnavailable as exc:
            exc.attempts = attempts
            raise
        response.attempts = attempts
        return response

    def _retrying(
        self, retry: RetrySettings, replayable: bool, deadline: Deadline | None
    ) -> AsyncRetrying:
        return AsyncRetrying(
            sleep=self._sleep,
            retry=(
                retry_if_exception_type(RETRY_ERRORS)
                | retry_if_result(lambda response: response.status in RETRY_STATUSES)
            ),
            wait=retry_wait(retry),
            stop=retry_stop(retry, replayable, deadline),
            before_sleep=_log_retry,
            retry_error_callback=_last_outcome,
        )

    async def _attempt(self, request: UpstreamRequest, url: URL, number: int) -> UpstreamResponse:
        if not self.tracing.on:
            return await self._exchange(request, url, number, forwardable_headers(request.headers))
        attributes: dict[str, str | int] = {
            "http.request.method": request.method,
            "server.address": url.host or "",
            "url.path": url.path,
            "http.request.resend_count": number - 1,
        }
        with self.tracing.span(f"{request.method} upstream", attributes, kind="client") as span:
            headers = forwardable_headers(request.headers)
            self.tracing.inject(headers)  # this attempt's traceparent, for the provider
            answer = await self._exchange(request, url, number, headers)
            set_attributes(span, {"http.response.status_code": answer.status})
            return answer

    async def _exchange(
        self, request: UpstreamRequest, url: URL, number: int, headers: Mapping[str, str]
    ) -> UpstreamResponse:
        pool = self._pool(url)
        await pool.acquire(self._connect_timeout)
        body = request.body
        upload = _Upload(body) if isinstance(body, AsyncIterable) else None
        data = _in_pieces(body) if upload is None else upload
        try:
            response = await pool.session.request(
                request.method,
                url,
                headers=headers,
                data=data,
                allow_redirects=False,
                skip_auto_headers=_skipped_auto_headers(headers),
            )
        except BaseException:
            pool.release()
            if upload is not None and upload.error is not None:
                raise upload.error from None
            raise
        answer = UpstreamResponse(
            response,
            number,
            max_body_bytes=self._max_body_bytes,
            deadline=request.deadline,
            secrets=request.secrets,
            on_release=pool.release,
        )
        try:
            # Error bodies are small and decide the retry; a stream's success body is
            # left unread so it can be relayed as it arrives.
            if not request.stream or answer.status >= 400:
                await answer._read()  # a failed read is retried like a failed connect
        except BaseException:
            await answer.aclose()
            raise
        return answer

    def _pool(self, url: URL) -> _Pool:
        key = (url.scheme, url.host, url.port)
        pool = self._pools.get(key)
        if pool is None:
            if self._closed:  # shutting down: no new session that nothing would close
                raise aiohttp.ClientConnectionError("the upstream client is closed")
            pool = self._pools[key] = _Pool(self._pool_size, self._timeout, _env_proxy(url))
        return pool


_NO_CONTENT_TYPE = ("Content-Type",)


def _skipped_auto_headers(headers: Mapping[str, str]) -> tuple[str, ...] | None:
    """aiohttp makes up a Content-Type for a body that has none: not unless the client
    sent one. (None when it did: aiohttp's fast path, no per-request header copies.)"""
    for name in headers:
        if name.lower() == "content-type":
            return None
    return _NO_CONTENT_TYPE


def _in_pieces(body: bytes | AsyncIterable[bytes] | None) -> Any:
    """A large body goes out from a BytesIO (no copy), 64 KiB at a time with the loop
    free in between, as aiohttp advises."""
    return io.BytesIO(body) if isinstance(body, bytes) and len(body) > LARGE_BODY else body


def _env_proxy(url: URL) -> str | None:
    """HTTP(S)_PROXY / NO_PROXY, read once per pool. (aiohttp's trust_env would read them
    per request, and ~/.netrc too, whose credentials replace the client's Authorization.)"""
    if url.host is None or urllib.request.proxy_bypass(url.host):
        return None
    return urllib.request.getproxies().get(url.scheme)


@functools.lru_cache(maxsize=1024)  # a URL is immutable; the same few are sent every time
def _url(url: str) -> URL:
    return URL(url)


def _url_with_query(url: str, params: str | None) -> URL:
    parsed = _url(url)
    if not params:
        return parsed
    # The raw query goes through as is (re-encoding could change what it means); only
    # characters a URL cannot carry literally are percent-encoded.
    raw = "".join(
        c if c.isascii() and c.isprintable() and c not in " #" else quote(c) for c in params
    )
    return URL(f"{parsed.with_query(None)}?{raw.lstrip('?')}", encoded=True)
