"""Passthrough mode (`allow_unknown_keys: true`) isolates callers of unknown keys from each
other (issue 8 item 2; SPEC section 1): their local state lives under a namespace of the
key, as if each key were a tenant. A caller with `Bearer garbage` must not read, delete or
replay what another unknown key stored; the same key sees its own."""

from __future__ import annotations

import io
import json
from typing import Any
from urllib.parse import quote

import httpx
import pytest

from proxy.fake_provider import FakeProvider, Reply
from proxy.logs import configure_logging
from proxy.server.state import POLICIES, STORE

from .conftest import TENANT_KEY, Proxy
from .test_ledger_e2e import CHAT_TOOLS, REFUND, tools_policy

ALICE = {"Authorization": "Bearer sk-alice-own-openai-key-0001"}
MALLORY = {"Authorization": "Bearer garbage"}
ACME = {"Authorization": f"Bearer {TENANT_KEY}"}
MESSAGE = {"type": "message", "role": "user", "content": "alice's secret plan"}


@pytest.fixture
async def http(proxy: Proxy) -> Any:
    async with proxy.http() as client:
        yield client


async def test_conversations_are_per_key(http: httpx.AsyncClient) -> None:
    created = await http.post("/v1/conversations", json={"items": [MESSAGE]}, headers=ALICE)
    assert created.status_code == 200
    conv = created.json()["id"]
    path = f"/v1/conversations/{conv}"
    item_id = (await http.get(f"{path}/items", headers=ALICE)).json()["data"][0]["id"]

    for method, url in [
        ("GET", path),
        ("POST", path),
        ("DELETE", path),
        ("GET", f"{path}/items"),
        ("POST", f"{path}/items"),
        ("GET", f"{path}/items/{item_id}"),
        ("DELETE", f"{path}/items/{item_id}"),
    ]:
        body = {"items": [MESSAGE]} if url.endswith("/items") else {"metadata": {"x": "y"}}
        kwargs: dict[str, Any] = {"json": body} if method == "POST" else {}
        for stranger in (MALLORY, ACME):
            got = await http.request(method, url, headers=stranger, **kwargs)
            assert got.status_code == 404, (method, url, stranger, got.text)
    forked = await http.post(f"/threadkeeper/v1/conversations/{conv}/fork", headers=MALLORY)
    assert forked.status_code == 404

    # Nothing above touched Alice's conversation; her own key still sees all of it.
    items = (await http.get(f"{path}/items", headers=ALICE)).json()["data"]
    assert [i["id"] for i in items] == [item_id]
    assert (await http.get(path, headers=ALICE)).json()["metadata"] == {}


async def test_item_references_are_per_key(http: httpx.AsyncClient, provider: FakeProvider) -> None:
    created = await http.post("/v1/conversations", json={"items": [MESSAGE]}, headers=ALICE)
    conv = created.json()["id"]
    item_id = (await http.get(f"/v1/conversations/{conv}/items", headers=ALICE)).json()["data"][0][
        "id"
    ]
    reference = {"model": "gpt-4o", "input": [{"type": "item_reference", "id": item_id}]}
    before = len(provider.requests)
    got = await http.post("/v1/responses", json=reference, headers=MALLORY)
    assert got.status_code == 404, got.text
    assert got.json()["error"]["param"] == "input[0]"
    assert len(provider.requests) == before  # Alice's text never reached the provider
    provider.script.append(Reply(text="ok"))
    own = await http.post("/v1/responses", json=reference, headers=ALICE)
    assert own.status_code == 200, own.text
    assert provider.requests[-1].json["input"][0]["content"] == MESSAGE["content"]


async def test_responses_are_per_key(http: httpx.AsyncClient, provider: FakeProvider) -> None:
    body = {"model": "gpt-4o-mini", "input": "alice's secret plan"}
    first = await http.post("/v1/responses", json=body, headers=ALICE)
    assert first.status_code == 200
    rid = first.json()["id"]
    calls = len(provider.model_requests)

    for method, url in [
        ("GET", f"/v1/responses/{rid}"),
        ("GET", f"/v1/responses/{rid}/input_items"),
        ("DELETE", f"/v1/responses/{rid}"),
    ]:
        got = await http.request(method, url, headers=MALLORY)
        assert got.status_code == 404, (method, url, got.text)
    chained = {"model": "gpt-4o-mini", "input": "and?", "previous_response_id": rid}
    stolen = await http.post("/v1/responses", json=chained, headers=MALLORY)
    assert stolen.status_code == 400  # OpenAI's answer for an unknown previous response
    assert stolen.json()["error"]["code"] == "previous_response_not_found"
    assert len(provider.model_requests) == calls  # refused before the provider

    assert (await http.get(f"/v1/responses/{rid}", headers=ALICE)).status_code == 200
    items = (await http.get(f"/v1/responses/{rid}/input_items", headers=ALICE)).json()["data"]
    assert items[0]["content"][0]["text"] == "alice's secret plan"
    own = await http.post("/v1/responses", json=chained, headers=ALICE)
    assert own.status_code == 200
    sent = provider.model_requests[-1].json
    assert "alice's secret plan" in json.dumps(sent["input"])


