"""What the summarizer model is asked and what its answer becomes (proxy/core/llm_summary.py)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.core import memory
from proxy.core.items import Item, chat_item, responses_item
from proxy.core.llm_summary import (
    missing,
    parse_answer,
    summary_from_answer,
    summary_messages,
    transcript,
)
from proxy.core.tokens import TokenCounter

RULE = "My rules: never refund more than 100 EUR without approval."
REFUND = "rfd_98765"


@pytest.fixture(scope="module")
def counter() -> TokenCounter:
    return TokenCounter.for_model("gpt-4o-mini")


def support_items() -> list[Item]:
    arguments = json.dumps({"order_id": "ORD-1234", "amount": "42.50 EUR"})
    result = {"refund_id": REFUND, "status": "approved", "amount": "42.50 EUR"}
    return [
        chat_item({"role": "user", "content": f"{RULE} Order ORD-1234 arrived broken."}),
        chat_item(
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "refund_order", "arguments": arguments},
                    }
                ],
            }
        ),
        chat_item({"role": "tool", "tool_call_id": "call_1", "content": json.dumps(result)}),
        chat_item(
            {"role": "assistant", "content": f"The refund {REFUND} of 42.50 EUR is approved."}
        ),
        chat_item({"role": "user", "content": "I prefer email updates."}),
    ]


def good_answer(**changes: Any) -> str:
    answer: dict[str, Any] = {
        "constraints": [RULE],
        "preferences": [{"preference": "I prefer email updates.", "changed_from": None}],
        "decisions": [f"The refund {REFUND} of 42.50 EUR is approved."],
        "open_tasks": [],
        "pending_calls": [],
        "facts": [
            {
                "tool": "refund_order",
                "values": {"refund_id": REFUND, "status": "approved", "amount": "42.50 EUR"},
            }
        ],
        "entities": ["100 EUR", "42.50 EUR", REFUND, "ORD-1234"],
    }
    answer.update(changes)
    return json.dumps(answer)


def test_the_prompt_asks_for_the_state_and_shows_calls_results_and_instructions() -> None:
    messages = summary_messages(support_items(), "Keep ticket numbers.")
    system, user = messages[0]["content"], messages[1]["content"]
    assert '"constraints"' in system and '"pending_calls"' in system
    assert system.endswith("Keep ticket numbers.")
    assert RULE in user
    assert "refund_order call_1" in user and "ORD-1234" in user
    assert "[tool result refund_order call_1]" in user and REFUND in user


def test_the_prompt_carries_the_previous_summary_forward(counter: TokenCounter) -> None:
    previous = memory.summarize_turns(support_items()[:3], counter, 500)
    user = summary_messages(support_items()[3:], None, previous)[1]["content"]
    assert user.startswith("Memory so far") and previous.text() in user


def test_a_long_item_keeps_head_and_tail_in_the_transcript() -> None:
    text = "START " + "x" * 20_000 + " END"
    line = transcript([responses_item({"role": "user", "content": text})])
    assert "START" in line and "END" in line and len(line) < 7_000


def test_an_answer_with_everything_renders_like_the_digest(counter: TokenCounter) -> None:
    written = summary_from_answer(good_answer(), support_items(), counter, 800)
    assert written is not None and written.appended == ()
    text = written.item.text()
    assert text.startswith(memory.SUMMARY_MARKER) and "Stands for 5 earlier items" in text
    assert "Constraints stated by the user (their words):\n- " + RULE in text
    assert f"refund_order -> refund_id={REFUND}, status=approved" in text
    assert written.item.raw["role"] == "system"
    assert memory.from_json(written.state).constraints == (RULE,)
    again = summary_from_answer(good_answer(), support_items(), counter, 800)
    assert again is not None and again.item.raw == written.item.raw  # stable bytes


@pytest.mark.parametrize(
    ("changes", "dropped"),
    [
        ({"constraints": []}, RULE),  # the turn-1 rule
        ({"entities": ["100 EUR"], "decisions": ["A refund was approved."], "facts": []}, REFUND),
    ],
)
def test_what_the_model_dropped_is_appended_verbatim(
    counter: TokenCounter, changes: dict[str, Any], dropped: str
) -> None:
    written = summary_from_answer(good_answer(**changes), support_items(), counter, 800)
    assert written is not None and dropped in written.appended
    text = written.item.text()
    assert f"- {dropped}" in text
    assert all(kept in text for kept in memory.must_keep(support_items()))


def test_a_dropped_rule_goes_back_to_the_constraints_it_came_from(counter: TokenCounter) -> None:
    written = summary_from_answer(good_answer(constraints=[]), support_items(), counter, 800)
    assert written is not None
    assert f"Constraints stated by the user (their words):\n- {RULE}" in written.item.text()
    assert memory.from_json(written.state).constraints == (RULE,)  # the state sent


def test_missing_is_an_exact_substring_check_in_order_once() -> None:
    keep = ("rfd_981", "order #1234", "rfd_981", "", "Approved.")
    assert missing("order 1234 Approved.", keep) == ("rfd_981", "order #1234")


@pytest.mark.parametrize(
    "answer",
    [
        "The customer wants a refund; it was approved.",  # prose
        '{"constraints": ["x"], "decisions": [',  # invalid JSON
        "[]",
        '{"summary": "prose in JSON"}',  # none of the fields
        '{"constraints": "never refund twice"}',  # a field of the wrong type
        '{"constraints": [1, 2]}',
        '{"facts": [{"values": {"a": 1}}]}',  # a fact without its tool
        '{"preferences": [{"changed_from": "sms"}]}',
    ],
)
def test_an_answer_that_is_not_the_state_gives_none(counter: TokenCounter, answer: str) -> None:
    assert summary_from_answer(answer, support_items(), counter, 800) is None


def test_a_fenced_json_answer_is_read() -> None:
    assert parse_answer("```json\n" + good_answer() + "\n```") is not None


def test_the_guarded_summary_fits_its_limit_or_gives_none(counter: TokenCounter) -> None:
    many = [f"Decision {n} about ORD-{n}." for n in range(60)]
    answer = good_answer(decisions=many)
    keep = memory.must_keep(support_items())
    roomy = summary_from_answer(answer, support_items(), counter, 2000)
    assert roomy is not None and "Decision 59 about ORD-59." in roomy.item.text()
    for limit in (160, 250, 400):  # the model's own decisions give way to must-keep ones
        written = summary_from_answer(answer, support_items(), counter, limit)
        assert written is not None
        assert counter.chat_message(written.item.raw) <= limit
        assert all(kept in written.item.text() for kept in keep)
    # Below what the must-keep strings need (the digest loses one there too): not used.
    assert summary_from_answer(answer, support_items(), counter, 120) is None
    digest = memory.summarize_turns(support_items(), counter, 120)
    assert missing(digest.text(), keep)


def test_a_responses_summary_is_a_developer_message(counter: TokenCounter) -> None:
    items = [
        responses_item({"type": "message", "role": "user", "content": RULE}),
        responses_item({"type": "message", "role": "assistant", "content": "Noted."}),
    ]
    written = summary_from_answer(good_answer(), items, counter, 400)
    assert written is not None and written.item.raw["role"] == "developer"
    assert written.item.raw["type"] == "message" and RULE in written.item.text()


FIELDS_DROPPED = st.sets(
    st.sampled_from(["constraints", "preferences", "decisions", "facts", "entities"])
)


@settings(max_examples=40, deadline=None)
@given(dropped=FIELDS_DROPPED, limit=st.integers(min_value=100, max_value=900))
def test_a_used_summary_always_holds_every_must_keep_string_within_its_limit(
    dropped: set[str], limit: int
) -> None:
    counter = TokenCounter.for_model("gpt-4o-mini")
    answer = good_answer(**{name: [] for name in dropped})
    written = summary_from_answer(answer, support_items(), counter, limit)
    if written is None:
        return  # the digest is sent instead
    assert counter.chat_message(written.item.raw) <= limit
    assert not missing(written.item.text(), memory.must_keep(support_items()))


def test_a_base_state_keeps_the_pending_calls_ids_that_its_text_loses(
    counter: TokenCounter,
) -> None:
    """A compaction hands the state it follows (`base`): a call pending there and
    answered in `items` is no longer pending. Read back from the rendered text, the call
    id is gone and the call would stay pending, kept by the guard."""
    call, output = support_items()[1], support_items()[2]
    base = memory.extract([call])
    assert [p.call_id for p in base.pending] == ["call_1"]
    previous = memory.summary_item("chat", memory.render(base, counter, 10_000))
    answer = good_answer(pending_calls=[])
    written = summary_from_answer(answer, [output], counter, 800, previous, base)
    assert written is not None
    assert memory.from_json(written.state).pending == ()
    assert "Pending actions" not in written.item.text()
    from_text = summary_from_answer(answer, [output], counter, 800, previous)
    assert from_text is not None and memory.from_json(from_text.state).pending != ()


def test_a_failure_in_a_tool_log_is_kept_when_the_model_leaves_it_out(
    counter: TokenCounter,
) -> None:
    """The one failing line of a long test log is what the later turns act on: a vague
    answer without it gets it appended (it is must-keep), like the digest keeps it."""
    passed = [f"tests/test_{i}.py::test_ok PASSED" for i in range(300)]
    failed = ["E   ZeroDivisionError", "src/billing/proration.py:88: ZeroDivisionError"]
    log = "\n".join([*passed, *failed, "1 failed, 300 passed"])
    items = [
        chat_item({"role": "user", "content": "Run the tests."}),
        chat_item(
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_t",
                        "type": "function",
                        "function": {"name": "run_tests", "arguments": "{}"},
                    }
                ],
            }
        ),
        chat_item({"role": "tool", "tool_call_id": "call_t", "content": log}),
        chat_item({"role": "assistant", "content": "One test fails."}),
    ]
    vague = json.dumps({"decisions": ["The tests were run."], "facts": []})
    written = summary_from_answer(vague, items, counter, 600)
    assert written is not None
    assert "proration.py:88" in written.item.text()
    assert any("proration.py:88" in kept for kept in memory.must_keep(items))
