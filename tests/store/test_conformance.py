"""The Store contract (proxy/store/base.py), one suite run on every backend."""

from __future__ import annotations

import asyncio
import json
from contextlib import suppress
from dataclasses import replace
from typing import Any

import pytest

from proxy.core.items import content_digest
from proxy.store.base import (
    MAX_SUMMARY_DIGESTS,
    AlreadyExists,
    ExplainRow,
    Heartbeat,
    IdempotencyRecord,
    InspectorSession,
    LedgerEntry,
    NewItem,
    NotFound,
    Store,
    StoredResponse,
    StoredSummary,
    VersionConflict,
)
from proxy.store.migrate import CREATE_SCHEMA_VERSION, RECORD_VERSION, load_migrations, migrate
from proxy.store.sqlstore import SqlStore
from tests.store.conftest import Backend

T0 = "2025-01-01T00:00:00.000000+00:00"
T1 = "2025-01-01T00:00:01.000000+00:00"
T2 = "2025-01-01T00:00:02.000000+00:00"
T3 = "2025-01-01T00:00:03.000000+00:00"


def message(text: str, role: str = "user") -> dict[str, Any]:
    return {"type": "message", "role": role, "content": [{"type": "input_text", "text": text}]}


def new_item(item_id: str, text: str = "", **fields: Any) -> NewItem:
    return NewItem(item_id=item_id, raw=message(text or item_id), api="responses", **fields)


def items(*ids: str) -> list[NewItem]:
    return [new_item(item_id) for item_id in ids]


async def thread_with(store: Store, *ids: str, tenant: str = "acme", tid: str = "t1") -> None:
    await store.create_thread(tenant, tid, kind="conversation", items=items(*ids), now=T0)


async def status_of(store: Store, tenant: str, response_id: str) -> str | None:
    stored = await store.get_response(tenant, response_id)
    return None if stored is None else stored.status


def ids_of(stored: Any) -> list[str]:
    return [item.item_id for item in stored]


def response(
    rid: str, *, tenant: str = "acme", thread_id: str | None = "t1", owner: str = "p1"
) -> StoredResponse:
    return StoredResponse(
        tenant=tenant,
        id=rid,
        thread_id=thread_id,
        previous_response_id=None,
        status="in_progress",
        request={"model": "gpt-4o-mini", "store": True},
        response=None,
        created_at=T0,
        owner=owner,
    )


def ledger_entry(
    key: str = "refund:42", *, call_id: str = "call_1", tenant: str = "acme"
) -> LedgerEntry:
    return LedgerEntry(
        tenant=tenant,
        scope="tenant",
        key=key,
        tool="refund_order",
        call_id=call_id,
        thread_id="t1",
        response_id="resp_1",
        status="issued",
        arguments='{"order_id": 42}',
        result=None,
        attempts=1,
        created_at=T0,
        updated_at=T0,
    )


def idem(
    key: str = "k1",
    *,
    created: str = T0,
    expires: str = T2,
    fingerprint: str = "fp1",
    owner: str = "",
    tenant: str = "acme",
) -> IdempotencyRecord:
    return IdempotencyRecord(
        tenant=tenant,
        key=key,
        fingerprint=fingerprint,
        status="running",
        response_status=None,
        created_at=created,
        expires_at=expires,
        owner=owner,
    )


async def holder(store: Store, key: str, tenant: str = "acme") -> str | None:
    """The owner of the record holding `key`, or None when the key is free (the probe then
    takes it, so ask once per key)."""
    existing = await store.idempotency_begin(idem(key, fingerprint="probe", tenant=tenant))
    return None if existing is None else existing.owner


# threads -----------------------------------------------------------------------------


async def test_create_get_update_delete_thread(store: Store) -> None:
    created = await store.create_thread(
        "acme", "t1", kind="conversation", metadata={"topic": "refunds"}, now=T0
    )
    assert (created.version, created.next_seq, created.state) == (0, 0, {})
    assert await store.get_thread("acme", "t1") == created

    updated = await store.update_metadata("acme", "t1", {"topic": "billing"})
    assert updated is not None and dict(updated.metadata) == {"topic": "billing"}
    assert await store.update_metadata("acme", "missing", {}) is None

    assert await store.delete_thread("acme", "t1") is True
    assert await store.get_thread("acme", "t1") is None
    assert await store.delete_thread("acme", "t1") is False


async def test_create_thread_with_items_and_duplicate_id(store: Store) -> None:
    await thread_with(store, "a", "b")
    window = await store.load_window("acme", "t1")
    assert window is not None and window.thread.next_seq == 2
    assert [(i.seq, i.item_id) for i in window.items] == [(0, "a"), (1, "b")]
    with pytest.raises(AlreadyExists):
        await store.create_thread("acme", "t1", kind="chat", now=T1)


async def test_delete_thread_removes_its_items(store: Store) -> None:
    await thread_with(store, "a", "b")
    await store.delete_thread("acme", "t1")
    await store.create_thread("acme", "t1", kind="conversation", now=T1)
    assert await store.get_item("acme", "t1", "a") is None
    assert await store.items_between("acme", "t1", 0, 10) == ()


async def test_find_item_looks_in_every_thread_of_the_tenant_only(store: Store) -> None:
    await thread_with(store, "a", "b")
    await thread_with(store, "c", tid="t2")
    await thread_with(store, "d", tenant="other")
    found = await store.find_item("acme", "c")
    assert found is not None and (found.item_id, found.raw) == ("c", new_item("c").raw)
    assert await store.find_item("acme", "d") is None
    assert await store.find_item("other", "a") is None
    await store.delete_item("acme", "t2", "c")
    assert await store.find_item("acme", "c") is None


async def test_tenants_never_see_each_other(store: Store) -> None:
    await thread_with(store, "a")
    await store.begin_response(response("resp_1"))
    await store.ledger_issue(ledger_entry())
    await store.idempotency_begin(idem())

    assert await store.get_thread("other", "t1") is None
    assert await store.load_window("other", "t1") is None
    assert await store.get_item("other", "t1", "a") is None
    assert await store.items_between("other", "t1", 0, 10) == ()
    assert await store.update_metadata("other", "t1", {"x": "y"}) is None
    with pytest.raises(NotFound):
        await store.list_items("other", "t1")
    with pytest.raises(NotFound):
        await store.append_items("other", "t1", items("b"), now=T1)
    with pytest.raises(NotFound):
        await store.fork_thread("other", "t1", "t2", through_seq=0, now=T1)
    assert await store.get_response("other", "resp_1") is None
    with pytest.raises(NotFound):
        await store.finish_response("other", "resp_1", status="failed", response=None)
    assert await store.ledger_get("other", "tenant", "refund:42") is None
    assert await store.ledger_by_call("other", "call_1") is None
    assert await store.ledger_list("other") == ()
    assert not await store.ledger_resolve(
        "other", "tenant", "refund:42", status="completed", result="ok", now=T1
    )
    assert await store.idempotency_begin(replace(idem(), tenant="other")) is None

    # deletes by another tenant change nothing
    assert await store.delete_item("other", "t1", "a") is False
    assert await store.delete_response("other", "resp_1") is False
    assert await store.delete_thread("other", "t1") is False
    assert await store.get_item("acme", "t1", "a") is not None
    assert (await store.get_response("acme", "resp_1")) is not None

    # the same ids are free for the other tenant
    await thread_with(store, "a", tenant="other")
    assert ids_of(await store.items_between("other", "t1", 0, 10)) == ["a"]


# items -------------------------------------------------------------------------------


