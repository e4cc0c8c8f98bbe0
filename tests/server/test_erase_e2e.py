"""What deleting a conversation keeps, what an operator's erase removes, and a turn that
loses its conversation while the provider answers (issue 20, items 3 and 4)."""

from __future__ import annotations

import asyncio
import json
from datetime import timedelta
from typing import Any

import httpx
import openai
import pytest

from proxy.cli import main
from proxy.clock import ManualClock
from proxy.fake_provider import Reply
from proxy.server.state import STORE
from proxy.store.sqlstore import SqlStore
from tests.store.dump import tables_holding

from .conftest import TENANT_KEY, Proxy
from .test_ledger_e2e import RESPONSES_TOOLS, tools_policy
from .test_llm_summaries_e2e import (
    MEMORY,
    SUMMARIZER,
    background,
    summarizer_answer,
    summarizer_requests,
    user_turn,
)

AUTH = {"Authorization": f"Bearer {TENANT_KEY}"}


def user(text: str) -> dict[str, Any]:
    return {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}


async def responses_rows(proxy: Proxy) -> list[tuple[str, str | None, str]]:
    """(id, thread_id, status) of every stored response, read straight from the store."""
    store = proxy.app[STORE]  # type: ignore[index]
    assert isinstance(store, SqlStore)
    async with store.db.read() as conn:
        rows = await conn.fetch("SELECT id, thread_id, status FROM responses ORDER BY id")
    return [(row["id"], row["thread_id"], row["status"]) for row in rows]


async def provider_called(proxy: Proxy, count: int) -> None:
    """Waits (bounded) until the provider holds `count` model requests."""
    for _ in range(3000):
        if len(proxy.provider.model_requests) >= count:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"the provider never got {count} model requests")


# -- item 4: a conversation deleted while its turn runs --------------------------------------


async def test_deleting_the_conversation_during_a_turn_is_a_404_not_a_500(
    store_url: str, make_proxy: Any
) -> None:
    proxy = await make_proxy(store_url=store_url)
    client = proxy.client()
    conversation = await client.conversations.create(items=[user("hello")])
    release = asyncio.Event()
    proxy.provider.script.append(Reply(text="an answer nobody keeps", release=release))
    async with httpx.AsyncClient(base_url=proxy.base_url, timeout=30) as http:
        turn = asyncio.create_task(
            http.post(
                "/responses",
                headers=AUTH,
                json={"model": "gpt-4o-mini", "conversation": conversation.id, "input": "hi"},
            )
        )
        await provider_called(proxy, 1)
        assert [status for *_, status in await responses_rows(proxy)] == ["in_progress"]
        deleted = await client.conversations.delete(conversation.id)
        assert deleted.deleted
        release.set()
        answer = await turn
    assert answer.status_code == 404, answer.text
    assert answer.json() == {
        "error": {
            "message": f"Conversation with id '{conversation.id}' not found.",
            "type": "invalid_request_error",
            "param": "conversation",
            "code": None,
        }
    }
    assert await responses_rows(proxy) == []  # no orphan `incomplete` row


async def test_a_streamed_turn_that_loses_its_conversation_leaves_no_response_row(
    store_url: str, make_proxy: Any
) -> None:
    proxy = await make_proxy(store_url=store_url)
    client = proxy.client()
    conversation = await client.conversations.create(items=[user("hello")])
    release = asyncio.Event()
    proxy.provider.script.append(Reply(text="an answer nobody keeps", release=release))
    body = {
        "model": "gpt-4o-mini",
        "conversation": conversation.id,
        "input": "hi",
        "stream": True,
    }
    async with httpx.AsyncClient(base_url=proxy.base_url, timeout=30) as http:
        turn = asyncio.create_task(http.post("/responses", headers=AUTH, json=body))
        await provider_called(proxy, 1)
        await client.conversations.delete(conversation.id)
        release.set()
        answer = await turn
    assert answer.status_code == 200
    assert '"code":"store_error"' in answer.text.replace(" ", "")
    assert "response.completed" not in answer.text
    assert await responses_rows(proxy) == []


