"""SQLite's transactions on the loop's own connection (proxy/store/sqlite.py): with the
lock free, a turn's writes and reads make no trip to a thread; with the lock held by
another process they go to the thread and wait there while the loop serves; the loop's
writer never checkpoints the WAL, the checkpointer does, every CHECKPOINT_EVERY commits."""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import aiosqlite
import pytest

from proxy.store import sqlite as sqlite_store
from proxy.store.sqlite import open_sqlite_store
from proxy.store.sqlstore import SqlStore
from tests.store.test_conformance import T1, T2, items, new_item, response, thread_with


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[SqlStore]:
    store = await open_sqlite_store(f"sqlite:///{tmp_path}/loop.db")
    await store.migrate()
    yield store
    await store.close()


@contextmanager
def lock_held_elsewhere(path: Path) -> Iterator[None]:
    """The database's write lock taken by another connection, as another process would."""
    holder = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    holder.execute("BEGIN IMMEDIATE")
    try:
        yield
    finally:
        holder.execute("ROLLBACK")
        holder.close()


async def waited_in_the_thread(trips: list[int]) -> None:
    """Until a statement went to the worker thread, the loop serving meanwhile."""
    ticks = 0
    while trips[0] == 0 or ticks < 20:
        await asyncio.sleep(0.01)
        ticks += 1


def count_trips(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Every hand-off to an aiosqlite connection's thread, counted."""
    trips = [0]
    original = aiosqlite.Connection._execute

    async def counted(self: aiosqlite.Connection, fn: Any, *args: Any, **kwargs: Any) -> Any:
        trips[0] += 1
        return await original(self, fn, *args, **kwargs)

    monkeypatch.setattr(aiosqlite.Connection, "_execute", counted)
    return trips


async def test_a_turn_with_the_lock_free_makes_no_trip_to_a_thread(
    store: SqlStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    await thread_with(store, "a")
    trips = count_trips(monkeypatch)
    window = await store.load_window("acme", "t1")
    assert window is not None
    await store.commit_turn(
        "acme", "t1", expected_version=0, items=items("b", "c"), state={"k": 1}, now=T1
    )
    window = await store.load_window("acme", "t1")
    assert window is not None and [i.item_id for i in window.items] == ["a", "b", "c"]
    assert trips[0] == 0


async def test_a_lock_held_elsewhere_sends_the_write_to_the_thread_and_the_loop_serves(
    store: SqlStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    await thread_with(store, "a")
    trips = count_trips(monkeypatch)
    with lock_held_elsewhere(tmp_path / "loop.db"):
        write = asyncio.create_task(store.append_items("acme", "t1", items("b"), now=T1))
        await waited_in_the_thread(trips)
        assert not write.done()
        read = await store.load_window("acme", "t1")  # a reader is not held up either
        assert read is not None and [i.item_id for i in read.items] == ["a"]
    thread = await write
    assert thread.next_seq == 2
    window = await store.load_window("acme", "t1")
    assert window is not None and [i.item_id for i in window.items] == ["a", "b"]


def statements_on_the_loop(store: SqlStore) -> list[str]:
    """Every statement the loop's reader and writer run, in order."""
    ran: list[str] = []
    for conn in (store.db._reader, store.db._writer):  # type: ignore[attr-defined]
        conn._on_loop.set_trace_callback(lambda text: ran.append(text.split()[0].upper()))
    return ran


async def test_a_warm_turns_one_statement_reads_and_writes_send_no_begin_or_commit(
    store: SqlStore,
) -> None:
    await thread_with(store, "a")
    ran = statements_on_the_loop(store)
    window = await store.load_window("acme", "t1", from_seq=1)  # the window is held
    assert window is not None and window.items == () and window.thread.next_seq == 1
    await store.begin_response(response("r1"))
    assert ran == ["SELECT", "INSERT"]
    assert (await store.get_response("acme", "r1")) is not None
    ran.clear()
    window = await store.load_window("acme", "t1")  # items to read: one snapshot
    assert window is not None and [i.item_id for i in window.items] == ["a"]
    assert ran == ["SELECT", "BEGIN", "SELECT", "SELECT", "COMMIT"]


async def test_a_one_statement_read_runs_on_the_writer_while_no_write_holds_it(
    store: SqlStore,
) -> None:
    """The loop's writer keeps the pages it wrote cached; the reader's cache is emptied
    by each of its commits. While a write holds the writer, the reader reads."""
    await thread_with(store, "a")
    ran: dict[str, list[str]] = {"_reader": [], "_writer": []}
    for name, seen in ran.items():
        conn = getattr(store.db, name)  # the loop's reader and writer
        conn._on_loop.set_trace_callback(lambda text, seen=seen: seen.append(text.split()[0]))
    window = await store.load_window("acme", "t1", from_seq=1)
    assert window is not None and window.thread.next_seq == 1
    assert ran == {"_reader": [], "_writer": ["SELECT"]}
    ran["_writer"].clear()
    lock = store.db._write_lock  # type: ignore[attr-defined]
    await lock.acquire()  # a write under way
    try:
        window = await store.load_window("acme", "t1", from_seq=1)
    finally:
        lock.release()
    assert window is not None and window.thread.next_seq == 1
    assert ran == {"_reader": ["SELECT"], "_writer": []}


async def test_a_lock_held_elsewhere_sends_a_one_statement_write_to_the_thread(
    store: SqlStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    await thread_with(store, "a")
    trips = count_trips(monkeypatch)
    with lock_held_elsewhere(tmp_path / "loop.db"):
        begun = asyncio.create_task(store.begin_response(response("r1")))
        await waited_in_the_thread(trips)
        assert not begun.done()
        assert await store.get_response("acme", "r1") is None
    await begun
    stored = await store.get_response("acme", "r1")
    assert stored is not None and stored.status == "in_progress"
    assert not store.db._writer._on_loop.in_transaction  # type: ignore[attr-defined]


async def test_a_failed_first_statement_on_the_loop_leaves_no_transaction_open(
    store: SqlStore,
) -> None:
    await thread_with(store, "a")
    with pytest.raises(sqlite3.OperationalError):
        async with store.db.write() as conn:  # type: ignore[attr-defined]
            await conn.execute("SELEC 1")
    assert not store.db._writer._on_loop.in_transaction  # type: ignore[attr-defined]
    await store.append_items("acme", "t1", items("b"), now=T2)  # and the next write runs


async def test_the_checkpointer_not_the_loop_checkpoints_the_wal(
    store: SqlStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sqlite_store, "CHECKPOINT_EVERY", 4)
    path = tmp_path / "loop.db"
    await thread_with(store, "a")
    with sqlite3.connect(path) as other:  # the database file up to date, the WAL emptied
        other.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    before = path.stat().st_size
    big = "x" * 20_000
    for n in range(3):  # below CHECKPOINT_EVERY: the WAL only grows
        await store.append_items("acme", "t1", [new_item(f"b{n}", big)], now=T1)
    assert path.stat().st_size == before
    await store.append_items("acme", "t1", [new_item("b3", big)], now=T1)
    checkpoint = store.db._checkpoint  # type: ignore[attr-defined]
    assert checkpoint is not None
    await checkpoint
    assert path.stat().st_size > before + 3 * len(big)


async def test_an_in_memory_database_runs_in_its_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    store = await open_sqlite_store("sqlite:///:memory:")
    try:
        await store.migrate()
        trips = count_trips(monkeypatch)
        await thread_with(store, "a")
        assert trips[0] > 0
        window = await store.load_window("acme", "t1")
        assert window is not None and [i.item_id for i in window.items] == ["a"]
    finally:
        await store.close()
