"""`item_reference` inputs are resolved from the tenant's store (issue 8 item 22a): the
referenced item replaces the reference before budgeting and forwarding, since no provider
but OpenAI knows the reference (and none has the item: the proxy keeps it)."""

from __future__ import annotations

from typing import Any

import openai
import pytest

from proxy.fake_provider import FakeProvider, Reply

from .conftest import Proxy

MODEL = "gpt-4o-mini"


@pytest.fixture
def default_store_url(store_url: str) -> str:
    """Every test here runs on SQLite and on PostgreSQL: the backend changes nothing."""
    return store_url


async def stored_answer(proxy: Proxy, provider: FakeProvider) -> tuple[str, str]:
    """A conversation holding one turn; returns (conversation id, the answer's item id)."""
    client = proxy.client()
    conversation = await client.conversations.create()
    provider.script.append(Reply(text="The capital of France is Paris."))
    answer = await client.responses.create(
        model=MODEL, input="Capital of France?", conversation=conversation.id
    )
    return conversation.id, answer.output[0].id


async def test_reference_is_replaced_by_the_stored_item(
    proxy: Proxy, provider: FakeProvider
) -> None:
    _, item_id = await stored_answer(proxy, provider)
    client = proxy.client()
    given: Any = [
        {"type": "item_reference", "id": item_id},
        {"role": "user", "content": "Say that again."},
    ]

    await client.responses.create(model=MODEL, input=given, store=False)

    referenced, question = provider.model_requests[-1].json["input"]
    assert referenced["type"] == "message" and referenced["role"] == "assistant"
    assert referenced["content"][0]["text"] == "The capital of France is Paris."
    assert "id" not in referenced  # a new occurrence: the provider refuses duplicate ids
    assert question == given[1]


async def test_reference_within_the_same_conversation_is_committed_as_a_copy(
    proxy: Proxy, provider: FakeProvider
) -> None:
    conversation_id, item_id = await stored_answer(proxy, provider)
    client = proxy.client()
    provider.script.append(Reply(text="Paris, again."))
    given: Any = [{"type": "item_reference", "id": item_id}, {"role": "user", "content": "Again?"}]

    await client.responses.create(model=MODEL, input=given, conversation=conversation_id)

    sent = provider.model_requests[-1].json["input"]
    assert [i.get("type", "message") for i in sent] == ["message"] * 4
    assert sent[1]["content"] == sent[2]["content"]  # the answer, then its referenced copy
    items = await client.conversations.items.list(conversation_id, order="asc")
    ids = [item.id for item in items.data]
    assert len(ids) == 5 and len(set(ids)) == 5
    assert items.data[2].type == "message" and items.data[2].role == "assistant"


async def test_input_tokens_count_the_referenced_item(proxy: Proxy, provider: FakeProvider) -> None:
    _, item_id = await stored_answer(proxy, provider)
    client = proxy.client()
    stored = (await client.responses.input_tokens.count(model=MODEL, input="x")).input_tokens
    inline: Any = [
        {"role": "assistant", "content": "The capital of France is Paris."},
        {"role": "user", "content": "x"},
    ]
    referenced: Any = [{"type": "item_reference", "id": item_id}, {"role": "user", "content": "x"}]
    with_item = await client.responses.input_tokens.count(model=MODEL, input=inline)
    with_reference = await client.responses.input_tokens.count(model=MODEL, input=referenced)
    assert with_reference.input_tokens == with_item.input_tokens > stored


@pytest.mark.parametrize("whose", ["unknown", "other tenant"])
async def test_unknown_reference_is_a_404_naming_the_input_and_writes_nothing(
    proxy: Proxy, provider: FakeProvider, whose: str
) -> None:
    conversation_id, item_id = await stored_answer(proxy, provider)
    client = proxy.client() if whose == "unknown" else proxy.client(api_key="sk-someone-else")
    target = await client.conversations.create() if whose != "unknown" else None
    conversation = target.id if target is not None else conversation_id
    reference = item_id if whose == "other tenant" else "msg_does_not_exist"
    before = len(provider.model_requests)
    given: Any = [{"role": "user", "content": "hi"}, {"type": "item_reference", "id": reference}]

    with pytest.raises(openai.NotFoundError) as raised:
        await client.responses.create(model=MODEL, input=given, conversation=conversation)

    assert raised.value.status_code == 404
    error = raised.value.body
    assert isinstance(error, dict) and error["param"] == "input[1]"
    assert reference in error["message"]
    assert len(provider.model_requests) == before
    items = await client.conversations.items.list(conversation)
    assert len(items.data) == (2 if whose == "unknown" else 0)
