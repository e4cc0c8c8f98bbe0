"""Chat Completions through the proxy on a real socket, with the openai SDK as the client."""

from __future__ import annotations

import json
from typing import Any

import pytest

from proxy.core.tokens import TokenCounter
from proxy.fake_provider import Reply
from tests.server.conftest import PROVIDER_KEY, TENANT_KEY


def tool_history(turns: int, result_size: int = 60) -> list[dict[str, Any]]:
    """An agent conversation: each turn a user question, a tool call, a bulky result, an answer."""
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are an order assistant."},
        {"role": "user", "content": "All prices in CNY, tax included."},
        {"role": "assistant", "content": "Understood."},
    ]
    for turn in range(turns):
        call_id = f"call_{turn}"
        messages += [
            {"role": "user", "content": f"Where is order ORD-{turn}? Please check carefully."},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": call_id,
                        "type": "function",
                        "function": {
                            "name": "get_order",
                            "arguments": json.dumps({"order_id": f"ORD-{turn}"}),
                        },
                    }
                ],
            },
            {
                "role": "tool",
                "tool_call_id": call_id,
                "content": json.dumps(
                    {
                        "order_id": f"ORD-{turn}",
                        "status": "shipped",
                        "events": [
                            f"scan {i} at hub {i % 7} on day {turn}" for i in range(result_size)
                        ],
                    }
                ),
            },
            {"role": "assistant", "content": f"Order ORD-{turn} has shipped and is on its way."},
        ]
    messages.append({"role": "user", "content": "Summarize all my orders."})
    return messages


def assert_tool_calls_closed(messages: list[dict[str, Any]]) -> None:
    calls = {c["id"] for m in messages for c in m.get("tool_calls") or []}
    outputs = {m["tool_call_id"] for m in messages if m.get("role") == "tool"}
    assert calls == outputs


async def test_fitting_request_goes_upstream_byte_for_byte(proxy) -> None:
    body = (
        b'{"model": "gpt-4o",   "messages": [{"role": "user", "content": "hi"}],'
        b' "zz_unknown_field": {"kept": true}, "temperature": 0.2}'
    )
    async with proxy.http() as http:
        response = await http.post(
            "/v1/chat/completions",
            content=body,
            headers={"Authorization": f"Bearer {TENANT_KEY}", "Content-Type": "application/json"},
        )
    assert response.status_code == 200
    assert proxy.provider.requests[-1].raw == body
    assert response.headers["x-threadkeeper-trimmed"] == "dropped=0, compressed=0, summarized=0"
    assert int(response.headers["x-threadkeeper-context-tokens"]) == TokenCounter.for_model(
        "gpt-4o"
    ).chat_prompt([{"role": "user", "content": "hi"}])


async def test_sdk_chat_passthrough_unchanged(proxy) -> None:
    client = proxy.client()
    messages = tool_history(2)
    completion = await client.chat.completions.create(model="gpt-4o", messages=messages)
    assert completion.choices[0].message.content
    assert proxy.provider.requests[-1].json["messages"] == messages


async def test_long_tool_history_is_rebuilt_under_16k_window(proxy) -> None:
    client = proxy.client()
    messages = tool_history(40)
    counter = TokenCounter.for_model("gpt-4o")
    assert counter.chat_prompt(messages) > 16000
    raw = await client.chat.completions.with_raw_response.create(model="gpt-4o", messages=messages)
    assert raw.parse().choices[0].message.content
    sent = proxy.provider.requests[-1].json["messages"]
    assert_tool_calls_closed(sent)
    assert sent[0] == messages[0]  # system text pinned
    assert sent[-1] == messages[-1]  # current turn verbatim
    assert any("All prices in CNY" in json.dumps(m) for m in sent)  # pinned by pattern
    sent_tokens = int(raw.headers["x-threadkeeper-context-tokens"])
    assert sent_tokens == counter.chat_prompt(sent)
    assert sent_tokens <= 16000 - 1000 - 200
    trimmed = dict(part.split("=") for part in raw.headers["x-threadkeeper-trimmed"].split(", "))
    assert int(trimmed["summarized"]) > 0 or int(trimmed["compressed"]) > 0


