"""Background mode (`background: true`), served by the proxy for any provider.

    POST /v1/responses {background: true}   the turn runs in a task this process owns; the
                                            client gets the stored Response `in_progress`
                                            at once (with `stream: true`, its events)
    GET  /v1/responses/{id}                 polls it, on any replica (the store's row)
    GET  /v1/responses/{id}?stream=true&starting_after=N
                                            replays the stored events after N, then follows
                                            the live ones to the end (`follow`)
    POST /v1/responses/{id}/cancel          `cancelled`, the provider request aborted

The task runs the one turn pipeline (turn.run_turn) with the request's plan; only where
its answer goes differs: a stream's events go to `StoredEvents` (relay.EVENT_SINK), which
numbers them (`sequence_number`) and keeps them in the store, instead of a connection
The turn is started in the handler's presence: whatever it refuses before the provider
is called (bad input, an unknown previous_response_id) is the handler's 4xx, and nothing
is stored. From then on the client may leave.

Who wins, with several replicas on one database: the store's row. A cancel is the
conditional UPDATE `in_progress -> cancelled` (Store.cancel_response) and a completion
is conditional on the row not being cancelled, so exactly one of them takes effect. The
replica that runs the response learns of a cancel made elsewhere by polling the rows of
its runs every `background_poll_seconds`; followers on other replicas poll the events as
often. A response whose turn ends without an answer ends `failed` with the error, written
once the store takes it (retried until then, or until shutdown: the recovery sweep then
ends it `incomplete`, proxy/server/recovery.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import Any, Protocol

import structlog
from aiohttp import web

from proxy.clock import Clock, utc_iso
from proxy.core import events as ev
from proxy.core import fastjson
from proxy.periodic import every, running
from proxy.policy import BackgroundPolicy
from proxy.server.api import ApiShape
from proxy.server.errors import ApiError, invalid
from proxy.server.explain import DEFERRED, record_request
from proxy.server.relay import EVENT_SINK, STORE_FAILURES
from proxy.server.state import (
    CLOCK,
    LOG_FIELDS,
    NAMESPACE,
    REQUEST_ID,
    SETTINGS,
    STORE,
    TENANT_POLICY,
)
from proxy.server.turn import Observer, Plan, Turn, run_turn
from proxy.server.validate import JsonDict
from proxy.sse import SSEDecoder, SSEEvent, encode_event
from proxy.store.base import (
    BackgroundStore,
    Cancelled,
    ResponseEvent,
    ResponseStore,
    StoredResponse,
)

log = structlog.get_logger("threadkeeper.background")

EVENTS_BATCH = 200  # events one read of a follower takes at most
# After its row ended, a follower waits this many polls for the stream's last event
# (the row is completed before the terminal event is kept), then ends without it.
GRACE_POLLS = 3
SETTLE_BACKOFF = (0.05, 2.0)
# Keys of the background turn's log line that are its own, not the request's fields.
OWN_LOG_KEYS = frozenset(
    {"request_id", "response_id", "status", "duration_ms", "background_status"}
)  # first and longest wait between tries of a store that is down


class TooManyEvents(ConnectionError):
    """The stream outgrew the policy's background.max_events (a ConnectionError: the
    relay ends the turn without writing to the sink again)."""


@dataclass
class Run:
    """One background response this process runs."""

    tenant: str
    id: str
    stream: bool
    task: asyncio.Task[None] | None = None
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    last_error: JsonDict | None = None  # the last `error` event the stream kept
    last_event: str | None = None  # the type of the last event kept
    kept: int = 0  # events kept
    begun: bool = False  # its row exists (before that, nothing can cancel it)

    def notify(self) -> None:
        """Wakes the followers waiting on this run (each takes `changed` before reading)."""
        self.changed.set()
        self.changed = asyncio.Event()


class Begun(Observer):
    """The turn reached the provider: its response row exists, the handler may answer."""

    def __init__(self) -> None:
        self.future: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def forwarding(self, turn: Turn) -> None:
        if not self.future.done():
            self.future.set_result(None)


class StoredEvents:
    """Where a background turn's stream goes instead of a connection (relay.EVENT_SINK):
    each event gets the next `sequence_number` and is kept in the store before the relay
    reads on (the store's pace bounds the memory a stream holds)."""

    def __init__(self, runs: BackgroundRuns, run: Run, max_events: int) -> None:
        self.runs, self.run, self.max_events = runs, run, max_events
        self.decoder = SSEDecoder()

    async def frames(self, data: bytes) -> None:
        await self.keep(self.decoder.feed(data))

    async def keep(self, events: Sequence[SSEEvent]) -> None:
        run = self.run
        numbered = [
            self.numbered(event, run.kept + index)
            for index, event in enumerate(e for e in events if e.data != "[DONE]")
        ]
        if not numbered:
            return
        if run.kept + len(numbered) > self.max_events:
            raise TooManyEvents(f"the stream outgrew background.max_events ({self.max_events})")
        store, now = self.runs.store, self.runs.clock.iso()
        await store.response_events_append(run.tenant, run.id, numbered, now)
        run.kept += len(numbered)
        run.notify()

    def numbered(self, event: SSEEvent, seq: int) -> ResponseEvent:
        """The event as kept: its JSON with this stream's `sequence_number` (the
        provider's own numbering, if any, restarts with a ledger continuation)."""
        try:
            payload = json.loads(event.data)
        except ValueError:
            return ResponseEvent(seq, event.event, event.data)
        if not isinstance(payload, dict):
            return ResponseEvent(seq, event.event, event.data)
        payload["sequence_number"] = seq
        kind = payload.get("type")
        self.run.last_event = kind if isinstance(kind, str) else event.event
        if self.run.last_event == "error":
            self.run.last_error = payload
        return ResponseEvent(seq, event.event, fastjson.dumps(payload).decode())


class RunStore(ResponseStore, BackgroundStore, Protocol):
    """What background runs read and write: the response rows and their events."""


class BackgroundRuns:
    """The background responses this process runs (the app's RUNS)."""

    def __init__(self, store: RunStore, clock: Clock, poll_seconds: float) -> None:
        self.store, self.clock, self.poll_seconds = store, clock, poll_seconds
        self.runs: dict[tuple[str, str], Run] = {}
        self.closing = False

    def changed(self, tenant: str, response_id: str) -> asyncio.Event | None:
        run = self.runs.get((tenant, response_id))
        return run.changed if run is not None else None

    async def start(
        self,
        request: web.Request,
        api: ApiShape,
        body: JsonDict,
        raw: bytes,
        plan: Plan,
        response_id: str,
    ) -> Run:
        """Runs the turn in a task of this process; returns once the provider is called.
        What the turn refuses before that is raised here (the client's 4xx, a 429 past
        background.max_running)."""
        tenant = request[NAMESPACE]
        limits: BackgroundPolicy = request[TENANT_POLICY].background
        # background.max_running is checked where the row is inserted, as one unit
        # (Store.begin_response): the turn's refusal is the 429 raised below.
        run = Run(tenant, response_id, stream=bool(body.get("stream")))
        if run.stream:
            request[EVENT_SINK] = StoredEvents(self, run, limits.max_events)
        begun = Begun()
        plan = replace(plan, observers=[*plan.observers, begun])
        task = asyncio.create_task(self._run(run, request, api, body, raw, plan, begun))
        run.task = task
        self.runs[(tenant, response_id)] = run
        try:
            await asyncio.wait({begun.future, task}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            if not begun.future.done():  # the client left before anything was stored
                task.cancel()
            raise
        if not begun.future.done():
            await task  # raises what the turn refused
            raise ApiError(500, "The background response ended before it began.")
        run.begun = True
        request[DEFERRED] = True  # its record is the turn's, written when it ends (_run)
        return run

    async def _run(
        self,
        run: Run,
        request: web.Request,
        api: ApiShape,
        body: JsonDict,
        raw: bytes,
        plan: Plan,
        begun: Begun,
    ) -> None:
        error: JsonDict | None = None
        started = time.perf_counter()
        http_status = 500  # what the turn answered (the record's `status`)
        try:
            answer = await run_turn(request, api, body, raw, plan)
            http_status = answer.status
            error = answer_error(answer, run)
        except asyncio.CancelledError:
            if self.closing or not begun.future.done():
                raise  # shutdown: its owner's retire ends it incomplete
            # cancelled (POST .../cancel): the row says so already
        except Cancelled:
            pass  # the late answer lost to a cancel: nothing was kept
        except ApiError as exc:
            if not begun.future.done():
                raise
            error = response_error(exc.status, exc.message)
        except TooManyEvents as exc:
            error = {"code": "server_error", "message": f"The response was stopped: {exc}."}
        except Exception as exc:
            if not begun.future.done():
                raise
            log.exception("background_response_failed", response_id=run.id)
            error = {"code": "server_error", "message": failure_message(exc)}
        finally:
            self.runs.pop((run.tenant, run.id), None)
            run.notify()
        if begun.future.done():
            await self.settle(run, error)
            await self.logged(run, request, http_status, started)

    async def logged(
        self, run: Run, request: web.Request, http_status: int, started: float
    ) -> None:
        """The background turn's own log line and explain record (the create's request
        logged only its start): the response id, its final status, how long it ran."""
        duration_ms = round((time.perf_counter() - started) * 1000, 3)
        status = None
        with contextlib.suppress(*STORE_FAILURES):
            stored = await self.store.get_response(run.tenant, run.id)
            status = stored.status if stored is not None else None
        fields = request[LOG_FIELDS]
        fields["background_status"] = status
        log.info(
            "background_response",
            request_id=request[REQUEST_ID],
            response_id=run.id,
            status=status,
            duration_ms=duration_ms,
            **{k: v for k, v in fields.items() if k not in OWN_LOG_KEYS},
        )
        record_request(request, http_status, duration_ms, final=True)

    async def settle(self, run: Run, error: JsonDict | None) -> None:
        """A run whose row is still `in_progress` ends `failed` with `error` (a stream's
        last error event, or a generic one), tried until the store takes it."""
        wait, longest = SETTLE_BACKOFF
        while not self.closing:
            try:
                await self._settle(run, error)
                return
            except STORE_FAILURES as exc:
                log.warning("background_settle_retried", response_id=run.id, error=repr(exc))
            await asyncio.sleep(wait)
            wait = min(wait * 2, longest)

    async def _settle(self, run: Run, error: JsonDict | None) -> None:
        stored = await self.store.get_response(run.tenant, run.id)
        if stored is None or stored.status != "in_progress":
            return
        if error is None:
            error = stream_error(run.last_error) or {
                "code": "server_error",
                "message": "The provider's answer ended before it was complete.",
            }
        failed = {**response_object(stored), "status": "failed", "error": error}
        if run.stream and run.last_event not in ev.TERMINAL_EVENTS:
            event = {"type": ev.FAILED, "sequence_number": run.kept, "response": failed}
            kept = ResponseEvent(run.kept, ev.FAILED, fastjson.dumps(event).decode())
            await self.store.response_events_append(run.tenant, run.id, [kept], self.clock.iso())
            run.kept += 1
            run.last_event = ev.FAILED
        await self.store.finish_response(run.tenant, run.id, status="failed", response=failed)
        run.notify()

    def cancel_here(self, tenant: str, response_id: str) -> None:
        """Stops the task of a response this process runs (its row is cancelled)."""
        run = self.runs.get((tenant, response_id))
        if run is not None and run.task is not None:
            run.task.cancel()

    async def watch_cancels(self) -> None:
        """One poll: runs whose row was cancelled on another replica are stopped."""
        for (tenant, response_id), run in list(self.runs.items()):
            if not run.begun:
                continue
            stored = await self.store.get_response(tenant, response_id)
            if stored is None or stored.status == "cancelled":
                self.cancel_here(tenant, response_id)

    async def aclose(self) -> None:
        """At shutdown: the runs are stopped (their rows end incomplete when this owner
        retires) and awaited, so none outlives the store."""
        self.closing = True
        tasks = [run.task for run in self.runs.values() if run.task is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(BaseException):
                await task


RUNS = web.AppKey("background_runs", BackgroundRuns)


def answer_error(answer: web.StreamResponse, run: Run) -> JsonDict | None:
    """The error of a turn that relayed the provider's refusal whole (non-streamed)."""
    if answer.status < 400 or not isinstance(answer, web.Response):
        return None
    try:
        body = json.loads(answer.body or b"{}")  # type: ignore[arg-type]
        message = str(body["error"]["message"])
    except (ValueError, KeyError, TypeError):
        message = f"The provider answered HTTP {answer.status}."
    return response_error(answer.status, message)


def response_error(status: int, message: str) -> JsonDict:
    """A Response's `error` (the spec's ResponseError: a ResponseErrorCode and a message)."""
    if status == 429:
        code = "rate_limit_exceeded"
    elif 400 <= status < 500:
        code = "invalid_prompt"
    else:
        code = "server_error"
    return {"code": code, "message": message}


def stream_error(event: JsonDict | None) -> JsonDict | None:
    if event is None:
        return None
    message = event.get("message") or (event.get("error") or {}).get("message")
    return {"code": "server_error", "message": str(message)} if message else None


def failure_message(exc: BaseException) -> str:
    if isinstance(exc, STORE_FAILURES):
        return "The proxy could not save this response while it ran."
    return "The proxy failed while running this response."


def response_object(stored: StoredResponse) -> JsonDict:
    # Imported here: response_routes serves this module's cancel and resume.
    from proxy.server.response_routes import response_object as described

    return described(stored)


# -- following a stream (create with stream: true, and GET ...?stream=true) -------------


async def follow(
    request: web.Request, tenant: str, response_id: str, after: int
) -> web.StreamResponse:
    """The response's events after `after` as an event stream: the stored ones, then the
    live ones as they are kept, to the end. The client leaving ends only this."""
    runs, store = request.app[RUNS], request.app[RUNS].store
    response = web.StreamResponse(
        headers={"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache"}
    )
    await response.prepare(request)
    quiet = 0
    while True:
        changed = runs.changed(tenant, response_id)
        events = await store.response_events(tenant, response_id, after=after, limit=EVENTS_BATCH)
        for event in events:
            await response.write(encode_event(event.data, event=event.event))
            after = event.seq
        if events and last_type(events[-1]) in ev.TERMINAL_EVENTS:
            break
        if len(events) == EVENTS_BATCH:
            continue
        if not events:
            stored = await store.get_response(tenant, response_id)
            if stored is None or stored.status == "cancelled":
                break
            if stored.status != "in_progress":
                quiet += 1
                if quiet > GRACE_POLLS:
                    break
        await wait_for_change(changed, runs.poll_seconds)
    await response.write_eof()
    return response


def last_type(event: ResponseEvent) -> str | None:
    if event.event is not None:
        return event.event
    with contextlib.suppress(ValueError, AttributeError):
        kind = json.loads(event.data).get("type")
        return kind if isinstance(kind, str) else None
    return None


async def wait_for_change(changed: asyncio.Event | None, poll_seconds: float) -> None:
    """Until the run here keeps more, or one poll interval (a run on another replica)."""
    if changed is None:
        await asyncio.sleep(poll_seconds)
        return
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(poll_seconds):
            await changed.wait()


def starting_after(request: web.Request) -> int:
    """The `starting_after` query parameter: an integer (absent: -1, from the start)."""
    value = request.query.get("starting_after")
    if value is None:
        return -1
    try:
        number = int(value)
    except ValueError:
        raise invalid(
            f"Invalid 'starting_after': expected an integer, but got '{value}' instead.",
            param="starting_after",
            code="invalid_type",
        ) from None
    if number < -1:
        raise invalid(
            f"Invalid 'starting_after': {number} is below -1.",
            param="starting_after",
            code="invalid_value",
        )
    return number


async def resume(request: web.Request, stored: StoredResponse) -> web.StreamResponse:
    """GET /v1/responses/{id}?stream=true: the stream of a background response, resumed."""
    after = starting_after(request)
    store: RunStore = request.app[STORE]
    if not (stored.background and stored.request.get("stream")):
        raise invalid(
            "This response was not created with background=true and stream=true, so it "
            "has no stream to resume.",
            param="stream",
        )
    last = await store.response_events_last(stored.tenant, stored.id)
    last = -1 if last is None else last
    if after > last and stored.status != "in_progress":
        raise invalid(
            f"Invalid 'starting_after': {after} is beyond the last event of this response "
            f"({last}).",
            param="starting_after",
            code="invalid_value",
        )
    return await follow(request, stored.tenant, stored.id, after)


async def cancel(request: web.Request, stored: StoredResponse) -> StoredResponse:
    """POST /v1/responses/{id}/cancel: the row becomes `cancelled` (the store decides a
    race with the completion), then the task running it stops, here or on its replica."""
    if not stored.background:
        raise invalid("Only responses created with background=true can be cancelled.")
    store: RunStore = request.app[STORE]
    if stored.status == "in_progress" and await store.cancel_response(stored.tenant, stored.id):
        request.app[RUNS].cancel_here(stored.tenant, stored.id)
    now = await store.get_response(stored.tenant, stored.id)
    if now is None:
        raise ApiError(404, f"Response with id '{stored.id}' not found.")
    if now.status != "cancelled":  # cancelling twice is not an error (OpenAI's guide)
        raise invalid(f"Cannot cancel a response with status '{now.status}'.")
    return now


def runs_ctx() -> Any:
    """cleanup_ctx: the app's RUNS, its cancel watch, the events' retention purge; the
    runs are stopped before the store closes (registered after the store's context)."""

    async def ctx(app: web.Application) -> AsyncIterator[None]:
        settings, clock = app[SETTINGS], app[CLOCK]
        runs = BackgroundRuns(app[STORE], clock, settings.background_poll_seconds)
        app[RUNS] = runs
        retention = settings.background_event_retention_seconds

        async def purge() -> None:
            before = utc_iso(clock.now() - timedelta(seconds=retention))
            if purged := await runs.store.response_events_purge(before):
                log.info("background_events_purged", count=purged)

        async with running(
            every(
                "background_cancels", settings.background_poll_seconds, runs.watch_cancels, clock
            ),
            every("background_events_purge", 600.0, purge, clock, first_now=True),
        ):
            yield
            await runs.aclose()

    return ctx
