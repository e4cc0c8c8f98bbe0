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
from proxy.store import open_store

from .conftest import TENANT_KEY, Proxy
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
        capsys, "threads", "import", str(export), "--id", "t-copy", "--json",
        "--policies", str(proxy.policies_dir), *store,
    )  # fmt: skip
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
    assert err.startswith("threadkeeper: there is no store at /nowhere/x.db (sqlite:////nowhere")
    (tmp_path / "t.jsonl").write_text('{"object": "threadkeeper.thread"}\n')
    code, out, err = await cli(
        capsys, "threads", "import", str(tmp_path / "t.jsonl"), "--store", "sqlite:////nowhere/x.db"
    )
    assert (
        code == 2
        and out == ""
        and err.strip()
        == (
            "threadkeeper: cannot open the store 'sqlite:////nowhere/x.db': "
            "the directory of '/nowhere/x.db' does not exist"
        )
    )

    store = ("--store", f"sqlite:///{tmp_path / 'empty.db'}")
    empty = await open_store(store[1])
    await empty.migrate()
    await empty.close()
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


async def test_threads_explain_shows_the_providers_error(
    store_url: str,
    make_proxy: Callable[..., Awaitable[Proxy]],
    provider: FakeProvider,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Issue 20, item 14: the request an operator most needs to explain, a provider's
    refusal, has a record, and the CLI shows the provider's error."""
    proxy = await make_proxy(store_url=store_url)
    provider.script.append(Reply(status=400, text="Invalid 'temperature': 9 is above 2."))
    async with proxy.http() as http:
        refused = await http.post(
            "/v1/responses",
            json={"model": "gpt-4o", "input": "Hi", "temperature": 9},
            headers={"Authorization": f"Bearer {TENANT_KEY}"},
        )
    assert refused.status_code == 400
    await written(proxy)
    request_id = refused.headers["x-threadkeeper-request-id"]
    code, out, _ = await cli(capsys, "threads", "explain", request_id, "--store", store_url)
    assert code == 0 and "status 400" in out.splitlines()[0]
    assert "provider answered 400 (invalid_request_error): Invalid 'temperature'" in out


HEADER = {"object": "threadkeeper.thread", "tenant": "acme", "id": "t-in", "kind": "chat"}


def export_file(path: Path, *entries: str, header: dict[str, Any] = HEADER) -> Path:
    path.write_text("\n".join([json.dumps(header), *entries]) + "\n")
    return path


def chat_line(raw: dict[str, Any] | str, item_id: str | None = None) -> str:
    entry = {"api": "chat", "raw": raw} | ({"id": item_id} if item_id else {})
    return json.dumps(entry)


async def test_import_refuses_what_the_api_refuses_with_one_line_and_writes_nothing(
    store_url: str,
    make_proxy: Callable[..., Awaitable[Proxy]],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Issue 20 item 6: each of these imported before, and then crashed the inspector,
    `threads show`/`export`, or every turn on the thread (a 500)."""
    proxy = await make_proxy(store_url=store_url)
    store = ("--store", store_url, "--policies", str(proxy.policies_dir))
    user = {"role": "user", "content": "hi"}
    deep = '{"api": "chat", "raw": {"role": "user", "content": ' + "[" * 50_000 + "]" * 50_000
    cases = {
        "surrogate": (
            [json.dumps({"api": "chat", "raw": {"role": "user", "content": "\ud800"}})],
            "line 2: Invalid 'raw.content': a string contains a lone UTF-16 surrogate",
        ),
        "responses item in a chat thread": (
            [json.dumps({"api": "responses", "raw": {"type": "message", **user}})],
            "line 2: a chat thread holds chat items, not responses items",
        ),
        "content object": (
            [chat_line({"role": "user", "content": {"text": "hi"}})],
            "line 2: Invalid type for 'raw.content': expected a string or an array",
        ),
        "tool_calls string": (
            [chat_line({"role": "assistant", "content": None, "tool_calls": "get_order"})],
            "line 2: Invalid type for 'raw.tool_calls': expected an array, but got a string",
        ),
        "50k deep": ([deep + "}}"], "line 2: not JSON (nested more than 128 levels deep)"),
        "repeated id": (
            [chat_line(user, "msg_1"), chat_line({"role": "user", "content": "b"}, "msg_1")],
            "line 3: Duplicate item found with id msg_1. Remove duplicate items",
        ),
        "output before its call": (
            [chat_line({"role": "tool", "tool_call_id": "call_9", "content": "done"})],
            "line 2: no tool call before this output has the call id 'call_9'",
        ),
    }
    for name, (entries, problem) in cases.items():
        path = export_file(tmp_path / "bad.jsonl", *entries)
        code, out, err = await cli(capsys, "threads", "import", str(path), *store)
        assert (code, out) == (2, ""), name
        assert err.startswith(f"threadkeeper: {problem}") and err.count("\n") == 1, (name, err)

    passthrough = dict(HEADER, tenant="default:0123abcd")  # a passthrough caller's namespace
    path = export_file(tmp_path / "caller.jsonl", chat_line(user), header=passthrough)
    code, _, err = await cli(capsys, "threads", "import", str(path), *store)
    assert code == 2 and err.strip() == (
        "threadkeeper: 'default:0123abcd' is not a configured tenant (the policies define: "
        "acme, default); pass --namespace default:0123abcd to import into that namespace anyway"
    )
    code, _, err = await cli(capsys, "threads", "import", str(path), "--tenant", "acmee", *store)
    assert code == 2 and "'acmee' is not a configured tenant" in err
    code, out, _ = await cli(capsys, "threads", "list", "--json", "--store", store_url)
    assert json.loads(out) == [], "a refused import leaves nothing behind"

    code, out, _ = await cli(
        capsys, "threads", "import", str(path), "--namespace", "default:0123abcd", "--json", *store
    )
    assert code == 0 and json.loads(out)["namespace"] == "default:0123abcd"

    # What passes the checks takes a turn through the socket.
    path = export_file(tmp_path / "good.jsonl", chat_line(user, "msg_1"))
    code, _, err = await cli(capsys, "threads", "import", str(path), *store)
    assert code == 0, err
    proxy.provider.script.append(Reply(text="Hello again."))
    reply = await proxy.client().chat.completions.create(
        model="gpt-4o",
        messages=[{"role": "user", "content": "still there?"}],
        extra_headers={"X-Thread-Id": "t-in"},
    )
    assert reply.choices[0].message.content == "Hello again."
    sent = proxy.provider.requests[-1].json or {}
    assert [m["content"] for m in sent["messages"]] == ["hi", "still there?"]


async def test_export_openai_imports_back_as_a_conversation_that_takes_a_turn(
    store_url: str,
    make_proxy: Callable[..., Awaitable[Proxy]],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Issue 20 item 6: `threads import` could not read `threads export --format openai`."""
    proxy = await make_proxy(store_url=store_url)
    store = ("--store", store_url)
    client = proxy.client()
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Where is ORD-7?"}]
    proxy.provider.script.append(Reply(tool_calls=[("get_order", '{"order_id": "ORD-7"}')]))
    first = await client.chat.completions.create(
        model="gpt-4o", messages=messages, extra_headers={"X-Thread-Id": "t-orders"}
    )
    call = first.choices[0].message
    assert call.tool_calls
    messages += [
        call.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.tool_calls[0].id, "content": "shipped"},
    ]
    proxy.provider.script.append(Reply(text="ORD-7 has shipped."))
    await client.chat.completions.create(
        model="gpt-4o", messages=messages, extra_headers={"X-Thread-Id": "t-orders"}
    )

    code, replay_text, _ = await cli(
        capsys, "threads", "export", "t-orders", "--format", "openai", *store
    )
    replay = json.loads(replay_text)
    assert [i.get("type") for i in replay] == [
        "message", "function_call", "function_call_output", "message",
    ]  # fmt: skip
    path = tmp_path / "replay.json"
    path.write_text(replay_text)
    code, out, err = await cli(
        capsys, "threads", "import", str(path), "--tenant", "acme", "--id", "conv_copy",
        "--policies", str(proxy.policies_dir), "--json", *store,
    )  # fmt: skip
    assert code == 0, err
    imported = json.loads(out)
    assert (imported["kind"], imported["items"]) == ("conversation", 4)
    code, again, _ = await cli(
        capsys, "threads", "export", "conv_copy", "--format", "openai", *store
    )
    assert json.loads(again) == replay

    proxy.provider.script.append(Reply(text="It arrives Friday."))
    answer = await client.responses.create(
        model="gpt-4o", input="When does it arrive?", conversation="conv_copy"
    )
    assert answer.output_text == "It arrives Friday."
    sent = proxy.provider.requests[-1].json or {}
    assert sent["input"][:4] == replay


async def test_threads_find_names_the_thread_of_a_response_and_fork_takes_a_seq(
    store_url: str,
    make_proxy: Callable[..., Awaitable[Proxy]],
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Issue 20 item 13: no way to find the thread behind a resp_... id; `threads show`
    prints seqs but `fork --at` took only item ids."""
    proxy = await make_proxy(store_url=store_url)
    store = ("--store", store_url)
    client = proxy.client()
    proxy.provider.script += [Reply(text="First."), Reply(text="Second.")]
    first = await client.responses.create(model="gpt-4o", input="one")
    raw = await client.responses.with_raw_response.create(
        model="gpt-4o", input="two", previous_response_id=first.id
    )
    second = raw.parse()

    code, out, err = await cli(capsys, "threads", "find", second.id, "--json", *store)
    assert code == 0, err
    found = json.loads(out)
    assert (found["kind"], found["tenant"]) == ("response", "acme")
    thread = found["thread"]
    assert thread["kind"] == "responses" and thread["items"] == 4
    code, out, _ = await cli(capsys, "threads", "find", first.id, *store)
    assert out.splitlines() == [
        f"response {first.id}  tenant acme  thread {thread['id']} (responses, 4 items)",
        f"threadkeeper threads show {thread['id']} --tenant acme",
    ]
    request_id = raw.headers["x-threadkeeper-request-id"]
    await written(proxy)
    code, out, _ = await cli(capsys, "threads", "find", request_id, "--json", *store)
    assert (code, json.loads(out)["thread_id"]) == (0, thread["id"])
    code, _, err = await cli(capsys, "threads", "find", "resp_nope", *store)
    assert (code, err.strip()) == (
        2,
        "threadkeeper: no response or request 'resp_nope' in any tenant",
    )

    code, out, _ = await cli(capsys, "threads", "show", thread["id"], "--json", *store)
    log = json.loads(out)["log"]
    by_seq = json.loads((await cli(capsys, "threads", "fork", thread["id"], "--at", "1",
                                   "--json", *store))[1])  # fmt: skip
    by_id = json.loads((await cli(capsys, "threads", "fork", thread["id"], "--at", log[1]["id"],
                                  "--json", *store))[1])  # fmt: skip
    assert by_seq["items"] == by_id["items"] == 2
    code, _, err = await cli(capsys, "threads", "fork", thread["id"], "--at", "4", *store)
    assert code == 2 and "--at takes an item id or a seq from 0 to 3" in err
