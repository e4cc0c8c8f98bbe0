"""Thread storage: one contract (base.py), backends for SQLite and PostgreSQL.

    base.py       the contract: a Protocol per concern, `Store` their union, row
                  dataclasses, errors
    sql.py        SQL text (no I/O)
    sqlstore.py   SqlStore: the contract's logic over a small connection seam, and
                  the pure row <-> dataclass helpers of what it reads and writes
    sqlite.py     aiosqlite, WAL, one writer queue per process
    postgres.py   asyncpg pool; `?schema=NAME` (or schema=) sets the search_path
    migrate.py    numbered SQL files per dialect, one migrate() for both

Example::

    store = await open_store("sqlite:///./threadkeeper.db")
    await store.migrate()
"""

from __future__ import annotations

from urllib.parse import urlsplit

from proxy.store.base import Store
from proxy.store.postgres import (
    DEFAULT_COMMAND_TIMEOUT,
    DEFAULT_CONNECT_TIMEOUT,
    open_postgres_store,
)
from proxy.store.sqlite import open_sqlite_store

POSTGRES_SCHEMES = ("postgresql", "postgres")


async def open_store(
    url: str,
    *,
    schema: str | None = None,
    connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
    command_timeout: float = DEFAULT_COMMAND_TIMEOUT,
) -> Store:
    """Open the store a URL names: `sqlite:///rel/path`, `sqlite:////abs/path`,
    `sqlite:///:memory:`, or `postgresql://...` / `postgres://...` (optionally with
    `?schema=NAME`, or `schema=`, to use a PostgreSQL schema other than the default).

    The timeouts bound every wait (settings store_connect_timeout, store_command_timeout;
    on SQLite the connect timeout bounds the wait for this process's connection, the
    command timeout is the busy timeout)."""
    scheme = urlsplit(url).scheme
    if scheme == "sqlite":
        if schema is not None:
            raise ValueError("schema= applies to PostgreSQL stores only")
        return await open_sqlite_store(
            url, busy_timeout=command_timeout, lock_timeout=connect_timeout
        )
    if scheme in POSTGRES_SCHEMES:
        return await open_postgres_store(
            url,
            schema=schema,
            connect_timeout=connect_timeout,
            command_timeout=command_timeout,
        )
    raise ValueError(
        f"unsupported store URL scheme {scheme!r} in {url!r}: "
        "expected sqlite:///path or postgresql://user@host:port/db"
    )
