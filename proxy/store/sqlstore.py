"""`SqlStore`: the Store contract over any SQL database that offers a tiny connection seam.

The SQLite and PostgreSQL backends differ in how they open connections, begin
transactions and lock; they run the same statements (proxy/store/sql.py) with the same
logic, which lives here once. A backend supplies a `Database` (proxy/store/database.py):
`read()` yields a connection inside a consistent read snapshot, `write()` one inside a
write transaction that commits on exit and rolls back on any exception, so a raised
`VersionConflict` leaves nothing behind. The rows those statements read and write are
decoded and encoded at the end of this module, by pure functions (JSON text columns).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from proxy.core import fastjson
from proxy.core.checkpoint import without_cut
from proxy.core.items import content_digest
from proxy.namespaces import caller_prefix
from proxy.store import sql
from proxy.store.base import (
    MAX_SUMMARY_DIGESTS,
    AlreadyExists,
    Cancelled,
    ExplainRecord,
    ExplainRow,
    Heartbeat,
    IdempotencyRecord,
    InspectorSession,
    ItemPage,
    JsonDict,
    LearnedRecord,
    LedgerEntry,
    LedgerStatus,
    NewItem,
    NotFound,
    ResponseEvent,
    ResponseStatus,
    StoredItem,
    StoredResponse,
    StoredSummary,
    StoreUnavailable,
    SummaryKey,
    Thread,
    ThreadKind,
    TooManyRunning,
    VersionConflict,
    Window,
    stored_items,
    window_start,
)
from proxy.store.database import Conn, Database, Row
from proxy.store.migrate import migrate

# How long readiness reports a store that refused a write for lack of space (disk full):
# an emptied disk is trusted again after this, even with no traffic to prove it.
FULL_REMEMBERED_SECONDS = 5.0


class SqlStore:
    """Implements proxy.store.base.Store; see that protocol for each method's contract."""

    def __init__(self, db: Database) -> None:
        self.db = db

    # lifecycle ------------------------------------------------------------------------
    async def migrate(self) -> None:
        await migrate(self.db)

    async def close(self) -> None:
        await self.db.close()

    async def ping(self) -> None:
        full_at = self.db.full_at
        if full_at is not None and time.monotonic() - full_at < FULL_REMEMBERED_SECONDS:
            raise StoreUnavailable("a write failed for lack of space (disk full) just now")
        async with self.db.read() as conn:
            await conn.fetchrow("SELECT 1 AS ok")

    # threads --------------------------------------------------------------------------
    async def create_thread(
        self,
        tenant: str,
        thread_id: str,
        *,
        kind: ThreadKind,
        metadata: Mapping[str, str] | None = None,
        items: Sequence[NewItem] = (),
        now: str,
    ) -> Thread:
        params = thread_params(tenant, thread_id, kind, metadata, now, len(items))
        async with self.db.write() as conn:
            row = await conn.fetchrow(sql.INSERT_THREAD, *params)
            if row is None:
                raise AlreadyExists(f"thread {thread_id!r} exists")
            await _insert_items(conn, item_params(tenant, thread_id, 0, items, now))
        return thread_from_row(row)

    async def get_thread(self, tenant: str, thread_id: str) -> Thread | None:
        async with self.db.read() as conn:
            return await _thread(conn, tenant, thread_id)

    async def list_threads(
        self, tenant: str | None, *, limit: int, callers: bool = False
    ) -> tuple[Thread, ...]:
        async with self.db.read() as conn:
            if tenant is None:
                rows = await conn.fetch(sql.LIST_THREADS, limit)
            elif callers:
                prefix = caller_prefix(tenant)
                rows = await conn.fetch(sql.LIST_CALLER_THREADS, tenant, len(prefix), prefix, limit)
            else:
                rows = await conn.fetch(sql.LIST_TENANT_THREADS, tenant, limit)
        return tuple(map(thread_from_row, rows))

    async def namespaces(self, tenant: str, *, limit: int) -> tuple[str, ...]:
        prefix = caller_prefix(tenant)
        async with self.db.read() as conn:
            rows = await conn.fetch(sql.TENANT_NAMESPACES, tenant, len(prefix), prefix, limit)
        return tuple(str(row["tenant"]) for row in rows)

    async def find_threads(self, thread_id: str, *, limit: int = 10) -> tuple[Thread, ...]:
        async with self.db.read() as conn:
            rows = await conn.fetch(sql.FIND_THREADS, thread_id, limit)
        return tuple(map(thread_from_row, rows))

    async def update_metadata(
        self, tenant: str, thread_id: str, metadata: Mapping[str, str]
    ) -> Thread | None:
        async with self.db.write() as conn:
            row = await conn.fetchrow(sql.UPDATE_METADATA, tenant, thread_id, dumps(dict(metadata)))
        return None if row is None else thread_from_row(row)

    async def delete_thread(self, tenant: str, thread_id: str) -> bool:
        async with self.db.write() as conn:
            return await _delete_thread(conn, tenant, thread_id)

    async def erase_thread(self, tenant: str, thread_id: str) -> dict[str, int]:
        async with self.db.write() as conn:
            erased = {"items": await conn.execute(sql.DELETE_THREAD_ITEMS, tenant, thread_id)}
            erased["threads"] = await conn.execute(sql.DELETE_THREAD, tenant, thread_id)
            erased["summaries"] = await _forget_thread_summaries(conn, tenant, thread_id)
            for table, statement in sql.ERASE_THREAD.items():
                erased[table] = await conn.execute(statement, tenant, thread_id)
        return erased

    async def responses_purge(self, before: str, *, limit: int = 1000) -> int:
        async with self.db.write() as conn:
            rows = await conn.fetch(sql.PURGE_RESPONSES, before, limit)
            for tenant, thread_id in sorted({(r["tenant"], r["thread_id"]) for r in rows}):
                if thread_id is not None and await conn.fetchrow(
                    sql.EMPTY_CHAIN, tenant, thread_id
                ):
                    await _delete_thread(conn, tenant, thread_id)
        return len(rows)

    async def fork_thread(
        self, tenant: str, source_id: str, new_id: str, *, through_seq: int, now: str
    ) -> Thread:
        async with self.db.write() as conn:
            source = await _thread(conn, tenant, source_id)
            if source is None:
                raise NotFound(f"thread {source_id!r} not found")
            next_seq = max(0, min(source.next_seq, through_seq + 1))
            params = thread_params(tenant, new_id, source.kind, source.metadata, now, next_seq)
            row = await conn.fetchrow(sql.INSERT_THREAD, *params)
            if row is None:
                raise AlreadyExists(f"thread {new_id!r} exists")
            await conn.execute(sql.COPY_ITEMS, tenant, source_id, new_id, through_seq)
        return thread_from_row(row)

    # items ----------------------------------------------------------------------------
    async def append_items(
        self,
        tenant: str,
        thread_id: str,
        items: Sequence[NewItem],
        *,
        expected_version: int | None = None,
        state: JsonDict | None = None,
        now: str,
    ) -> Thread:
        async with self.db.write() as conn:
            thread = await _advance(conn, tenant, thread_id, len(items), expected_version, state)
            first_seq = thread.next_seq - len(items)
            await _insert_items(conn, item_params(tenant, thread_id, first_seq, items, now))
        return thread

    async def load_window(self, tenant: str, thread_id: str, *, from_seq: int = 0) -> Window | None:
        # The thread row alone first, one statement: a window held up to its next_seq
        # (a warm turn's) needs nothing more; else the row again, with its items, in one
        # snapshot.
        async with self.db.read(single=True) as conn:
            thread = await _thread(conn, tenant, thread_id)
        if thread is None:
            return None
        if max(window_start(thread.state), from_seq) >= thread.next_seq:
            return Window(thread=thread, items=())
        async with self.db.read() as conn:
            thread = await _thread(conn, tenant, thread_id)
            if thread is None:
                return None
            start = max(window_start(thread.state), from_seq)
            if start >= thread.next_seq:
                return Window(thread=thread, items=())
            rows = await conn.fetch(sql.SELECT_ITEMS_FROM, tenant, thread_id, start)
        return Window(thread=thread, items=tuple(map(item_from_row, rows)))

    async def list_items(
        self,
        tenant: str,
        thread_id: str,
        *,
        after: str | None = None,
        limit: int = 20,
        order: Literal["asc", "desc"] = "desc",
    ) -> ItemPage:
        if not 1 <= limit <= 100:
            raise ValueError(f"limit must be between 1 and 100, got {limit}")
        async with self.db.read() as conn:
            if await _thread(conn, tenant, thread_id) is None:
                raise NotFound(f"thread {thread_id!r} not found")
            cursor: tuple[int, ...] = ()
            if after is not None:
                row = await conn.fetchrow(sql.SELECT_ITEM, tenant, thread_id, after)
                if row is None:
                    raise NotFound(f"item {after!r} not found in thread {thread_id!r}")
                cursor = (row["seq"],)
            query = sql.page_query(order, after=after is not None)
            rows = await conn.fetch(query, tenant, thread_id, *cursor, limit + 1)
        items = tuple(map(item_from_row, rows[:limit]))
        return ItemPage(items=items, has_more=len(rows) > limit)

    async def items_between(
        self, tenant: str, thread_id: str, first_seq: int, last_seq: int
    ) -> tuple[StoredItem, ...]:
        async with self.db.read() as conn:
            rows = await conn.fetch(
                sql.SELECT_ITEMS_BETWEEN, tenant, thread_id, first_seq, last_seq
            )
        return tuple(map(item_from_row, rows))

    async def get_item(self, tenant: str, thread_id: str, item_id: str) -> StoredItem | None:
        async with self.db.read() as conn:
            row = await conn.fetchrow(sql.SELECT_ITEM, tenant, thread_id, item_id)
        return None if row is None else item_from_row(row)

    async def find_item(self, tenant: str, item_id: str) -> StoredItem | None:
        async with self.db.read() as conn:
            row = await conn.fetchrow(sql.FIND_ITEM, tenant, item_id)
        return None if row is None else item_from_row(row)

    async def delete_item(self, tenant: str, thread_id: str, item_id: str) -> bool:
        async with self.db.write() as conn:
            if await conn.execute(sql.DELETE_ITEM, tenant, thread_id, item_id) == 0:
                return False
            await conn.execute(sql.BUMP_EPOCH, tenant, thread_id)
            await _forget_thread_summaries(conn, tenant, thread_id)
            # The cut's summaries and compressed results may quote the item: projected
            # again from the log, they go, and so do the explain records that show them.
            await conn.execute(sql.DELETE_THREAD_EXPLAIN, tenant, thread_id)
            row = await conn.fetchrow(sql.SELECT_STATE, tenant, thread_id)
            state = loads(row["state"]) if row is not None else None
            if isinstance(state, dict):
                cleared = dumps(without_cut(state))
                await conn.execute(sql.SET_STATE, tenant, thread_id, cleared)
        return True

    # responses ------------------------------------------------------------------------
    async def begin_response(
        self, response: StoredResponse, *, max_running: int | None = None
    ) -> None:
        limit = max_running if response.background else None
        async with self.db.write(single=limit is None) as conn:  # else a count, then the row
            if limit is not None:
                # SQLite's write transactions are serial already; PostgreSQL's are not
                # (each count would miss the other's uncommitted row): the tenant's lock.
                if self.db.dialect == "postgres":
                    await conn.execute(sql.LOCK_BACKGROUND_TENANT, response.tenant)
                row = await conn.fetchrow(sql.COUNT_BACKGROUND_RUNNING, response.tenant)
                if row is not None and int(row["running"]) >= limit:
                    raise TooManyRunning(limit)
            if await conn.execute(sql.INSERT_RESPONSE, *response_params(response)) == 0:
                raise AlreadyExists(f"response {response.id!r} exists")

    async def commit_turn(
        self,
        tenant: str,
        thread_id: str,
        *,
        expected_version: int,
        items: Sequence[NewItem],
        state: JsonDict,
        now: str,
        response_id: str | None = None,
        response: JsonDict | None = None,
    ) -> Thread:
        count = len(items)
        async with self.db.write() as conn:
            thread = await _advance(
                conn, tenant, thread_id, count, expected_version, state, head=response_id
            )
            first_seq = thread.next_seq - count
            rows = item_params(tenant, thread_id, first_seq, items, now, response_id)
            await _insert_items(conn, rows)
            if response_id is not None:
                seqs = (first_seq, thread.next_seq - 1) if count else (None, None)
                body = None if response is None else dumps(response)
                args = (tenant, response_id, body, *seqs)
                if await conn.execute(sql.COMPLETE_TURN_RESPONSE, *args) == 0:
                    await _lost_response(conn, tenant, response_id)
        return thread

    async def finish_response(
        self,
        tenant: str,
        response_id: str,
        *,
        status: ResponseStatus,
        response: JsonDict | None,
    ) -> None:
        body = None if response is None else dumps(response)
        async with self.db.write() as conn:
            if await conn.execute(sql.FINISH_RESPONSE, tenant, response_id, status, body) == 0:
                with contextlib.suppress(Cancelled):  # it stays cancelled
                    await _lost_response(conn, tenant, response_id)

    async def get_response(self, tenant: str, response_id: str) -> StoredResponse | None:
        async with self.db.read() as conn:
            row = await conn.fetchrow(sql.SELECT_RESPONSE, tenant, response_id)
        return None if row is None else response_from_row(row)

    async def find_responses(
        self, response_id: str, *, limit: int = 10
    ) -> tuple[StoredResponse, ...]:
        async with self.db.read() as conn:
            rows = await conn.fetch(sql.FIND_RESPONSES, response_id, limit)
        return tuple(map(response_from_row, rows))

    async def delete_response(self, tenant: str, response_id: str) -> bool:
        async with self.db.write() as conn:
            await conn.execute(sql.DELETE_RESPONSE_EVENTS, tenant, response_id)
            return await conn.execute(sql.DELETE_RESPONSE, tenant, response_id) > 0

    async def cancel_response(self, tenant: str, response_id: str) -> bool:
        async with self.db.write() as conn:
            return await conn.execute(sql.CANCEL_RESPONSE, tenant, response_id) > 0

    async def background_running(self, tenant: str) -> int:
        async with self.db.read() as conn:
            row = await conn.fetchrow(sql.COUNT_BACKGROUND_RUNNING, tenant)
        return int(row["running"]) if row is not None else 0

    async def response_events_append(
        self, tenant: str, response_id: str, events: Sequence[ResponseEvent], now: str
    ) -> None:
        rows = [(tenant, response_id, e.seq, e.event, e.data, now) for e in events]
        async with self.db.write() as conn:
            await conn.executemany(sql.INSERT_RESPONSE_EVENT, rows)

    async def response_events(
        self, tenant: str, response_id: str, *, after: int, limit: int
    ) -> tuple[ResponseEvent, ...]:
        async with self.db.read() as conn:
            rows = await conn.fetch(sql.SELECT_RESPONSE_EVENTS, tenant, response_id, after, limit)
        return tuple(ResponseEvent(row["seq"], row["event"], row["data"]) for row in rows)

    async def response_events_last(self, tenant: str, response_id: str) -> int | None:
        async with self.db.read() as conn:
            row = await conn.fetchrow(sql.LAST_RESPONSE_EVENT, tenant, response_id)
        return None if row is None or row["last"] is None else int(row["last"])

    async def response_events_purge(self, before: str) -> int:
        async with self.db.write() as conn:
            return await conn.execute(sql.PURGE_RESPONSE_EVENTS, before)

    async def heartbeat(self, owner: str, now: str, *, host: str = "", pid: int = 0) -> None:
        async with self.db.write() as conn:
            await conn.execute(sql.HEARTBEAT, owner, host, pid, now)

    async def heartbeats(self) -> tuple[Heartbeat, ...]:
        async with self.db.read() as conn:
            rows = await conn.fetch(sql.SELECT_HEARTBEATS)
        return tuple(map(heartbeat_from_row, rows))

    async def abandon_dead(self, stale_before: str, *, except_owner: str) -> int:
        async with self.db.write() as conn:
            abandoned = await conn.execute(sql.ABANDON_DEAD, stale_before, except_owner)
            await conn.execute(sql.DELETE_DEAD_IDEMPOTENCY, stale_before, except_owner)
            await conn.execute(sql.DELETE_STALE_OWNERS, stale_before, except_owner)
        return abandoned

    async def retire(self, owner: str) -> int:
        async with self.db.write() as conn:
            abandoned = await conn.execute(sql.ABANDON_OWNED, owner)
            await conn.execute(sql.DELETE_OWNED_IDEMPOTENCY, owner)
            await conn.execute(sql.DELETE_OWNER, owner)
        return abandoned

    # side-effect ledger ---------------------------------------------------------------
    async def ledger_issue(self, entry: LedgerEntry) -> tuple[LedgerEntry, bool]:
        async with self.db.write() as conn:
            row = await conn.fetchrow(sql.INSERT_LEDGER, *ledger_params(entry))
            if row is not None:
                return ledger_from_row(row), True
            row = await conn.fetchrow(sql.SELECT_LEDGER, entry.tenant, entry.scope, entry.key)
        if row is None:  # the ledger has no DELETE, so the conflicting row is still there
            raise RuntimeError(f"ledger entry {entry.key!r} conflicted but cannot be read")
        return ledger_from_row(row), False

    async def ledger_get(self, tenant: str, scope: str, key: str) -> LedgerEntry | None:
        async with self.db.read() as conn:
            row = await conn.fetchrow(sql.SELECT_LEDGER, tenant, scope, key)
        return None if row is None else ledger_from_row(row)

    async def ledger_by_call(self, tenant: str, call_id: str) -> LedgerEntry | None:
        async with self.db.read() as conn:
            row = await conn.fetchrow(sql.SELECT_LEDGER_BY_CALL, tenant, call_id)
        return None if row is None else ledger_from_row(row)

    async def ledger_resolve(
        self,
        tenant: str,
        scope: str,
        key: str,
        *,
        status: LedgerStatus,
        result: str | None,
        now: str,
        only_if: LedgerStatus = "issued",
    ) -> bool:
        args = (tenant, scope, key, status, result, now, only_if)
        async with self.db.write() as conn:
            return await conn.execute(sql.RESOLVE_LEDGER, *args) > 0

    async def ledger_rearm(
        self, tenant: str, scope: str, key: str, *, call_id: str, now: str
    ) -> bool:
        async with self.db.write() as conn:
            return await conn.execute(sql.REARM_LEDGER, tenant, scope, key, call_id, now) > 0

    async def ledger_list(
        self,
        tenant: str | None,
        *,
        status: LedgerStatus | None = None,
        limit: int = 100,
        callers: bool = False,
    ) -> tuple[LedgerEntry, ...]:
        async with self.db.read() as conn:
            if tenant is not None and callers:
                prefix = caller_prefix(tenant)
                if status is None:
                    rows = await conn.fetch(
                        sql.LIST_CALLER_LEDGER, tenant, len(prefix), prefix, limit
                    )
                else:
                    rows = await conn.fetch(
                        sql.LIST_CALLER_LEDGER_BY_STATUS, tenant, len(prefix), prefix, status, limit
                    )
            elif tenant is None and status is None:
                rows = await conn.fetch(sql.LIST_ALL_LEDGER, limit)
            elif tenant is None:
                rows = await conn.fetch(sql.LIST_ALL_LEDGER_BY_STATUS, status, limit)
            elif status is None:
                rows = await conn.fetch(sql.LIST_LEDGER, tenant, limit)
            else:
                rows = await conn.fetch(sql.LIST_LEDGER_BY_STATUS, tenant, status, limit)
        return tuple(map(ledger_from_row, rows))

    # server secrets -------------------------------------------------------------------
    async def secret(self, name: str) -> str | None:
        async with self.db.read() as conn:
            row = await conn.fetchrow(sql.SELECT_SECRET, name)
        return None if row is None else str(row["value"])

    async def create_secret(self, name: str, value: str, now: str) -> str:
        async with self.db.write() as conn:
            await conn.execute(sql.INSERT_SECRET, name, value, now)
            row = await conn.fetchrow(sql.SELECT_SECRET, name)
        if row is None:  # same transaction as the insert: cannot be missing
            raise RuntimeError(f"server secret {name!r} vanished")
        return str(row["value"])

    # learned limits -------------------------------------------------------------------
    async def learned_get(self, tenant: str, upstream: str, model: str) -> LearnedRecord | None:
        async with self.db.read() as conn:
            row = await conn.fetchrow(sql.SELECT_LEARNED, tenant, upstream, model)
        return None if row is None else learned_from_row(row)

    async def learned_put(self, record: LearnedRecord) -> None:
        async with self.db.write() as conn:
            await conn.execute(
                sql.UPSERT_LEARNED,
                record.tenant,
                record.upstream,
                record.model,
                dumps(record.state),
                record.updated_at,
            )

    async def learned_list(
        self, tenant: str | None, *, limit: int = 1000
    ) -> tuple[LearnedRecord, ...]:
        async with self.db.read() as conn:
            if tenant is None:
                rows = await conn.fetch(sql.LIST_ALL_LEARNED, limit)
            else:
                rows = await conn.fetch(sql.LIST_LEARNED, tenant, limit)
        return tuple(map(learned_from_row, rows))

    # upstream APIs --------------------------------------------------------------------
    async def upstream_api_get(self, tenant: str, base_url: str) -> str | None:
        async with self.db.read() as conn:
            row = await conn.fetchrow(sql.SELECT_UPSTREAM_API, tenant, base_url)
        return None if row is None else str(row["api"])

    async def upstream_api_set(self, tenant: str, base_url: str, api: str, now: str) -> str:
        async with self.db.write() as conn:
            await conn.execute(sql.INSERT_UPSTREAM_API, tenant, base_url, api, now)
            row = await conn.fetchrow(sql.SELECT_UPSTREAM_API, tenant, base_url)
        if row is None:  # same transaction as the insert: cannot be missing
            raise RuntimeError(f"upstream api of {base_url!r} vanished")
        return str(row["api"])

    # explain records ------------------------------------------------------------------
    async def explain_put(self, rows: Sequence[ExplainRow]) -> None:
        values = [(r.tenant, r.request_id, r.created_at, r.text, r.thread_id) for r in rows]
        async with self.db.write() as conn:
            await conn.executemany(sql.INSERT_EXPLAIN, values)

    async def explain_get(self, tenant: str | None, request_id: str) -> ExplainRecord | None:
        async with self.db.read() as conn:
            if tenant is not None:
                row = await conn.fetchrow(sql.SELECT_EXPLAIN, tenant, request_id)
                return None if row is None else explain_from_row(row)
            rows = await conn.fetch(sql.FIND_EXPLAIN, request_id)
        return explain_from_row(rows[0]) if len(rows) == 1 else None

    async def explain_for_thread(
        self, tenant: str, thread_id: str, *, limit: int
    ) -> tuple[ExplainRecord, ...]:
        async with self.db.read() as conn:
            rows = await conn.fetch(sql.THREAD_EXPLAIN, tenant, thread_id, limit)
        return tuple(map(explain_from_row, rows))

    async def explain_purge(self, before: str) -> int:
        async with self.db.write() as conn:
            return await conn.execute(sql.PURGE_EXPLAIN, before)

    # inspector sessions ---------------------------------------------------------------
    async def inspector_session_create(self, session: InspectorSession) -> None:
        async with self.db.write() as conn:
            if await conn.fetchrow(sql.SELECT_SESSION, session.id_hash) is not None:
                raise AlreadyExists(f"inspector session {session.id_hash[:12]}")
            await conn.execute(
                sql.INSERT_SESSION,
                session.id_hash,
                session.tenant,
                session.key_hash,
                session.signing_key,
                session.created_at,
                session.expires_at,
            )

    async def inspector_session_get(self, id_hash: str) -> InspectorSession | None:
        async with self.db.read() as conn:
            row = await conn.fetchrow(sql.SELECT_SESSION, id_hash)
        return None if row is None else session_from_row(row)

    async def inspector_session_revoke(self, id_hash: str) -> bool:
        async with self.db.write() as conn:
            return await conn.execute(sql.DELETE_SESSION, id_hash) > 0

    async def inspector_sessions_purge(self, *, now: str, signing_key: str | None = None) -> int:
        async with self.db.write() as conn:
            if signing_key is None:
                return await conn.execute(sql.PURGE_SESSIONS, now)
            return await conn.execute(sql.PURGE_SESSIONS_OF_OTHER_KEYS, now, signing_key)

    # request idempotency --------------------------------------------------------------
    async def idempotency_begin(self, record: IdempotencyRecord) -> IdempotencyRecord | None:
        async with self.db.write() as conn:
            if await conn.fetchrow(sql.BEGIN_IDEMPOTENCY, *idempotency_params(record)):
                return None
            row = await conn.fetchrow(sql.SELECT_IDEMPOTENCY, record.tenant, record.key)
        if row is None:  # same transaction as the conflicting insert: cannot vanish
            raise RuntimeError(f"idempotency record {record.key!r} conflicted but is gone")
        return idempotency_from_row(row)

    async def idempotency_get(self, tenant: str, key: str) -> IdempotencyRecord | None:
        """Not in the protocol; lets tests and tools inspect a record."""
        async with self.db.read() as conn:
            row = await conn.fetchrow(sql.SELECT_IDEMPOTENCY, tenant, key)
        return None if row is None else idempotency_from_row(row)

    async def idempotency_finish(
        self,
        tenant: str,
        key: str,
        *,
        status: int,
        headers: Sequence[tuple[str, str]],
        body: bytes,
        thread_id: str | None = None,
    ) -> None:
        args = (tenant, key, status, headers_text(headers), body, thread_id)
        async with self.db.write() as conn:
            await conn.execute(sql.FINISH_IDEMPOTENCY, *args)

    async def idempotency_abort(self, tenant: str, key: str) -> None:
        async with self.db.write() as conn:
            await conn.execute(sql.ABORT_IDEMPOTENCY, tenant, key)

    async def idempotency_purge(self, now: str) -> int:
        async with self.db.write() as conn:
            return await conn.execute(sql.PURGE_IDEMPOTENCY, now)

    # LLM summaries --------------------------------------------------------------------
    async def summary_put(self, summary: StoredSummary, *, thread_id: str | None = None) -> bool:
        async with self.db.write() as conn:
            exists = sql.THREAD_EXISTS[self.db.dialect]
            if thread_id is not None and not await conn.fetchrow(exists, summary.tenant, thread_id):
                return False
            stored = await conn.fetchrow(sql.INSERT_SUMMARY, *summary_params(summary))
            if thread_id is not None:
                key = (summary.tenant, thread_id, summary.model, summary.api)
                await _keep_summaries(conn, *key, [summary.digest])
        return stored is not None

    async def summaries_get(
        self, tenant: str, model: str, api: str, digests: Sequence[str]
    ) -> dict[str, StoredSummary]:
        wanted = list(dict.fromkeys(digests))
        if len(wanted) > MAX_SUMMARY_DIGESTS:
            raise ValueError(f"at most {MAX_SUMMARY_DIGESTS} digests, got {len(wanted)}")
        if not wanted:
            return {}
        async with self.db.read() as conn:
            rows = await conn.fetch(sql.select_summaries(len(wanted)), tenant, model, api, *wanted)
        return {row["digest"]: summary_from_row(row) for row in rows}

    async def summaries_keep(
        self, tenant: str, thread_id: str, model: str, api: str, digests: Sequence[str]
    ) -> None:
        wanted = list(dict.fromkeys(digests))
        if len(wanted) > MAX_SUMMARY_DIGESTS:
            raise ValueError(f"at most {MAX_SUMMARY_DIGESTS} digests, got {len(wanted)}")
        if not wanted:
            return
        async with self.db.write() as conn:
            if await conn.fetchrow(sql.THREAD_EXISTS[self.db.dialect], tenant, thread_id):
                await _keep_summaries(conn, tenant, thread_id, model, api, wanted)

    async def summaries_touch(self, keys: Sequence[SummaryKey], now: str) -> None:
        if not keys:
            return
        async with self.db.write() as conn:
            await conn.executemany(sql.TOUCH_SUMMARY, [(*key, now) for key in keys])

    async def summaries_purge(self, before: str) -> int:
        async with self.db.write() as conn:
            await conn.execute(sql.PURGE_SUMMARY_LINKS, before)
            unused = await conn.execute(sql.PURGE_SUMMARIES, before)
            return unused + await conn.execute(sql.PURGE_ORPHAN_SUMMARIES)


