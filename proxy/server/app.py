"""The application: `create_app(settings)` builds everything; nothing lives at module level.

One middleware, `request_middleware`, runs every request's steps in order as plain
calls (one frame, not one wrapper per step): request context (id, one log line,
metrics) around OpenAI's error envelope around tenant auth -> path and query checks ->
body read deadline -> Idempotency-Key (replay or record) -> the handler; a whole answer
is written to the client before its log line, metrics and explain record (`sent`). Resources
(upstream pool, policy watcher, idempotency purge, owner heartbeat) open and close in
cleanup_ctx.

Slow clients are bounded by `client_header_timeout`: aiohttp's keep-alive timer (started
when a connection opens, >= 3.14.4, and after each response) closes a connection whose
next request's headers have not fully arrived in time, and `read_body_in_time` answers
408 to a buffered body that does not.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import signal
import time
from collections.abc import AsyncIterator, Callable, Mapping
from datetime import timedelta
from typing import TYPE_CHECKING

import structlog
from aiohttp import web

from proxy.clock import SYSTEM_CLOCK, Clock
from proxy.ids import new_id
from proxy.metrics import Metrics
from proxy.periodic import every, run_step, running
from proxy.policy import PolicyRegistry
from proxy.server import (
    background,
    chat,
    compaction,
    conversations,
    erase,
    explain,
    inspector,
    ledger_routes,
    ops,
    passthrough,
    response_routes,
    responses,
    summaries,
    websocket,
)
from proxy.server.auth import authorize
from proxy.server.errors import Handler, error_for
from proxy.server.idempotency import idempotent, mark_not_replayed, purge_ctx
from proxy.server.model_budget import LearnedLimits, ProviderCounts
from proxy.server.recovery import keep_alive
from proxy.server.startup import serving_fields
from proxy.server.state import (
    CHAT_CAP_FIELDS,
    CLOCK,
    ENV,
    LEARNED,
    LOG_FIELDS,
    METRICS,
    OWNER,
    POLICIES,
    PROVIDER_COUNTS,
    REQUEST_ID,
    SETTINGS,
    STORE,
    SUMMARIES,
    THREADS,
    TRACING,
    UPSTREAM,
    UPSTREAM_APIS,
    WINDOWS,
)
from proxy.server.validate import check_url_keys
from proxy.settings import Settings
from proxy.store.base import Store
from proxy.summarizer import LlmSummarizer
from proxy.threads import ThreadService, WindowCache
from proxy.tracing import Tracing, set_attributes
from proxy.upstream import Upstream

if TYPE_CHECKING:
    from opentelemetry.trace import Span

log = structlog.get_logger("threadkeeper.request")


def route_name(request: web.Request) -> str:
    """A low-cardinality label for metrics: the route's name, not the raw path."""
    resource = request.match_info.route.resource
    name = resource.name if resource is not None else None
    return name or "unmatched"