async def test_append_bumps_version_and_seq(store: Store) -> None:
    await thread_with(store, "a")
    thread = await store.append_items("acme", "t1", items("b", "c"), now=T1)
    assert (thread.version, thread.next_seq) == (1, 3)
    thread = await store.append_items(
        "acme", "t1", items("d"), expected_version=1, state={"window_start": 2}, now=T2
    )
    assert (thread.version, thread.next_seq, thread.state) == (2, 4, {"window_start": 2})


async def test_append_to_missing_thread_is_not_found(store: Store) -> None:
    with pytest.raises(NotFound):
        await store.append_items("acme", "nope", items("a"), now=T0)
    with pytest.raises(NotFound):
        await store.append_items("acme", "nope", items("a"), expected_version=0, now=T0)


async def test_duplicate_item_id_rolls_back_the_append(store: Store) -> None:
    await thread_with(store, "a")
    with pytest.raises(AlreadyExists):
        await store.append_items("acme", "t1", items("b", "a"), now=T1)
    thread = await store.get_thread("acme", "t1")
    assert thread is not None and (thread.version, thread.next_seq) == (0, 1)
    assert await store.get_item("acme", "t1", "b") is None


async def test_load_window_starts_at_window_start(store: Store) -> None:
    await thread_with(store, "a", "b", "c", "d")
    await store.append_items(
        "acme", "t1", items("e"), expected_version=0, state={"window_start": 3}, now=T1
    )
    window = await store.load_window("acme", "t1")
    assert window is not None
    assert [(i.seq, i.item_id) for i in window.items] == [(3, "d"), (4, "e")]
    assert window.thread.state == {"window_start": 3}


async def test_raw_json_round_trips_exactly(store: Store) -> None:
    raw = {
        "type": "function_call_output",
        "zeta": 1,
        "alpha": {"nested": [1, 2.5, None, True, {"b": 1, "a": 2}]},
        "text": 'héllo — 你好 🌍 \u0000 "quoted" \\ \n',
        "encrypted_content": "gAAAAB" + "x" * 2000,
        "id": "fc_1",
    }
    await store.create_thread("acme", "t1", kind="responses", now=T0)
    await store.append_items(
        "acme", "t1", [NewItem(item_id="fc_1", raw=raw, api="responses")], now=T1
    )
    stored = await store.get_item("acme", "t1", "fc_1")
    assert stored is not None
    assert stored.raw == raw
    assert list(stored.raw) == list(raw)
    assert list(stored.raw["alpha"]["nested"][4]) == ["b", "a"]


async def test_tokens_and_item_fields_are_stored(store: Store) -> None:
    item = NewItem(
        item_id="m1",
        raw={"role": "assistant", "content": "hi"},
        api="chat",
        tokens=17,
        encoding="o200k_base",
        response_id="resp_9",
        role="output",
    )
    await store.create_thread("acme", "t1", kind="chat", items=[item], now=T0)
    stored = await store.get_item("acme", "t1", "m1")
    assert stored is not None
    assert (stored.tokens, stored.encoding, stored.api) == (17, "o200k_base", "chat")
    assert (stored.response_id, stored.role, stored.created_at, stored.seq) == (
        "resp_9",
        "output",
        T0,
        0,
    )


async def test_each_item_digest_is_stored_beside_its_count(store: Store) -> None:
    given = new_item("m1", tokens=5, encoding="o200k_base", digest="d" * 64)
    await store.create_thread("acme", "t1", kind="conversation", items=[given], now=T0)
    await store.append_items("acme", "t1", [new_item("m2")], now=T1)  # digest computed
    window = await store.load_window("acme", "t1")
    assert window is not None
    assert [i.digest for i in window.items] == ["d" * 64, content_digest(message("m2"))]
    await store.fork_thread("acme", "t1", "t2", through_seq=1, now=T2)
    forked = await store.items_between("acme", "t2", 0, 1)
    assert [i.digest for i in forked] == [i.digest for i in window.items]


async def test_load_window_from_seq_reads_only_what_is_new(store: Store) -> None:
    await thread_with(store, "a", "b", "c")
    window = await store.load_window("acme", "t1", from_seq=1)
    assert window is not None and ids_of(window.items) == ["b", "c"]
    await store.append_items("acme", "t1", items("d"), state={"window_start": 3}, now=T1)
    later = await store.load_window("acme", "t1", from_seq=1)  # the window start wins
    assert later is not None and ids_of(later.items) == ["d"]
    past_end = await store.load_window("acme", "t1", from_seq=4)
    assert past_end is not None and past_end.items == () and past_end.thread.next_seq == 4


async def test_deleting_an_item_bumps_the_epoch_and_the_version(store: Store) -> None:
    """A turn that read the thread before the delete commits its state (a cut that may
    quote the item) at the old version: it loses the race and commits again."""
    await thread_with(store, "a", "b")
    before = await store.get_thread("acme", "t1")
    assert before is not None and before.epoch == 0
    assert await store.delete_item("acme", "t1", "a")
    assert not await store.delete_item("acme", "t1", "a")
    after = await store.get_thread("acme", "t1")
    assert after is not None and (after.epoch, after.version) == (1, before.version + 1)
    with pytest.raises(VersionConflict):
        await store.commit_turn(
            "acme", "t1", expected_version=before.version, items=[], state={}, now=T0
        )


async def test_deleting_an_item_drops_the_threads_cut(store: Store) -> None:
    """The cut's summary may quote the item: the thread is projected again from its log,
    and the explain records that showed the summary go. What else the state holds
    stays."""
    await thread_with(store, "a", "b")
    state = {
        "window_start": 1,
        "summary": [{"api": "chat", "raw": {"role": "system", "content": "quotes a"}}],
        "compressed": [],
        "other": 1,
    }
    await store.append_items("acme", "t1", [], state=state, now=T0)
    await store.explain_put([explain_record("req_a", T0, "t1"), explain_record("req_b", T0, "t2")])
    assert await store.delete_item("acme", "t1", "a")
    after = await store.get_thread("acme", "t1")
    assert after is not None and after.state == {"other": 1}
    assert await store.explain_get("acme", "req_a") is None  # it showed that summary
    assert await store.explain_get("acme", "req_b") is not None


async def migrate_below(conn: Any, store: SqlStore, version: int) -> list[int]:
    """The migrations before `version` applied and recorded, as a database made then;
    the versions left for `migrate` to apply."""
    await conn.execute(CREATE_SCHEMA_VERSION)
    later = []
    for migration in load_migrations(store.db.dialect):
        if migration.version >= version:
            later.append(migration.version)
            continue
        for statement in migration.statements:
            await conn.execute(statement)
        await conn.execute(RECORD_VERSION, migration.version, migration.name, T0)
    return later


async def test_item_digest_migration_keeps_older_rows_readable(backend: Backend) -> None:
    store = await backend.open()
    assert isinstance(store, SqlStore)
    async with store.db.write() as conn:  # a database created before migration 005
        later = await migrate_below(conn, store, 5)
        await conn.execute(
            "INSERT INTO threads (tenant, id, kind, created_at, next_seq) "
            "VALUES ('acme', 't1', 'conversation', $1, 1)",
            T0,
        )
        await conn.execute(
            "INSERT INTO items (tenant, thread_id, seq, item_id, raw, api, tokens, encoding, "
            "role, created_at) VALUES ('acme', 't1', 0, 'm_old', $1, 'responses', 7, "
            "'o200k_base', 'input', $2)",
            json.dumps(message("old")),
            T0,
        )

    assert await migrate(store.db) == later
    window = await store.load_window("acme", "t1")
    assert window is not None
    [old] = window.items
    assert (old.digest, old.tokens) == (content_digest(message("old")), 7)


