"""`Idempotency-Key` through the proxy (SPEC section 1): replay, 422, 409, what is not
stored, expiry, tenant isolation, bad keys."""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest

from proxy.clock import ManualClock, utc_iso
from proxy.core.idempotency import fingerprint
from proxy.fake_provider import Reply
from proxy.server import recovery
from proxy.server.idempotency import purge_expired
from proxy.server.state import OWNER, STORE
from proxy.store.base import IdempotencyRecord
from tests.server.conftest import TENANT_KEY, Proxy

CHAT = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "Refund order 7."}]}
RESPONSES = {"model": "gpt-4o-mini", "input": "Refund order 7."}
OTHER_TENANT_KEY = "sk-someone-else-entirely"


@pytest.fixture
def default_store_url(store_url: str) -> str:
    """Every test here runs on SQLite and on PostgreSQL: the backend changes nothing."""
    return store_url


def keyed(key: str, api_key: str = TENANT_KEY) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}", "Idempotency-Key": key}


async def post(
    proxy: Proxy, path: str, body: dict[str, Any], key: str, api_key: str = TENANT_KEY
) -> httpx.Response:
    async with proxy.http() as http:
        return await http.post(path, json=body, headers=keyed(key, api_key))


async def first_provider_call(proxy: Proxy) -> None:
    for _ in range(500):
        if proxy.provider.requests:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the request never reached the provider")


def error_of(response: httpx.Response) -> dict[str, Any]:
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return dict(error)


async def test_chat_replay_returns_the_same_body_without_a_second_provider_call(proxy) -> None:
    client = proxy.client()
    headers = {"Idempotency-Key": "chat-1"}
    first = await client.chat.completions.with_raw_response.create(**CHAT, extra_headers=headers)
    second = await client.chat.completions.with_raw_response.create(**CHAT, extra_headers=headers)
    assert second.http_response.content == first.http_response.content
    assert second.parse().id == first.parse().id
    assert first.headers["Idempotent-Replayed"] == "false"
    assert second.headers["Idempotent-Replayed"] == "true"
    assert second.headers["x-threadkeeper-request-id"] != first.headers["x-threadkeeper-request-id"]
    assert len(proxy.provider.requests) == 1


async def test_json_key_order_does_not_make_another_request(proxy) -> None:
    reordered = {"messages": CHAT["messages"], "model": CHAT["model"]}
    first = await post(proxy, "/v1/chat/completions", CHAT, "order")
    second = await post(proxy, "/v1/chat/completions", reordered, "order")
    assert second.status_code == 200
    assert second.content == first.content
    assert len(proxy.provider.requests) == 1


async def test_streamed_chat_replays_the_exact_event_stream(proxy) -> None:
    body = {**CHAT, "stream": True}
    first = await post(proxy, "/v1/chat/completions", body, "stream-1")
    second = await post(proxy, "/v1/chat/completions", body, "stream-1")
    assert first.status_code == second.status_code == 200
    assert b"data: [DONE]" in first.content
    assert second.content == first.content
    assert second.headers["content-type"].startswith("text/event-stream")
    assert (first.headers["Idempotent-Replayed"], second.headers["Idempotent-Replayed"]) == (
        "false",
        "true",
    )
    assert len(proxy.provider.requests) == 1


async def test_sdk_reads_a_replayed_stream(proxy) -> None:
    client = proxy.client()
    headers = {"Idempotency-Key": "stream-sdk"}
    texts = []
    for _ in range(2):
        stream = await client.chat.completions.create(**CHAT, stream=True, extra_headers=headers)
        texts.append("".join([c.choices[0].delta.content or "" async for c in stream if c.choices]))
    assert texts[0] and texts[1] == texts[0]
    assert len(proxy.provider.requests) == 1


