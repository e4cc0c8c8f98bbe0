"""Every row of every table of a store as text, to grep for what must be gone (an erased
thread's words): SQLite's tables from sqlite_master, PostgreSQL's from the store's schema."""

from __future__ import annotations

from typing import Any

from proxy.store.base import Store
from proxy.store.sqlstore import SqlStore

TABLES = {
    "sqlite": "SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name",
    "postgres": (
        "SELECT table_name AS name FROM information_schema.tables "
        "WHERE table_schema = current_schema() AND table_type = 'BASE TABLE' ORDER BY table_name"
    ),
}


def _text(value: Any) -> str:
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value).decode("utf-8", "replace")
    return str(value)


async def dump_store(store: Store) -> dict[str, list[str]]:
    """{table: [each row's values joined as text]} for every table of the store."""
    assert isinstance(store, SqlStore)
    dumped: dict[str, list[str]] = {}
    async with store.db.read() as conn:
        names = [row["name"] for row in await conn.fetch(TABLES[store.db.dialect])]
        assert {"threads", "items", "responses", "ledger", "idempotency"} <= set(names)
        for name in names:
            rows = await conn.fetch(f'SELECT * FROM "{name}"')
            dumped[name] = ["\t".join(_text(value) for value in tuple(row)) for row in rows]
    return dumped


async def tables_holding(store: Store, needle: str) -> dict[str, int]:
    """The tables where `needle` occurs, with how many rows hold it."""
    found = {}
    for name, rows in (await dump_store(store)).items():
        if count := sum(needle in row for row in rows):
            found[name] = count
    return found
