"""The side-effect ledger rules (SPEC section 6): which calls are guarded, their keys,
the decision for a repeated key, the answers fed back to the model, client outcomes."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from proxy.core.items import canonical_json, chat_item, legacy_call_id, responses_item
from proxy.core.ledger import (
    REPLAY_NOTE,
    Decision,
    RenderedKey,
    ToolCall,
    ToolRule,
    arguments_digest,
    dangling_calls,
    dangling_decision,
    decide,
    is_synthetic_output,
    ledger_scope,
    model_output,
    output_outcome,
    outputs_in,
    place_answers,
    render_idempotency_key,
    side_effect_calls,
    unanswered_output,
)

REFUND = ToolRule(side_effect=True, idempotency_key="refund:{order_id}")
RULES = {
    "refund_order": REFUND,
    "send_email": ToolRule(side_effect=True),
    "get_weather": ToolRule(side_effect=False),
    "patch": ToolRule(side_effect=True),
}


def call(
    arguments: str, name: str = "refund_order", api: Any = "chat", kind: Any = "function"
) -> ToolCall:
    return ToolCall("call_1", name, arguments, api, kind)


def sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


# --- side_effect_calls ---------------------------------------------------------------------


def test_chat_message_keeps_only_side_effecting_calls_in_order() -> None:
    message = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "c1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": "{}"},
            },
            {
                "id": "c2",
                "type": "function",
                "function": {"name": "refund_order", "arguments": '{"order_id":"A"}'},
            },
            {
                "id": "c3",
                "type": "function",
                "function": {"name": "unknown_tool", "arguments": "{}"},
            },
            {"id": "c4", "type": "custom", "custom": {"name": "patch", "input": "*** Begin Patch"}},
            {
                "id": "c5",
                "type": "function",
                "function": {"name": "send_email", "arguments": '{"to":"x"}'},
            },
        ],
    }
    assert side_effect_calls(message, RULES) == [
        ToolCall("c2", "refund_order", '{"order_id":"A"}', "chat", "function", 1),
        ToolCall("c4", "patch", "*** Begin Patch", "chat", "custom", 3),
        ToolCall("c5", "send_email", '{"to":"x"}', "chat", "function", 4),
    ]


def test_chat_legacy_function_call_uses_the_legacy_call_id() -> None:
    message = {"role": "assistant", "function_call": {"name": "refund_order", "arguments": "{}"}}
    [found] = side_effect_calls(message, RULES)
    assert (found.call_id, found.name, found.api) == (
        legacy_call_id("refund_order"),
        "refund_order",
        "chat",
    )


def test_chat_message_without_calls_or_with_malformed_ones() -> None:
    assert side_effect_calls({"role": "assistant", "content": "hi"}, RULES) == []
    broken = {
        "role": "assistant",
        "tool_calls": [None, {"type": "function"}, {"id": "c", "function": {}}],
    }
    assert side_effect_calls(broken, RULES) == []


def test_object_arguments_from_a_compatible_server_become_canonical_json() -> None:
    message = {
        "role": "assistant",
        "tool_calls": [
            {
                "id": "c1",
                "type": "function",
                "function": {"name": "refund_order", "arguments": {"b": 1, "a": 2}},
            }
        ],
    }
    assert side_effect_calls(message, RULES)[0].arguments == '{"a":2,"b":1}'


def test_responses_output_items() -> None:
    output: list[dict[str, Any]] = [
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {
            "type": "function_call",
            "id": "fc_1",
            "call_id": "call_a",
            "name": "refund_order",
            "arguments": '{"order_id":1}',
        },
        {
            "type": "function_call",
            "id": "fc_2",
            "call_id": "call_b",
            "name": "get_weather",
            "arguments": "{}",
        },
        {
            "type": "custom_tool_call",
            "id": "ct_1",
            "call_id": "call_c",
            "name": "patch",
            "input": "diff",
        },
        {"type": "message", "role": "assistant", "content": []},
    ]
    assert side_effect_calls(output, RULES) == [
        ToolCall("call_a", "refund_order", '{"order_id":1}', "responses", "function", 1),
        ToolCall("call_c", "patch", "diff", "responses", "custom", 3),
    ]


# --- render_idempotency_key ----------------------------------------------------------------


def test_template_renders_from_the_arguments() -> None:
    assert render_idempotency_key(
        REFUND, call('{"order_id": "ORD-1", "amount": 5}')
    ) == RenderedKey("refund:ORD-1", False, None)


@pytest.mark.parametrize(
    ("value", "rendered"),
    [
        (7, "7"),
        (7.0, "7.0"),
        (True, "true"),
        ({"b": 1, "a": [1, 2]}, '{"a":[1,2],"b":1}'),
        ("ünï 订单", "ünï 订单"),
    ],
)
def test_non_string_values_render_as_json(value: Any, rendered: str) -> None:
    key = render_idempotency_key(REFUND, call(json.dumps({"order_id": value})))
    assert key == RenderedKey(f"refund:{rendered}", False, None)


def test_dotted_paths_reach_into_objects_and_arrays() -> None:
    rule = ToolRule(side_effect=True, idempotency_key="pay:{order.id}:{lines.1.sku}")
    arguments = json.dumps({"order": {"id": "O9"}, "lines": [{"sku": "a"}, {"sku": "b"}]})
    assert render_idempotency_key(rule, call(arguments)).key == "pay:O9:b"


def test_format_spec_applies_to_the_raw_value() -> None:
    rule = ToolRule(side_effect=True, idempotency_key="pay:{amount:.2f}")
    assert render_idempotency_key(rule, call('{"amount": 5}')).key == "pay:5.00"


def test_constant_template_ignores_the_arguments() -> None:
    rule = ToolRule(side_effect=True, idempotency_key="close-month")
    assert render_idempotency_key(rule, call("not json")) == RenderedKey("close-month", False, None)


@pytest.mark.parametrize(
    ("arguments", "reason_part"),
    [
        ('{"amount": 5}', "order_id is missing"),
        ('{"order_id": null}', "order_id is missing"),
        ('{"order_id": ""}', "order_id is missing"),
        ('["ORD-1"]', "not a JSON object"),
        ('"ORD-1"', "not a JSON object"),
        ("{order_id: ORD-1", "not a JSON object"),
    ],
)
def test_unusable_arguments_fall_back_to_the_arguments_hash(
    arguments: str, reason_part: str
) -> None:
    key = render_idempotency_key(REFUND, call(arguments))
    assert key.fallback and key.reason is not None and reason_part in key.reason
    assert key.key == f"refund_order:sha256:{arguments_digest(arguments)}"


@pytest.mark.parametrize(
    "arguments", ['{"order": {}}', '{"order": "O9"}', '{"lines": []}', '{"lines": {"0": 1}}']
)
def test_missing_nested_path_falls_back(arguments: str) -> None:
    rule = ToolRule(side_effect=True, idempotency_key="{order.id}{lines.0}")
    key = render_idempotency_key(rule, call(arguments))
    assert key.fallback and "is missing" in (key.reason or "")


def test_bad_format_spec_falls_back() -> None:
    rule = ToolRule(side_effect=True, idempotency_key="{order_id:.2f}")
    key = render_idempotency_key(rule, call('{"order_id": "ORD-1"}'))
    assert key.fallback and "cannot render" in (key.reason or "")


def test_no_template_falls_back_to_the_canonical_hash() -> None:
    key = render_idempotency_key(
        ToolRule(side_effect=True), call('{ "to": "x",  "a": 1 }', name="send_email")
    )
    canonical = '{"a":1,"to":"x"}'
    assert key == RenderedKey(
        f"send_email:sha256:{sha(canonical)}",
        True,
        "no idempotency_key template for this tool",
    )


def test_unparsable_arguments_hash_the_raw_string() -> None:
    assert arguments_digest("*** Begin Patch") == sha("*** Begin Patch")


def test_unicode_arguments_hash_as_utf8_without_escapes() -> None:
    assert arguments_digest('{"name": "\\u00fcber"}') == sha('{"name":"über"}')


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=4)
    ),
    max_leaves=10,
)


@given(
    st.dictionaries(st.text(max_size=8), json_values, max_size=6), st.randoms(use_true_random=False)
)
def test_canonical_hash_ignores_key_order_and_whitespace(
    arguments: dict[str, Any], rng: Any
) -> None:
    shuffled = list(arguments.items())
    rng.shuffle(shuffled)
    spaced = json.dumps(
        dict(shuffled), indent=rng.choice([None, 2]), ensure_ascii=rng.choice([True, False])
    )
    assert arguments_digest(spaced) == arguments_digest(json.dumps(arguments))
    assert arguments_digest(spaced) == sha(canonical_json(arguments))


def test_different_arguments_give_different_fallback_keys() -> None:
    rule = ToolRule(side_effect=True)
    assert (
        render_idempotency_key(rule, call('{"a":1}')).key
        != render_idempotency_key(rule, call('{"a":2}')).key
    )


# --- ledger_scope --------------------------------------------------------------------------


def test_scopes() -> None:
    thread_rule = ToolRule(side_effect=True, scope="thread")
    assert ledger_scope(REFUND, "t1") == "tenant"
    assert ledger_scope(thread_rule, "t1") == "thread:t1"
    # a stateless request has no thread: the wider tenant scope still guards it
    assert ledger_scope(thread_rule, None) == "tenant"


# --- decide: every row of the table --------------------------------------------------------

BLOCK_RULE = ToolRule(side_effect=True, on_duplicate="block")


@pytest.mark.parametrize(
    ("status", "created", "earlier", "rule", "expected"),
    [
        ("issued", True, "call_1", REFUND, Decision.HAND_OUT),
        ("issued", True, "call_1", BLOCK_RULE, Decision.HAND_OUT),
        ("issued", False, "call_1", REFUND, Decision.HAND_OUT),
        ("completed", False, "call_1", REFUND, Decision.REPLAY),
        ("completed", False, "call_1", BLOCK_RULE, Decision.REPLAY),
        ("failed", False, "call_1", REFUND, Decision.REPLAY),
        ("completed", False, "call_0", REFUND, Decision.REPLAY),
        ("completed", False, "call_0", BLOCK_RULE, Decision.BLOCK),
        ("issued", False, "call_0", REFUND, Decision.UNKNOWN_OUTCOME),
        ("issued", False, "call_0", BLOCK_RULE, Decision.UNKNOWN_OUTCOME),
        ("failed", False, "call_0", REFUND, Decision.FAILED_BEFORE),
        ("failed", False, "call_0", BLOCK_RULE, Decision.FAILED_BEFORE),
    ],
)
def test_decision_table(
    status: str, created: bool, earlier: str, rule: ToolRule, expected: Decision
) -> None:
    assert decide(status, created, earlier, "call_1", rule) is expected


@pytest.mark.parametrize("status", [None, "submitted"])
def test_decide_without_a_known_entry_is_a_caller_bug(status: str | None) -> None:
    with pytest.raises(ValueError, match="status"):
        decide(status, False, None, "call_1", REFUND)


# --- model_output --------------------------------------------------------------------------

AT = "2026-09-01T09:00:01+00:00"


def body_of(output: dict[str, Any]) -> dict[str, Any]:
    text = output.get("content", output.get("output"))
    assert isinstance(text, str)
    body = json.loads(text)
    assert isinstance(body, dict)
    return body


@pytest.mark.parametrize(
    ("api", "kind", "shape"),
    [
        ("chat", "function", {"role": "tool", "tool_call_id": "call_1"}),
        ("chat", "custom", {"role": "tool", "tool_call_id": "call_1"}),
        ("responses", "function", {"type": "function_call_output", "call_id": "call_1"}),
        ("responses", "custom", {"type": "custom_tool_call_output", "call_id": "call_1"}),
    ],
)
def test_output_has_the_shape_of_a_client_output(
    api: str, kind: str, shape: dict[str, str]
) -> None:
    output = model_output(call("{}", api=api, kind=kind), Decision.BLOCK, None, "call_0", AT)
    text_field = "content" if api == "chat" else "output"
    assert set(output) == {*shape, text_field}
    assert {k: output[k] for k in shape} == shape


def test_replay_carries_the_recorded_result_as_json() -> None:
    output = model_output(call("{}"), Decision.REPLAY, '{"refund_id": "re_1"}', "call_0", AT)
    assert body_of(output) == {
        "threadkeeper": "replay",
        "replay_of": "call_0",
        "note": REPLAY_NOTE,
        "result": {"refund_id": "re_1"},
    }


@pytest.mark.parametrize(
    ("recorded", "result"), [("refunded 5 EUR", "refunded 5 EUR"), (None, None), ("[1]", [1])]
)
def test_replay_result_that_is_not_an_object(recorded: str | None, result: Any) -> None:
    assert (
        body_of(model_output(call("{}"), Decision.REPLAY, recorded, "call_0", AT))["result"]
        == result
    )


def test_block_says_it_was_not_run_again() -> None:
    body = body_of(model_output(call("{}"), Decision.BLOCK, '{"x":1}', "call_0", AT))
    assert body == {
        "threadkeeper": "blocked",
        "replay_of": "call_0",
        "note": "This action was already performed (call call_0); it was not run again.",
    }


def test_unknown_outcome_names_the_time_and_the_key() -> None:
    output = model_output(
        call("{}", api="responses"), Decision.UNKNOWN_OUTCOME, None, "call_0", AT, "refund:ORD-1"
    )
    body = body_of(output)
    assert (body["threadkeeper"], body["earlier_call_id"], body["idempotency_key"]) == (
        "outcome_unknown",
        "call_0",
        "refund:ORD-1",
    )
    assert AT in body["note"] and "NOT run again" in body["note"]


@pytest.mark.parametrize("decision", [Decision.HAND_OUT, Decision.FAILED_BEFORE])
def test_calls_handed_to_the_client_have_no_model_output(decision: Decision) -> None:
    with pytest.raises(ValueError, match=decision.name):
        model_output(call("{}"), decision, None, None, AT)


# --- output_outcome ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "output",
    [
        '{"error": "card declined"}',
        '{"error": {"code": 500}}',
        '{"status": "failed"}',
        '{"status": "ERROR"}',
        '{"state": "failure"}',
        '{"ok": false}',
        '{"success": false, "data": 1}',
        '{"isError": true}',
        "Error: timeout",
        "  \n failed to connect",
        "EXCEPTION raised",
        "Traceback (most recent call last):",
        '"error: quoted json string"',
        {"error": "x"},
        [{"type": "input_text", "text": "Error: "}, {"type": "input_text", "text": "boom"}],
        [{"type": "text", "text": '{"status": "failed"}'}],
    ],
)
def test_failed_outputs(output: Any) -> None:
    assert output_outcome(output) == "failed"


@pytest.mark.parametrize(
    "output",
    [
        '{"refund_id": "re_1", "status": "succeeded"}',
        '{"error": null, "ok": true}',
        '{"error": "", "success": true}',
        '{"ok": 0}',
        "Refunded. No errors.",
        "errors found: 0",
        "",
        "[]",
        "42",
        {"status": "done"},
        [{"type": "input_image", "image_url": "https://x/a.png"}],
        [{"type": "input_text", "text": "done"}],
    ],
)
def test_completed_outputs(output: Any) -> None:
    assert output_outcome(output) == "completed"


# --- outputs_in ----------------------------------------------------------------------------


def test_chat_outputs_in() -> None:
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "refund"},
        {"role": "assistant", "tool_calls": [{"id": "c1"}]},
        {"role": "tool", "tool_call_id": "c1", "content": '{"ok": true}'},
        {"role": "function", "name": "refund_order", "content": "done"},
        {"role": "tool", "content": "no call id"},
    ]
    assert outputs_in(messages, "chat") == [
        ("c1", '{"ok": true}'),
        (legacy_call_id("refund_order"), "done"),
    ]


def test_responses_outputs_in() -> None:
    parts = [{"type": "input_text", "text": "ok"}]
    items: list[dict[str, Any]] = [
        {"role": "user", "content": "refund"},
        {"type": "function_call", "call_id": "c1", "name": "refund_order", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "done"},
        {"type": "custom_tool_call_output", "call_id": "c2", "output": parts},
        {"type": "computer_call_output", "call_id": "c3", "output": {}},
    ]
    assert outputs_in(items, "responses") == [("c1", "done"), ("c2", parts)]
    assert outputs_in("just text", "responses") == []


def test_lone_surrogate_escapes_still_hash() -> None:
    # valid JSON a model can emit; a crash here would turn a tool call into a 500
    assert arguments_digest('{"b": 1, "a": "\\ud800"}') == arguments_digest('{"a":"\\ud800","b":1}')


@pytest.mark.parametrize("order_id", ["A\\u0000B", "A\\ud800B"])
def test_a_key_the_store_cannot_keep_falls_back_to_the_hash(order_id: str) -> None:
    rendered = render_idempotency_key(REFUND, call(f'{{"order_id": "{order_id}"}}'))
    assert rendered.fallback
    assert rendered.key.startswith("refund_order:sha256:")
    assert "NUL, a lone surrogate" in (rendered.reason or "")


# --- calls left dangling (issue 8 item 20) -------------------------------------------------


def fcall(call_id: str, name: str = "refund_order") -> dict[str, Any]:
    return {"type": "function_call", "call_id": call_id, "name": name, "arguments": "{}"}


def fout(call_id: str) -> dict[str, Any]:
    return {"type": "function_call_output", "call_id": call_id, "output": "done"}


def user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


def test_dangling_calls_are_the_unanswered_function_and_custom_calls() -> None:
    custom = {"type": "custom_tool_call", "call_id": "c3", "name": "patch", "input": "x"}
    shell = {"type": "local_shell_call", "call_id": "c4", "action": {}}
    known = [responses_item(r) for r in (user("go"), fcall("c1"), fcall("c2"), custom, shell)]
    new = [responses_item(r) for r in (fout("c1"), user("next"))]
    found = dangling_calls(known, new)
    assert [(c.call_id, c.kind) for c in found] == [("c2", "function"), ("c3", "custom")]
    chat_known = [
        chat_item({"role": "assistant", "function_call": {"name": "f", "arguments": "{}"}})
    ]
    assert dangling_calls(chat_known, []) == []  # legacy calls carry no id to answer


def test_answers_go_after_the_window_or_after_their_calls_outputs() -> None:
    new = [responses_item(r) for r in (fout("a"), user("u"), fcall("b"), fcall("c"), fout("c"))]
    new.append(responses_item(user("v")))
    answers = {
        "w": responses_item(fout("w")),  # a call of the stored window
        "b": responses_item(fout("b")),
    }
    placed = place_answers(new, answers)
    order = [i.output_for or i.call_ids or i.raw.get("content") for i in placed]
    assert order == ["w", "a", "u", ("b",), ("c",), "c", "b", "v"]


def test_chat_answer_follows_its_tool_messages_not_the_next_step() -> None:
    def calls(*ids: str) -> dict[str, Any]:
        tool_calls = [
            {"id": i, "type": "function", "function": {"name": "f", "arguments": "{}"}} for i in ids
        ]
        return {"role": "assistant", "content": None, "tool_calls": tool_calls}

    def tool(call_id: str) -> dict[str, Any]:
        return {"role": "tool", "tool_call_id": call_id, "content": "ok"}

    new = [chat_item(m) for m in (calls("a", "b"), tool("a"), calls("c"), tool("c"))]
    answer = chat_item(tool("b"))
    placed = place_answers(new, {"b": answer})
    assert placed.index(answer) == 2


def test_dangling_decision() -> None:
    assert dangling_decision("issued") is Decision.UNKNOWN_OUTCOME
    assert dangling_decision("completed") is Decision.REPLAY
    assert dangling_decision("failed") is Decision.REPLAY
    with pytest.raises(ValueError):
        dangling_decision("bogus")


def test_synthetic_outputs_are_recognized_and_client_outputs_are_not() -> None:
    chat_call = ToolCall("c1", "lookup", "{}", "chat")
    custom_call = ToolCall("c2", "patch", "x", "responses", "custom")
    unknown = model_output(chat_call, Decision.UNKNOWN_OUTCOME, None, "c0", "t", "k")
    no_output = unanswered_output(custom_call)
    assert no_output["type"] == "custom_tool_call_output"
    assert is_synthetic_output(unknown) and is_synthetic_output(no_output)
    assert not is_synthetic_output({"role": "tool", "tool_call_id": "c1", "content": "ok"})
    fake = {"role": "tool", "tool_call_id": "c", "content": '{"threadkeeper": "mine"}'}
    assert not is_synthetic_output(fake)
