"""GET/DELETE /v1/responses/{id} and GET /v1/responses/{id}/input_items, from the store.

Served locally and tenant-scoped: a response of another tenant is a 404 (SPEC 1).
"""

from __future__ import annotations

from datetime import datetime

from aiohttp import web

from proxy.core.items import JsonDict
from proxy.server.conversations import item_object
from proxy.server.errors import ApiError, invalid
from proxy.server.pagination import page_params
from proxy.server.state import NAMESPACE, STORE
from proxy.store.base import StoredItem, StoredResponse


def add_routes(app: web.Application) -> None:
    """Register before the `/v1/{tail}` passthrough, or these paths would be forwarded."""
    one = "/v1/responses/{response_id}"
    app.router.add_get(one, get_response, name="responses.retrieve")
    app.router.add_delete(one, delete_response, name="responses.delete")
    app.router.add_get(f"{one}/input_items", list_input_items, name="responses.input_items")


async def _stored(request: web.Request) -> StoredResponse:
    response_id = request.match_info["response_id"]
    stored = await request.app[STORE].get_response(request[NAMESPACE], response_id)
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
    }


async def get_response(request: web.Request) -> web.Response:
    return web.json_response(response_object(await _stored(request)))


async def delete_response(request: web.Request) -> web.Response:
    stored = await _stored(request)
    await request.app[STORE].delete_response(stored.tenant, stored.id)
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
    items = await request.app[STORE].items_between(stored.tenant, stored.thread_id, first, last)
    return tuple(i for i in items if i.role == "input" and i.response_id == stored.id)