@web.middleware
async def request_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every request's steps (the module docstring's order), under its trace span."""
    return await in_context(request, handler, checked=True)


async def in_context(
    request: web.Request, handler: Handler, *, checked: bool
) -> web.StreamResponse:
    """`handler` in the request's context: its id, its log line and metrics, OpenAI's
    error envelope and the tenant's auth; `checked` adds the HTTP request's own steps
    (path and query keys, the body deadline, Idempotency-Key). A WebSocket message runs
    without them (proxy/server/websocket.py)."""
    tracing = request.app[TRACING]
    if not tracing.on:
        return await _in_context(request, handler, None, checked)
    resource = request.match_info.route.resource
    route = resource.canonical if resource is not None else request.path
    attributes = {"http.request.method": request.method, "http.route": route}
    name = f"{request.method} {route}"
    with tracing.span(name, attributes, kind="server", parent_headers=request.headers) as span:
        return await _in_context(request, handler, span, checked)


async def _in_context(
    request: web.Request, handler: Handler, span: Span | None, checked: bool
) -> web.StreamResponse:
    request_id = "req_" + secrets.token_hex(12)
    request[REQUEST_ID] = request_id
    request[LOG_FIELDS] = {}
    started = time.perf_counter()
    status = 500
    try:
        response = await _answered(request, handler, checked)
        status = response.status
        if not response.prepared:
            response.headers["x-threadkeeper-request-id"] = request_id
            if checked:
                response, status = await sent(request, response)
        return response
    except asyncio.CancelledError:
        status = 499  # the client went away
        raise
    finally:
        fields = request[LOG_FIELDS]
        if span is not None:
            attributes = {
                "http.response.status_code": status,
                "threadkeeper.request_id": request_id,
                "threadkeeper.tenant": fields.get("tenant"),
            }
            set_attributes(span, attributes)
        route = route_name(request)
        tenant = fields.get("tenant", "-")
        latency_ms = round((time.perf_counter() - started) * 1000, 3)
        metrics = request.app[METRICS]
        metrics.child(metrics.requests, route, str(status), tenant).inc()
        if route not in ("healthz", "readyz", "metrics"):
            log.info(
                "request",
                request_id=request_id,
                method=request.method,
                route=route,
                path=request.path,
                status=status,
                latency_ms=latency_ms,
                pid=os.getpid(),  # which worker process served it (serve --workers N)
                **fields,
            )
        explain.record_request(request, status, latency_ms)


async def _answered(request: web.Request, handler: Handler, checked: bool) -> web.StreamResponse:
    """The steps inside the error envelope: whatever one raises becomes OpenAI's error
    (errors.error_for); a 408 for a slow body also closes the connection."""
    try:
        authorize(request)
        if not checked:
            return await handler(request)
        check_url_keys(request)
        await read_body_in_time(request)
        return await idempotent(request, handler)
    except Exception as exc:
        response = error_for(request, exc)
        if response is None:
            raise
        if isinstance(exc, passthrough.ClientTooSlow):
            response.force_close()
        return response


async def sent(
    request: web.Request, response: web.StreamResponse
) -> tuple[web.StreamResponse, int]:
    """A whole answer written to the client now, before the request's metrics, log line
    and explain record, which the client need not wait for (aiohttp then finds it sent).
    It leaves complete: its headers are set before (the request id) or during the write
    (`on_response_prepare`), nothing after. Returns what was sent and the status to log:
    499 for a client gone during the write; an answer that could not be written at all
    (nothing sent yet) is replaced by OpenAI's 500."""
    try:
        await _write(request, response)
    except ConnectionError:
        return response, 499
    except Exception as exc:
        fallback = error_for(request, exc)
        if fallback is None or request.writer.output_size > 0:
            raise
        try:
            await _write(request, fallback)
        except ConnectionError:
            return fallback, 499
        return fallback, fallback.status
    return response, response.status


async def _write(request: web.Request, response: web.StreamResponse) -> None:
    await response.prepare(request)
    await response.write_eof()


async def read_body_in_time(request: web.Request) -> None:
    """A body the proxy buffers (every one but a streamed passthrough upload, whose chunks
    passthrough.py bounds) is read here within client_header_timeout; aiohttp keeps it
    for the handler's own read. A client too slow gets a 408 and the connection closes
    (after at most client_header_timeout more of reading and dropping the rest)."""
    if request.body_exists and not passthrough.streams_upload(request):
        if request.content.is_eof():  # it came with the headers: no wait to bound
            await request.read()
            return
        timeout = request.app[SETTINGS].client_header_timeout
        try:
            async with asyncio.timeout(timeout):
                await request.read()
        except TimeoutError:
            raise passthrough.ClientTooSlow(timeout) from None


