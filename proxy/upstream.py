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
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from email.utils import parsedate_to_datetime
from typing import Any
from urllib.parse import quote

import httpx
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception_type, retry_if_result

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


@dataclass(frozen=True)
class RetrySettings:
    max_attempts: int = 3  # total tries, the first included
    max_seconds: float = 30.0  # overall bound: never sleep past it
    initial_backoff: float = 0.5
    max_backoff: float = 8.0


@dataclass(frozen=True)
class UpstreamRequest:
    method: str
    url: str  # absolute
    headers: Mapping[str, str]
    body: bytes | AsyncIterable[bytes] | None = None
    stream: bool = False
    params: str | None = None  # raw query string, forwarded as is


class UpstreamUnavailable(Exception):
    """The provider could not be reached: 502 for connection errors, 504 for timeouts."""

    def __init__(self, status: int, message: str, attempts: int = 1) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.attempts = attempts

    @classmethod
    def from_error(cls, error: BaseException, attempts: int = 1) -> UpstreamUnavailable:
        status = 504 if isinstance(error, httpx.TimeoutException) else 502
        reason = "timed out" if status == 504 else "unreachable"
        detail = str(error) or type(error).__name__
        return cls(status, f"upstream provider {reason}: {detail}", attempts)


class UpstreamResponse:
    """The provider's answer. Close it (or use `async with`) when not read to the end."""

    def __init__(self, response: httpx.Response, attempts: int = 1) -> None:
        self._response = response
        self.status: int = response.status_code
        self.headers: list[tuple[str, str]] = relayable_headers(response.headers.multi_items())
        self.attempts = attempts

    @property
    def retries(self) -> int:
        return self.attempts - 1

    @property
    def provider_headers(self) -> httpx.Headers:
        """Every header the provider sent, hop-by-hop ones included (read-only use)."""
        return self._response.headers

    @property
    def closed(self) -> bool:
        return self._response.is_closed

    async def aread(self) -> bytes:
        try:
            return await self._response.aread()
        except httpx.RequestError as exc:
            raise UpstreamUnavailable.from_error(exc, self.attempts) from exc
        finally:
            await self._response.aclose()

    async def aiter_bytes(self) -> AsyncIterator[bytes]:
        """Decoded chunks as they arrive; the connection is closed however this ends."""
        try:
            async for chunk in self._response.aiter_bytes():
                if chunk:
                    yield chunk
        except httpx.RequestError as exc:
            raise UpstreamUnavailable.from_error(exc, self.attempts) from exc
        finally:
            await self._response.aclose()

    async def aclose(self) -> None:
        await self._response.aclose()

    async def __aenter__(self) -> UpstreamResponse:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()


def relayable_headers(headers: Iterable[tuple[str, str]]) -> list[tuple[str, str]]:
    headers = list(headers)
    dropped = RESPONSE_DROP | _connection_tokens(headers)
    return [(name, value) for name, value in headers if name.lower() not in dropped]


def forwardable_headers(headers: Mapping[str, str]) -> dict[str, str]:
    dropped = REQUEST_DROP | _connection_tokens(headers.items())
    return {
        name: value
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

    def __init__(self, retry: RetrySettings, replayable: bool) -> None:
        self.retry = retry
        self.max_attempts = retry.max_attempts if replayable else 1
        self.deadline = time.monotonic() + retry.max_seconds

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
    ) -> None:
        self._client = client
        self._sleep = sleep  # injectable so tests can see the waits without taking them

    @classmethod
    def create(cls, connect_timeout: float, read_timeout: float, pool_size: int) -> Upstream:
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
        return cls(client)

    async def aclose(self) -> None:
        await self._client.aclose()

    async def send(self, request: UpstreamRequest, retry: RetrySettings) -> UpstreamResponse:
        # A body that is an async iterable is consumed by the first try: it cannot be sent
        # twice, so such a request gets exactly one attempt.
        replayable = not isinstance(request.body, AsyncIterable)
        policy = _RetryPolicy(retry, replayable)
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
            response: UpstreamResponse = await retrying(attempt)
        except httpx.RequestError as exc:
            raise UpstreamUnavailable.from_error(exc, attempts) from exc
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
        try:
            # Error bodies are small and decide the retry; a stream's success body is
            # left unread so it can be relayed as it arrives.
            if not request.stream or response.status_code >= 400:
                await response.aread()
        except BaseException:
            await response.aclose()
            raise
        return UpstreamResponse(response, number)


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