async def test_responses_replay_without_a_second_provider_call(proxy) -> None:
    client = proxy.client()
    headers = {"Idempotency-Key": "resp-1"}
    first = await client.responses.with_raw_response.create(**RESPONSES, extra_headers=headers)
    second = await client.responses.with_raw_response.create(**RESPONSES, extra_headers=headers)
    assert second.http_response.content == first.http_response.content
    assert second.parse().id == first.parse().id
    assert second.headers["Idempotent-Replayed"] == "true"
    assert len(proxy.provider.requests) == 1


async def test_streamed_responses_replay_the_exact_event_stream(proxy) -> None:
    body = {**RESPONSES, "stream": True}
    first = await post(proxy, "/v1/responses", body, "resp-stream")
    second = await post(proxy, "/v1/responses", body, "resp-stream")
    assert b"response.completed" in first.content
    assert second.content == first.content
    assert second.headers["Idempotent-Replayed"] == "true"
    assert len(proxy.provider.requests) == 1


async def test_same_key_with_another_body_is_422(proxy) -> None:
    await post(proxy, "/v1/chat/completions", CHAT, "reused")
    other = {**CHAT, "messages": [{"role": "user", "content": "Refund order 8."}]}
    response = await post(proxy, "/v1/chat/completions", other, "reused")
    assert response.status_code == 422
    assert error_of(response) == {
        "message": "Idempotency-Key 'reused' was already used with a different request body.",
        "type": "invalid_request_error",
        "param": None,
        "code": "idempotency_key_reused",
    }
    assert len(proxy.provider.requests) == 1


async def test_same_key_on_another_endpoint_is_422(proxy) -> None:
    await post(proxy, "/v1/chat/completions", CHAT, "endpoint")
    response = await post(proxy, "/v1/responses", RESPONSES, "endpoint")
    assert response.status_code == 422
    assert len(proxy.provider.requests) == 1


async def test_same_key_while_the_first_runs_is_409(proxy) -> None:
    proxy.provider.script.append(Reply(text="slow answer", delay=1.0))
    first = asyncio.create_task(post(proxy, "/v1/chat/completions", CHAT, "busy"))
    await first_provider_call(proxy)
    second = await post(proxy, "/v1/chat/completions", CHAT, "busy")
    assert second.status_code == 409
    assert second.headers["Retry-After"] == "1"
    assert error_of(second)["code"] == "idempotency_key_in_progress"
    assert (await first).status_code == 200
    third = await post(proxy, "/v1/chat/completions", CHAT, "busy")
    assert third.json()["choices"][0]["message"]["content"] == "slow answer"
    assert third.headers["Idempotent-Replayed"] == "true"
    assert len(proxy.provider.requests) == 1


async def test_a_key_left_running_by_a_dead_process_runs_again_after_the_sweep(proxy) -> None:
    """kill -9 mid-request leaves a `running` record; once its owner is swept as dead the
    retry runs instead of getting 409 until the record expires."""
    store, now = proxy.app[STORE], datetime.now(UTC)
    await store.heartbeat("proc_killed", utc_iso(now - timedelta(minutes=5)))
    orphan = IdempotencyRecord(
        tenant="acme",
        key="orphan",
        fingerprint=fingerprint("POST", "/v1/chat/completions", json.dumps(CHAT).encode()),
        status="running",
        response_status=None,
        created_at=utc_iso(now),
        expires_at=utc_iso(now + timedelta(hours=24)),
        owner="proc_killed",
    )
    assert await store.idempotency_begin(orphan) is None

    blocked = await post(proxy, "/v1/chat/completions", CHAT, "orphan")
    assert blocked.status_code == 409
    await recovery.sweep(store, proxy.app[OWNER], now=now)
    retried = await post(proxy, "/v1/chat/completions", CHAT, "orphan")
    assert retried.status_code == 200
    assert retried.headers["Idempotent-Replayed"] == "false"
    assert len(proxy.provider.requests) == 1
    stored = await store.idempotency_get("acme", "orphan")
    assert (stored.status, stored.owner) == ("done", proxy.app[OWNER])