async def test_item_id_migration_keeps_items_and_their_keys(backend: Backend) -> None:
    store = await backend.open()
    assert isinstance(store, SqlStore)
    async with store.db.write() as conn:  # a database created before migration 016
        later = await migrate_below(conn, store, 16)
    await thread_with(store, "a", "b")
    await store.fork_thread("acme", "t1", "t2", through_seq=1, now=T1)  # the same ids
    assert await migrate(store.db) == later

    window = await store.load_window("acme", "t2")
    assert window is not None and ids_of(window.items) == ["a", "b"]
    assert window.items[1].digest == content_digest(new_item("b").raw)
    found = await store.find_item("acme", "b")
    assert found is not None and found.item_id == "b"
    with pytest.raises(AlreadyExists):  # ids stay unique within a thread
        await store.append_items("acme", "t1", items("a"), now=T2)
    await store.append_items("acme", "t1", items("c"), now=T2)
    assert await store.get_item("acme", "t2", "c") is None
    assert await store.delete_item("acme", "t1", "a")
    assert await store.get_item("acme", "t1", "a") is None
    assert await store.get_item("acme", "t2", "a") is not None


async def test_stale_version_conflicts_and_writes_nothing(store: Store) -> None:
    await thread_with(store, "a")
    await store.append_items("acme", "t1", items("b"), expected_version=0, now=T1)
    with pytest.raises(VersionConflict):
        await store.append_items(
            "acme", "t1", items("c"), expected_version=0, state={"window_start": 1}, now=T2
        )
    await store.begin_response(response("resp_1"))
    with pytest.raises(VersionConflict):
        await store.commit_turn(
            "acme",
            "t1",
            expected_version=0,
            items=items("d"),
            state={"x": 1},
            now=T2,
            response_id="resp_1",
            response={"id": "resp_1"},
        )
    thread = await store.get_thread("acme", "t1")
    assert thread is not None and (thread.version, thread.next_seq, thread.state) == (1, 2, {})
    assert await store.get_item("acme", "t1", "c") is None
    assert await store.get_item("acme", "t1", "d") is None
    stored = await store.get_response("acme", "resp_1")
    assert stored is not None and stored.status == "in_progress" and stored.response is None


async def test_items_between_get_and_delete_item(store: Store) -> None:
    await thread_with(store, "a", "b", "c", "d")
    assert ids_of(await store.items_between("acme", "t1", 1, 2)) == ["b", "c"]
    assert await store.delete_item("acme", "t1", "b") is True
    assert await store.delete_item("acme", "t1", "b") is False
    assert ids_of(await store.items_between("acme", "t1", 0, 3)) == ["a", "c", "d"]
    thread = await store.append_items("acme", "t1", items("e"), now=T1)
    assert thread.next_seq == 5  # a seq gap is fine, seqs are never reused


async def cancelled_appends(store: Store, count: int) -> None:
    """`count` appends to acme's t1, each cancelled at a later point of its transaction."""
    for steps in range(count):
        task = asyncio.create_task(store.append_items("acme", "t1", items(f"c{steps}"), now=T1))
        for _ in range(steps):
            await asyncio.sleep(0)
        task.cancel()
        with suppress(asyncio.CancelledError):
            await task


async def test_a_cancelled_write_leaves_the_store_consistent(store: Store) -> None:
    await thread_with(store, "a")
    await cancelled_appends(store, 6)  # cancel at different points of the transaction
    thread = await store.append_items("acme", "t1", items("z"), now=T2)
    window = await store.load_window("acme", "t1")
    assert window is not None
    # every append either happened whole (one item, one version) or not at all
    assert [i.seq for i in window.items] == list(range(thread.next_seq))
    assert thread.version == thread.next_seq - 1
    assert ids_of(window.items)[-1] == "z"


# pagination --------------------------------------------------------------------------


async def test_list_items_desc_by_default_with_cursor(store: Store) -> None:
    await thread_with(store, "a", "b", "c", "d", "e")
    first = await store.list_items("acme", "t1", limit=2)
    assert (ids_of(first.items), first.has_more) == (["e", "d"], True)
    second = await store.list_items("acme", "t1", after="d", limit=2)
    assert (ids_of(second.items), second.has_more) == (["c", "b"], True)
    last = await store.list_items("acme", "t1", after="b", limit=2)
    assert (ids_of(last.items), last.has_more) == (["a"], False)


async def test_list_items_asc(store: Store) -> None:
    await thread_with(store, "a", "b", "c")
    page = await store.list_items("acme", "t1", order="asc")
    assert (ids_of(page.items), page.has_more) == (["a", "b", "c"], False)
    page = await store.list_items("acme", "t1", order="asc", after="a", limit=1)
    assert (ids_of(page.items), page.has_more) == (["b"], True)
    page = await store.list_items("acme", "t1", order="asc", after="b", limit=1)
    assert (ids_of(page.items), page.has_more) == (["c"], False)


async def test_list_items_errors(store: Store) -> None:
    await thread_with(store, "a")
    with pytest.raises(NotFound):
        await store.list_items("acme", "t1", after="zzz")
    with pytest.raises(NotFound):
        await store.list_items("acme", "missing")
    for limit in (0, 101):
        with pytest.raises(ValueError):
            await store.list_items("acme", "t1", limit=limit)
    empty = await store.fork_thread("acme", "t1", "t2", through_seq=-1, now=T1)
    page = await store.list_items("acme", empty.id)
    assert (page.items, page.has_more) == ((), False)


# responses ---------------------------------------------------------------------------


async def test_commit_turn_is_one_unit(store: Store) -> None:
    await thread_with(store, "a")
    await store.begin_response(response("resp_1"))
    turn = [new_item("in_1"), new_item("out_1", role="output"), new_item("out_2", role="output")]
    final = {"id": "resp_1", "object": "response", "status": "completed", "output": []}
    thread = await store.commit_turn(
        "acme",
        "t1",
        expected_version=0,
        items=turn,
        state={"window_start": 0, "summary": []},
        now=T1,
        response_id="resp_1",
        response=final,
    )
    assert (thread.version, thread.next_seq, thread.head_response_id) == (1, 4, "resp_1")
    assert thread.state == {"window_start": 0, "summary": []}
    stored = await store.get_response("acme", "resp_1")
    assert stored is not None
    assert (stored.status, stored.response) == ("completed", final)
    assert (stored.input_first_seq, stored.output_last_seq) == (1, 3)
    between = await store.items_between("acme", "t1", 1, 3)
    assert ids_of(between) == ["in_1", "out_1", "out_2"]
    assert {item.response_id for item in between} == {"resp_1"}
    assert await store.get_thread("acme", "t1") == thread


async def test_commit_turn_for_unknown_response_writes_nothing(store: Store) -> None:
    await thread_with(store, "a")
    with pytest.raises(NotFound):
        await store.commit_turn(
            "acme",
            "t1",
            expected_version=0,
            items=items("b"),
            state={},
            now=T1,
            response_id="resp_missing",
        )
    thread = await store.get_thread("acme", "t1")
    assert thread is not None and (thread.version, thread.next_seq) == (0, 1)


