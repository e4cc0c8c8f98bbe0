"""Chat Completions with X-Thread-Id: the proxy keeps the history (openai SDK client)."""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest

from proxy.fake_provider import Reply
from proxy.server.state import STORE
from proxy.store.base import Store

from .conftest import TENANT_KEY, Proxy

SYSTEM = {"role": "system", "content": "You track orders."}


@pytest.fixture
def default_store_url(store_url: str) -> str:
    """Every test here runs on SQLite and on PostgreSQL: the backend changes nothing."""
    return store_url


def store_of(proxy: Proxy) -> Store:
    return proxy.app[STORE]  # type: ignore[index]


def thread(thread_id: str) -> dict[str, Any]:
    return {"extra_headers": {"X-Thread-Id": thread_id}}


def sent_messages(proxy: Proxy) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = proxy.provider.model_requests[-1].json["messages"]
    return messages


async def test_full_history_and_only_new_clients_give_the_provider_the_same_history(
    proxy: Proxy,
) -> None:
    client = proxy.client()
    questions = ["Where is ORD-1?", "And ORD-2?", "Which was first?"]
    full: list[dict[str, Any]] = [SYSTEM]
    provider_saw: dict[str, list[list[dict[str, Any]]]] = {"full": [], "new": []}
    for turn, question in enumerate(questions):
        full.append({"role": "user", "content": question})
        reply = await client.chat.completions.create(
            model="gpt-4o", messages=full, **thread("t-full")
        )
        provider_saw["full"].append(sent_messages(proxy))
        full.append({"role": "assistant", "content": reply.choices[0].message.content})

        only_new = [SYSTEM] if turn == 0 else []
        await client.chat.completions.create(
            model="gpt-4o",
            messages=[*only_new, {"role": "user", "content": question}],
            **thread("t-new"),
        )
        provider_saw["new"].append(sent_messages(proxy))
    assert provider_saw["full"] == provider_saw["new"]
    assert [m["content"] for m in provider_saw["new"][-1]] == [
        SYSTEM["content"],
        questions[0],
        "ok: Where is ORD-1?",
        questions[1],
        "ok: And ORD-2?",
        questions[2],
    ]
    window = await store_of(proxy).load_window("acme", "t-new")
    assert window is not None and len(window.items) == 7


async def test_streamed_reply_is_kept_in_the_thread(proxy: Proxy) -> None:
    client = proxy.client()
    stream = await client.chat.completions.create(
        model="gpt-4o",
        messages=[{"role": "user", "content": "Stream please."}],
        stream=True,
        **thread("t-stream"),
    )
    text = "".join(
        [chunk.choices[0].delta.content or "" async for chunk in stream if chunk.choices]
    )
    await client.chat.completions.create(
        model="gpt-4o", messages=[{"role": "user", "content": "Again."}], **thread("t-stream")
    )
    assert sent_messages(proxy) == [
        {"role": "user", "content": "Stream please."},
        {"role": "assistant", "content": text},
        {"role": "user", "content": "Again."},
    ]


async def test_threaded_stream_ending_without_a_blank_line_delivers_done_and_commits(
    proxy: Proxy,
) -> None:
    # Regression (issue 9, drift bug 1): the kept-stream relay did not flush its decoder,
    # so `data: [DONE]\n` at EOF never reached the client and the turn was not committed.
    def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
        choice = {"index": 0, "delta": delta, "finish_reason": finish}
        body = {"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": "m"}
        return f"data: {json.dumps({**body, 'choices': [choice]})}\n\n".encode()

    frames = [
        chunk({"role": "assistant", "content": "Shipped."}),
        chunk({}, "stop"),
        b"data: [DONE]\n",  # some compatible servers end right after the sentinel
    ]
    proxy.provider.script.append(Reply(frames=frames))
    question = {"role": "user", "content": "Where is ORD-1?"}
    headers = {"Authorization": f"Bearer {TENANT_KEY}", "X-Thread-Id": "t-no-blank"}
    body = {"model": "gpt-4o", "messages": [question], "stream": True}
    async with proxy.http() as http:
        response = await http.post("/v1/chat/completions", json=body, headers=headers)
    assert response.status_code == 200
    assert response.content.endswith(b"data: [DONE]\n\n")
    window = await store_of(proxy).load_window("acme", "t-no-blank")
    assert window is not None
    assert [item.raw for item in window.items] == [
        question,
        {"role": "assistant", "content": "Shipped."},
    ]


async def test_tool_calls_round_trip_through_the_thread(proxy: Proxy) -> None:
    client = proxy.client()
    proxy.provider.script.append(Reply(tool_calls=[("get_order", '{"id": 1}')]))
    first = await client.chat.completions.create(
        model="gpt-4o", messages=[{"role": "user", "content": "Order 1?"}], **thread("t-tools")
    )
    call_id = first.choices[0].message.tool_calls[0].id  # type: ignore[index]
    await client.chat.completions.create(
        model="gpt-4o",
        messages=[{"role": "tool", "tool_call_id": call_id, "content": "shipped"}],
        **thread("t-tools"),
    )
    roles = [m["role"] for m in sent_messages(proxy)]
    assert roles == ["user", "assistant", "tool"]
    assert sent_messages(proxy)[1]["tool_calls"][0]["id"] == call_id


async def test_orphan_tool_message_is_400_and_changes_nothing(proxy: Proxy) -> None:
    client = proxy.client()
    await client.chat.completions.create(
        model="gpt-4o", messages=[{"role": "user", "content": "hi"}], **thread("t-orphan")
    )
    before = await store_of(proxy).load_window("acme", "t-orphan")
    with pytest.raises(openai.BadRequestError) as caught:
        await client.chat.completions.create(
            model="gpt-4o",
            messages=[{"role": "tool", "tool_call_id": "call_nope", "content": "x"}],
            **thread("t-orphan"),
        )
    assert caught.value.body["param"] == "messages"  # type: ignore[index]
    assert await store_of(proxy).load_window("acme", "t-orphan") == before
    assert len(proxy.provider.model_requests) == 1


async def test_threads_are_tenant_scoped(proxy: Proxy) -> None:
    acme, other = proxy.client(), proxy.client(api_key="sk-unknown-tenant-key")
    await acme.chat.completions.create(
        model="gpt-4o", messages=[{"role": "user", "content": "secret plan"}], **thread("shared")
    )
    await other.chat.completions.create(
        model="gpt-4o", messages=[{"role": "user", "content": "hello"}], **thread("shared")
    )
    assert sent_messages(proxy) == [{"role": "user", "content": "hello"}]


async def test_without_the_header_chat_stays_stateless(proxy: Proxy) -> None:
    client = proxy.client()
    await client.chat.completions.create(
        model="gpt-4o", messages=[{"role": "user", "content": "one"}]
    )
    await client.chat.completions.create(
        model="gpt-4o", messages=[{"role": "user", "content": "two"}]
    )
    assert sent_messages(proxy) == [{"role": "user", "content": "two"}]
