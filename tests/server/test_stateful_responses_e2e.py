"""Stateful Responses through the proxy (conversation, previous_response_id, stored
responses) with the openai SDK and a fake provider, on SQLite and on PostgreSQL."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import openai
import pytest

from proxy.core.memory import SUMMARY_MARKER
from proxy.fake_provider import Reply, response_object
from proxy.server.state import STORE
from proxy.store.base import Store

from .conftest import Proxy

TENANT = "acme"


@pytest.fixture
def default_store_url(store_url: str) -> str:
    """Every test here runs on SQLite and on PostgreSQL: the backend changes nothing."""
    return store_url


def store_of(proxy: Proxy) -> Store:
    return proxy.app[STORE]  # type: ignore[index]


def upstream(proxy: Proxy, index: int = -1) -> dict[str, Any]:
    body: dict[str, Any] = proxy.provider.model_requests[index].json
    return body


def texts(items: list[dict[str, Any]]) -> list[str]:
    """The text of each message item, in order (other items by type)."""
    out = []
    for item in items:
        content = item.get("content")
        if isinstance(content, str):
            out.append(content)
        elif isinstance(content, list):
            out.append("".join(part.get("text", "") for part in content))
        else:
            out.append(str(item.get("type")))
    return out


async def conversation_items(proxy: Proxy, conversation_id: str) -> list[str]:
    page = await store_of(proxy).list_items(TENANT, conversation_id, limit=100, order="asc")
    return [item.item_id for item in page.items]


async def test_conversation_turns_carry_history_and_forward_stateless(proxy: Proxy) -> None:
    client = proxy.client()
    conversation = await client.conversations.create()
    first = await client.responses.create(
        model="gpt-4o", conversation=conversation.id, input="My order is ORD-7."
    )
    assert first.conversation is not None and first.conversation.id == conversation.id
    second = await client.responses.with_raw_response.create(
        model="gpt-4o", conversation={"id": conversation.id}, input="Which order was it?"
    )
    sent = upstream(proxy)
    assert "conversation" not in sent and "previous_response_id" not in sent
    assert sent["store"] is False
    assert texts(sent["input"]) == [
        "My order is ORD-7.",
        first.output_text,
        "Which order was it?",
    ]
    assert int(second.headers["x-threadkeeper-context-tokens"]) > 0
    assert "x-threadkeeper-trimmed" in second.headers
    assert len(await conversation_items(proxy, conversation.id)) == 4
    stored = await store_of(proxy).get_response(TENANT, second.parse().id)
    assert stored is not None and stored.status == "completed"


async def test_streamed_conversation_turn_is_kept_whole(proxy: Proxy) -> None:
    client = proxy.client()
    conversation = await client.conversations.create()
    stream = await client.responses.create(
        model="gpt-4o", conversation=conversation.id, input="Stream me a hello.", stream=True
    )
    events = [event async for event in stream]
    final = events[-1].response  # type: ignore[union-attr]
    assert events[0].response.id == final.id  # type: ignore[union-attr]
    fetched = await client.responses.retrieve(final.id)
    assert fetched.status == "completed" and fetched.output_text == final.output_text
    await client.responses.create(model="gpt-4o", conversation=conversation.id, input="Again.")
    sent = upstream(proxy)
    assert texts(sent["input"]) == ["Stream me a hello.", final.output_text, "Again."]
    assert sent["store"] is False and "conversation" not in sent


async def test_reasoning_model_gets_encrypted_reasoning_and_replays_it(proxy: Proxy) -> None:
    client = proxy.client()
    answer = response_object({"model": "o4-mini"}, Reply(text="Thought about it."))
    reasoning = {
        "id": "rs_1",
        "type": "reasoning",
        "summary": [],
        "encrypted_content": "gAAAA-secret-chain-of-thought",
    }
    answer["output"].insert(0, reasoning)
    proxy.provider.script.append(Reply(body=answer))
    first = await client.responses.create(
        model="o4-mini", input="Think.", include=["message.output_text.logprobs"]
    )
    assert upstream(proxy)["include"] == [
        "message.output_text.logprobs",
        "reasoning.encrypted_content",
    ]
    await client.responses.create(model="o4-mini", previous_response_id=first.id, input="More.")
    replayed = upstream(proxy)["input"]
    assert reasoning in replayed
    assert replayed.index(reasoning) == 1  # after the first user message, before the answer


async def test_previous_response_chain_of_three_turns(proxy: Proxy) -> None:
    client = proxy.client()
    one = await client.responses.create(model="gpt-4o", input="one", instructions="Be terse.")
    two = await client.responses.create(model="gpt-4o", previous_response_id=one.id, input="two")
    assert "instructions" not in upstream(proxy)  # instructions are not carried over
    three = await client.responses.create(
        model="gpt-4o", previous_response_id=two.id, input="three"
    )
    assert three.previous_response_id == two.id
    sent = upstream(proxy)
    assert "previous_response_id" not in sent and sent["store"] is False
    assert texts(sent["input"]) == ["one", one.output_text, "two", two.output_text, "three"]


async def test_branches_of_a_chain_never_see_each_other(proxy: Proxy) -> None:
    client = proxy.client()
    root = await client.responses.create(model="gpt-4o", input="root")
    left = await client.responses.create(model="gpt-4o", previous_response_id=root.id, input="L")
    right = await client.responses.create(model="gpt-4o", previous_response_id=root.id, input="R")
    assert texts(upstream(proxy)["input"]) == ["root", root.output_text, "R"]
    await client.responses.create(model="gpt-4o", previous_response_id=left.id, input="L2")
    assert texts(upstream(proxy)["input"]) == [
        "root",
        root.output_text,
        "L",
        left.output_text,
        "L2",
    ]
    await client.responses.create(model="gpt-4o", previous_response_id=right.id, input="R2")
    assert texts(upstream(proxy)["input"]) == [
        "root",
        root.output_text,
        "R",
        right.output_text,
        "R2",
    ]


async def test_unknown_previous_response_is_400(proxy: Proxy) -> None:
    client = proxy.client()
    with pytest.raises(openai.BadRequestError) as caught:
        await client.responses.create(model="gpt-4o", previous_response_id="resp_nope", input="x")
    error = caught.value.body
    assert isinstance(error, dict)
    assert error["code"] == "previous_response_not_found"
    assert error["param"] == "previous_response_id"
    assert error["message"] == "Previous response with id 'resp_nope' not found."
    assert proxy.provider.model_requests == []


async def test_unknown_conversation_is_404(proxy: Proxy) -> None:
    client = proxy.client()
    with pytest.raises(openai.NotFoundError) as caught:
        await client.responses.create(model="gpt-4o", conversation="conv_nope", input="x")
    assert caught.value.body == {
        "message": "Conversation with id 'conv_nope' not found.",
        "type": "invalid_request_error",
        "param": "conversation",
        "code": None,
    }
    assert proxy.provider.model_requests == []


async def test_orphan_tool_output_is_400_and_changes_nothing(proxy: Proxy) -> None:
    client = proxy.client()
    conversation = await client.conversations.create()
    await client.responses.create(model="gpt-4o", conversation=conversation.id, input="hi")
    before = await store_of(proxy).get_thread(TENANT, conversation.id)
    orphan = {"type": "function_call_output", "call_id": "call_nope", "output": "done"}
    with pytest.raises(openai.BadRequestError) as caught:
        await client.responses.create(model="gpt-4o", conversation=conversation.id, input=[orphan])
    error = caught.value.body
    assert isinstance(error, dict) and error["param"] == "input"
    assert error["message"] == "No tool call found for function call output with call_id call_nope."
    assert await store_of(proxy).get_thread(TENANT, conversation.id) == before
    assert len(proxy.provider.model_requests) == 1


async def test_tool_output_answering_a_stored_call_is_accepted(proxy: Proxy) -> None:
    client = proxy.client()
    proxy.provider.script.append(Reply(tool_calls=[("get_order", '{"id": 7}')]))
    first = await client.responses.create(model="gpt-4o", input="Look up order 7.")
    call = first.output[0]
    assert call.type == "function_call"
    output = {"type": "function_call_output", "call_id": call.call_id, "output": "shipped"}
    await client.responses.create(model="gpt-4o", previous_response_id=first.id, input=[output])
    assert [item.get("type") for item in upstream(proxy)["input"]][-2:] == [
        "function_call",
        "function_call_output",
    ]


async def test_store_false_persists_nothing(proxy: Proxy) -> None:
    client = proxy.client()
    response = await client.responses.create(model="gpt-4o", input="forget me", store=False)
    assert upstream(proxy)["store"] is False
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(response.id)
    assert await store_of(proxy).get_response(TENANT, response.id) is None


async def test_get_delete_and_input_items(proxy: Proxy) -> None:
    client = proxy.client()
    created = await client.responses.create(
        model="gpt-4o",
        input=[
            {"role": "user", "content": "first"},
            {"role": "user", "content": "second"},
            {"role": "user", "content": "third"},
        ],
    )
    fetched = await client.responses.retrieve(created.id)
    assert fetched.id == created.id and fetched.output_text == created.output_text
    assert fetched.store is True

    listed = await client.responses.input_items.list(created.id)
    assert texts([item.model_dump() for item in listed.data]) == ["third", "second", "first"]
    assert all(item.id and item.type == "message" for item in listed.data)
    page = await client.responses.input_items.list(created.id, order="asc", limit=2)
    assert texts([i.model_dump() for i in page.data]) == ["first", "second"]
    assert page.has_more is True and page.last_id == page.data[-1].id
    rest = await client.responses.input_items.list(
        created.id, order="asc", limit=2, after=page.last_id
    )
    assert texts([i.model_dump() for i in rest.data]) == ["third"] and rest.has_more is False

    other_tenant = proxy.client(api_key="sk-some-other-tenant")
    with pytest.raises(openai.NotFoundError):
        await other_tenant.responses.retrieve(created.id)
    with pytest.raises(openai.NotFoundError):
        await other_tenant.responses.delete(created.id)

    async with proxy.http() as http:
        deleted = await http.delete(
            f"/v1/responses/{created.id}", headers={"Authorization": "Bearer sk-tk-acme-test-key"}
        )
    assert deleted.json() == {"id": created.id, "object": "response", "deleted": True}
    with pytest.raises(openai.NotFoundError) as caught:
        await client.responses.retrieve(created.id)
    assert caught.value.body["message"] == f"Response with id '{created.id}' not found."  # type: ignore[index]


async def test_client_disconnect_mid_stream_leaves_response_incomplete(proxy: Proxy) -> None:
    client = proxy.client()
    conversation = await client.conversations.create()
    items_before = await conversation_items(proxy, conversation.id)
    words = " ".join(f"word{i}" for i in range(40))
    proxy.provider.script.append(Reply(text=words, stream_chunk_delay=0.2))
    body = {"model": "gpt-4o", "conversation": conversation.id, "input": "talk", "stream": True}
    headers = {"Authorization": "Bearer sk-tk-acme-test-key"}
    async with proxy.http() as http:
        async with http.stream("POST", "/v1/responses", json=body, headers=headers) as reply:
            first_line = ""
            async for line in reply.aiter_lines():
                if line.startswith("data: "):
                    first_line = line
                    break
    response_id = json.loads(first_line.removeprefix("data: "))["response"]["id"]
    status = await _settled_status(proxy, response_id)
    assert status == "incomplete"
    assert await conversation_items(proxy, conversation.id) == items_before


async def _settled_status(proxy: Proxy, response_id: str) -> str:
    """The response's status once the proxy noticed the disconnect (bounded wait)."""
    stored = None
    for _ in range(200):
        stored = await store_of(proxy).get_response(TENANT, response_id)
        if stored is not None and stored.status != "in_progress":
            break
        await asyncio.sleep(0.05)
    assert stored is not None
    return stored.status


