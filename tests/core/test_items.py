"""The frozen item view over both APIs, and the byte-for-byte round trip."""

from __future__ import annotations

import dataclasses
import inspect
import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from proxy.core import items as items_module
from proxy.core.items import (
    CALL_KINDS,
    CALL_TYPES,
    MCP_KINDS,
    OUTPUT_TO_CALL_TYPE,
    Item,
    ResponsesInput,
    canonical_json,
    chat_from_items,
    chat_item,
    content_digest,
    is_pending_approval,
    items_from_chat,
    items_from_responses_input,
    message_text,
    pending_approvals,
    responses_input_from_items,
    responses_item,
)

# --- Chat Completions ----------------------------------------------------------------------


@pytest.mark.parametrize("role", ["system", "developer"])
def test_instruction_messages(role: str) -> None:
    item = chat_item({"role": role, "content": "Be brief."})
    assert (item.api, item.kind, item.role) == ("chat", "message", role)
    assert item.is_instruction and not item.is_user_message
    assert item.text() == "Be brief."


def test_user_message_with_parts() -> None:
    raw = {
        "role": "user",
        "name": "ana",
        "content": [
            {"type": "text", "text": "look"},
            {"type": "image_url", "image_url": {"url": "https://x/a.png"}},
            {"type": "text", "text": "here"},
        ],
    }
    item = chat_item(raw)
    assert item.kind == "message" and item.is_user_message and not item.is_instruction
    assert item.name == "ana"
    assert item.text() == "look\nhere"
    assert item.raw is raw


def test_plain_assistant_message() -> None:
    item = chat_item({"role": "assistant", "content": "Hi!", "tool_calls": []})
    assert (item.kind, item.call_ids) == ("message", ())


def test_assistant_parallel_tool_calls() -> None:
    raw = {
        "role": "assistant",
        "content": "Checking both.",
        "tool_calls": [
            {"id": "call_b", "type": "function", "function": {"name": "f", "arguments": "{}"}},
            {"id": "call_a", "type": "function", "function": {"name": "g", "arguments": "{}"}},
        ],
    }
    item = chat_item(raw)
    assert (item.kind, item.role, item.output_for) == ("tool_calls", "assistant", None)
    assert item.call_ids == ("call_b", "call_a")


def test_tool_message_answers_its_call() -> None:
    item = chat_item({"role": "tool", "tool_call_id": "call_a", "content": "42"})
    assert (item.kind, item.output_for, item.call_ids) == ("tool_output", "call_a", ())
    assert not item.is_user_message


def test_legacy_function_call_pairs_by_name() -> None:
    call = chat_item(
        {"role": "assistant", "content": None, "function_call": {"name": "f", "arguments": "{}"}}
    )
    result = chat_item({"role": "function", "name": "f", "content": "done"})
    assert call.kind == "tool_calls" and result.kind == "tool_output"
    assert call.call_ids == (result.output_for,)
    assert result.name == "f"


def test_chat_items_keep_order_and_raw() -> None:
    messages = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "u"},
        {"role": "assistant", "content": "a"},
    ]
    items = items_from_chat(messages)
    assert [i.role for i in items] == ["system", "user", "assistant"]
    assert all(back is orig for back, orig in zip(chat_from_items(items), messages, strict=True))


# --- Responses -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "raw",
    [
        {"role": "user", "content": "hi"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]},
    ],
)
def test_message_with_and_without_type(raw: dict[str, Any]) -> None:
    item = responses_item(raw)
    assert (item.api, item.kind, item.type, item.role) == (
        "responses",
        "message",
        "message",
        "user",
    )
    assert item.is_user_message
    assert item.text() == "hi"


def test_output_message_keeps_id_and_status() -> None:
    raw = {
        "type": "message",
        "id": "msg_1",
        "status": "completed",
        "role": "assistant",
        "content": [{"type": "output_text", "text": "Hello", "annotations": []}],
    }
    item = responses_item(raw)
    assert (item.id, item.status, item.role, item.text()) == (
        "msg_1",
        "completed",
        "assistant",
        "Hello",
    )


