"""The pure Responses <-> Chat Completions translation (proxy/core/chat_translate.py)."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from proxy.core.chat_translate import (
    ChatStream,
    cap_ignored,
    chat_answer,
    chat_request,
    refuses_field,
    with_cap_field,
)
from proxy.core.validate import ApiError

counter = itertools.count()


def ids(prefix: str) -> str:
    return f"{prefix}_{next(counter)}"


def call(call_id: str, name: str = "f") -> dict[str, Any]:
    return {"type": "function_call", "call_id": call_id, "name": name, "arguments": "{}"}


def output(call_id: str, text: str = "ok") -> dict[str, Any]:
    return {"type": "function_call_output", "call_id": call_id, "output": text}


def messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    result: list[dict[str, Any]] = chat_request({"model": "m", "input": items}, ids=ids)["messages"]
    return result


def test_a_run_of_calls_is_one_assistant_message_and_text_before_calls_joins_it() -> None:
    said = {"role": "assistant", "content": [{"type": "output_text", "text": "Let me look."}]}
    sent = messages(
        [
            {"role": "user", "content": "q"},
            {"type": "reasoning", "id": "rs_1", "summary": []},
            said,
            call("a"),
            call("b"),
            output("a"),
            output("b"),
            call("c"),
            output("c"),
        ]
    )
    assert [m["role"] for m in sent] == ["user", "assistant", "tool", "tool", "assistant", "tool"]
    assert sent[1]["content"] == "Let me look."
    assert [c["id"] for c in sent[1]["tool_calls"]] == ["a", "b"]
    assert [m.get("tool_call_id") for m in sent[2:]] == ["a", "b", None, "c"]


def test_image_and_file_parts_become_chat_parts() -> None:
    content = [
        {"type": "input_text", "text": "see"},
        {"type": "input_image", "image_url": "data:image/png;base64,AA", "detail": "low"},
        {"type": "input_file", "file_data": "data:application/pdf;base64,AA", "filename": "a.pdf"},
    ]
    assert messages([{"role": "user", "content": content}])[0]["content"] == [
        {"type": "text", "text": "see"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA", "detail": "low"}},
        {
            "type": "file",
            "file": {"file_data": "data:application/pdf;base64,AA", "filename": "a.pdf"},
        },
    ]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tools": [{"type": "web_search"}]}, "tools[0]"),
        ({"tools": [{"type": "custom", "name": "x"}]}, "tools[0]"),
        ({"tool_choice": {"type": "file_search"}}, "tool_choice"),
        ({"prompt": {"id": "pmpt_1"}}, "prompt"),
        ({"input": [{"type": "custom_tool_call", "call_id": "c", "input": ""}]}, "input[0]"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}]},
            "input[0].content[0].file_id",
        ),
        (
            {
                "input": [
                    {"role": "user", "content": [{"type": "input_file", "file_url": "https://x"}]}
                ]
            },
            "input[0].content[0].file_url",
        ),
    ],
)
def test_what_chat_cannot_carry_is_a_400_naming_it(body: dict[str, Any], param: str) -> None:
    with pytest.raises(ApiError) as caught:
        chat_request({"model": "m", "input": "x", **body}, ids=ids)
    assert caught.value.status == 400 and caught.value.param == param


def test_options_map_to_chat_names() -> None:
    sent = chat_request(
        {
            "model": "m",
            "input": "x",
            "tools": [{"type": "function", "name": "f", "strict": True}],
            "tool_choice": {
                "type": "allowed_tools",
                "mode": "required",
                "tools": [{"type": "function", "name": "f"}],
            },
            "text": {"format": {"type": "json_object"}, "verbosity": "low"},
            "max_output_tokens": 9,
            "top_logprobs": 2,
            "store": True,
            "include": ["reasoning.encrypted_content"],
            "stream": True,
        },
        ids=ids,
        max_tokens_field="max_completion_tokens",
    )
    assert sent == {
        "model": "m",
        "messages": [{"role": "user", "content": "x"}],
        "tools": [{"type": "function", "function": {"name": "f", "strict": True}}],
        "tool_choice": {
            "type": "allowed_tools",
            "allowed_tools": {
                "mode": "required",
                "tools": [{"type": "function", "function": {"name": "f"}}],
            },
        },
        "response_format": {"type": "json_object"},
        "verbosity": "low",
        "max_completion_tokens": 9,
        "logprobs": True,
        "top_logprobs": 2,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def completion(message: dict[str, Any], finish: str) -> dict[str, Any]:
    choice = {"index": 0, "finish_reason": finish, "message": {"role": "assistant", **message}}
    return {"id": "c", "created": 7, "model": "m", "choices": [choice]}


def test_a_refusal_filtered_by_content_is_incomplete_with_its_reason() -> None:
    answer = chat_answer(
        {"model": "m"}, completion({"content": None, "refusal": "No."}, "content_filter"),
        response_id="resp_1", ids=ids,
    )  # fmt: skip
    assert answer["status"] == "incomplete"
    assert answer["incomplete_details"] == {"reason": "content_filter"}
    assert answer["output"][0]["content"] == [{"type": "refusal", "refusal": "No."}]


def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
    return {
        "model": "m",
        "created": 1,
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    }


def test_a_stream_that_never_finished_ends_with_no_terminal_event() -> None:
    stream = ChatStream({"model": "m"}, response_id="resp_1", ids=ids)
    events = stream.chunk(chunk({"content": "Hel"}))
    assert [e["type"] for e in events][-1] == "response.output_text.delta"
    assert stream.done() == []  # the relay's cut-off check ends it with an error event


def test_text_after_a_call_opens_a_new_message_and_numbers_keep_rising() -> None:
    stream = ChatStream({"model": "m"}, response_id="resp_1", ids=ids)
    events = stream.chunk(chunk({"content": "a"}))
    opening = {"index": 0, "id": "call_1", "function": {"name": "f", "arguments": "{}"}}
    events += stream.chunk(chunk({"tool_calls": [opening]}))
    events += stream.chunk(chunk({"content": "b"}, "stop"))
    events += stream.done()
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    final = events[-1]["response"]
    assert [i["type"] for i in final["output"]] == ["message", "function_call", "message"]
    added = [e["output_index"] for e in events if e["type"] == "response.output_item.added"]
    assert added == [0, 1, 2]


def test_a_provider_error_chunk_is_the_responses_error_event() -> None:
    stream = ChatStream({"model": "m"}, response_id="resp_1", ids=ids)
    stream.chunk(chunk({"content": "a"}))
    events = stream.chunk({"error": {"message": "overloaded", "type": "server_error"}})
    assert events[-1]["type"] == "error" and events[-1]["message"] == "overloaded"
    assert events[-1]["error"]["message"] == "overloaded"
    assert stream.chunk(chunk({"content": "late"})) == [] and stream.done() == []


def test_reasoning_then_text_then_reasoning_are_three_items_in_order() -> None:
    stream = ChatStream({"model": "m"}, response_id="resp_1", ids=ids)
    events = stream.chunk(chunk({"reasoning_content": "think"}))
    events += stream.chunk(chunk({"content": "say"}))
    events += stream.chunk(chunk({"reasoning": "more"}, "stop"))
    events += stream.done()
    final = events[-1]["response"]
    assert [i["type"] for i in final["output"]] == ["reasoning", "message", "reasoning"]
    assert final["output"][2]["content"] == [{"type": "reasoning_text", "text": "more"}]
    done = [e for e in events if e["type"] == "response.reasoning_text.done"]
    assert [(e["output_index"], e["text"]) for e in done] == [(0, "think"), (2, "more")]


def test_the_output_cap_goes_as_the_specs_field_unless_told_otherwise() -> None:
    body = {"model": "m", "input": "x", "max_output_tokens": 7}
    assert chat_request(body, ids=ids)["max_completion_tokens"] == 7
    sent = chat_request(body, ids=ids, max_tokens_field="max_tokens")
    assert sent["max_tokens"] == 7 and "max_completion_tokens" not in sent
    assert with_cap_field(sent, "max_completion_tokens") == {
        "model": "m",
        "messages": [{"role": "user", "content": "x"}],
        "max_completion_tokens": 7,
    }


OPENAI_REFUSAL = (
    b'{"error": {"message": "Unsupported parameter: \'max_tokens\' is not supported with this'
    b' model. Use \'max_completion_tokens\' instead.", "type": "invalid_request_error",'
    b' "param": "max_tokens", "code": "unsupported_parameter"}}'
)
VLLM_REFUSAL = (
    b"{\"object\": \"error\", \"message\": \"[{'type': 'extra_forbidden', 'loc': ('body',"
    b" 'max_completion_tokens'), 'msg': 'Extra inputs are not permitted', 'input':"
    b' 8192}]", "type": "BadRequestError", "param": null, "code": 400}'
)


@pytest.mark.parametrize(
    ("status", "body", "field", "refused"),
    [
        (400, OPENAI_REFUSAL, "max_tokens", True),
        (400, OPENAI_REFUSAL, "max_completion_tokens", False),  # it names the other
        (400, VLLM_REFUSAL, "max_completion_tokens", True),
        (
            422,
            b'{"detail": "Unknown field `max_completion_tokens`"}',
            "max_completion_tokens",
            True,
        ),
        (
            400,
            b'{"error": {"message": "\'max_tokens\' must be at most 4096."}}',
            "max_tokens",
            False,
        ),
        (400, b'{"error": {"message": "unsupported", "param": "messages"}}', "max_tokens", False),
        (500, OPENAI_REFUSAL, "max_tokens", False),
        (400, b"<html>Bad Request</html>", "max_tokens", False),
    ],
)
def test_a_refused_field_is_told_from_other_400s(
    status: int, body: bytes, field: str, refused: bool
) -> None:
    assert refuses_field(status, body, field) is refused


def test_an_answer_past_the_specs_cap_says_it_was_ignored() -> None:
    sent = {"max_completion_tokens": 5}
    assert cap_ignored(sent, {"output_tokens": 6})
    assert not cap_ignored(sent, {"output_tokens": 5})
    assert not cap_ignored({"max_tokens": 5}, {"output_tokens": 60})
    assert not cap_ignored(sent, None)
