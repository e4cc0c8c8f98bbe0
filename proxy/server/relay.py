"""Forwarding to the provider, in the API it serves (`send_model`: a Chat-only provider
gets a Responses turn translated, proxy/server/chat_upstream.py), and relaying its answer
back, streamed or not, through the turn's transformer (defined here too).

Streams are relayed as they arrive (never buffered to the end) by one loop,
`relay_stream`: each event the provider's answer carries is decoded and parsed once
here, checked, and handed with its dict to the turn's transformer (`Passthrough`, the
bytes untouched; `Keep`, a stored turn, kept before its end reaches the client; the
ledger's holdback, proxy/server/holdback.py, an `EventTransformer`). One answer
is framed before it gets here: a turn that compacted (proxy/server/compacted.py,
`WithCompaction`) decodes the provider's events to put the compaction item first, and
the relay decodes what that re-encodes. Every
answer passes its API's shape check first (proxy/core/answers.py): a malformed one is a
502, or in a stream an error event that ends it. A client that goes
away cancels the handler (handler_cancellation) and with it the upstream request.
Passthrough bodies are relayed as they arrive too, so nothing but a model answer is
buffered (and that only up to max_provider_body_bytes, proxy/upstream.py). A stream the
proxy cannot finish ends with one error event (`stream_failure`). A model endpoint's
error body reaches the client in OpenAI's envelope (`in_envelope`); a passthrough
endpoint's, byte for byte.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import AsyncIterable, Callable, Mapping, Sequence
from typing import Any, Protocol

import asyncpg
import structlog
from aiohttp import web
from multidict import CIMultiDict

from proxy.clock import utc_now
from proxy.core import fastjson
from proxy.core.answers import BadAnswer
from proxy.core.provider_errors import read_provider_error
from proxy.logs import register_secret
from proxy.policy import Policy, PolicyError
from proxy.server.api import CHAT, RESPONSES, ApiShape
from proxy.server.chat_upstream import CHAT_PATH, Upstream, send_chat, translated
from proxy.server.errors import ApiError
from proxy.server.explain import PROVIDER_ERROR, provider_error
from proxy.server.state import (
    ENV,
    LOG_FIELDS,
    METRICS,
    REQUEST_ID,
    SETTINGS,
    STORE,
    UPSTREAM,
    UPSTREAM_APIS,
    request_value,
)
from proxy.server.validate import JsonDict
from proxy.sse import SSEDecoder, SSEEvent, encode_event, event_payload
from proxy.store.base import Cancelled, StoreError, UpstreamApiStore
from proxy.upstream import (
    Deadline,
    ProviderAnswerTooLarge,
    RetrySettings,
    UpstreamRequest,
    UpstreamResponse,
    UpstreamUnavailable,
)

log = structlog.get_logger("threadkeeper.relay")

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


class EventSink(Protocol):
    """Where a stream's SSE frames go instead of an HTTP body (WebSocket mode,
    proxy/server/websocket.py): each write is whole events, as a StreamResponse gets them."""

    async def frames(self, data: bytes) -> None: ...


# When set, a relay's stream is written to this sink rather than to the HTTP response.
EVENT_SINK: web.RequestKey[EventSink] = web.RequestKey("event_sink", EventSink)
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
    sink = request_value(request, EVENT_SINK)
    if sink is not None:
        return _SinkStream(sink, status=status, headers=headers)
    tap = request_value(request, STREAM_TAP)
    if tap is None:
        return web.StreamResponse(status=status, headers=headers)
    return _TappedStream(tap, status=status, headers=headers)


class _TappedStream(web.StreamResponse):
    """Its end (the chunked terminator) is held back until `end_tapped_stream`: the
    middleware stores the idempotency record first, so a client that saw the whole
    stream and retries at once gets the replay, never a 409."""

    def __init__(self, tap: list[bytes], *, status: int, headers: CIMultiDict[str]) -> None:
        super().__init__(status=status, headers=headers)
        self._tap = tap
        self._end_held = True

    async def write(self, data: bytes | bytearray | memoryview) -> None:
        await super().write(data)
        self._tap.append(bytes(data))

    async def write_eof(self, data: bytes = b"") -> None:
        if data:
            await self.write(data)
        if not self._end_held:
            await super().write_eof()

    async def end(self) -> None:
        self._end_held = False
        if self.prepared:
            await self.write_eof()


async def end_tapped_stream(response: web.StreamResponse) -> None:
    """Send the end a tapped stream held back (see _TappedStream); others have ended."""
    if isinstance(response, _TappedStream):
        await response.end()


class _SinkStream(web.StreamResponse):
    """A stream whose frames go to an EventSink: nothing is written to the HTTP
    connection (it carries a WebSocket)."""

    def __init__(self, sink: EventSink, *, status: int, headers: CIMultiDict[str]) -> None:
        super().__init__(status=status, headers=headers)
        self._sink = sink

    async def prepare(self, request: web.BaseRequest) -> None:
        return None

    async def write(self, data: bytes | bytearray | memoryview) -> None:
        await self._sink.frames(bytes(data))

    async def write_eof(self, data: bytes = b"") -> None:
        if data:
            await self._sink.frames(data)


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
    deadline = request_value(request, DEADLINE)
    if deadline is None:
        deadline = request[DEADLINE] = Deadline.after(policy.upstream.deadline_seconds)
    return deadline


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
    metrics.child(metrics.upstream_latency, route).observe(elapsed)
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


# -- the API a model turn is sent in (issue 25; the translation: chat_upstream.py) -------
# `send_model` is the one place a model turn goes upstream (run_turn and the ledger's
# continuations call it). For a Responses turn it reads the tenant's `upstream.api`:
# `responses`, the request goes to /responses as it is; `chat`, it is translated and sent
# to /chat/completions (proxy/server/chat_upstream.py); `auto` (default), /responses
# until the provider answers it 404 or 405, then the turn is sent again translated, and
# when Chat answers it (anything but 404/405 again: an unknown model is a 404 on both)
# `chat` is recorded in the store for this tenant's upstream URL, and read from there
# (once per process) for every later turn.

NOT_SERVED = frozenset({404, 405})  # what a Chat-only server answers on /v1/responses


def upstream_of(request: web.Request, policy: Policy) -> Upstream:
    return (policy.tenant, upstream_base(request, policy))


class Untranslatable(Exception):
    """A turn found Chat-only only after its /responses call (`auto`) that Chat cannot
    carry: `error` is the client's 400, `upstream` the refused call (the turn's hooks see
    it as a refusal, so nothing of the turn stays in the store)."""

    def __init__(self, error: ApiError, upstream: UpstreamResponse) -> None:
        super().__init__(error.message)
        self.error = error
        self.upstream = upstream


async def upstream_api(request: web.Request, policy: Policy) -> str:
    """`responses`, `chat`, or `auto` (nothing learnt yet) for this tenant's upstream."""
    if policy.upstream.api != "auto":
        return policy.upstream.api
    key = upstream_of(request, policy)
    known = request.app[UPSTREAM_APIS]
    if key not in known:
        store: UpstreamApiStore = request.app[STORE]
        known[key] = await store.upstream_api_get(*key)
    return known[key] or "auto"


