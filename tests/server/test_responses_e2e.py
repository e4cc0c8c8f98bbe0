"""Responses API (stateless) through the proxy with the openai SDK."""

from __future__ import annotations

import json
from typing import Any

from proxy.core.items import items_from_responses_input
from proxy.core.tokens import TokenCounter
from proxy.fake_provider import Reply


def responses_history(turns: int) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = []
    for turn in range(turns):
        items += [
            {"role": "user", "content": f"Check order ORD-{turn} for me please."},
            {
                "type": "reasoning",
                "id": f"rs_{turn}",
                "summary": [],
                "encrypted_content": "gAAA" * 30,
            },
            {
                "type": "function_call",
                "call_id": f"call_{turn}",
                "name": "get_order",
                "arguments": json.dumps({"order_id": f"ORD-{turn}"}),
            },
            {
                "type": "function_call_output",
                "call_id": f"call_{turn}",
                "output": json.dumps(
                    {"status": "shipped", "log": [f"event {i}" for i in range(80)]}
                ),
            },
            {
                "type": "message",
                "role": "assistant",
                "content": [{"type": "output_text", "text": f"ORD-{turn} shipped."}],
            },
        ]
    items.append({"role": "user", "content": "Which orders have shipped?"})
    return items


async def test_responses_fitting_input_is_unchanged(proxy) -> None:
    client = proxy.client()
    history = responses_history(2)
    response = await client.responses.create(
        model="gpt-4o", input=history, instructions="Be brief."
    )
    assert response.output_text
    assert proxy.provider.requests[-1].json["input"] == history


async def test_responses_long_input_is_rebuilt_with_calls_closed(proxy) -> None:
    client = proxy.client()
    history = responses_history(40)
    raw = await client.responses.with_raw_response.create(model="gpt-4o", input=history)
    assert raw.parse().output_text
    sent = proxy.provider.requests[-1].json["input"]
    calls = {i["call_id"] for i in sent if i.get("type") == "function_call"}
    outputs = {i["call_id"] for i in sent if i.get("type") == "function_call_output"}
    assert calls == outputs
    assert sent[-1] == history[-1]
    tokens = int(raw.headers["x-threadkeeper-context-tokens"])
    counter = TokenCounter.for_model("gpt-4o")
    assert tokens == counter.responses_prompt(items_from_responses_input(sent).items)
    assert tokens <= 16000 - 1000 - 200


async def test_responses_stream_relayed(proxy) -> None:
    client = proxy.client()
    proxy.provider.script.append(Reply(text="streamed answer here"))
    stream = await client.responses.create(model="gpt-4o", input="hello", stream=True)
    text = ""
    completed = False
    async for event in stream:
        if event.type == "response.output_text.delta":
            text += event.delta
        if event.type == "response.completed":
            completed = True
    assert completed
    assert text == "streamed answer here"


async def test_input_tokens_counted_locally(proxy) -> None:
    client = proxy.client()
    history = responses_history(3)
    result = await client.responses.input_tokens.count(
        model="gpt-4o", input=history, instructions="Be brief."
    )
    counter = TokenCounter.for_model("gpt-4o")
    expected = counter.responses_prompt(items_from_responses_input(history).items, "Be brief.")
    assert result.input_tokens == expected
    assert result.object == "response.input_tokens"
    assert not proxy.provider.requests