async def test_response_lifecycle(store: Store) -> None:
    await store.begin_response(response("resp_1", thread_id=None))
    with pytest.raises(AlreadyExists):
        await store.begin_response(response("resp_1", thread_id=None))
    stored = await store.get_response("acme", "resp_1")
    assert stored == response("resp_1", thread_id=None)

    await store.finish_response("acme", "resp_1", status="completed", response={"id": "resp_1"})
    stored = await store.get_response("acme", "resp_1")
    assert stored is not None and (stored.status, stored.response) == (
        "completed",
        {"id": "resp_1"},
    )

    assert await store.delete_response("acme", "resp_1") is True
    assert await store.get_response("acme", "resp_1") is None
    assert await store.delete_response("acme", "resp_1") is False
    with pytest.raises(NotFound):
        await store.finish_response("acme", "resp_1", status="failed", response=None)


async def test_find_responses_looks_in_every_tenant(store: Store) -> None:
    await store.begin_response(response("resp_1", tenant="beta"))
    await store.begin_response(response("resp_1", tenant="acme", thread_id=None))
    await store.begin_response(response("resp_2"))
    found = await store.find_responses("resp_1")
    assert [(r.tenant, r.thread_id) for r in found] == [("acme", None), ("beta", "t1")]
    assert [r.tenant for r in await store.find_responses("resp_1", limit=1)] == ["acme"]
    assert await store.find_responses("resp_9") == ()


async def test_abandon_dead_spares_live_owners(store: Store) -> None:
    await store.heartbeat("live", T2)
    await store.heartbeat("stale", T0)
    await store.begin_response(response("r_live", owner="live"))
    await store.begin_response(response("r_stale", owner="stale"))
    await store.begin_response(response("r_unknown", owner="never_beat", tenant="other"))

    assert await store.abandon_dead(T1, except_owner="me") == 2
    assert await status_of(store, "acme", "r_live") == "in_progress"
    assert await status_of(store, "acme", "r_stale") == "incomplete"
    assert await status_of(store, "other", "r_unknown") == "incomplete"
    assert await store.abandon_dead(T1, except_owner="me") == 0


async def test_abandon_dead_never_touches_the_caller(store: Store) -> None:
    await store.heartbeat("me", T0)
    await store.begin_response(response("r_mine", owner="me"))
    await store.begin_response(response("r_silent", owner="silent"))

    assert await store.abandon_dead(T3, except_owner="me") == 1
    assert await status_of(store, "acme", "r_mine") == "in_progress"
    assert await status_of(store, "acme", "r_silent") == "incomplete"


async def test_a_heartbeat_at_the_cutoff_is_alive_and_later_beats_refresh(store: Store) -> None:
    await store.heartbeat("p1", T0)
    await store.heartbeat("p1", T2)  # the upsert moves the heartbeat forward
    await store.begin_response(response("r1", owner="p1"))
    assert await store.abandon_dead(T2, except_owner="me") == 0
    assert await store.abandon_dead(T3, except_owner="me") == 1


async def test_heartbeats_keep_host_and_pid_and_move_the_time(store: Store) -> None:
    await store.heartbeat("p1", T0, host="h1", pid=41)
    await store.heartbeat("p2", T1)
    await store.heartbeat("p1", T2, host="h9", pid=99)  # identity is fixed at the first beat
    assert await store.heartbeats() == (
        Heartbeat(owner="p1", host="h1", pid=41, started_at=T0, heartbeat_at=T2),
        Heartbeat(owner="p2", host="", pid=0, started_at=T1, heartbeat_at=T1),
    )
    await store.retire("p2")
    assert [beat.owner for beat in await store.heartbeats()] == ["p1"]


async def test_abandon_dead_removes_stale_owners_who_may_beat_again(store: Store) -> None:
    await store.heartbeat("p1", T0)
    await store.heartbeat("me", T0)
    await store.abandon_dead(T1, except_owner="me")
    assert [beat.owner for beat in await store.heartbeats()] == ["me"]
    await store.heartbeat("p1", T2)  # a paused replica resumes: its row comes back
    await store.begin_response(response("r1", owner="p1"))
    assert await store.abandon_dead(T1, except_owner="me") == 0
    assert await status_of(store, "acme", "r1") == "in_progress"


async def test_retire_ends_own_responses_and_forgets_the_owner(store: Store) -> None:
    await store.heartbeat("p1", T3)
    await store.heartbeat("p2", T3)
    await store.begin_response(response("r1", owner="p1"))
    await store.begin_response(response("r2", owner="p2"))

    assert await store.retire("p1") == 1
    assert await status_of(store, "acme", "r1") == "incomplete"
    assert await status_of(store, "acme", "r2") == "in_progress"
    await store.begin_response(response("r3", owner="p1"))  # p1 has no heartbeat row now
    assert await store.abandon_dead(T0, except_owner="me") == 1
    assert await status_of(store, "acme", "r3") == "incomplete"
    assert await status_of(store, "acme", "r2") == "in_progress"


async def test_owners_migration_applies_on_a_database_at_version_1(backend: Backend) -> None:
    store = await backend.open()
    assert isinstance(store, SqlStore)
    first, *later = load_migrations(store.db.dialect)
    async with store.db.write() as conn:  # a database created before migration 002
        await conn.execute(CREATE_SCHEMA_VERSION)
        for statement in first.statements:
            await conn.execute(statement)
        await conn.execute(RECORD_VERSION, first.version, first.name, T0)
        # A row as that version held it (begin_response writes the columns of today).
        await conn.execute(
            "INSERT INTO responses (tenant, id, thread_id, status, request, created_at, owner)"
            " VALUES ($1, $2, $3, $4, $5, $6, $7)",
            *("acme", "r_old", "t1", "in_progress", "{}", T0, "proc_before_upgrade"),
        )

    assert await migrate(store.db) == [migration.version for migration in later]
    assert await migrate(store.db) == []
    assert await status_of(store, "acme", "r_old") == "in_progress"
    assert await store.abandon_dead(T0, except_owner="me") == 1
    assert await status_of(store, "acme", "r_old") == "incomplete"


async def test_abandon_dead_frees_the_running_keys_of_dead_owners_only(store: Store) -> None:
    await store.heartbeat("live", T2)
    await store.heartbeat("stale", T0)
    await store.heartbeat("me", T0)
    await store.begin_response(response("r_stale", owner="stale"))
    for key, owner in [("k_live", "live"), ("k_stale", "stale"), ("k_mine", "me")]:
        await store.idempotency_begin(idem(key, owner=owner))
    await store.idempotency_begin(idem("k_never", owner="never_beat", tenant="other"))
    await store.idempotency_begin(idem("k_unknown"))  # no owner: left to expire
    await store.idempotency_begin(idem("k_done", owner="stale"))
    await store.idempotency_finish("acme", "k_done", status=200, headers=[], body=b"{}")

    assert await store.abandon_dead(T1, except_owner="me") == 1  # still counts responses
    assert await holder(store, "k_live") == "live"
    assert await holder(store, "k_stale") is None
    assert await holder(store, "k_never", tenant="other") is None
    assert await holder(store, "k_mine") == "me"
    assert await holder(store, "k_unknown") == ""
    assert await holder(store, "k_done") == "stale"


async def test_retire_frees_its_own_running_keys_and_keeps_done_ones(store: Store) -> None:
    await store.heartbeat("p1", T3)
    await store.heartbeat("p2", T3)
    await store.idempotency_begin(idem("k1", owner="p1"))
    await store.idempotency_begin(idem("k2", owner="p2"))
    await store.idempotency_begin(idem("k3", owner="p1"))
    await store.idempotency_finish("acme", "k3", status=201, headers=[], body=b"")

    assert await store.retire("p1") == 0
    assert await holder(store, "k1") is None
    assert await holder(store, "k2") == "p2"
    assert await holder(store, "k3") == "p1"


