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

    def read(self) -> AbstractAsyncContextManager[Conn]: ...

    def write(self, *, bounded: bool = True) -> AbstractAsyncContextManager[Conn]:
        """`bounded=False`: no store timeout (migrations at start)."""
        ...

    async def close(self) -> None: ...