async def test_chat_threads_are_per_key(http: httpx.AsyncClient, provider: FakeProvider) -> None:
    def turn(text: str) -> dict[str, Any]:
        return {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": text}]}

    thread = {"X-Thread-Id": "shared-name"}
    got = await http.post(
        "/v1/chat/completions", json=turn("alice's secret plan"), headers=ALICE | thread
    )
    assert got.status_code == 200
    got = await http.post("/v1/chat/completions", json=turn("hello"), headers=MALLORY | thread)
    assert got.status_code == 200
    assert "secret" not in json.dumps(provider.model_requests[-1].json["messages"])
    got = await http.post("/v1/chat/completions", json=turn("more"), headers=ALICE | thread)
    assert got.status_code == 200
    assert "alice's secret plan" in json.dumps(provider.model_requests[-1].json["messages"])


async def test_ledger_entries_are_per_key(
    proxy: Proxy, http: httpx.AsyncClient, provider: FakeProvider
) -> None:
    default = proxy.policies_dir / "default.yaml"
    default.write_text(default.read_text() + tools_policy())
    assert not proxy.app[POLICIES].reload()  # type: ignore[index]
    body = {
        "model": "gpt-4o-mini",
        "messages": [{"role": "user", "content": "Refund ORD-1"}],
        "tools": CHAT_TOOLS,
    }
    provider.script.append(Reply(tool_calls=[REFUND]))
    alice = await http.post("/v1/chat/completions", json=body, headers=ALICE)
    assert alice.json()["choices"][0]["message"]["tool_calls"]  # handed out, entry issued

    entry = "/threadkeeper/v1/ledger/tenant/" + quote("refund:ORD-1", safe="")
    assert (await http.get(entry, headers=MALLORY)).status_code == 404
    listed = await http.get("/threadkeeper/v1/ledger", headers=MALLORY)
    assert listed.json()["data"] == []
    resolve = await http.post(entry + "/resolve", json={"status": "failed"}, headers=MALLORY)
    assert resolve.status_code == 404
    # Mallory's own refund of the same order is hers to make, not a duplicate of Alice's.
    provider.script.append(Reply(tool_calls=[REFUND]))
    mallory = await http.post("/v1/chat/completions", json=body, headers=MALLORY)
    assert mallory.json()["choices"][0]["message"]["tool_calls"]

    mine = (await http.get(entry, headers=ALICE)).json()
    assert (
        mine["status"] == "issued"
        and mine["call_id"] == alice.json()["choices"][0]["message"]["tool_calls"][0]["id"]
    )


async def test_idempotency_keys_are_per_key(http: httpx.AsyncClient) -> None:
    key = {"Idempotency-Key": "create-1"}
    body = {"items": [MESSAGE]}
    first = await http.post("/v1/conversations", json=body, headers=ALICE | key)
    again = await http.post("/v1/conversations", json=body, headers=ALICE | key)
    assert again.json()["id"] == first.json()["id"]  # the same key replays its own record
    assert again.headers.get("Idempotent-Replayed") == "true"

    other = await http.post("/v1/conversations", json=body, headers=MALLORY | key)
    assert other.status_code == 200 and other.json()["id"] != first.json()["id"]
    assert (
        "Idempotent-Replayed" not in other.headers or other.headers["Idempotent-Replayed"] != "true"
    )
    different = await http.post(
        "/v1/conversations", json={}, headers={**ALICE, **key, "Authorization": "Bearer sk-carol"}
    )
    assert different.status_code == 200  # not a 422: Carol never used this key


async def test_keyed_tenants_keep_their_namespace_and_logs_stay_low_cardinality(
    proxy: Proxy, http: httpx.AsyncClient
) -> None:
    stream = io.StringIO()
    configure_logging("info", stream)
    try:
        acme = await http.post("/v1/conversations", json={}, headers=ACME)
        alice = await http.post("/v1/conversations", json={}, headers=ALICE)
    finally:
        configure_logging("info")
    store = proxy.app[STORE]  # type: ignore[index]
    assert await store.get_thread("acme", acme.json()["id"]) is not None  # unchanged layout
    assert await store.get_thread("default", alice.json()["id"]) is None
    lines = [json.loads(x) for x in stream.getvalue().splitlines() if x.startswith("{")]
    requests = [x for x in lines if x.get("event") == "request"]
    assert [x["tenant"] for x in requests] == ["acme", "default"]
    # the log names where the state lives as the CLI and the inspector do (namespaces.py)
    stored = await store.find_threads(alice.json()["id"])
    assert [x["namespace"] for x in requests] == ["acme", stored[0].tenant]
    assert stored[0].tenant.startswith("default:")
    async with httpx.AsyncClient(base_url=str(http.base_url)) as raw:
        metrics = (await raw.get("/metrics")).text
    assert 'tenant="default"' in metrics and "caller" not in metrics