async def _keep_summaries(
    conn: Conn, tenant: str, thread_id: str, model: str, api: str, digests: list[str]
) -> None:
    """Links the stored summaries among `digests` to the thread (which exists)."""
    await conn.execute(sql.keep_summaries(len(digests)), tenant, thread_id, model, api, *digests)
    await conn.execute(sql.own_summaries(len(digests)), tenant, model, api, *digests)


async def _lost_response(conn: Conn, tenant: str, response_id: str) -> None:
    """Why a response's conditional UPDATE matched no row: Cancelled or NotFound."""
    row = await conn.fetchrow(sql.RESPONSE_STATUS, tenant, response_id)
    if row is not None and row["status"] == "cancelled":
        raise Cancelled(f"response {response_id!r} was cancelled")
    raise NotFound(f"response {response_id!r} not found")


async def _delete_thread(conn: Conn, tenant: str, thread_id: str) -> bool:
    await conn.execute(sql.DELETE_THREAD_ITEMS, tenant, thread_id)
    deleted = await conn.execute(sql.DELETE_THREAD, tenant, thread_id) > 0
    await _forget_thread_summaries(conn, tenant, thread_id)
    # Explain records quote the thread's summaries and compressed tool results.
    await conn.execute(sql.DELETE_THREAD_EXPLAIN, tenant, thread_id)
    return deleted


