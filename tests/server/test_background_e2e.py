"""Background mode through the proxy with the openai SDK, on SQLite and on PostgreSQL:
create, poll, cancel, a stream left and resumed with `starting_after`, and the faults
(a provider that fails, a store down meanwhile, a cancel racing the completion)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import openai
import pytest
from structlog.testing import capture_logs

from proxy.fake_provider import Reply
from proxy.server.background import RUNS
from proxy.server.explain import EXPLAIN
from proxy.server.state import STORE
from proxy.store.base import Store, StoreUnavailable

from .conftest import TENANT_KEY, Proxy

TENANT = "acme"
MODEL = "gpt-4o-mini"


@pytest.fixture
def default_store_url(store_url: str) -> str:
    return store_url


def store_of(proxy: Proxy) -> Store:
    return proxy.app[STORE]  # type: ignore[index]


async def until(check: Callable[[], Awaitable[bool]], what: str) -> None:
    """Waits for a state the proxy reaches on its own (bounded: a hang fails the test)."""
    for _ in range(1000):
        if await check():
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"never reached: {what}")


async def status_becomes(client: openai.AsyncOpenAI, response_id: str, status: str) -> Any:
    async def done() -> bool:
        return (await client.responses.retrieve(response_id)).status == status

    await until(done, status)
    return await client.responses.retrieve(response_id)


async def test_background_create_returns_at_once_and_polls_to_completed(proxy: Proxy) -> None:
    release = asyncio.Event()
    proxy.provider.script.append(Reply(text="the long answer", release=release))
    client = proxy.client()
    created = await client.responses.create(model=MODEL, input="think hard", background=True)
    assert (created.status, created.background) == ("in_progress", True)
    polled = await client.responses.retrieve(created.id)
    assert (polled.status, polled.background) == ("in_progress", True)
    release.set()
    done = await status_becomes(client, created.id, "completed")
    assert done.output_text == "the long answer"
    assert done.background is True
    sent = proxy.provider.model_requests[-1].json
    assert "background" not in sent
    # It is a stored response like any: the chain continues from it.
    proxy.provider.script.append(Reply(text="second"))
    follow = await client.responses.create(
        model=MODEL, input="more", previous_response_id=created.id
    )
    assert follow.output_text == "second" and follow.background is False
    texts = [str(item) for item in proxy.provider.model_requests[-1].json["input"]]
    assert any("the long answer" in text for text in texts)


async def test_cancel_aborts_the_provider_request_and_commits_nothing(proxy: Proxy) -> None:
    client = proxy.client()
    first = await client.responses.create(model=MODEL, input="hello")
    release = asyncio.Event()
    proxy.provider.script.append(Reply(text="too late", release=release))
    created = await client.responses.create(
        model=MODEL, input="think", background=True, previous_response_id=first.id
    )
    cancelled = await client.responses.cancel(created.id)
    assert (cancelled.id, cancelled.status, cancelled.background) == (
        created.id,
        "cancelled",
        True,
    )
    again = await client.responses.cancel(created.id)  # cancelling twice is no error
    assert again.status == "cancelled"
    release.set()

    async def aborted() -> bool:
        return proxy.provider.aborted == 1

    await until(aborted, "the provider's request aborted")
    assert (await client.responses.retrieve(created.id)).status == "cancelled"
    # Nothing of the cancelled turn is in the chain: `first` is still its head.
    stored = await store_of(proxy).get_response(TENANT, first.id)
    assert stored is not None and stored.thread_id is not None
    thread = await store_of(proxy).get_thread(TENANT, stored.thread_id)
    assert thread is not None and thread.head_response_id == first.id
    items = await store_of(proxy).items_between(TENANT, stored.thread_id, 0, 100)
    assert all(item.response_id != created.id for item in items)


async def test_cancel_refusals_are_openais(proxy: Proxy) -> None:
    client = proxy.client()
    proxy.provider.script.append(Reply(text="done"))
    foreground = await client.responses.create(model=MODEL, input="hi")
    with pytest.raises(openai.BadRequestError) as refused:
        await client.responses.cancel(foreground.id)
    assert "background" in refused.value.message
    proxy.provider.script.append(Reply(text="quick"))
    finished = await client.responses.create(model=MODEL, input="hi", background=True)
    await status_becomes(client, finished.id, "completed")
    with pytest.raises(openai.BadRequestError) as refused:
        await client.responses.cancel(finished.id)
    assert "completed" in refused.value.message
    with pytest.raises(openai.NotFoundError):
        await client.responses.cancel("resp_unknown")
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve("resp_unknown", stream=True, starting_after=0)  # type: ignore[call-overload]


async def test_background_requires_store_and_refuses_before_storing(proxy: Proxy) -> None:
    client = proxy.client()
    with pytest.raises(openai.BadRequestError) as refused:
        await client.responses.create(model=MODEL, input="x", background=True, store=False)
    assert refused.value.body["param"] == "background"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as refused:
        await client.responses.create(
            model=MODEL, input="x", background=True, previous_response_id="resp_missing"
        )
    assert refused.value.body["param"] == "previous_response_id"  # type: ignore[index]
    assert proxy.provider.model_requests == []


async def test_a_stream_left_midway_resumes_after_its_last_event(proxy: Proxy) -> None:
    release = asyncio.Event()
    proxy.provider.script.append(Reply(text="one two three four", release=release, release_after=3))
    client = proxy.client()
    stream = await client.responses.create(model=MODEL, input="go", background=True, stream=True)
    seen = []
    async for event in stream:
        seen.append(event)
        if len(seen) == 3:
            break
    await stream.close()  # the client leaves; the response runs on
    assert [e.sequence_number for e in seen] == [0, 1, 2]
    assert seen[0].type == "response.created" and seen[0].response.background is True
    response_id = seen[0].response.id
    release.set()
    resumed = await client.responses.retrieve(response_id, stream=True, starting_after=2)
    rest = [event async for event in resumed]
    assert [e.sequence_number for e in rest] == list(range(3, 3 + len(rest)))
    assert rest[-1].type == "response.completed"
    assert rest[-1].response.output_text == "one two three four"
    assert rest[-1].response.id == response_id
    again = await client.responses.retrieve(response_id, stream=True, starting_after=-1)
    replay = [event async for event in again]
    assert [e.type for e in replay[:3]] == [e.type for e in seen]
    assert len(replay) == 3 + len(rest)
    assert (await client.responses.retrieve(response_id)).status == "completed"


async def test_starting_after_must_be_an_integer_within_the_stream(proxy: Proxy) -> None:
    proxy.provider.script.append(Reply(text="short"))
    client = proxy.client()
    stream = await client.responses.create(model=MODEL, input="go", background=True, stream=True)
    events = [event async for event in stream]
    response_id, last = events[0].response.id, events[-1].sequence_number
    async with proxy.http() as http:
        for value in ("abc", "1.5", str(last + 1), "-2"):
            answer = await http.get(
                f"/v1/responses/{response_id}",
                params={"stream": "true", "starting_after": value},
                headers=auth(),
            )
            assert answer.status_code == 400, value
            assert answer.json()["error"]["param"] == "starting_after"
        answer = await http.get(
            f"/v1/responses/{response_id}", params={"stream": "maybe"}, headers=auth()
        )
        assert (answer.status_code, answer.json()["error"]["param"]) == (400, "stream")
    proxy.provider.script.append(Reply(text="plain"))
    plain = await client.responses.create(model=MODEL, input="go")
    with pytest.raises(openai.BadRequestError) as refused:
        await client.responses.retrieve(plain.id, stream=True)
    assert refused.value.body["param"] == "stream"  # type: ignore[index]


def auth() -> dict[str, str]:
    from .conftest import TENANT_KEY

    return {"Authorization": f"Bearer {TENANT_KEY}"}


async def test_a_failing_provider_ends_the_response_failed_with_its_error(proxy: Proxy) -> None:
    proxy.provider.script.append(Reply(status=400, text="The model refuses this input."))
    client = proxy.client()
    created = await client.responses.create(model=MODEL, input="x", background=True)
    failed = await status_becomes(client, created.id, "failed")
    assert failed.error is not None
    assert (failed.error.code, failed.error.message) == (
        "invalid_prompt",
        "The model refuses this input.",
    )
    proxy.provider.script.extend(Reply(status=500, text="down") for _ in range(3))
    streamed = await client.responses.create(model=MODEL, input="x", background=True, stream=True)
    events = [event async for event in streamed]
    assert events[-1].type == "response.failed"
    assert events[-1].response.error.code == "server_error"
    stored = await client.responses.retrieve(events[-1].response.id)
    assert stored.status == "failed"


async def test_the_store_down_during_a_run_ends_it_failed_once_back(
    proxy: Proxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    release = asyncio.Event()
    proxy.provider.script.append(Reply(text="lost", release=release))
    client = proxy.client()
    created = await client.responses.create(model=MODEL, input="x", background=True)
    store = store_of(proxy)
    back = asyncio.Event()
    tried: list[str] = []
    real_commit, real_finish = store.commit_turn, store.finish_response

    async def commit_down(*args: Any, **kwargs: Any) -> Any:
        tried.append("commit")
        raise StoreUnavailable("the store is down")

    async def finish_until_back(*args: Any, **kwargs: Any) -> Any:
        tried.append("finish")
        if not back.is_set():
            raise StoreUnavailable("the store is down")
        return await real_finish(*args, **kwargs)

    monkeypatch.setattr(store, "commit_turn", commit_down)
    monkeypatch.setattr(store, "finish_response", finish_until_back)
    release.set()

    async def retried() -> bool:
        return tried.count("finish") >= 2

    await until(retried, "the settle retried")
    assert (await client.responses.retrieve(created.id)).status == "in_progress"
    back.set()
    failed = await status_becomes(client, created.id, "failed")
    assert failed.error is not None and "could not save" in failed.error.message
    monkeypatch.setattr(store, "commit_turn", real_commit)


async def test_a_tenant_runs_at_most_its_limit(make_proxy: Any) -> None:
    proxy: Proxy = await make_proxy(acme_extra="background: {max_running: 1}\n")
    release = asyncio.Event()
    proxy.provider.script.extend([Reply(text="a", release=release), Reply(text="b")])
    client = proxy.client()
    first = await client.responses.create(model=MODEL, input="x", background=True)
    with pytest.raises(openai.RateLimitError) as refused:
        await client.responses.create(model=MODEL, input="y", background=True)
    assert "background.max_running" in refused.value.message
    release.set()
    await status_becomes(client, first.id, "completed")
    second = await client.responses.create(model=MODEL, input="y", background=True)
    await status_becomes(client, second.id, "completed")


async def test_concurrent_creates_never_run_past_the_limit(make_proxy: Any) -> None:
    """max_running is counted where the row is inserted: of 6 creates sent at once under
    a limit of 2, exactly 2 run and the others get the 429 (none is stored)."""
    proxy: Proxy = await make_proxy(acme_extra="background: {max_running: 2}\n")
    release = asyncio.Event()
    proxy.provider.script.extend([Reply(text=f"r{n}", release=release) for n in range(6)])
    client = proxy.client()

    async def create(n: int) -> str | None:
        try:
            return (await client.responses.create(model=MODEL, input=f"x{n}", background=True)).id
        except openai.RateLimitError:
            return None

    created = await asyncio.gather(*(create(n) for n in range(6)))
    running = [rid for rid in created if rid is not None]
    assert len(running) == 2
    assert await store_of(proxy).background_running(TENANT) == 2
    release.set()
    for rid in running:
        await status_becomes(client, rid, "completed")


async def test_a_background_turn_has_its_own_log_line_and_explain_record(
    proxy: Proxy,
) -> None:
    """The create request logs the turn's start; the turn, once it ends, logs a line of
    its own (response id, final status, duration) and writes the explain record of its
    model request under the create's request id, with what the provider answered."""
    release = asyncio.Event()
    proxy.provider.script.append(Reply(text="done later", release=release))
    client = proxy.client()
    with capture_logs() as logs:
        raw = await client.responses.with_raw_response.create(
            model=MODEL, input="x", background=True
        )
        created = raw.parse()
        request_id = raw.headers["x-threadkeeper-request-id"]
        release.set()
        await status_becomes(client, created.id, "completed")

        async def logged() -> bool:
            return any(line["event"] == "background_response" for line in logs)

        await until(logged, "the background turn's log line")
    line = next(line for line in logs if line["event"] == "background_response")
    assert (line["request_id"], line["response_id"]) == (request_id, created.id)
    assert line["status"] == "completed" and line["duration_ms"] > 0
    assert line["usage_input_tokens"] > 0 and line["upstream_status"] == 200
    recorder = proxy.app[EXPLAIN]  # type: ignore[index]

    async def written() -> bool:
        return not recorder._unwritten

    await until(written, "the explain record written")
    async with proxy.http() as http:
        shown = await http.get(
            f"/threadkeeper/v1/requests/{request_id}",
            headers={"Authorization": f"Bearer {TENANT_KEY}"},
        )
    assert shown.status_code == 200
    record = shown.json()
    assert record["status"] == 200 and record["upstream_status"] == 200
    assert record["background_status"] == "completed"
    assert record["usage_input_tokens"] == line["usage_input_tokens"]
    assert record["projection"]["blocks"]


