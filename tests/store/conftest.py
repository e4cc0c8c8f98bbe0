"""Store fixtures: every test taking `store` (or `backend`) runs on SQLite and PostgreSQL.

PostgreSQL runs when THREADKEEPER_TEST_PG_DSN is set (e.g.
postgresql://postgres@127.0.0.1:5432/test). Each test gets a fresh schema
`tk_test_<hex>`, passed to the store as `open_store(url, schema=...)`, dropped afterwards,
so parallel and repeated runs never collide.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import asyncpg
import pytest

from proxy.store import open_store
from proxy.store.base import Store

PG_DSN_ENV = "THREADKEEPER_TEST_PG_DSN"


@dataclass
class Backend:
    """Where one test's database lives; `open()` gives another store on the same data."""

    name: str
    url: str
    schema: str | None = None
    opened: list[Store] = field(default_factory=list)

    async def open(self) -> Store:
        store = await open_store(self.url, schema=self.schema)
        self.opened.append(store)
        return store

    async def close_all(self) -> None:
        for store in self.opened:
            await store.close()


@pytest.fixture(params=["sqlite", "postgres"])
async def backend(request: pytest.FixtureRequest, tmp_path: object) -> AsyncIterator[Backend]:
    if request.param == "sqlite":
        backend = Backend("sqlite", f"sqlite:///{tmp_path}/threadkeeper.db")
        yield backend
        await backend.close_all()
        return
    dsn = os.environ.get(PG_DSN_ENV)
    if not dsn:
        pytest.skip(f"{PG_DSN_ENV} is not set: PostgreSQL tests skipped")
    schema = f"tk_test_{secrets.token_hex(6)}"
    admin = await asyncpg.connect(dsn)
    try:
        await admin.execute(f"CREATE SCHEMA {schema}")
        backend = Backend("postgres", dsn, schema)
        try:
            yield backend
        finally:
            await backend.close_all()
            await admin.execute(f"DROP SCHEMA {schema} CASCADE")
    finally:
        await admin.close()


@pytest.fixture
async def store(backend: Backend) -> Store:
    store = await backend.open()
    await store.migrate()
    return store
