"""SSE decoding per the WHATWG rules, encoding, and the stream accumulators."""

from __future__ import annotations

import itertools
import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from proxy.core.answers import BadAnswer
from proxy.sse import (
    DONE,
    ChatStreamAccumulator,
    EventFramer,
    EventTooLarge,
    ResponsesStreamAccumulator,
    SSEDecoder,
    SSEEvent,
    encode_event,
    encode_json_event,
    stream_finished,
)

STREAM = (
    ": keep-alive comment\n"
    "event: response.output_text.delta\n"
    'data: {"delta": "héllo"}\n'
    "id: 7\n"
    "\n"
    "data: line one\n"
    "data: line two\n"
    "\n"
    "data:no-space\n"
    "data\n"
    "retry: 3000\n"
    "\n"
    "event: ignored-without-data\n"
    "\n"
    "data: [DONE]\n"
    "\n"
).encode()

EXPECTED = [
    SSEEvent("response.output_text.delta", '{"delta": "héllo"}', id="7"),
    SSEEvent(None, "line one\nline two", id="7"),
    SSEEvent(None, "no-space\n", id="7", retry=3000),
    SSEEvent(None, DONE, id="7"),
]


def decode_all(chunks: list[bytes]) -> list[SSEEvent]:
    decoder = SSEDecoder()
    events = [event for chunk in chunks for event in decoder.feed(chunk)]
    return events + decoder.flush()


def test_whole_stream_decodes_to_the_expected_events() -> None:
    assert decode_all([STREAM]) == EXPECTED


def test_byte_at_a_time_equals_whole() -> None:
    # Splits every multi-byte UTF-8 sequence ("é") and every line break.
    assert decode_all([STREAM[i : i + 1] for i in range(len(STREAM))]) == EXPECTED


@given(st.lists(st.integers(min_value=0, max_value=len(STREAM)), max_size=20))
def test_any_chunking_equals_whole(cuts: list[int]) -> None:
    bounds = [0, *sorted(cuts), len(STREAM)]
    chunks = [STREAM[a:b] for a, b in itertools.pairwise(bounds)]
    assert decode_all(chunks) == EXPECTED


def test_crlf_and_cr_line_endings_even_split_across_chunks() -> None:
    for newline in (b"\r\n", b"\r"):
        stream = STREAM.replace(b"\n", newline)
        assert decode_all([stream]) == EXPECTED
        assert decode_all([stream[i : i + 1] for i in range(len(stream))]) == EXPECTED


def test_cr_then_lf_in_the_next_chunk_is_one_line_break() -> None:
    assert decode_all([b"data: a\r", b"\n\r", b"\n"]) == [SSEEvent(None, "a")]
    # CR LF LF is two breaks: the event is dispatched, not merged with the next one.
    assert decode_all([b"data: a\r", b"\n", b"\ndata: b\n\n"]) == [
        SSEEvent(None, "a"),
        SSEEvent(None, "b"),
    ]


def test_a_leading_byte_order_mark_is_dropped() -> None:
    assert decode_all([b"\xef\xbb", b"\xbfdata: x\n\n"]) == [SSEEvent(None, "x")]


def test_events_are_dispatched_only_on_a_blank_line_until_flush() -> None:
    decoder = SSEDecoder()
    assert decoder.feed(b"data: [DONE]\n") == []
    assert decoder.flush() == [SSEEvent(None, DONE)]


def test_only_one_space_after_the_colon_is_stripped() -> None:
    assert decode_all([b"data:  two spaces\n\n"]) == [SSEEvent(None, " two spaces")]


def test_an_invalid_retry_is_ignored() -> None:
    assert decode_all([b"retry: 1s\ndata: x\n\n"]) == [SSEEvent(None, "x")]


def test_encode_event_round_trips_through_the_decoder() -> None:
    frame = encode_event("first\nsecond\r\nthird", event="message")
    assert frame == b"event: message\ndata: first\ndata: second\ndata: third\n\n"
    assert decode_all([frame]) == [SSEEvent("message", "first\nsecond\nthird")]
    assert encode_event(DONE) == b"data: [DONE]\n\n"


def test_event_json_parses_data_and_knows_done() -> None:
    assert SSEEvent(None, '{"a": [1]}').json() == {"a": [1]}
    assert SSEEvent(None, DONE).json() is None


# --- Chat -------------------------------------------------------------------------------


