"""Every list endpoint pages alike (proxy/server/pagination.py): `limit` 1..100, default
20 (OpenAI's list endpoints), and one OpenAI-shaped 400 naming the parameter."""

from __future__ import annotations

import pytest

from proxy.server.state import STORE
from proxy.store.base import LedgerEntry, Store
from tests.server.conftest import TENANT_KEY, Proxy

AUTH = {"Authorization": f"Bearer {TENANT_KEY}"}
NOW = "2025-01-01T00:00:00+00:00"


@pytest.fixture
def default_store_url(store_url: str) -> str:
    """Every test here runs on SQLite and on PostgreSQL: the backend changes nothing."""
    return store_url


def store_of(proxy: Proxy) -> Store:
    return proxy.app[STORE]  # type: ignore[index]


async def list_urls(proxy: Proxy, items: int) -> list[str]:
    """A conversation and a stored response with `items` items each, and the ledger with
    as many entries."""
    client = proxy.client()
    messages = [{"role": "user", "content": f"message {n}"} for n in range(items)]
    conversation = await client.conversations.create(items=messages[:20])  # type: ignore[arg-type]
    for start in range(20, items, 20):
        await client.conversations.items.create(
            conversation.id,
            items=messages[start : start + 20],  # type: ignore[arg-type]
        )
    response = await client.responses.create(model="gpt-4o", input=messages)  # type: ignore[arg-type]
    for n in range(items):
        await store_of(proxy).ledger_issue(
            LedgerEntry("acme", "tenant", f"refund:ORD-{n}", "refund_order", f"call_{n}",
                        None, None, "issued", "{}", None, 1, NOW, NOW)
        )  # fmt: skip
    return [
        f"/v1/conversations/{conversation.id}/items",
        f"/v1/responses/{response.id}/input_items",
        "/threadkeeper/v1/ledger",
    ]


async def test_one_default_and_one_maximum(proxy: Proxy) -> None:
    urls = await list_urls(proxy, 101)
    async with proxy.http() as http:
        for url in urls:
            default = (await http.get(url, headers=AUTH)).json()
            assert len(default["data"]) == 20, url
            most = (await http.get(url, params={"limit": "100"}, headers=AUTH)).json()
            assert len(most["data"]) == 100, url


@pytest.mark.parametrize(
    ("limit", "code", "message"),
    [
        (
            "0",
            "integer_below_min_value",
            "Invalid 'limit': integer below minimum value. Expected a value >= 1, but got 0 "
            "instead.",
        ),
        (
            "101",
            "integer_above_max_value",
            "Invalid 'limit': integer above maximum value. Expected a value <= 100, but got 101 "
            "instead.",
        ),
        ("ten", "invalid_type", "Invalid 'limit': expected an integer, but got 'ten' instead."),
    ],
)
async def test_one_error_for_a_bad_limit(proxy: Proxy, limit: str, code: str, message: str) -> None:
    urls = await list_urls(proxy, 1)
    async with proxy.http() as http:
        for url in urls:
            answer = await http.get(url, params={"limit": limit}, headers=AUTH)
            assert answer.status_code == 400, url
            assert answer.json()["error"] == {
                "message": message,
                "type": "invalid_request_error",
                "param": "limit",
                "code": code,
            }, url


async def test_one_error_for_a_bad_order(proxy: Proxy) -> None:
    conversation, response, _ = await list_urls(proxy, 1)
    async with proxy.http() as http:
        for url in (conversation, response):
            answer = await http.get(url, params={"order": "up"}, headers=AUTH)
            assert answer.status_code == 400, url
            assert answer.json()["error"] == {
                "message": "Invalid value: 'up'. Supported values are: 'asc' and 'desc'.",
                "type": "invalid_request_error",
                "param": "order",
                "code": "invalid_value",
            }, url
