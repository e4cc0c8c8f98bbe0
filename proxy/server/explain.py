"""Explain records: what one model request sent to the provider, and why.

The request's log line already gathers the facts (tenant, thread, budget totals, ledger
verdicts, usage, retries, timings). An explain record is that line plus the whole
projection report (every block with its decision and its tokens before and after) and the
texts that stood in for history: summaries and compressed tool results. Verbatim items are
not copied; the record names the thread they live in.

Records are queued and written in batches by one background task (a batch gathers for
BATCH_WAIT_SECONDS after its first record), so no request waits for this write. The
record's JSON text is made once (`record_text`) when the answer was already sent
(app.sent), and the store keeps it as it is; the queue holds that text, not the
request's projection. When the queue is full (a store that is down), records are
dropped and counted in the log. `GET /threadkeeper/v1/requests/{request_id}` serves a
record to the tenant that made the request, from the queue while it is not written yet.
Records older than `explain_retention_seconds` are purged in the background.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from datetime import timedelta

import orjson
import structlog
from aiohttp import web

from proxy.clock import Clock, utc_iso
from proxy.core import fastjson
from proxy.core.compress import COMPRESSED_KEY, output_text
from proxy.core.items import INSTRUCTION_ROLES, Item
from proxy.core.memory import is_summary
from proxy.core.projection import Projection
from proxy.periodic import every, running
from proxy.server.errors import ApiError
from proxy.server.state import (
    CLOCK,
    LOG_FIELDS,
    NAMESPACE,
    REQUEST_ID,
    SETTINGS,
    STORE,
    request_value,
)
from proxy.server.validate import JsonDict
from proxy.store.base import ExplainRecord, ExplainRow, ExplainStore, StoreError

log = structlog.get_logger("threadkeeper.explain")

QUEUE_MAX = 1000  # records waiting for the writer; more are dropped
BATCH_MAX = 250  # records per store transaction
# Before each batch the writer waits this long for more records: one client's requests
# one after the other then share a transaction (on SQLite about 18 us of CPU a record in
# a transaction of 25, 11 in one of 500: bench/RESULTS.md, h-explain). A record
# waiting is served from the queue (`unwritten`) and written at shutdown (`drain`); a
# process killed outright loses the last BATCH_WAIT_SECONDS of them.
BATCH_WAIT_SECONDS = 0.25
PURGE_INTERVAL_SECONDS = 600.0
# Log fields the record carries in a fuller form of its own.
REPLACED_FIELDS = ("budget", "trimmed_blocks")

PROJECTION = web.RequestKey("projection", Projection)  # set by rebuild_turn when observed
# The request's turn outlives its handler (a background response): the runner records it
# when the turn ends (record_request with final=True), not the create's middleware.
DEFERRED = web.RequestKey("explain_deferred", bool)
# The provider's error, when it answered a model request with one (set by the relay).
PROVIDER_ERROR: web.RequestKey[JsonDict] = web.RequestKey("provider_error", dict)
# A provider's error body is read for its record up to this size (a message is cut).
ERROR_BODY_MAX = 64 * 1024
ERROR_MESSAGE_MAX = 4000


@dataclass(frozen=True)
class PendingRecord:
    """A record waiting for its write: its JSON text, made when the answer was sent (the
    request's projection and fields are let go then, not kept for the batch's wait)."""

    tenant: str
    request_id: str
    created_at: str
    thread_id: str | None
    text: str

    def row(self) -> ExplainRow:
        return ExplainRow(self.tenant, self.request_id, self.created_at, self.thread_id, self.text)

    def record(self) -> ExplainRecord:
        record = fastjson.loads(self.text)
        return ExplainRecord(self.tenant, self.request_id, self.created_at, record)


class ExplainRecorder:
    """A bounded queue of records and the one task that writes them."""

    def __init__(
        self, store: ExplainStore, sleep: Callable[[float], Awaitable[None]] = asyncio.sleep
    ) -> None:
        self.store = store
        self._sleep = sleep  # injectable so tests can hold the wait without taking it
        self.dropped = 0
        self._queue: asyncio.Queue[PendingRecord] = asyncio.Queue(QUEUE_MAX)
        self._arrived = asyncio.Event()  # set by `offer`
        self._unwritten: dict[tuple[str, str], PendingRecord] = {}
        self._gone: set[tuple[str, str | None]] = set()  # threads deleted since the last write

    def offer(self, pending: PendingRecord) -> None:
        try:
            self._queue.put_nowait(pending)
        except asyncio.QueueFull:
            self._dropped(1, "queue_full")
            return
        self._unwritten[(pending.tenant, pending.request_id)] = pending
        self._arrived.set()

    def forget_thread(self, tenant: str, thread_id: str) -> None:
        """The thread was deleted (its stored records with it): its queued ones are not
        written."""
        self._gone.add((tenant, thread_id))
        for key, record in list(self._unwritten.items()):
            if (record.tenant, record.thread_id) == (tenant, thread_id):
                del self._unwritten[key]

    def unwritten(self, tenant: str | None, request_id: str) -> ExplainRecord | None:
        """A queued record; with tenant None (operators), the one queued with this id."""
        if tenant is not None:
            pending = self._unwritten.get((tenant, request_id))
            return pending.record() if pending is not None else None
        found = [r for (_, rid), r in list(self._unwritten.items()) if rid == request_id]
        return found[0].record() if len(found) == 1 else None

    async def run(self) -> None:
        """Writes what is queued, a batch at a time; before each batch (the records that
        came during the last write too) the writer waits BATCH_WAIT_SECONDS for more,
        the records in the queue (a writer cancelled meanwhile leaves them to `drain`)."""
        while True:
            if self._queue.empty():
                self._arrived.clear()
                await self._arrived.wait()
            if self._queue.qsize() < BATCH_MAX:  # also after a write the next ones met
                await self._sleep(BATCH_WAIT_SECONDS)
            size = min(BATCH_MAX, self._queue.qsize())
            await self._write([self._queue.get_nowait() for _ in range(size)])

    async def drain(self) -> None:
        """What is still queued, written once more before the process stops."""
        while not self._queue.empty():
            batch = [self._queue.get_nowait() for _ in range(min(BATCH_MAX, self._queue.qsize()))]
            await self._write(batch)

    async def _write(self, batch: list[PendingRecord]) -> None:
        gone, self._gone = self._gone, set()
        batch = [r for r in batch if (r.tenant, r.thread_id) not in gone]
        try:
            if batch:
                await self.store.explain_put([pending.row() for pending in batch])
        except StoreError as exc:
            self._dropped(len(batch), str(exc))
        finally:
            for record in batch:
                self._unwritten.pop((record.tenant, record.request_id), None)

    def _dropped(self, count: int, reason: str) -> None:
        self.dropped += count
        log.warning("explain_records_dropped", count=count, total=self.dropped, reason=reason)


EXPLAIN = web.AppKey("explain", ExplainRecorder)


def explain_ctx() -> Callable[[web.Application], AsyncIterator[None]]:
    """cleanup_ctx: the writer and the retention purge (nothing when `explain` is off)."""

    async def ctx(app: web.Application) -> AsyncIterator[None]:
        settings = app[SETTINGS]
        if not settings.explain:
            yield
            return
        recorder = ExplainRecorder(app[STORE])
        app[EXPLAIN] = recorder
        retention = timedelta(seconds=settings.explain_retention_seconds)
        clock = app[CLOCK]

        async def purge() -> None:
            if purged := await recorder.store.explain_purge(utc_iso(clock.now() - retention)):
                log.info("explain_records_purged", count=purged)

        purging = every("explain_purge", PURGE_INTERVAL_SECONDS, purge, clock, first_now=True)
        async with running(recorder.run(), purging):
            yield
        await recorder.drain()

    return ctx


def provider_error(status: int, body: bytes) -> JsonDict:
    """What a record keeps of a provider's error answer: its status and the four fields
    of OpenAI's envelope; a body that is not one, as its first characters."""
    error: object = None
    if len(body) <= ERROR_BODY_MAX:
        try:
            error = json.loads(body).get("error")
        except (ValueError, RecursionError, AttributeError):
            error = None
    if not isinstance(error, dict):
        text = body[:ERROR_MESSAGE_MAX].decode("utf-8", "replace")
        return {"status": status, "message": text, "type": None, "param": None, "code": None}
    kept = {name: error.get(name) for name in ("message", "type", "param", "code")}
    shown = {k: v if isinstance(v, str | int) or v is None else str(v) for k, v in kept.items()}
    if isinstance(shown["message"], str):
        shown["message"] = shown["message"][:ERROR_MESSAGE_MAX]
    return {"status": status, **shown}