async def test_an_idempotent_retry_after_the_lost_conversation_gets_the_same_404(
    proxy: Proxy,
) -> None:
    """The 404 is an answer about the request (stored like any 4xx): the retry does not
    run the turn again on a conversation that is gone."""
    client = proxy.client()
    conversation = await client.conversations.create(items=[user("hello")])
    release = asyncio.Event()
    proxy.provider.script.append(Reply(text="lost", release=release))
    headers = {**AUTH, "Idempotency-Key": "turn-1"}
    body = {"model": "gpt-4o-mini", "conversation": conversation.id, "input": "hi"}
    async with httpx.AsyncClient(base_url=proxy.base_url, timeout=30) as http:
        turn = asyncio.create_task(http.post("/responses", headers=headers, json=body))
        await provider_called(proxy, 1)
        await client.conversations.delete(conversation.id)
        release.set()
        first = await turn
        again = await http.post("/responses", headers=headers, json=body)
    assert (first.status_code, again.status_code) == (404, 404)
    assert again.json() == first.json()
    assert len(proxy.provider.model_requests) == 1


@pytest.mark.parametrize("streamed", [False, True])
async def test_a_turn_whose_response_row_was_deleted_meanwhile_keeps_nothing(
    proxy: Proxy, streamed: bool
) -> None:
    """DELETE /v1/responses/{id} while it runs: the conversation still exists, so the
    error names the response, and the conversation gains no items."""
    client = proxy.client()
    conversation = await client.conversations.create(items=[user("hello")])
    release = asyncio.Event()
    proxy.provider.script.append(Reply(text="lost", release=release))
    body = {"model": "gpt-4o-mini", "conversation": conversation.id, "input": "hi"}
    if streamed:
        body["stream"] = True
    async with httpx.AsyncClient(base_url=proxy.base_url, timeout=30) as http:
        turn = asyncio.create_task(http.post("/responses", headers=AUTH, json=body))
        await provider_called(proxy, 1)
        [(response_id, _, _)] = await responses_rows(proxy)
        await client.responses.delete(response_id)
        release.set()
        answer = await turn
    if streamed:
        assert '"code":"store_error"' in answer.text.replace(" ", "")
    else:
        assert answer.status_code == 404, answer.text
        assert answer.json()["error"]["message"] == f"Response with id '{response_id}' not found."
    items = await client.conversations.items.list(conversation.id)
    assert len(items.data) == 1
    assert await responses_rows(proxy) == []
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(response_id)


# -- item 3: what DELETE keeps, and the operator's erase -----------------------------------

MARK = "MARKa91f0c"  # the erased conversation's words, in everything it makes
KEEP = "KEEPb27d44"  # another conversation's, which stays
CONTEXT = [{"type": "compaction", "compact_threshold": 1500}]


def summarizer_with(word: str) -> Reply:
    return summarizer_answer(decisions=[f"Refunds go to card {word}, as agreed."])


async def grow_conversation(proxy: Proxy, word: str) -> dict[str, Any]:
    """A conversation whose `word` reaches every table that derives from it: user input,
    a side-effecting call and its output (ledger), turns under an Idempotency-Key,
    explain records, LLM summaries, a compaction. What it made, by kind."""
    client = proxy.client()
    conversation = await client.conversations.create(items=[user(f"I am {word}")])
    made: dict[str, Any] = {"conversation": conversation.id, "responses": [], "keys": []}

    async def turn(body: dict[str, Any], key: str | None = None) -> dict[str, Any]:
        headers = {**AUTH, **({"Idempotency-Key": key} if key else {})}
        async with httpx.AsyncClient(base_url=proxy.base_url, timeout=30) as http:
            answer = await http.post(
                "/responses",
                headers=headers,
                json={"model": "gpt-4o", "conversation": conversation.id, **body},
            )
        assert answer.status_code == 200, answer.text
        made["responses"].append(answer.json()["id"])
        if key:
            made["keys"].append((key, body))
        return answer.json()  # type: ignore[no-any-return]

    proxy.provider.script.append(
        Reply(tool_calls=[("refund_order", json.dumps({"order_id": f"ORD-{word}"}))])
    )
    called = await turn(
        {"input": f"Refund my order ORD-{word}", "tools": RESPONSES_TOOLS}, key=f"k1-{word}"
    )
    [call] = [o for o in called["output"] if o["type"] == "function_call"]
    output = {"type": "function_call_output", "call_id": call["call_id"], "output": f"ok {word}"}
    await turn({"input": [output], "tools": RESPONSES_TOOLS}, key=f"k2-{word}")
    summaries_before = len(summarizer_requests(proxy))
    for number in range(30):
        await turn({"input": user_turn(number, f" {word}")})
        await background(proxy).idle()
        if len(summarizer_requests(proxy)) > summaries_before:
            break
    compacted = await turn({"input": f"Sum it up, {word}", "context_management": CONTEXT})
    made["compactions"] = [
        o["encrypted_content"] for o in compacted["output"] if o["type"] == "compaction"
    ]
    await background(proxy).idle()
    return made