async def _forget_thread_summaries(conn: Conn, tenant: str, thread_id: str) -> int:
    """The summaries only this thread kept are deleted (how many), the others stop
    naming it."""
    deleted = await conn.execute(sql.DELETE_THREAD_SUMMARIES, tenant, thread_id)
    await conn.execute(sql.DELETE_THREAD_LINKS, tenant, thread_id)
    return deleted


async def _thread(conn: Conn, tenant: str, thread_id: str) -> Thread | None:
    row = await conn.fetchrow(sql.SELECT_THREAD, tenant, thread_id)
    return None if row is None else thread_from_row(row)


async def _advance(
    conn: Conn,
    tenant: str,
    thread_id: str,
    count: int,
    expected_version: int | None,
    state: JsonDict | None,
    head: str | None = None,
) -> Thread:
    """The OCC write (SPEC section 7): claim `count` seqs, bump the version, maybe replace
    the state. NotFound / VersionConflict when no row matched."""
    state_text = None if state is None else dumps(state)
    args: tuple[Any, ...] = (tenant, thread_id, count, state_text, head)
    if expected_version is None:
        row = await conn.fetchrow(sql.ADVANCE_THREAD, *args)
    else:
        row = await conn.fetchrow(sql.ADVANCE_THREAD_AT_VERSION, *args, expected_version)
    if row is not None:
        return thread_from_row(row)
    if await _thread(conn, tenant, thread_id) is None:
        raise NotFound(f"thread {thread_id!r} not found")
    raise VersionConflict(f"thread {thread_id!r} is past version {expected_version}")


