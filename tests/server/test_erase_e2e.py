"""What deleting a conversation keeps, what an operator's erase removes, and a turn that
loses its conversation while the provider answers (issue 20, items 3 and 4)."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import openai
import pytest

from proxy.fake_provider import Reply
from proxy.server.state import STORE
from proxy.store.sqlstore import SqlStore

from .conftest import TENANT_KEY, Proxy

AUTH = {"Authorization": f"Bearer {TENANT_KEY}"}


def user(text: str) -> dict[str, Any]:
    return {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}


async def responses_rows(proxy: Proxy) -> list[tuple[str, str | None, str]]:
    """(id, thread_id, status) of every stored response, read straight from the store."""
    store = proxy.app[STORE]  # type: ignore[index]
    assert isinstance(store, SqlStore)
    async with store.db.read() as conn:
        rows = await conn.fetch("SELECT id, thread_id, status FROM responses ORDER BY id")
    return [(row["id"], row["thread_id"], row["status"]) for row in rows]


async def provider_called(proxy: Proxy, count: int) -> None:
    """Waits (bounded) until the provider holds `count` model requests."""
    for _ in range(3000):
        if len(proxy.provider.model_requests) >= count:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"the provider never got {count} model requests")


# -- item 4: a conversation deleted while its turn runs --------------------------------------


async def test_deleting_the_conversation_during_a_turn_is_a_404_not_a_500(
    store_url: str, make_proxy: Any
) -> None:
    proxy = await make_proxy(store_url=store_url)
    client = proxy.client()
    conversation = await client.conversations.create(items=[user("hello")])
    release = asyncio.Event()
    proxy.provider.script.append(Reply(text="an answer nobody keeps", release=release))
    async with httpx.AsyncClient(base_url=proxy.base_url, timeout=30) as http:
        turn = asyncio.create_task(
            http.post(
                "/responses",
                headers=AUTH,
                json={"model": "gpt-4o-mini", "conversation": conversation.id, "input": "hi"},
            )
        )
        await provider_called(proxy, 1)
        assert [status for *_, status in await responses_rows(proxy)] == ["in_progress"]
        deleted = await client.conversations.delete(conversation.id)
        assert deleted.deleted
        release.set()
        answer = await turn
    assert answer.status_code == 404, answer.text
    assert answer.json() == {
        "error": {
            "message": f"Conversation with id '{conversation.id}' not found.",
            "type": "invalid_request_error",
            "param": "conversation",
            "code": None,
        }
    }
    assert await responses_rows(proxy) == []  # no orphan `incomplete` row


async def test_a_streamed_turn_that_loses_its_conversation_leaves_no_response_row(
    store_url: str, make_proxy: Any
) -> None:
    proxy = await make_proxy(store_url=store_url)
    client = proxy.client()
    conversation = await client.conversations.create(items=[user("hello")])
    release = asyncio.Event()
    proxy.provider.script.append(Reply(text="an answer nobody keeps", release=release))
    body = {
        "model": "gpt-4o-mini",
        "conversation": conversation.id,
        "input": "hi",
        "stream": True,
    }
    async with httpx.AsyncClient(base_url=proxy.base_url, timeout=30) as http:
        turn = asyncio.create_task(http.post("/responses", headers=AUTH, json=body))
        await provider_called(proxy, 1)
        await client.conversations.delete(conversation.id)
        release.set()
        answer = await turn
    assert answer.status_code == 200
    assert '"code":"store_error"' in answer.text.replace(" ", "")
    assert "response.completed" not in answer.text
    assert await responses_rows(proxy) == []


async def test_an_idempotent_retry_after_the_lost_conversation_gets_the_same_404(
    proxy: Proxy,
) -> None:
    """The 404 is an answer about the request (stored like any 4xx): the retry does not
    run the turn again on a conversation that is gone."""
    client = proxy.client()
    conversation = await client.conversations.create(items=[user("hello")])
    release = asyncio.Event()
    proxy.provider.script.append(Reply(text="lost", release=release))
    headers = {**AUTH, "Idempotency-Key": "turn-1"}
    body = {"model": "gpt-4o-mini", "conversation": conversation.id, "input": "hi"}
    async with httpx.AsyncClient(base_url=proxy.base_url, timeout=30) as http:
        turn = asyncio.create_task(http.post("/responses", headers=headers, json=body))
        await provider_called(proxy, 1)
        await client.conversations.delete(conversation.id)
        release.set()
        first = await turn
        again = await http.post("/responses", headers=headers, json=body)
    assert (first.status_code, again.status_code) == (404, 404)
    assert again.json() == first.json()
    assert len(proxy.provider.model_requests) == 1


@pytest.mark.parametrize("streamed", [False, True])
async def test_a_turn_whose_response_row_was_deleted_meanwhile_keeps_nothing(
    proxy: Proxy, streamed: bool
) -> None:
    """DELETE /v1/responses/{id} while it runs: the conversation still exists, so the
    error names the response, and the conversation gains no items."""
    client = proxy.client()
    conversation = await client.conversations.create(items=[user("hello")])
    release = asyncio.Event()
    proxy.provider.script.append(Reply(text="lost", release=release))
    body = {"model": "gpt-4o-mini", "conversation": conversation.id, "input": "hi"}
    if streamed:
        body["stream"] = True
    async with httpx.AsyncClient(base_url=proxy.base_url, timeout=30) as http:
        turn = asyncio.create_task(http.post("/responses", headers=AUTH, json=body))
        await provider_called(proxy, 1)
        [(response_id, _, _)] = await responses_rows(proxy)
        await client.responses.delete(response_id)
        release.set()
        answer = await turn
    if streamed:
        assert '"code":"store_error"' in answer.text.replace(" ", "")
    else:
        assert answer.status_code == 404, answer.text
        assert answer.json()["error"]["message"] == f"Response with id '{response_id}' not found."
    items = await client.conversations.items.list(conversation.id)
    assert len(items.data) == 1
    assert await responses_rows(proxy) == []
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(response_id)