def test_function_call_and_output() -> None:
    call = responses_item(
        {
            "type": "function_call",
            "id": "fc_1",
            "call_id": "call_1",
            "name": "get_weather",
            "arguments": "{}",
            "status": "completed",
        }
    )
    output = responses_item({"type": "function_call_output", "call_id": "call_1", "output": "ok"})
    assert (call.kind, call.type, call.id, call.name, call.status) == (
        "tool_calls",
        "function_call",
        "fc_1",
        "get_weather",
        "completed",
    )
    assert call.call_ids == ("call_1",)
    assert (output.kind, output.output_for, output.call_ids) == ("tool_output", "call_1", ())


def test_reasoning_with_encrypted_content() -> None:
    raw = {
        "type": "reasoning",
        "id": "rs_1",
        "summary": [{"type": "summary_text", "text": "thinking"}],
        "encrypted_content": "gAAAA...",
    }
    item = responses_item(raw)
    assert (item.kind, item.type, item.id, item.call_ids) == ("reasoning", "reasoning", "rs_1", ())
    assert item.raw["encrypted_content"] == "gAAAA..."


@pytest.mark.parametrize(
    ("call", "output"),
    [
        (
            {"type": "custom_tool_call", "call_id": "c1", "name": "sql", "input": "SELECT 1"},
            {"type": "custom_tool_call_output", "call_id": "c1", "output": "1"},
        ),
        (
            {"type": "computer_call", "id": "cu_1", "call_id": "c2", "action": {"type": "click"}},
            {
                "type": "computer_call_output",
                "call_id": "c2",
                "output": {"type": "computer_screenshot", "image_url": "data:"},
            },
        ),
        (
            {"type": "shell_call", "call_id": "c3", "action": {"commands": ["ls"]}},
            {"type": "shell_call_output", "call_id": "c3", "output": []},
        ),
        (
            {"type": "apply_patch_call", "call_id": "c4", "operation": {"type": "update_file"}},
            {"type": "apply_patch_call_output", "call_id": "c4", "status": "completed"},
        ),
        (
            {"type": "local_shell_call", "id": "ls_1", "call_id": "c5", "action": {}},
            {"type": "local_shell_call_output", "id": "c5", "output": "done"},
        ),
    ],
)
def test_calls_pair_with_their_outputs(call: dict[str, Any], output: dict[str, Any]) -> None:
    call_item, output_item = responses_item(call), responses_item(output)
    assert call_item.kind == "tool_calls" and output_item.kind == "tool_output"
    assert call_item.call_ids == (output_item.output_for,)
    assert OUTPUT_TO_CALL_TYPE[output["type"]] == call["type"]


def test_output_types_name_known_calls() -> None:
    assert set(OUTPUT_TO_CALL_TYPE.values()) == CALL_TYPES
    assert not CALL_TYPES & set(OUTPUT_TO_CALL_TYPE)


@pytest.mark.parametrize("kind", ["compaction", "item_reference"])
def test_compaction_and_item_reference(kind: str) -> None:
    item = responses_item({"type": kind, "id": "x_1"})
    assert (item.kind, item.type, item.id) == (kind, kind, "x_1")


@pytest.mark.parametrize(
    "raw",
    [
        {"type": "image_generation_call", "id": "ig_1", "result": "iVBOR"},
        {"type": "some_future_item", "payload": [1, 2, 3]},
        {"content": "no role, no type"},
    ],
)
def test_unknown_types_are_opaque_and_keep_raw(raw: dict[str, Any]) -> None:
    snapshot = json.dumps(raw)
    item = responses_item(raw)
    assert item.kind == "other"
    assert item.type == raw.get("type")
    assert item.raw is raw and json.dumps(item.raw) == snapshot


# --- the view itself -----------------------------------------------------------------------


def test_item_is_frozen() -> None:
    item = chat_item({"role": "user", "content": "x"})
    with pytest.raises(dataclasses.FrozenInstanceError):
        item.kind = "other"  # type: ignore[misc]


def test_digest_names_content_not_key_order() -> None:
    a = {"role": "user", "content": "x"}
    b = {"content": "x", "role": "user"}
    assert content_digest(a) == content_digest(b) == chat_item(a).digest
    assert content_digest(a) != content_digest({"role": "user", "content": "y"})
    assert chat_item(a) == chat_item(b)
    assert canonical_json({"b": 1, "a": "é"}) == '{"a":"é","b":1}'


