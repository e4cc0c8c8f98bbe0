"""Forwarding to the provider and relaying its answer back, streamed or not.

Streams are relayed as they arrive (never buffered to the end), whole events at a time,
and decoded on the side (proxy/sse.py) so the log line can carry the final usage. Every
answer passes its API's shape check first (proxy/core/answers.py): a malformed one is a
502, or in a stream an error event that ends it. A client that goes
away cancels the handler (handler_cancellation) and with it the upstream request.
Passthrough bodies are relayed as they arrive too, so nothing but a model answer is
buffered (and that only up to max_provider_body_bytes, proxy/upstream.py). A stream the
proxy cannot finish ends with one error event (`stream_failure`).
"""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import AsyncIterable, Mapping
from typing import Any, Literal, Protocol

import asyncpg
import structlog
from aiohttp import web
from multidict import CIMultiDict

from proxy.core.answers import BadAnswer, check_answer
from proxy.logs import register_secret
from proxy.policy import Policy, PolicyError
from proxy.server.errors import ApiError, error_body
from proxy.server.state import ENV, LOG_FIELDS, METRICS, REQUEST_ID, SETTINGS, UPSTREAM
from proxy.sse import (
    ChatStreamAccumulator,
    EventFramer,
    ResponsesStreamAccumulator,
    SSEDecoder,
    SSEEvent,
    encode_event,
)
from proxy.store.base import StoreError
from proxy.upstream import (
    Deadline,
    RetrySettings,
    UpstreamRequest,
    UpstreamResponse,
    UpstreamUnavailable,
)

log = structlog.get_logger("threadkeeper.relay")

Family = Literal["chat", "responses"]

HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "trailers",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
        "content-encoding",
        "accept-encoding",
    }
)
# Headers meant for the proxy itself, never forwarded.
PROXY_ONLY = frozenset({"x-thread-id", "idempotency-key"})

# Capture hook of the Idempotency-Key middleware (proxy/server/idempotency.py): when a
# request carries a tap, every byte its stream sends the client is also appended to it.
STREAM_TAP: web.RequestKey[list[bytes]] = web.RequestKey("stream_tap", list)
# One deadline per client request, shared by every exchange it has with the provider.
DEADLINE = web.RequestKey("upstream_deadline", Deadline)
# What a store failure looks like, whichever backend raised it.
STORE_FAILURES: tuple[type[BaseException], ...] = (
    StoreError,
    sqlite3.Error,
    asyncpg.PostgresError,
    asyncpg.InterfaceError,
)


def stream_response(
    request: web.Request, *, status: int, headers: CIMultiDict[str]
) -> web.StreamResponse:
    """The StreamResponse a relay writes to; tapped when request[STREAM_TAP] is set. It
    carries the request id like every other answer (its error event quotes it)."""
    if REQUEST_ID in request:
        headers["x-threadkeeper-request-id"] = request[REQUEST_ID]
    tap = request.get(STREAM_TAP)
    if tap is None:
        return web.StreamResponse(status=status, headers=headers)
    return _TappedStream(tap, status=status, headers=headers)


class _TappedStream(web.StreamResponse):
    def __init__(self, tap: list[bytes], *, status: int, headers: CIMultiDict[str]) -> None:
        super().__init__(status=status, headers=headers)
        self._tap = tap

    async def write(self, data: bytes | bytearray | memoryview) -> None:
        await super().write(data)
        self._tap.append(bytes(data))

    async def write_eof(self, data: bytes = b"") -> None:
        await super().write_eof(data)
        if data:
            self._tap.append(bytes(data))


def upstream_base(request: web.Request, policy: Policy) -> str:
    return (policy.upstream.base_url or request.app[SETTINGS].upstream_url).rstrip("/")


