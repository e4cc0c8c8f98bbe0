"""Helpers for end-to-end tests that run the proxy on a store other than the default
SQLite file: a fresh PostgreSQL schema per test, and proxies started on a given store URL
(several app instances on one database, as replicas behind a load balancer run)."""

from __future__ import annotations

import os
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import asyncpg
import pytest

from proxy.fake_provider import FakeProvider
from proxy.server.app import bound_port, create_app, start
from proxy.server.state import STORE
from proxy.settings import Settings
from proxy.store.base import Store

from .conftest import PROVIDER_KEY, Proxy, write_policies

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
async def start_proxy(tmp_path: Path, provider: FakeProvider) -> AsyncIterator[StartProxy]:
    """Starts proxy instances on a given store URL; all are stopped after the test."""
    proxies: list[Proxy] = []
    runners = []

    async def factory(store_url: str) -> Proxy:
        policies = tmp_path / f"policies-{len(proxies)}"
        write_policies(policies)
        settings = Settings(
            port=0,
            policies_dir=policies,
            upstream_url=provider.base_url or "",
            policy_reload_interval=0,
            store_url=store_url,
        )
        app = create_app(settings, env={"ACME_OPENAI_KEY": PROVIDER_KEY})
        runner = await start(settings, app)
        runners.append(runner)
        proxy = Proxy(f"http://127.0.0.1:{bound_port(runner)}/v1", provider, policies, app)
        proxies.append(proxy)
        return proxy

    yield factory
    for proxy in proxies:
        for client in proxy.clients:
            await client.close()
    for runner in runners:
        await runner.cleanup()


def store_of(proxy: Proxy) -> Store:
    return proxy.app[STORE]  # type: ignore[index]