async def _insert_items(conn: Conn, rows: list[tuple[Any, ...]]) -> None:
    if rows:
        await conn.executemany(sql.INSERT_ITEM, rows)


# -- rows <-> values (pure: the statements' text is proxy/store/sql.py) -------------------


def dumps(value: Any) -> str:
    """A column's JSON text: read back by `loads` as `value` (fastjson.dumps_text)."""
    return fastjson.dumps_text(value)


def loads(text: str | None) -> Any:
    return None if text is None else fastjson.loads(text)


def learned_from_row(row: Row) -> LearnedRecord:
    state = loads(row["state"])
    return LearnedRecord(
        tenant=row["tenant"],
        upstream=row["upstream"],
        model=row["model"],
        state=state if isinstance(state, dict) else {},
        updated_at=row["updated_at"],
    )


def thread_from_row(row: Row) -> Thread:
    return Thread(
        tenant=row["tenant"],
        id=row["id"],
        kind=row["kind"],
        metadata=loads(row["metadata"]),
        created_at=row["created_at"],
        version=row["version"],
        next_seq=row["next_seq"],
        state=loads(row["state"]),
        head_response_id=row["head_response_id"],
        epoch=row["epoch"],
    )


def item_from_row(row: Row) -> StoredItem:
    raw = loads(row["raw"])
    return StoredItem(
        seq=row["seq"],
        item_id=row["item_id"],
        raw=raw,
        api=row["api"],
        tokens=row["tokens"],
        encoding=row["encoding"],
        response_id=row["response_id"],
        role=row["role"],
        created_at=row["created_at"],
        # Rows from before migration 005 have none: computed here, the same function.
        digest=row["digest"] or content_digest(raw),
    )


