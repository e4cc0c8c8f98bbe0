"""The Responses WebSocket mode (GET /v1/responses, `client.responses.connect()`) through
the proxy with the openai SDK and a fake provider, on SQLite and on PostgreSQL: the
same turn pipeline as HTTP, chaining on one socket, the socket's `store: false`
continuation, tool rounds, bad messages, limits and a client that leaves mid-response."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import openai
import pytest
import websockets

from proxy.fake_provider import Reply
from proxy.server.state import STORE
from proxy.store.base import Store

from .conftest import TENANT_KEY, Proxy

ProxyFactory = Callable[..., Awaitable[Proxy]]

TENANT = "acme"


@pytest.fixture
def default_store_url(store_url: str) -> str:
    """Every test here runs on SQLite and on PostgreSQL."""
    return store_url


def store_of(proxy: Proxy) -> Store:
    return proxy.app[STORE]  # type: ignore[index]


def sent_input(proxy: Proxy, index: int = -1) -> list[Any]:
    """The provider's `input` of a model request (the proxy always sends a list)."""
    body: dict[str, Any] = proxy.provider.model_requests[index].json
    return list(body["input"])


def texts(items: list[Any]) -> list[str]:
    out = []
    for item in items:
        content = item.get("content")
        if isinstance(content, str):
            out.append(content)
        elif isinstance(content, list):
            out.append("".join(part.get("text", "") for part in content))
        else:
            out.append(str(item.get("type")))
    return out


async def events_until_done(connection: Any) -> list[Any]:
    """Every server event of one response, up to and including its terminal or error."""
    events = []
    async for event in connection:
        events.append(event)
        if event.type in ("response.completed", "response.failed", "response.incomplete"):
            return events
        if event.type == "error":
            return events
    return events


def final(events: list[Any]) -> Any:
    assert events[-1].type == "response.completed", [e.type for e in events]
    return events[-1].response


async def test_two_chained_responses_on_one_socket(proxy: Proxy) -> None:
    proxy.provider.script.extend([Reply(text="first answer"), Reply(text="second answer")])
    client = proxy.client()
    async with client.responses.connect() as connection:
        await connection.response.create(model="gpt-4o", input="hello")
        events = await events_until_done(connection)
        first = final(events)
        assert [e.type for e in events][0] == "response.created"
        deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        assert deltas == "first answer"
        await connection.response.create(
            model="gpt-4o", input="and then?", previous_response_id=first.id
        )
        second = final(await events_until_done(connection))
    assert second.output_text == "second answer"
    assert second.previous_response_id == first.id
    # The provider got the whole chain, stateless, from the proxy's store.
    assert texts(sent_input(proxy)) == ["hello", "first answer", "and then?"]
    assert "previous_response_id" not in proxy.provider.model_requests[-1].json
    # Both are stored responses of the tenant: HTTP continues the socket's chain.
    stored = await client.responses.retrieve(second.id)
    assert stored.output_text == "second answer"
    proxy.provider.script.append(Reply(text="over http"))
    third = await client.responses.create(
        model="gpt-4o", input="last", previous_response_id=second.id
    )
    assert third.output_text == "over http"
    assert texts(sent_input(proxy)) == ["hello", "first answer", "and then?", "second answer", "last"]


async def test_an_unstored_response_continues_on_its_socket_only(proxy: Proxy) -> None:
    """`store: false`: the socket keeps its last response for `previous_response_id`
    (OpenAI's connection-local cache); nothing is stored, and neither HTTP nor another
    socket can continue it."""
    proxy.provider.script.extend([Reply(text="one"), Reply(text="two"), Reply(text="three")])
    client = proxy.client()
    async with client.responses.connect() as connection:
        await connection.response.create(model="gpt-4o", input="alpha", store=False)
        first = final(await events_until_done(connection))
        await connection.response.create(
            model="gpt-4o", input="beta", store=False, previous_response_id=first.id
        )
        second = final(await events_until_done(connection))
        assert texts(sent_input(proxy)) == ["alpha", "one", "beta"]
        # The socket's last response continues again: the whole unstored chain is sent.
        await connection.response.create(
            model="gpt-4o", input="gamma", store=False, previous_response_id=second.id
        )
        third = final(await events_until_done(connection))
        assert third.output_text == "three"
        assert texts(sent_input(proxy)) == ["alpha", "one", "beta", "two", "gamma"]
        # Only the last one is kept: the first is gone from the socket's memory.
        await connection.response.create(
            model="gpt-4o", input="again", store=False, previous_response_id=first.id
        )
        gone = await events_until_done(connection)
    assert gone[-1].type == "error"
    assert gone[-1].status == 400 and gone[-1].error.code == "previous_response_not_found"
    assert len(proxy.provider.model_requests) == 3
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(third.id)
    with pytest.raises(openai.BadRequestError):
        await client.responses.create(model="gpt-4o", input="x", previous_response_id=third.id)
    async with client.responses.connect() as other:
        await other.response.create(
            model="gpt-4o", input="x", store=False, previous_response_id=third.id
        )
        refused = await events_until_done(other)
    assert refused[-1].type == "error" and refused[-1].status == 400
    assert await store_of(proxy).get_response(TENANT, third.id) is None
    assert await store_of(proxy).list_threads(TENANT, limit=10) == ()


TOOLS = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "The weather of a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    }
]


@pytest.mark.parametrize("store", [True, False])
async def test_a_tool_call_round_on_one_socket(proxy: Proxy, store: bool) -> None:
    proxy.provider.script.extend(
        [Reply(tool_calls=[("get_weather", '{"city": "Paris"}')]), Reply(text="Sunny in Paris.")]
    )
    client = proxy.client()
    async with client.responses.connect() as connection:
        await connection.response.create(
            model="gpt-4o", input="Weather in Paris?", tools=TOOLS, store=store  # type: ignore[arg-type]
        )
        called = final(await events_until_done(connection))
        (call,) = [item for item in called.output if item.type == "function_call"]
        assert call.name == "get_weather"
        await connection.response.create(
            model="gpt-4o",
            tools=TOOLS,  # type: ignore[arg-type]
            store=store,
            previous_response_id=called.id,
            input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}],
        )
        answered = final(await events_until_done(connection))
    assert answered.output_text == "Sunny in Paris."
    sent = sent_input(proxy)
    assert [item.get("type", "message") for item in sent] == [
        "message",
        "function_call",
        "function_call_output",
    ]
    assert sent[1]["call_id"] == sent[2]["call_id"] == call.call_id


async def test_the_upgrade_is_authenticated(make_proxy: ProxyFactory) -> None:
    """A key the proxy does not know is a 401 at the upgrade: no socket, no model call."""
    strict = await make_proxy(allow_unknown=False)
    client = strict.client(api_key="sk-not-a-known-key")
    with pytest.raises(websockets.InvalidStatus) as raised:
        async with client.responses.connect():
            pass
    assert raised.value.response.status_code == 401
    assert b"invalid_api_key" in raised.value.response.body
    # No Authorization header at all (the SDK always sends one).
    url = strict.base_url.replace("http://", "ws://") + "/responses"
    with pytest.raises(websockets.InvalidStatus) as raised:
        async with websockets.connect(url):
            pass
    assert raised.value.response.status_code == 401
    assert b"You didn't provide an API key" in raised.value.response.body
    assert strict.provider.model_requests == []