async def test_idempotency_owner_migration_keeps_older_records(backend: Backend) -> None:
    store = await backend.open()
    assert isinstance(store, SqlStore)
    async with store.db.write() as conn:  # a database created before migration 003
        later = await migrate_below(conn, store, 3)
        await conn.execute(
            "INSERT INTO idempotency (tenant, key, fingerprint, status, created_at, expires_at) "
            "VALUES ('acme', 'k_old', 'fp1', 'running', $1, $2)",
            T0,
            T2,
        )

    assert await migrate(store.db) == later
    assert await store.abandon_dead(T3, except_owner="me") == 0
    assert await holder(store, "k_old") == ""  # unknown owner: kept until it expires


# forks -------------------------------------------------------------------------------


async def test_fork_copies_through_seq_and_stays_isolated(store: Store) -> None:
    await store.create_thread(
        "acme", "t1", kind="responses", metadata={"m": "1"}, items=items("a", "b", "c"), now=T0
    )
    await store.append_items("acme", "t1", [], state={"window_start": 1}, now=T1)
    fork = await store.fork_thread("acme", "t1", "t2", through_seq=1, now=T2)
    assert (fork.kind, dict(fork.metadata), fork.version, fork.state) == (
        "responses",
        {"m": "1"},
        0,
        {},
    )
    assert (fork.next_seq, fork.created_at) == (2, T2)
    forked = await store.load_window("acme", "t2")
    assert forked is not None
    assert [(i.seq, i.item_id) for i in forked.items] == [(0, "a"), (1, "b")]

    await store.append_items("acme", "t2", items("x"), now=T3)
    await store.append_items("acme", "t1", items("y"), now=T3)
    await store.delete_item("acme", "t2", "a")
    assert ids_of(await store.items_between("acme", "t1", 0, 10)) == ["a", "b", "c", "y"]
    assert ids_of(await store.items_between("acme", "t2", 0, 10)) == ["b", "x"]
    assert [i.seq for i in await store.items_between("acme", "t2", 0, 10)] == [1, 2]

    await store.delete_thread("acme", "t1")
    assert ids_of(await store.items_between("acme", "t2", 0, 10)) == ["b", "x"]


async def test_fork_errors(store: Store) -> None:
    await thread_with(store, "a")
    with pytest.raises(NotFound):
        await store.fork_thread("acme", "missing", "t2", through_seq=0, now=T1)
    with pytest.raises(AlreadyExists):
        await store.fork_thread("acme", "t1", "t1", through_seq=0, now=T1)


# side-effect ledger ------------------------------------------------------------------


async def test_ledger_first_write_wins(store: Store) -> None:
    first, created = await store.ledger_issue(ledger_entry(call_id="call_1"))
    assert created and first == ledger_entry(call_id="call_1")
    second, created = await store.ledger_issue(ledger_entry(call_id="call_2"))
    assert not created and second.call_id == "call_1"
    assert await store.ledger_get("acme", "tenant", "refund:42") == first
    assert await store.ledger_by_call("acme", "call_1") == first
    assert await store.ledger_by_call("acme", "call_2") is None


async def test_ledger_resolve_is_conditional(store: Store) -> None:
    await store.ledger_issue(ledger_entry())
    assert await store.ledger_resolve(
        "acme", "tenant", "refund:42", status="completed", result='{"ok":true}', now=T1
    )
    assert not await store.ledger_resolve(
        "acme", "tenant", "refund:42", status="failed", result="boom", now=T2
    )
    entry = await store.ledger_get("acme", "tenant", "refund:42")
    assert entry is not None
    assert (entry.status, entry.result, entry.updated_at) == ("completed", '{"ok":true}', T1)
    assert await store.ledger_resolve(
        "acme", "tenant", "refund:42", status="failed", result="x", now=T2, only_if="completed"
    )
    assert not await store.ledger_resolve(
        "acme", "tenant", "missing", status="completed", result=None, now=T2
    )


async def test_ledger_rearm_only_a_failed_entry_once(store: Store) -> None:
    await store.ledger_issue(ledger_entry(call_id="call_1"))
    assert not await store.ledger_rearm("acme", "tenant", "refund:42", call_id="call_2", now=T1)
    await store.ledger_resolve("acme", "tenant", "refund:42", status="failed", result="x", now=T1)
    assert await store.ledger_rearm("acme", "tenant", "refund:42", call_id="call_2", now=T2)
    assert not await store.ledger_rearm("acme", "tenant", "refund:42", call_id="call_3", now=T2)
    entry = await store.ledger_get("acme", "tenant", "refund:42")
    assert entry is not None
    assert (entry.status, entry.call_id, entry.result, entry.attempts, entry.updated_at) == (
        "issued",
        "call_2",
        None,
        2,
        T2,
    )
    assert await store.ledger_by_call("acme", "call_2") == entry
    assert not await store.ledger_rearm("other", "tenant", "refund:42", call_id="c", now=T2)


async def test_ledger_list_filters_by_status(store: Store) -> None:
    await store.ledger_issue(ledger_entry("k1", call_id="c1"))
    await store.ledger_issue(ledger_entry("k2", call_id="c2"))
    await store.ledger_resolve("acme", "tenant", "k2", status="completed", result="r", now=T1)
    assert [e.key for e in await store.ledger_list("acme")] == ["k1", "k2"]
    assert [e.key for e in await store.ledger_list("acme", status="issued")] == ["k1"]
    assert [e.key for e in await store.ledger_list("acme", status="completed")] == ["k2"]
    assert len(await store.ledger_list("acme", limit=1)) == 1


# Namespaces a tenant filter takes in with callers=True (proxy/namespaces.py): the tenant's
# own and `<tenant>:<hash>`, not a tenant whose id merely starts alike ("_" is no wildcard).
NAMESPACES = ("de_ault", "de_ault:c1", "de_ault:c2", "default:c3", "de_ault2", "de_aultx:c4")


async def test_listings_take_in_a_tenants_passthrough_callers(store: Store) -> None:
    for n, tenant in enumerate(NAMESPACES):
        await thread_with(store, f"i{n}", tenant=tenant, tid=f"t{n}")
        await store.ledger_issue(ledger_entry(f"k{n}", call_id=f"c{n}", tenant=tenant))
    await store.ledger_resolve("de_ault:c2", "tenant", "k2", status="completed", result="r", now=T1)
    wanted = {"de_ault", "de_ault:c1", "de_ault:c2"}
    threads = await store.list_threads("de_ault", limit=10, callers=True)
    assert {t.tenant for t in threads} == wanted
    assert [t.tenant for t in await store.list_threads("de_ault", limit=10)] == ["de_ault"]
    assert {e.tenant for e in await store.ledger_list("de_ault", callers=True)} == wanted
    issued = await store.ledger_list("de_ault", status="issued", callers=True)
    assert {e.tenant for e in issued} == {"de_ault", "de_ault:c1"}
    assert [e.tenant for e in await store.ledger_list("de_ault")] == ["de_ault"]
    await store.begin_response(response("resp_1", tenant="de_ault:c9", thread_id=None))
    assert await store.namespaces("de_ault", limit=10) == (*sorted(wanted), "de_ault:c9")
    assert await store.namespaces("de_ault", limit=2) == ("de_ault", "de_ault:c1")


# explain records ---------------------------------------------------------------------


def explain_record(request_id: str, created: str, thread: str | None, tenant: str = "acme"):  # type: ignore[no-untyped-def]
    record = {"id": request_id, **({"thread_id": thread} if thread else {})}
    return ExplainRow(tenant, request_id, created, thread, json.dumps(record))


