"""Explain records: GET /threadkeeper/v1/requests/{request_id} says what one model request
sent and why, to the tenant that made it and no one else."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import Any

import httpx
import openai
import pytest
from structlog.testing import capture_logs

from proxy.clock import ManualClock
from proxy.fake_provider import FakeProvider, Reply
from proxy.server.explain import EXPLAIN
from proxy.server.state import STORE

from .conftest import TENANT_KEY, Proxy
from .test_ledger_e2e import REFUND, ChatAgent, Shop, tools_policy

AUTH = {"Authorization": f"Bearer {TENANT_KEY}"}
WINDOW = 6000


async def explain(proxy: Proxy, request_id: str, auth: dict[str, str] = AUTH) -> httpx.Response:
    async with proxy.http() as http:
        return await http.get(f"/threadkeeper/v1/requests/{request_id}", headers=auth)


async def written(proxy: Proxy) -> None:
    """Until the background writer has stored every queued record."""
    recorder = proxy.app[EXPLAIN]  # type: ignore[index]
    for _ in range(1000):
        if not recorder._unwritten:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("explain records still unwritten after 10 s")


async def chat(
    proxy: Proxy, messages: list[dict[str, Any]], thread: str | None = None, **extra: Any
) -> httpx.Response:
    headers = {**AUTH, **({"X-Thread-Id": thread} if thread else {})}
    async with proxy.http() as http:
        body = {"model": "gpt-4o", "messages": messages, **extra}
        return await http.post("/v1/chat/completions", json=body, headers=headers, timeout=30)


async def test_a_cut_thread_explains_its_blocks_summary_and_usage(
    make_proxy: Callable[..., Awaitable[Proxy]], provider: FakeProvider
) -> None:
    proxy = await make_proxy(window=WINDOW)
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You track orders."}]
    for turn in range(8):
        provider.script.append(Reply(text=f"Noted ORD-{turn}. " + "detail " * 400))
        messages.append({"role": "user", "content": f"Order ORD-{turn}: " + "words " * 400})
        answer = await chat(proxy, messages, thread="t-explain")
        assert answer.status_code == 200
        messages.append(answer.json()["choices"][0]["message"])

    shown = await explain(proxy, answer.headers["x-threadkeeper-request-id"])
    assert shown.status_code == 200
    record = shown.json()
    assert record["object"] == "threadkeeper.request" and record["status"] == 200
    assert (record["tenant"], record["thread_id"]) == ("acme", "t-explain")
    projection = record["projection"]
    assert projection["window"] == WINDOW
    assert record["estimated_input_tokens"] == int(answer.headers["x-threadkeeper-context-tokens"])
    assert record["usage_input_tokens"] == answer.json()["usage"]["prompt_tokens"]
    actions = {block["action"] for block in projection["blocks"]}
    assert "kept" in actions and "summarized" in actions
    for block in projection["blocks"]:
        assert block["tokens_after"] <= block["tokens_before"] or block["action"] == "kept"
    summaries = [s for s in record["stand_ins"] if s["kind"] == "summary"]
    sent = provider.model_requests[-1].json["messages"]
    assert summaries and sent[summaries[0]["position"]]["content"] == summaries[0]["text"]
    assert record["retries"] == 0 and record["upstream_status"] == 200
    assert record["latency_ms"] >= record["upstream_ms"] > 0


async def test_stateless_streamed_answers_carry_the_id_and_get_a_record(proxy: Proxy) -> None:
    async with proxy.http() as http:
        body = {"model": "gpt-4o", "messages": [{"role": "user", "content": "Hi"}], "stream": True}
        async with http.stream("POST", "/v1/chat/completions", json=body, headers=AUTH) as streamed:
            request_id = streamed.headers["x-threadkeeper-request-id"]
            assert [line async for line in streamed.aiter_lines() if line][-1] == "data: [DONE]"
    record = (await explain(proxy, request_id)).json()
    assert record["id"] == request_id and record["projection"]["blocks"]
    await written(proxy)
    assert (await explain(proxy, request_id)).json() == record, "the stored record is the same"


async def test_ledger_verdicts_are_in_the_record(
    make_proxy: Callable[..., Awaitable[Proxy]], provider: FakeProvider
) -> None:
    proxy = await make_proxy(acme_extra=tools_policy())
    agent = ChatAgent(proxy, Shop(), stream=False)
    with capture_logs() as logs:
        provider.script += [Reply(tool_calls=[REFUND]), Reply(text="Refunded.")]
        await agent.ask("Refund ORD-1")
        provider.script += [Reply(tool_calls=[REFUND]), Reply(text="Already done.")]
        await agent.ask("Refund ORD-1 again")
    ids = [line["request_id"] for line in logs if line["event"] == "request"]
    verdicts = []
    for request_id in ids:
        verdicts += (await explain(proxy, request_id)).json().get("ledger", [])
    assert [v["verdict"] for v in verdicts] == ["hand_out", "replay"]
    assert {v["key"] for v in verdicts} == {"refund:ORD-1"}


async def test_other_tenants_unknown_ids_and_explain_off_get_404(
    make_proxy: Callable[..., Awaitable[Proxy]],
) -> None:
    proxy = await make_proxy()
    answer = await chat(proxy, [{"role": "user", "content": "Hi"}])
    request_id = answer.headers["x-threadkeeper-request-id"]
    await written(proxy)
    assert (await explain(proxy, request_id)).status_code == 200
    for auth, wanted in (
        ({"Authorization": "Bearer sk-someone-else-entirely"}, request_id),
        (AUTH, "req_0123456789abcdef01234567"),
        (AUTH, "x" * 300),
    ):
        missing = await explain(proxy, wanted, auth)
        assert missing.status_code == 404
        error = missing.json()["error"]
        assert error["code"] == "request_not_found" and error["param"] == "request_id"

    off = await make_proxy(settings={"explain": False})
    answer = await chat(off, [{"role": "user", "content": "Hi"}])
    assert answer.headers["x-threadkeeper-request-id"]
    assert (await explain(off, answer.headers["x-threadkeeper-request-id"])).status_code == 404


async def test_records_past_their_retention_are_purged(
    store_url: str,  # before make_proxy: a PostgreSQL schema outlives the proxy
    make_proxy: Callable[..., Awaitable[Proxy]],
) -> None:
    clock = ManualClock()
    proxy = await make_proxy(
        clock=clock, store_url=store_url, settings={"explain_retention_seconds": 3600.0}
    )
    answer = await chat(proxy, [{"role": "user", "content": "Hi"}])
    request_id = answer.headers["x-threadkeeper-request-id"]
    await written(proxy)
    await clock.advance_settled(timedelta(minutes=50))  # a purge (every 10 min): too young
    assert (await explain(proxy, request_id)).status_code == 200
    clock.advance(timedelta(minutes=20))
    for _ in range(500):
        gone = await explain(proxy, request_id)
        if gone.status_code == 404:
            break
        await asyncio.sleep(0.02)
    assert json.loads(gone.text)["error"]["code"] == "request_not_found"


async def test_a_provider_error_is_explained_and_the_proxys_own_refusal_is_not(
    make_proxy: Callable[..., Awaitable[Proxy]], provider: FakeProvider
) -> None:
    """Issue 20, item 14: a provider's 4xx (and 5xx) answer keeps its record, with the
    provider's status and error; a 4xx the proxy gives before calling the provider (bad
    input) keeps none."""
    proxy = await make_proxy(window=WINDOW)
    client = proxy.client()
    provider.script.append(Reply(status=400, text="Invalid 'temperature': 9 is above 2."))
    with pytest.raises(openai.BadRequestError) as refused:
        await client.responses.with_raw_response.create(
            model="gpt-4o", input="Hi", temperature=9, store=False
        )
    refused_id = refused.value.response.headers["x-threadkeeper-request-id"]
    provider.script.append(Reply(status=400, text="Invalid 'temperature': 9 is above 2."))
    streamed = await chat(proxy, [{"role": "user", "content": "Hi"}], temperature=9, stream=True)
    assert streamed.status_code == 400
    provider.script += [Reply(status=503)] * 3  # every attempt the retry policy allows
    failed = await chat(proxy, [{"role": "user", "content": "Hi"}])
    assert failed.status_code >= 500
    with pytest.raises(openai.BadRequestError) as ours:  # the proxy's own: over the window
        await client.responses.create(
            model="gpt-4o", input="words " * 7000, truncation="disabled", store=False
        )
    assert ours.value.code == "context_length_exceeded"
    invalid = await chat(proxy, [{"role": "user", "content": "Hi"}], max_tokens="many")
    assert invalid.status_code == 400
    await written(proxy)
    for request_id in (refused_id, streamed.headers["x-threadkeeper-request-id"]):
        kept = await explain(proxy, request_id)
        assert kept.status_code == 200, kept.text
        record = kept.json()
        assert record["status"] == 400 and record["upstream_status"] == 400
        assert record["provider_error"] == {
            "status": 400,
            "message": "Invalid 'temperature': 9 is above 2.",
            "type": "invalid_request_error",
            "param": None,
            "code": None,
        }
        assert record["estimated_input_tokens"] > 0 and record["projection"]["blocks"]
        assert "usage_input_tokens" not in record  # the provider counted nothing
    kept = await explain(proxy, failed.headers["x-threadkeeper-request-id"])
    assert kept.status_code == 200 and kept.json()["status"] == failed.status_code
    assert kept.json()["provider_error"]["status"] == 503
    for request_id in (
        ours.value.response.headers["x-threadkeeper-request-id"],
        invalid.headers["x-threadkeeper-request-id"],
    ):
        assert (await explain(proxy, request_id)).status_code == 404
    assert len(provider.model_requests) == 5  # the two refusals and three 503s


async def test_every_request_counts_the_history_it_did_not_send_verbatim(
    make_proxy: Callable[..., Awaitable[Proxy]], provider: FakeProvider
) -> None:
    """One meaning for the counts: a request after a cut counts the items an earlier cut
    summarized, in the header, the log line and the explain record alike (it said
    summarized=0 while its log line showed a summary block)."""
    proxy = await make_proxy(window=WINDOW)
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You track orders."}]
    counts = []
    for turn in range(12):
        provider.script.append(Reply(text=f"Noted ORD-{turn}. " + "detail " * 400))
        messages.append({"role": "user", "content": f"Order ORD-{turn}: " + "words " * 400})
        with capture_logs() as logs:
            answer = await chat(proxy, messages, thread="t-counts")
        messages.append(answer.json()["choices"][0]["message"])
        header = dict(
            part.strip().split("=") for part in answer.headers["x-threadkeeper-trimmed"].split(",")
        )
        logged = next(line for line in logs if line["event"] == "request")["budget"]
        record = (await explain(proxy, answer.headers["x-threadkeeper-request-id"])).json()
        assert int(header["summarized"]) == logged["summarized"]
        assert logged["summarized"] == record["projection"]["summarized"]
        assert int(header["dropped"]) == 0
        counts.append(logged["summarized"])
    thread = await proxy.app[STORE].get_thread("acme", "t-counts")  # type: ignore[index]
    before_window = thread.state["window_start"] - 1  # all but the pinned system message
    cut_at = next(turn for turn, count in enumerate(counts) if count)
    assert cut_at < len(counts) - 2, "the thread was cut with turns to spare"
    assert all(count > 0 for count in counts[cut_at:]), counts
    assert counts == sorted(counts) and counts[-1] == before_window


async def test_deleting_a_conversation_deletes_its_records(
    make_proxy: Callable[..., Awaitable[Proxy]], provider: FakeProvider
) -> None:
    """The records quote the thread's summaries and compressed tool results: deleting the
    conversation deletes them, written or still queued; other threads' stay."""
    proxy = await make_proxy(window=WINDOW)
    async with proxy.http() as http:
        made = await http.post("/v1/conversations", json={}, headers=AUTH)
        conversation = made.json()["id"]
        ids = []
        for text in ("first", "second"):
            provider.script.append(Reply(text=f"Noted {text}."))
            body = {"model": "gpt-4o", "input": text, "conversation": conversation}
            answer = await http.post("/v1/responses", json=body, headers=AUTH)
            assert answer.status_code == 200, answer.text
            ids.append(answer.headers["x-threadkeeper-request-id"])
            if text == "first":
                await written(proxy)  # one stored, one (perhaps) still queued
        other = await chat(proxy, [{"role": "user", "content": "hi"}], thread="t-other")
        deleted = await http.delete(f"/v1/conversations/{conversation}", headers=AUTH)
        assert deleted.status_code == 200
    await written(proxy)
    for request_id in ids:
        assert (await explain(proxy, request_id)).status_code == 404
    kept = await explain(proxy, other.headers["x-threadkeeper-request-id"])
    assert kept.status_code == 200


