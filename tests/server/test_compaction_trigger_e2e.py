"""A final `compaction_trigger` input item, and `responses/compact` of an empty history
(issue 24, item 3), through the real socket with the real `openai` SDK: the answer is a
Response whose output is one compaction item, served by the proxy (the provider gets no
request), stored like any response and read by later turns as its summary."""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest

from proxy.core.compaction import BLOB_PREFIX
from proxy.core.memory import SUMMARY_MARKER

from .conftest import Proxy
from .test_compaction_e2e import history, sent_item_types


@pytest.fixture
def default_store_url(store_url: str) -> str:
    """Every test here runs on SQLite and on PostgreSQL: the backend changes nothing."""
    return store_url


TRIGGER = {"type": "compaction_trigger"}


def dumped(response: Any) -> list[dict[str, Any]]:
    return [o.model_dump(exclude_unset=True, warnings=False) for o in response.output]


def assert_one_compaction(response: Any) -> dict[str, Any]:
    output = dumped(response)
    assert [o["type"] for o in output] == ["compaction"]
    assert output[0]["id"].startswith("cmp_")
    assert output[0]["encrypted_content"].startswith(BLOB_PREFIX)
    assert response.status == "completed" and response.object == "response"
    assert response.usage.input_tokens > 0 and response.usage.output_tokens > 0
    return output[0]


def never_forwarded(proxy: Proxy) -> None:
    assert TRIGGER["type"] not in json.dumps([r.json for r in proxy.provider.model_requests])


async def test_a_final_trigger_is_answered_with_a_compaction_and_no_provider_request(
    proxy: Proxy,
) -> None:
    client = proxy.client()
    answer = await client.responses.create(
        model="gpt-4o",
        input=[*history(3), TRIGGER],  # type: ignore[list-item]
        store=False,
    )
    item = assert_one_compaction(answer)
    assert proxy.provider.model_requests == []
    # The same compaction `responses/compact` makes of that history (one code path).
    compacted = await client.responses.compact(model="gpt-4o", input=history(3))  # type: ignore[arg-type]
    assert dumped(compacted)[-1] == item

    # Sent back with a new message, it reaches the provider as its summary text.
    follow = await client.responses.create(
        model="gpt-4o",
        input=[item, {"role": "user", "content": "What was refunded?"}],  # type: ignore[list-item]
        store=False,
    )
    assert follow.output_text
    sent = proxy.provider.model_requests[-1].json
    developer = [i for i in sent["input"] if i.get("role") == "developer"]
    assert developer[0]["content"].startswith(SUMMARY_MARKER)
    assert "ORD-7731" in developer[0]["content"]
    never_forwarded(proxy)


async def test_a_trigger_on_a_response_chain_is_stored_and_continued(proxy: Proxy) -> None:
    client = proxy.client()
    first = await client.responses.create(model="gpt-4o", input=history(4))  # type: ignore[arg-type]
    asked = len(proxy.provider.model_requests)
    second = await client.responses.create(
        model="gpt-4o",
        previous_response_id=first.id,
        input=[{"role": "user", "content": "Ship it to Lyon."}, TRIGGER],  # type: ignore[list-item]
    )
    item = assert_one_compaction(second)
    assert len(proxy.provider.model_requests) == asked  # served here
    assert second.previous_response_id == first.id and second.id != first.id

    stored = await client.responses.retrieve(second.id)
    assert dumped(stored) == [item]
    inputs = [
        i.model_dump(exclude_unset=True) async for i in client.responses.input_items.list(second.id)
    ]
    assert [i.get("role") for i in inputs] == ["user"]  # the trigger is no history

    third = await client.responses.create(
        model="gpt-4o", previous_response_id=second.id, input="Where does it go?"
    )
    assert third.output_text
    sent = proxy.provider.model_requests[-1].json["input"]
    roles = [i.get("role") for i in sent]
    assert roles.count("developer") == 1 and "assistant" not in roles  # the summary stands
    assert "ORD-7731" in json.dumps(sent)
    assert "Ship it to Lyon." in json.dumps(sent)  # user messages stay verbatim
    assert "compaction" not in sent_item_types(proxy.provider)
    never_forwarded(proxy)