def test_message_text_of_odd_content() -> None:
    assert message_text(None) == ""
    assert message_text(["a", {"type": "input_image"}, {"text": "b"}]) == "a\nb"


def test_bare_string_input_round_trips() -> None:
    parsed = items_from_responses_input("hello")
    assert parsed.was_string
    (item,) = parsed.items
    assert (item.kind, item.role, item.text()) == ("message", "user", "hello")
    assert responses_input_from_items(parsed) == "hello"


def test_items_alone_give_back_a_list() -> None:
    parsed = items_from_responses_input("hello")
    assert responses_input_from_items(list(parsed.items)) == [{"role": "user", "content": "hello"}]
    assert responses_input_from_items(ResponsesInput(())) == []


# --- property: items -> back is byte for byte ----------------------------------------------

text = st.text(max_size=12)
ids = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789_", min_size=1, max_size=10)
json_scalars = st.none() | st.booleans() | st.integers(-(2**40), 2**40) | text
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(text, inner, max_size=3),
    max_leaves=8,
)


def shuffled(fields: dict[str, st.SearchStrategy[Any]]) -> st.SearchStrategy[dict[str, Any]]:
    """A dict of these fields, keys in any order (order must survive the round trip)."""
    return st.fixed_dictionaries(fields).flatmap(
        lambda d: st.permutations(list(d.items())).map(dict)
    )


chat_parts = st.lists(
    shuffled({"type": st.just("text"), "text": text})
    | shuffled(
        {
            "type": st.just("image_url"),
            "image_url": shuffled({"url": text, "detail": st.sampled_from(["low", "high"])}),
        }
    ),
    max_size=3,
)
tool_call = shuffled(
    {
        "id": ids,
        "type": st.just("function"),
        "function": shuffled({"name": ids, "arguments": text}),
    }
)
chat_message = st.one_of(
    shuffled(
        {
            "role": st.sampled_from(["system", "developer", "user"]),
            "content": text | chat_parts,
        }
    ),
    shuffled({"role": st.just("user"), "name": ids, "content": text}),
    shuffled({"role": st.just("assistant"), "content": st.none() | text}),
    shuffled(
        {
            "role": st.just("assistant"),
            "content": st.none() | text,
            "tool_calls": st.lists(tool_call, min_size=1, max_size=3),
        }
    ),
    shuffled({"role": st.just("tool"), "tool_call_id": ids, "content": text}),
    shuffled(
        {
            "role": st.just("assistant"),
            "content": st.none(),
            "function_call": shuffled({"name": ids, "arguments": text}),
        }
    ),
    shuffled({"role": st.just("function"), "name": ids, "content": text}),
)

responses_parts = st.lists(
    shuffled({"type": st.sampled_from(["input_text", "output_text"]), "text": text})
    | shuffled({"type": st.just("input_image"), "image_url": text, "detail": st.just("auto")}),
    max_size=3,
)
responses_raw = st.one_of(
    shuffled({"role": st.sampled_from(["user", "system", "developer"]), "content": text}),
    shuffled(
        {
            "type": st.just("message"),
            "role": st.sampled_from(["user", "assistant"]),
            "content": responses_parts,
        }
    ),
    shuffled(
        {
            "type": st.just("function_call"),
            "id": ids,
            "call_id": ids,
            "name": ids,
            "arguments": text,
            "status": st.just("completed"),
        }
    ),
    shuffled(
        {"type": st.just("function_call_output"), "call_id": ids, "output": text | responses_parts}
    ),
    shuffled(
        {
            "type": st.just("reasoning"),
            "id": ids,
            "summary": st.lists(shuffled({"type": st.just("summary_text"), "text": text})),
            "encrypted_content": text,
        }
    ),
    shuffled({"type": st.just("custom_tool_call"), "call_id": ids, "name": ids, "input": text}),
    shuffled(
        {"type": st.sampled_from(sorted(OUTPUT_TO_CALL_TYPE)), "call_id": ids, "output": text}
    ),
    shuffled({"type": st.just("compaction"), "encrypted_content": text}),
    shuffled({"type": st.just("item_reference"), "id": ids}),
    st.dictionaries(text, json_values, max_size=4),
)