def chunk(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> dict[str, Any]:
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 1700000000,
        "model": "gpt-4o-mini",
        "system_fingerprint": "fp_x",
        "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
        **extra,
    }


def call_delta(index: int, **fields: Any) -> dict[str, Any]:
    return {"tool_calls": [{"index": index, **fields}]}


def test_chat_text_deltas_accumulate_into_one_message() -> None:
    acc = ChatStreamAccumulator()
    acc.feed(chunk({"role": "assistant", "content": ""}))
    for piece in ["Hel", "lo", " there"]:
        acc.feed(chunk({"content": piece}))
    acc.feed(chunk({}, finish="stop"))
    usage = {"prompt_tokens": 9, "completion_tokens": 3, "total_tokens": 12}
    acc.feed({**chunk({}), "choices": [], "usage": usage})
    assert acc.result() == {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 1700000000,
        "model": "gpt-4o-mini",
        "system_fingerprint": "fp_x",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "Hello there", "refusal": None},
                "logprobs": None,
                "finish_reason": "stop",
            }
        ],
        "usage": usage,
    }


def test_chat_parallel_tool_call_argument_deltas_accumulate_by_index() -> None:
    acc = ChatStreamAccumulator()
    acc.feed(chunk({"role": "assistant", "content": None}))
    acc.feed(chunk(call_delta(0, id="call_a", type="function", function={"name": "get_w"})))
    acc.feed(chunk(call_delta(0, function={"arguments": '{"ci'})))
    acc.feed(chunk(call_delta(1, id="call_b", type="function", function={"name": "refund"})))
    acc.feed(chunk(call_delta(0, function={"arguments": 'ty": "Paris"}'})))
    acc.feed(chunk(call_delta(1, function={"arguments": '{"order_id": 7}'})))
    acc.feed(chunk({}, finish="tool_calls"))
    calls = acc.tool_calls()
    assert calls == [
        {
            "id": "call_a",
            "type": "function",
            "function": {"name": "get_w", "arguments": '{"city": "Paris"}'},
        },
        {
            "id": "call_b",
            "type": "function",
            "function": {"name": "refund", "arguments": '{"order_id": 7}'},
        },
    ]
    choice = acc.result()["choices"][0]
    assert choice["message"]["content"] is None
    assert choice["message"]["tool_calls"] == calls
    assert choice["finish_reason"] == "tool_calls"
    assert acc.result()["usage"] is None


def test_chat_refusal_and_multiple_choices() -> None:
    acc = ChatStreamAccumulator()
    acc.feed(chunk({"role": "assistant", "refusal": "I can"}))
    acc.feed(chunk({"refusal": "not."}, finish="stop"))
    second = chunk({"role": "assistant", "content": "B"}, finish="stop")
    second["choices"][0]["index"] = 1
    acc.feed(second)
    first, other = acc.result()["choices"]
    assert first["message"]["refusal"] == "I cannot."
    assert first["message"]["content"] is None
    assert other["message"]["content"] == "B"
    assert acc.tool_calls(choice_index=5) == []


# --- Responses ----------------------------------------------------------------------------


def responses_events(text: str, args: str) -> list[tuple[str, dict[str, Any]]]:
    base = {"id": "resp_1", "object": "response", "status": "in_progress", "output": []}
    msg = {"id": "msg_1", "type": "message", "role": "assistant", "status": "in_progress"}
    call = {
        "id": "fc_1",
        "type": "function_call",
        "call_id": "call_1",
        "name": "refund",
        "arguments": "",
        "status": "in_progress",
    }
    events: list[tuple[str, dict[str, Any]]] = [
        ("response.created", {"response": base}),
        ("response.in_progress", {"response": base}),
        ("response.output_item.added", {"output_index": 0, "item": {**msg, "content": []}}),
        (
            "response.content_part.added",
            {"output_index": 0, "content_index": 0, "part": {"type": "output_text", "text": ""}},
        ),
    ]
    for piece in (text[:3], text[3:]):
        events.append(
            (
                "response.output_text.delta",
                {"output_index": 0, "content_index": 0, "delta": piece},
            )
        )
    events.append(("response.output_item.added", {"output_index": 1, "item": call}))
    for piece in (args[:5], args[5:]):
        events.append(
            ("response.function_call_arguments.delta", {"output_index": 1, "delta": piece})
        )
    return events


