"""Operator endpoints of the side-effect ledger (/threadkeeper/v1/ledger), and the
write-ahead guarantee seen from a raw stream."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import quote

import httpx
import pytest

from proxy.fake_provider import FakeProvider, Reply

from .conftest import TENANT_KEY, Proxy
from .test_ledger_e2e import REFUND, ChatAgent, Shop, synthetic_outputs, tools_policy

AUTH = {"Authorization": f"Bearer {TENANT_KEY}"}
ENTRY = "/threadkeeper/v1/ledger/tenant/" + quote("refund:ORD-1", safe="")


@pytest.fixture
def default_store_url(store_url: str) -> str:
    """Every test here runs on SQLite and on PostgreSQL: the backend changes nothing."""
    return store_url


@pytest.fixture
async def guarded(make_proxy: Callable[..., Awaitable[Proxy]]) -> Proxy:
    # No passthrough tenant: a request without a known key is a 401 here.
    return await make_proxy(acme_extra=tools_policy(), allow_unknown=False)


async def crashed_refund(proxy: Proxy, provider: FakeProvider) -> None:
    """A client received the refund call and never reported its outcome."""
    provider.script.append(Reply(tool_calls=[REFUND]))
    await ChatAgent(proxy, Shop(), stream=False).ask("Refund ORD-1", execute=False)


async def test_list_get_and_resolve_an_unknown_outcome(
    guarded: Proxy, provider: FakeProvider
) -> None:
    await crashed_refund(guarded, provider)
    async with guarded.http() as http:
        issued = (await http.get("/threadkeeper/v1/ledger?status=issued", headers=AUTH)).json()
        assert [e["key"] for e in issued["data"]] == ["refund:ORD-1"]
        done = await http.get("/threadkeeper/v1/ledger?status=completed", headers=AUTH)
        assert done.json()["data"] == []
        entry = (await http.get(ENTRY, headers=AUTH)).json()
        assert (entry["tool"], entry["status"], entry["attempts"]) == ("refund_order", "issued", 1)
        assert json.loads(entry["arguments"]) == {"order_id": "ORD-1"}

        body = {"status": "completed", "result": '{"refunded": "ORD-1", "by": "operator"}'}
        resolved = await http.post(ENTRY + "/resolve", json=body, headers=AUTH)
        assert resolved.status_code == 200 and resolved.json()["status"] == "completed"
        again = await http.post(ENTRY + "/resolve", json={"status": "failed"}, headers=AUTH)
        assert again.status_code == 409
        assert again.json()["error"]["code"] == "ledger_entry_not_issued"

    # The model asking again now gets the operator's result as a replay.
    provider.script += [Reply(tool_calls=[REFUND]), Reply(text="Already refunded.")]
    agent = ChatAgent(guarded, Shop(), stream=False)
    assert await agent.ask("Refund ORD-1") == "Already refunded."
    [replay] = synthetic_outputs(provider)
    assert replay["result"] == {"refunded": "ORD-1", "by": "operator"}


async def test_errors_in_openai_shape(guarded: Proxy, provider: FakeProvider) -> None:
    await crashed_refund(guarded, provider)
    async with guarded.http() as http:
        missing = await http.get("/threadkeeper/v1/ledger/tenant/refund%3AORD-9", headers=AUTH)
        assert missing.status_code == 404 and "error" in missing.json()
        bad = await http.get("/threadkeeper/v1/ledger?status=done", headers=AUTH)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "status"
        bad_limit = await http.get("/threadkeeper/v1/ledger?limit=0", headers=AUTH)
        assert bad_limit.status_code == 400
        issued = await http.post(ENTRY + "/resolve", json={"status": "issued"}, headers=AUTH)
        assert issued.status_code == 400
        anonymous = await http.get("/threadkeeper/v1/ledger")
        assert anonymous.status_code == 401
        entry = (await http.get(ENTRY, headers=AUTH)).json()
        assert entry["status"] == "issued"  # nothing above changed it


async def test_other_tenants_never_see_the_entry(
    make_proxy: Callable[..., Awaitable[Proxy]], provider: FakeProvider
) -> None:
    proxy = await make_proxy(acme_extra=tools_policy())
    await crashed_refund(proxy, provider)
    stranger = {"Authorization": "Bearer sk-someone-else"}  # the passthrough tenant
    async with proxy.http() as http:
        assert (await http.get(ENTRY, headers=stranger)).status_code == 404
        listed = await http.get("/threadkeeper/v1/ledger", headers=stranger)
        assert listed.json()["data"] == []
        resolve = await http.post(ENTRY + "/resolve", json={"status": "failed"}, headers=stranger)
        assert resolve.status_code == 404


async def test_stream_call_reaches_the_client_only_after_its_entry(
    guarded: Proxy, provider: FakeProvider
) -> None:
    """Write ahead (SPEC 6): when the first byte of the call arrives, its entry exists;
    the text before it was not held back."""
    provider.script.append(Reply(text="Refunding now.", tool_calls=[REFUND]))
    body: dict[str, Any] = {
        "model": "gpt-4o-mini",
        "stream": True,
        "messages": [{"role": "user", "content": "Refund ORD-1"}],
    }
    seen: list[str] = []
    entry_when_call_arrived = None
    async with guarded.http() as http:
        async with http.stream("POST", "/v1/chat/completions", json=body, headers=AUTH) as got:
            async for line in got.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                delta = json.loads(line[6:])["choices"][0]["delta"]
                if delta.get("content"):
                    seen.append("text")
                if delta.get("tool_calls"):
                    seen.append("call")
                    async with guarded.http() as ops:
                        entry_when_call_arrived = (await ops.get(ENTRY, headers=AUTH)).json()
    assert seen[0] == "text" and seen.count("call") == 1
    assert entry_when_call_arrived is not None
    assert entry_when_call_arrived["status"] == "issued"


async def test_limit_and_order(guarded: Proxy, provider: FakeProvider) -> None:
    for order in ("ORD-1", "ORD-2", "ORD-3"):
        provider.script.append(
            Reply(tool_calls=[("refund_order", json.dumps({"order_id": order}))])
        )
        await ChatAgent(guarded, Shop(), stream=False).ask(f"Refund {order}", execute=False)
    async with httpx.AsyncClient(base_url=guarded.base_url.removesuffix("/v1")) as http:
        page = (await http.get("/threadkeeper/v1/ledger?limit=2", headers=AUTH)).json()
    assert len(page["data"]) == 2
