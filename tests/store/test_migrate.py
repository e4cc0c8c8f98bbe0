"""migrate(): numbered files per dialect, recorded in schema_version, safe to repeat and to
race (replicas starting together on PostgreSQL)."""

from __future__ import annotations

import asyncio

import pytest

from proxy.store import open_store, sql
from proxy.store.migrate import load_migrations, migrate, pending, schema_versions, split_statements
from proxy.store.postgres import split_schema
from proxy.store.sqlite import sqlite_path
from proxy.store.sqlstore import SqlStore
from tests.store.conftest import Backend


def latest(dialect: str) -> int:
    return load_migrations(dialect)[-1].version


@pytest.mark.parametrize("dialect", ["sqlite", "postgres"])
def test_each_dialect_has_the_same_numbered_migrations(dialect: str) -> None:
    versions = [m.version for m in load_migrations(dialect)]
    assert versions == [m.version for m in load_migrations("sqlite")]
    assert versions == sorted(set(versions)) and versions[0] == 1


def test_pending_skips_applied_versions() -> None:
    migrations = load_migrations("sqlite")
    assert pending(migrations, set()) == migrations
    assert pending(migrations, {m.version for m in migrations}) == []


def test_split_statements_drops_comments_and_blanks() -> None:
    sql = "-- header\nCREATE TABLE a (x INT); -- trailing\n\n;CREATE INDEX i ON a (x);\n"
    assert split_statements(sql) == ["CREATE TABLE a (x INT)", "CREATE INDEX i ON a (x)"]


async def test_migrate_records_versions_and_twice_is_a_no_op(backend: Backend) -> None:
    store = await backend.open()
    assert isinstance(store, SqlStore)
    assert await migrate(store.db) == [m.version for m in load_migrations(store.db.dialect)]
    assert await migrate(store.db) == []
    await store.migrate()
    assert await schema_versions(store.db) == [m.version for m in load_migrations(store.db.dialect)]
    await store.create_thread("acme", "t1", kind="chat", now="2025-01-01T00:00:00+00:00")
    assert await store.get_thread("acme", "t1") is not None


async def test_concurrent_migrations_both_succeed(backend: Backend) -> None:
    first, second = await backend.open(), await backend.open()
    await asyncio.gather(first.migrate(), second.migrate())
    assert isinstance(first, SqlStore)
    assert await schema_versions(first.db) == [m.version for m in load_migrations(first.db.dialect)]
    await second.create_thread("acme", "t1", kind="chat", now="2025-01-01T00:00:00+00:00")
    assert await first.get_thread("acme", "t1") is not None


async def test_open_store_rejects_unknown_schemes() -> None:
    with pytest.raises(ValueError, match="'mysql'"):
        await open_store("mysql://localhost/db")
    with pytest.raises(ValueError, match="PostgreSQL"):
        await open_store("sqlite:///:memory:", schema="x")


async def test_in_memory_sqlite_store_works() -> None:
    store = await open_store("sqlite:///:memory:")
    try:
        await store.migrate()
        await store.create_thread("acme", "t1", kind="chat", now="2025-01-01T00:00:00+00:00")
        window = await store.load_window("acme", "t1")
        assert window is not None and window.items == ()
    finally:
        await store.close()


@pytest.mark.parametrize(
    ("url", "path"),
    [
        ("sqlite:///./threadkeeper.db", "./threadkeeper.db"),
        ("sqlite:///data/tk.db", "data/tk.db"),
        ("sqlite:////var/lib/tk.db", "/var/lib/tk.db"),
        ("sqlite:///:memory:", ":memory:"),
    ],
)
def test_sqlite_urls_name_a_path(url: str, path: str) -> None:
    assert sqlite_path(url) == path


def test_sqlite_url_without_a_path_is_rejected() -> None:
    with pytest.raises(ValueError, match="sqlite:///"):
        sqlite_path("sqlite://")


def test_postgres_schema_comes_from_the_url_or_the_argument() -> None:
    url = "postgresql://u@h:5432/db?schema=tk_a&sslmode=disable"
    assert split_schema(url) == ("postgresql://u@h:5432/db?sslmode=disable", "tk_a")
    assert split_schema(url, "tk_b")[1] == "tk_b"
    assert split_schema("postgres://u@h/db") == ("postgres://u@h/db", None)
    with pytest.raises(ValueError, match="identifier"):
        split_schema("postgresql://u@h/db?schema=a;drop")


async def test_a_turns_rows_keep_no_key_nothing_reads(tmp_path: object) -> None:
    """Migrations 016 and 017: an item writes the table and two keys, not three, an
    explain record three, not four; the lookups by id (Store.find_item, get_item,
    delete_item, explain_get) still search a key, not the table."""
    store = await open_store(f"sqlite:///{tmp_path}/keys.db")
    try:
        await store.migrate()
        assert isinstance(store, SqlStore)
        async with store.db.read() as conn:
            for table, count in (("items", 2), ("explain_records", 3)):
                keys = await conn.fetch(
                    "SELECT name FROM sqlite_master WHERE type = 'index' AND tbl_name = $1", table
                )
                assert len(keys) == count, (table, keys)
            for statement, args in (
                (sql.FIND_ITEM, 2),
                (sql.SELECT_ITEM, 3),
                (sql.DELETE_ITEM, 3),
                (sql.SELECT_ITEMS_FROM, 3),
                (sql.SELECT_EXPLAIN, 2),
                (sql.FIND_EXPLAIN, 1),
            ):
                plan = await conn.fetch("EXPLAIN QUERY PLAN " + statement, *[""] * args)
                assert [row["detail"].split()[0] for row in plan] == ["SEARCH"], plan
    finally:
        await store.close()