def create_app(
    settings: Settings,
    *,
    policies: PolicyRegistry | None = None,
    upstream: Upstream | None = None,
    store: Store | None = None,
    env: Mapping[str, str] | None = None,
    clock: Clock | None = None,
    tracing: Tracing | None = None,
) -> web.Application:
    """`clock` defaults to the system clock; tests pass a ManualClock to move time.
    `tracing` defaults to what the OTEL_* variables of `env` configure (off without)."""
    app = web.Application(
        middlewares=[request_middleware],
        client_max_size=settings.max_body_bytes,
    )
    app[SETTINGS] = settings
    app[POLICIES] = policies if policies is not None else PolicyRegistry.load(settings.policies_dir)
    app[METRICS] = Metrics()
    app[LEARNED] = LearnedLimits()
    app[PROVIDER_COUNTS] = ProviderCounts()
    app[UPSTREAM_APIS] = {}
    app[CHAT_CAP_FIELDS] = {}
    app[ENV] = dict(env if env is not None else os.environ)
    app[OWNER] = new_id("proc")
    app[WINDOWS] = WindowCache(settings.thread_cache_bytes)
    app[CLOCK] = clock if clock is not None else SYSTEM_CLOCK
    app[TRACING] = tracing if tracing is not None else Tracing.from_env(app[ENV])
    app.on_cleanup.append(_flush_traces)

    app.cleanup_ctx.append(_store_ctx(store))
    app.cleanup_ctx.append(_summaries_ctx)  # after the store: cancelled before it closes
    app.cleanup_ctx.append(_learned_ctx)  # after the store: written before it closes
    app.cleanup_ctx.append(_upstream_ctx(upstream))
    # Background runs stop before the upstream and the store close (cleanup runs backwards).
    app.cleanup_ctx.append(background.runs_ctx())
    app.cleanup_ctx.append(purge_ctx())
    app.cleanup_ctx.append(response_routes.purge_ctx())
    app.cleanup_ctx.append(explain.explain_ctx())
    app.on_response_prepare.append(mark_not_replayed)
    app.cleanup_ctx.append(_policy_watch_ctx)

    app.router.add_get("/healthz", ops.healthz, name="healthz")
    app.router.add_get("/readyz", ops.readyz, name="readyz")
    app.router.add_get("/metrics", ops.metrics, name="metrics")
    app.router.add_post("/v1/chat/completions", chat.chat_completions, name="chat.completions")
    app.router.add_post("/v1/responses", responses.create_response, name="responses")
    websocket.add_routes(app)
    app.router.add_post(
        "/v1/responses/input_tokens", responses.input_tokens, name="responses.input_tokens"
    )
    compaction.add_routes(app)
    response_routes.add_routes(app)
    conversations.add_routes(app)
    erase.add_routes(app)
    ledger_routes.add_routes(app)
    explain.add_routes(app)
    inspector.add_routes(app)
    app.router.add_route("*", "/v1/{tail:.*}", passthrough.passthrough, name="passthrough")
    return app


def _store_ctx(given: Store | None):  # type: ignore[no-untyped-def]
    async def ctx(app: web.Application) -> AsyncIterator[None]:
        from proxy.store import open_store

        settings = app[SETTINGS]
        store = given or await open_store(
            settings.store_url,
            connect_timeout=settings.store_connect_timeout,
            command_timeout=settings.store_command_timeout,
        )
        await store.migrate()
        app[STORE] = store
        app[THREADS] = ThreadService(
            store, app[CLOCK].iso, cache=app[WINDOWS], tracing=app[TRACING]
        )
        # Responses of dead processes become incomplete; live replicas' do not (SPEC 7, 8).
        async with keep_alive(store, app[OWNER], app[CLOCK]):
            yield
        if given is None:
            await store.close()

    return ctx


async def _summaries_ctx(app: web.Application) -> AsyncIterator[None]:
    """Background LLM summaries (proxy/server/summaries.py): cancelled and awaited at
    shutdown, so none outlives the store it writes to; their retention purge."""
    metrics, clock = app[METRICS], app[CLOCK]
    summarizer = LlmSummarizer(metrics, tracing=app[TRACING])
    background = summaries.BackgroundSummaries(app[STORE], summarizer, metrics, clock)
    app[SUMMARIES] = background
    retention = timedelta(seconds=app[SETTINGS].summary_retention_seconds)

    async def purge() -> None:
        if purged := await background.purge(retention):
            summaries.log.info("summaries_purged", count=purged)

    interval = summaries.PURGE_INTERVAL_SECONDS
    async with running(every("summaries_purge", interval, purge, clock, first_now=True)):
        yield
    await run_step("summaries_touch", background.touch)  # what was served since the last step
    await background.aclose()


