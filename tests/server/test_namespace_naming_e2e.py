"""One naming of passthrough callers everywhere (issue 20 item 11; proxy/namespaces.py):
the log line, the CLI, the inspector and `compaction show` name a caller's state by
tenant `default` and namespace `default:<hash>`; metrics by the tenant only. A tenant
filter (`--tenant default`, the inspector's tenant field) finds every caller of the
tenant; a namespace filter one caller's."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Awaitable, Callable
from html import unescape
from typing import Any

import httpx
import pytest
from structlog.testing import capture_logs

from proxy.cli import main
from proxy.fake_provider import FakeProvider, Reply
from proxy.server.state import POLICIES, SETTINGS

from .conftest import TENANT_KEY, Proxy
from .test_compaction_e2e import history
from .test_explain_e2e import written
from .test_ledger_e2e import CHAT_TOOLS, REFUND, tools_policy

ALICE = "sk-alice-own-openai-key-0001"
BOB = "sk-bob-own-openai-key-00002"
OPERATOR = "op-token-for-the-namespace-tests"


async def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = await asyncio.to_thread(main, list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


async def conversations(proxy: Proxy) -> tuple[dict[str, str], dict[str, str]]:
    """A conversation each for Alice, Bob (passthrough callers) and acme (a keyed tenant):
    {who: conversation id} and {who: the `namespace` of its request log line}."""
    ids = {}
    with capture_logs() as lines:
        async with proxy.http() as http:
            for who, key in (("alice", ALICE), ("bob", BOB), ("acme", TENANT_KEY)):
                created = await http.post(
                    "/v1/conversations", json={}, headers={"Authorization": f"Bearer {key}"}
                )
                assert created.status_code == 200, created.text
                ids[who] = created.json()["id"]
    logged = {
        line["conversation_id"]: line
        for line in lines
        if line.get("event") == "request" and "conversation_id" in line
    }
    for who in ("alice", "bob"):
        assert logged[ids[who]]["tenant"] == "default"
    assert logged[ids["acme"]]["tenant"] == logged[ids["acme"]]["namespace"] == "acme"
    return ids, {who: logged[ids[who]]["namespace"] for who in ids}


async def test_the_cli_lists_and_filters_passthrough_callers_as_the_log_names_them(
    store_url: str,
    make_proxy: Callable[..., Awaitable[Proxy]],
    capsys: pytest.CaptureFixture[str],
) -> None:
    proxy = await make_proxy(store_url=store_url)
    ids, namespaces = await conversations(proxy)
    assert namespaces["alice"].startswith("default:") and namespaces["alice"] != namespaces["bob"]
    store = ("--store", store_url)

    code, out, _ = await cli(capsys, "threads", "list", "--tenant", "default", "--json", *store)
    assert code == 0
    listed = {t["id"]: (t["tenant"], t["namespace"]) for t in json.loads(out)}
    assert listed == {
        ids["alice"]: ("default", namespaces["alice"]),
        ids["bob"]: ("default", namespaces["bob"]),
    }
    code, out, _ = await cli(
        capsys, "threads", "list", "--namespace", namespaces["alice"], "--json", *store
    )
    assert code == 0 and [t["id"] for t in json.loads(out)] == [ids["alice"]]
    code, out, _ = await cli(capsys, "threads", "list", "--tenant", "acme", *store)
    assert code == 0 and out.splitlines()[0].split()[:3] == ["TENANT", "NAMESPACE", "ID"]
    assert ids["acme"] in out and ids["alice"] not in out

    code, _, err = await cli(capsys, "threads", "list", "--tenant", namespaces["bob"], *store)
    assert code == 2 and "is a namespace, not a tenant" in err
    # A thread of a caller is found by its tenant, as listed.
    code, out, _ = await cli(
        capsys, "threads", "show", ids["bob"], "--tenant", "default", "--json", *store
    )
    assert code == 0 and json.loads(out)["namespace"] == namespaces["bob"]

    async with httpx.AsyncClient(base_url=proxy.base_url.removesuffix("/v1")) as raw:
        metrics = (await raw.get("/metrics")).text
    assert 'tenant="default"' in metrics
    assert namespaces["alice"].partition(":")[2] not in metrics  # one label value per tenant


async def test_the_inspector_filters_by_tenant_and_by_namespace(
    make_proxy: Callable[..., Awaitable[Proxy]],
) -> None:
    proxy = await make_proxy(settings={"operator_token": OPERATOR})
    ids, namespaces = await conversations(proxy)
    operator = {"Authorization": f"Bearer {OPERATOR}"}
    async with proxy.http() as http:
        page = await http.get("/threadkeeper/ui/", params={"tenant": "default"}, headers=operator)
        assert page.status_code == 200
        assert ids["alice"] in page.text and ids["bob"] in page.text
        assert ids["acme"] not in page.text

        one = await http.get(
            "/threadkeeper/ui/", params={"namespace": namespaces["alice"]}, headers=operator
        )
        assert ids["alice"] in one.text and ids["bob"] not in one.text
        link = re.search(r'href="(/threadkeeper/ui/thread\?[^"]+)"', one.text)
        assert link is not None
        thread = await http.get(unescape(link.group(1)), headers=operator)
        assert thread.status_code == 200 and namespaces["alice"] in thread.text

        # A caller's request page names its namespace and links to its thread.
        raw = await proxy.client(api_key=ALICE).chat.completions.with_raw_response.create(
            model="gpt-4o",
            messages=[{"role": "user", "content": "hello"}],
            extra_headers={"X-Thread-Id": "t-alice"},
        )
        await written(proxy)
        request_id = raw.headers["x-threadkeeper-request-id"]
        record = await http.get(f"/threadkeeper/ui/requests/{request_id}", headers=operator)
        assert record.status_code == 200 and namespaces["alice"] in record.text
        link = re.search(r'id="thread-link" href="([^"]+)"', record.text)
        assert link is not None
        thread = await http.get(unescape(link.group(1)), headers=operator)
        assert thread.status_code == 200 and "t-alice" in thread.text

        # A tenant's key sees its own namespace whatever it asks for.
        acme = {"Authorization": f"Bearer {TENANT_KEY}"}
        own = await http.get("/threadkeeper/ui/", params={"tenant": "default"}, headers=acme)
        assert ids["acme"] in own.text and ids["alice"] not in own.text
        bad = await http.get(
            "/threadkeeper/ui/", params={"tenant": namespaces["bob"]}, headers=operator
        )
        assert bad.status_code == 400 and "not a tenant" in bad.text


async def test_compaction_show_opens_a_passthrough_callers_item_by_its_tenant(
    proxy: Proxy, capsys: pytest.CaptureFixture[str]
) -> None:
    _, namespaces = await conversations(proxy)  # Alice's namespace holds a thread
    client = proxy.client(api_key=ALICE)
    compacted = await client.responses.compact(model="gpt-4o", input=history(2))  # type: ignore[arg-type]
    item: dict[str, Any] = compacted.output[-1].model_dump(exclude_unset=True, warnings=False)
    store = f"sqlite:///{proxy.app[SETTINGS].store_url.removeprefix('sqlite:///')}"  # type: ignore[index]
    blob = item["encrypted_content"]

    code, out, err = await cli(
        capsys, "compaction", "show", blob, "--tenant", "default", "--json", "--store", store
    )
    assert code == 0, err
    shown = json.loads(out)
    assert (shown["tenant"], shown["namespace"], shown["id"]) == (
        "default",
        namespaces["alice"],
        item["id"],
    )
    code, out, _ = await cli(
        capsys, "compaction", "show", blob, "--namespace", namespaces["alice"], "--store", store
    )
    assert code == 0 and f"passthrough caller {namespaces['alice']}" in out
    code, _, err = await cli(
        capsys, "compaction", "show", blob, "--namespace", namespaces["bob"], "--store", store
    )
    assert code == 2 and "could not be verified" in err
    code, _, err = await cli(
        capsys, "compaction", "show", blob, "--tenant", "acme", "--store", store
    )
    assert code == 2 and "tenant 'acme'" in err


async def test_ledger_list_takes_the_same_filters(
    proxy: Proxy, provider: FakeProvider, capsys: pytest.CaptureFixture[str]
) -> None:
    default = proxy.policies_dir / "default.yaml"
    default.write_text(default.read_text() + tools_policy())
    assert not proxy.app[POLICIES].reload()  # type: ignore[index]
    body = {
        "model": "gpt-4o-mini",
        "messages": [{"role": "user", "content": "Refund ORD-1"}],
        "tools": CHAT_TOOLS,
    }
    async with proxy.http() as http:
        for key in (ALICE, BOB):
            provider.script.append(Reply(tool_calls=[REFUND]))
            got = await http.post(
                "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}
            )
            assert got.json()["choices"][0]["message"]["tool_calls"]  # an entry issued each
    store = ("--store", f"sqlite:///{proxy.app[SETTINGS].store_url.removeprefix('sqlite:///')}")  # type: ignore[index]
    code, out, _ = await cli(capsys, "ledger", "list", "--tenant", "default", "--json", *store)
    assert code == 0
    entries = json.loads(out)
    assert [e["tenant"] for e in entries] == ["default", "default"]
    namespaces = {e["namespace"] for e in entries}
    assert len(namespaces) == 2 and all(n.startswith("default:") for n in namespaces)
    one = sorted(namespaces)[0]
    code, out, _ = await cli(capsys, "ledger", "list", "--namespace", one, "--json", *store)
    assert code == 0 and [e["namespace"] for e in json.loads(out)] == [one]
    # the namespace a listing names is the one `ledger show` takes
    code, out, _ = await cli(
        capsys, "ledger", "show", "tenant", "refund:ORD-1", "--tenant", one, *store
    )
    assert code == 0 and f"namespace: {one}" in out
