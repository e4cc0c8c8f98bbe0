"""Calls left without an output (issue 8 item 20): the client received a call, crashed
before answering it, and then wrote again on the same thread. The provider refuses an
unpaired call ("No tool output found for function call ..."; the fake provider does too),
so the proxy answers each dangling call before anything is sent: from the ledger when the
call is side-effecting ("outcome unknown, check first"), else "no output was recorded".
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

import openai
import pytest

from proxy.fake_provider import FakeProvider, Reply

from .conftest import Proxy
from .test_ledger_e2e import (
    CHAT_TOOLS,
    MODEL,
    REFUND,
    RESPONSES_TOOLS,
    ledger_entries,
    tools_policy,
    unknown_outcomes,
)

LOOKUP = ("lookup_order", '{"order_id": "ORD-1"}')  # not side-effecting


@pytest.fixture
async def guarded(make_proxy: Callable[..., Awaitable[Proxy]]) -> Proxy:
    return await make_proxy(acme_extra=tools_policy())


def parsed_output(item: dict[str, Any]) -> dict[str, Any]:
    text = item.get("output", item.get("content"))
    assert isinstance(text, str)
    parsed: dict[str, Any] = json.loads(text)
    return parsed


def sent_input(provider: FakeProvider) -> list[dict[str, Any]]:
    body = provider.model_requests[-1].json
    return list(body.get("input") or body.get("messages"))


@pytest.mark.parametrize("chain", ["conversation", "previous_response_id"])
async def test_side_effecting_call_left_dangling_is_answered_outcome_unknown(
    guarded: Proxy, provider: FakeProvider, chain: str
) -> None:
    client = guarded.client()
    provider.script.append(Reply(tool_calls=[REFUND]))
    first_args: dict[str, Any] = {"model": MODEL, "input": "Refund ORD-1", "tools": RESPONSES_TOOLS}
    if chain == "conversation":
        conversation = await client.conversations.create()
        first_args["conversation"] = conversation.id
    first = await client.responses.create(**first_args)
    [call] = [item for item in first.output if item.type == "function_call"]
    # ...the client crashed here, never running the refund nor reporting it.

    provider.script.append(Reply(text="Let me check the refund first."))
    second_args: dict[str, Any] = {"model": MODEL, "input": "Hello? Did it work?"}
    if chain == "conversation":
        second_args["conversation"] = first_args["conversation"]
    else:
        second_args["previous_response_id"] = first.id
    second = await client.responses.create(**second_args, tools=RESPONSES_TOOLS)

    assert second.output_text == "Let me check the refund first."
    sent = sent_input(provider)
    types = [item.get("type", "message") for item in sent]
    assert types == ["message", "function_call", "function_call_output", "message"]
    answer = sent[2]
    assert answer["call_id"] == call.call_id
    assert parsed_output(answer)["threadkeeper"] == "outcome_unknown"
    assert parsed_output(answer)["idempotency_key"] == "refund:ORD-1"
    assert await unknown_outcomes(guarded) == 1
    [entry] = await ledger_entries(guarded)
    assert entry["status"] == "issued"  # the synthetic answer is not the client's outcome

    # The answer is kept in the thread: the next turn sends the same prefix.
    provider.script.append(Reply(text="ok"))
    third_args = dict(second_args, input="Thanks.")
    if chain == "previous_response_id":
        third_args["previous_response_id"] = second.id
    await client.responses.create(**third_args)
    assert sent_input(provider)[: len(sent) + 1] == [*sent, sent_input(provider)[len(sent)]]
    assert sum(i.get("type") == "function_call_output" for i in sent_input(provider)) == 1


async def test_unguarded_call_left_dangling_is_answered_no_output(
    guarded: Proxy, provider: FakeProvider
) -> None:
    client = guarded.client()
    conversation = await client.conversations.create()
    provider.script.append(Reply(tool_calls=[LOOKUP]))
    first = await client.responses.create(
        model=MODEL, input="Where is ORD-1?", conversation=conversation.id
    )
    [call] = [item for item in first.output if item.type == "function_call"]
    provider.script.append(Reply(text="Sorry, the lookup never came back."))

    await client.responses.create(model=MODEL, input="Never mind.", conversation=conversation.id)

    answer = sent_input(provider)[2]
    assert (answer["type"], answer["call_id"]) == ("function_call_output", call.call_id)
    assert parsed_output(answer)["threadkeeper"] == "no_output"
    assert await ledger_entries(guarded) == []
    items = await client.conversations.items.list(conversation.id, order="asc")
    assert [item.type for item in items.data] == [
        "message",
        "function_call",
        "function_call_output",
        "message",
        "message",
    ]


async def test_chat_thread_dangling_call_is_answered_and_history_still_reconciles(
    guarded: Proxy, provider: FakeProvider
) -> None:
    """A full-history Chat client (LangGraph's checkpointer keeps the AI message with its
    tool_calls) resends the call without a tool message after a crash."""
    client = guarded.client(default_headers={"X-Thread-Id": "support-7"})
    history: list[dict[str, Any]] = [{"role": "user", "content": "Refund ORD-1"}]
    provider.script.append(Reply(tool_calls=[REFUND]))
    first = await client.chat.completions.create(model=MODEL, messages=history, tools=CHAT_TOOLS)
    reply = first.choices[0].message.model_dump(
        exclude_none=True, include={"role", "content", "tool_calls"}
    )
    history += [reply, {"role": "user", "content": "Did it go through?"}]

    provider.script.append(Reply(text="I must check first."))
    second = await client.chat.completions.create(model=MODEL, messages=history, tools=CHAT_TOOLS)

    sent = sent_input(provider)
    assert [m["role"] for m in sent] == ["user", "assistant", "tool", "user"]
    assert sent[2]["tool_call_id"] == reply["tool_calls"][0]["id"]
    assert parsed_output(sent[2])["threadkeeper"] == "outcome_unknown"

    # The client never saw the tool message; its next full history still matches.
    history += [{"role": "assistant", "content": second.choices[0].message.content}]
    history.append({"role": "user", "content": "Thanks."})
    provider.script.append(Reply(text="You're welcome."))
    await client.chat.completions.create(model=MODEL, messages=history, tools=CHAT_TOOLS)
    roles = [m["role"] for m in sent_input(provider)]
    assert roles == ["user", "assistant", "tool", "user", "assistant", "user"]


async def test_stateless_side_effecting_dangling_call_is_answered_from_the_ledger(
    guarded: Proxy, provider: FakeProvider
) -> None:
    client = guarded.client()
    history: list[dict[str, Any]] = [{"role": "user", "content": "Refund ORD-1"}]
    provider.script.append(Reply(tool_calls=[REFUND]))
    first = await client.chat.completions.create(model=MODEL, messages=history, tools=CHAT_TOOLS)
    call = first.choices[0].message.model_dump(exclude_none=True, include={"role", "tool_calls"})
    history += [call, {"role": "user", "content": "Did it go through?"}]
    provider.script.append(Reply(text="I must check first."))

    await client.chat.completions.create(model=MODEL, messages=history, tools=CHAT_TOOLS)

    sent = sent_input(provider)
    assert [m["role"] for m in sent] == ["user", "assistant", "tool", "user"]
    assert parsed_output(sent[2])["threadkeeper"] == "outcome_unknown"
    [entry] = await ledger_entries(guarded)
    assert entry["status"] == "issued"


async def test_stateless_unguarded_dangling_call_gets_the_providers_400(
    guarded: Proxy, provider: FakeProvider
) -> None:
    """A stateless history is the client's own: it is forwarded as sent, as to OpenAI."""
    client = guarded.client()
    call = {"type": "function_call", "call_id": "call_lookup", "name": "lookup_order"}
    given = [
        {"role": "user", "content": "Where is ORD-1?"},
        {**call, "arguments": '{"order_id": "ORD-1"}'},
        {"role": "user", "content": "Never mind."},
    ]
    with pytest.raises(openai.BadRequestError, match="No tool output found"):
        await client.responses.create(model=MODEL, input=given, store=False)
