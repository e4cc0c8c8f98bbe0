"""A call restored from the ledger keeps its kind (issue 8 item 22b): the output of a
call the thread never saw (its turn was cut off, or it was made statelessly) brings the
call back from the ledger, and a custom tool's call must come back as a custom tool call,
not as a function call the provider would not pair with a custom tool output."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from proxy.fake_provider import FakeProvider, Reply, chat_completion, response_object

from .conftest import Proxy
from .test_ledger_e2e import MODEL, ledger_entries, tools_policy


@pytest.fixture
async def guarded(make_proxy: Callable[..., Awaitable[Proxy]]) -> Proxy:
    return await make_proxy(acme_extra=tools_policy())


def custom_responses_answer() -> dict[str, Any]:
    answer = response_object({"model": MODEL}, Reply())
    call = {
        "id": "ctc_1",
        "type": "custom_tool_call",
        "status": "completed",
        "call_id": "call_custom_1",
        "name": "refund_order",
        "input": "ORD-1 full amount",
    }
    return {**answer, "output": [call]}


def custom_chat_answer() -> dict[str, Any]:
    answer = chat_completion({"model": MODEL, "messages": []}, Reply())
    call = {
        "id": "call_custom_2",
        "type": "custom",
        "custom": {"name": "refund_order", "input": "ORD-2 full amount"},
    }
    message = {"role": "assistant", "content": None, "tool_calls": [call]}
    choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": "tool_calls"}
    return {**answer, "choices": [choice]}


async def test_responses_custom_tool_call_is_restored_as_custom(
    guarded: Proxy, provider: FakeProvider
) -> None:
    client = guarded.client()
    tools: Any = [{"type": "custom", "name": "refund_order"}]
    provider.script.append(Reply(body=custom_responses_answer()))
    first = await client.responses.create(model=MODEL, input="Refund", tools=tools, store=False)
    assert [item.type for item in first.output] == ["custom_tool_call"]
    conversation = await client.conversations.create()
    output = {"type": "custom_tool_call_output", "call_id": "call_custom_1", "output": "done"}
    provider.script.append(Reply(text="Refunded."))

    await client.responses.create(
        model=MODEL, conversation=conversation.id, input=[output], tools=tools
    )

    restored, answered = provider.model_requests[-1].json["input"]
    assert restored == {
        "type": "custom_tool_call",
        "call_id": "call_custom_1",
        "name": "refund_order",
        "input": "ORD-1 full amount",
    }
    assert answered == output
    [entry] = await ledger_entries(guarded)
    assert (entry["status"], entry["result"]) == ("completed", "done")


async def test_chat_custom_tool_call_is_restored_as_custom(
    guarded: Proxy, provider: FakeProvider
) -> None:
    client = guarded.client()
    tools: Any = [{"type": "custom", "custom": {"name": "refund_order"}}]
    provider.script.append(Reply(body=custom_chat_answer()))
    await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Refund"}], tools=tools
    )
    provider.script.append(Reply(text="Refunded."))
    threaded = guarded.client(default_headers={"X-Thread-Id": "restored-chat"})
    tool_message = {"role": "tool", "tool_call_id": "call_custom_2", "content": "done"}

    await threaded.chat.completions.create(model=MODEL, messages=[tool_message], tools=tools)

    restored, answered = provider.model_requests[-1].json["messages"]
    assert restored["tool_calls"] == [
        {
            "id": "call_custom_2",
            "type": "custom",
            "custom": {"name": "refund_order", "input": "ORD-2 full amount"},
        }
    ]
    assert answered == tool_message