async def test_a_sweep_leaves_the_running_key_of_a_live_process_alone(proxy) -> None:
    proxy.provider.script.append(Reply(text="slow answer", delay=1.0))
    first = asyncio.create_task(post(proxy, "/v1/chat/completions", CHAT, "alive"))
    await first_provider_call(proxy)
    await recovery.sweep(proxy.app[STORE], "proc_other_replica", now=datetime.now(UTC))
    second = await post(proxy, "/v1/chat/completions", CHAT, "alive")
    assert second.status_code == 409
    assert (await first).status_code == 200
    assert len(proxy.provider.requests) == 1


async def test_provider_5xx_is_not_stored_so_a_retry_can_succeed(proxy) -> None:
    proxy.provider.script.extend([Reply(status=500) for _ in range(3)])  # every attempt
    proxy.provider.script.append(Reply(text="worked this time"))
    failed = await post(proxy, "/v1/chat/completions", CHAT, "flaky")
    assert failed.status_code == 500
    calls = len(proxy.provider.requests)
    retried = await post(proxy, "/v1/chat/completions", CHAT, "flaky")
    assert retried.status_code == 200
    assert retried.json()["choices"][0]["message"]["content"] == "worked this time"
    assert retried.headers["Idempotent-Replayed"] == "false"
    assert len(proxy.provider.requests) == calls + 1


async def test_provider_4xx_is_stored_and_replayed(proxy) -> None:
    proxy.provider.script.append(Reply(status=400, text="Unsupported value: 'temperature'."))
    first = await post(proxy, "/v1/chat/completions", CHAT, "bad-param")
    second = await post(proxy, "/v1/chat/completions", CHAT, "bad-param")
    assert first.status_code == second.status_code == 400
    assert second.content == first.content
    assert second.headers["Idempotent-Replayed"] == "true"
    assert len(proxy.provider.requests) == 1


async def test_a_request_the_proxy_refuses_stores_nothing(proxy) -> None:
    async with proxy.http() as http:
        refused = await http.post(
            "/v1/chat/completions", content=b"{not json", headers=keyed("refused")
        )
    assert refused.status_code == 400
    assert await proxy.app[STORE].idempotency_get("acme", "refused") is None
    fixed = await post(proxy, "/v1/chat/completions", CHAT, "refused")
    assert fixed.status_code == 200


async def test_a_client_that_goes_away_mid_stream_frees_the_key(proxy) -> None:
    proxy.provider.script.append(Reply(text="a b c d e f g h", stream_chunk_delay=0.3))
    body = {**CHAT, "stream": True}
    async with proxy.http() as http:
        request = http.build_request(
            "POST", "/v1/chat/completions", json=body, headers=keyed("gone")
        )
        response = await http.send(request, stream=True)
        async for _ in response.aiter_bytes():
            break
        await response.aclose()
    store = proxy.app[STORE]
    for _ in range(500):
        if await store.idempotency_get("acme", "gone") is None:
            break
        await asyncio.sleep(0.01)
    assert await store.idempotency_get("acme", "gone") is None
    retried = await post(proxy, "/v1/chat/completions", body, "gone")
    assert retried.status_code == 200
    assert retried.headers["Idempotent-Replayed"] == "false"
    assert len(proxy.provider.requests) == 2


async def test_an_expired_key_runs_again_and_is_purged(make_proxy) -> None:
    clock = ManualClock()
    proxy = await make_proxy(clock=clock, acme_extra="idempotency: {retention_seconds: 30}\n")
    first = await post(proxy, "/v1/chat/completions", CHAT, "short-lived")
    clock.advance(timedelta(seconds=29))  # (the background purge sleeps 60 s)
    assert await purge_expired(proxy.app[STORE], clock) == 0
    clock.advance(timedelta(seconds=2))
    assert await purge_expired(proxy.app[STORE], clock) == 1
    assert await proxy.app[STORE].idempotency_get("acme", "short-lived") is None
    other = {**CHAT, "messages": [{"role": "user", "content": "Something else."}]}
    again = await post(proxy, "/v1/chat/completions", other, "short-lived")
    assert again.status_code == 200
    assert again.headers["Idempotent-Replayed"] == "false"
    assert again.json()["id"] != first.json()["id"]
    assert len(proxy.provider.requests) == 2