def test_responses_deltas_rebuild_items_when_the_stream_is_cut() -> None:
    acc = ResponsesStreamAccumulator()
    for kind, data in responses_events("Hello!", '{"order_id": 7}'):
        acc.feed(kind, data)
    message, call = acc.item(0), acc.item(1)
    assert message is not None and message["content"][0]["text"] == "Hello!"
    assert call is not None and call["arguments"] == '{"order_id": 7}'
    assert acc.item(2) is None
    # No item is done yet: nothing finished to record, the snapshot still says so.
    assert acc.output_items() == []
    result = acc.result()
    assert result is not None and result["status"] == "in_progress"
    assert result["output"] == []
    assert acc.usage() is None and acc.error() is None


def test_responses_done_items_are_kept_in_output_index_order() -> None:
    acc = ResponsesStreamAccumulator()
    events = responses_events("Hello!", '{"order_id": 7}')
    for kind, data in events:
        acc.feed(kind, data)
    acc.feed(
        "response.function_call_arguments.done",
        {"output_index": 1, "name": "refund", "arguments": '{"order_id": 7}'},
    )
    acc.feed("response.output_item.done", {"output_index": 1, "item": _done_call()})
    acc.feed("response.output_text.done", {"output_index": 0, "content_index": 0, "text": "Hello!"})
    acc.feed("response.output_item.done", {"output_index": 0, "item": _done_message("Hello!")})
    assert [item["type"] for item in acc.output_items()] == ["message", "function_call"]
    assert acc.output_items()[1]["arguments"] == '{"order_id": 7}'
    result = acc.result()
    assert result is not None and result["output"] == acc.output_items()


def test_responses_completed_event_is_the_result_and_carries_usage() -> None:
    acc = ResponsesStreamAccumulator()
    for kind, data in responses_events("Hi", "{}"):
        acc.feed(kind, data)
    usage = {"input_tokens": 20, "output_tokens": 4, "total_tokens": 24}
    final = {
        "id": "resp_1",
        "object": "response",
        "status": "completed",
        "output": [_done_message("Hi"), _done_call()],
        "usage": usage,
    }
    acc.feed("response.completed", {"response": final})
    assert acc.result() == final
    assert acc.usage() == usage


def test_responses_errors_from_error_event_and_failed_response() -> None:
    acc = ResponsesStreamAccumulator()
    acc.feed(
        "error",
        {"type": "error", "code": "server_error", "message": "boom", "param": None},
    )
    assert acc.error() == {"code": "server_error", "message": "boom", "param": None}
    failed = ResponsesStreamAccumulator()
    error = {"code": "server_error", "message": "The model failed."}
    failed.feed("response.failed", {"response": {"status": "failed", "error": error}})
    assert failed.error() == error
    assert ResponsesStreamAccumulator().result() is None


def test_decoder_and_responses_accumulator_together() -> None:
    frames = b"".join(
        encode_event(json.dumps({"type": kind, **data}), event=kind)
        for kind, data in responses_events("Hello!", "{}")
    )
    acc = ResponsesStreamAccumulator()
    for event in decode_all([frames[i : i + 7] for i in range(0, len(frames), 7)]):
        acc.feed(event.event or "", event.json())
    acc.feed("response.output_item.done", {"output_index": 0, "item": _done_message("Hello!")})
    assert acc.output_items() == [_done_message("Hello!")]


def _done_message(text: str) -> dict[str, Any]:
    return {
        "id": "msg_1",
        "type": "message",
        "role": "assistant",
        "status": "completed",
        "content": [{"type": "output_text", "text": text, "annotations": []}],
    }


def _done_call() -> dict[str, Any]:
    return {
        "id": "fc_1",
        "type": "function_call",
        "call_id": "call_1",
        "name": "refund",
        "arguments": '{"order_id": 7}',
        "status": "completed",
    }


class _CountingPattern:
    """Stands in for the decoder's line-break pattern and counts the characters it scans."""

    def __init__(self, pattern: Any) -> None:
        self.pattern = pattern
        self.scanned = 0

    def split(self, text: str) -> list[str]:
        self.scanned += len(text)
        result: list[str] = self.pattern.split(text)
        return result


def test_decoder_scans_a_long_line_once(monkeypatch) -> None:
    # Regression (issue 8, item 14): the unterminated line was re-split on every chunk, so
    # one 20 MB `data:` line cost minutes. The work must be linear in the bytes fed.
    import proxy.sse

    counting = _CountingPattern(proxy.sse._LINE_BREAK)
    monkeypatch.setattr(proxy.sse, "_LINE_BREAK", counting)
    body = b"data: " + b"x" * 2_000_000 + b"\n\n"
    decoder = SSEDecoder()
    events = [e for i in range(0, len(body), 16384) for e in decoder.feed(body[i : i + 16384])]
    assert [len(e.data) for e in events] == [2_000_000]
    assert counting.scanned <= 2 * len(body)  # quadratic re-scanning was ~60x this