async def operator_erase(proxy: Proxy, thread_id: str) -> httpx.Response:
    async with proxy.http() as http:
        return await http.post(f"/threadkeeper/v1/threads/{thread_id}/erase", headers=AUTH)


async def test_erase_leaves_no_trace_of_a_deleted_conversation_and_keeps_the_others(
    store_url: str, make_proxy: Any
) -> None:
    proxy = await make_proxy(
        store_url=store_url, window=5000, memory_extra=MEMORY, acme_extra=tools_policy()
    )
    proxy.provider.scripts[SUMMARIZER] = [summarizer_with(MARK) for _ in range(10)]
    erased = await grow_conversation(proxy, MARK)
    assert erased["compactions"], "the turn was not compacted"
    proxy.provider.scripts[SUMMARIZER] = [summarizer_with(KEEP) for _ in range(10)]
    kept = await grow_conversation(proxy, KEEP)
    store = proxy.app[STORE]  # type: ignore[index]
    made_by_it = {"items", "responses", "ledger", "idempotency", "explain_records", "summaries"}
    assert made_by_it <= set(await tables_holding(store, MARK))

    # DELETE keeps what OpenAI keeps: the stored responses, and the replays.
    client = proxy.client()
    await client.conversations.delete(erased["conversation"])
    assert (await client.responses.retrieve(erased["responses"][0])).id == erased["responses"][0]
    key, body = erased["keys"][0]
    async with httpx.AsyncClient(base_url=proxy.base_url, timeout=30) as http:
        replay = await http.post(
            "/responses",
            headers={**AUTH, "Idempotency-Key": key},
            json={"model": "gpt-4o", "conversation": erased["conversation"], **body},
        )
    assert replay.headers["Idempotent-Replayed"] == "true"
    assert {"responses", "ledger", "idempotency"} <= set(await tables_holding(store, MARK))

    answer = await operator_erase(proxy, erased["conversation"])
    assert answer.status_code == 200, answer.text
    counts = answer.json()
    assert counts["object"] == "threadkeeper.thread.erased"
    assert counts["responses"] == len(erased["responses"])
    assert counts["idempotency"] == len(erased["keys"]) and counts["ledger"] == 1

    needles = [MARK, erased["conversation"], *erased["responses"], *erased["compactions"]]
    left = {needle: await tables_holding(store, needle) for needle in needles}
    assert {needle: found for needle, found in left.items() if found} == {}
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(erased["responses"][0])
    assert made_by_it <= set(await tables_holding(store, KEEP))
    for response_id in kept["responses"]:
        assert (await client.responses.retrieve(response_id)).id == response_id
    # Nothing is left to erase, and another tenant cannot erase this one's threads.
    assert (await operator_erase(proxy, erased["conversation"])).status_code == 404
    async with proxy.http() as http:
        stranger = await http.post(
            f"/threadkeeper/v1/threads/{kept['conversation']}/erase",
            headers={"Authorization": "Bearer sk-someone-else"},
        )
    assert stranger.status_code == 404
    assert await tables_holding(store, kept["conversation"])