async def learn_chat(request: web.Request, policy: Policy) -> None:
    key = upstream_of(request, policy)
    store: UpstreamApiStore = request.app[STORE]
    learnt = await store.upstream_api_set(*key, "chat", utc_now())
    request.app[UPSTREAM_APIS][key] = learnt


async def check_translatable(request: web.Request, policy: Policy, body: JsonDict) -> None:
    """Before anything is stored or forwarded: a turn for a Chat-only upstream that Chat
    cannot carry (a hosted tool, say) is refused with a 400 naming the param."""
    if await upstream_api(request, policy) == "chat":
        translated(request, upstream_of(request, policy), body)


async def send_model(
    request: web.Request,
    policy: Policy,
    api: ApiShape,
    sent: JsonDict,
    raw: bytes,
    *,
    stream: bool,
) -> UpstreamResponse:
    """The model turn `sent` (its bytes `raw`) to the provider, in the API it serves."""
    chosen = await upstream_api(request, policy) if api is RESPONSES else "responses"
    if chosen == "chat":
        chat = translated(request, upstream_of(request, policy), sent)
        return await _send_chat(request, policy, sent, chat, stream)
    upstream = await send_upstream(
        request, policy, path=api.path, body=raw, stream=stream, route=api.route
    )
    if chosen == "responses" or upstream.status not in NOT_SERVED:
        return upstream
    if await _names_the_model(upstream, sent):
        return upstream
    try:
        chat = translated(request, upstream_of(request, policy), sent)
    except ApiError as exc:
        raise Untranslatable(exc, upstream) from None
    answer = await _send_chat(request, policy, sent, chat, stream)
    if answer.status in NOT_SERVED:  # not the endpoint: the model, say; nothing learnt
        await answer.aclose()
        request[LOG_FIELDS].pop("upstream_api", None)
        return upstream
    await upstream.aclose()
    await learn_chat(request, policy)
    return answer


