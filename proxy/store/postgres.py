"""The PostgreSQL backend (SPEC section 8: several replicas share one database).

An asyncpg pool; writes run in READ COMMITTED transactions where the conditional UPDATE
on `threads.version` and the unique keys do the concurrency control, reads in a
read-only REPEATABLE READ snapshot. `schema` (the `schema=` argument or a `?schema=NAME`
query parameter of the URL) becomes the connections' search_path, so one database can
hold several isolated stores (the tests use a fresh schema per test).

Waits are bounded (SPEC section 1, store timeouts): opening a connection or waiting for
a free one takes at most `connect_timeout`, one read or write transaction at most
`command_timeout` (each statement too, via asyncpg's command_timeout). Past those, or
when the server refuses or drops connections or is out of space, StoreUnavailable is
raised; the pool replaces broken connections on the next acquire, so the store recovers
on its own when PostgreSQL comes back.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import asyncpg

from proxy.store.base import AlreadyExists, StoreUnavailable
from proxy.store.database import Row
from proxy.store.sqlstore import SqlStore

DEFAULT_CONNECT_TIMEOUT = 5.0
DEFAULT_COMMAND_TIMEOUT = 10.0
UNBOUNDED_STATEMENT_SECONDS = 24 * 3600.0  # asyncpg wants a number to lift its default
# Causes that are the server's absence, not a bug: network errors, connection-class
# SQLSTATEs (08), operator intervention (57: shutdown, cancel), insufficient resources
# (53: disk full, too many connections), and a connection closed under an operation.
_UNREACHABLE: tuple[type[BaseException], ...] = (
    OSError,
    asyncpg.PostgresConnectionError,
    asyncpg.exceptions.OperatorInterventionError,
    asyncpg.exceptions.InsufficientResourcesError,
    asyncpg.exceptions.ConnectionDoesNotExistError,
)

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

    def __init__(self, conn: asyncpg.Connection, timeout: float | None = None) -> None:
        self._conn = conn
        self._timeout = timeout  # per statement; None: the pool's command_timeout

    async def execute(self, query: str, *args: Any) -> int:
        async with _unique_as_exists():
            status: str = await self._conn.execute(query, *args, timeout=self._timeout)
        count = status.rsplit(" ", 1)[-1]
        return int(count) if count.isdigit() else 0

    async def executemany(self, query: str, rows: Sequence[tuple[Any, ...]]) -> None:
        async with _unique_as_exists():
            await self._conn.executemany(query, rows, timeout=self._timeout)

    async def fetch(self, query: str, *args: Any) -> list[Row]:
        async with _unique_as_exists():
            return list(await self._conn.fetch(query, *args, timeout=self._timeout))

    async def fetchrow(self, query: str, *args: Any) -> Row | None:
        async with _unique_as_exists():
            return await self._conn.fetchrow(query, *args, timeout=self._timeout)


@asynccontextmanager
async def _unique_as_exists() -> AsyncIterator[None]:
    try:
        yield
    except asyncpg.UniqueViolationError as error:
        raise AlreadyExists(str(error)) from error


class PostgresDatabase:
    dialect = "postgres"

    def __init__(
        self,
        pool: asyncpg.Pool,
        *,
        connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
        command_timeout: float = DEFAULT_COMMAND_TIMEOUT,
    ) -> None:
        self._pool = pool
        self._connect_timeout = connect_timeout
        self._command_timeout = command_timeout
        self.full_at: float | None = None

    @asynccontextmanager
    async def write(
        self, *, bounded: bool = True, single: bool = False
    ) -> AsyncIterator[PostgresConn]:
        """`bounded=False` (migrations at start: an index build may take minutes, and
        replicas queue on the migration lock) lifts the command timeout. `single`: one
        statement, its own transaction (no BEGIN and COMMIT round trips)."""
        timeout = None if bounded else UNBOUNDED_STATEMENT_SECONDS
        async with self._connection(bounded=bounded) as conn:
            if single:
                yield PostgresConn(conn, timeout)
                return
            async with conn.transaction():
                yield PostgresConn(conn, timeout)

    @asynccontextmanager
    async def read(self, *, single: bool = False) -> AsyncIterator[PostgresConn]:
        async with self._connection() as conn:
            if single:
                yield PostgresConn(conn)
                return
            async with conn.transaction(isolation="repeatable_read", readonly=True):
                yield PostgresConn(conn)

    @asynccontextmanager
    async def _connection(self, *, bounded: bool = True) -> AsyncIterator[asyncpg.Connection]:
        """A pooled connection for one transaction, with the waits bounded and the
        server's absence turned into StoreUnavailable."""
        total = self._connect_timeout + self._command_timeout if bounded else None
        try:
            async with asyncio.timeout(total):
                async with self._pool.acquire(timeout=self._connect_timeout) as conn:
                    yield conn
        except TimeoutError as exc:
            raise StoreUnavailable(
                "PostgreSQL did not answer within the store timeouts "
                f"(connect {self._connect_timeout:g}s, command {self._command_timeout:g}s)"
            ) from exc
        except _UNREACHABLE as exc:
            if isinstance(exc, asyncpg.exceptions.DiskFullError):
                self.full_at = time.monotonic()
            raise StoreUnavailable(f"PostgreSQL is unavailable: {type(exc).__name__}") from exc
        except asyncpg.InterfaceError as exc:
            # e.g. "cannot call Transaction.__aexit__(): the underlying connection is
            # closed" while handling a dropped connection; any other misuse is a bug.
            if not _caused_by_outage(exc):
                raise
            raise StoreUnavailable(f"PostgreSQL is unavailable: {type(exc).__name__}") from exc

    async def close(self) -> None:
        await self._pool.close()


def _caused_by_outage(exc: BaseException) -> bool:
    seen: set[int] = set()
    cause: BaseException | None = exc.__cause__ or exc.__context__
    while cause is not None and id(cause) not in seen:
        if isinstance(cause, _UNREACHABLE):
            return True
        seen.add(id(cause))
        cause = cause.__cause__ or cause.__context__
    return False


async def _session_kept(conn: asyncpg.Connection) -> None:
    """What the pool does to a connection given back, beyond asyncpg's own rollback of a
    transaction left open: nothing. Its default (advisory unlocks, CLOSE ALL, UNLISTEN,
    RESET ALL) is one more round trip per transaction, and this store leaves no session
    state behind: its locks are transaction-scoped (`pg_advisory_xact_lock`), it declares
    no cursors, listens to nothing and sets nothing but the `search_path` it connects
    with (tests/store/test_postgres_session.py checks what a connection keeps)."""
    return None


async def open_postgres_store(
    url: str,
    *,
    schema: str | None = None,
    min_size: int = 1,
    max_size: int = 10,
    connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
    command_timeout: float = DEFAULT_COMMAND_TIMEOUT,
) -> SqlStore:
    dsn, chosen = split_schema(url, schema)
    settings = {"search_path": chosen} if chosen else None
    pool = await asyncpg.create_pool(
        dsn,
        min_size=min_size,
        max_size=max_size,
        server_settings=settings,
        timeout=connect_timeout,
        command_timeout=command_timeout,
        reset=_session_kept,
    )
    database = PostgresDatabase(
        pool, connect_timeout=connect_timeout, command_timeout=command_timeout
    )
    return SqlStore(database)
