"""The PostgreSQL backend (SPEC section 8: several replicas share one database).

An asyncpg pool; writes run in READ COMMITTED transactions where the conditional UPDATE
on `threads.version` and the unique keys do the concurrency control, reads in a
read-only REPEATABLE READ snapshot. `schema` (the `schema=` argument or a `?schema=NAME`
query parameter of the URL) becomes the connections' search_path, so one database can
hold several isolated stores (the tests use a fresh schema per test).
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import asyncpg

from proxy.store import sql
from proxy.store.base import AlreadyExists
from proxy.store.sqlstore import SqlStore

_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,62}$")


def split_schema(url: str, schema: str | None = None) -> tuple[str, str | None]:
    """The DSN without a `schema` query parameter, and the schema (argument wins)."""
    parts = urlsplit(url)
    query = parse_qsl(parts.query, keep_blank_values=True)
    from_url = [value for name, value in query if name == "schema"]
    rest = [(name, value) for name, value in query if name != "schema"]
    dsn = urlunsplit(parts._replace(query=urlencode(rest)))
    chosen = schema if schema is not None else (from_url[-1] if from_url else None)
    if chosen is not None and not _IDENTIFIER.match(chosen):
        raise ValueError(f"schema must be a plain SQL identifier, got {chosen!r}")
    return dsn, chosen


class PostgresConn:
    """Runs the shared `$n` statements on one asyncpg connection."""

    def __init__(self, conn: asyncpg.Connection) -> None:
        self._conn = conn

    async def execute(self, query: str, *args: Any) -> int:
        async with _unique_as_exists():
            status: str = await self._conn.execute(query, *args)
        count = status.rsplit(" ", 1)[-1]
        return int(count) if count.isdigit() else 0

    async def executemany(self, query: str, rows: Sequence[tuple[Any, ...]]) -> None:
        async with _unique_as_exists():
            await self._conn.executemany(query, rows)

    async def fetch(self, query: str, *args: Any) -> list[sql.Row]:
        async with _unique_as_exists():
            return list(await self._conn.fetch(query, *args))

    async def fetchrow(self, query: str, *args: Any) -> sql.Row | None:
        async with _unique_as_exists():
            return await self._conn.fetchrow(query, *args)


@asynccontextmanager
async def _unique_as_exists() -> AsyncIterator[None]:
    try:
        yield
    except asyncpg.UniqueViolationError as error:
        raise AlreadyExists(str(error)) from error


class PostgresDatabase:
    dialect = "postgres"

    def __init__(self, pool: asyncpg.Pool) -> None:
        self._pool = pool

    @asynccontextmanager
    async def write(self) -> AsyncIterator[PostgresConn]:
        async with self._pool.acquire() as conn, conn.transaction():
            yield PostgresConn(conn)

    @asynccontextmanager
    async def read(self) -> AsyncIterator[PostgresConn]:
        async with (
            self._pool.acquire() as conn,
            conn.transaction(isolation="repeatable_read", readonly=True),
        ):
            yield PostgresConn(conn)

    async def close(self) -> None:
        await self._pool.close()


async def open_postgres_store(
    url: str, *, schema: str | None = None, min_size: int = 1, max_size: int = 10
) -> SqlStore:
    dsn, chosen = split_schema(url, schema)
    settings = {"search_path": chosen} if chosen else None
    pool = await asyncpg.create_pool(
        dsn, min_size=min_size, max_size=max_size, server_settings=settings
    )
    return SqlStore(PostgresDatabase(pool))