async def test_explain_key_migration_keeps_records_and_their_lookups(backend: Backend) -> None:
    store = await backend.open()
    assert isinstance(store, SqlStore)
    async with store.db.write() as conn:  # a database created before migration 017
        later = await migrate_below(conn, store, 17)
    await store.explain_put(
        [
            explain_record("req_a", T0, "t1"),
            explain_record("req_b", T1, "t1"),
            explain_record("req_b", T1, None, tenant="other"),
        ]
    )
    assert await migrate(store.db) == later

    found = await store.explain_get(None, "req_a")
    assert found is not None and (found.tenant, found.record) == (
        "acme",
        {"id": "req_a", "thread_id": "t1"},
    )
    assert await store.explain_get(None, "req_b") is None  # two tenants hold it
    other = await store.explain_get("other", "req_b")
    assert other is not None and other.record == {"id": "req_b"}
    listed = await store.explain_for_thread("acme", "t1", limit=10)
    assert [r.request_id for r in listed] == ["req_b", "req_a"]
    await store.explain_put([explain_record("req_a", T2, "t2")])  # the first write wins
    kept = await store.explain_get("acme", "req_a")
    assert kept is not None and kept.created_at == T0
    assert await store.explain_purge(T1) == 1


async def test_explain_for_thread_lists_the_threads_records_newest_first(store: Store) -> None:
    await store.explain_put(
        [
            explain_record("req_a", T0, "t1"),
            explain_record("req_b", T2, "t1"),
            explain_record("req_c", T1, "t2"),
            explain_record("req_d", T3, None),
            explain_record("req_e", T3, "t1", tenant="other"),
        ]
    )
    found = await store.explain_for_thread("acme", "t1", limit=10)
    assert [(r.request_id, r.created_at) for r in found] == [("req_b", T2), ("req_a", T0)]
    assert found[0].record == {"id": "req_b", "thread_id": "t1"}
    assert [r.request_id for r in await store.explain_for_thread("acme", "t1", limit=1)] == [
        "req_b"
    ]
    assert await store.explain_for_thread("acme", "t9", limit=10) == ()
    await store.explain_purge(T1)
    assert [r.request_id for r in await store.explain_for_thread("acme", "t1", limit=10)] == [
        "req_b"
    ]


async def test_deleting_a_thread_deletes_its_explain_records(store: Store) -> None:
    """They quote its summaries and compressed tool results: they go with it."""
    await store.create_thread("acme", "t1", kind="chat", now=T0)
    await store.explain_put(
        [
            explain_record("req_a", T0, "t1"),
            explain_record("req_b", T1, "t2"),
            explain_record("req_c", T1, "t1", tenant="other"),
        ]
    )
    assert await store.delete_thread("acme", "t1")
    assert await store.explain_get("acme", "req_a") is None
    assert await store.explain_get("acme", "req_b") is not None
    assert await store.explain_get("other", "req_c") is not None


# request idempotency -----------------------------------------------------------------


async def test_idempotency_begin_finish_replay(store: Store) -> None:
    assert await store.idempotency_begin(idem()) is None
    running = await store.idempotency_begin(idem(fingerprint="fp2", created=T1))
    assert running is not None and (running.status, running.fingerprint) == ("running", "fp1")

    headers = [("content-type", "application/json"), ("x-request-id", "req_1")]
    await store.idempotency_finish("acme", "k1", status=200, headers=headers, body=b'{"id":1}\x00')
    done = await store.idempotency_begin(idem(created=T1))
    assert done is not None
    assert (done.status, done.response_status, done.response_body) == ("done", 200, b'{"id":1}\x00')
    assert list(done.response_headers) == headers
    assert (done.created_at, done.expires_at) == (T0, T2)


async def test_idempotency_abort_frees_the_key(store: Store) -> None:
    await store.idempotency_begin(idem())
    await store.idempotency_abort("acme", "k1")
    assert await store.idempotency_begin(idem(fingerprint="fp2")) is None
    await store.idempotency_finish("acme", "k1", status=201, headers=[], body=b"")
    await store.idempotency_abort("acme", "k1")  # a finished record is kept
    kept = await store.idempotency_begin(idem())
    assert kept is not None and (kept.fingerprint, kept.status) == ("fp2", "done")


async def test_idempotency_expired_record_is_replaced(store: Store) -> None:
    await store.idempotency_begin(idem(created=T0, expires=T1))
    await store.idempotency_finish("acme", "k1", status=200, headers=[], body=b"old")
    assert await store.idempotency_begin(idem(created=T2, expires=T3, fingerprint="new")) is None
    current = await store.idempotency_begin(idem(created=T2, expires=T3))
    assert current is not None
    assert (current.fingerprint, current.status, current.response_body) == ("new", "running", None)


async def test_idempotency_purge(store: Store) -> None:
    await store.idempotency_begin(idem("old", created=T0, expires=T1))
    await store.idempotency_begin(idem("new", created=T0, expires=T3))
    assert await store.idempotency_purge(T2) == 1
    assert await store.idempotency_begin(idem("old", created=T0, expires=T1)) is None
    assert (await store.idempotency_begin(idem("new"))) is not None


async def test_ping(store: Store) -> None:
    await store.ping()


# -- LLM summaries (migration 006) ---------------------------------------------------------


def summary(digest: str, text: str = "a summary", **fields: Any) -> StoredSummary:
    values: dict[str, Any] = {
        "tenant": "acme",
        "model": "gpt-4o-mini",
        "api": "chat",
        "digest": digest,
        "raw": {"role": "system", "content": text},
        "state": {"constraints": ["Never refund twice — ünïcode kept"]},
        "created_at": T0,
    }
    values.update(fields)
    return StoredSummary(**values)


async def test_summary_round_trips_and_first_write_wins(store: Store) -> None:
    first = summary("d1", "first")
    assert await store.summary_put(first) is True
    assert await store.summary_put(summary("d1", "second", created_at=T1)) is False
    assert await store.summaries_get("acme", "gpt-4o-mini", "chat", ["d1"]) == {"d1": first}
    no_state = summary("d2", state=None)
    assert await store.summary_put(no_state) is True
    found = await store.summaries_get("acme", "gpt-4o-mini", "chat", ["d2", "d1", "d1", "nope"])
    assert found == {"d1": first, "d2": no_state}
    assert await store.summaries_get("acme", "gpt-4o-mini", "chat", []) == {}


async def test_summaries_are_keyed_by_tenant_model_and_api(store: Store) -> None:
    await store.summary_put(summary("d1"))
    assert await store.summaries_get("other", "gpt-4o-mini", "chat", ["d1"]) == {}
    assert await store.summaries_get("acme", "gpt-4o", "chat", ["d1"]) == {}
    assert await store.summaries_get("acme", "gpt-4o-mini", "responses", ["d1"]) == {}
    other = summary("d1", "theirs", tenant="other")
    assert await store.summary_put(other) is True  # another tenant's row, not a conflict
    assert await store.summaries_get("other", "gpt-4o-mini", "chat", ["d1"]) == {"d1": other}


async def test_summaries_get_reads_a_bounded_number_of_digests(store: Store) -> None:
    digests = [f"d{n}" for n in range(MAX_SUMMARY_DIGESTS)]
    for digest in digests[:3]:
        await store.summary_put(summary(digest))
    found = await store.summaries_get("acme", "gpt-4o-mini", "chat", digests)
    assert sorted(found) == ["d0", "d1", "d2"]
    with pytest.raises(ValueError, match="at most"):
        await store.summaries_get("acme", "gpt-4o-mini", "chat", [*digests, "one more"])


# -- summaries kept for threads, and their retention (migration 010) -----------------------