def provider_key(request: web.Request, policy: Policy) -> str | None:
    """The tenant's provider key; None = the client's own Authorization is forwarded."""
    try:
        key = policy.upstream_key(request.app[ENV])
    except PolicyError as exc:
        log.error("provider_key_missing", tenant=policy.tenant, problem=str(exc))
        raise ApiError(
            500,
            f"The proxy has no provider key for tenant '{policy.tenant}' "
            "(its upstream.api_key_env is not set).",
            type="server_error",
            code="upstream_key_missing",
        ) from None
    if key is not None:
        register_secret(key)
    return key


def upstream_headers(request: web.Request, key: str | None) -> dict[str, str]:
    """Client headers minus hop-by-hop ones; the tenant's provider key when it has one."""
    headers = {
        name: value
        for name, value in request.headers.items()
        if name.lower() not in HOP_BY_HOP and name.lower() not in PROXY_ONLY
    }
    if key is not None:
        for name in [n for n in headers if n.lower() == "authorization"]:
            del headers[name]
        headers["Authorization"] = f"Bearer {key}"
    return headers


def request_deadline(request: web.Request, policy: Policy) -> Deadline:
    """Set by the request's first exchange with the provider; later ones (ledger
    continuations) share what is left of it."""
    if DEADLINE not in request:
        request[DEADLINE] = Deadline.after(policy.upstream.deadline_seconds)
    return request[DEADLINE]


def relay_headers(upstream: UpstreamResponse, extra: Mapping[str, str]) -> CIMultiDict[str]:
    headers: CIMultiDict[str] = CIMultiDict()
    for name, value in upstream.headers:
        if name.lower() not in HOP_BY_HOP:
            headers.add(name, value)
    for name, value in extra.items():
        headers[name] = value
    return headers


def retry_settings(policy: Policy) -> RetrySettings:
    retry = policy.retry
    return RetrySettings(
        max_attempts=retry.max_attempts,
        max_seconds=retry.max_seconds,
        initial_backoff=retry.initial_backoff,
        max_backoff=retry.max_backoff,
    )


async def send_upstream(
    request: web.Request,
    policy: Policy,
    *,
    path: str,
    body: bytes | AsyncIterable[bytes] | None,
    stream: bool,
    route: str,
    retry: bool = True,
) -> UpstreamResponse:
    key = provider_key(request, policy)
    up_request = UpstreamRequest(
        method=request.method,
        url=upstream_base(request, policy) + path,
        headers=upstream_headers(request, key),
        body=body,
        stream=stream,
        params=request.rel_url.raw_query_string or None,
        deadline=request_deadline(request, policy),
        secrets=(key,) if key is not None else (),
    )
    settings = retry_settings(policy) if retry else RetrySettings(max_attempts=1)
    started = time.perf_counter()
    try:
        response = await request.app[UPSTREAM].send(up_request, settings)
    except UpstreamUnavailable as exc:
        request[LOG_FIELDS]["upstream_error"] = exc.message
        raise upstream_error(exc) from None
    elapsed = time.perf_counter() - started
    metrics = request.app[METRICS]
    metrics.upstream_latency.labels(route).observe(elapsed)
    if response.retries:
        metrics.upstream_retries.labels(route).inc(response.retries)
    # Time to the provider's headers (its whole answer when not streamed): the request's
    # latency_ms minus this is what the proxy itself cost.
    request[LOG_FIELDS].update(
        upstream_status=response.status,
        retries=response.retries,
        upstream_ms=round(elapsed * 1000, 3),
    )
    return response


def is_event_stream(upstream: UpstreamResponse) -> bool:
    return upstream.is_event_stream


async def read_body(upstream: UpstreamResponse) -> bytes:
    """The provider's whole (non-stream) body; a connection lost while reading it is
    OpenAI's server_error, not a 500."""
    try:
        return await upstream.aread()
    except UpstreamUnavailable as exc:
        raise upstream_error(exc) from None


def upstream_error(exc: UpstreamUnavailable) -> ApiError:
    return ApiError(exc.status, exc.message, type="server_error", code=exc.code)


BAD_ANSWER = "bad_upstream_answer"