async def test_the_records_of_requests_one_after_the_other_share_a_write(
    make_proxy: Callable[..., Awaitable[Proxy]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The writer gathers a batch for BATCH_WAIT_SECONDS after its first record: one
    client's requests in a row are written in one store transaction, each record served
    from the queue meanwhile."""
    from proxy.server import explain as explain_module

    monkeypatch.setattr(explain_module, "BATCH_WAIT_SECONDS", 30.0)
    proxy = await make_proxy()
    store = proxy.app[STORE]  # type: ignore[index]
    batches: list[int] = []
    put = store.explain_put

    async def counted(records: Any) -> None:
        batches.append(len(records))
        await put(records)

    monkeypatch.setattr(store, "explain_put", counted)
    ids = []
    for turn in range(4):
        answer = await chat(proxy, [{"role": "user", "content": f"Hi {turn}"}])
        ids.append(answer.headers["x-threadkeeper-request-id"])
        assert (await explain(proxy, ids[-1])).json()["id"] == ids[-1]  # from the queue
    assert batches == [], "nothing is written while the batch gathers"
    recorder = proxy.app[EXPLAIN]  # type: ignore[index]
    await recorder.drain()  # what shutdown does; the waiting writer finds the queue empty
    assert batches == [4]
    for request_id in ids:
        assert (await store.explain_get("acme", request_id)) is not None


async def test_the_records_that_come_during_a_write_wait_for_the_next_batch(
    make_proxy: Callable[..., Awaitable[Proxy]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The writer waits before every batch, not only the first after an idle queue: the
    records of the requests answered while a batch was being written gather too (else
    one client's requests one after the other were written one or two at a time)."""
    proxy = await make_proxy()
    recorder = proxy.app[EXPLAIN]  # type: ignore[index]
    store = proxy.app[STORE]  # type: ignore[index]
    waits: list[asyncio.Event] = []

    async def held(seconds: float) -> None:
        waits.append(asyncio.Event())
        await waits[-1].wait()

    recorder._sleep = held
    batches: list[int] = []
    writing = asyncio.Event()
    put = store.explain_put

    async def slow(records: Any) -> None:
        batches.append(len(records))
        await writing.wait()
        await put(records)

    monkeypatch.setattr(store, "explain_put", slow)

    async def until(done: Callable[[], bool], what: str) -> None:
        for _ in range(1000):
            if done():
                return
            await asyncio.sleep(0.01)
        raise AssertionError(f"not within 10 s: {what}")

    await chat(proxy, [{"role": "user", "content": "first"}])
    await until(lambda: len(waits) == 1, "the first record waits")
    assert batches == []
    waits[0].set()
    await until(lambda: batches == [1], "the first batch written")
    for turn in range(3):  # answered while the write is held up
        await chat(proxy, [{"role": "user", "content": f"during the write {turn}"}])
    writing.set()
    await until(lambda: len(waits) == 2, "the next batch waits before it is written")
    assert batches == [1]
    waits[1].set()
    await until(lambda: batches == [1, 3], "the three written together")
