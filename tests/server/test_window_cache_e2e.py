"""The hot-thread cache across app instances sharing one store (replicas, workers).

Each instance keeps the windows it read in memory. Turns alternate between two
instances on one conversation and one chat thread: every turn's upstream request must
carry what the other instance wrote, a deleted item must disappear from the next turn
on both, and a cached turn reads only what is new.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from proxy.clock import utc_now
from proxy.server.state import STORE, WINDOWS
from proxy.threads import ThreadService, WindowCache

from .conftest import Proxy
from .pg import StartProxy, pg_store_url, start_proxy  # noqa: F401

TURNS = 6


def texts_sent(proxy: Proxy) -> list[str]:
    """The text of every message of the last request the provider received."""
    body = proxy.provider.model_requests[-1].json
    messages = body.get("messages") or body.get("input") or []
    found = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, str):
            found.append(content)
        elif isinstance(content, list):
            found.extend(part.get("text", "") for part in content if isinstance(part, dict))
    return found


def cache_of(proxy: Proxy) -> WindowCache:
    return proxy.app[WINDOWS]  # type: ignore[index,no-any-return]


async def alternate_conversation_turns(proxies: list[Proxy]) -> None:
    conversation = await proxies[0].client().conversations.create()
    for n in range(TURNS):
        proxy = proxies[n % 2]
        await proxy.client().responses.create(
            model="gpt-4o", conversation=conversation.id, input=f"question {n}"
        )
        sent = texts_sent(proxy)
        for earlier in range(n):  # the other instance's turns included
            assert f"question {earlier}" in sent
            assert f"ok: question {earlier}" in sent
        assert sent[-1] == f"question {n}"
    for proxy in proxies:
        assert len(cache_of(proxy)) == 1

    # A deleted item (no new version: the epoch) leaves both instances' next turn.
    client = proxies[0].client()
    items = [i async for i in client.conversations.items.list(conversation.id, order="asc")]
    first = next(i for i in items if i.type == "message" and i.role == "user")
    await client.conversations.items.delete(first.id, conversation_id=conversation.id)
    for n, proxy in enumerate(proxies):
        await proxy.client().responses.create(
            model="gpt-4o", conversation=conversation.id, input=f"after delete {n}"
        )
        assert "question 0" not in texts_sent(proxy)
        assert "question 1" in texts_sent(proxy)


async def alternate_chat_turns(proxies: list[Proxy]) -> None:
    headers = {"X-Thread-Id": "t-shared"}
    for n in range(TURNS):
        proxy = proxies[n % 2]
        await proxy.client().chat.completions.create(
            model="gpt-4o",
            messages=[{"role": "user", "content": f"chat {n}"}],
            extra_headers=headers,
        )
        sent = texts_sent(proxy)
        assert sent == [text for k in range(n) for text in (f"chat {k}", f"ok: chat {k}")] + [
            f"chat {n}"
        ]
    for proxy in proxies:  # each instance's window is what the store holds
        store = proxy.app[STORE]  # type: ignore[index]
        held = await ThreadService(store, utc_now, cache=cache_of(proxy)).load("acme", "t-shared")
        fresh = await ThreadService(store, utc_now).load("acme", "t-shared")
        assert held is not None and fresh is not None and held.stored == fresh.stored


async def two_instances(make_proxy: Any, store_url: str) -> list[Proxy]:
    return [await make_proxy(store_url=store_url), await make_proxy(store_url=store_url)]


async def test_two_instances_on_one_sqlite_file(make_proxy: Any, tmp_path: Path) -> None:
    proxies = await two_instances(make_proxy, f"sqlite:///{tmp_path / 'shared.db'}")
    await alternate_conversation_turns(proxies)
    await alternate_chat_turns(proxies)


async def test_two_instances_on_one_postgres(
    pg_store_url: str,  # noqa: F811
    start_proxy: StartProxy,  # noqa: F811
) -> None:
    proxies = [await start_proxy(pg_store_url), await start_proxy(pg_store_url)]
    await alternate_conversation_turns(proxies)
    await alternate_chat_turns(proxies)


async def test_a_cached_turn_reads_only_what_is_new(
    make_proxy: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Turns of this instance are added to its window when committed: the next turn reads
    the thread row only. The other instance's turn is read as new rows."""
    store_url = f"sqlite:///{tmp_path / 'shared.db'}"
    proxy, other = await two_instances(make_proxy, store_url)
    store = proxy.app[STORE]  # type: ignore[index]
    client = proxy.client()
    conversation = await client.conversations.create()
    await client.responses.create(model="gpt-4o", conversation=conversation.id, input="one")
    read: list[int] = []
    original = store.load_window

    async def load_window(tenant: str, thread_id: str, *, from_seq: int = 0) -> Any:
        window = await original(tenant, thread_id, from_seq=from_seq)
        read.append(len(window.items))
        return window

    monkeypatch.setattr(store, "load_window", load_window)
    for text in ("two", "three"):
        await client.responses.create(model="gpt-4o", conversation=conversation.id, input=text)
    await other.client().responses.create(
        model="gpt-4o", conversation=conversation.id, input="from the other instance"
    )
    await client.responses.create(model="gpt-4o", conversation=conversation.id, input="four")
    assert read == [0, 0, 2]  # the other instance's input and output, not the whole window
    assert "from the other instance" in texts_sent(proxy)
    assert cache_of(proxy).bytes > 0

    # What this instance added to its window is what the store holds, field for field.
    monkeypatch.setattr(store, "load_window", original)
    await client.responses.create(model="gpt-4o", conversation=conversation.id, input="five")
    held = await ThreadService(store, utc_now, cache=cache_of(proxy)).load("acme", conversation.id)
    fresh = await ThreadService(store, utc_now).load("acme", conversation.id)
    assert held is not None and fresh is not None
    assert held.stored == fresh.stored and len(held.stored) == 12
    assert held.items == fresh.items
    assert [i.tokens for i in held.items] == [i.tokens for i in fresh.items]


async def test_no_cache_when_its_size_is_zero(make_proxy: Any) -> None:
    proxy = await make_proxy(settings={"thread_cache_bytes": 0})
    client = proxy.client()
    conversation = await client.conversations.create()
    for text in ("one", "two"):
        await client.responses.create(model="gpt-4o", conversation=conversation.id, input=text)
    assert "one" in texts_sent(proxy)
    assert len(cache_of(proxy)) == 0
