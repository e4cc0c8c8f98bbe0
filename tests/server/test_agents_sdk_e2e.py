"""The OpenAI Agents SDK through the proxy, as docs/integrations.md describes it: its
Conversations session and its previous_response_id chain both work in front of a provider
that stores nothing, and a tool call runs once with its result sent back."""

from __future__ import annotations

import json
from typing import Any

from agents import (
    Agent,
    OpenAIConversationsSession,
    OpenAIResponsesModel,
    Runner,
    function_tool,
    set_tracing_disabled,
)

from proxy.fake_provider import FakeProvider, Reply

from .conftest import Proxy

set_tracing_disabled(True)  # the SDK would otherwise export its traces to OpenAI

LOOKUPS: list[str] = []


@function_tool
def order_status(order_id: str) -> str:
    """The status of an order."""
    LOOKUPS.append(order_id)
    return json.dumps({"order_id": order_id, "status": "shipped"})


def agent_for(proxy: Proxy) -> Agent[Any]:
    model = OpenAIResponsesModel(model="gpt-4o", openai_client=proxy.client())
    return Agent(
        name="support", instructions="You track orders.", model=model, tools=[order_status]
    )


def input_texts(request_json: dict[str, Any]) -> list[str]:
    texts = []
    for item in request_json["input"]:
        content = item.get("content")
        if isinstance(content, str):
            texts.append(content)
        elif isinstance(content, list):
            texts += [part.get("text", "") for part in content if isinstance(part, dict)]
        elif item.get("type") == "function_call_output":
            texts.append(item["output"])
    return texts


async def test_a_conversations_session_keeps_the_thread_in_the_proxy(
    proxy: Proxy, provider: FakeProvider
) -> None:
    LOOKUPS.clear()
    session = OpenAIConversationsSession(openai_client=proxy.client())
    agent = agent_for(proxy)
    provider.script += [
        Reply(tool_calls=[("order_status", '{"order_id": "ORD-7"}')]),
        Reply(text="ORD-7 has shipped."),
        Reply(text="You asked about ORD-7."),
    ]
    first = await Runner.run(agent, "Where is ORD-7?", session=session)
    assert first.final_output == "ORD-7 has shipped."
    second = await Runner.run(agent, "Which order did I ask about?", session=session)
    assert second.final_output == "You asked about ORD-7."
    assert LOOKUPS == ["ORD-7"]

    last = provider.model_requests[-1].json
    assert last.get("store") is False and "conversation" not in last
    texts = input_texts(last)
    assert texts[0] == "Where is ORD-7?"
    assert any('"status": "shipped"' in text for text in texts)
    assert texts[-1] == "Which order did I ask about?"
    items = await session.get_items()
    assert [i.get("role") or i.get("type") for i in items] == [
        "user", "function_call", "function_call_output", "assistant", "user", "assistant",
    ]  # fmt: skip


async def test_previous_response_id_chains_through_the_proxy(
    proxy: Proxy, provider: FakeProvider
) -> None:
    agent = agent_for(proxy)
    provider.script += [Reply(text="Noted: deliver to Berlin."), Reply(text="Berlin.")]
    first = await Runner.run(agent, "Deliver to Berlin, please.")
    second = await Runner.run(
        agent, "Where do I want it delivered?", previous_response_id=first.last_response_id
    )
    assert second.final_output == "Berlin."
    last = provider.model_requests[-1].json
    assert "previous_response_id" not in last
    assert input_texts(last) == [
        "Deliver to Berlin, please.",
        "Noted: deliver to Berlin.",
        "Where do I want it delivered?",
    ]
