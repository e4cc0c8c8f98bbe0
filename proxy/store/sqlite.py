"""The SQLite backend (SPEC section 8: the embedded default), WAL mode via aiosqlite.

Two connections: one writer and one reader. Writes in this process queue on an
asyncio.Lock and run as `BEGIN IMMEDIATE ... COMMIT`, so coroutines never meet
"database is locked"; other processes on the same file wait on `busy_timeout`. WAL lets
the reader take consistent snapshots while a write is under way. An in-memory database
cannot be shared between connections, so there the writer also reads.
"""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from functools import lru_cache
from typing import Any

import aiosqlite

from proxy.store import sql
from proxy.store.base import AlreadyExists
from proxy.store.sqlstore import SqlStore

MEMORY = ":memory:"
BUSY_TIMEOUT_MS = 10_000
_UNIQUE_ERRORS = {"SQLITE_CONSTRAINT_UNIQUE", "SQLITE_CONSTRAINT_PRIMARYKEY"}


def sqlite_path(url: str) -> str:
    """`sqlite:///rel/path` -> `rel/path`, `sqlite:////abs/path` -> `/abs/path`,
    `sqlite:///:memory:` -> `:memory:`."""
    prefix = "sqlite:///"
    if not url.startswith(prefix) or len(url) == len(prefix):
        raise ValueError(f"expected sqlite:///path or sqlite:///:memory:, got {url!r}")
    return url[len(prefix) :]


@lru_cache(maxsize=256)
def _qmark(query: str) -> str:
    return sql.to_qmark(query)


class SqliteConn:
    """Runs the shared `$n` statements on one aiosqlite connection."""

    def __init__(self, conn: aiosqlite.Connection) -> None:
        self._conn = conn

    async def execute(self, query: str, *args: Any) -> int:
        async with _unique_as_exists():
            cursor = await self._conn.execute(_qmark(query), args)
            await cursor.close()
        return cursor.rowcount

    async def executemany(self, query: str, rows: Sequence[tuple[Any, ...]]) -> None:
        async with _unique_as_exists():
            await self._conn.executemany(_qmark(query), rows)

    async def fetch(self, query: str, *args: Any) -> list[sql.Row]:
        async with _unique_as_exists():
            return list(await self._conn.execute_fetchall(_qmark(query), args))

    async def fetchrow(self, query: str, *args: Any) -> sql.Row | None:
        rows = await self.fetch(query, *args)
        return rows[0] if rows else None


@asynccontextmanager
async def _unique_as_exists() -> AsyncIterator[None]:
    try:
        yield
    except sqlite3.IntegrityError as error:
        if getattr(error, "sqlite_errorname", "") in _UNIQUE_ERRORS:
            raise AlreadyExists(str(error)) from error
        raise


class SqliteDatabase:
    dialect = "sqlite"

    def __init__(self, writer: aiosqlite.Connection, reader: aiosqlite.Connection | None):
        self._writer = SqliteConn(writer)
        self._reader = SqliteConn(reader) if reader is not None else self._writer
        self._connections = [c for c in (writer, reader) if c is not None]
        self._write_lock = asyncio.Lock()
        self._read_lock = asyncio.Lock() if reader is not None else self._write_lock

    @asynccontextmanager
    async def write(self) -> AsyncIterator[SqliteConn]:
        async with self._write_lock:
            async with _transaction(self._writer, "BEGIN IMMEDIATE"):
                yield self._writer

    @asynccontextmanager
    async def read(self) -> AsyncIterator[SqliteConn]:
        async with self._read_lock:
            async with _transaction(self._reader, "BEGIN"):
                yield self._reader

    async def close(self) -> None:
        for connection in self._connections:
            await connection.close()


@asynccontextmanager
async def _transaction(conn: SqliteConn, begin: str) -> AsyncIterator[None]:
    # BEGIN and COMMIT sit inside the try: a task cancelled while awaiting them has still
    # queued them on the connection's thread, and the ROLLBACK queued behind them keeps the
    # connection out of a dangling transaction.
    try:
        await conn.execute(begin)
        yield
        await conn.execute("COMMIT")
    except BaseException:
        await _rollback(conn)
        raise


async def _rollback(conn: SqliteConn) -> None:
    try:
        await conn.execute("ROLLBACK")
    except sqlite3.OperationalError:  # no transaction was active (BEGIN failed or COMMIT ran)
        pass


async def _connect(path: str) -> aiosqlite.Connection:
    # isolation_level=None: we issue BEGIN/COMMIT ourselves (sqlite3's implicit ones would
    # not cover SELECTs or DDL).
    conn = await aiosqlite.connect(path, isolation_level=None)
    conn.row_factory = sqlite3.Row
    for pragma in (
        "PRAGMA journal_mode=WAL",
        "PRAGMA synchronous=NORMAL",  # durable across process crashes in WAL mode
        "PRAGMA foreign_keys=ON",
        f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}",
    ):
        await conn.execute(pragma)
    return conn


async def open_sqlite_store(url: str) -> SqlStore:
    path = sqlite_path(url)
    writer = await _connect(path)
    reader = None if path == MEMORY else await _connect(path)
    return SqlStore(SqliteDatabase(writer, reader))
