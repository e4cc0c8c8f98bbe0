"""Operator endpoints of the side-effect ledger (SPEC 6): an operator reads the entries and
settles one whose outcome the client never reported. The guard that writes the entries is
proxy/server/ledger.py.

Tenant-scoped, bearer auth like /v1; keys and scopes may contain ":", URL-encode them:

    GET  /threadkeeper/v1/ledger?status=issued|completed|failed&limit=1..100 (default 20)
         -> {"object": "list", "data": [entry, ...]}
    GET  /threadkeeper/v1/ledger/{scope}/{key}        -> entry, or 404
    POST /threadkeeper/v1/ledger/{scope}/{key}/resolve
         {"status": "completed", "result": "..."} | {"status": "failed"}
         -> the resolved entry; 409 unless the entry is `issued`, 404 if there is none
"""

from __future__ import annotations

from typing import Any

import structlog
from aiohttp import web

from proxy.operations import LedgerEntryNotIssued, NoLedgerEntry, resolve_ledger_entry
from proxy.server.errors import ApiError, invalid
from proxy.server.pagination import limit_param
from proxy.server.state import CLOCK, NAMESPACE, STORE
from proxy.server.validate import JsonDict, read_json_object, unsupported_value
from proxy.store.base import LedgerEntry, LedgerStatus, LedgerStore

log = structlog.get_logger("threadkeeper.ledger")

STATUSES: tuple[LedgerStatus, ...] = ("issued", "completed", "failed")


def entry_json(entry: LedgerEntry) -> JsonDict:
    return {
        "object": "threadkeeper.ledger_entry",
        "scope": entry.scope,
        "key": entry.key,
        "tool": entry.tool,
        "call_id": entry.call_id,
        "thread_id": entry.thread_id,
        "response_id": entry.response_id,
        "status": entry.status,
        "arguments": entry.arguments,
        "result": entry.result,
        "attempts": entry.attempts,
        "created_at": entry.created_at,
        "updated_at": entry.updated_at,
    }


def status_param(value: Any, param: str) -> LedgerStatus:
    for status in STATUSES:
        if value == status:
            return status
    raise unsupported_value(value, STATUSES, param)


async def list_entries(request: web.Request) -> web.Response:
    tenant = request[NAMESPACE]
    status_value = request.query.get("status")
    status = None if status_value is None else status_param(status_value, "status")
    limit = limit_param(request.query.get("limit"))
    store: LedgerStore = request.app[STORE]
    entries = await store.ledger_list(tenant, status=status, limit=limit)
    return web.json_response({"object": "list", "data": [entry_json(e) for e in entries]})


async def _entry_or_404(request: web.Request) -> LedgerEntry:
    tenant = request[NAMESPACE]
    scope, key = request.match_info["scope"], request.match_info["key"]
    store: LedgerStore = request.app[STORE]
    entry = await store.ledger_get(tenant, scope, key)
    if entry is None:
        raise _not_found(scope, key)
    return entry


def _not_found(scope: str, key: str) -> ApiError:
    return ApiError(404, f"No ledger entry with scope '{scope}' and key '{key}'.")


async def get_entry(request: web.Request) -> web.Response:
    return web.json_response(entry_json(await _entry_or_404(request)))


async def resolve_entry(request: web.Request) -> web.Response:
    """An operator settles an entry whose outcome the client never reported."""
    body, _ = await read_json_object(request)
    status = status_param(body.get("status"), "status")
    if status == "issued":
        raise invalid("'status' must be 'completed' or 'failed'.", "status", "invalid_value")
    scope, key = request.match_info["scope"], request.match_info["key"]
    store: LedgerStore = request.app[STORE]
    try:
        entry = await resolve_ledger_entry(
            store,
            request[NAMESPACE],
            scope,
            key,
            status=status,
            result=body.get("result"),
            now=request.app[CLOCK].iso(),
        )
    except NoLedgerEntry:
        raise _not_found(scope, key) from None
    except LedgerEntryNotIssued as exc:
        raise ApiError(
            409,
            f"Ledger entry '{key}' is '{exc.entry.status}'; only an 'issued' entry can be "
            "resolved.",
            code="ledger_entry_not_issued",
        ) from None
    log.warning("ledger_resolved_by_operator", tenant=entry.tenant, key=entry.key, status=status)
    return web.json_response(entry_json(entry))


def add_routes(app: web.Application) -> None:
    base = "/threadkeeper/v1/ledger"
    app.router.add_get(base, list_entries, name="ledger.list")
    app.router.add_post(base + "/{scope}/{key:.+}/resolve", resolve_entry, name="ledger.resolve")
    app.router.add_get(base + "/{scope}/{key:.+}", get_entry, name="ledger.get")