async def _names_the_model(upstream: UpstreamResponse, sent: JsonDict) -> bool:
    """Whether a 404/405 is about the model, not the endpoint: OpenAI's `model_not_found`,
    or a body that names the requested model (Ollama's `model "x" not found`). A server
    without /responses answers its framework's not-found, which names no model."""
    try:
        body = await upstream.aread()
    except ProviderAnswerTooLarge:
        return False
    model = sent.get("model")
    named = isinstance(model, str) and len(model) >= 2 and model.encode() in body
    return named or b'"model_not_found"' in body


async def _send_chat(
    request: web.Request, policy: Policy, sent: JsonDict, chat: JsonDict, stream: bool
) -> UpstreamResponse:
    async def post(body: bytes) -> UpstreamResponse:
        return await send_upstream(
            request, policy, path=CHAT_PATH, body=body, stream=stream, route=RESPONSES.route
        )

    return await send_chat(request, upstream_of(request, policy), sent, chat, post)


# -- the answer back: checked, then through the turn's transformer -----------------------


def is_event_stream(upstream: UpstreamResponse) -> bool:
    return upstream.is_event_stream


async def read_body(upstream: UpstreamResponse) -> bytes:
    """The provider's whole (non-stream) body; a connection lost while reading it is
    OpenAI's server_error, not a 500."""
    try:
        return await upstream.aread()
    except UpstreamUnavailable as exc:
        raise upstream_error(exc) from None
    except BadAnswer as exc:  # a translated Chat answer (chat_upstream.TranslatedResponse)
        raise bad_answer(exc) from None


def upstream_error(exc: UpstreamUnavailable) -> ApiError:
    return ApiError(exc.status, exc.message, type="server_error", code=exc.code)


BAD_ANSWER = "bad_upstream_answer"
ERROR_LOG_BYTES = 4096  # of a provider's error body, on the log line that rewrote it


def provider_answer(api: ApiShape, body: bytes) -> dict[str, Any]:
    """A successful non-streamed answer, parsed and checked (proxy/core/answers.py): the
    one gate before any flow reads or keeps it. A malformed one is a 502."""
    try:
        answer = fastjson.loads(body)  # the stdlib's values (fastjson.py)
    except (ValueError, RecursionError):
        raise bad_answer(BadAnswer("it is not JSON")) from None
    try:
        return api.check_answer(answer)
    except BadAnswer as exc:
        raise bad_answer(exc) from None


def bad_answer(exc: BadAnswer) -> ApiError:
    return ApiError(502, str(exc), type="server_error", code=BAD_ANSWER)