def _upstream_ctx(given: Upstream | None):  # type: ignore[no-untyped-def]
    async def ctx(app: web.Application) -> AsyncIterator[None]:
        settings = app[SETTINGS]
        upstream = given or Upstream.create(
            connect_timeout=settings.upstream_connect_timeout,
            read_timeout=settings.upstream_read_timeout,
            pool_size=settings.upstream_pool_size,
            max_body_bytes=settings.max_provider_body_bytes,
        )
        upstream.tracing = app[TRACING]
        app[UPSTREAM] = upstream
        app[METRICS].upstream_connections_in_use.set_function(upstream.connections_in_use)
        yield
        await upstream.aclose()

    return ctx


async def _learned_ctx(app: web.Application) -> AsyncIterator[None]:
    """What was learnt and not yet written (proxy/server/model_budget.py) goes to the store at
    shutdown, so a restart starts from it."""
    yield
    await app[LEARNED].flush(app.get(STORE), app[CLOCK].iso())


async def _flush_traces(app: web.Application) -> None:
    await asyncio.to_thread(app[TRACING].shutdown)


async def _policy_watch_ctx(app: web.Application) -> AsyncIterator[None]:
    interval = app[SETTINGS].policy_reload_interval
    if interval <= 0:
        yield
        return
    async with running(app[POLICIES].watch(interval, app[CLOCK])):
        yield


async def start(settings: Settings, app: web.Application | None = None) -> web.AppRunner:
    """Start serving; the caller owns the runner (tests, `demo`, `serve`). With several
    workers each process binds the port with SO_REUSEPORT and the kernel spreads new
    connections among them."""
    app = app or create_app(settings)
    runner = web.AppRunner(
        app,
        handler_cancellation=True,
        access_log=None,
        keepalive_timeout=settings.client_header_timeout,
        # After an answer sent before its body was read (a 408, a 401), what is left of
        # the body is read and dropped for at most this long, then the connection closes.
        lingering_time=min(10.0, settings.client_header_timeout),
    )
    await runner.setup()
    site = web.TCPSite(
        runner, settings.host, settings.port, reuse_address=True, reuse_port=settings.workers > 1
    )
    await site.start()
    return runner


def bound_port(runner: web.AppRunner) -> int:
    for site in runner.sites:
        server = site._server  # aiohttp keeps the asyncio server here
        sockets = getattr(server, "sockets", None)
        if sockets:
            return int(sockets[0].getsockname()[1])
    raise RuntimeError("the server is not listening")


def run(settings: Settings) -> None:
    """Serve in this process until SIGTERM or SIGINT, then shut down cleanly (in-flight
    requests finish or are cut, own in_progress responses end `incomplete`)."""

    async def main() -> None:
        # The handlers come first: a signal while the app starts stops it once started,
        # cleanly. A worker holds the signals pending until here (proxy/server/workers.py).
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError):  # no signal handlers on Windows
                loop.add_signal_handler(signum, stop.set)
        if hasattr(signal, "pthread_sigmask"):
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM, signal.SIGINT})
        runner = await start(settings)
        port = bound_port(runner)
        log.info("listening", host=settings.host, port=port, pid=os.getpid())
        if settings.workers == 1:  # with several, the supervisor says it (workers.py)
            log.info("serving", **serving_fields(settings, runner.app[POLICIES], port))
        try:
            await stop.wait()
        finally:
            await runner.cleanup()

    try:
        with asyncio.Runner(loop_factory=event_loop_factory()) as runner:
            runner.run(main())
    except KeyboardInterrupt:
        pass


def event_loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's loop when it is installed (a dependency but on Windows), else asyncio's default."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop  # type: ignore[no-any-return]
