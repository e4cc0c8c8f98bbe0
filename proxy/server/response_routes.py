"""GET/DELETE /v1/responses/{id} and GET /v1/responses/{id}/input_items, from the store.

Served locally and tenant-scoped: a response of another tenant is a 404 (SPEC 1).

Stored responses are kept `response_retention_seconds` (30 days by default, as OpenAI
keeps them) from their creation, whatever became of their conversation, and then purged
in the background (`purge_ctx`), with the response chains left without a response.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from datetime import datetime, timedelta

import structlog
from aiohttp import web

from proxy.clock import Clock, utc_iso
from proxy.core.items import JsonDict
from proxy.periodic import every, running
from proxy.server import background
from proxy.server.conversations import item_object
from proxy.server.errors import ApiError, invalid
from proxy.server.pagination import page_params
from proxy.server.state import CLOCK, NAMESPACE, SETTINGS, STORE
from proxy.store.base import ResponseStore, StoredItem, StoredResponse, ThreadStore

log = structlog.get_logger("threadkeeper.responses")

PURGE_INTERVAL_SECONDS = 600.0
PURGE_BATCH = 200  # responses one purge transaction deletes (and holds the writer for) at most
PURGE_BATCHES = 100  # transactions one purge step runs at most (the rest: the next step)


def add_routes(app: web.Application) -> None:
    """Register before the `/v1/{tail}` passthrough, or these paths would be forwarded."""
    one = "/v1/responses/{response_id}"
    app.router.add_get(one, get_response, name="responses.retrieve")
    app.router.add_delete(one, delete_response, name="responses.delete")
    app.router.add_get(f"{one}/input_items", list_input_items, name="responses.input_items")
    app.router.add_post(f"{one}/cancel", cancel_response, name="responses.cancel")


async def _stored(request: web.Request, response_id: str | None = None) -> StoredResponse:
    response_id = response_id or request.match_info["response_id"]
    store: ResponseStore = request.app[STORE]
    stored = await store.get_response(request[NAMESPACE], response_id)
    if stored is None:
        raise ApiError(404, f"Response with id '{response_id}' not found.")
    return stored


def response_object(stored: StoredResponse) -> JsonDict:
    """The final Response; one still running or cut off before the provider answered is
    described from its request."""
    if stored.response is not None:
        return {**stored.response, "status": stored.status}
    request = stored.request
    return {
        "id": stored.id,
        "object": "response",
        "created_at": int(datetime.fromisoformat(stored.created_at).timestamp()),
        "status": stored.status,
        "error": None,
        "incomplete_details": None,
        "instructions": request.get("instructions"),
        "model": request.get("model"),
        "output": [],
        "previous_response_id": stored.previous_response_id,
        "metadata": request.get("metadata") or {},
        "store": True,
        "background": stored.background,
    }


async def get_response(request: web.Request, response_id: str | None = None) -> web.StreamResponse:
    """The stored Response; `?stream=true` resumes a background stream (starting_after)."""
    stored = await _stored(request, response_id)
    if response_id is None and stream_asked(request):
        return await background.resume(request, stored)
    return web.json_response(response_object(stored))


def stream_asked(request: web.Request) -> bool:
    value = request.query.get("stream", "false")
    if value not in ("true", "false"):
        raise invalid(
            f"Invalid 'stream': expected a boolean (true or false), but got '{value}' instead.",
            param="stream",
            code="invalid_type",
        )
    if value == "false":
        background.starting_after(request)  # checked even when it is not used
    return value == "true"


async def cancel_response(request: web.Request) -> web.Response:
    """Only a background response still running can be cancelled (OpenAI's 400 else)."""
    return web.json_response(
        response_object(await background.cancel(request, await _stored(request)))
    )


async def delete_response(request: web.Request) -> web.Response:
    stored = await _stored(request)
    store: ResponseStore = request.app[STORE]
    await store.delete_response(stored.tenant, stored.id)
    return web.json_response({"id": stored.id, "object": "response", "deleted": True})


async def list_input_items(request: web.Request) -> web.Response:
    stored = await _stored(request)
    params = page_params(request.query)
    after, limit = params.after, params.limit
    items = list(await _input_items(request, stored))
    if params.order == "desc":
        items.reverse()
    if after is not None:
        ids = [item.item_id for item in items]
        if after not in ids:
            raise invalid(f"No item with id '{after}' in this response's input.", param="after")
        items = items[ids.index(after) + 1 :]
    page = [item_object(item) for item in items[:limit]]  # as conversations list them
    return web.json_response(
        {
            "object": "list",
            "data": page,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None,
            "has_more": len(items) > limit,
        }
    )


async def _input_items(request: web.Request, stored: StoredResponse) -> tuple[StoredItem, ...]:
    """This response's own input: a cut-off response stored none (SPEC 7)."""
    first, last = stored.input_first_seq, stored.output_last_seq
    if stored.thread_id is None or first is None or last is None:
        return ()
    store: ThreadStore = request.app[STORE]
    items = await store.items_between(stored.tenant, stored.thread_id, first, last)
    return tuple(i for i in items if i.role == "input" and i.response_id == stored.id)


async def purge_expired(store: ResponseStore, clock: Clock, retention: timedelta) -> int:
    """Deletes the responses created more than `retention` ago, in bounded batches; how
    many went."""
    before = utc_iso(clock.now() - retention)
    purged = 0
    for _ in range(PURGE_BATCHES):
        batch = await store.responses_purge(before, limit=PURGE_BATCH)
        purged += batch
        if batch < PURGE_BATCH:
            break
    return purged


def purge_ctx() -> Callable[[web.Application], AsyncIterator[None]]:
    """cleanup_ctx: the retention purge at start and then every PURGE_INTERVAL_SECONDS."""

    async def ctx(app: web.Application) -> AsyncIterator[None]:
        store, clock = app[STORE], app[CLOCK]
        retention = timedelta(seconds=app[SETTINGS].response_retention_seconds)

        async def purge() -> None:
            if purged := await purge_expired(store, clock, retention):
                log.info("responses_purged", count=purged)

        loop = every("responses_purge", PURGE_INTERVAL_SECONDS, purge, clock, first_now=True)
        async with running(loop):
            yield

    return ctx