def provider_answer(family: Family, body: bytes) -> dict[str, Any]:
    """A successful non-streamed answer, parsed and checked (proxy/core/answers.py): the
    one gate before any flow reads or keeps it. A malformed one is a 502."""
    try:
        answer = json.loads(body)
    except (ValueError, RecursionError):
        raise bad_answer(BadAnswer("it is not JSON")) from None
    try:
        return check_answer(family, answer)
    except BadAnswer as exc:
        raise bad_answer(exc) from None


def bad_answer(exc: BadAnswer) -> ApiError:
    return ApiError(502, str(exc), type="server_error", code=BAD_ANSWER)


async def relay_response(
    request: web.Request,
    upstream: UpstreamResponse,
    *,
    family: Family | None,
    extra_headers: Mapping[str, str],
) -> web.StreamResponse:
    headers = relay_headers(upstream, extra_headers)
    if family is None and not upstream.closed and not is_event_stream(upstream):
        return await _relay_body(request, upstream, headers)
    if not is_event_stream(upstream):
        body = await read_body(upstream)
        if family is not None and upstream.status < 400:
            _log_usage(request, family, provider_answer(family, body))
        return web.Response(status=upstream.status, body=body, headers=headers)
    return await _relay_stream(request, upstream, family, headers)


async def _relay_body(
    request: web.Request, upstream: UpstreamResponse, headers: CIMultiDict[str]
) -> web.StreamResponse:
    """A passthrough body (a file download, say) as it arrives, never buffered. When the
    provider fails midway the connection is dropped before the body's end, so the client
    sees an incomplete body rather than a short one."""
    response = stream_response(request, status=upstream.status, headers=headers)
    await response.prepare(request)
    try:
        async for chunk in upstream.aiter_bytes():
            await response.write(chunk)
    except UpstreamUnavailable as exc:
        log.warning("upstream_body_broken", error=exc.message)
        request[LOG_FIELDS]["stream_error"] = exc.message
        if request.transport is not None:
            request.transport.abort()
        raise ConnectionResetError("the provider's body broke off") from None
    finally:
        await upstream.aclose()
    await response.write_eof()
    return response


async def _relay_stream(
    request: web.Request,
    upstream: UpstreamResponse,
    family: Family | None,
    headers: CIMultiDict[str],
) -> web.StreamResponse:
    response = stream_response(request, status=upstream.status, headers=headers)
    await response.prepare(request)
    accumulator = _accumulator(family)
    try:
        if family is None or accumulator is None:  # no API shape: bytes as they come
            async for chunk in upstream.aiter_bytes():
                await response.write(chunk)
        else:
            await _relay_events(request, response, upstream, family, accumulator)
    except (ConnectionError, ApiError):
        raise
    except BadAnswer as exc:
        await bad_stream(request, response, family, exc)
    except Exception as exc:  # the provider cut the stream after we started relaying
        await response.write(stream_failure(request, family, exc))
    finally:
        await upstream.aclose()
    if accumulator is not None and family is not None:
        _log_usage(request, family, _accumulated(accumulator))
    await response.write_eof()
    return response


async def _relay_events(
    request: web.Request,
    response: web.StreamResponse,
    upstream: UpstreamResponse,
    family: Family,
    accumulator: ChatStreamAccumulator | ResponsesStreamAccumulator,
) -> None:
    """The provider's bytes, each event checked before it is relayed (untouched), whole
    events at a time: a malformed event is never sent, and an error event after it is a
    clean event of its own."""
    decoder = SSEDecoder()
    framer = EventFramer()
    async for chunk in upstream.aiter_bytes():
        for event in decoder.feed(chunk):
            accumulator.feed_event(event)
        if ready := framer.feed(chunk):
            await response.write(ready)
    for event in decoder.flush():
        accumulator.feed_event(event)
    if rest := framer.rest():
        await response.write(rest)
    await end_of_stream(request, response, family, accumulator)


