"""The provider-answer checks (proxy/core/answers.py): what passes, and what is named."""

from __future__ import annotations

from typing import Any

import pytest

from proxy.core.answers import (
    BadAnswer,
    check_answer,
    check_chat_chunk,
    check_chat_completion,
    check_response,
    check_response_event,
)

CALL = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
MESSAGE = {"role": "assistant", "content": "hi", "refusal": None, "tool_calls": [CALL]}
COMPLETION = {"id": "c", "choices": [{"index": 0, "message": MESSAGE, "finish_reason": "stop"}]}
OUTPUT_TEXT = {"type": "output_text", "text": "hi"}
RESPONSE = {
    "id": "r",
    "status": "completed",
    "output": [
        {"type": "message", "role": "assistant", "content": [OUTPUT_TEXT]},
        {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}"},
    ],
    "usage": {"input_tokens": 1},
}


def test_well_formed_answers_pass_unchanged() -> None:
    assert check_chat_completion(COMPLETION) is COMPLETION
    assert check_response(RESPONSE) is RESPONSE
    assert check_answer("chat", COMPLETION) is COMPLETION
    assert check_answer("responses", RESPONSE) is RESPONSE


@pytest.mark.parametrize(
    ("answer", "named"),
    [
        ({"choices": "x"}, "'choices' is not an array"),
        ({}, "'choices' is not an array"),
        ([1], "the answer is not a JSON object"),
        ({"choices": [None]}, "'choices[0]' is not a JSON object"),
        ({"choices": [{"message": "hi"}]}, "'choices[0].message' is not a JSON object"),
        ({"choices": [{"message": {"content": 5}}]}, "'choices[0].message.content'"),
        ({"choices": [{"message": {"tool_calls": {}}}]}, "'choices[0].message.tool_calls'"),
        ({"choices": [{"message": {"tool_calls": [{"id": 1}]}}]}, "tool_calls[0].id'"),
        ({"choices": [{"index": -1, "message": {}}]}, "'choices[0].index'"),
        ({"choices": [], "usage": 3}, "'usage' is not a JSON object"),
    ],
)
def test_a_wrong_chat_completion_is_named(answer: Any, named: str) -> None:
    with pytest.raises(BadAnswer, match="malformed") as info:
        check_chat_completion(answer)
    assert named in str(info.value)


@pytest.mark.parametrize(
    ("answer", "named"),
    [
        ({"output": 5}, "'output' is not an array"),
        ({}, "'output' is not an array"),
        ({"output": [None]}, "'output[0]' is not a JSON object"),
        ({"output": [{"type": 3}]}, "'output[0].type' is not a string"),
        ({"output": [{"type": "function_call", "name": "f"}]}, "'output[0].call_id'"),
        ({"output": [{"type": "message", "content": "hi"}]}, "'output[0].content'"),
        ({"output": [], "status": 1}, "'status' is not a string"),
    ],
)
def test_a_wrong_response_is_named(answer: Any, named: str) -> None:
    with pytest.raises(BadAnswer) as info:
        check_response(answer)
    assert named in str(info.value)


def test_chat_chunks() -> None:
    delta = {"role": "assistant", "tool_calls": [{"index": 0, "function": {"arguments": "{"}}]}
    chunk = {"choices": [{"index": 0, "delta": delta, "finish_reason": None}]}
    assert check_chat_chunk(chunk) is chunk
    assert check_chat_chunk({"choices": [], "usage": {"prompt_tokens": 1}})
    for wrong in (
        {"choices": "x"},
        {"choices": [{"delta": 7}]},
        {"choices": [{"delta": {"content": ["a"]}}]},
        {"choices": [{"delta": {"tool_calls": [{"index": "0"}]}}]},
        {"choices": [{"delta": {"tool_calls": [{"function": {"name": 1}}]}}]},
        {"choices": [{"finish_reason": 1}]},
        5,
    ):
        with pytest.raises(BadAnswer):
            check_chat_chunk(wrong)


def test_responses_events() -> None:
    done = {"type": "response.completed", "response": RESPONSE}
    assert check_response_event("response.completed", done) is done
    assert check_response_event("response.created", {"response": {"output": []}})
    # A failed or incomplete response may come without output.
    assert check_response_event("response.failed", {"response": {"status": "failed"}})
    text = {"output_index": 0, "content_index": 0, "delta": "hi"}
    assert check_response_event("response.output_text.delta", text)
    arguments = {"output_index": 1, "arguments": "{}"}
    assert check_response_event("response.function_call_arguments.done", arguments)
    assert check_response_event("response.some_future_event", {"anything": [1]})
    for kind, wrong in (
        ("response.completed", {"response": 5}),
        ("response.completed", {"response": {}}),
        ("response.created", {}),
        ("response.output_item.added", {"output_index": 0, "item": None}),
        ("response.output_item.done", {"item": {"type": "message"}}),
        ("response.output_text.delta", {"output_index": 0, "content_index": 0, "delta": 1}),
        ("response.output_text.done", {"output_index": 0, "content_index": 0}),
        ("response.content_part.added", {"output_index": 0, "content_index": 0, "part": 1}),
        ("response.output_text.delta", {"output_index": "0", "content_index": 0}),
    ):
        with pytest.raises(BadAnswer):
            check_response_event(kind, wrong)