async def test_a_cancel_racing_the_completion_has_one_winner(proxy: Proxy) -> None:
    """Whichever lands first: a completed response refuses the cancel, a cancelled one
    keeps none of its answer."""
    client = proxy.client()
    for round_ in range(6):
        release = asyncio.Event()
        proxy.provider.script.append(Reply(text=f"answer {round_}", release=release))
        created = await client.responses.create(model=MODEL, input="x", background=True)
        release.set()
        try:
            await client.responses.cancel(created.id)
            won = "cancelled"
        except openai.BadRequestError:
            won = "completed"

        async def settled(rid: str = created.id) -> bool:
            return (TENANT, rid) not in proxy.app[RUNS].runs  # type: ignore[index]

        await until(settled, "the run ended")
        final = await client.responses.retrieve(created.id)
        assert final.status == won
        stored = await store_of(proxy).get_response(TENANT, created.id)
        assert stored is not None and stored.thread_id is not None
        thread = await store_of(proxy).get_thread(TENANT, stored.thread_id)
        kept = thread is not None and thread.head_response_id == created.id
        assert kept == (won == "completed")


async def test_the_sdk_retrieve_without_stream_is_a_plain_poll(proxy: Proxy) -> None:
    proxy.provider.script.append(Reply(text="x"))
    client = proxy.client()
    created = await client.responses.create(model=MODEL, input="x", background=True)
    await status_becomes(client, created.id, "completed")
    async with httpx.AsyncClient(base_url=proxy.base_url, headers=auth()) as http:
        answer = await http.get(f"/responses/{created.id}", params={"starting_after": "x"})
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "starting_after"


