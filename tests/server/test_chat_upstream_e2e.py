"""Responses and Conversations over a provider that only serves Chat Completions (issue
25): the openai SDK's responses.create against a fake that answers /v1/responses 404 and
holds Chat requests to Chat's rules (roles, tool pairing, known params)."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from agents import OpenAIConversationsSession, Runner

from proxy.fake_provider import FakeProvider, Reply
from proxy.server.state import POLICIES
from proxy.sse import DONE, encode_event, encode_json_event
from tests.core.test_events import check_shape

from .conftest import TENANT_KEY, Proxy
from .test_agents_sdk_e2e import LOOKUPS, agent_for
from .test_docs_snippets_e2e import SNIPPETS, run

CHAT = ", api: chat"
AUTH = {"Authorization": f"Bearer {TENANT_KEY}"}
MakeProxy = Callable[..., Awaitable[Proxy]]


@pytest.fixture
async def provider() -> AsyncIterator[FakeProvider]:
    fake = FakeProvider(chat_only=True)
    await fake.start()
    yield fake
    await fake.stop()


def paths(provider: FakeProvider) -> list[str]:
    return [request.path for request in provider.model_requests]


def last_chat(provider: FakeProvider) -> dict[str, Any]:
    body: dict[str, Any] = provider.model_requests[-1].json
    return body


# -- JSON answers ----------------------------------------------------------------------------


async def test_a_json_turn_is_sent_as_chat_and_answered_as_a_response(
    make_proxy: MakeProxy, provider: FakeProvider
) -> None:
    proxy = await make_proxy(upstream_extra=CHAT)
    provider.script.append(Reply(text="Hello there."))
    response = await proxy.client().responses.create(
        model="gpt-4o",
        instructions="Be brief.",
        input=[
            {"role": "developer", "content": "Answer in English."},
            {"role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
        ],
        max_output_tokens=50,
        temperature=0.5,
        reasoning={"effort": "low"},
        metadata={"k": "v"},
    )
    assert paths(provider) == ["/v1/chat/completions"]
    sent = last_chat(provider)
    assert sent["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "system", "content": "Answer in English."},
        {"role": "user", "content": "Hi"},
    ]
    assert (
        sent["max_completion_tokens"] == 50
        and "max_tokens" not in sent
        and sent["temperature"] == 0.5
    )
    assert sent["reasoning_effort"] == "low" and "metadata" not in sent
    assert response.output_text == "Hello there."
    assert response.status == "completed" and response.id.startswith("resp_")
    assert response.output[0].type == "message" and response.output[0].id.startswith("msg_")
    assert response.usage is not None and response.usage.input_tokens > 0
    assert response.usage.total_tokens == response.usage.input_tokens + response.usage.output_tokens


async def test_parallel_calls_and_their_outputs_keep_their_pairs_and_ids(
    make_proxy: MakeProxy, provider: FakeProvider
) -> None:
    proxy = await make_proxy(upstream_extra=CHAT)
    client = proxy.client()
    tools: Any = [
        {"type": "function", "name": "weather", "parameters": {"type": "object"}},
        {"type": "function", "name": "time", "parameters": {"type": "object"}},
    ]
    provider.script += [Reply(body=completion(CALLS, "tool_calls")), Reply(text="Sunny, 12:00.")]
    first = await client.responses.create(
        model="gpt-4o", input="Weather and time?", tools=tools, parallel_tool_calls=True
    )
    sent = last_chat(provider)
    assert sent["tools"][0] == {
        "type": "function",
        "function": {"name": "weather", "parameters": {"type": "object"}},
    }
    assert sent["parallel_tool_calls"] is True
    calls = [item for item in first.output if item.type == "function_call"]
    provider_ids = ["call_A", "call_B"]
    assert [c.call_id for c in calls] == provider_ids
    assert [(c.name, c.arguments) for c in calls] == [
        ("weather", '{"city": "Oslo"}'),
        ("time", '{"tz": "CET"}'),
    ]
    outputs: Any = [
        {"type": "function_call_output", "call_id": c.call_id, "output": f"{c.name} ok"}
        for c in calls
    ]
    second = await client.responses.create(
        model="gpt-4o", previous_response_id=first.id, input=outputs, tools=tools
    )
    assert second.output_text == "Sunny, 12:00."
    messages = last_chat(provider)["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant", "tool", "tool"]
    assert [c["id"] for c in messages[1]["tool_calls"]] == provider_ids
    assert [m["tool_call_id"] for m in messages[2:]] == provider_ids


CALLS = [
    {
        "id": "call_A",
        "type": "function",
        "function": {"name": "weather", "arguments": '{"city": "Oslo"}'},
    },
    {
        "id": "call_B",
        "type": "function",
        "function": {"name": "time", "arguments": '{"tz": "CET"}'},
    },
]


def completion(
    calls: list[dict[str, Any]], finish: str, content: str | None = None
) -> dict[str, Any]:
    message = {"role": "assistant", "content": content, "tool_calls": calls}
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 1,
        "model": "gpt-4o",
        "choices": [{"index": 0, "finish_reason": finish, "message": message}],
        "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6},
    }


async def test_structured_output_becomes_response_format(
    make_proxy: MakeProxy, provider: FakeProvider
) -> None:
    proxy = await make_proxy(upstream_extra=CHAT)
    provider.script.append(Reply(text='{"answer": 4}'))
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}}}
    response = await proxy.client().responses.create(
        model="gpt-4o",
        input="2+2?",
        text={"format": {"type": "json_schema", "name": "sum", "schema": schema, "strict": True}},
    )
    assert last_chat(provider)["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "sum", "schema": schema, "strict": True},
    }
    assert json.loads(response.output_text) == {"answer": 4}
    assert response.text is not None and response.text.format is not None
    assert response.text.format.type == "json_schema"


async def test_a_hosted_tool_is_a_400_naming_it_and_nothing_is_forwarded_or_kept(
    make_proxy: MakeProxy, provider: FakeProvider
) -> None:
    proxy = await make_proxy(upstream_extra=CHAT)
    client = proxy.client()
    with pytest.raises(openai.BadRequestError) as caught:
        await client.responses.create(model="gpt-4o", input="news?", tools=[{"type": "web_search"}])
    assert caught.value.status_code == 400
    body: Any = caught.value.body
    assert body["param"] == "tools[0]" and "web_search" in body["message"]
    assert provider.model_requests == []
    conversation = await client.conversations.create()
    with pytest.raises(openai.BadRequestError):
        await client.responses.create(
            model="gpt-4o",
            input="hi",
            conversation=conversation.id,
            tools=[{"type": "file_search"}],
        )
    assert (await client.conversations.items.list(conversation.id)).data == []


async def test_finish_reasons_become_status_and_provider_errors_keep_their_envelope(
    make_proxy: MakeProxy, provider: FakeProvider
) -> None:
    proxy = await make_proxy(upstream_extra=CHAT)
    client = proxy.client()
    provider.script.append(Reply(body=completion([], "length", "Par")))
    response = await client.responses.create(model="gpt-4o", input="long story")
    assert response.status == "incomplete"
    assert response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.usage is not None and response.usage.input_tokens == 5
    provider.script.append(Reply(status=400, text="messages: bad thing"))
    with pytest.raises(openai.BadRequestError) as caught:
        await client.responses.create(model="gpt-4o", input="x")
    body: Any = caught.value.body
    assert body["message"] == "messages: bad thing"
    assert set(body) >= {"message", "type", "param", "code"}


# -- auto: learnt from the provider, remembered in the store --------------------------------


async def test_auto_switches_on_the_first_404_and_remembers_it_in_the_store(
    make_proxy: MakeProxy, provider: FakeProvider, tmp_path: Path
) -> None:
    store = f"sqlite:///{tmp_path / 'shared.db'}"
    proxy = await make_proxy(store_url=store)
    provider.script += [Reply(text="one"), Reply(text="two"), Reply(text="three")]
    raw = await proxy.client().responses.with_raw_response.create(model="gpt-4o", input="a")
    assert raw.parse().output_text == "one"
    request_id = raw.headers["x-threadkeeper-request-id"]
    assert paths(provider) == ["/v1/responses", "/v1/chat/completions"]
    await proxy.client().responses.create(model="gpt-4o", input="b")
    assert paths(provider)[2:] == ["/v1/chat/completions"]
    again = await make_proxy(store_url=store)  # a restart: the store remembers
    third = await again.client().responses.create(model="gpt-4o", input="c")
    assert third.output_text == "three"
    assert paths(provider)[3:] == ["/v1/chat/completions"]
    async with proxy.http() as http:
        explained = await http.get(f"/threadkeeper/v1/requests/{request_id}", headers=AUTH)
    assert explained.status_code == 200
    assert explained.json()["upstream_api"] == "chat"  # the record says it was translated


async def test_a_responses_provider_is_not_switched(make_proxy: MakeProxy, tmp_path: Path) -> None:
    native = FakeProvider()
    await native.start()
    try:
        proxy = await make_proxy(upstream_url=native.base_url)
        await proxy.client().responses.create(model="gpt-4o", input="a")
        # A 404 that names the model is about the model, not the endpoint: Chat is not
        # tried and nothing is learnt.
        native.script += [Reply(status=404, text="The model 'nope' does not exist")]
        with pytest.raises(openai.NotFoundError):
            await proxy.client().responses.create(model="nope", input="b")
        await proxy.client().responses.create(model="gpt-4o", input="c")
        assert paths(native) == ["/v1/responses"] * 3
        # A 404 that does not (a gateway's own not-found) is tried as Chat, and a Chat 404
        # too means the endpoint was not the problem: still nothing is learnt.
        native.script += [Reply(status=404, text="Not Found")] * 2
        with pytest.raises(openai.NotFoundError):
            await proxy.client().responses.create(model="gpt-4o", input="d")
        await proxy.client().responses.create(model="gpt-4o", input="e")
        assert paths(native)[3:] == ["/v1/responses", "/v1/chat/completions", "/v1/responses"]
    finally:
        await native.stop()


# -- chains and Conversations ---------------------------------------------------------------


async def test_chains_and_conversations_send_the_whole_thread_as_chat(
    make_proxy: MakeProxy, provider: FakeProvider
) -> None:
    proxy = await make_proxy(upstream_extra=CHAT)
    client = proxy.client()
    provider.script += [Reply(text="Noted: blue."), Reply(text="Blue."), Reply(text="Yes.")]
    first = await client.responses.create(model="gpt-4o", input="My color is blue.")
    second = await client.responses.create(
        model="gpt-4o", previous_response_id=first.id, input="My color?"
    )
    assert second.output_text == "Blue." and second.previous_response_id == first.id
    assert [m["content"] for m in last_chat(provider)["messages"]] == [
        "My color is blue.",
        "Noted: blue.",
        "My color?",
    ]
    conversation = await client.conversations.create()
    await client.responses.create(model="gpt-4o", input="Hi", conversation=conversation.id)
    items = (await client.conversations.items.list(conversation.id, order="asc")).data
    assert [getattr(i, "role", None) for i in items] == ["user", "assistant"]
    assert items[1].content[0].text == "Yes."  # type: ignore[union-attr]


# -- streams --------------------------------------------------------------------------------


async def sse_events(proxy: Proxy, body: dict[str, Any]) -> list[dict[str, Any]]:
    async with proxy.http() as http:
        answer = await http.post("/v1/responses", json={**body, "stream": True}, headers=AUTH)
    assert answer.headers["content-type"].startswith("text/event-stream")
    events = []
    for frame in answer.text.split("\n\n"):
        data = [line[6:] for line in frame.splitlines() if line.startswith("data: ")]
        if data:
            events.append(json.loads("\n".join(data)))
    return events


async def test_a_streamed_text_answer_is_the_documented_event_sequence(
    make_proxy: MakeProxy, provider: FakeProvider
) -> None:
    proxy = await make_proxy(upstream_extra=CHAT)
    provider.script.append(Reply(text="Hello big world"))
    events = await sse_events(proxy, {"model": "gpt-4o", "input": "hi"})
    assert [e["type"] for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    for event in events:
        check_shape(event)
    item_id = events[2]["item"]["id"]
    assert all(e["item_id"] == item_id for e in events[3:9])
    assert "".join(e["delta"] for e in events[4:7]) == "Hello big world"
    final = events[-1]["response"]
    assert final["status"] == "completed" and final["usage"]["input_tokens"] > 0
    assert final["output"][0]["content"][0]["text"] == "Hello big world"
    assert last_chat(provider)["stream_options"] == {"include_usage": True}


def chunk(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> bytes:
    choice = {"index": 0, "delta": delta, "finish_reason": finish}
    body = {"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": "m"}
    return encode_json_event({**body, "choices": [choice], **extra})


def call_delta(index: int, arguments: str, name: str | None = None) -> dict[str, Any]:
    function: dict[str, Any] = {"arguments": arguments}
    opening: dict[str, Any] = {}
    if name is not None:
        function["name"] = name
        opening = {"id": f"call_{name}", "type": "function"}
    return {"tool_calls": [{"index": index, **opening, "function": function}]}


INTERLEAVED = [
    chunk({"role": "assistant", "content": None}),
    chunk(call_delta(0, "", name="weather")),
    chunk(call_delta(1, "", name="time")),
    chunk(call_delta(0, '{"city":')),
    chunk(call_delta(1, '{"tz":')),
    chunk(call_delta(0, ' "Oslo"}')),
    chunk(call_delta(1, ' "CET"}')),
    chunk({}, "tool_calls"),
    encode_json_event(
        {
            "id": "c1",
            "object": "chat.completion.chunk",
            "created": 1,
            "model": "m",
            "choices": [],
            "usage": {"prompt_tokens": 9, "completion_tokens": 4, "total_tokens": 13},
        }
    ),
    encode_event(DONE),
]


async def test_streamed_parallel_calls_interleave_by_index(
    make_proxy: MakeProxy, provider: FakeProvider
) -> None:
    proxy = await make_proxy(upstream_extra=CHAT)
    provider.script.append(Reply(frames=INTERLEAVED))
    tools = [
        {"type": "function", "name": "weather", "parameters": {"type": "object"}},
        {"type": "function", "name": "time", "parameters": {"type": "object"}},
    ]
    events = await sse_events(proxy, {"model": "gpt-4o", "input": "both?", "tools": tools})
    shown = [(e["type"], e.get("output_index"), e.get("delta")) for e in events]
    assert shown == [
        ("response.created", None, None),
        ("response.in_progress", None, None),
        ("response.output_item.added", 0, None),
        ("response.output_item.added", 1, None),
        ("response.function_call_arguments.delta", 0, '{"city":'),
        ("response.function_call_arguments.delta", 1, '{"tz":'),
        ("response.function_call_arguments.delta", 0, ' "Oslo"}'),
        ("response.function_call_arguments.delta", 1, ' "CET"}'),
        ("response.function_call_arguments.done", 0, None),
        ("response.output_item.done", 0, None),
        ("response.function_call_arguments.done", 1, None),
        ("response.output_item.done", 1, None),
        ("response.completed", None, None),
    ]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    for event in events:
        check_shape(event)
    assert events[8]["arguments"] == '{"city": "Oslo"}' and events[8]["name"] == "weather"
    final = events[-1]["response"]
    assert [(i["call_id"], i["arguments"]) for i in final["output"]] == [
        ("call_weather", '{"city": "Oslo"}'),
        ("call_time", '{"tz": "CET"}'),
    ]
    assert final["usage"] == {
        "input_tokens": 9,
        "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
        "output_tokens": 4,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": 13,
    }


async def test_the_sdk_streams_a_translated_turn_and_its_chain_continues(
    make_proxy: MakeProxy, provider: FakeProvider
) -> None:
    proxy = await make_proxy(upstream_extra=CHAT)
    client = proxy.client()
    provider.script += [Reply(text="Streamed words here"), Reply(text="Again.")]
    async with client.responses.stream(model="gpt-4o", input="hi") as stream:
        texts = [e.delta async for e in stream if e.type == "response.output_text.delta"]
        final = await stream.get_final_response()
    assert "".join(texts) == "Streamed words here" == final.output_text
    follow = await client.responses.create(
        model="gpt-4o", previous_response_id=final.id, input="more"
    )
    assert follow.output_text == "Again."
    assert [m["role"] for m in last_chat(provider)["messages"]] == ["user", "assistant", "user"]


@pytest.mark.parametrize(
    "frames",
    [
        [chunk({"content": "Hel"}), b"data: {not json\n\n"],
        [chunk({"content": "Hel"}), chunk(call_delta(0, '{"city": "Os', name="weather"))],
    ],
    ids=["chunk_not_json", "arguments_never_close"],
)
async def test_a_broken_chat_stream_ends_with_an_error_event_and_keeps_nothing(
    make_proxy: MakeProxy, provider: FakeProvider, frames: list[bytes]
) -> None:
    proxy = await make_proxy(upstream_extra=CHAT)
    provider.script.append(Reply(frames=frames))
    conversation = await proxy.client().conversations.create()
    events = await sse_events(
        proxy, {"model": "gpt-4o", "input": "hi", "conversation": conversation.id}
    )
    assert events[-1]["type"] == "error"
    assert not any(e["type"] == "response.completed" for e in events)
    assert (await proxy.client().conversations.items.list(conversation.id)).data == []


async def test_a_chat_stream_cut_mid_answer_is_an_error_event(
    make_proxy: MakeProxy, provider: FakeProvider
) -> None:
    proxy = await make_proxy(upstream_extra=CHAT)
    provider.script.append(Reply(text="one two three four five", disconnect_after=3))
    events = await sse_events(proxy, {"model": "gpt-4o", "input": "hi"})
    assert events[-1]["type"] == "error"
    assert events[-1]["code"] == "upstream_stream_error"


async def test_http_errors_are_not_500s(make_proxy: MakeProxy, provider: FakeProvider) -> None:
    proxy = await make_proxy(upstream_extra=CHAT)
    provider.script.append(Reply(raw=b"not json at all"))
    async with httpx.AsyncClient(base_url=proxy.base_url, timeout=30) as http:
        answer = await http.post("/responses", json={"model": "gpt-4o", "input": "x"}, headers=AUTH)
    assert answer.status_code == 502
    assert answer.json()["error"]["code"] == "bad_upstream_answer"


# -- the Agents SDK, unchanged ----------------------------------------------------------------


async def test_the_agents_sdk_runs_a_tool_loop_and_a_session_over_chat(
    make_proxy: MakeProxy, provider: FakeProvider
) -> None:
    proxy = await make_proxy()  # upstream.api: auto
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
    assert paths(provider).count("/v1/responses") == 1  # learnt once, then Chat only
    messages = last_chat(provider)["messages"]
    assert [m["role"] for m in messages] == [
        "system", "user", "assistant", "tool", "assistant", "user",
    ]  # fmt: skip
    assert messages[2]["tool_calls"][0]["id"] == messages[3]["tool_call_id"]
    items = await session.get_items()
    assert [i.get("role") or i.get("type") for i in items] == [
        "user", "function_call", "function_call_output", "assistant", "user", "assistant",
    ]  # fmt: skip


async def test_the_agents_sdk_streams_over_chat(
    make_proxy: MakeProxy, provider: FakeProvider
) -> None:
    proxy = await make_proxy(upstream_extra=CHAT)
    LOOKUPS.clear()
    provider.script += [
        Reply(tool_calls=[("order_status", '{"order_id": "ORD-9"}')]),
        Reply(text="ORD-9 has shipped."),
    ]
    result = Runner.run_streamed(agent_for(proxy), "Where is ORD-9?")
    async for _ in result.stream_events():
        pass
    assert result.final_output == "ORD-9 has shipped."
    assert LOOKUPS == ["ORD-9"]


async def test_the_documented_agents_snippet_runs_unchanged_over_chat(
    proxy: Proxy, provider: FakeProvider, tmp_path: Path
) -> None:
    (snippet,) = [s for s in SNIPPETS if "from agents import" in s.code]
    ran = await run(snippet.code, proxy, tmp_path)
    assert ran.code == 0, ran.output
    assert paths(provider) == ["/v1/responses", *["/v1/chat/completions"] * 2]
    contents = [m.get("content") for m in last_chat(provider)["messages"]]
    assert "Where is my order 4417?" in contents and contents[-1] == "Refund it."


# -- the ledger on translated turns -----------------------------------------------------------

LEDGER_POLICY = """\
tools:
  refund_order:
    side_effect: true
    idempotency_key: "refund:{order_id}"
    on_duplicate: replay