async def test_provider_error_leaves_response_incomplete(proxy: Proxy) -> None:
    client = proxy.client()
    root = await client.responses.create(model="gpt-4o", input="root")
    proxy.provider.script.append(Reply(status=400, text="Bad things."))
    with pytest.raises(openai.BadRequestError):
        await client.responses.create(model="gpt-4o", previous_response_id=root.id, input="x")
    await client.responses.create(model="gpt-4o", previous_response_id=root.id, input="y")
    assert texts(upstream(proxy)["input"]) == ["root", root.output_text, "y"]


def tool_turn(turn: int) -> list[dict[str, Any]]:
    log = [f"shipment event {i} for ORD-{turn}: scanned at depot {i % 7}" for i in range(60)]
    return [
        {"role": "user", "content": f"Check order ORD-{turn}."},
        {
            "type": "function_call",
            "call_id": f"call_{turn}",
            "name": "get_order",
            "arguments": json.dumps({"order_id": f"ORD-{turn}"}),
        },
        {
            "type": "function_call_output",
            "call_id": f"call_{turn}",
            "output": json.dumps({"status": "shipped", "log": log}),
        },
    ]


# Enough turns that compressing their logs (SPEC 5 step 1) no longer makes them fit.
TURNS = 24


async def test_long_conversation_is_rebuilt_under_budget_with_a_stable_prefix(make_proxy) -> None:  # type: ignore[no-untyped-def]
    proxy = await make_proxy(window=6000)
    client = proxy.client()
    conversation = await client.conversations.create()
    trimmed = []
    for turn in range(TURNS):
        raw = await client.responses.with_raw_response.create(
            model="gpt-4o", conversation=conversation.id, input=tool_turn(turn)
        )
        assert int(raw.headers["x-threadkeeper-context-tokens"]) <= 6000
        trimmed.append(
            raw.headers["x-threadkeeper-trimmed"] != "dropped=0, compressed=0, summarized=0"
        )
    assert trimmed[-1]
    sent = [r.json["input"] for r in proxy.provider.model_requests]
    # Every request is a rebuild: the current turn always ends it, whole.
    assert all(inputs[-3:] == tool_turn(turn) for turn, inputs in enumerate(sent))
    # The summary stands after the opening head (the thread's first turns as they were
    # last sent, when they fit keep_opening_share), so look for it in any message.
    summarized = [
        turn
        for turn, inputs in enumerate(sent)
        if any(SUMMARY_MARKER in text for text in texts(inputs))
    ]
    assert summarized and len(sent[summarized[0]]) < len(sent[summarized[0] - 1])
    # The cut is sticky: later turns send the same summary and the same items after it
    # (the provider's cached prefix), until the budget forces the next cut.
    first, after = sent[summarized[0]], sent[summarized[0] + 1]
    assert after[: len(first)] == first
    assert len(await conversation_items(proxy, conversation.id)) == TURNS * 4