class Keeper(Protocol):
    """A stateful turn's hooks into the relay (SPEC 7): the final answer is persisted
    before its terminal bytes reach the client, so the client's next request finds it."""

    def rewrite(self, response: dict[str, Any]) -> dict[str, Any]:
        """A provider Response / chat.completion object as the proxy returns it."""
        ...

    async def keep(self, result: dict[str, Any]) -> None:
        """Persist the final (rewritten) answer; called at most once."""
        ...


async def relay_kept(
    request: web.Request,
    upstream: UpstreamResponse,
    *,
    family: Family,
    extra_headers: Mapping[str, str],
    keeper: Keeper,
) -> web.StreamResponse:
    """relay_response for a stateful turn: response objects are rewritten by the keeper,
    and the answer is kept before the client sees its end. Streams are relayed event by
    event as they arrive."""
    headers = relay_headers(upstream, extra_headers)
    if is_event_stream(upstream):
        return await _relay_kept_stream(request, upstream, family, headers, keeper)
    body = await read_body(upstream)
    if upstream.status < 400:
        payload = provider_answer(family, body)
        _log_usage(request, family, payload)
        payload = keeper.rewrite(payload)
        await keeper.keep(payload)
        body = json.dumps(payload, ensure_ascii=False).encode()
    return web.Response(status=upstream.status, body=body, headers=headers)


async def _relay_kept_stream(
    request: web.Request,
    upstream: UpstreamResponse,
    family: Family,
    headers: CIMultiDict[str],
    keeper: Keeper,
) -> web.StreamResponse:
    response = stream_response(request, status=upstream.status, headers=headers)
    await response.prepare(request)
    decoder = SSEDecoder()
    accumulator = _accumulator(family)
    assert accumulator is not None
    kept = False
    try:
        async for chunk in upstream.aiter_bytes():
            for event in decoder.feed(chunk):
                kept = await _relay_kept_event(response, family, accumulator, keeper, event, kept)
        for event in decoder.flush():
            kept = await _relay_kept_event(response, family, accumulator, keeper, event, kept)
        await end_of_stream(request, response, family, accumulator)
    except (ConnectionError, ApiError):
        raise
    except BadAnswer as exc:
        await bad_stream(request, response, family, exc)
    except Exception as exc:  # the provider cut the stream, or keeping the answer failed
        await response.write(stream_failure(request, family, exc))
    finally:
        await upstream.aclose()
    _log_usage(request, family, _accumulated(accumulator))
    await response.write_eof()
    return response


async def _relay_kept_event(
    response: web.StreamResponse,
    family: Family,
    accumulator: ChatStreamAccumulator | ResponsesStreamAccumulator,
    keeper: Keeper,
    event: SSEEvent,
    kept: bool,
) -> bool:
    """Relays one event, keeping the answer first when this event ends it; whether the
    answer is kept now."""
    final = _final_answer(accumulator, event)
    if final is not None and not kept:
        await keeper.keep(keeper.rewrite(final))
        kept = True
    await response.write(_rewritten_event(family, event.event, event.data, keeper))
    return kept


async def end_of_stream(
    request: web.Request,
    response: web.StreamResponse,
    family: Family,
    accumulator: ChatStreamAccumulator | ResponsesStreamAccumulator,
) -> None:
    """At the provider's EOF: an error event when the stream stopped before its answer
    said its last word (a chat `[DONE]`, a Responses terminal or error event)."""
    if accumulator.ended:
        return
    request[LOG_FIELDS]["stream_error"] = "cut_off"
    message = "The provider's stream ended before its answer was complete"
    await response.write(stream_error_event(family, tagged(request, message)))


async def bad_stream(
    request: web.Request, response: web.StreamResponse, family: Family | None, exc: BadAnswer
) -> None:
    """A malformed event: the client gets an error event naming it and the stream ends."""
    log.warning("upstream_bad_answer", problem=exc.problem)
    request[LOG_FIELDS]["stream_error"] = BAD_ANSWER
    await response.write(stream_error_event(family, tagged(request, str(exc)), code=BAD_ANSWER))