async def test_an_expired_record_is_replaced_when_its_key_returns(make_proxy) -> None:
    clock = ManualClock()
    proxy = await make_proxy(clock=clock, acme_extra="idempotency: {retention_seconds: 30}\n")
    await post(proxy, "/v1/chat/completions", CHAT, "replaced")
    clock.advance(timedelta(seconds=31))
    again = await post(proxy, "/v1/chat/completions", CHAT, "replaced")
    assert again.headers["Idempotent-Replayed"] == "false"
    assert len(proxy.provider.requests) == 2


async def test_keys_are_per_tenant(proxy) -> None:
    other = {**CHAT, "messages": [{"role": "user", "content": "Another tenant's request."}]}
    mine = await post(proxy, "/v1/chat/completions", CHAT, "shared")
    theirs = await post(proxy, "/v1/chat/completions", other, "shared", OTHER_TENANT_KEY)
    same_body = await post(proxy, "/v1/chat/completions", CHAT, "shared", OTHER_TENANT_KEY)
    assert mine.status_code == theirs.status_code == 200
    assert theirs.headers["Idempotent-Replayed"] == "false"
    assert same_body.status_code == 422  # their own record, not acme's
    assert len(proxy.provider.requests) == 2


async def test_a_bad_key_is_400_naming_the_header(proxy) -> None:
    for key in ("", "k" * 256):
        response = await post(proxy, "/v1/chat/completions", CHAT, key)
        assert response.status_code == 400
        error = error_of(response)
        assert "Idempotency-Key" in error["message"]
        assert error["code"] == "invalid_idempotency_key"
    async with proxy.http() as http:
        response = await http.post(
            "/v1/chat/completions",
            json=CHAT,
            headers=[
                ("Authorization", f"Bearer {TENANT_KEY}"),
                ("Idempotency-Key", "café".encode()),
            ],
        )
    assert response.status_code == 400
    assert proxy.provider.requests == []


async def test_requests_without_the_header_are_untouched(proxy) -> None:
    client = proxy.client()
    raw = await client.chat.completions.with_raw_response.create(**CHAT)
    assert "Idempotent-Replayed" not in raw.headers
    await client.chat.completions.create(**CHAT)
    assert len(proxy.provider.requests) == 2


async def test_passthrough_post_is_replayed(proxy) -> None:
    body = {"model": "text-embedding-3-small", "input": "refund"}
    first = await post(proxy, "/v1/embeddings", body, "embed")
    second = await post(proxy, "/v1/embeddings", body, "embed")
    assert first.status_code == 200
    assert json.loads(second.content) == json.loads(first.content)
    assert second.headers["Idempotent-Replayed"] == "true"
    assert len(proxy.provider.requests) == 1


async def test_a_stream_the_provider_cut_is_not_stored(proxy) -> None:
    proxy.provider.script.append(Reply(text="a b c d e f g h", disconnect_after=2))
    body = {**CHAT, "stream": True}
    cut = await post(proxy, "/v1/chat/completions", body, "cut")
    assert b"upstream_stream_error" in cut.content
    retried = await post(proxy, "/v1/chat/completions", body, "cut")
    assert b"data: [DONE]" in retried.content
    assert retried.headers["Idempotent-Replayed"] == "false"
    assert len(proxy.provider.requests) == 2


def chat_chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
    choice = {"index": 0, "delta": delta, "finish_reason": finish}
    chunk = {"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": "m"}
    return f"data: {json.dumps({**chunk, 'choices': [choice]})}\n\n".encode()