SUMMARY_KEY = ("acme", "gpt-4o-mini", "chat")


async def digests_stored(store: Store, tenant: str = "acme") -> list[str]:
    found = await store.summaries_get(tenant, "gpt-4o-mini", "chat", ["d1", "d2", "d3"])
    return sorted(found)


async def test_a_summary_goes_with_the_last_thread_it_was_kept_for(store: Store) -> None:
    await thread_with(store, "m1", tid="t1")
    await thread_with(store, "m1", tid="t2")  # the same history: the same chunk digests
    assert await store.summary_put(summary("d1"), thread_id="t1") is True
    assert await store.summary_put(summary("d2"), thread_id="t1") is True
    assert await store.summary_put(summary("d2"), thread_id="t2") is False  # kept for t2 too
    assert await store.summary_put(summary("d3")) is True  # a stateless request's
    assert await store.delete_thread("acme", "t1") is True
    assert await digests_stored(store) == ["d2", "d3"]
    assert await store.delete_thread("acme", "t2") is True
    assert await digests_stored(store) == ["d3"]  # left to the retention


async def test_a_stored_summary_kept_for_a_thread_later_goes_with_it(store: Store) -> None:
    await thread_with(store, "m1", tid="t1")
    await store.summary_put(summary("d1"))  # a stateless request wrote it first
    assert await store.summary_put(summary("d1", "other text"), thread_id="t1") is False
    assert await store.delete_thread("acme", "t1") is True
    assert await digests_stored(store) == []


async def test_a_summary_for_a_thread_that_is_gone_is_not_written(store: Store) -> None:
    assert await store.summary_put(summary("d1"), thread_id="deleted") is False
    await thread_with(store, "m1", tid="t1")
    await store.delete_thread("acme", "t1")
    assert await store.summary_put(summary("d1"), thread_id="t1") is False
    assert await digests_stored(store) == []


async def test_deleting_a_thread_keeps_other_tenants_summaries(store: Store) -> None:
    await thread_with(store, "m1", tid="t1")
    await thread_with(store, "m1", tid="t1", tenant="other")
    await store.summary_put(summary("d1"), thread_id="t1")
    await store.summary_put(summary("d1", tenant="other"), thread_id="t1")
    await store.delete_thread("other", "t1")
    assert await digests_stored(store, "other") == []
    assert await digests_stored(store) == ["d1"]


async def test_deleting_an_item_deletes_the_summaries_only_its_thread_kept(
    store: Store,
) -> None:
    """A summary may quote the deleted item; the thread's next cut writes a new one."""
    await thread_with(store, "m1", "m2", tid="t1")
    await thread_with(store, "m1", tid="t2")
    await store.summary_put(summary("d1"), thread_id="t1")
    await store.summary_put(summary("d2"), thread_id="t1")
    await store.summary_put(summary("d2"), thread_id="t2")
    assert await store.delete_item("acme", "t1", "nope") is False
    assert await digests_stored(store) == ["d1", "d2"]
    assert await store.delete_item("acme", "t1", "m2") is True
    assert await digests_stored(store) == ["d2"]
    await store.delete_thread("acme", "t2")  # t1 no longer keeps d2
    assert await digests_stored(store) == []


async def test_summaries_purge_removes_the_ones_unused_since(store: Store) -> None:
    await thread_with(store, "m1", tid="t1")
    await store.summary_put(summary("d1", created_at=T0), thread_id="t1")
    await store.summary_put(summary("d2", created_at=T0))
    await store.summary_put(summary("d3", created_at=T2))
    await store.summaries_touch([(*SUMMARY_KEY, "d2"), (*SUMMARY_KEY, "gone")], T2)
    await store.summaries_touch([(*SUMMARY_KEY, "d2")], T1)  # never moves back
    await store.summaries_touch([], T3)
    assert await store.summaries_purge(T2) == 1
    assert await digests_stored(store) == ["d2", "d3"]
    assert await store.summaries_purge(T3) == 2
    assert await digests_stored(store) == []
    # d1's link went with it: written again, it is kept for t1 alone, as new.
    assert await store.summary_put(summary("d1", created_at=T3), thread_id="t1") is True
    await store.delete_thread("acme", "t1")
    assert await digests_stored(store) == []


async def test_summaries_purge_removes_summaries_whose_threads_all_went(store: Store) -> None:
    """Two threads deleted at once can each see the other's link and keep the summary:
    the purge removes a summary kept for threads once none keeps it."""
    assert isinstance(store, SqlStore)
    await thread_with(store, "m1", tid="t1")
    await store.summary_put(summary("d1", created_at=T3), thread_id="t1")
    await store.summary_put(summary("d2", created_at=T3))
    async with store.db.write() as conn:  # what the two deletes leave behind
        await conn.execute("DELETE FROM summary_threads")
    assert await store.summaries_purge(T0) == 1
    assert await digests_stored(store) == ["d2"]


async def test_summary_migration_marks_older_summaries_used_when_written(
    backend: Backend,
) -> None:
    store = await backend.open()
    assert isinstance(store, SqlStore)
    async with store.db.write() as conn:  # a database created before migration 010
        later = await migrate_below(conn, store, 10)
        for digest, created in (("d1", T0), ("d2", T2)):
            await conn.execute(
                "INSERT INTO summaries (tenant, model, api, digest, raw, state, created_at) "
                "VALUES ('acme', 'gpt-4o-mini', 'chat', $1, '{}', NULL, $2)",
                digest,
                created,
            )
    assert await migrate(store.db) == later
    assert await store.summaries_purge(T1) == 1
    assert await digests_stored(store) == ["d2"]


async def test_summaries_keep_links_stored_summaries_to_a_live_thread(store: Store) -> None:
    await thread_with(store, "m1", tid="t1")
    await thread_with(store, "m1", tid="t2")
    await store.summary_put(summary("d1"), thread_id="t1")
    await store.summary_put(summary("d2"))  # a stateless request's
    await store.summaries_keep("acme", "t2", "gpt-4o-mini", "chat", ["d1", "d2", "nope"])
    await store.summaries_keep("acme", "gone", "gpt-4o-mini", "chat", ["d1"])  # no thread
    await store.summaries_keep("acme", "t2", "gpt-4o-mini", "chat", [])
    await store.delete_thread("acme", "t1")
    assert await digests_stored(store) == ["d1", "d2"]  # both kept for t2
    await store.delete_thread("acme", "t2")
    assert await digests_stored(store) == []
    with pytest.raises(ValueError, match="at most"):
        digests = [f"d{n}" for n in range(MAX_SUMMARY_DIGESTS + 1)]
        await store.summaries_keep("acme", "t1", "gpt-4o-mini", "chat", digests)


# -- inspector sessions (migration 011) ----------------------------------------------------


def inspector_session(id_hash: str, *, expires: str = T2, key: str = "k1") -> InspectorSession:
    return InspectorSession(id_hash, None, None, key, T0, expires)


async def test_an_inspector_session_round_trips_and_revoking_deletes_it(store: Store) -> None:
    tenant_session = InspectorSession("h2", "acme", "keyhash", "k1", T0, T3)
    await store.inspector_session_create(inspector_session("h1"))
    await store.inspector_session_create(tenant_session)
    with pytest.raises(AlreadyExists):
        await store.inspector_session_create(inspector_session("h1", expires=T3))
    assert await store.inspector_session_get("h1") == inspector_session("h1")
    assert await store.inspector_session_get("h2") == tenant_session
    assert await store.inspector_session_get("nope") is None
    assert await store.inspector_session_revoke("h1") is True
    assert await store.inspector_session_revoke("h1") is False
    assert await store.inspector_session_get("h1") is None
    assert await store.inspector_session_get("h2") == tenant_session


