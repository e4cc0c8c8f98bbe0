"""End-to-end fixtures: a fake provider on loopback, the proxy on a real socket, and the
real openai SDK as the client."""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from proxy.clock import Clock
from proxy.fake_provider import FakeProvider
from proxy.server.app import bound_port, create_app, start
from proxy.settings import Settings
from proxy.tracing import Tracing

TENANT_KEY = "sk-tk-acme-test-key"
PROVIDER_KEY = "sk-provider-secret-acme-0123456789"

DEFAULT_POLICY = """\
tenant: default
allow_unknown_keys: {allow}
models:
  "*": {{context_window: 128000, max_output_tokens: 16384}}
retry: {{max_attempts: 3, max_seconds: 10, initial_backoff: 0.01, max_backoff: 0.05}}
"""

ACME_POLICY = """\
tenant: acme
api_keys: ["{key_hash}"]
upstream: {{api_key_env: ACME_OPENAI_KEY{upstream_extra}}}
models:
  "*": {{context_window: {window}, max_output_tokens: 4096}}{models_extra}
budget: {{reserve_output_tokens: 1000, safety_margin_tokens: 200}}
memory: {{keep_recent_turns: 2, tool_result_max_tokens: 300, pin_patterns: ["(?i)all prices in"]{memory_extra}}}
retry: {{max_attempts: 3, max_seconds: 10, initial_backoff: 0.01, max_backoff: 0.05}}
"""


def write_policies(
    directory: Path,
    *,
    allow_unknown: bool = True,
    window: int = 16000,
    acme_extra: str = "",
    memory_extra: str = "",
    models_extra: str = "",
    upstream_extra: str = "",
) -> None:
    """`upstream_extra`: more fields of acme's upstream mapping (", api: chat");
    `memory_extra`: more fields of acme's memory mapping (", summarizer: {...}");
    `models_extra`: more entries of acme's models mapping ("\n  qwen: {...}")."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "default.yaml").write_text(DEFAULT_POLICY.format(allow=str(allow_unknown).lower()))
    key_hash = hashlib.sha256(TENANT_KEY.encode()).hexdigest()
    acme = ACME_POLICY.format(
        key_hash=key_hash,
        window=window,
        memory_extra=memory_extra,
        models_extra=models_extra,
        upstream_extra=upstream_extra,
    )
    acme += acme_extra
    (directory / "acme.yaml").write_text(acme)


@dataclass
class Proxy:
    base_url: str
    provider: FakeProvider
    policies_dir: Path
    app: object
    clients: list[openai.AsyncOpenAI] = field(default_factory=list)

    def client(self, api_key: str = TENANT_KEY, **kwargs: object) -> openai.AsyncOpenAI:
        client = openai.AsyncOpenAI(
            base_url=self.base_url, api_key=api_key, max_retries=0, **kwargs
        )  # type: ignore[arg-type]
        self.clients.append(client)
        return client

    def http(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.base_url.removesuffix("/v1"), timeout=30)


@pytest.fixture
async def provider() -> AsyncIterator[FakeProvider]:
    fake = FakeProvider()
    await fake.start()
    yield fake
    await fake.stop()


ProxyFactory = Callable[..., "AsyncIterator[Proxy]"]


@asynccontextmanager
async def proxy_factory(  # type: ignore[no-untyped-def]
    tmp_path: Path, provider: FakeProvider, default_store_url: str | None = None
):
    """make_proxy outside pytest's fixtures (tests/reliability runs it on its own loop).
    `default_store_url`: the store of a proxy started without one (None: a SQLite file of
    its own)."""
    runners = []
    proxies: list[Proxy] = []

    async def factory(
        *,
        allow_unknown: bool = True,
        window: int = 16000,
        upstream_url: str | None = None,
        reload_interval: float = 0,
        max_body_bytes: int = 1024 * 1024,
        acme_extra: str = "",
        memory_extra: str = "",
        models_extra: str = "",
        upstream_extra: str = "",
        store_url: str | None = None,
        settings: Mapping[str, Any] | None = None,
        env: Mapping[str, str] | None = None,
        clock: Clock | None = None,
        tracing: Tracing | None = None,
    ) -> Proxy:
        """`settings` overrides any Settings field; `env` replaces the process environment;
        `clock` (a ManualClock) replaces the system clock."""
        policies = tmp_path / f"policies{len(proxies)}"
        write_policies(
            policies,
            allow_unknown=allow_unknown,
            window=window,
            acme_extra=acme_extra,
            memory_extra=memory_extra,
            models_extra=models_extra,
            upstream_extra=upstream_extra,
        )
        config = Settings(
            port=0,
            policies_dir=policies,
            upstream_url=upstream_url or provider.base_url,
            policy_reload_interval=reload_interval,
            max_body_bytes=max_body_bytes,
            store_url=store_url
            or default_store_url
            or f"sqlite:///{tmp_path / f'store{len(proxies)}.db'}",
        )
        config = replace(config, **(settings or {}))
        app = create_app(
            config,
            env=env if env is not None else {"ACME_OPENAI_KEY": PROVIDER_KEY},
            clock=clock,
            tracing=tracing,
        )
        runner = await start(config, app)
        runners.append(runner)
        proxy = Proxy(f"http://127.0.0.1:{bound_port(runner)}/v1", provider, policies, app)
        proxies.append(proxy)
        return proxy

    try:
        yield factory
    finally:
        for proxy in proxies:
            for client in proxy.clients:
                await client.close()
        for runner in runners:
            await runner.cleanup()


@pytest.fixture
def default_store_url() -> str | None:
    """The store of a proxy whose test names none: None, a SQLite file per proxy. A module
    whose tests must hold on every backend overrides it to return `store_url`."""
    return None


@pytest.fixture
async def make_proxy(  # type: ignore[no-untyped-def]
    tmp_path: Path, provider: FakeProvider, default_store_url: str | None
):
    async with proxy_factory(tmp_path, provider, default_store_url) as factory:
        yield factory


@pytest.fixture
async def proxy(make_proxy) -> Proxy:  # type: ignore[no-untyped-def]
    return await make_proxy()


@pytest.fixture(params=["sqlite", "postgres"])
async def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[str]:
    """A store of each kind. Set up before make_proxy, so a PostgreSQL schema is dropped
    after the proxy stops (skipped without THREADKEEPER_TEST_PG_DSN)."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'tk.db'}"
        return
    from .pg import fresh_schema_url  # pg.py imports this module

    async with fresh_schema_url() as url:
        yield url