def record_request(
    request: web.Request, status: int, latency_ms: float, *, final: bool = False
) -> None:
    """Queues the record of a model request (one whose context was projected) that
    reached the provider, whatever it answered (its 4xx and 5xx too: `provider_error`),
    or that failed in the proxy (5xx). A 4xx the proxy gave before calling the provider
    leaves none: bad input changes nothing in the store."""
    recorder = request.app.get(EXPLAIN)
    projection = request_value(request, PROJECTION)
    if recorder is None or projection is None or (request_value(request, DEFERRED) and not final):
        return
    fields = request[LOG_FIELDS]
    if 400 <= status < 500 and "upstream_status" not in fields:
        return
    clock: Clock = request.app[CLOCK]
    request_id = request[REQUEST_ID]
    created_at = clock.iso()
    head: JsonDict = {
        "object": "threadkeeper.request",
        "id": request_id,
        "created_at": created_at,
        "method": request.method,
        "path": request.path,
        "status": status,
        "latency_ms": latency_ms,
    }

    facts = head  # the head's own dict: its keys first, the log fields after
    facts.update(fields)
    for name in REPLACED_FIELDS:
        facts.pop(name, None)
    error = request_value(request, PROVIDER_ERROR)
    if error is not None:
        facts["provider_error"] = error
    thread_id = fields.get("thread_id")
    thread = thread_id if isinstance(thread_id, str) else None
    text = record_text(facts, projection)
    recorder.offer(PendingRecord(request[NAMESPACE], request_id, created_at, thread, text))