async def test_a_background_response_of_a_dead_process_ends_incomplete(
    make_proxy: Any, store_url: str
) -> None:
    """A process killed mid-run never finishes its row: the next start's recovery sweep
    ends it `incomplete`, and its stream, resumed, ends instead of waiting forever."""
    from proxy.clock import utc_now
    from proxy.store import open_store
    from proxy.store.base import ResponseEvent, StoredResponse

    now = utc_now()  # recent: the retention purges would take older rows at start

    before = await open_store(store_url)
    await before.migrate()
    await before.heartbeat("proc_killed", "2025-01-01T00:00:00.000000+00:00", pid=0)
    await before.begin_response(
        StoredResponse(
            tenant=TENANT,
            id="resp_orphan",
            thread_id=None,
            previous_response_id=None,
            status="in_progress",
            request={"model": MODEL, "stream": True},
            response=None,
            created_at=now,
            owner="proc_killed",
            background=True,
        )
    )
    created = {"type": "response.created", "sequence_number": 0, "response": {"id": "x"}}
    event = ResponseEvent(0, "response.created", json.dumps(created))
    await before.response_events_append(TENANT, "resp_orphan", [event], now)
    await before.close()
    proxy: Proxy = await make_proxy()
    client = proxy.client()
    assert (await client.responses.retrieve("resp_orphan")).status == "incomplete"
    resumed = await client.responses.retrieve("resp_orphan", stream=True, starting_after=-1)
    assert [e.sequence_number async for e in resumed] == [0]


async def test_a_stream_beyond_max_events_ends_failed_naming_the_limit(make_proxy: Any) -> None:
    proxy: Proxy = await make_proxy(acme_extra="background: {max_events: 4}\n")
    proxy.provider.script.append(Reply(text="a b c d e f g h i j"))
    client = proxy.client()
    stream = await client.responses.create(model=MODEL, input="x", background=True, stream=True)
    events = [event async for event in stream]
    assert [e.sequence_number for e in events] == [0, 1, 2, 3, 4]
    assert events[-1].type == "response.failed"
    assert "background.max_events" in events[-1].response.error.message
    stored = await client.responses.retrieve(events[0].response.id)
    assert stored.status == "failed"
