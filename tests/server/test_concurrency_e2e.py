"""Concurrent turns on one thread through the HTTP path lose nothing and duplicate nothing
(SPEC 7), on SQLite with one proxy and on PostgreSQL with two proxies sharing the
database (SPEC 8). The openai SDK is the client; the fake provider echoes each turn."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import openai

from proxy.store.base import Store, StoredItem, VersionConflict

from .conftest import Proxy
from .pg import StartProxy, pg_store_url, start_proxy, store_of  # noqa: F401

TENANT = "acme"
TURNS = 20
MODEL = "gpt-4o"


@dataclass
class Conflicts:
    """Commits that lost the optimistic-concurrency race and were retried."""

    commits: int = 0
    lost: int = 0
    per_turn: Counter[int] = field(default_factory=Counter)  # losses of each commit task

    def report(self) -> str:
        worst = max(self.per_turn.values(), default=0)
        return f"{self.lost} commits lost the race (at most {worst} for one turn)"


def counting_conflicts(stores: Sequence[Store]) -> Conflicts:
    """Wraps each store's commit_turn to count the races it loses (VersionConflict)."""
    conflicts = Conflicts()
    for store in stores:
        original = store.commit_turn

        async def commit_turn(*args: Any, _original: Any = original, **kwargs: Any) -> Any:
            conflicts.commits += 1
            try:
                return await _original(*args, **kwargs)
            except VersionConflict:
                conflicts.lost += 1
                # The thread service retries a commit inside one (shielded) task.
                conflicts.per_turn[id(asyncio.current_task())] += 1
                raise

        store.commit_turn = commit_turn  # type: ignore[method-assign]
    return conflicts


def text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    return "".join(getattr(part, "text", "") or "" for part in content or ())


async def listed_items(client: openai.AsyncOpenAI, conversation_id: str) -> list[tuple[str, str]]:
    """(role, text) of every conversation item, oldest first, read page by page."""
    items = []
    async for item in client.conversations.items.list(conversation_id, order="asc", limit=7):
        assert item.type == "message"
        items.append((item.role, text_of(item.content)))
    return items


def assert_turns_paired(pairs: Sequence[tuple[str, str]]) -> None:
    """Exactly one `turn i` per turn, each directly followed by its own echoed reply
    (input and output items commit together)."""
    users = [text for role, text in pairs if role == "user"]
    assert sorted(users) == sorted(f"turn {i}" for i in range(TURNS))
    assert Counter(users).most_common(1)[0][1] == 1
    assert len(pairs) == 2 * TURNS
    for (role, text), (reply_role, reply) in zip(pairs[::2], pairs[1::2], strict=True):
        assert (role, reply_role) == ("user", "assistant")
        assert reply == f"ok: {text}"


async def run_conversation_turns(proxies: Sequence[Proxy]) -> Conflicts:
    clients = [proxy.client() for proxy in proxies]
    conflicts = counting_conflicts([store_of(proxy) for proxy in proxies])
    conversation = await clients[0].conversations.create()

    async def turn(i: int) -> openai.types.responses.Response:
        client = clients[i % len(clients)]
        return await client.responses.create(
            model=MODEL, conversation=conversation.id, input=f"turn {i}"
        )

    responses = await asyncio.gather(*(turn(i) for i in range(TURNS)))
    assert [r.output_text for r in responses] == [f"ok: turn {i}" for i in range(TURNS)]
    for client in clients:
        assert_turns_paired(await listed_items(client, conversation.id))
    for index, response in enumerate(responses):
        retrieved = await clients[(index + 1) % len(clients)].responses.retrieve(response.id)
        assert retrieved.status == "completed"
        assert retrieved.output_text == f"ok: turn {index}"
    assert conflicts.commits == TURNS + conflicts.lost
    print(f"\n{TURNS} conversation turns on {len(proxies)} proxies: {conflicts.report()}")
    return conflicts


async def thread_pairs(store: Store, thread_id: str) -> list[tuple[str, str]]:
    items: list[StoredItem] = []
    after = None
    while True:
        page = await store.list_items(TENANT, thread_id, after=after, limit=7, order="asc")
        items.extend(page.items)
        if not page.has_more:
            break
        after = page.items[-1].item_id
    return [(item.raw["role"], text_of(item.raw["content"])) for item in items]


async def run_chat_turns(proxies: Sequence[Proxy]) -> Conflicts:
    clients = [proxy.client() for proxy in proxies]
    conflicts = counting_conflicts([store_of(proxy) for proxy in proxies])

    async def turn(i: int) -> str | None:
        completion = await clients[i % len(clients)].chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": f"turn {i}"}],
            extra_headers={"X-Thread-Id": "t-concurrent"},
        )
        return completion.choices[0].message.content

    replies = await asyncio.gather(*(turn(i) for i in range(TURNS)))
    assert replies == [f"ok: turn {i}" for i in range(TURNS)]
    for proxy in proxies:
        assert_turns_paired(await thread_pairs(store_of(proxy), "t-concurrent"))
    assert conflicts.commits == TURNS + conflicts.lost
    print(f"\n{TURNS} chat turns on {len(proxies)} proxies: {conflicts.report()}")
    return conflicts


async def test_concurrent_conversation_turns_on_sqlite(proxy: Proxy) -> None:
    await run_conversation_turns([proxy])


async def test_concurrent_conversation_turns_on_two_postgres_proxies(
    pg_store_url: str,  # noqa: F811
    start_proxy: StartProxy,  # noqa: F811
) -> None:
    await run_conversation_turns([await start_proxy(pg_store_url), await start_proxy(pg_store_url)])


async def test_concurrent_chat_turns_on_one_thread_id_on_sqlite(proxy: Proxy) -> None:
    await run_chat_turns([proxy])


async def test_concurrent_chat_turns_on_two_postgres_proxies(
    pg_store_url: str,  # noqa: F811
    start_proxy: StartProxy,  # noqa: F811
) -> None:
    await run_chat_turns([await start_proxy(pg_store_url), await start_proxy(pg_store_url)])