@given(messages=st.lists(chat_message, max_size=8))
def test_chat_round_trip_is_byte_for_byte(messages: list[dict[str, Any]]) -> None:
    sent = json.dumps(messages, ensure_ascii=False)
    back = chat_from_items(items_from_chat(json.loads(sent)))
    assert json.dumps(back, ensure_ascii=False) == sent


@given(value=text | st.lists(responses_raw, max_size=8))
def test_responses_round_trip_is_byte_for_byte(value: str | list[dict[str, Any]]) -> None:
    sent = json.dumps(value, ensure_ascii=False)
    back = responses_input_from_items(items_from_responses_input(json.loads(sent)))
    assert json.dumps(back, ensure_ascii=False) == sent


@given(messages=st.lists(chat_message, max_size=8))
def test_every_chat_item_is_viewed(messages: list[dict[str, Any]]) -> None:
    for item in items_from_chat(messages):
        assert isinstance(item, Item)
        assert item.kind in ("message", "tool_calls", "tool_output")
        assert item.digest == content_digest(item.raw)


def test_digest_of_a_lone_surrogate_is_no_error() -> None:
    from proxy.core.items import content_digest

    assert content_digest({"text": "\ud800"}) != content_digest({"text": "\udfff"})


def test_an_mcp_approval_request_is_a_call_its_response_and_mcp_call_answer() -> None:
    request = responses_item({"type": "mcp_approval_request", "id": "mcpr_1", "name": "x"})
    response = responses_item(
        {"type": "mcp_approval_response", "approval_request_id": "mcpr_1", "approve": True}
    )
    run = responses_item({"type": "mcp_call", "id": "mcp_1", "approval_request_id": "mcpr_1"})
    free = responses_item({"type": "mcp_call", "id": "mcp_2", "name": "search"})
    assert (request.kind, request.call_ids, request.output_for) == (
        "mcp_approval_request",
        ("mcpr_1",),
        None,
    )
    assert (response.kind, response.output_for) == ("mcp_approval_response", "mcpr_1")
    assert (run.kind, run.output_for, run.call_ids) == ("mcp_call", "mcpr_1", ())
    assert (free.kind, free.output_for, free.call_ids) == ("mcp_call", None, ())
    assert pending_approvals([request, free]) == {"mcpr_1"}
    assert pending_approvals([request, response, run]) == frozenset()
    assert not is_pending_approval(free, frozenset({"mcp_2"}))


def test_tool_search_items_pair_only_by_a_call_id_they_carry() -> None:
    call = responses_item({"type": "tool_search_call", "call_id": "ts_1", "arguments": {}})
    output = responses_item({"type": "tool_search_output", "call_id": "ts_1", "tools": []})
    hosted = responses_item({"type": "tool_search_output", "id": "tso_1", "tools": []})
    assert (call.kind, call.call_ids) == ("tool_calls", ("ts_1",))
    assert (output.kind, output.output_for) == ("tool_output", "ts_1")
    assert (hosted.kind, hosted.output_for) == ("other", None)


CALLING = [
    *(
        responses_item({"type": call, "call_id": "c", "name": "f", "arguments": "{}"})
        for call in OUTPUT_TO_CALL_TYPE.values()
    ),
    *(responses_item({"type": output, "call_id": "c"}) for output in OUTPUT_TO_CALL_TYPE),
    responses_item({"type": "mcp_approval_request", "id": "a", "name": "f"}),
    responses_item({"type": "mcp_approval_response", "approval_request_id": "a"}),
    responses_item({"type": "mcp_call", "id": "m", "approval_request_id": "a"}),
    chat_item({"role": "assistant", "tool_calls": [{"id": "c", "type": "function"}]}),
    chat_item({"role": "assistant", "function_call": {"name": "f", "arguments": "{}"}}),
    chat_item({"role": "tool", "tool_call_id": "c", "content": "ok"}),
    chat_item({"role": "function", "name": "f", "content": "ok"}),
]
NOT_CALLING = [
    responses_item({"role": "user", "content": "hi", "call_id": "c"}),
    responses_item({"type": "reasoning", "id": "c", "summary": []}),
    responses_item({"type": "compaction", "id": "c", "encrypted_content": "x"}),
    responses_item({"type": "item_reference", "id": "c"}),
    responses_item({"type": "mcp_list_tools", "id": "c", "server_label": "s"}),
    responses_item({"type": "web_search_call", "id": "c"}),
    responses_item({"type": "tool_search_call"}),
    chat_item({"role": "assistant", "content": "hi", "tool_call_id": "c"}),
    chat_item({"role": "user", "content": "hi", "tool_call_id": "c"}),
]