def _final_answer(
    accumulator: ChatStreamAccumulator | ResponsesStreamAccumulator, event: SSEEvent
) -> dict[str, Any] | None:
    """Feeds one event; the whole answer once this event ends it (a chat stream's [DONE]
    after a finish_reason, a Responses terminal event)."""
    accumulator.feed_event(event)
    if isinstance(accumulator, ChatStreamAccumulator):
        return accumulator.result() if accumulator.finished and event.data == "[DONE]" else None
    return accumulator.result() if accumulator.terminal else None


def _rewritten_event(family: Family, event: str | None, data: str, keeper: Keeper) -> bytes:
    """The event as the client gets it: Responses snapshots carry the proxy's own ids."""
    if family == "responses" and data.startswith("{"):
        payload = _json_or_none(data.encode())
        if isinstance(payload, dict) and isinstance(payload.get("response"), dict):
            payload["response"] = keeper.rewrite(payload["response"])
            data = json.dumps(payload, ensure_ascii=False)
    return encode_event(data, event=event)


def stream_failure(request: web.Request, family: Family | None, exc: Exception) -> bytes:
    """The error event that ends a stream the proxy could not finish. The exception goes
    to the log only; the client gets the proxy's own words, the request id, and a code
    telling an upstream failure (`upstream_stream_error`) from a store failure
    (`store_error`) and anything else (`internal_error`)."""
    request[LOG_FIELDS]["stream_error"] = repr(exc)
    if isinstance(exc, UpstreamUnavailable):
        log.warning("upstream_stream_broken", error=exc.message)
        message = exc.reason
        code = "upstream_stream_error"
    elif isinstance(exc, STORE_FAILURES):
        log.error("store_failed_mid_stream", error=repr(exc))
        message = "The proxy could not save this answer, so it was not kept"
        code = "store_error"
    else:
        log.exception("stream_failed", error=repr(exc))
        message = "The proxy failed while relaying this stream"
        code = "internal_error"
    return stream_error_event(family, tagged(request, message), code)


def tagged(request: web.Request, message: str) -> str:
    """An error event's message with the request id, so a report can be found in the log."""
    return f"{message.rstrip('.')} (request id {request.get(REQUEST_ID, '-')})."


def stream_error_event(
    family: Family | None, message: str, code: str = "upstream_stream_error"
) -> bytes:
    """An error event in the shape each API's clients parse; the only place one is built."""
    error = error_body(message, "server_error", None, code)["error"]
    if family == "responses":
        # The spec's flat fields, plus the nested object the SDKs read.
        payload: dict[str, Any] = {
            "type": "error",
            "code": error["code"],
            "message": error["message"],
            "param": error["param"],
            "error": error,
        }
        return encode_event(json.dumps(payload), event="error")
    return encode_event(json.dumps({"error": error}))


def _accumulator(
    family: Family | None,
) -> ChatStreamAccumulator | ResponsesStreamAccumulator | None:
    if family == "chat":
        return ChatStreamAccumulator()
    if family == "responses":
        return ResponsesStreamAccumulator()
    return None


def _accumulated(accumulator: ChatStreamAccumulator | ResponsesStreamAccumulator) -> Any:
    if isinstance(accumulator, ChatStreamAccumulator):
        return accumulator.result()
    return {"usage": accumulator.usage()}


def _json_or_none(body: bytes) -> Any:
    try:
        return json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None


def _log_usage(request: web.Request, family: Family, payload: Any) -> None:
    if not isinstance(payload, dict):
        return
    usage = payload.get("usage")
    if not isinstance(usage, dict):
        return
    key = "prompt_tokens" if family == "chat" else "input_tokens"
    if isinstance(usage.get(key), int):
        request[LOG_FIELDS]["usage_input_tokens"] = usage[key]
