"""The fake provider speaks OpenAI's wire format: checked with the real SDK, and its
streams parsed with our own SSE decoder and accumulators (a cross-check of both)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageFunctionToolCall

from proxy.core.tokens import TokenCounter
from proxy.fake_provider import FakeProvider, Reply
from proxy.sse import ChatStreamAccumulator, ResponsesStreamAccumulator, SSEDecoder, SSEEvent

MODEL = "gpt-4o-mini"
# Any: the SDK's TypedDict params would reject plain dict literals in mypy.
MESSAGES: list[Any] = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is the weather in Paris today, please?"},
]
TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
ARGS = '{"city": "Paris", "unit": "celsius"}'


@pytest.fixture
async def provider() -> AsyncIterator[FakeProvider]:
    async with FakeProvider() as fake:
        yield fake


@pytest.fixture
async def client(provider: FakeProvider) -> AsyncIterator[openai.AsyncOpenAI]:
    assert provider.base_url is not None
    async with openai.AsyncOpenAI(base_url=provider.base_url, api_key="x", max_retries=0) as sdk:
        yield sdk


@pytest.fixture
async def http(provider: FakeProvider) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=str(provider.base_url)) as raw:
        yield raw


async def sse_events(http: httpx.AsyncClient, path: str, body: dict[str, Any]) -> list[SSEEvent]:
    """Every event of a stream, decoded from the chunks exactly as the socket gave them."""
    decoder = SSEDecoder()
    events: list[SSEEvent] = []
    async with http.stream("POST", path, json=body) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        async for chunk in response.aiter_raw():
            events.extend(decoder.feed(chunk))
    return events + decoder.flush()


# --- Chat -------------------------------------------------------------------------------


async def test_default_chat_reply_echoes_the_user_and_counts_tokens(
    provider: FakeProvider, client: openai.AsyncOpenAI
) -> None:
    completion = await client.chat.completions.create(model=MODEL, messages=MESSAGES)
    message = completion.choices[0].message
    assert message.role == "assistant"
    assert message.content == "ok: What is the weather in Paris today, plea..."
    assert completion.choices[0].finish_reason == "stop"
    counter = TokenCounter.for_model(MODEL)
    assert completion.usage is not None
    assert completion.usage.prompt_tokens == counter.chat_prompt(MESSAGES)
    assert completion.usage.completion_tokens == counter.text(message.content)
    recorded = provider.requests[-1]
    assert (recorded.method, recorded.path) == ("POST", "/v1/chat/completions")
    assert recorded.json["messages"] == MESSAGES
    assert recorded.headers["authorization"] == recorded.headers["Authorization"] == "Bearer x"


async def test_scripted_chat_tool_calls_reach_the_sdk(
    provider: FakeProvider, client: openai.AsyncOpenAI
) -> None:
    provider.script.append(Reply(tool_calls=[("get_weather", ARGS), ("get_time", "{}")]))
    completion = await client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        tools=TOOLS,
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    calls = choice.message.tool_calls or []
    assert all(isinstance(c, ChatCompletionMessageFunctionToolCall) for c in calls)
    functions = [c.function for c in calls if isinstance(c, ChatCompletionMessageFunctionToolCall)]
    assert [(f.name, f.arguments) for f in functions] == [
        ("get_weather", ARGS),
        ("get_time", "{}"),
    ]
    assert len({c.id for c in calls}) == 2
    assert completion.usage is not None
    counter = TokenCounter.for_model(MODEL)
    assert completion.usage.prompt_tokens == counter.chat_prompt(MESSAGES, TOOLS)
    assert provider.script == []


async def test_chat_stream_through_the_sdk_and_our_accumulator_agree(
    provider: FakeProvider, client: openai.AsyncOpenAI, http: httpx.AsyncClient
) -> None:
    reply = Reply(text="Sunny, 24 degrees.", tool_calls=[("get_weather", ARGS)])
    provider.script.extend([reply, reply])
    stream = await client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        stream=True,
        stream_options={"include_usage": True},
    )
    sdk_text, sdk_args = "", ""
    async for chunk in stream:
        for choice in chunk.choices:
            sdk_text += choice.delta.content or ""
            for call in choice.delta.tool_calls or ():
                sdk_args += (call.function and call.function.arguments) or ""
        if chunk.usage is not None:
            sdk_usage = chunk.usage
    assert (sdk_text, sdk_args) == ("Sunny, 24 degrees.", ARGS)

    body = {
        "model": MODEL,
        "messages": MESSAGES,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    events = await sse_events(http, "/chat/completions", body)
    assert events[-1].data == "[DONE]"
    acc = ChatStreamAccumulator()
    deltas_with_args = 0
    for event in events[:-1]:
        chunk_json = event.json()
        acc.feed(chunk_json)
        for choice in chunk_json["choices"]:
            deltas_with_args += bool(choice["delta"].get("tool_calls"))
    assert deltas_with_args > 2  # arguments really arrive in several pieces
    result = acc.result()
    message = result["choices"][0]["message"]
    assert message["content"] == "Sunny, 24 degrees."
    assert [c["function"]["arguments"] for c in acc.tool_calls()] == [ARGS]
    assert result["choices"][0]["finish_reason"] == "tool_calls"
    assert result["usage"]["prompt_tokens"] == sdk_usage.prompt_tokens


async def test_chat_stream_without_include_usage_has_no_usage_chunk(
    http: httpx.AsyncClient,
) -> None:
    events = await sse_events(http, "/chat/completions", {"model": MODEL, "stream": True})
    chunks = [event.json() for event in events[:-1]]
    assert all("usage" not in chunk for chunk in chunks)
    acc = ChatStreamAccumulator()
    for chunk in chunks:
        acc.feed(chunk)
    assert acc.result()["choices"][0]["message"]["content"] == "ok: "


async def test_stream_events_arrive_as_separate_socket_chunks(
    provider: FakeProvider, http: httpx.AsyncClient
) -> None:
    provider.script.append(Reply(text="one two three", stream_chunk_delay=0.01))
    decoder = SSEDecoder()
    per_chunk: list[int] = []
    body = {"model": MODEL, "stream": True, "messages": MESSAGES}
    async with http.stream("POST", "/chat/completions", json=body) as response:
        async for chunk in response.aiter_raw():
            per_chunk.append(len(decoder.feed(chunk)))
    # Events are written one by one: the client sees them as they come, not as one block.
    assert len(per_chunk) > 1 and sum(per_chunk) == 6  # role, 3 words, finish, [DONE]


# --- Responses ----------------------------------------------------------------------------


async def test_default_response_and_tool_calls_through_the_sdk(
    provider: FakeProvider, client: openai.AsyncOpenAI
) -> None:
    response = await client.responses.create(model=MODEL, input="Say hi", instructions="Be brief")
    assert response.output_text == "ok: Say hi"
    assert response.status == "completed"
    assert response.usage is not None and response.usage.output_tokens > 0

    provider.script.append(Reply(tool_calls=[("get_weather", ARGS)]))
    response = await client.responses.create(model=MODEL, input="Weather?", tools=[])
    [call] = response.output
    assert call.type == "function_call"
    assert (call.name, call.arguments) == ("get_weather", ARGS)
    assert call.call_id.startswith("call_")


async def test_responses_stream_event_sequence_and_accumulator(
    provider: FakeProvider, client: openai.AsyncOpenAI, http: httpx.AsyncClient
) -> None:
    reply = Reply(text="Looking it up.", tool_calls=[("get_weather", ARGS)])
    provider.script.extend([reply, reply])
    async with client.responses.stream(model=MODEL, input="Weather in Paris?") as stream:
        async for _ in stream:
            pass
        final = await stream.get_final_response()
    assert final.output_text == "Looking it up."
    assert [item.type for item in final.output] == ["message", "function_call"]

    events = await sse_events(http, "/responses", {"model": MODEL, "input": "x", "stream": True})
    kinds = [event.event for event in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds.count("response.output_text.delta") > 1
    assert kinds.count("response.function_call_arguments.delta") > 1
    assert kinds[-1] == "response.completed"
    payloads = [event.json() for event in events]
    assert [p["sequence_number"] for p in payloads] == list(range(len(payloads)))
    assert all(p["type"] == event.event for p, event in zip(payloads, events, strict=True))

    acc = ResponsesStreamAccumulator()
    for event, payload in zip(events[:-1], payloads[:-1], strict=True):
        acc.feed(str(event.event), payload)
    # Without the completed event the items are rebuilt from the stream itself...
    completed = payloads[-1]["response"]
    assert acc.output_items() == completed["output"]
    acc.feed("response.completed", payloads[-1])
    # ...and with it, the result is exactly what the provider reported.
    assert acc.result() == completed
    assert acc.usage() == completed["usage"]


# --- faults and other endpoints ------------------------------------------------------


async def test_error_reply_has_openai_envelope_headers_and_request_id(
    provider: FakeProvider, client: openai.AsyncOpenAI
) -> None:
    provider.script.append(
        Reply(status=429, text="Slow down.", retry_after="2", headers={"x-request-id": "req_7"})
    )
    with pytest.raises(openai.RateLimitError) as caught:
        await client.chat.completions.create(model=MODEL, messages=MESSAGES)
    error = caught.value
    assert error.status_code == 429
    assert error.request_id == "req_7"
    assert error.response.headers["retry-after"] == "2"
    assert error.body == {
        "message": "Slow down.",
        "type": "requests",
        "param": None,
        "code": "rate_limit_exceeded",
    }


async def test_an_error_on_a_stream_request_is_plain_json(
    provider: FakeProvider, client: openai.AsyncOpenAI
) -> None:
    provider.script.append(Reply(status=500))
    with pytest.raises(openai.InternalServerError) as caught:
        await client.responses.create(model=MODEL, input="x", stream=True)
    assert caught.value.response.headers["x-request-id"].startswith("req_")


async def test_exact_body_reply_is_returned_as_given(
    provider: FakeProvider, http: httpx.AsyncClient
) -> None:
    provider.script.append(Reply(body={"anything": ["goes"]}, headers={"x-extra": "1"}))
    response = await http.post("/chat/completions", json={"model": MODEL, "messages": []})
    assert response.json() == {"anything": ["goes"]}
    assert response.headers["x-extra"] == "1"


async def test_disconnect_after_cuts_the_stream_mid_body(
    provider: FakeProvider, http: httpx.AsyncClient
) -> None:
    provider.script.append(Reply(text="one two three four five", disconnect_after=3))
    decoder = SSEDecoder()
    events: list[SSEEvent] = []
    with pytest.raises(httpx.RemoteProtocolError):
        body = {"model": MODEL, "messages": MESSAGES, "stream": True}
        async with http.stream("POST", "/chat/completions", json=body) as response:
            async for chunk in response.aiter_raw():
                events.extend(decoder.feed(chunk))
    assert len(events) == 3
    assert all(event.data != "[DONE]" for event in events)


async def test_non_json_model_request_is_a_400(http: httpx.AsyncClient) -> None:
    response = await http.post("/responses", content=b"not json")
    assert response.status_code == 400
    assert response.json()["error"]["type"] == "invalid_request_error"


async def test_models_embeddings_and_echo(
    provider: FakeProvider, client: openai.AsyncOpenAI, http: httpx.AsyncClient
) -> None:
    models = await client.models.list()
    assert MODEL in [model.id async for model in models]

    embeddings = await client.embeddings.create(model="text-embedding-3-small", input=["a", "b"])
    assert [e.index for e in embeddings.data] == [0, 1]
    assert embeddings.data[0].embedding == [0.125, -0.25, 0.5, 0.0625]

    echoed = await http.put("/files/f1?purpose=batch&x=%2F", content=b'{"k": 1}')
    assert echoed.headers["x-request-id"].startswith("req_")
    assert echoed.json() == {
        "method": "PUT",
        "path": "/v1/files/f1",
        "query": "purpose=batch&x=%2F",
        "body": {"k": 1},
    }
    text = await http.post("/audio/raw", content=b"plain text")
    assert text.json()["body"] == "plain text"
    assert [r.path for r in provider.requests][-2:] == ["/v1/files/f1", "/v1/audio/raw"]
    assert provider.model_requests == []
    assert json.loads(provider.requests[-2].raw) == {"k": 1}


@pytest.mark.parametrize("path", ["/chat/completions", "/responses"])
async def test_unpaired_call_is_refused_like_openai(
    provider: FakeProvider, http: httpx.AsyncClient, path: str
) -> None:
    """OpenAI answers a tool call sent without its output with a 400; so does the fake,
    without consuming a scripted reply."""
    call = {"id": "call_9", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    if path == "/chat/completions":
        body: dict[str, Any] = {
            "model": MODEL,
            "messages": [
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "user", "content": "hi"},
            ],
        }
    else:
        item = {"type": "function_call", "call_id": "call_9", "name": "f", "arguments": "{}"}
        body = {"model": MODEL, "input": [item, {"role": "user", "content": "hi"}]}
    provider.script.append(Reply(text="kept"))
    refused = await http.post(path, json=body)
    assert refused.status_code == 400
    assert "call_9" in refused.json()["error"]["message"]
    assert provider.script == [Reply(text="kept")]


async def test_chat_only_mode_refuses_responses_and_holds_chat_to_its_rules() -> None:
    async with FakeProvider(chat_only=True) as fake:
        client = openai.AsyncOpenAI(base_url=fake.base_url, api_key="sk-x", max_retries=0)
        with pytest.raises(openai.NotFoundError):
            await client.responses.create(model=MODEL, input="hi")
        stray: list[Any] = [
            {"role": "user", "content": "hi"},
            {"role": "tool", "tool_call_id": "call_1", "content": "x"},
        ]
        with pytest.raises(openai.BadRequestError, match="role 'tool'"):
            await client.chat.completions.create(model=MODEL, messages=stray)
        with pytest.raises(openai.BadRequestError, match="Unrecognized request argument"):
            await client.chat.completions.create(
                model=MODEL, messages=MESSAGES, extra_body={"input": "hi"}
            )
        with pytest.raises(openai.BadRequestError, match="Invalid value: 'robot'"):
            await client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "robot", "content": "x"}],  # type: ignore[misc,list-item]
            )
        answer = await client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS)
        assert answer.choices[0].message.content
        await client.close()


@pytest.mark.parametrize("path", ["/chat/completions", "/responses"])
async def test_light_mode_counts_as_the_exact_one_and_keeps_no_record(path: str) -> None:
    """The benchmarks' stub: the same usage as the tests' stub (twice: the second time from
    its item counts), nothing recorded, a dangling call not its business."""
    call = {"type": "function_call", "call_id": "call_9", "name": "f", "arguments": "{}"}
    if path == "/chat/completions":
        body: dict[str, Any] = {"model": MODEL, "messages": MESSAGES, "tools": TOOLS}
    else:
        item = {"type": "function_call_output", "call_id": "call_9", "output": "x" * 300}
        given = [call, item, {"role": "user", "content": "hi there"}]
        body = {"model": MODEL, "input": given, "instructions": "Be terse.", "tools": TOOLS}
    async with FakeProvider() as exact, httpx.AsyncClient() as http:
        expected = (await http.post(f"{exact.base_url}{path}", json=body)).json()["usage"]
    async with FakeProvider(light=True) as fake, httpx.AsyncClient() as http:
        answers = [(await http.post(f"{fake.base_url}{path}", json=body)) for _ in range(2)]
        streamed = await http.post(f"{fake.base_url}{path}", json={**body, "stream": True})
        text = await http.post(f"{fake.base_url}/responses", json={"model": MODEL, "input": "hi"})
        dangling = await http.post(
            f"{fake.base_url}/responses", json={"model": MODEL, "input": [call]}
        )
    assert dangling.status_code == 200
    for answer in answers:
        assert answer.status_code == 200
        assert answer.json()["usage"] == expected
    assert text.json()["usage"]["input_tokens"] == TokenCounter.for_model(MODEL).responses_prompt(
        [], None
    ) + TokenCounter.for_model(MODEL).responses_item({"role": "user", "content": "hi"})
    assert streamed.headers["content-type"].startswith("text/event-stream")
    assert fake.requests == []