async def test_context_length_exceeded_when_current_turn_cannot_fit(proxy) -> None:
    client = proxy.client()
    huge = "word " * 20000
    with pytest.raises(Exception) as info:
        await client.chat.completions.create(
            model="gpt-4o", messages=[{"role": "user", "content": huge}]
        )
    error = info.value
    assert getattr(error, "status_code", None) == 400
    assert error.body["code"] == "context_length_exceeded"  # type: ignore[attr-defined]
    assert error.body["param"] == "messages"  # type: ignore[attr-defined]
    assert "maximum context length is 16000 tokens" in error.body["message"]  # type: ignore[attr-defined]
    assert not proxy.provider.requests  # nothing sent that must fail


async def test_streaming_chat_with_tool_calls(proxy) -> None:
    client = proxy.client()
    proxy.provider.script.append(Reply(tool_calls=[("get_order", '{"order_id": "ORD-7"}')]))
    stream = await client.chat.completions.create(
        model="gpt-4o",
        messages=[{"role": "user", "content": "where is ORD-7"}],
        stream=True,
        stream_options={"include_usage": True},
    )
    arguments = ""
    async for chunk in stream:
        for choice in chunk.choices:
            for call in choice.delta.tool_calls or []:
                arguments += call.function.arguments or ""
    assert json.loads(arguments) == {"order_id": "ORD-7"}


async def test_tenant_key_is_replaced_by_the_provider_key(proxy) -> None:
    client = proxy.client(api_key=TENANT_KEY)
    await client.chat.completions.create(
        model="gpt-4o", messages=[{"role": "user", "content": "x"}]
    )
    assert proxy.provider.requests[-1].headers["Authorization"] == f"Bearer {PROVIDER_KEY}"


async def test_unknown_key_forwarded_in_passthrough_mode(proxy) -> None:
    client = proxy.client(api_key="sk-client-own-key")
    await client.chat.completions.create(
        model="gpt-4o", messages=[{"role": "user", "content": "x"}]
    )
    assert proxy.provider.requests[-1].headers["Authorization"] == "Bearer sk-client-own-key"


async def test_unknown_key_is_401_without_passthrough(make_proxy) -> None:
    proxy = await make_proxy(allow_unknown=False)
    client = proxy.client(api_key="sk-nobody")
    with pytest.raises(Exception) as info:
        await client.chat.completions.create(
            model="gpt-4o", messages=[{"role": "user", "content": "x"}]
        )
    assert getattr(info.value, "status_code", None) == 401
    assert info.value.body["code"] == "invalid_api_key"  # type: ignore[attr-defined]
    assert "sk-nobody" not in str(info.value.body)  # type: ignore[attr-defined]
    assert not proxy.provider.requests


async def test_policy_reload_changes_the_window(make_proxy) -> None:
    proxy = await make_proxy(window=16000)
    client = proxy.client()
    messages = tool_history(12)
    await client.chat.completions.create(model="gpt-4o", messages=messages)
    assert proxy.provider.requests[-1].json["messages"] == messages  # fits in 16k

    text = (
        (proxy.policies_dir / "acme.yaml")
        .read_text()
        .replace("context_window: 16000", "context_window: 8000")
    )
    (proxy.policies_dir / "acme.yaml").write_text(text)
    from proxy.server.state import POLICIES

    assert proxy.app[POLICIES].reload() == []
    await client.chat.completions.create(model="gpt-4o", messages=messages)
    assert proxy.provider.requests[-1].json["messages"] != messages  # rebuilt under 8k


async def test_bad_policy_edit_keeps_last_good_policy(make_proxy) -> None:
    proxy = await make_proxy()
    (proxy.policies_dir / "acme.yaml").write_text(
        "tenant: acme\nmodels: {'*': {context_window: -5}}\n"
    )
    from proxy.server.state import POLICIES

    errors = proxy.app[POLICIES].reload()
    assert errors and "acme.yaml" in str(errors[0])
    client = proxy.client()
    completion = await client.chat.completions.create(
        model="gpt-4o", messages=[{"role": "user", "content": "still served"}]
    )
    assert completion.choices[0].message.content
    assert proxy.provider.requests[-1].headers["Authorization"] == f"Bearer {PROVIDER_KEY}"


async def test_stateless_rebuild_is_byte_stable_across_turns(proxy) -> None:
    # A stateless client resends its history: the compressed forms must come out the same,
    # or every turn would change the prompt prefix and defeat the provider's cache.
    client = proxy.client()
    messages = tool_history(30)
    await client.chat.completions.create(model="gpt-4o", messages=messages)
    first = proxy.provider.requests[-1].raw
    await client.chat.completions.create(model="gpt-4o", messages=messages)
    assert proxy.provider.requests[-1].raw == first
    assert b"threadkeeper" in first  # it was rebuilt, not passed through