"""


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
async def test_a_repeated_side_effect_is_replayed_and_the_turn_continues_over_chat(
    make_proxy: MakeProxy, provider: FakeProvider, stream: bool
) -> None:
    proxy = await make_proxy(upstream_extra=CHAT, acme_extra=LEDGER_POLICY)
    client = proxy.client()
    tools: Any = [{"type": "function", "name": "refund_order", "parameters": {"type": "object"}}]
    refund = ("refund_order", '{"order_id": "ORD-1"}')
    provider.script += [
        Reply(tool_calls=[refund]),
        Reply(text="Refunded."),
        Reply(tool_calls=[refund]),  # the model asks again: the ledger replays the result
        Reply(text="It was refunded already."),
    ]
    conversation = await client.conversations.create()
    first = await client.responses.create(
        model="gpt-4o", input="Refund ORD-1", conversation=conversation.id, tools=tools
    )
    [call] = [item for item in first.output if item.type == "function_call"]
    output: Any = [{"type": "function_call_output", "call_id": call.call_id, "output": "done"}]
    await client.responses.create(
        model="gpt-4o", input=output, conversation=conversation.id, tools=tools
    )
    again = {"model": "gpt-4o", "input": "Refund it again", "conversation": conversation.id}
    if stream:
        events = await sse_events(proxy, {**again, "tools": tools})
        final = events[-1]["response"]
        assert events[-1]["type"] == "response.completed"
        text = final["output"][-1]["content"][0]["text"]
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
    else:
        text = (await client.responses.create(**again, tools=tools)).output_text
    assert text == "It was refunded already."
    assert set(paths(provider)) == {"/v1/chat/completions"}
    continued = last_chat(provider)["messages"]
    assert continued[-1]["role"] == "tool" and continued[-2]["role"] == "assistant"
    assert continued[-1]["tool_call_id"] == continued[-2]["tool_calls"][0]["id"]


async def test_auto_refuses_a_hosted_tool_found_chat_only_and_keeps_nothing(
    make_proxy: MakeProxy, provider: FakeProvider
) -> None:
    proxy = await make_proxy()  # upstream.api: auto, nothing learnt yet
    client = proxy.client()
    conversation = await client.conversations.create()
    with pytest.raises(openai.BadRequestError) as caught:
        await client.responses.create(
            model="gpt-4o",
            input="news?",
            conversation=conversation.id,
            tools=[{"type": "web_search"}],
        )
    body: Any = caught.value.body
    assert body["param"] == "tools[0]"
    assert paths(provider) == ["/v1/responses"]  # nothing went to Chat
    assert (await client.conversations.items.list(conversation.id)).data == []
    provider.script.append(Reply(text="ok"))
    answer = await client.responses.create(model="gpt-4o", input="hi", conversation=conversation.id)
    assert answer.output_text == "ok"
    assert paths(provider)[1:] == ["/v1/responses", "/v1/chat/completions"]


# -- background mode on top ------------------------------------------------------------------


async def test_background_mode_runs_over_a_chat_only_provider(
    make_proxy: MakeProxy, provider: FakeProvider
) -> None:
    """Background mode is the proxy's own: over a Chat-only provider it polls to completed,
    streams with sequence numbers, resumes after the last event seen, and the provider
    gets Chat requests without `background`."""
    proxy = await make_proxy(upstream_extra=CHAT)
    client = proxy.client()
    provider.script.append(Reply(text="the long answer"))
    created = await client.responses.create(model="gpt-4o", input="think hard", background=True)
    assert (created.status, created.background) == ("in_progress", True)
    for _ in range(1000):  # bounded: a response left in_progress fails the test
        polled = await client.responses.retrieve(created.id)
        if polled.status != "in_progress":
            break
        await asyncio.sleep(0.02)
    assert polled.status == "completed" and polled.output_text == "the long answer"
    assert paths(provider) == ["/v1/chat/completions"]
    assert "background" not in last_chat(provider)

    provider.script.append(Reply(text="one two three four"))
    stream = await client.responses.create(
        model="gpt-4o", input="go on", previous_response_id=created.id, background=True, stream=True
    )
    seen = [event async for event in stream]
    assert [e.sequence_number for e in seen] == list(range(len(seen)))
    assert seen[-1].type == "response.completed"
    assert seen[-1].response.output_text == "one two three four"
    resumed = await client.responses.retrieve(seen[-1].response.id, stream=True, starting_after=1)
    rest = [event async for event in resumed]
    assert [e.sequence_number for e in rest] == list(range(2, len(seen)))
    assert paths(provider) == ["/v1/chat/completions"] * 2
    texts = json.dumps(last_chat(provider)["messages"])
    assert "think hard" in texts and "the long answer" in texts


# -- reasoning (vLLM's and DeepSeek's reasoning_content, Ollama's reasoning) ------------------


@pytest.mark.parametrize("key", ["reasoning_content", "reasoning"])
async def test_chat_reasoning_is_a_reasoning_item_and_is_not_sent_back(
    make_proxy: MakeProxy, provider: FakeProvider, key: str
) -> None:
    proxy = await make_proxy(upstream_extra=CHAT)
    client = proxy.client()
    provider.script += [
        Reply(text="It is 4.", reasoning="Two and two make four.", reasoning_key=key),
        Reply(text="Still 4."),
    ]
    first = await client.responses.create(model="gpt-4o", input="2+2?")
    thought, answer = first.output
    assert thought.type == "reasoning" and thought.id.startswith("rs_")
    assert thought.content is not None
    assert [(c.type, c.text) for c in thought.content] == [
        ("reasoning_text", "Two and two make four.")
    ]
    assert answer.type == "message" and first.output_text == "It is 4."
    follow = await client.responses.create(
        model="gpt-4o", previous_response_id=first.id, input="Sure?"
    )
    assert follow.output_text == "Still 4."
    messages = last_chat(provider)["messages"]
    assert messages == [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "It is 4."},
        {"role": "user", "content": "Sure?"},
    ]
    stored = await client.responses.retrieve(first.id)  # the thread keeps it
    assert [item.type for item in stored.output] == ["reasoning", "message"]


async def test_streamed_chat_reasoning_is_the_documented_reasoning_events(
    make_proxy: MakeProxy, provider: FakeProvider
) -> None:
    proxy = await make_proxy(upstream_extra=CHAT)
    provider.script.append(
        Reply(text="It is 4.", reasoning="Two and two", reasoning_key="reasoning")
    )
    events = await sse_events(proxy, {"model": "gpt-4o", "input": "2+2?"})
    shown = [(e["type"], e.get("output_index"), e.get("delta")) for e in events]
    assert shown == [
        ("response.created", None, None),
        ("response.in_progress", None, None),
        ("response.output_item.added", 0, None),
        ("response.content_part.added", 0, None),
        ("response.reasoning_text.delta", 0, "Two"),
        ("response.reasoning_text.delta", 0, " and"),
        ("response.reasoning_text.delta", 0, " two"),
        ("response.reasoning_text.done", 0, None),
        ("response.content_part.done", 0, None),
        ("response.output_item.done", 0, None),
        ("response.output_item.added", 1, None),
        ("response.content_part.added", 1, None),
        ("response.output_text.delta", 1, "It"),
        ("response.output_text.delta", 1, " is"),
        ("response.output_text.delta", 1, " 4."),
        ("response.output_text.done", 1, None),
        ("response.content_part.done", 1, None),
        ("response.output_item.done", 1, None),
        ("response.completed", None, None),
    ]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    for event in events:
        check_shape(event)
    assert events[2]["item"] == {
        "id": events[2]["item"]["id"],
        "type": "reasoning",
        "status": "in_progress",
        "summary": [],
        "content": [],
    }
    assert events[3]["part"] == {"type": "reasoning_text", "text": ""}
    assert events[7]["text"] == "Two and two"
    final = events[-1]["response"]
    assert [item["type"] for item in final["output"]] == ["reasoning", "message"]
    assert final["output"][0]["content"] == [{"type": "reasoning_text", "text": "Two and two"}]


async def test_the_sdk_reads_streamed_reasoning_and_the_chain_drops_it(
    make_proxy: MakeProxy, provider: FakeProvider
) -> None:
    proxy = await make_proxy(upstream_extra=CHAT)
    client = proxy.client()
    provider.script += [Reply(text="Four.", reasoning="Adding up."), Reply(text="Yes.")]
    async with client.responses.stream(model="gpt-4o", input="2+2?") as stream:
        thoughts = [e.delta async for e in stream if e.type == "response.reasoning_text.delta"]
        final = await stream.get_final_response()
    assert "".join(thoughts) == "Adding up."
    assert [item.type for item in final.output] == ["reasoning", "message"]
    await client.responses.create(model="gpt-4o", previous_response_id=final.id, input="Sure?")
    sent = last_chat(provider)["messages"]
    assert [m["role"] for m in sent] == ["user", "assistant", "user"]
    assert all(set(m) <= {"role", "content"} for m in sent)


# -- the output cap's field -------------------------------------------------------------------


def caps(provider: FakeProvider) -> list[tuple[str, int]]:
    """The output-cap field and value of each Chat request the provider got."""
    out = []
    for request in provider.model_requests:
        for key in ("max_completion_tokens", "max_tokens"):
            if key in request.json:
                out.append((key, request.json[key]))
    return out


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
async def test_a_refused_cap_field_is_retried_with_the_other_and_remembered(
    make_proxy: MakeProxy, provider: FakeProvider, stream: bool
) -> None:
    proxy = await make_proxy(upstream_extra=CHAT)
    client = proxy.client()
    provider.refused_params = {"max_completion_tokens": "vllm"}  # vLLM before 0.6
    provider.script += [Reply(text="One."), Reply(text="Two.")]
    if stream:
        async with client.responses.stream(
            model="gpt-4o", input="hi", max_output_tokens=40
        ) as events:
            first = await events.get_final_response()
    else:
        first = await client.responses.create(model="gpt-4o", input="hi", max_output_tokens=40)
    assert first.output_text == "One." and first.status == "completed"
    assert caps(provider) == [("max_completion_tokens", 40), ("max_tokens", 40)]
    second = await client.responses.create(
        model="gpt-4o", previous_response_id=first.id, input="more", max_output_tokens=30
    )
    assert second.output_text == "Two."
    assert caps(provider)[2:] == [("max_tokens", 30)]  # remembered: no refused call


async def test_an_ignored_cap_field_moves_later_turns_to_max_tokens_and_back_on_openais_400(
    make_proxy: MakeProxy, provider: FakeProvider
) -> None:
    proxy = await make_proxy(upstream_extra=CHAT)
    client = proxy.client()
    long_text = "word " * 40  # the fake honours no cap: Ollama with max_completion_tokens
    provider.script += [Reply(text=long_text), Reply(text="ok"), Reply(text="ok again")]
    first = await client.responses.create(model="gpt-4o", input="talk", max_output_tokens=5)
    assert first.usage is not None and first.usage.output_tokens > 5
    await client.responses.create(model="gpt-4o", input="short", max_output_tokens=5)
    assert caps(provider) == [("max_completion_tokens", 5), ("max_tokens", 5)]
    provider.refused_params = {"max_tokens": "openai"}  # an OpenAI reasoning model
    third = await client.responses.create(model="gpt-4o", input="again", max_output_tokens=5)
    assert third.output_text == "ok again"
    assert caps(provider)[2:] == [("max_tokens", 5), ("max_completion_tokens", 5)]


async def test_another_400_naming_the_cap_is_relayed_not_retried(
    make_proxy: MakeProxy, provider: FakeProvider
) -> None:
    proxy = await make_proxy(upstream_extra=CHAT)
    message = "'max_completion_tokens' must be at most 4096."
    provider.script.append(Reply(status=400, text=message))
    with pytest.raises(openai.BadRequestError) as caught:
        await proxy.client().responses.create(model="gpt-4o", input="hi", max_output_tokens=9000)
    body: Any = caught.value.body
    assert body["message"] == message
    assert caps(provider) == [("max_completion_tokens", 9000)]


# -- docs/integrations.md's Chat-only policies ------------------------------------------------

INTEGRATIONS = Path(__file__).parent.parent.parent / "docs" / "integrations.md"


def chat_only_policies() -> list[str]:
    """The whole-file policies of the section 'Responses and Conversations over a
    Chat-only provider'."""
    text = INTEGRATIONS.read_text()
    section = text.split("### Responses and Conversations over a Chat-only provider", 1)[1]
    section = section.split("\n## ", 1)[0]
    found = re.findall(r"^```yaml\n(.*?)^```", section, re.M | re.S)
    return [policy for policy in found if policy.startswith("# ") and "tenant: default" in policy]