def response_from_row(row: Row) -> StoredResponse:
    return StoredResponse(
        tenant=row["tenant"],
        id=row["id"],
        thread_id=row["thread_id"],
        previous_response_id=row["previous_response_id"],
        status=row["status"],
        request=loads(row["request"]),
        response=loads(row["response"]),
        created_at=row["created_at"],
        owner=row["owner"],
        input_first_seq=row["input_first_seq"],
        output_last_seq=row["output_last_seq"],
        background=bool(row["background"]),
    )


def ledger_from_row(row: Row) -> LedgerEntry:
    return LedgerEntry(**{name: row[name] for name in sql.LEDGER_COLUMNS.split(", ")})


def heartbeat_from_row(row: Row) -> Heartbeat:
    return Heartbeat(**{name: row[name] for name in sql.HEARTBEAT_COLUMNS.split(", ")})


def idempotency_from_row(row: Row) -> IdempotencyRecord:
    body = row["response_body"]
    return IdempotencyRecord(
        tenant=row["tenant"],
        key=row["key"],
        fingerprint=row["fingerprint"],
        status=row["status"],
        response_status=row["response_status"],
        response_headers=tuple((name, value) for name, value in loads(row["response_headers"])),
        response_body=None if body is None else bytes(body),
        created_at=row["created_at"],
        expires_at=row["expires_at"],
        owner=row["owner"] or "",
    )


