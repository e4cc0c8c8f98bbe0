"""Bad input: each a 4xx in OpenAI's error shape, nothing sent upstream."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.server.conftest import TENANT_KEY

MSG = [{"role": "user", "content": "hi"}]

CHAT_CASES: list[tuple[str, Any, str | None]] = [
    ("not json", b"{not json", None),
    ("empty body", b"", None),
    ("array body", [], None),
    ("string body", "hello", None),
    ("missing model", {"messages": MSG}, "model"),
    ("model not string", {"model": 5, "messages": MSG}, "model"),
    ("empty model", {"model": "", "messages": MSG}, "model"),
    ("missing messages", {"model": "gpt-4o"}, "messages"),
    ("messages not list", {"model": "gpt-4o", "messages": "hi"}, "messages"),
    ("messages empty", {"model": "gpt-4o", "messages": []}, "messages"),
    ("message not object", {"model": "gpt-4o", "messages": ["hi"]}, "messages[0]"),
    ("role missing", {"model": "gpt-4o", "messages": [{"content": "x"}]}, "messages[0].role"),
    (
        "role not string",
        {"model": "gpt-4o", "messages": [{"role": 1, "content": "x"}]},
        "messages[0].role",
    ),
    (
        "role unknown",
        {"model": "gpt-4o", "messages": [{"role": "robot", "content": "x"}]},
        "messages[0].role",
    ),
    (
        "content number",
        {"model": "gpt-4o", "messages": [{"role": "user", "content": 5}]},
        "messages[0].content",
    ),
    (
        "content part not object",
        {"model": "gpt-4o", "messages": [{"role": "user", "content": ["x"]}]},
        "messages[0].content[0]",
    ),
    (
        "tool without call id",
        {"model": "gpt-4o", "messages": [{"role": "tool", "content": "r"}]},
        "messages[0].tool_call_id",
    ),
    (
        "tool_calls not list",
        {"model": "gpt-4o", "messages": [{"role": "assistant", "tool_calls": "x"}]},
        "messages[0].tool_calls",
    ),
    (
        "tool_call without id",
        {
            "model": "gpt-4o",
            "messages": [{"role": "assistant", "tool_calls": [{"type": "function"}]}],
        },
        "messages[0].tool_calls[0].id",
    ),
    ("max_tokens string", {"model": "gpt-4o", "messages": MSG, "max_tokens": "10"}, "max_tokens"),
    ("max_tokens zero", {"model": "gpt-4o", "messages": MSG, "max_tokens": 0}, "max_tokens"),
    (
        "max_completion_tokens negative",
        {"model": "gpt-4o", "messages": MSG, "max_completion_tokens": -1},
        "max_completion_tokens",
    ),
    ("max_tokens bool", {"model": "gpt-4o", "messages": MSG, "max_tokens": True}, "max_tokens"),
    ("stream not bool", {"model": "gpt-4o", "messages": MSG, "stream": "yes"}, "stream"),
    ("tools not list", {"model": "gpt-4o", "messages": MSG, "tools": {}}, "tools"),
    ("tool not object", {"model": "gpt-4o", "messages": MSG, "tools": [1]}, "tools[0]"),
    ("functions not list", {"model": "gpt-4o", "messages": MSG, "functions": "f"}, "functions"),
]

RESPONSES_CASES: list[tuple[str, Any, str | None]] = [
    ("responses input number", {"model": "gpt-4o", "input": 5}, "input"),
    ("responses item not object", {"model": "gpt-4o", "input": [1]}, "input[0]"),
    (
        "responses message without role",
        {"model": "gpt-4o", "input": [{"type": "message", "content": "x"}]},
        "input[0].role",
    ),
    (
        "responses content number",
        {"model": "gpt-4o", "input": [{"role": "user", "content": 1}]},
        "input[0].content",
    ),
    (
        "responses output without call id",
        {"model": "gpt-4o", "input": [{"type": "function_call_output", "output": "x"}]},
        "input[0].call_id",
    ),
    (
        "responses instructions number",
        {"model": "gpt-4o", "input": "x", "instructions": 3},
        "instructions",
    ),
    (
        "responses max_output_tokens zero",
        {"model": "gpt-4o", "input": "x", "max_output_tokens": 0},
        "max_output_tokens",
    ),
    ("responses stream not bool", {"model": "gpt-4o", "input": "x", "stream": 1}, "stream"),
    (
        "responses conversation and previous",
        {
            "model": "gpt-4o",
            "input": "x",
            "conversation": "conv_1",
            "previous_response_id": "resp_1",
        },
        None,
    ),
    ("responses tools not list", {"model": "gpt-4o", "input": "x", "tools": "t"}, "tools"),
]


def _encode(body: Any) -> bytes:
    return body if isinstance(body, bytes) else json.dumps(body).encode()


@pytest.mark.parametrize(("name", "body", "param"), CHAT_CASES, ids=[c[0] for c in CHAT_CASES])
async def test_malformed_chat_is_a_400(proxy, name: str, body: Any, param: str | None) -> None:
    await _assert_400(proxy, "/v1/chat/completions", body, param)


@pytest.mark.parametrize(
    ("name", "body", "param"), RESPONSES_CASES, ids=[c[0] for c in RESPONSES_CASES]
)
async def test_malformed_responses_is_a_400(proxy, name: str, body: Any, param: str | None) -> None:
    await _assert_400(proxy, "/v1/responses", body, param)


async def _assert_400(proxy, path: str, body: Any, param: str | None) -> None:  # type: ignore[no-untyped-def]
    async with proxy.http() as http:
        response = await http.post(
            path,
            content=_encode(body),
            headers={"Authorization": f"Bearer {TENANT_KEY}", "Content-Type": "application/json"},
        )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert error["message"]
    assert not proxy.provider.requests


async def test_body_above_the_limit_is_a_413(make_proxy) -> None:
    proxy = await make_proxy(max_body_bytes=10_000)
    body = {"model": "gpt-4o", "messages": [{"role": "user", "content": "x" * 20_000}]}
    async with proxy.http() as http:
        response = await http.post(
            "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {TENANT_KEY}"}
        )
    assert response.status_code == 413
    assert response.json()["error"]["code"] == "request_too_large"
    assert not proxy.provider.requests


async def test_unknown_route_outside_v1_is_a_404_in_openai_shape(proxy) -> None:
    async with proxy.http() as http:
        response = await http.get("/nope")
    assert response.status_code == 404
    assert response.json()["error"]["type"] == "invalid_request_error"


async def test_missing_key_is_a_401_when_unknown_keys_are_refused(make_proxy) -> None:
    proxy = await make_proxy(allow_unknown=False)
    async with proxy.http() as http:
        response = await http.post(
            "/v1/chat/completions", json={"model": "gpt-4o", "messages": MSG}
        )
    assert response.status_code == 401
    assert response.json()["error"]["code"] == "invalid_api_key"


async def test_server_keeps_serving_after_bad_input(proxy) -> None:
    async with proxy.http() as http:
        for _ in range(3):
            bad = await http.post(
                "/v1/chat/completions",
                content=b"{",
                headers={"Authorization": f"Bearer {TENANT_KEY}"},
            )
            assert bad.status_code == 400
        good = await http.post(
            "/v1/chat/completions",
            json={"model": "gpt-4o", "messages": MSG},
            headers={"Authorization": f"Bearer {TENANT_KEY}"},
        )
    assert good.status_code == 200