@pytest.mark.parametrize("item", CALLING, ids=lambda i: i.type or i.role)
def test_an_item_that_makes_or_answers_a_call_is_of_a_call_kind(item: Item) -> None:
    assert item.call_ids or item.output_for
    assert item.kind in CALL_KINDS


@pytest.mark.parametrize("item", NOT_CALLING, ids=lambda i: i.type or i.role)
def test_an_item_of_another_kind_pairs_nothing(item: Item) -> None:
    """What the ledger's rewriters read (call ids, the call answered) is empty on every
    item outside CALL_KINDS: turn.REWRITERS skip them for a turn without a call."""
    assert item.kind not in CALL_KINDS
    assert not item.call_ids and item.output_for is None


ANY_TYPE = st.sampled_from(
    [
        None,
        "message",
        "reasoning",
        "compaction",
        "item_reference",
        "web_search_call",
        "x",
        *sorted(CALL_TYPES | set(OUTPUT_TO_CALL_TYPE) | MCP_KINDS),
    ]
)
MAYBE_ID = st.one_of(st.none(), st.just("c1"))
ROLE = st.sampled_from([None, "user", "assistant", "tool", "function", "system"])


@given(ANY_TYPE, ROLE, MAYBE_ID, MAYBE_ID, MAYBE_ID, MAYBE_ID)
def test_only_call_kinds_pair(
    type_: str | None,
    role: str | None,
    call_id: str | None,
    item_id: str | None,
    approval: str | None,
    tool_call_id: str | None,
) -> None:
    """Whatever a raw item holds, call ids or a call answered come with a call kind."""
    fields = {
        "type": type_,
        "role": role,
        "call_id": call_id,
        "id": item_id,
        "approval_request_id": approval,
        "tool_call_id": tool_call_id,
        "name": "f",
        "tool_calls": [{"id": call_id}] if call_id else None,
    }
    raw = {key: value for key, value in fields.items() if value is not None}
    for item in (responses_item(raw), chat_item(raw)):
        if item.call_ids or item.output_for is not None:
            assert item.kind in CALL_KINDS


# --- construction --------------------------------------------------------------------------

_maybe_text = st.none() | st.text(max_size=5)


def test_the_fast_init_takes_the_generated_ones_parameters() -> None:
    fast = inspect.signature(items_module._init)
    generated = inspect.signature(items_module._GENERATED_INIT)
    assert [(p.name, p.kind, p.default) for p in fast.parameters.values()] == [
        (p.name, p.kind, p.default) for p in generated.parameters.values()
    ]


_item_values = st.tuples(
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
    st.sampled_from(["chat", "responses"]),
    st.text(max_size=5),
    _maybe_text,
    _maybe_text,
    _maybe_text,
    _maybe_text,
    _maybe_text,
    st.tuples(st.text(max_size=3)) | st.just(()),
    _maybe_text,
    st.text(max_size=5),
    st.none() | st.integers(),
    st.text(max_size=5),
)


@given(_item_values, st.integers(min_value=4, max_value=13))
def test_an_item_holds_what_the_generated_init_would_set(
    values: tuple[Any, ...], given: int
) -> None:
    """The first `given` values positional, the rest by name."""
    names = [field.name for field in dataclasses.fields(Item)]
    positional, named = values[:given], dict(zip(names[given:], values[given:], strict=True))
    expected = object.__new__(Item)
    items_module._GENERATED_INIT(expected, *positional, **named)
    made = Item(*positional, **named)
    assert [getattr(made, n) for n in names] == [getattr(expected, n) for n in names]
    assert made == expected and hash(made) == hash(expected)
    assert dataclasses.replace(made, kind="other") == dataclasses.replace(expected, kind="other")


def test_an_item_made_with_too_few_values_is_a_type_error() -> None:
    with pytest.raises(TypeError):
        Item({}, "chat", "message")  # type: ignore[call-arg]