def test_a_20_mb_line_split_in_small_chunks_decodes_whole() -> None:
    line = '{"a": "' + "y" * 20_000_000 + '"}'
    body = f"data: {line}\n\ndata: [DONE]\n".encode()
    decoder = SSEDecoder()
    events = [e for i in range(0, len(body), 65536) for e in decoder.feed(body[i : i + 65536])]
    events += decoder.flush()  # the stream ended right after the sentinel, no blank line
    assert [e.data for e in events] == [line, "[DONE]"]


def test_framer_hands_out_whole_events_only() -> None:
    framer = EventFramer()
    assert framer.feed(b"data: 1\n\ndata: 2") == b"data: 1\n\n"
    assert framer.feed(b"2\r") == b""
    assert framer.feed(b"\n\r\ndata: 3") == b"data: 22\r\n\r\n"  # a boundary across chunks
    assert framer.feed(b"\n") == b""
    assert framer.rest() == b"data: 3\n"  # the end of a stream without its blank line
    assert framer.rest() == b""


@pytest.mark.parametrize("newline", ["\n", "\r\n", "\r"])
def test_framer_relays_whole_events_only_however_the_stream_is_cut(newline: str) -> None:
    stream = "".join(f'data: {{"n": {i}}}{newline}{newline}' for i in range(3)).encode()
    for cut in range(len(stream) + 1):
        framer = EventFramer(limit=1000)
        out = [framer.feed(stream[:cut]), framer.feed(stream[cut:]), framer.rest()]
        assert b"".join(out) == stream
        decoder = SSEDecoder()
        for part in out[:2]:  # what is relayed before the end is whole events
            assert len(decoder.feed(part)) == part.count(b"data:"), (cut, part)


def test_one_event_above_the_framers_limit_is_refused_however_it_is_cut() -> None:
    framer = EventFramer(limit=100)
    assert framer.feed(b"data: small\n\n") == b"data: small\n\n"
    framer.feed(b"data: " + b"x" * 60)
    with pytest.raises(EventTooLarge) as info:
        framer.feed(b"x" * 60)
    assert info.value.limit == 100
    assert EventFramer().feed(b"data: " + b"x" * 10_000) == b""  # no limit: held


@given(st.lists(st.binary(max_size=40), max_size=20))
def test_framer_loses_and_reorders_nothing(chunks: list[bytes]) -> None:
    framer = EventFramer()
    out = b"".join(framer.feed(chunk) for chunk in chunks) + framer.rest()
    assert out == b"".join(chunks)


def test_accumulators_say_when_a_stream_is_finished() -> None:
    chat = ChatStreamAccumulator()
    chat.feed_event(SSEEvent(None, json.dumps({"choices": [{"index": 0, "delta": {}}]})))
    chat.feed_event(SSEEvent(None, DONE))
    assert chat.ended and not chat.finished  # [DONE] without a finish_reason
    responses = ResponsesStreamAccumulator()
    responses.feed_event(SSEEvent("response.created", json.dumps({"response": {"output": []}})))
    assert not responses.ended and not responses.finished
    done = {"type": "response.completed", "response": {"output": [], "status": "completed"}}
    responses.feed_event(SSEEvent(None, json.dumps(done)))
    assert responses.ended and responses.finished


def test_events_that_are_not_json_objects_are_bad_answers() -> None:
    for data in ("{not json", "42", '"text"'):
        with pytest.raises(BadAnswer):
            ChatStreamAccumulator().feed_event(SSEEvent(None, data))
    ChatStreamAccumulator().feed_event(SSEEvent(None, ""))  # empty data: nothing to read


def test_stream_finished_judges_a_whole_body() -> None:
    chunk = {"choices": [{"index": 0, "delta": {"content": "hi"}, "finish_reason": "stop"}]}
    whole = encode_json_event(chunk) + encode_event(DONE)
    assert stream_finished("chat", whole)
    assert not stream_finished("chat", encode_json_event(chunk))  # cut before [DONE]
    assert not stream_finished("chat", whole + b"data: {bad\n\n")
    assert not stream_finished("responses", encode_json_event({"type": "response.created"}))
