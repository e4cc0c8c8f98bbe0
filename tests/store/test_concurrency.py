"""SPEC section 7: concurrent writers on one thread lose nothing and duplicate nothing.

Each writer reads the window, "thinks", then commits its turn with the version it read;
on VersionConflict it reloads and retries. With two stores the writers are split between
two independent connection sets (two pools on PostgreSQL, two connection pairs on
SQLite), as two replicas or two processes would be.
"""

from __future__ import annotations

import asyncio

import pytest

from proxy.store import sql
from proxy.store.base import NewItem, Store, StoredSummary, VersionConflict
from proxy.store.sqlstore import SqlStore, summary_params
from tests.store.conftest import Backend

WRITERS = 20
NOW = "2025-01-01T00:00:00+00:00"


async def write_turn(store: Store, writer: int) -> int:
    """Commit one turn (input + output item); returns how many attempts it took."""
    attempts = 0
    while True:
        attempts += 1
        window = await store.load_window("acme", "t1")
        assert window is not None
        await asyncio.sleep(0.001 * (writer % 3))  # the model call
        turn = [
            NewItem(item_id=f"in_{writer}", raw={"n": writer}, api="responses"),
            NewItem(item_id=f"out_{writer}", raw={"n": writer}, api="responses", role="output"),
        ]
        state = {"turns": window.thread.state.get("turns", 0) + 1}
        try:
            await store.commit_turn(
                "acme",
                "t1",
                expected_version=window.thread.version,
                items=turn,
                state=state,
                now=NOW,
            )
            return attempts
        except VersionConflict:
            continue


@pytest.mark.parametrize("stores", [1, 2], ids=["one store", "two stores"])
async def test_concurrent_writers_lose_nothing(backend: Backend, store: Store, stores: int) -> None:
    await store.create_thread("acme", "t1", kind="conversation", now=NOW)
    pool = [store] + [await backend.open() for _ in range(stores - 1)]

    attempts = await asyncio.gather(
        *(write_turn(pool[writer % stores], writer) for writer in range(WRITERS))
    )

    window = await store.load_window("acme", "t1")
    assert window is not None
    assert window.thread.version == WRITERS
    assert window.thread.state == {"turns": WRITERS}  # derived state recomputed on retry
    assert [item.seq for item in window.items] == list(range(2 * WRITERS))
    expected = {f"{side}_{w}" for w in range(WRITERS) for side in ("in", "out")}
    assert sorted(item.item_id for item in window.items) == sorted(expected)
    # each turn's two items are adjacent: a turn commits as one unit
    pairs = [window.items[i : i + 2] for i in range(0, 2 * WRITERS, 2)]
    assert all(a.raw == b.raw and a.role == "input" for a, b in pairs)
    assert sum(attempts) > WRITERS  # the sleeps forced real conflicts and retries


async def test_unversioned_appends_commute(backend: Backend, store: Store) -> None:
    await store.create_thread("acme", "t1", kind="conversation", now=NOW)
    other = await backend.open()

    async def append(writer: int) -> None:
        target = (store, other)[writer % 2]
        item = NewItem(item_id=f"i_{writer}", raw={"n": writer}, api="chat")
        await target.append_items("acme", "t1", [item], now=NOW)

    await asyncio.gather(*(append(writer) for writer in range(WRITERS)))
    window = await store.load_window("acme", "t1")
    assert window is not None and window.thread.version == WRITERS
    assert [item.seq for item in window.items] == list(range(WRITERS))
    assert {item.item_id for item in window.items} == {f"i_{w}" for w in range(WRITERS)}


# A summary written for a thread while the thread is deleted (migration 010): whichever
# comes first, no summary is left behind for a thread that is gone.

SUMMARY = StoredSummary(
    "acme", "m", "chat", "d1", {"role": "system", "content": "ORD-1 refunded"}, None, NOW
)


async def test_a_summary_put_waiting_on_a_thread_being_deleted_writes_nothing(
    backend: Backend, store: Store
) -> None:
    await store.create_thread("acme", "t1", kind="chat", now=NOW)
    other = await backend.open()
    assert isinstance(store, SqlStore)
    async with store.db.write() as conn:  # delete_thread, caught before its commit
        await conn.execute(sql.DELETE_THREAD_ITEMS, "acme", "t1")
        await conn.execute(sql.DELETE_THREAD, "acme", "t1")
        put = asyncio.create_task(other.summary_put(SUMMARY, thread_id="t1"))
        await asyncio.sleep(0.2)
        assert not put.done()  # waits for the delete
    assert await put is False
    assert await store.summaries_get("acme", "m", "chat", ["d1"]) == {}


async def test_a_thread_deleted_while_a_summary_is_put_takes_the_summary_along(
    backend: Backend, store: Store
) -> None:
    await store.create_thread("acme", "t1", kind="chat", now=NOW)
    other = await backend.open()
    assert isinstance(store, SqlStore)
    async with store.db.write() as conn:  # summary_put, caught before its commit
        assert await conn.fetchrow(sql.THREAD_EXISTS[store.db.dialect], "acme", "t1")
        await conn.fetchrow(sql.INSERT_SUMMARY, *summary_params(SUMMARY))
        await conn.execute(sql.keep_summaries(1), "acme", "t1", "m", "chat", "d1")
        await conn.execute(sql.own_summaries(1), "acme", "m", "chat", "d1")
        delete = asyncio.create_task(other.delete_thread("acme", "t1"))
        await asyncio.sleep(0.2)
        assert not delete.done()  # waits for the summary
    assert await delete is True
    assert await store.summaries_get("acme", "m", "chat", ["d1"]) == {}
