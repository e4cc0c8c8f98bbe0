"""A provider's context-length refusal is retried once, under the window and count it
states, before any byte reaches the client; provider error bodies reach clients in
OpenAI's envelope (SPEC round 3, issue 21 items 4 and 5).

The fake provider enforces a window smaller than the policy's and counts 1.3 times the
proxy's count (a heavier vocabulary), refusing as vLLM does: a flat body,
`{"object": "error", "message": ..., "code": 400}`."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import openai
import pytest

from proxy.fake_provider import ContextWindow, FakeProvider, Reply
from tests.reliability.storecheck import diff, snapshot

from .conftest import TENANT_KEY, Proxy
from .test_ledger_e2e import CHAT_TOOLS, REFUND, ledger_entries, tools_policy

AUTH = {"Authorization": f"Bearer {TENANT_KEY}"}
MODEL = "gpt-4o-mini"
PROVIDER_WINDOW = 3000  # the policy says 16000
WORDS = " ".join(f"fact{i} about the order" for i in range(60))  # ~300 tokens


def vllm_window(provider: FakeProvider, tokens: int = PROVIDER_WINDOW) -> ContextWindow:
    provider.window = ContextWindow(tokens, inflation=1.3)
    return provider.window


def user(i: int) -> str:
    return f"Question {i}: {WORDS}"


async def metric(proxy: Proxy, outcome: str) -> float:
    async with proxy.http() as http:
        text = (await http.get("/metrics")).text
    for line in text.splitlines():
        if (
            line.startswith("threadkeeper_overflow_retries_total{")
            and f'outcome="{outcome}"' in line
        ):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


async def explain(proxy: Proxy, request_id: str) -> dict[str, Any]:
    async with proxy.http() as http:
        got = await http.get(f"/threadkeeper/v1/requests/{request_id}", headers=AUTH)
    assert got.status_code == 200, got.text
    record: dict[str, Any] = got.json()
    return record


async def test_a_chat_thread_on_a_smaller_provider_window_never_shows_the_refusal(
    make_proxy: Callable[..., Awaitable[Proxy]], provider: FakeProvider
) -> None:
    proxy = await make_proxy()
    window = vllm_window(provider)
    client = proxy.client()
    messages: list[Any] = []
    for i in range(12):
        messages.append({"role": "user", "content": user(i)})
        answer = await client.chat.completions.with_raw_response.create(
            model=MODEL, messages=messages, extra_headers={"X-Thread-Id": "t-overflow"}
        )
        completion = answer.parse()
        messages.append({"role": "assistant", "content": completion.choices[0].message.content})
    # One refusal taught the proxy the window and the count: later turns fit up front.
    assert window.refusals == 1
    assert len(provider.model_requests) == 13
    assert await metric(proxy, "retried") == 1


async def test_the_explain_record_says_the_request_was_retried(
    make_proxy: Callable[..., Awaitable[Proxy]], provider: FakeProvider
) -> None:
    proxy = await make_proxy()
    vllm_window(provider)
    history = [{"role": "user", "content": user(i)} for i in range(14)]
    async with proxy.http() as http:
        got = await http.post(
            "/v1/chat/completions", json={"model": MODEL, "messages": history}, headers=AUTH
        )
    assert got.status_code == 200, got.text
    record = await explain(proxy, got.headers["x-threadkeeper-request-id"])
    retry = record["overflow_retry"]
    assert retry["outcome"] == "retried"
    assert retry["refusal"]["status"] == 400
    assert "maximum context length is 3000 tokens" in retry["refusal"]["message"]
    assert retry["retried_estimate"] < retry["refused_estimate"]
    assert record["estimated_input_tokens"] == retry["retried_estimate"]
    assert "provider_error" not in record


async def test_a_stateless_request_is_retried_strictly_smaller(
    make_proxy: Callable[..., Awaitable[Proxy]], provider: FakeProvider
) -> None:
    proxy = await make_proxy()
    window = vllm_window(provider)
    history = [{"role": "user", "content": user(i)} for i in range(14)]
    completion = await proxy.client().chat.completions.create(model=MODEL, messages=history)
    assert completion.choices[0].message.content
    refused, retried = provider.model_requests
    assert len(retried.raw) < len(refused.raw)
    assert retried.json["messages"][-1] == history[-1]  # the current turn is whole
    assert window.refusals == 1


async def test_a_responses_conversation_is_retried_and_keeps_every_turn(
    make_proxy: Callable[..., Awaitable[Proxy]], provider: FakeProvider
) -> None:
    proxy = await make_proxy()
    window = vllm_window(provider)
    client = proxy.client()
    conversation = await client.conversations.create()
    for i in range(12):
        response = await client.responses.create(
            model=MODEL, input=user(i), conversation=conversation.id
        )
        assert response.status == "completed"
    assert window.refusals == 1
    items = await client.conversations.items.list(conversation.id, limit=100)
    assert len(items.data) == 24  # every input and answer kept: trimming is not deletion


async def test_a_stream_is_retried_before_its_first_byte(
    make_proxy: Callable[..., Awaitable[Proxy]], provider: FakeProvider
) -> None:
    proxy = await make_proxy()
    window = vllm_window(provider)
    history = [{"role": "user", "content": user(i)} for i in range(14)]
    async with proxy.http() as http:
        async with http.stream(
            "POST",
            "/v1/chat/completions",
            json={"model": MODEL, "messages": history, "stream": True},
            headers=AUTH,
        ) as got:
            assert got.status_code == 200
            assert got.headers["content-type"].startswith("text/event-stream")
            body = b"".join([chunk async for chunk in got.aiter_bytes()])
    assert body.startswith(b"data: ")
    assert b"error" not in body and body.rstrip().endswith(b"data: [DONE]")
    assert window.refusals == 1
    assert len(provider.model_requests) == 2


async def test_a_turn_that_cannot_fit_the_stated_window_gets_openais_400(
    make_proxy: Callable[..., Awaitable[Proxy]], provider: FakeProvider
) -> None:
    proxy = await make_proxy()
    window = vllm_window(provider)
    huge = " ".join(f"line {i} of the pasted log" for i in range(500))  # ~3000 tokens
    with pytest.raises(openai.BadRequestError) as caught:
        await proxy.client().chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hi"}, {"role": "user", "content": huge}],
        )
    error = caught.value.body
    assert isinstance(error, dict)
    assert error["code"] == "context_length_exceeded"
    assert error["type"] == "invalid_request_error"
    assert "maximum context length is 3000 tokens" in error["message"]
    assert "current turn" in error["message"]  # the breakdown
    # The learnt window shows the turn cannot fit: nothing is sent that must fail.
    assert window.refusals == 1 and len(provider.model_requests) == 1
    assert await metric(proxy, "refused") == 1


def vllm_refusal(window: int, prompt: int) -> Reply:
    message = (
        f"This model's maximum context length is {window} tokens. However, you requested "
        f"{prompt} tokens ({prompt} in the messages, 0 in the completion). Please reduce "
        "the length of the messages or completion."
    )
    body = {"object": "error", "message": message, "type": "BadRequestError", "param": None}
    return Reply(status=400, body={**body, "code": 400})


async def test_a_retry_refused_again_is_a_400_with_the_breakdown_and_no_third_call(
    make_proxy: Callable[..., Awaitable[Proxy]], provider: FakeProvider
) -> None:
    proxy = await make_proxy()
    provider.script += [vllm_refusal(3000, 3400), vllm_refusal(3000, 3100), Reply(text="no")]
    history = [{"role": "user", "content": user(i)} for i in range(8)]
    with pytest.raises(openai.BadRequestError) as caught:
        await proxy.client().chat.completions.create(model=MODEL, messages=history)
    error = caught.value.body
    assert isinstance(error, dict)
    assert error["code"] == "context_length_exceeded"
    assert "even after its history was reduced to" in error["message"]
    assert "current turn" in error["message"]
    assert len(provider.model_requests) == 2
    assert await metric(proxy, "not_retried") == 1


async def test_truncation_disabled_is_relayed_in_openais_envelope_not_retried(
    make_proxy: Callable[..., Awaitable[Proxy]], provider: FakeProvider
) -> None:
    proxy = await make_proxy()
    window = vllm_window(provider)
    history = [{"role": "user", "content": user(i), "type": "message"} for i in range(14)]
    with pytest.raises(openai.BadRequestError) as caught:
        await proxy.client().responses.create(
            model=MODEL, input=history, truncation="disabled", store=False
        )
    error = caught.value.body
    assert isinstance(error, dict)
    assert error["code"] == "context_length_exceeded"
    assert error["message"].startswith("This model's maximum context length is 3000 tokens")
    assert window.refusals == 1 and len(provider.model_requests) == 1


async def test_a_side_effecting_call_after_a_retry_has_one_ledger_entry(
    make_proxy: Callable[..., Awaitable[Proxy]], provider: FakeProvider
) -> None:
    proxy = await make_proxy(acme_extra=tools_policy())
    window = vllm_window(provider)
    client = proxy.client()
    thread = {"X-Thread-Id": "t-refund"}
    messages: list[Any] = [{"role": "user", "content": user(i)} for i in range(14)]
    provider.script += [Reply(tool_calls=[REFUND]), Reply(text="Refunded ORD-1.")]
    first = await client.chat.completions.create(
        model=MODEL, messages=messages, tools=CHAT_TOOLS, extra_headers=thread
    )
    [call] = first.choices[0].message.tool_calls or []
    messages += [
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"refunded": "ORD-1"})},
    ]
    done = await client.chat.completions.create(
        model=MODEL, messages=messages, tools=CHAT_TOOLS, extra_headers=thread
    )
    assert done.choices[0].message.content == "Refunded ORD-1."
    assert window.refusals == 1
    [entry] = await ledger_entries(proxy)
    assert (entry["key"], entry["status"]) == ("refund:ORD-1", "completed")


async def test_a_refused_tool_output_turn_is_recorded_once_across_the_retry(
    make_proxy: Callable[..., Awaitable[Proxy]], provider: FakeProvider
) -> None:
    proxy = await make_proxy(acme_extra=tools_policy())
    client = proxy.client()
    thread = {"X-Thread-Id": "t-refund-2"}
    messages: list[Any] = [{"role": "user", "content": user(i)} for i in range(10)]
    messages.append({"role": "user", "content": "Refund ORD-1"})
    provider.script += [Reply(tool_calls=[REFUND])]
    first = await client.chat.completions.create(
        model=MODEL, messages=messages, tools=CHAT_TOOLS, extra_headers=thread
    )
    [call] = first.choices[0].message.tool_calls or []
    messages += [
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": WORDS},
    ]
    # The output's turn is refused once for its length, then answered.
    provider.script += [vllm_refusal(3000, 5000), Reply(text="Refunded ORD-1.")]
    done = await client.chat.completions.create(
        model=MODEL, messages=messages, tools=CHAT_TOOLS, extra_headers=thread
    )
    assert done.choices[0].message.content == "Refunded ORD-1."
    assert len(provider.model_requests) == 3
    [entry] = await ledger_entries(proxy)
    assert (entry["key"], entry["status"], entry["attempts"]) == ("refund:ORD-1", "completed", 1)


async def test_a_non_context_400_is_relayed_once_in_openais_envelope(
    make_proxy: Callable[..., Awaitable[Proxy]], provider: FakeProvider
) -> None:
    proxy = await make_proxy()
    flat = {  # vLLM's flat body (vllm/entrypoints/openai/protocol.py ErrorResponse)
        "object": "error",
        "message": "temperature must be in [0, 2], got 7.0.",
        "type": "BadRequestError",
        "param": None,
        "code": 400,
    }
    provider.script += [Reply(status=400, body=flat), Reply(text="never")]
    with pytest.raises(openai.BadRequestError) as caught:
        await proxy.client().chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}]
        )
    assert caught.value.body == {
        "message": "temperature must be in [0, 2], got 7.0.",
        "type": "invalid_request_error",
        "param": None,
        "code": None,
    }
    assert len(provider.model_requests) == 1


@pytest.mark.parametrize(
    ("content_type", "raw", "message"),
    [
        ("text/plain", b"upstream connect error or disconnect/reset before headers", None),
        (
            "text/html",
            b"<html><head><title>502 Bad Gateway</title></head><body><center><h1>502 Bad"
            b" Gateway</h1></center><hr><center>nginx</center></body></html>",
            "502 Bad Gateway",
        ),
    ],
)
async def test_a_gateways_502_body_becomes_openais_envelope(
    make_proxy: Callable[..., Awaitable[Proxy]],
    provider: FakeProvider,
    content_type: str,
    raw: bytes,
    message: str | None,
) -> None:
    proxy = await make_proxy()
    reply = Reply(status=502, raw=raw, headers={"content-type": content_type})
    provider.script += [reply] * 3  # 502 is retried by the provider seam, 3 attempts
    async with proxy.http() as http:
        got = await http.post(
            "/v1/chat/completions",
            json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
            headers=AUTH,
        )
    assert got.status_code == 502
    assert got.headers["content-type"].startswith("application/json")
    assert got.json() == {
        "error": {
            "message": message or raw.decode(),
            "type": "server_error",
            "param": None,
            "code": None,
        }
    }


async def test_an_openai_shaped_provider_error_is_relayed_byte_for_byte(
    make_proxy: Callable[..., Awaitable[Proxy]], provider: FakeProvider
) -> None:
    proxy = await make_proxy()
    provider.script += [Reply(status=404, text="The model `gpt-9` does not exist.")]
    async with proxy.http() as http:
        got = await http.post(
            "/v1/responses", json={"model": "gpt-9", "input": "hi", "store": False}, headers=AUTH
        )
    assert got.status_code == 404
    assert got.json()["error"] == {
        "message": "The model `gpt-9` does not exist.",
        "type": "invalid_request_error",
        "param": None,
        "code": "not_found",
    }


async def test_a_stored_response_that_cannot_fit_leaves_the_store_as_it_was(
    make_proxy: Callable[..., Awaitable[Proxy]], provider: FakeProvider, tmp_path: Path
) -> None:
    store = tmp_path / "overflow.db"
    proxy = await make_proxy(store_url=f"sqlite:///{store}")
    client = proxy.client()
    first = await client.responses.create(model=MODEL, input="Hello")
    before = snapshot(store)
    vllm_window(provider)
    huge = " ".join(f"line {i} of the pasted log" for i in range(500))
    with pytest.raises(openai.BadRequestError) as caught:
        await client.responses.create(model=MODEL, input=huge, previous_response_id=first.id)
    error = caught.value.body
    assert isinstance(error, dict) and error["code"] == "context_length_exceeded"
    after = snapshot(store)
    assert after == before, diff(before, after)
