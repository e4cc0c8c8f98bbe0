"""A tool result placed before the call it answers cannot be sent in any order: a 400
naming the history, never a 500 (a stateless request used to reach the projection's
invariant check, which raised). Found by the OpenAPI fuzz test."""

from __future__ import annotations

from typing import Any

import pytest

from proxy.fake_provider import FakeProvider

from .conftest import TENANT_KEY, Proxy

AUTH = {"Authorization": f"Bearer {TENANT_KEY}"}
TOOL_CALL = {
    "role": "assistant",
    "content": None,
    "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
}
LEGACY_CALL = {
    "role": "assistant",
    "content": None,
    "function_call": {"name": "f", "arguments": "{}"},
}


@pytest.mark.parametrize(
    "messages",
    [
        [
            {"role": "user", "content": "a"},
            {"role": "tool", "tool_call_id": "c1", "content": "x"},
            TOOL_CALL,
            {"role": "user", "content": "b"},
        ],
        [
            {"role": "user", "content": "a"},
            {"role": "function", "name": "f", "content": "x"},
            LEGACY_CALL,
            {"role": "user", "content": "b"},
        ],
    ],
    ids=["tool", "legacy-function"],
)
@pytest.mark.parametrize("thread", [None, "t-order"])
async def test_an_output_before_its_call_is_a_400(
    proxy: Proxy, provider: FakeProvider, messages: list[dict[str, Any]], thread: str | None
) -> None:
    headers = {**AUTH, **({"X-Thread-Id": thread} if thread else {})}
    async with proxy.http() as http:
        answer = await http.post(
            "/v1/chat/completions",
            json={"model": "gpt-4o", "messages": messages},
            headers=headers,
        )
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == "messages" and "No tool call found" in error["message"]
    assert provider.model_requests == []


async def test_an_output_for_a_call_the_client_never_shows_still_goes_to_the_provider(
    proxy: Proxy, provider: FakeProvider
) -> None:
    """Stateless: the history is the client's; the provider judges an unknown call id."""
    messages = [
        {"role": "user", "content": "a"},
        {"role": "tool", "tool_call_id": "elsewhere", "content": "x"},
        {"role": "user", "content": "b"},
    ]
    async with proxy.http() as http:
        answer = await http.post(
            "/v1/chat/completions", json={"model": "gpt-4o", "messages": messages}, headers=AUTH
        )
    assert answer.status_code == 200
    sent = provider.model_requests[-1].json["messages"]
    assert sent[1] == {"role": "tool", "tool_call_id": "elsewhere", "content": "x"}