# -- the transformers: what a model answer becomes on its way to the client --------------
# The relay loop (`relay_stream`) decodes each event once and hands it with its parsed
# data to the turn's `Transformer`: `Passthrough` (the bytes untouched), `Keep` (a stored
# turn, kept through its `Keeper` before its end reaches the client) or the ledger's
# holdback (proxy/server/holdback.py, an `EventTransformer`). A non-streamed answer goes
# through `Transformer.answer` whole.


class Transformer(Protocol):
    """What one stream becomes on its way to the client. The relay loop decodes each
    event once, feeds it (checked) to `upstream`, then hands it with its parsed data to
    `event`; `passed` gets each raw chunk after its events; `end` runs at the provider's
    EOF (after the decoder's flush). Each returns the bytes the client gets next. A
    transformer takes a non-streamed answer whole (`answer`)."""

    @property
    def upstream(self) -> Any:
        """The accumulator of what the provider streamed (ApiShape.accumulator)."""
        ...

    async def event(self, event: SSEEvent, payload: JsonDict | None) -> list[bytes]: ...

    def passed(self, chunk: bytes) -> bytes: ...

    async def end(self) -> list[bytes]: ...

    async def answer(self, answer: JsonDict) -> JsonDict:
        """A whole (non-streamed) answer as the client gets it; the same object when
        it is relayed as the provider sent it."""
        ...


class EventTransformer:
    """A transformer that writes events it builds itself (raw chunks are not passed)."""

    def __init__(self, api: ApiShape) -> None:
        self.api = api
        self.upstream = api.accumulator()

    async def event(self, event: SSEEvent, payload: JsonDict | None) -> list[bytes]:
        raise NotImplementedError

    def passed(self, chunk: bytes) -> bytes:
        return b""

    async def end(self) -> list[bytes]:
        return []

    async def answer(self, answer: JsonDict) -> JsonDict:
        return answer


class Passthrough:
    """The provider's bytes untouched, whole events at a time: a malformed event is never
    sent, and an error event after it is a clean event of its own. Without an API shape
    (a passthrough endpoint) the bytes go as they come, not decoded."""

    def __init__(self, api: ApiShape | None) -> None:
        self.upstream = api.accumulator() if api is not None else None

    async def event(self, event: SSEEvent, payload: JsonDict | None) -> list[bytes]:
        return []

    def passed(self, chunk: bytes) -> bytes:
        return chunk  # an event stream's chunks are whole events (UpstreamResponse)

    async def end(self) -> list[bytes]:
        return []

    async def answer(self, answer: JsonDict) -> JsonDict:
        return answer


class Keeper(Protocol):
    """A stateful turn's hooks into the relay (SPEC 7): the final answer is persisted
    before its terminal bytes reach the client, so the client's next request finds it."""

    def rewrite(self, response: dict[str, Any]) -> dict[str, Any]:
        """A provider Response / chat.completion object as the proxy returns it."""
        ...

    async def keep(
        self, result: dict[str, Any], log: Sequence[dict[str, Any]] | None = None
    ) -> None:
        """Persist the final (rewritten) answer; called at most once. `log` replaces the
        answer's output as the thread's items when the ledger continued the turn."""
        ...


class Keep(EventTransformer):
    """A stateful turn's stream: response objects rewritten by the keeper, and the answer
    kept before the event that ends it reaches the client."""

    def __init__(self, api: ApiShape, keeper: Keeper) -> None:
        super().__init__(api)
        self.keeper = keeper
        self.kept = False

    async def event(self, event: SSEEvent, payload: JsonDict | None) -> list[bytes]:
        final = self.api.final_answer(self.upstream, event)
        if final is not None and not self.kept:
            await self.keeper.keep(self.keeper.rewrite(final))
            self.kept = True
        data = event.data
        if payload is not None:
            rewritten = self.api.rewritten_payload(payload, self.keeper.rewrite)
            if rewritten is not None:
                data = fastjson.dumps(rewritten).decode()
        return [encode_event(data, event=event.event)]

    async def answer(self, answer: JsonDict) -> JsonDict:
        final = self.keeper.rewrite(answer)
        await self.keeper.keep(final)
        return final


