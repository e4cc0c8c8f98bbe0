"""LLM summaries are thread data: deleting a thread (DELETE /v1/conversations/{id}, the
admin CLI) deletes the summaries kept for it, unless another live thread keeps them too;
on SQLite and PostgreSQL."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import Any

import pytest

from proxy.cli import main
from proxy.clock import ManualClock
from proxy.server.state import STORE
from proxy.store.sqlstore import SqlStore

from .conftest import Proxy
from .test_llm_summaries_e2e import (
    MEMORY,
    SUMMARIZER,
    background,
    summarizer_answer,
    summarizer_requests,
    summary_blocks,
    turn_requests,
    user_turn,
)


async def stored_summaries(proxy: Proxy) -> list[tuple[str, str]]:
    """(digest, raw) of every summary row, read from the proxy's own store."""
    store = proxy.app[STORE]  # type: ignore[index]
    assert isinstance(store, SqlStore)
    async with store.db.read() as conn:
        rows = await conn.fetch("SELECT digest, raw FROM summaries ORDER BY digest")
    return [(row["digest"], row["raw"]) for row in rows]


async def test_deleting_a_conversation_deletes_its_summaries(
    store_url: str, make_proxy: Callable[..., Awaitable[Proxy]]
) -> None:
    proxy = await make_proxy(window=5000, memory_extra=MEMORY, store_url=store_url)
    proxy.provider.scripts[SUMMARIZER] = [summarizer_answer() for _ in range(8)]
    client = proxy.client()
    conversation = await client.conversations.create()
    for number in range(30):
        await client.responses.create(
            model="gpt-4o", input=user_turn(number), conversation=conversation.id
        )
        await background(proxy).idle()
        if summarizer_requests(proxy):
            break
    assert summarizer_requests(proxy), "the conversation never neared its budget"
    rows = await stored_summaries(proxy)
    assert rows and any("ORD-10" in raw for _, raw in rows)  # the conversation's words

    deleted = await client.conversations.delete(conversation.id)
    assert deleted.deleted is True
    assert await stored_summaries(proxy) == []
    ready = background(proxy).ready("acme", SUMMARIZER, "responses")
    assert [ready.get(digest) for digest, _ in rows] == [None] * len(rows)  # nor in memory


async def test_a_summary_shared_with_a_live_thread_survives_until_that_one_goes(
    store_url: str,
    make_proxy: Callable[..., Awaitable[Proxy]],
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Two threads with the same history share its chunks' summaries (the digests are
    content hashes): the first deleted (the admin CLI) leaves them to the other."""
    proxy = await make_proxy(window=5000, memory_extra=MEMORY, store_url=store_url)
    proxy.provider.scripts[SUMMARIZER] = [summarizer_answer() for _ in range(20)]
    for thread_id in ("t-first", "t-second"):
        await grow_until_cut(proxy, thread_id)
    paid = len(summarizer_requests(proxy))
    assert paid >= 1  # written for t-first, used by t-second: paid once
    rows = await stored_summaries(proxy)
    assert rows

    store = ("--store", store_url, "--tenant", "acme")
    assert await asyncio.to_thread(main, ["threads", "delete", "t-first", *store]) == 0
    assert await stored_summaries(proxy) == rows  # t-second keeps them
    assert await asyncio.to_thread(main, ["threads", "delete", "t-second", *store]) == 0
    assert await stored_summaries(proxy) == []
    capsys.readouterr()


async def grow_until_cut(proxy: Proxy, thread_id: str | None) -> list[dict[str, Any]]:
    """Turns until the first cut (its chunk summarized ahead, past the high-water mark);
    the history a stateless client (thread_id None) sent."""
    client = proxy.client()
    history: list[dict[str, Any]] = []
    headers = {"X-Thread-Id": thread_id} if thread_id else {}
    for number in range(30):
        history.append({"role": "user", "content": user_turn(number)})
        sent = history if thread_id is None else history[-1:]
        reply = await client.chat.completions.create(
            model="gpt-4o", messages=sent, extra_headers=headers
        )
        history.append({"role": "assistant", "content": reply.choices[0].message.content})
        await background(proxy).idle()
        if summary_blocks(turn_requests(proxy)[-1].json["messages"]):
            return history
    raise AssertionError("the history never outgrew its budget")


async def test_a_stateless_requests_summaries_are_left_to_the_retention(
    store_url: str, make_proxy: Callable[..., Awaitable[Proxy]]
) -> None:
    """No thread keeps them: deleting one leaves them; unused past
    summary_retention_seconds, the purge (every 10 minutes) deletes them."""
    clock = ManualClock()
    proxy = await make_proxy(
        window=5000,
        memory_extra=MEMORY,
        store_url=store_url,
        clock=clock,
        settings={"summary_retention_seconds": 3600.0},
    )
    proxy.provider.scripts[SUMMARIZER] = [summarizer_answer() for _ in range(20)]
    client = proxy.client()
    history = await grow_until_cut(proxy, None)
    conversation = await client.conversations.create()
    await client.conversations.delete(conversation.id)  # another thread goes
    rows = await stored_summaries(proxy)
    assert rows
    await clock.advance_settled(timedelta(minutes=50))  # a purge step: all too young
    assert await stored_summaries(proxy) == rows
    # Used now (the resend reads them), so the step at 70 minutes, which deletes what
    # was unused since minute 10, keeps them.
    await client.chat.completions.create(model="gpt-4o", messages=history)
    await background(proxy).idle()  # a summary it starts is written now, not after the jump
    await clock.advance_settled(timedelta(minutes=20))
    assert await stored_summaries(proxy) == rows
    clock.advance(timedelta(minutes=70))
    for _ in range(500):
        if not await stored_summaries(proxy):
            break
        await asyncio.sleep(0.02)
    assert await stored_summaries(proxy) == []
