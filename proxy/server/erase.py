"""Erasing a thread with everything derived from it, for the tenant that owns it.

    POST /threadkeeper/v1/threads/{thread_id}/erase
         -> {"object": "threadkeeper.thread.erased", "id": ..., "threads": 1, "items": N,
             "responses": N, "idempotency": N, "ledger": N, "explain_records": N,
             "summaries": N}; 404 when nothing of the thread is stored

Tenant-scoped, bearer auth like /v1 (as the ledger's operator endpoints). Deleting a
conversation keeps its responses, idempotency records and ledger entries (as OpenAI keeps
a deleted conversation's responses); this removes them too, and works on the id of a
conversation already deleted. `threadkeeper threads delete ID --erase` is the same from a
shell, for any tenant (proxy/admin.py, Store.erase_thread).
"""

from __future__ import annotations

from aiohttp import web

from proxy import admin
from proxy.server.conversations import forget_thread
from proxy.server.errors import ApiError
from proxy.server.state import LOG_FIELDS, NAMESPACE, STORE, WINDOWS


async def erase_thread(request: web.Request) -> web.Response:
    tenant, thread_id = request[NAMESPACE], request.match_info["thread_id"]
    request[LOG_FIELDS]["erased_thread"] = thread_id
    try:
        erased = await admin.erase_thread(request.app[STORE], thread_id, tenant)
    except admin.AdminError:
        raise ApiError(404, f"Thread with id '{thread_id}' not found.") from None
    request.app[WINDOWS].drop(tenant, thread_id)
    forget_thread(request, tenant, thread_id)
    return web.json_response({k: v for k, v in erased.items() if k != "tenant"})


def add_routes(app: web.Application) -> None:
    app.router.add_post(
        "/threadkeeper/v1/threads/{thread_id}/erase", erase_thread, name="threads.erase"
    )