# Where a relayed model answer (or a stream's usage holder) is reported (turn hooks).
OnAnswer = Callable[[JsonDict], None]


async def relay_answer(
    request: web.Request,
    upstream: UpstreamResponse,
    api: ApiShape | None,
    transformer: Transformer,
    *,
    extra_headers: Mapping[str, str],
    on_answer: OnAnswer | None = None,
) -> web.StreamResponse:
    """The provider's answer through `transformer`: a stream event by event as it
    arrives, a whole answer checked and handed to `transformer.answer` (a provider error
    as it is). `api` None: a passthrough endpoint, whose body is not a model answer.
    The provider's connection is released however this ends (a client gone before the
    headers were written included)."""
    try:
        return await _relay_answer(request, upstream, api, transformer, extra_headers, on_answer)
    finally:
        await upstream.aclose()


async def _relay_answer(
    request: web.Request,
    upstream: UpstreamResponse,
    api: ApiShape | None,
    transformer: Transformer,
    extra_headers: Mapping[str, str],
    on_answer: OnAnswer | None,
) -> web.StreamResponse:
    headers = relay_headers(upstream, extra_headers)
    if is_event_stream(upstream):
        return await relay_stream(request, upstream, api, transformer, headers, on_answer)
    if api is None and not upstream.closed:
        return await _relay_body(request, upstream, headers)
    body = await read_body(upstream)
    if api is not None and upstream.status >= 400:
        request[PROVIDER_ERROR] = provider_error(upstream.status, body)
        body = in_envelope(upstream, body, headers)
    if api is not None and upstream.status < 400:
        answer = provider_answer(api, body)
        if on_answer is not None:
            on_answer(answer)
        final = await transformer.answer(answer)
        if final is not answer:
            body = fastjson.dumps(final)
    return web.Response(status=upstream.status, body=body, headers=headers)


def in_envelope(upstream: UpstreamResponse, body: bytes, headers: CIMultiDict[str]) -> bytes:
    """A model endpoint's error as OpenAI's envelope (SPEC round 3): vLLM's flat body,
    `{"error": "<text>"}`, plain text or a gateway's HTML become `{"error": {message, type,
    param, code}}` with the provider's status and message and a mapped code; an envelope
    is relayed as it came, unless it is a context-length refusal without OpenAI's code.
    The raw body goes to the log (already scrubbed of the tenant's key, and of key-shaped
    strings by the log's own filter)."""
    content_type = upstream.provider_headers.get("content-type", "")
    error = read_provider_error(upstream.status, content_type, body)
    if not error.rewrite:
        return body
    log.warning(
        "provider_error_enveloped",
        status=upstream.status,
        content_type=content_type,
        body=body[:ERROR_LOG_BYTES].decode("utf-8", "replace"),
    )
    headers["Content-Type"] = "application/json"
    return fastjson.dumps(error.envelope)


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


# -- the stream relay: one loop, pluggable transformers (above) -------------------------


async def relay_stream(
    request: web.Request,
    upstream: UpstreamResponse,
    api: ApiShape | None,
    transformer: Transformer,
    headers: CIMultiDict[str],
    on_answer: OnAnswer | None = None,
) -> web.StreamResponse:
    """The one stream relay loop: events as they arrive through `transformer`; a stream
    the proxy cannot finish ends with one error event (`stream_failure`)."""
    response = stream_response(request, status=upstream.status, headers=headers)
    await response.prepare(request)
    try:
        await _pump(request, response, upstream, api, transformer)
    except (ConnectionError, ApiError):
        raise
    except BadAnswer as exc:  # the provider's event is not what its API streams
        await bad_stream(request, response, api, exc)
    except Exception as exc:  # the provider cut the stream, or the store or ledger failed
        await response.write(stream_failure(request, api, exc))
    finally:
        await upstream.aclose()
    if api is not None and on_answer is not None:
        on_answer(api.usage_holder(transformer.upstream))
    await response.write_eof()
    return response