def summary_from_row(row: Row) -> StoredSummary:
    return StoredSummary(
        tenant=row["tenant"],
        model=row["model"],
        api=row["api"],
        digest=row["digest"],
        raw=loads(row["raw"]),
        state=loads(row["state"]),
        created_at=row["created_at"],
    )


def thread_params(
    tenant: str,
    thread_id: str,
    kind: str,
    metadata: Mapping[str, str] | None,
    now: str,
    next_seq: int,
) -> tuple[Any, ...]:
    return (tenant, thread_id, kind, dumps(dict(metadata or {})), now, next_seq, dumps({}))


def item_params(
    tenant: str,
    thread_id: str,
    first_seq: int,
    items: Sequence[NewItem],
    now: str,
    response_id: str | None = None,
) -> list[tuple[Any, ...]]:
    """Rows for sql.INSERT_ITEM (base.stored_items: the turn's response id, the digest)."""
    return [
        (
            tenant,
            thread_id,
            item.seq,
            item.item_id,
            dumps(item.raw),
            item.api,
            item.tokens,
            item.encoding,
            item.response_id,
            item.role,
            item.created_at,
            item.digest,
        )
        for item in stored_items(items, first_seq, now, response_id)
    ]


def response_params(response: StoredResponse) -> tuple[Any, ...]:
    return (
        response.tenant,
        response.id,
        response.thread_id,
        response.previous_response_id,
        response.status,
        dumps(response.request),
        None if response.response is None else dumps(response.response),
        response.created_at,
        response.owner,
        response.input_first_seq,
        response.output_last_seq,
        response.background,
    )


