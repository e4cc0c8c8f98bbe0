"""`threadkeeper threads ...` and `threadkeeper ledger ...` on a store a running proxy
wrote: what an operator sees is what the proxy keeps, on SQLite and PostgreSQL."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from proxy.cli import main
from proxy.fake_provider import FakeProvider, Reply

from .conftest import Proxy
from .test_explain_e2e import written
from .test_ledger_e2e import REFUND, ChatAgent, Shop, tools_policy

WINDOW = 6000  # small: a few long turns force a cut and a summary


async def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """Runs the command line in a thread (it runs its own event loop, like a shell would);
    what the proxy logged before is not the command's output."""
    capsys.readouterr()
    code = await asyncio.to_thread(main, list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


async def long_thread(proxy: Proxy, thread_id: str, turns: int = 8) -> str:
    """Drives a thread past its window; the last request's id."""
    client = proxy.client()
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You track orders."}]
    for turn in range(turns):
        proxy.provider.script.append(Reply(text=f"Noted order ORD-{turn}. " + "detail " * 400))
        messages.append({"role": "user", "content": f"Order ORD-{turn}: " + "words " * 400})
        raw = await client.chat.completions.with_raw_response.create(
            model="gpt-4o", messages=messages, extra_headers={"X-Thread-Id": thread_id}
        )
        reply = raw.parse()
        messages.append({"role": "assistant", "content": reply.choices[0].message.content})
    await written(proxy)
    return raw.headers["x-threadkeeper-request-id"]


async def test_threads_list_show_export_import_fork_delete(
    store_url: str,  # before make_proxy: a PostgreSQL schema outlives the proxy
    make_proxy: Callable[..., Awaitable[Proxy]],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    proxy = await make_proxy(window=WINDOW, store_url=store_url)
    request_id = await long_thread(proxy, "t-orders")
    store = ("--store", store_url)

    code, out, _ = await cli(capsys, "threads", "explain", request_id, *store)
    assert code == 0 and out.startswith(f"request {request_id}  tenant acme  thread t-orders")
    assert "summarized" in out and "[summary sent at position 1]" in out
    code, out, _ = await cli(capsys, "threads", "explain", request_id, "--json", *store)
    assert json.loads(out)["id"] == request_id
    code, _, err = await cli(capsys, "threads", "explain", "req_nope", *store)
    assert code == 2 and "no explain record 'req_nope'" in err

    code, out, _ = await cli(capsys, "threads", "list", "--json", *store)
    assert code == 0
    listed = {t["id"]: t for t in json.loads(out)}
    thread = listed["t-orders"]
    assert (thread["tenant"], thread["kind"], thread["items"]) == ("acme", "chat", 17)
    assert thread["window_start"] > 1, "the thread was cut"

    code, out, _ = await cli(capsys, "threads", "list", *store)
    assert code == 0 and out.splitlines()[0].split() == [
        "TENANT", "NAMESPACE", "ID", "KIND", "ITEMS", "WINDOW", "FROM", "CREATED",
    ]  # fmt: skip

    code, out, _ = await cli(capsys, "threads", "show", "t-orders", "--json", *store)
    shown = json.loads(out)
    start = shown["window_start"]
    assert [e["seq"] for e in shown["log"]] == list(range(17))
    assert [e["cut"] for e in shown["log"]] == [seq < start for seq in range(17)]
    assert all(e["tokens"] > 0 for e in shown["log"])
    assert shown["summary"] and "ORD-0" in shown["summary"][-1]["text"]
    code, text, _ = await cli(capsys, "threads", "show", "t-orders", *store)
    assert f"---- cut: the model sees items from seq {start} on ----" in text
    assert "Stands for the cut part" in text

    export = tmp_path / "orders.jsonl"
    code, out, _ = await cli(capsys, "threads", "export", "t-orders", *store)
    export.write_text(out)
    lines = [json.loads(line) for line in out.splitlines()]
    assert lines[0]["object"] == "threadkeeper.thread" and len(lines) == 18
    code, out, _ = await cli(
        capsys, "threads", "import", str(export), "--id", "t-copy", "--json", *store
    )
    assert code == 0 and json.loads(out)["items"] == 17
    code, out, _ = await cli(capsys, "threads", "export", "t-copy", *store)
    assert [line["raw"] for line in map(json.loads, out.splitlines()[1:])] == [
        line["raw"] for line in lines[1:]
    ]

    code, out, _ = await cli(capsys, "threads", "export", "t-orders", "--format", "openai", *store)
    replay = json.loads(out)
    assert replay[0] == {"type": "message", "role": "system", "content": "You track orders."}
    assert [i["role"] for i in replay[1:3]] == ["user", "assistant"]

    third = shown["log"][2]["id"]
    code, out, _ = await cli(capsys, "threads", "fork", "t-orders", "--at", third, "--json", *store)
    fork = json.loads(out)
    assert fork["items"] == 3 and fork["id"].startswith("thread_")

    code, out, _ = await cli(capsys, "threads", "delete", "t-copy", *store)
    assert (code, out.strip()) == (0, "deleted thread t-copy")
    code, _, err = await cli(capsys, "threads", "show", "t-copy", *store)
    assert (code, err.strip()) == (2, "threadkeeper: no thread 't-copy' in any tenant")


async def test_ledger_list_show_resolve(
    store_url: str,
    make_proxy: Callable[..., Awaitable[Proxy]],
    provider: FakeProvider,
    capsys: pytest.CaptureFixture[str],
) -> None:
    proxy = await make_proxy(acme_extra=tools_policy(), store_url=store_url)
    provider.script.append(Reply(tool_calls=[REFUND]))
    await ChatAgent(proxy, Shop(), stream=False).ask("Refund ORD-1", execute=False)
    store = ("--store", store_url)

    code, out, _ = await cli(capsys, "ledger", "list", "--status", "issued", "--json", *store)
    entries = json.loads(out)
    assert [(e["tenant"], e["key"], e["status"]) for e in entries] == [
        ("acme", "refund:ORD-1", "issued")
    ]
    code, out, _ = await cli(capsys, "ledger", "list", *store)
    assert "refund:ORD-1" in out and out.splitlines()[0].startswith("TENANT")

    code, out, _ = await cli(
        capsys, "ledger", "resolve", "tenant", "refund:ORD-1", "--tenant", "acme",
        "--status", "completed", "--result", '{"refunded": "ORD-1"}', "--json", *store,
    )  # fmt: skip
    assert code == 0 and json.loads(out)["status"] == "completed"
    code, _, err = await cli(
        capsys, "ledger", "resolve", "tenant", "refund:ORD-1", "--tenant", "acme",
        "--status", "failed", *store,
    )  # fmt: skip
    assert code == 2 and "is 'completed'; only 'issued' resolves" in err
    code, out, _ = await cli(
        capsys, "ledger", "show", "tenant", "refund:ORD-1", "--tenant", "acme", *store
    )
    assert 'result: {"refunded": "ORD-1"}' in out
    code, _, err = await cli(
        capsys, "ledger", "show", "tenant", "refund:ORD-9", "--tenant", "acme", *store
    )
    assert code == 2 and err.count("\n") == 1


async def test_bad_store_url_missing_thread_and_bad_import_exit_2_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = await cli(capsys, "threads", "list", "--store", "mysql://x/y")
    assert code == 2 and out == "" and err.count("\n") == 1
    assert err.startswith("threadkeeper: --store: expected sqlite:///path or postgresql://")

    code, out, err = await cli(capsys, "threads", "list", "--store", "sqlite:////nowhere/x.db")
    assert code == 2 and out == "" and err.count("\n") == 1
    assert err.strip() == (
        "threadkeeper: cannot open the store 'sqlite:////nowhere/x.db': "
        "the directory of '/nowhere/x.db' does not exist"
    )

    store = ("--store", f"sqlite:///{tmp_path / 'empty.db'}")
    code, _, err = await cli(capsys, "threads", "show", "nope", *store)
    assert (code, err.strip()) == (2, "threadkeeper: no thread 'nope' in any tenant")
    code, _, err = await cli(capsys, "threads", "list", "--limit", "0", *store)
    assert (code, err.strip()) == (2, "threadkeeper: --limit must be at least 1")

    bad = tmp_path / "bad.jsonl"
    for content, problem in (
        ("not json\n", "line 1: not JSON"),
        ('{"object": "list"}\n', "line 1: expected the header"),
        (
            '{"object": "threadkeeper.thread", "tenant": "acme", "id": "t", "kind": "chat"}\n'
            '{"api": "chat", "raw": []}\n',
            "line 2: expected 'api' chat|responses and an object 'raw'",
        ),
    ):
        bad.write_text(content)
        code, _, err = await cli(capsys, "threads", "import", str(bad), *store)
        assert code == 2 and problem in err, err
    code, out, _ = await cli(capsys, "threads", "list", "--json", *store)
    assert json.loads(out) == [], "a refused import leaves nothing behind"