async def test_a_trigger_in_a_conversation_keeps_the_compaction_item(proxy: Proxy) -> None:
    client = proxy.client()
    conversation = await client.conversations.create(items=history(3))  # type: ignore[arg-type]
    answer = await client.responses.create(
        model="gpt-4o",
        conversation=conversation.id,
        input=[TRIGGER],  # type: ignore[list-item]
    )
    item = assert_one_compaction(answer)
    assert proxy.provider.model_requests == []
    listed = [
        i.model_dump(exclude_unset=True, warnings=False)
        async for i in client.conversations.items.list(conversation.id, order="asc")
    ]
    assert listed[-1]["type"] == "compaction"
    assert listed[-1]["encrypted_content"] == item["encrypted_content"]

    await client.responses.create(
        model="gpt-4o", conversation=conversation.id, input="And the refund?"
    )
    sent = proxy.provider.model_requests[-1].json["input"]
    assert [i.get("role") for i in sent].count("developer") == 1
    assert "compaction" not in sent_item_types(proxy.provider)
    assert "ORD-7731" in json.dumps(sent)


async def test_a_streamed_trigger_gets_the_item_events_and_completes(proxy: Proxy) -> None:
    client = proxy.client()
    events = []
    async with await client.responses.create(
        model="gpt-4o",
        input=[*history(2), TRIGGER],  # type: ignore[list-item]
        stream=True,
    ) as stream:
        async for event in stream:
            events.append(event)
    kinds = [e.type for e in events]
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e.sequence_number for e in events] == list(range(5))
    assert events[2].item.type == "compaction" and events[2].output_index == 0
    completed = events[-1].response
    assert [o.type for o in completed.output] == ["compaction"]
    assert proxy.provider.model_requests == []
    stored = await client.responses.retrieve(completed.id)
    assert stored.status == "completed" and [o.type for o in stored.output] == ["compaction"]


@pytest.mark.parametrize("where", [0, 1])
async def test_a_trigger_that_is_not_last_is_a_400_naming_it(proxy: Proxy, where: int) -> None:
    client = proxy.client()
    given: list[Any] = [{"role": "user", "content": "hi"}, {"role": "user", "content": "more"}]
    given.insert(where, TRIGGER)
    with pytest.raises(openai.BadRequestError) as caught:
        await client.responses.create(model="gpt-4o", input=given)
    error = caught.value.body
    assert isinstance(error, dict)
    assert error["param"] == f"input[{where}]" and "final input item" in error["message"]
    with pytest.raises(openai.BadRequestError) as compact:
        await client.responses.compact(model="gpt-4o", input=given)
    assert isinstance(compact.value.body, dict) and compact.value.body["param"] == f"input[{where}]"
    assert proxy.provider.model_requests == []


async def test_compact_with_neither_input_nor_previous_response_is_an_empty_compaction(
    proxy: Proxy,
) -> None:
    client = proxy.client()
    compacted = await client.responses.compact(model="gpt-4o")
    assert compacted.object == "response.compaction"
    output = dumped(compacted)
    assert [o["type"] for o in output] == ["compaction"]
    assert output[0]["encrypted_content"].startswith(BLOB_PREFIX)
    # It opens for the tenant and stands for nothing: a turn that sends it back works.
    answer = await client.responses.create(
        model="gpt-4o",
        input=[output[0], {"role": "user", "content": "hello"}],  # type: ignore[list-item]
        store=False,
    )
    assert answer.output_text
    assert proxy.provider.model_requests[-1].json["input"][-1] == {
        "role": "user",
        "content": "hello",
    }


async def test_a_pending_approval_is_never_compacted_away(proxy: Proxy) -> None:
    """A pending action (SPEC 5): `responses/compact` keeps it in its output beside the
    user messages, and a compaction that a trigger makes does not stand for it."""
    client = proxy.client()
    pending = {
        "type": "mcp_approval_request",
        "id": "mcpr_3",
        "server_label": "shop",
        "name": "refund",
        "arguments": '{"order": "ORD-3"}',
    }
    given = [*history(2), pending, {"role": "user", "content": "Wait for my approval."}]
    compacted = await client.responses.compact(model="gpt-4o", input=given)  # type: ignore[arg-type]
    output = dumped(compacted)
    assert pending in output and output[-1]["type"] == "compaction"
    assert output.index(pending) < len(output) - 1

    first = await client.responses.create(model="gpt-4o", input=given)  # type: ignore[arg-type]
    second = await client.responses.create(
        model="gpt-4o",
        previous_response_id=first.id,
        input=[TRIGGER],  # type: ignore[list-item]
    )
    assert_one_compaction(second)
    await client.responses.create(model="gpt-4o", previous_response_id=second.id, input="Go.")
    sent = proxy.provider.model_requests[-1].json["input"]
    assert pending in sent  # verbatim, beside the compaction's summary
    assert [i.get("role") for i in sent].count("developer") == 1
