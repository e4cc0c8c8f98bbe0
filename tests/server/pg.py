"""Helpers for end-to-end tests that run the proxy on a store other than the default
SQLite file: a fresh PostgreSQL schema per test, and proxies started on a given store URL
(several app instances on one database, as replicas behind a load balancer run)."""

from __future__ import annotations

import os
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import asyncpg
import pytest

from proxy.server.state import STORE
from proxy.store.base import Store

from .conftest import Proxy

PG_DSN_ENV = "THREADKEEPER_TEST_PG_DSN"

StartProxy = Callable[[str], Awaitable[Proxy]]


def with_schema(dsn: str, schema: str) -> str:
    """The DSN with `?schema=NAME` added to whatever query it already has."""
    parts = urlsplit(dsn)
    query = [*parse_qsl(parts.query, keep_blank_values=True), ("schema", schema)]
    return urlunsplit(parts._replace(query=urlencode(query)))


@asynccontextmanager
async def fresh_schema_url() -> AsyncIterator[str]:
    """A store URL on a new PostgreSQL schema, dropped afterwards; skips without a DSN."""
    dsn = os.environ.get(PG_DSN_ENV)
    if not dsn:
        pytest.skip(f"{PG_DSN_ENV} is not set: PostgreSQL tests skipped")
    schema = f"tk_e2e_{secrets.token_hex(6)}"
    admin = await asyncpg.connect(dsn)
    try:
        await admin.execute(f"CREATE SCHEMA {schema}")
        try:
            yield with_schema(dsn, schema)
        finally:
            await admin.execute(f"DROP SCHEMA {schema} CASCADE")
    finally:
        await admin.close()


@pytest.fixture
async def pg_store_url() -> AsyncIterator[str]:
    """A store URL on a fresh PostgreSQL schema, dropped after the test."""
    async with fresh_schema_url() as url:
        yield url


@pytest.fixture
async def start_proxy(make_proxy: Callable[..., Awaitable[Proxy]]) -> StartProxy:
    """Starts proxy instances on a given store URL (replicas of one database)."""

    async def factory(store_url: str) -> Proxy:
        return await make_proxy(store_url=store_url)

    return factory


def store_of(proxy: Proxy) -> Store:
    return proxy.app[STORE]  # type: ignore[index]
