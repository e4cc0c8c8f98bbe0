"""The `Idempotency-Key` request header (SPEC section 1): a retried POST gets the first answer.

Semantics of the IETF draft "The Idempotency-Key HTTP Header Field" with Stripe's choices
where the draft leaves room; the pure rules are in proxy/core/idempotency.py, this module
is the edge that reads the request, talks to the store and records the response.

- **Scope.** Any POST under `/v1/` (or `/threadkeeper/v1/`) that carries the header, per
  tenant: the same key from two tenants names two unrelated requests. The key is opaque
  printable ASCII of at most 255 characters (else 400, code `invalid_idempotency_key`).
- **Same request.** The fingerprint is sha256 of method, path with query, and body (a
  JSON body canonically, so key order and whitespace do not count).
- **First request** inserts a `running` record, runs, then stores the status, the headers
  and the body. For a stream the body is the exact bytes the client received (the SSE
  events, proxy ids included), so a replay is byte-identical, and the record is stored
  before the stream's end reaches the client (a retry sent at once is replayed, never
  answered 409). The response carries `Idempotent-Replayed: false`.
- **Retry, same body, done:** the stored status, headers and body, with
  `Idempotent-Replayed: true`; the provider is not called. A stream replays as one
  `text/event-stream` body.
- **Same key, other body (or other path):** 422, code `idempotency_key_reused`.
- **Same key while the first still runs:** 409, code `idempotency_key_in_progress`, with
  `Retry-After: 1`.
- **Stored:** 2xx and 4xx answers, the provider's 4xx included (an answer about the
  request itself, Stripe does the same). **Not stored** (the record is dropped and a
  retry runs again): 5xx, 408, 425 and 429 (transient, `should_store`), a stream that
  is not a finished answer (Chat: every choice has its finish_reason, then `[DONE]`;
  Responses: `response.completed` or `.incomplete`; judged on the bytes the client got by
  proxy/sse.py's accumulators, so an EOF cut or an error event is never kept), a request the proxy itself refused
  before any work (validation, auth, conflicts: Stripe does not save a request that
  "never began execution", and SPEC section 1 says bad input changes nothing in the
  store), an unexpected exception, and a client that went away mid-request.
- **Not replayed headers:** hop-by-hop ones, `Date`, `Server`, and the proxy's own
  per-request `x-threadkeeper-request-id` (a replay gets a fresh one). The provider's
  headers (its `x-request-id` too) describe the stored answer and are replayed.
- **Thread.** A record names the thread its request ran on, and erasing that thread
  (`threadkeeper threads delete --erase`) deletes it; deleting a conversation does not.
- **Retention** is the tenant policy's `idempotency.retention_seconds` (default 24 h),
  counted from the first request. An expired record is ignored and replaced in place when
  its key comes back; a background task deletes the rest every 60 s.
- **Limits.** A passthrough upload that the proxy streams (no Content-Length, or over
  1 MiB) cannot be fingerprinted without buffering it: such a request with the header is
  a 400 rather than a silent lack of idempotency. A record left `running` by a process
  that died (kill -9 mid-request) names its owner (the app's OWNER), so the recovery
  sweep (proxy/server/recovery.py) deletes it once that owner is dead: at once when it
  died on this host, else after the owner has been silent for STALE_AFTER (30 s). Until
  then the key answers 409; afterwards a retry runs again (the provider may have been
  called once already). A process that only stalls past STALE_AFTER is taken for dead
  too, so its key could run twice: the same trade-off as its responses.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence

import structlog
from aiohttp import web
from multidict import CIMultiDict

from proxy.clock import Clock
from proxy.core.idempotency import (
    Verdict,
    expires_at,
    fingerprint,
    should_store,
    validate_key,
    verdict,
)
from proxy.periodic import every, running
from proxy.server.api import for_route
from proxy.server.errors import ApiError, Handler
from proxy.server.relay import HOP_BY_HOP, STREAM_TAP, end_tapped_stream
from proxy.server.state import (
    CLOCK,
    LOG_FIELDS,
    NAMESPACE,
    OWNER,
    STORE,
    TENANT_POLICY,
    request_value,
)
from proxy.store.base import IdempotencyRecord, IdempotencyStore

log = structlog.get_logger("threadkeeper.idempotency")

HEADER = "Idempotency-Key"
REPLAYED = "Idempotent-Replayed"
PURGE_INTERVAL_SECONDS = 60.0
# passthrough.py streams request bodies above this size (or of unknown size) upstream.
MAX_BUFFERED_PASSTHROUGH_BODY = 1024 * 1024
KEYED_PREFIXES = ("/v1/", "/threadkeeper/v1/")
NOT_REPLAYED = HOP_BY_HOP | {"date", "server", "x-threadkeeper-request-id", REPLAYED.lower()}

ReplayableAnswer = tuple[int, list[tuple[str, str]], bytes]


async def idempotent(request: web.Request, handler: Handler) -> web.StreamResponse:
    """The Idempotency-Key step (app.request_middleware), after auth (it needs the
    tenant); a request without the header goes straight to `handler`."""
    key = request.headers.get(HEADER)
    if key is None or request.method != "POST" or not request.path.startswith(KEYED_PREFIXES):
        return await handler(request)
    record = await new_record(request, key)
    store: IdempotencyStore = request.app[STORE]
    existing = await store.idempotency_begin(record)
    found = None if existing is None else (existing.fingerprint, existing.status)
    match verdict(found, record.fingerprint):
        case Verdict.RUN:
            return await run_and_record(request, handler, record)
        case Verdict.REPLAY:
            assert existing is not None
            request[LOG_FIELDS]["idempotency"] = "replayed"
            return replayed_response(existing)
        case Verdict.CONFLICT_BODY:
            raise key_reused(key)
        case Verdict.IN_PROGRESS:
            raise key_in_progress(key)


async def new_record(request: web.Request, key: str) -> IdempotencyRecord:
    """The `running` record this request would insert; 400 when the key is unusable."""
    if len(request.headers.getall(HEADER)) > 1:
        raise invalid_key("Idempotency-Key must be sent once")
    if problem := validate_key(key):
        raise invalid_key(problem)
    if _streams_body(request):
        raise invalid_key(
            "Idempotency-Key needs a request body with a Content-Length of at most "
            f"{MAX_BUFFERED_PASSTHROUGH_BODY} bytes on this endpoint"
        )
    body = await request.read()
    policy = request[TENANT_POLICY]
    now = request.app[CLOCK].iso()
    return IdempotencyRecord(
        tenant=request[NAMESPACE],
        key=key,
        fingerprint=fingerprint(request.method, request.path_qs, body),
        status="running",
        response_status=None,
        created_at=now,
        expires_at=expires_at(now, policy.idempotency.retention_seconds),
        owner=request.app[OWNER],
    )


def _streams_body(request: web.Request) -> bool:
    if not request.body_exists or request.match_info.route.name != "passthrough":
        return False
    length = request.content_length
    return length is None or length > MAX_BUFFERED_PASSTHROUGH_BODY


async def run_and_record(
    request: web.Request, handler: Handler, record: IdempotencyRecord
) -> web.StreamResponse:
    """Run the handler; store its answer when it may be replayed, else drop the record."""
    store: IdempotencyStore = request.app[STORE]
    tap: list[bytes] = []
    request[STREAM_TAP] = tap
    try:
        response = await handler(request)
    except BaseException:  # refused, failed, or cancelled by a client that went away
        request[LOG_FIELDS]["idempotency"] = "aborted"
        await _shielded(store.idempotency_abort(record.tenant, record.key))
        raise
    stored = replayable_answer(request, response, tap)
    request[LOG_FIELDS]["idempotency"] = "stored" if stored else "aborted"
    if stored is None:
        await _shielded(store.idempotency_abort(record.tenant, record.key))
    else:
        status, headers, body = stored
        finish = store.idempotency_finish(
            record.tenant,
            record.key,
            status=status,
            headers=headers,
            body=body,
            thread_id=thread_of(request),
        )
        await _shielded(finish)
    await end_tapped_stream(response)  # only now may the client see the end of a stream
    return response


def thread_of(request: web.Request) -> str | None:
    """The thread the request ran on (a conversation, a chat thread, a response chain),
    as the handler logged it: erasing that thread deletes the record too."""
    fields = request[LOG_FIELDS]
    thread_id = fields.get("thread_id") or fields.get("conversation_id")
    return thread_id if isinstance(thread_id, str) else None


def replayable_answer(
    request: web.Request, response: web.StreamResponse, tap: Sequence[bytes]
) -> ReplayableAnswer | None:
    """(status, headers, body) to keep for replay, or None when it must not be kept."""
    if not should_store(response.status) or "stream_error" in request[LOG_FIELDS]:
        return None
    if isinstance(response, web.Response):
        body = response.body
        if body is not None and not isinstance(body, bytes | bytearray):
            return None  # a payload object (file, stream) cannot be kept as bytes
        content = bytes(body or b"")
    elif response.prepared and tap:
        content = b"".join(tap)
        if not _finished_stream(request, content):
            return None
    else:
        return None  # a stream written past the relay's tap: we do not have its bytes
    headers = [(k, v) for k, v in response.headers.items() if k.lower() not in NOT_REPLAYED]
    return response.status, headers, content


def _finished_stream(request: web.Request, content: bytes) -> bool:
    api = for_route(request.match_info.route.name)  # a model answer must be finished
    return api is None or api.stream_finished(content)


def replayed_response(record: IdempotencyRecord) -> web.Response:
    headers: CIMultiDict[str] = CIMultiDict(record.response_headers)
    headers[REPLAYED] = "true"
    return web.Response(
        status=record.response_status or 200, body=record.response_body or b"", headers=headers
    )


async def mark_not_replayed(request: web.Request, response: web.StreamResponse) -> None:
    """on_response_prepare: a response that ran under a key says so, streams included."""
    if request_value(request, STREAM_TAP) is not None and REPLAYED not in response.headers:
        response.headers[REPLAYED] = "false"


async def _shielded(write: Awaitable[None]) -> None:
    """A store write that a client's disconnect must not cut in half; failures are logged
    (the record then expires on its own)."""
    try:
        await asyncio.shield(write)
    except asyncio.CancelledError:
        raise
    except Exception:
        log.exception("idempotency_record_write_failed")


def invalid_key(problem: str) -> ApiError:
    return ApiError(400, problem + ".", code="invalid_idempotency_key")


def key_reused(key: str) -> ApiError:
    return ApiError(
        422,
        f"Idempotency-Key '{key}' was already used with a different request body.",
        code="idempotency_key_reused",
    )


def key_in_progress(key: str) -> ApiError:
    return ApiError(
        409,
        f"A request with Idempotency-Key '{key}' is still being processed; "
        "retry after it completes.",
        code="idempotency_key_in_progress",
        headers={"Retry-After": "1"},
    )


async def purge_expired(store: IdempotencyStore, clock: Clock) -> int:
    """Delete the records expired by `clock`'s now; how many went."""
    return await store.idempotency_purge(clock.iso())


def purge_ctx(
    interval: float = PURGE_INTERVAL_SECONDS,
) -> Callable[[web.Application], AsyncIterator[None]]:
    """cleanup_ctx: purge expired records at start and then every `interval` seconds."""

    async def ctx(app: web.Application) -> AsyncIterator[None]:
        store, clock = app[STORE], app[CLOCK]

        async def purge() -> None:
            if purged := await purge_expired(store, clock):
                log.info("idempotency_records_purged", count=purged)

        async with running(every("idempotency_purge", interval, purge, clock, first_now=True)):
            yield

    return ctx
