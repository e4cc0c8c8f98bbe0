"""Clients that vanish mid-stream must not leak upstream connections (issue 8, item 1).

Each disconnect resets the socket while the proxy is relaying a long stream; the upstream
pool holds 4 connections, so a single leaked one per disconnect would exhaust it and every
later request would fail with a pool timeout."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from proxy.fake_provider import Reply
from proxy.server.state import STORE
from proxy.store.base import StoredResponse

from .conftest import TENANT_KEY, Proxy
from .hostile import IN_USE, disconnect_mid_stream, metric, settled_metric
from .test_ledger_e2e import CHAT_TOOLS, tools_policy

POOL = 4
DISCONNECTS = POOL + 2
LONG = " ".join(f"w{i}" for i in range(2000))
UNKNOWN_KEY = "sk-client-own-key"


def long_stream() -> Reply:
    """A stream the proxy is still busy relaying (as fast as it can) when the client resets."""
    return Reply(text=LONG)


class Path:
    """One kind of model turn: how to stream it raw and how to ask it through the SDK."""

    def __init__(self, route: str, body: dict[str, Any], key: str, thread: bool) -> None:
        self.route, self.body, self.key, self.thread = route, body, key, thread

    def headers(self, n: int) -> dict[str, str]:
        headers = {"Authorization": f"Bearer {self.key}"}
        if self.thread:
            headers["X-Thread-Id"] = f"thread-{n}"
        return headers

    async def ask(self, proxy: Proxy, n: int, stream: bool) -> str:
        client = proxy.client(api_key=self.key)
        extra = {"X-Thread-Id": f"thread-{n}"} if self.thread else None
        if self.route == "/v1/responses":
            if not stream:
                response = await client.responses.create(model="gpt-4o", input="hi")
                return response.output_text
            events = await client.responses.create(model="gpt-4o", input="hi", stream=True)
            return "".join(
                [e.delta async for e in events if e.type == "response.output_text.delta"]
            )
        kwargs: dict[str, Any] = {k: v for k, v in self.body.items() if k != "stream"}
        if not stream:
            done = await client.chat.completions.create(**kwargs, extra_headers=extra)
            return done.choices[0].message.content or ""
        chunks = await client.chat.completions.create(**kwargs, stream=True, extra_headers=extra)
        return "".join([c.choices[0].delta.content or "" async for c in chunks if c.choices])


CHAT = {"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}], "stream": True}
PATHS = {
    "stateless_chat": Path("/v1/chat/completions", CHAT, UNKNOWN_KEY, thread=False),
    "guarded_chat": Path("/v1/chat/completions", {**CHAT, "tools": CHAT_TOOLS}, TENANT_KEY, False),
    "threaded_chat": Path("/v1/chat/completions", CHAT, UNKNOWN_KEY, thread=True),
    "stored_responses": Path(
        "/v1/responses", {"model": "gpt-4o", "input": "hi", "stream": True}, UNKNOWN_KEY, False
    ),
}


@pytest.mark.parametrize("name", list(PATHS))
async def test_mid_stream_disconnects_do_not_leak_the_upstream_pool(
    make_proxy: Callable[..., Awaitable[Proxy]], name: str
) -> None:
    path = PATHS[name]
    proxy = await make_proxy(
        acme_extra=tools_policy(),
        settings={"upstream_pool_size": POOL, "upstream_connect_timeout": 3.0},
    )
    for n in range(DISCONNECTS):
        proxy.provider.script.append(long_stream())
        head = await disconnect_mid_stream(
            proxy.base_url, path.route, path.body, path.headers(n), read=4096
        )
        assert head.startswith(b"HTTP/1.1 200"), head[:200]
    assert await settled_metric(proxy.base_url, IN_USE, 0) == 0
    # Ordinary requests still get a connection, streamed or not.
    for n, stream in enumerate([False, True, False, True, False]):
        proxy.provider.script.append(Reply(text="still serving"))
        assert await path.ask(proxy, DISCONNECTS + n, stream) == "still serving"
    assert await metric(proxy.base_url, IN_USE) == 0


async def test_the_gauge_counts_the_connection_of_a_stream_in_flight(
    make_proxy: Callable[..., Awaitable[Proxy]],
) -> None:
    proxy = await make_proxy()
    assert await metric(proxy.base_url, IN_USE) == 0
    proxy.provider.script.append(Reply(text=LONG, stream_chunk_delay=0.01))
    client = proxy.client(api_key=UNKNOWN_KEY)
    stream = await client.chat.completions.create(
        model="gpt-4o", messages=[{"role": "user", "content": "hi"}], stream=True
    )
    await anext(aiter(stream))
    assert await metric(proxy.base_url, IN_USE) == 1
    await stream.close()
    assert await settled_metric(proxy.base_url, IN_USE, 0) == 0


async def test_a_client_gone_while_its_response_is_recorded_leaves_it_incomplete(
    proxy: Proxy,
) -> None:
    """The client resets while the proxy writes the `in_progress` row: the row must still
    end `incomplete` (it stayed `in_progress` for the life of the process)."""
    store = proxy.app[STORE]  # type: ignore[index]
    gate, writing = asyncio.Event(), asyncio.Event()
    begun: list[StoredResponse] = []
    original = store.begin_response

    async def held_begin(response: StoredResponse, **options: Any) -> None:
        begun.append(response)
        writing.set()
        await gate.wait()
        await original(response, **options)

    store.begin_response = held_begin  # type: ignore[method-assign]
    created = await proxy.client().conversations.create()
    body = {"model": "gpt-4o", "input": "hi", "conversation": created.id, "stream": True}
    client = asyncio.create_task(
        disconnect_mid_stream(
            proxy.base_url, "/v1/responses", body, {"Authorization": f"Bearer {TENANT_KEY}"}
        )
    )
    await asyncio.wait_for(writing.wait(), timeout=30)
    client.cancel()  # resets the connection while the row is being written
    with contextlib.suppress(asyncio.CancelledError):
        await client
    gate.set()
    stored = None
    for _ in range(300):
        stored = await store.get_response(begun[0].tenant, begun[0].id)
        if stored is not None and stored.status != "in_progress":
            break
        await asyncio.sleep(0.02)
    assert stored is not None and stored.status == "incomplete"
    assert proxy.provider.model_requests == []