def ledger_params(entry: LedgerEntry) -> tuple[Any, ...]:
    return tuple(getattr(entry, name) for name in sql.LEDGER_COLUMNS.split(", "))


def idempotency_params(record: IdempotencyRecord) -> tuple[Any, ...]:
    return (
        record.tenant,
        record.key,
        record.fingerprint,
        record.status,
        record.response_status,
        headers_text(record.response_headers),
        record.response_body,
        record.created_at,
        record.expires_at,
        record.owner or None,
    )


def headers_text(headers: Sequence[tuple[str, str]]) -> str:
    return dumps([[name, value] for name, value in headers])


def summary_params(summary: StoredSummary) -> tuple[Any, ...]:
    state = None if summary.state is None else dumps(summary.state)
    return (
        summary.tenant,
        summary.model,
        summary.api,
        summary.digest,
        dumps(summary.raw),
        state,
        summary.created_at,
    )


def explain_from_row(row: Row) -> ExplainRecord:
    return ExplainRecord(row["tenant"], row["request_id"], row["created_at"], loads(row["record"]))


def session_from_row(row: Row) -> InspectorSession:
    return InspectorSession(
        row["id_hash"],
        row["tenant"],
        row["key_hash"],
        row["signing_key"],
        row["created_at"],
        row["expires_at"],
    )