def record_text(facts: JsonDict, projection: Projection) -> str:
    """The record's JSON text: `facts` (its head and log fields), the projection report
    and the stand-ins. The report's blocks go to orjson as the report's own dataclasses
    (no dict a block, as `ProjectionReport.as_dict` builds, and no second parse of the
    whole text); the facts, where any value may be a float, go through
    fastjson.dumps_text, which keeps a NaN or an integer beyond 64 bits as it is. The two
    objects are joined into one."""
    report = projection.report
    shown = {**facts, "estimated_input_tokens": report.prompt_tokens}
    for name in ("projection", "stand_ins"):  # written by the second part
        shown.pop(name, None)
    tail: JsonDict = {
        "projection": {**report.totals(), "blocks": report.blocks},
        "stand_ins": stand_ins(projection),
    }
    try:
        rest = orjson.dumps(tail).decode()
    except TypeError:  # a lone surrogate in a text, an integer beyond 64 bits
        tail["projection"] = report.as_dict()
        rest = json.dumps(tail, separators=(",", ":"))
    return fastjson.dumps_text(shown)[:-1] + "," + rest[1:]


def stand_ins(projection: Projection) -> list[JsonDict]:
    """The items sent in place of history, in the order they were sent: summaries and
    compressed tool results, with their text."""
    shown: list[JsonDict] = []
    for position, item in enumerate(projection.items):
        # Cheap tests first, on every item of the window: a summary is an instruction.
        if item.role in INSTRUCTION_ROLES and is_summary(item):
            shown.append({"position": position, "kind": "summary", "text": item.text()})
        elif item.output_for is not None and (text := compressed_text(item)) is not None:
            shown.append(
                {
                    "position": position,
                    "kind": "compressed",
                    "call_id": item.output_for,
                    "text": text,
                }
            )
    return shown


def compressed_text(output: Item) -> str | None:
    """The text of a compressed tool result; None for any other output."""
    value = output.raw.get("content" if output.api == "chat" else "output")
    if isinstance(value, str):  # output_text's own answer, without building it
        return value if COMPRESSED_KEY in value else None
    text = output_text(output)
    return text if COMPRESSED_KEY in text else None


async def find_record(
    app: web.Application, tenant: str | None, request_id: str
) -> ExplainRecord | None:
    """The tenant's record (any tenant's for None), from the queue while it is unwritten."""
    recorder = app.get(EXPLAIN)
    found = recorder.unwritten(tenant, request_id) if recorder is not None else None
    if found is not None:
        return found
    store: ExplainStore = app[STORE]
    return await store.explain_get(tenant, request_id)


async def get_record(request: web.Request) -> web.Response:
    """GET /threadkeeper/v1/requests/{request_id}: the tenant's own records only."""
    request_id = request.match_info["request_id"]
    found = await find_record(request.app, request[NAMESPACE], request_id)
    if found is None:
        raise ApiError(
            404,
            f"No explain record found with id '{request_id}'.",
            param="request_id",
            code="request_not_found",
            type="invalid_request_error",
        )
    return web.json_response(found.record)


def add_routes(app: web.Application) -> None:
    app.router.add_get(
        "/threadkeeper/v1/requests/{request_id}", get_record, name="explain.retrieve"
    )