async def test_inspector_sessions_purge_the_expired_and_those_of_another_key(
    store: Store,
) -> None:
    await store.inspector_session_create(inspector_session("expired", expires=T1))
    await store.inspector_session_create(inspector_session("live", expires=T3))
    await store.inspector_session_create(inspector_session("old-token", expires=T3, key="k0"))
    assert await store.inspector_sessions_purge(now=T1) == 1
    assert await store.inspector_session_get("old-token") is not None
    await store.inspector_session_create(inspector_session("expired", expires=T1))
    assert await store.inspector_sessions_purge(now=T1, signing_key="k1") == 2
    assert await store.inspector_session_get("live") is not None
    assert await store.inspector_session_get("expired") is None
    assert await store.inspector_session_get("old-token") is None
    assert await store.inspector_sessions_purge(now=T1, signing_key="k1") == 0


# -- erasing a thread and the responses retention (migration 012) ---------------------------

MARK = "MARK-7f3a"  # the erased thread's words
KEEP = "KEEP-91bc"  # another thread's


async def thread_everywhere(store: Store, tid: str, word: str, *, tenant: str = "acme") -> None:
    """A thread whose `word` is in every table that derives from it."""
    raw = message(f"my card is {word}")
    await store.create_thread(
        tenant, tid, kind="conversation", items=[NewItem(f"m_{tid}", raw, "responses")], now=T0
    )
    thread = await store.get_thread(tenant, tid)
    assert thread is not None
    rid = f"resp_{tid}"
    await store.begin_response(replace(response(rid, tenant=tenant, thread_id=tid)))
    await store.commit_turn(
        tenant,
        tid,
        expected_version=thread.version,
        items=[NewItem(f"o_{tid}", message(f"noted {word}", "assistant"), "responses")],
        state={"summary": word},
        now=T1,
        response_id=rid,
        response={"id": rid, "output_text": f"noted {word}"},
    )
    for scope in ("tenant", f"thread:{tid}"):
        entry = replace(
            ledger_entry(f"refund:{word}:{scope}", call_id=f"call_{tid}", tenant=tenant),
            scope=scope,
            thread_id=tid,
            response_id=rid,
            arguments=f'{{"card": "{word}"}}',
        )
        await store.ledger_issue(entry)
    await store.idempotency_begin(idem(f"key_{tid}", tenant=tenant, expires=T3))
    body = f'{{"output_text": "noted {word}"}}'.encode()
    await store.idempotency_finish(
        tenant, f"key_{tid}", status=200, headers=[], body=body, thread_id=tid
    )
    await store.explain_put(
        [ExplainRow(tenant, f"req_{tid}", T1, tid, json.dumps({"thread_id": tid, "w": word}))]
    )
    await store.summary_put(summary(f"d_{tid}", word, tenant=tenant), thread_id=tid)


async def test_erase_removes_every_trace_of_the_thread_and_only_it(store: Store) -> None:
    from tests.store.dump import tables_holding

    await thread_everywhere(store, "t1", MARK)
    await thread_everywhere(store, "t2", KEEP)
    await thread_everywhere(store, "t1", KEEP, tenant="other")  # the same id, another tenant
    derived = {"items", "threads", "responses", "ledger", "idempotency", "explain_records"}
    assert derived | {"summaries"} <= set(await tables_holding(store, MARK))

    erased = await store.erase_thread("acme", "t1")
    assert erased == {
        "items": 2,
        "threads": 1,
        "summaries": 1,
        "response_events": 0,  # a background response's (tests/store/test_background_store.py)
        "responses": 1,
        "idempotency": 1,
        "ledger": 2,
        "explain_records": 1,
    }
    assert await tables_holding(store, MARK) == {}
    kept = await tables_holding(store, KEEP)
    assert derived | {"summaries"} <= set(kept)
    assert kept["threads"] == 2 and kept["ledger"] == 4
    assert await store.get_response("other", "resp_t1") is not None
    assert await store.erase_thread("acme", "t1") == dict.fromkeys(erased, 0)
    # The side effect is forgotten: its tenant-scoped key can be issued again.
    again = replace(ledger_entry(f"refund:{MARK}:tenant", call_id="call_new"), thread_id="t9")
    assert (await store.ledger_issue(again))[1] is True


async def test_erase_removes_what_deleting_the_thread_left(store: Store) -> None:
    """DELETE of a conversation keeps its responses, idempotency records and ledger
    entries (as OpenAI keeps responses); the erase of the deleted id removes them."""
    from tests.store.dump import tables_holding

    await thread_everywhere(store, "t1", MARK)
    assert await store.delete_thread("acme", "t1")
    assert set(await tables_holding(store, MARK)) == {"responses", "ledger", "idempotency"}
    erased = await store.erase_thread("acme", "t1")
    assert (erased["threads"], erased["responses"], erased["ledger"]) == (0, 1, 2)
    assert await tables_holding(store, MARK) == {}


async def test_responses_purge_deletes_old_finished_responses_and_their_empty_chains(
    store: Store,
) -> None:
    async def respond(rid: str, tid: str, kind: str, created: str, *, finish: bool) -> None:
        if await store.get_thread("acme", tid) is None:
            await store.create_thread("acme", tid, kind=kind, now=T0)  # type: ignore[arg-type]
        await store.begin_response(replace(response(rid, thread_id=tid), created_at=created))
        if finish:
            thread = await store.get_thread("acme", tid)
            assert thread is not None
            await store.commit_turn(
                "acme",
                tid,
                expected_version=thread.version,
                items=[new_item(f"i_{rid}")],
                state={},
                now=created,
                response_id=rid,
                response={"id": rid},
            )

    await respond("r_old", "chain_old", "responses", T0, finish=True)
    await respond("r_old2", "chain_mixed", "responses", T0, finish=True)
    await respond("r_new", "chain_mixed", "responses", T2, finish=True)
    await respond("r_conv", "conv", "conversation", T0, finish=True)
    await respond("r_running", "chain_running", "responses", T0, finish=False)
    await store.summary_put(summary("d1"), thread_id="chain_old")

    assert await store.responses_purge(T1, limit=2) == 2  # the oldest two, by created_at
    assert await store.responses_purge(T1, limit=2) == 1
    assert await store.responses_purge(T1, limit=2) == 0
    left = [r for r in ("r_old", "r_old2", "r_new", "r_conv", "r_running")]
    assert [await status_of(store, "acme", r) for r in left] == [
        None,
        None,
        "completed",
        None,
        "in_progress",  # never purged while it runs
    ]
    # A chain without responses is unreachable: it goes, with its summaries; a
    # conversation stays (its items are the conversation's), and so does a chain still
    # holding a response.
    assert await store.get_thread("acme", "chain_old") is None
    assert await store.items_between("acme", "chain_old", 0, 10) == ()
    assert await digests_stored(store) == []
    for kept in ("chain_mixed", "conv", "chain_running"):
        assert await store.get_thread("acme", kept) is not None


async def test_upstream_api_first_write_wins_per_tenant_and_url(store: Store) -> None:
    url = "http://127.0.0.1:11434/v1"
    assert await store.upstream_api_get("acme", url) is None
    assert await store.upstream_api_set("acme", url, "chat", T0) == "chat"
    assert await store.upstream_api_set("acme", url, "responses", T1) == "chat"
    assert await store.upstream_api_get("acme", url) == "chat"
    assert await store.upstream_api_get("acme", url + "/other") is None
    assert await store.upstream_api_get("globex", url) is None
