"""Chaos: a provider that misbehaves in every way we know, behind every flow.

Flows: stateless chat, threaded chat (X-Thread-Id), stored Responses, and the same with a
ledger-guarded tenant. Faults: wrong-shaped answers, a 200 that is not JSON, a body cut
mid-way, 500 and 429 storms, streams that are truncated, cut, carry garbage or malformed
events, and a huge single line. Each case asserts: no 5xx but the documented ones (502 /
504 from the proxy, or the provider's own status relayed after bounded retries), an
error in OpenAI's shape, a stream that ends with one clean error event, nothing
committed to the store, and a proxy that still serves the next request.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from proxy.fake_provider import (
    Reply,
    chat_completion,
    chat_stream_frames,
    response_object,
    response_stream_frames,
)
from proxy.server.state import SETTINGS
from proxy.sse import SSEDecoder, encode_event, encode_json_event
from tests.server.conftest import TENANT_KEY, Proxy

GUARDED_POLICY = """
tools:
  refund_order:
    side_effect: true
    idempotency_key: "refund:{{order_id}}"
"""
PROXY_ERRORS = {502, 504}


@dataclass(frozen=True)
class Flow:
    family: str  # "chat" | "responses"
    path: str
    stateful: bool
    guarded: bool = False
    headers: dict[str, str] = field(default_factory=dict)

    def body(self, stream: bool) -> dict[str, Any]:
        if self.family == "chat":
            body: dict[str, Any] = {"messages": [{"role": "user", "content": "Refund order 7."}]}
        else:
            body = {"input": "Refund order 7."}
            if not self.stateful:
                body["store"] = False
        return {"model": "gpt-4o-mini", **body, "stream": stream}


FLOWS = {
    "stateless-chat": Flow("chat", "/v1/chat/completions", stateful=False),
    "threaded-chat": Flow(
        "chat", "/v1/chat/completions", stateful=True, headers={"X-Thread-Id": "t-chaos"}
    ),
    "stateless-responses": Flow("responses", "/v1/responses", stateful=False),
    "stored-responses": Flow("responses", "/v1/responses", stateful=True),
    "guarded-chat": Flow("chat", "/v1/chat/completions", stateful=False, guarded=True),
    "guarded-threaded-chat": Flow(
        "chat",
        "/v1/chat/completions",
        stateful=True,
        guarded=True,
        headers={"X-Thread-Id": "t-chaos"},
    ),
    "guarded-stored-responses": Flow("responses", "/v1/responses", stateful=True, guarded=True),
}


# -- what a well-behaved provider would have sent ---------------------------------------------


def good_answer(flow: Flow) -> dict[str, Any]:
    body = flow.body(stream=False)
    if flow.family == "chat":
        return chat_completion(body, Reply(text="Refunded order 7."))
    return response_object(body, Reply(text="Refunded order 7."))


def good_frames(flow: Flow) -> list[bytes]:
    body = flow.body(stream=True)
    if flow.family == "chat":
        return chat_stream_frames(body, good_answer(flow))
    return response_stream_frames(body, good_answer(flow))


def wrong_event(flow: Flow) -> bytes:
    if flow.family == "chat":
        return encode_json_event({"id": "c", "object": "chat.completion.chunk", "choices": "x"})
    return encode_json_event({"type": "response.completed", "response": 5}, "response.completed")


def empty_final_event(flow: Flow) -> bytes:
    if flow.family == "chat":
        return encode_json_event({"id": "c", "choices": [{"index": 0, "delta": 7}]})
    return encode_json_event({"type": "response.completed", "response": {}}, "response.completed")


# -- faults: each gives the provider's script for one request ---------------------------------

Fault = Callable[[Flow], list[Reply]]

NON_STREAM_FAULTS: dict[str, Fault] = {
    "choices-not-array": lambda f: [Reply(body={"choices": "x"})],
    "choices-of-null": lambda f: [Reply(body={"choices": [None]})],
    "tool-calls-not-array": lambda f: [
        Reply(body={"choices": [{"index": 0, "message": {"role": "assistant", "tool_calls": 3}}]})
    ],
    "output-not-array": lambda f: [Reply(body={"output": 5})],
    "output-of-null": lambda f: [Reply(body={"output": [None]})],
    "empty-object": lambda f: [Reply(body={})],
    "not-json": lambda f: [Reply(raw=b'{"id": "chatcmpl-1", "choices": [')],
    "json-but-a-list": lambda f: [Reply(raw=b"[1, 2, 3]")],
    "body-cut-mid-way": lambda f: [  # every attempt: the proxy retries a cut body
        Reply(raw=json.dumps(good_answer(f)).encode(), disconnect_after=20) for _ in range(5)
    ],
    "500-storm": lambda f: [Reply(status=500) for _ in range(5)],
    "429-storm": lambda f: [Reply(status=429, retry_after="0") for _ in range(5)],
}

STREAM_FAULTS: dict[str, Fault] = {
    "truncated-at-eof": lambda f: [Reply(frames=good_frames(f)[:3])],
    "connection-dropped": lambda f: [Reply(text="a b c d e f g h", disconnect_after=3)],
    "garbage-data-line": lambda f: [
        Reply(frames=[*good_frames(f)[:2], b"data: {not json at all\n\n", *good_frames(f)[2:]])
    ],
    "data-not-an-object": lambda f: [Reply(frames=[*good_frames(f)[:2], b"data: 42\n\n"])],
    "wrong-shaped-event": lambda f: [Reply(frames=[*good_frames(f)[:2], wrong_event(f)])],
    "empty-final-answer": lambda f: [Reply(frames=[*good_frames(f)[:2], empty_final_event(f)])],
    "huge-garbage-line": lambda f: [
        Reply(frames=[*good_frames(f)[:2], b"data: " + b"z" * 5_000_000 + b"\n\n"])
    ],
    "huge-line-then-eof": lambda f: [
        Reply(frames=[*good_frames(f)[:2], encode_event(json.dumps({"pad": "p" * 5_000_000}))])
    ],
}


# -- the checks ---------------------------------------------------------------------------------


async def send(proxy: Proxy, flow: Flow, stream: bool) -> httpx.Response:
    headers = {"Authorization": f"Bearer {TENANT_KEY}", **flow.headers}
    async with proxy.http() as http:
        return await http.post(flow.path, json=flow.body(stream), headers=headers)


def assert_openai_error(response: httpx.Response) -> dict[str, Any]:
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    return dict(error)


def stream_events(body: bytes) -> list[tuple[str | None, str]]:
    decoder = SSEDecoder()
    return [(e.event, e.data) for e in [*decoder.feed(body), *decoder.flush()]]


def assert_ends_with_one_error_event(flow: Flow, body: bytes, request_id: str) -> None:
    events = stream_events(body)
    assert events, "the stream sent nothing"
    name, data = events[-1]
    payload = json.loads(data)
    error = payload["error"]
    assert error["code"] in ("bad_upstream_answer", "upstream_stream_error"), error
    assert error["message"].endswith(f"(request id {request_id})."), error
    if flow.family == "responses":
        assert name == "error" and payload["type"] == "error"
    errors = [d for _, d in events if '"error"' in d and "upstream" in d]
    assert len(errors) == 1, "exactly one error event, at the end"
    assert all(data != "[DONE]" for _, data in events)
    assert all(name != "response.completed" for name, _ in events)


def store_rows(proxy: Proxy) -> dict[str, Any]:
    path = proxy.app[SETTINGS].store_url.removeprefix("sqlite:///")  # type: ignore[index]
    with sqlite3.connect(path) as db:
        return {
            "items": db.execute("SELECT count(*) FROM items").fetchone()[0],
            "responses": [r[0] for r in db.execute("SELECT status FROM responses")],
            "ledger": db.execute("SELECT count(*) FROM ledger").fetchone()[0],
        }


async def assert_nothing_committed(proxy: Proxy, flow: Flow) -> None:
    rows = store_rows(proxy)
    for _ in range(100):  # a stored turn is marked incomplete right after the stream ends
        if "in_progress" not in rows["responses"]:
            break
        await asyncio.sleep(0.02)
        rows = store_rows(proxy)
    assert rows["items"] == 0
    assert rows["ledger"] == 0
    if flow.family == "responses" and flow.stateful:
        assert rows["responses"] == ["incomplete"]
    else:
        assert rows["responses"] == []


async def assert_still_serving(proxy: Proxy, flow: Flow) -> None:
    proxy.provider.script.clear()
    response = await send(proxy, flow, stream=False)
    assert response.status_code == 200, response.text


async def chaos_proxy(make_proxy: Any, flow: Flow) -> Proxy:
    proxy: Proxy = await make_proxy(acme_extra=GUARDED_POLICY if flow.guarded else "")
    return proxy


# -- the matrix ----------------------------------------------------------------------------------


@pytest.mark.parametrize("fault", NON_STREAM_FAULTS)
@pytest.mark.parametrize("flow", FLOWS)
async def test_a_faulty_answer_is_a_clean_error_and_commits_nothing(
    make_proxy, flow: str, fault: str
) -> None:
    chosen = FLOWS[flow]
    proxy = await chaos_proxy(make_proxy, chosen)
    script = NON_STREAM_FAULTS[fault](chosen)
    proxy.provider.script.extend(script)
    response = await send(proxy, chosen, stream=False)
    provider_statuses = {reply.status for reply in script if reply.status >= 400}
    assert response.status_code in PROXY_ERRORS | provider_statuses, response.text
    error = assert_openai_error(response)
    if response.status_code == 502 and not fault.startswith("body-cut"):
        assert error["code"] == "bad_upstream_answer"
        assert "provider's answer is malformed" in error["message"]
    await assert_nothing_committed(proxy, chosen)
    await assert_still_serving(proxy, chosen)


@pytest.mark.parametrize("fault", STREAM_FAULTS)
@pytest.mark.parametrize("flow", FLOWS)
async def test_a_faulty_stream_ends_with_one_error_event_and_commits_nothing(
    make_proxy, flow: str, fault: str
) -> None:
    chosen = FLOWS[flow]
    proxy = await chaos_proxy(make_proxy, chosen)
    proxy.provider.script.extend(STREAM_FAULTS[fault](chosen))
    response = await send(proxy, chosen, stream=True)
    assert response.status_code == 200  # the headers went out before the fault
    request_id = response.headers["x-threadkeeper-request-id"]
    assert_ends_with_one_error_event(chosen, response.content, request_id)
    await assert_nothing_committed(proxy, chosen)
    await assert_still_serving(proxy, chosen)


@pytest.mark.parametrize("flow", FLOWS)
async def test_ignorable_garbage_lines_do_not_break_a_stream(make_proxy, flow: str) -> None:
    # Lines that are not `data:` fields are comments or unknown fields: SSE ignores them.
    chosen = FLOWS[flow]
    proxy = await chaos_proxy(make_proxy, chosen)
    frames = good_frames(chosen)
    noisy = [frames[0], b": keep-alive\n\n", b"garbage without a colon\n", *frames[1:]]
    proxy.provider.script.append(Reply(frames=noisy))
    response = await send(proxy, chosen, stream=True)
    assert response.status_code == 200
    assert "upstream" not in response.text
    assert "Refunded" in response.text
    rows = store_rows(proxy)
    assert rows["items"] == (2 if chosen.stateful else 0)


async def test_a_storm_of_faults_leaves_the_proxy_serving(make_proxy) -> None:
    flow = FLOWS["stored-responses"]
    proxy = await chaos_proxy(make_proxy, flow)
    statuses = []
    for name, fault in NON_STREAM_FAULTS.items():
        proxy.provider.script[:] = fault(flow)
        statuses.append((name, (await send(proxy, flow, stream=False)).status_code))
    assert all(status in {502, 504, 500, 429} for _, status in statuses), statuses
    assert set(store_rows(proxy)["responses"]) == {"incomplete"}
    await assert_still_serving(proxy, flow)
    assert store_rows(proxy)["items"] == 2


@pytest.mark.parametrize("flow", FLOWS)
async def test_a_stream_ending_without_its_final_blank_line_is_whole(make_proxy, flow: str) -> None:
    # Some compatible servers stop right after the last `data:` line; the relays flush it.
    chosen = FLOWS[flow]
    proxy = await chaos_proxy(make_proxy, chosen)
    frames = good_frames(chosen)
    proxy.provider.script.append(Reply(frames=[*frames[:-1], frames[-1].removesuffix(b"\n")]))
    response = await send(proxy, chosen, stream=True)
    names = [name for name, _ in stream_events(response.content)]
    datas = [data for _, data in stream_events(response.content)]
    assert "upstream" not in response.text
    assert datas[-1] == "[DONE]" if chosen.family == "chat" else names[-1] == "response.completed"
    assert store_rows(proxy)["items"] == (2 if chosen.stateful else 0)
