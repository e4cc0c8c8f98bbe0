"""The stream relay's transformers (proxy/server/relay.py, holdback.py), driven with
plain event lists: no socket, no provider, no store."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import pytest

from proxy.core.answers import BadAnswer
from proxy.core.ledger import ToolCall, ToolRule
from proxy.server.api import CHAT, RESPONSES, ApiShape
from proxy.server.errors import ApiError
from proxy.server.holdback import ChatHoldback, Guarded
from proxy.server.relay import Keep, Passthrough, Transformer, provider_answer, transformed
from proxy.sse import DONE, SSEDecoder, SSEEvent, encode_event


def chunk(delta: dict[str, Any], finish: str | None = None) -> SSEEvent:
    choice = {"index": 0, "delta": delta, "finish_reason": finish}
    data = {"id": "c1", "object": "chat.completion.chunk", "model": "m", "choices": [choice]}
    return SSEEvent(None, json.dumps(data))


CHAT_EVENTS = [
    chunk({"role": "assistant", "content": "Hi"}),
    chunk({}, "stop"),
    SSEEvent(None, DONE),
]
RESPONSE = {"id": "resp_up", "object": "response", "status": "completed", "output": []}
RESPONSES_EVENTS = [
    SSEEvent("response.created", json.dumps({"type": "response.created", "response": RESPONSE})),
    SSEEvent(
        "response.completed", json.dumps({"type": "response.completed", "response": RESPONSE})
    ),
]


async def drive(api: ApiShape, transformer: Transformer, events: Sequence[SSEEvent]) -> list[bytes]:
    frames: list[bytes] = []
    for event in events:
        frames += await transformed(api, transformer, event)
    return frames + await transformer.end()


def decoded(frames: Sequence[bytes]) -> list[SSEEvent]:
    decoder = SSEDecoder()
    return decoder.feed(b"".join(frames)) + decoder.flush()


class Recorder:
    """A keeper that records what it kept and rewrites ids like a stored turn."""

    def __init__(self) -> None:
        self.kept: list[dict[str, Any]] = []

    def rewrite(self, response: dict[str, Any]) -> dict[str, Any]:
        return {**response, "id": "resp_proxy"}

    async def keep(self, result: dict[str, Any], log: Any = None) -> None:
        self.kept.append(result)


async def test_passthrough_relays_the_providers_bytes_untouched() -> None:
    """The chunks are whole events already (UpstreamResponse frames them, tests/
    test_upstream.py); the relay decodes a chunk's events before passing its bytes, so a
    malformed event raises before any of it is written."""
    passthrough = Passthrough(CHAT)
    chunks = [encode_event(e.data) for e in CHAT_EVENTS]
    for chunk in chunks:
        for event in decoded([chunk]):
            assert await transformed(CHAT, passthrough, event) == []  # bytes go by `passed`
        assert passthrough.passed(chunk) == chunk
    assert await passthrough.end() == []
    assert passthrough.upstream.finished


async def test_a_passthrough_without_an_api_passes_raw_bytes() -> None:
    passthrough = Passthrough(None)
    assert passthrough.passed(b"not: an event") == b"not: an event"
    assert await passthrough.end() == []


async def test_keep_keeps_a_chat_answer_before_its_done_reaches_the_client() -> None:
    keeper = Recorder()
    frames = await drive(CHAT, Keep(CHAT, keeper), CHAT_EVENTS)
    assert keeper.kept[0]["choices"][0]["message"]["content"] == "Hi"
    assert keeper.kept[0]["id"] == "resp_proxy"
    assert decoded(frames)[-1].data == DONE


async def test_keep_rewrites_responses_snapshots_and_keeps_the_final_one() -> None:
    keeper = Recorder()
    frames = await drive(RESPONSES, Keep(RESPONSES, keeper), RESPONSES_EVENTS)
    ids = [json.loads(e.data)["response"]["id"] for e in decoded(frames)]
    assert ids == ["resp_proxy", "resp_proxy"]
    assert [k["id"] for k in keeper.kept] == ["resp_proxy"]


async def test_a_malformed_event_is_refused_before_the_transformer_sees_it() -> None:
    keeper = Recorder()
    with pytest.raises(BadAnswer):
        await drive(CHAT, Keep(CHAT, keeper), [SSEEvent(None, "{not json")])
    with pytest.raises(BadAnswer):
        await drive(CHAT, Keep(CHAT, keeper), [SSEEvent(None, json.dumps({"choices": "x"}))])
    assert keeper.kept == []


@dataclass(frozen=True)
class Decided:
    call: ToolCall
    output: dict[str, Any] | None

    @property
    def withheld(self) -> bool:
        return self.output is not None


class WithholdingGuard:
    """A ledger that has seen every `refund` before: each is withheld (no store)."""

    rules: ClassVar[dict[str, ToolRule]] = {"refund": ToolRule(side_effect=True)}
    max_replays = 0  # strip, never continue upstream

    def guarded(self, name: Any) -> bool:
        return name in self.rules

    async def judge_call(self, call: ToolCall, response_id: str | None) -> Decided:
        return Decided(call, {"role": "tool", "tool_call_id": call.call_id, "content": "done"})

    async def judge(self, calls: Sequence[ToolCall], response_id: str | None) -> list[Decided]:
        return [await self.judge_call(call, response_id) for call in calls]


async def test_the_chat_holdback_drops_a_withheld_call_and_finishes_with_stop() -> None:
    call = {"index": 0, "id": "call_1", "type": "function"}
    call["function"] = {"name": "refund", "arguments": '{"order": 7}'}
    events = [
        chunk({"role": "assistant", "content": None}),
        chunk({"tool_calls": [call]}),
        chunk({}, "tool_calls"),
        SSEEvent(None, DONE),
    ]
    guarded = Guarded(None, CHAT, WithholdingGuard(), {"model": "m", "messages": []})  # type: ignore[arg-type]
    frames = decoded(await drive(CHAT, ChatHoldback(guarded), events))
    assert b"call_1" not in b"".join(encode_event(e.data) for e in frames)
    finishes = [
        c["finish_reason"]
        for e in frames
        if e.data != DONE
        for c in json.loads(e.data)["choices"]
        if c.get("finish_reason")
    ]
    assert finishes == ["stop"] and frames[-1].data == DONE


def test_error_events_take_each_apis_shape() -> None:
    chat = decoded([CHAT.error_event("boom", "internal_error")])[0]
    assert chat.event is None and json.loads(chat.data)["error"]["code"] == "internal_error"
    responses = decoded([RESPONSES.error_event("boom", "internal_error")])[0]
    assert responses.event == "error" and json.loads(responses.data)["code"] == "internal_error"


ANSWER = {"id": "c1", "object": "chat.completion", "model": "m", "created": 1}
CHOICE = {"index": 0, "finish_reason": "stop", "message": {"role": "assistant"}}


@pytest.mark.parametrize(
    "value",
    ['"a\\ud800b"', '"\\ud83d\\ude00"', '"\\u00e9\\u0000"', "12345678901234567890123", "1e400"],
)
def test_an_answer_is_read_to_the_stdlibs_values(value: str) -> None:
    """Lone surrogates, integers beyond 64 bits, overflowing floats: what orjson reads
    differently or refuses reads as `json.loads` reads it (proxy/core/fastjson.py)."""
    text = json.dumps({**ANSWER, "choices": [CHOICE], "x_provider": "?"})
    text = text.replace('"?"', value)
    for body in (text.encode(), text.encode("utf-16"), b"\xef\xbb\xbf" + text.encode()):
        answer = provider_answer(CHAT, body)
        assert answer == json.loads(body)
        assert repr(answer) == repr(json.loads(body))  # an int stays an int, inf stays inf


@pytest.mark.parametrize("body", [b"", b"[" * 100_000, b'{"a": NaN', b"\xff{}"])
def test_an_answer_that_is_not_json_is_a_502(body: bytes) -> None:
    with pytest.raises(ApiError) as refused:
        provider_answer(CHAT, body)
    assert refused.value.status == 502
