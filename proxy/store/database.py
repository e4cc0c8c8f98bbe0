"""The connection seam a SQL backend supplies to `SqlStore` (proxy/store/sqlstore.py).

Its own module so that the migrations (proxy/store/migrate.py) and the store both read it
without importing each other.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractAsyncContextManager
from typing import Any, Protocol

# sqlite3.Row or asyncpg.Record: both index by column name.
Row = Any


class Conn(Protocol):
    """The statements a backend runs, with `$n` placeholders. Unique-key violations raise
    `AlreadyExists`."""

    async def execute(self, query: str, *args: Any) -> int:
        """Run one statement; returns the number of rows it changed."""

    async def executemany(self, query: str, rows: Sequence[tuple[Any, ...]]) -> None: ...

    async def fetch(self, query: str, *args: Any) -> list[Row]: ...

    async def fetchrow(self, query: str, *args: Any) -> Row | None: ...


class Database(Protocol):
    """Raises StoreUnavailable (never a driver error) when the database is unreachable,
    slower than the store timeouts, or out of space."""

    dialect: str  # "sqlite" | "postgres": names the migrations folder
    full_at: float | None  # time.monotonic() of the last write refused for lack of space

    def read(self, *, single: bool = False) -> AbstractAsyncContextManager[Conn]: ...

    def write(
        self, *, bounded: bool = True, single: bool = False
    ) -> AbstractAsyncContextManager[Conn]:
        """`bounded=False`: no store timeout (migrations at start).

        `single` (read or write): the block runs one statement, which is its own
        transaction (atomic, and one snapshot, on both databases), so no BEGIN and COMMIT
        are sent around it; a cancelled one may have committed. A second statement in
        such a block would be a transaction of its own: a misuse."""
        ...

    async def close(self) -> None: ...
