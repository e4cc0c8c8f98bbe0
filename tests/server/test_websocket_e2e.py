"""The Responses WebSocket mode (GET /v1/responses, `client.responses.connect()`) through
the proxy with the openai SDK and a fake provider, on SQLite and on PostgreSQL: the
same turn pipeline as HTTP, chaining on one socket, the socket's `store: false`
continuation, tool rounds, bad messages, limits and a client that leaves mid-response."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import openai
import pytest
import websockets

from proxy.fake_provider import Reply
from proxy.server.state import STORE
from proxy.store.base import Store

from .conftest import TENANT_KEY, Proxy

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