@pytest.mark.parametrize("policy", chat_only_policies(), ids=lambda p: p.split(":")[0][2:])
async def test_each_documented_server_policy_runs_the_agents_snippet_as_it_is(
    proxy: Proxy, provider: FakeProvider, tmp_path: Path, policy: str
) -> None:
    served = re.sub(r'base_url: "[^"]+"', f'base_url: "{provider.base_url}"', policy)
    (proxy.policies_dir / "default.yaml").write_text(served)
    assert proxy.app[POLICIES].reload() == []  # type: ignore[index]
    (snippet,) = [s for s in SNIPPETS if "from agents import" in s.code]
    # Any key: the documented policy takes unknown keys (and forwards them).
    ran = await run(snippet.code.replace('"<proxy key>"', '"sk-anything"'), proxy, tmp_path)
    assert ran.code == 0, ran.output
    chat = [r for r in provider.model_requests if r.path == "/v1/chat/completions"]
    assert len(chat) == 2 and chat[0].headers["Authorization"] == "Bearer sk-anything"
    assert chat[-1].json["model"] == "gpt-4o"
    assert [m["content"] for m in chat[-1].json["messages"]][-1] == "Refund it."


def test_the_documented_policies_are_the_four_servers() -> None:
    names = [policy.split(":")[0][2:] for policy in chat_only_policies()]
    assert names == ["Ollama", "llama.cpp", "TGI", "vLLM"]