async def test_threads_delete_erase_from_the_cli(
    store_url: str, make_proxy: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    proxy = await make_proxy(store_url=store_url)
    client = proxy.client()
    for thread_id, word in (("t-erased", MARK), ("t-kept", KEEP)):
        await client.chat.completions.create(
            model="gpt-4o-mini",
            messages=[{"role": "user", "content": f"my card is {word}"}],
            extra_headers={"X-Thread-Id": thread_id, "Idempotency-Key": f"key-{word}"},
        )
    conversation = await client.conversations.create(items=[user(f"conv {MARK}")])
    await client.responses.create(model="gpt-4o-mini", conversation=conversation.id, input="hi")
    await client.conversations.delete(conversation.id)
    store = proxy.app[STORE]  # type: ignore[index]
    assert {"items", "idempotency"} <= set(await tables_holding(store, MARK))
    capsys.readouterr()

    args = ["--store", store_url]
    assert await asyncio.to_thread(main, ["threads", "delete", "t-erased", "--erase", *args]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("erased thread t-erased of tenant acme: 1 threads, 2 items")
    assert "1 idempotency" in printed
    # A deleted conversation is no thread any more: its leftovers need the tenant named.
    gone = ["threads", "delete", conversation.id, "--erase", *args]
    assert await asyncio.to_thread(main, gone) == 2
    assert capsys.readouterr().err.strip() == (
        f"threadkeeper: no thread '{conversation.id}' in any tenant (to erase what a deleted "
        "one left, pass --tenant)"
    )
    erase = [*gone, "--tenant", "acme", "--json"]
    assert await asyncio.to_thread(main, erase) == 0
    erased = json.loads(capsys.readouterr().out)
    assert (erased["threads"], erased["responses"]) == (0, 1)
    assert await tables_holding(store, MARK) == {}
    assert {"items", "idempotency"} <= set(await tables_holding(store, KEEP))
    assert await asyncio.to_thread(main, erase) == 2  # nothing left
    assert "nothing of thread" in capsys.readouterr().err


# -- item 3: the responses retention ------------------------------------------------------


async def test_stored_responses_are_purged_after_the_retention(
    store_url: str, make_proxy: Any
) -> None:
    """As OpenAI's: a response is kept response_retention_seconds from its creation, even
    after its conversation is deleted; then the purge (every 10 minutes) deletes it, and a
    response chain left with none goes with it. A conversation keeps its items."""
    clock = ManualClock()
    settings = {"response_retention_seconds": 3600.0}
    proxy = await make_proxy(store_url=store_url, clock=clock, settings=settings)
    client = proxy.client()
    chained = await client.responses.create(model="gpt-4o-mini", input=f"chain {MARK}")
    conversation = await client.conversations.create()
    in_conversation = await client.responses.create(
        model="gpt-4o-mini", input=f"conv {MARK}", conversation=conversation.id
    )
    deleted = await client.conversations.create()
    of_deleted = await client.responses.create(
        model="gpt-4o-mini", input=f"gone {MARK}", conversation=deleted.id
    )
    await client.conversations.delete(deleted.id)
    await clock.advance_settled(timedelta(minutes=50))  # a purge step: all too young
    for response in (chained, in_conversation, of_deleted):
        assert (await client.responses.retrieve(response.id)).id == response.id
    later = await client.responses.create(
        model="gpt-4o-mini", input="later", previous_response_id=chained.id
    )

    clock.advance(timedelta(minutes=20))  # 70 minutes: the first three are past it
    for _ in range(500):
        if len(await responses_rows(proxy)) == 1:
            break
        await asyncio.sleep(0.02)
    assert [row[0] for row in await responses_rows(proxy)] == [later.id]
    for response in (chained, in_conversation, of_deleted):
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(response.id)
    items = await client.conversations.items.list(conversation.id)
    assert len(items.data) == 2  # the conversation's own log stays
    store = proxy.app[STORE]  # type: ignore[index]
    assert set(await tables_holding(store, f"conv {MARK}")) == {"items"}
    assert set(await tables_holding(store, f"chain {MARK}")) == {"items"}  # `later`'s chain

    clock.advance(timedelta(minutes=70))  # `later` goes too, and its chain with it
    for _ in range(500):
        if not await responses_rows(proxy):
            break
        await asyncio.sleep(0.02)
    assert await responses_rows(proxy) == []
    with pytest.raises(openai.BadRequestError, match="Previous response"):
        await client.responses.create(
            model="gpt-4o-mini", input="again", previous_response_id=later.id
        )
    assert await tables_holding(store, f"chain {MARK}") == {}


@pytest.mark.parametrize("streamed", [False, True])
async def test_a_chat_thread_erased_during_its_turn_is_not_written_again(
    proxy: Proxy, streamed: bool
) -> None:
    """The erase wins: the turn keeps nothing (the thread is not created again with it),
    and the client hears why (a 409; a stream ends with its store_error event)."""
    client = proxy.client()
    headers = {**AUTH, "X-Thread-Id": "t-chat"}
    await client.chat.completions.create(
        model="gpt-4o-mini",
        messages=[{"role": "user", "content": f"first {MARK}"}],
        extra_headers={"X-Thread-Id": "t-chat"},
    )
    release = asyncio.Event()
    proxy.provider.script.append(Reply(text="lost", release=release))
    body = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": f"then {MARK}"}]}
    if streamed:
        body["stream"] = True
    async with httpx.AsyncClient(base_url=proxy.base_url, timeout=30) as http:
        turn = asyncio.create_task(http.post("/chat/completions", headers=headers, json=body))
        await provider_called(proxy, 2)
        assert (await operator_erase(proxy, "t-chat")).status_code == 200
        release.set()
        answer = await turn
    if streamed:
        assert '"code":"store_error"' in answer.text.replace(" ", "")
    else:
        assert answer.status_code == 409, answer.text
        assert answer.json()["error"] == {
            "message": "Thread 't-chat' was deleted while this request ran; its answer was "
            "not kept.",
            "type": "invalid_request_error",
            "param": "X-Thread-Id",
            "code": "thread_deleted",
        }
    assert await tables_holding(proxy.app[STORE], MARK) == {}  # type: ignore[index]