async def _pump(
    request: web.Request,
    response: web.StreamResponse,
    upstream: UpstreamResponse,
    api: ApiShape | None,
    transformer: Transformer,
) -> None:
    """Decodes each event once and always flushes the decoder at the provider's EOF (a
    stream may end right after `data: [DONE]\\n`, SSEDecoder's docstring)."""
    decoder = SSEDecoder() if api is not None else None
    async for chunk in upstream.aiter_bytes():
        if decoder is not None:
            await _events(response, api, transformer, decoder.feed(chunk))
        if passed := transformer.passed(chunk):
            await response.write(passed)
    if decoder is not None:
        await _events(response, api, transformer, decoder.flush())
    for frame in await transformer.end():
        await response.write(frame)
    if api is not None:
        await end_of_stream(request, response, api, transformer.upstream)


async def _events(
    response: web.StreamResponse,
    api: ApiShape | None,
    transformer: Transformer,
    events: Sequence[SSEEvent],
) -> None:
    assert api is not None
    for event in events:
        for frame in await transformed(api, transformer, event):
            await response.write(frame)


async def transformed(api: ApiShape, transformer: Transformer, event: SSEEvent) -> list[bytes]:
    """One decoded event through the transformer: its data parsed once, checked and fed
    to the transformer's accumulator first (BadAnswer when it is not what `api` streams)."""
    payload = event_payload(event)
    api.feed(transformer.upstream, event, payload)
    return await transformer.event(event, payload)


async def end_of_stream(
    request: web.Request, response: web.StreamResponse, api: ApiShape, accumulator: Any
) -> None:
    """At the provider's EOF: an error event when the stream stopped before its answer
    said its last word (a chat `[DONE]`, a Responses terminal or error event)."""
    if accumulator.ended:
        return
    request[LOG_FIELDS]["stream_error"] = "cut_off"
    message = "The provider's stream ended before its answer was complete"
    await response.write(stream_error_event(api, tagged(request, message)))


async def bad_stream(
    request: web.Request, response: web.StreamResponse, api: ApiShape | None, exc: BadAnswer
) -> None:
    """A malformed event: the client gets an error event naming it and the stream ends."""
    log.warning("upstream_bad_answer", problem=exc.problem)
    request[LOG_FIELDS]["stream_error"] = BAD_ANSWER
    await response.write(stream_error_event(api, tagged(request, str(exc)), code=BAD_ANSWER))


def stream_failure(request: web.Request, api: ApiShape | None, exc: Exception) -> bytes:
    """The error event that ends a stream the proxy could not finish. The exception goes
    to the log only; the client gets the proxy's own words, the request id, and a code
    telling an upstream failure (`upstream_stream_error`) from a store failure
    (`store_error`) and anything else (`internal_error`)."""
    request[LOG_FIELDS]["stream_error"] = repr(exc)
    if isinstance(exc, Cancelled):
        message = "This response was cancelled, so its answer was not kept"
        code = "response_cancelled"
    elif isinstance(exc, UpstreamUnavailable):
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
    return stream_error_event(api, tagged(request, message), code)


def tagged(request: web.Request, message: str) -> str:
    """An error event's message with the request id, so a report can be found in the log."""
    return f"{message.rstrip('.')} (request id {request.get(REQUEST_ID, '-')})."


def stream_error_event(
    api: ApiShape | None, message: str, code: str = "upstream_stream_error"
) -> bytes:
    """An error event in the shape each API's clients parse (Chat's for a passthrough)."""
    return (api or CHAT).error_event(message, code)