async def test_a_chat_stream_ended_by_eof_without_done_is_not_stored(proxy) -> None:
    # Regression (issue 8, item 12): a clean EOF before `[DONE]` was stored and replayed.
    frames = [
        chat_chunk({"role": "assistant", "content": "Refund"}),
        chat_chunk({"content": " ok"}),
    ]
    proxy.provider.script.append(Reply(frames=frames))
    body = {**CHAT, "stream": True}
    cut = await post(proxy, "/v1/chat/completions", body, "eof")
    assert cut.status_code == 200
    assert b"[DONE]" not in cut.content
    retried = await post(proxy, "/v1/chat/completions", body, "eof")
    assert retried.headers["Idempotent-Replayed"] == "false"
    assert b"data: [DONE]" in retried.content
    assert len(proxy.provider.model_requests) == 2


async def test_a_chat_stream_with_done_but_no_finish_reason_is_not_stored(proxy) -> None:
    frames = [chat_chunk({"role": "assistant", "content": "Refund"}), b"data: [DONE]\n\n"]
    proxy.provider.script.append(Reply(frames=frames))
    body = {**CHAT, "stream": True}
    first = await post(proxy, "/v1/chat/completions", body, "no-finish")
    assert first.status_code == 200 and b"data: [DONE]" in first.content
    retried = await post(proxy, "/v1/chat/completions", body, "no-finish")
    assert retried.headers["Idempotent-Replayed"] == "false"
    assert len(proxy.provider.model_requests) == 2


async def test_a_responses_stream_without_its_completed_event_is_not_stored(proxy) -> None:
    created = {"type": "response.created", "response": {"id": "r1", "output": []}}
    frames = [f"event: response.created\ndata: {json.dumps(created)}\n\n".encode()]
    proxy.provider.script.append(Reply(frames=frames))
    body = {**RESPONSES, "stream": True, "store": False}
    cut = await post(proxy, "/v1/responses", body, "eof-responses")
    assert b"response.completed" not in cut.content
    retried = await post(proxy, "/v1/responses", body, "eof-responses")
    assert retried.headers["Idempotent-Replayed"] == "false"
    assert b"response.completed" in retried.content
    assert len(proxy.provider.model_requests) == 2


async def test_a_finished_stream_ending_without_a_blank_line_is_stored(proxy) -> None:
    frames = [
        chat_chunk({"role": "assistant", "content": "Refund"}),
        chat_chunk({}, "stop"),
        b"data: [DONE]\n",  # some compatible servers end right after the sentinel
    ]
    proxy.provider.script.append(Reply(frames=frames))
    body = {**CHAT, "stream": True}
    first = await post(proxy, "/v1/chat/completions", body, "no-blank")
    replayed = await post(proxy, "/v1/chat/completions", body, "no-blank")
    assert replayed.headers["Idempotent-Replayed"] == "true"
    assert replayed.content == first.content
    assert len(proxy.provider.model_requests) == 1


async def test_a_stream_ends_only_once_its_record_is_stored(proxy, monkeypatch) -> None:
    # Regression (flaky under load): the stream's end reached the client before the
    # record was stored, so a retry sent at once got a 409 instead of the replay.
    store = proxy.app[STORE]
    finish, stored, saw_done = store.idempotency_finish, asyncio.Event(), asyncio.Event()

    async def finish_after_the_client_read_the_last_event(*args: Any, **kwargs: Any) -> None:
        await asyncio.wait_for(saw_done.wait(), timeout=30)  # lets the client read on
        await finish(*args, **kwargs)
        stored.set()

    monkeypatch.setattr(store, "idempotency_finish", finish_after_the_client_read_the_last_event)
    body = {**CHAT, "stream": True}
    received = b""
    async with proxy.http() as http:
        async with http.stream(
            "POST", "/v1/chat/completions", json=body, headers=keyed("at-once")
        ) as first:
            async for chunk in first.aiter_raw():
                received += chunk
                if b"data: [DONE]" in received:
                    saw_done.set()
            stored_before_the_end = stored.is_set()
    assert b"data: [DONE]" in received
    assert stored_before_the_end
    replayed = await post(proxy, "/v1/chat/completions", body, "at-once")
    assert replayed.headers["Idempotent-Replayed"] == "true"
    assert replayed.content == received
