"""The memory state a digest holds: what is extracted, how it renders, what must be kept."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proxy.core.compress import compress_tool_output
from proxy.core.items import Item, chat_item, responses_item
from proxy.core.memory import (
    SUMMARY_MARKER,
    MemoryState,
    Pending,
    Preference,
    constraints,
    entities_in,
    extract,
    from_json,
    guard,
    is_rule,
    merge,
    must_keep,
    parse,
    referenced_values,
    render,
    sentences,
    summarize_turns,
    to_json,
)
from proxy.core.tokens import TokenCounter


@pytest.fixture(scope="module")
def counter() -> TokenCounter:
    return TokenCounter.for_model("gpt-4o")


def user(text: str) -> Item:
    return chat_item({"role": "user", "content": text})


def assistant(text: str) -> Item:
    return chat_item({"role": "assistant", "content": text})


def call(call_id: str, name: str, arguments: dict[str, Any]) -> Item:
    function = {"name": name, "arguments": json.dumps(arguments)}
    return chat_item(
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": call_id, "type": "function", "function": function}],
        }
    )


def result(call_id: str, body: Any) -> Item:
    return chat_item({"role": "tool", "tool_call_id": call_id, "content": json.dumps(body)})


def support_thread() -> list[Item]:
    return [
        user(
            "Customer Anna Berg (anna.berg@shop.example.org) says her headphones never "
            "arrived. My rules: never refund more than 200 EUR without approval, and always "
            "reply in English. I prefer short answers."
        ),
        call("call_a1", "lookup_order", {"order_id": "ORD-7731"}),
        result(
            "call_a1",
            {
                "request_id": "req_9f8e7d",
                "served_by": "api-eu-3",
                "generated_at": "2026-11-30T10:00:00Z",
                "data": {
                    "order": {
                        "id": "ORD-7731",
                        "status": "lost_in_transit",
                        "total": {"amount": 89.99, "currency": "EUR"},
                    }
                },
            },
        ),
        assistant("ORD-7731 is lost in transit. I'll refund 89.99 EUR to the original card."),
        call(
            "call_a2",
            "issue_refund",
            {"order_id": "ORD-7731", "amount": 89.99, "currency": "EUR", "reason": "lost"},
        ),
        result(
            "call_a2", {"trace_id": "tr-1", "refund": {"refund_id": "RF-5501", "status": "done"}}
        ),
        user("Actually, I'd rather have detailed answers instead. Refund the 12.50 EUR fee too."),
        assistant(
            "The refund of the shipping fee is on hold pending supervisor approval, which "
            "usually takes one business day; I will follow up with the customer as soon as "
            "the supervisor has decided, and then close ticket TCK-2231."
        ),
        call("call_a3", "request_approval", {"refund_for": "ORD-7731", "amount": "12.50"}),
    ]


# --- sentences and rules ------------------------------------------------------------------


def test_sentences_do_not_split_addresses_versions_decimals_or_abbreviations() -> None:
    text = (
        "Customer Anna (anna.berg@shop.example.org) says her headphones never arrived. "
        "Use Python 3.11 only. She paid $89.99, e.g. by card. Mr. Smith agreed. "
        "See https://docs.example.com/v2.1/api.html?x=1 for details! Done"
    )
    assert sentences(text) == [
        "Customer Anna (anna.berg@shop.example.org) says her headphones never arrived.",
        "Use Python 3.11 only.",
        "She paid $89.99, e.g. by card.",
        "Mr. Smith agreed.",
        "See https://docs.example.com/v2.1/api.html?x=1 for details!",
        "Done",
    ]


def test_sentences_split_lines_and_strip_bullets() -> None:
    text = "My rules:\n- total budget 1800 EUR\n2. no red-eye flights\n所有金额都用人民币。默认含税"
    assert sentences(text) == [
        "My rules:",
        "total budget 1800 EUR",
        "no red-eye flights",
        "所有金额都用人民币。",
        "默认含税",
    ]


def test_the_issues_misfiled_fragments_are_not_constraints() -> None:
    # Issue 10: a naive split filed these two fragments as constraints.
    text = (
        "Customer Anna (anna.berg@shop.example.org) says her headphones never arrived. "
        "The service needs Python 3.11 only."
    )
    found = constraints(text)
    assert "org) says her headphones never arrived." not in found
    assert "11 only." not in found and "- 11 only." not in found
    assert not any(c.startswith(("org)", "11 only", "- 11")) for c in found)
    assert not is_rule("org) says her headphones never arrived.")
    assert found == ["The service needs Python 3.11 only."]


def test_rules_without_a_pin_pattern_are_constraints() -> None:
    rules = "My rules: total budget 1800 EUR, no red-eye flights, and I'm vegetarian"
    assert constraints(f"Hi! {rules}. Thanks.") == [f"{rules}."]


@pytest.mark.parametrize(
    "sentence",
    [
        "Never refund twice.",
        "always answer in French",
        "You must get approval above 200 EUR.",
        "Don't book anything before I confirm.",
        "Only economy class.",
        "At most 2 stops per leg.",
        "The deadline is March 3.",
        "Submit it by Friday.",
        "Keep the total under 1800 EUR, no hotels outside the center.",
        "All amounts in CNY, tax included.",
        "所有金额都用人民币，默认含税。",
        "We mustn't touch the production database.",
        "From now on summarize accounts in bullet points, not paragraphs.",
        "Going forward, cc the account owner.",
    ],
)
def test_rule_statements_are_detected(sentence: str) -> None:
    assert is_rule(sentence)


@pytest.mark.parametrize(
    "sentence",
    [
        "Customer Anna says her headphones never arrived.",
        "No, thanks.",
        "I don't know which flight is better.",
        "The order ORD-7731 was shipped on Monday.",
        "What about the hotel?",
    ],
)
def test_stories_and_questions_are_not_rules(sentence: str) -> None:
    assert not is_rule(sentence)


def test_entities_are_ids_emails_and_amounts_with_currency() -> None:
    text = (
        "Order ORD-7731 (ref YT123456, cus_8842) for anna@x.example.org: 1,800 EUR, $89.99, "
        "€12.50 and 30 dollars; call_abc123 and 2026-11-30T10:00:00Z are not entities."
    )
    assert entities_in(text) == [
        "ORD-7731",
        "YT123456",
        "cus_8842",
        "anna@x.example.org",
        "1,800 EUR",
        "$89.99",
        "€12.50",
        "30 dollars",
    ]


# --- extraction -----------------------------------------------------------------------------


def test_extract_keeps_rules_decisions_pending_calls_and_nested_facts() -> None:
    state = extract(support_thread())
    assert state.count == 9
    assert state.constraints == (
        "My rules: never refund more than 200 EUR without approval, and always reply in English.",
    )
    assert state.preferences == (
        Preference(
            "Actually, I'd rather have detailed answers instead.", "I prefer short answers."
        ),
    )
    # A decision is kept whole, not cut at 160 characters into an "unverified" bucket.
    assert any(d.startswith("The refund of the shipping fee is on hold") for d in state.decisions)
    assert any(d.endswith("close ticket TCK-2231.") for d in state.decisions)
    assert state.pending == (
        Pending("request_approval(refund_for=ORD-7731, amount=12.50)", "call_a3"),
    )
    lookup, refund = state.facts
    assert lookup.startswith("lookup_order(order_id=ORD-7731) -> ")
    assert "order.status=lost_in_transit" in lookup and "order.total.amount=89.99" in lookup
    assert refund.startswith("issue_refund(order_id=ORD-7731, amount=89.99, currency=EUR")
    assert "reason=lost" in refund and "refund_id=RF-5501" in refund
    for noise in ("req_9f8e7d", "api-eu-3", "2026-11-30", "tr-1", "call_a"):
        assert noise not in to_json(state).replace('"call_id":"call_a3"', "")
    for entity in ("ORD-7731", "RF-5501", "TCK-2231", "anna.berg@shop.example.org", "89.99 EUR"):
        assert entity in state.entities


def test_a_later_result_closes_a_pending_call() -> None:
    first = extract(support_thread())
    later = extract([result("call_a3", {"approval": "granted"})], first)
    assert later.pending == ()
    assert any(f.startswith("request_approval(") for f in later.facts)


def test_a_reused_call_id_pairs_each_result_with_the_call_just_before_it() -> None:
    """Some providers answer every call with the id "call_0" (the Chat API allows it):
    each result was filed under the thread's last call with that id."""
    state = extract(
        [
            user("Look up ORD-1."),
            call("call_0", "lookup_order", {"order_id": "ORD-1"}),
            result("call_0", {"status": "shipped"}),
            user("Refund ORD-2."),
            call("call_0", "issue_refund", {"order_id": "ORD-2", "amount": 12.5}),
            result("call_0", {"refund_id": "RF-2"}),
        ]
    )
    lookup, refund = state.facts
    assert lookup.startswith("lookup_order(order_id=ORD-1) -> ") and "status=shipped" in lookup
    assert refund.startswith("issue_refund(order_id=ORD-2, amount=12.5) -> ")


def test_a_preference_replaced_twice_keeps_only_the_latest_change() -> None:
    state = extract(
        [
            user("I prefer an aisle seat."),
            user("Actually, a window seat instead."),
            user("Hmm, I'd prefer a middle seat after all. I prefer the vegetarian meal."),
        ]
    )
    assert state.preferences == (
        Preference("Hmm, I'd prefer a middle seat after all.", "Actually, a window seat instead."),
        Preference("I prefer the vegetarian meal."),
    )


def test_user_decisions_and_open_tasks_are_kept() -> None:
    state = extract([user("Let's go with the 9:40 flight. I still need to send the invoice.")])
    assert state.decisions == ("Let's go with the 9:40 flight.",)
    assert state.open_tasks == ("I still need to send the invoice.",)


def test_text_tool_results_keep_their_error_lines() -> None:
    log = "\n".join([*(f"step {i} ok" for i in range(50)), "src/billing/proration.py:88: Error"])
    items = [
        call("c1", "run_tests", {"path": "tests/"}),
        chat_item({"role": "tool", "tool_call_id": "c1", "content": log}),
    ]
    (fact,) = extract(items).facts
    assert fact == 'run_tests(path=tests/) -> "src/billing/proration.py:88: Error"'


def test_responses_items_are_extracted_too() -> None:
    items = [
        responses_item({"type": "message", "role": "user", "content": "Never book red-eyes."}),
        responses_item(
            {
                "type": "function_call",
                "call_id": "fc_1",
                "name": "book",
                "arguments": '{"flight": "LH-1234", "price": 420, "currency": "EUR"}',
            }
        ),
    ]
    state = extract(items)
    assert state.constraints == ("Never book red-eyes.",)
    assert state.pending == (Pending("book(flight=LH-1234, price=420, currency=EUR)", "fc_1"),)
    assert "420 EUR" in state.entities and "LH-1234" in state.entities


# --- rendering ------------------------------------------------------------------------------


def test_render_is_stable_and_holds_no_call_ids_or_times(counter: TokenCounter) -> None:
    state = extract(support_thread())
    text = render(state, counter, 2000)
    assert text == render(extract(support_thread()), counter, 2000)
    assert text.startswith(f"{SUMMARY_MARKER} Stands for 9 earlier items")
    assert not re.search(r"call_a\d|\d{2}:\d{2}Z|T\d{2}:00", text)
    assert counter.text(text) <= 2000


def test_rendered_text_reads_back_to_the_same_rendering(counter: TokenCounter) -> None:
    state = extract(support_thread())
    text = render(state, counter, 2000)
    assert render(parse(text), counter, 2000) == text
    assert parse(text).count == 9


def test_json_round_trip(counter: TokenCounter) -> None:
    state = extract(support_thread())
    assert from_json(to_json(state)) == state
    assert to_json(from_json(to_json(state))) == to_json(state)


@pytest.mark.parametrize(
    "body",
    ['"x"', "[]", '{"count": -1}', '{"constraints": "x"}', '{"pending": [{"text": 3}]}'],
)
def test_malformed_json_states_are_value_errors(body: str) -> None:
    with pytest.raises(ValueError):
        from_json(body)


def test_an_older_digest_format_is_parsed_without_its_call_ids() -> None:
    old = (
        f"{SUMMARY_MARKER} Stands for 6 earlier items no longer sent verbatim. Tool facts ...\n"
        "Constraints stated by the user (their words):\n- Never refund twice.\n"
        "Verified facts from tool results:\n"
        '- lookup_order call_1: {"status": "shipped"}\n'
        "Pending actions (called, no result seen):\n"
        '- refund_order call_2 {"order_id":"ORD-1"}\n'
        "User requests:\n- Refund it.\n"
    )
    state = parse(old)
    assert state.count == 6 and state.constraints == ("Never refund twice.",)
    assert state.facts == ('lookup_order: {"status": "shipped"}',)
    assert state.pending == (Pending('refund_order {"order_id":"ORD-1"}'),)
    assert state.requests == ("Refund it.",)


def test_foreign_text_becomes_an_earlier_summary() -> None:
    assert parse("The user wants a refund.") == MemoryState(earlier=("The user wants a refund.",))


def test_must_keep_survives_before_nice_to_keep(counter: TokenCounter) -> None:
    state = extract(support_thread())
    full = render(state, counter, 4000)
    small = render(state, counter, 260)
    assert counter.text(small) <= 260
    assert "User requests:" in full and "User requests:" not in small
    for kept in state.constraints + state.decisions:
        assert kept in small


def test_older_entries_are_not_evicted_for_newer_ones(counter: TokenCounter) -> None:
    items: list[Item] = []
    for n in range(1, 7):
        items += [
            call(f"call_{n}", "issue_refund", {"order_id": f"ORD-{n}", "amount": 10 * n}),
            result(f"call_{n}", {"refund_id": f"RF-{n}", "status": "done"}),
        ]
    state = extract(items)
    text = render(state, counter, 150)
    kept = [n for n in range(1, 7) if f"RF-{n}," in text or f"RF-{n}\n" in text]
    assert kept and kept == list(range(1, len(kept) + 1))  # the first refund goes last


def test_re_summarizing_keeps_every_earlier_must_keep_entry(counter: TokenCounter) -> None:
    thread = support_thread()
    first = summarize_turns(thread[:4], counter, 1000, None)
    second = summarize_turns(thread[4:], counter, 1000, first)
    text = second.text()
    assert "Stands for 9 earlier items" in text
    for kept in must_keep(thread[:4]) + must_keep(thread[4:]):
        assert kept in text


def test_merge_equals_extracting_in_one_go() -> None:
    thread = support_thread()
    assert merge(extract(thread[:4]), extract(thread[4:])) == extract(thread)


# --- properties -----------------------------------------------------------------------------

_words = st.sampled_from(
    [
        "never",
        "refund",
        "ORD-17",
        "RF-2",
        "1800 EUR",
        "$30",
        "budget",
        "I prefer",
        "window seat",
        "aisle seat",
        "instead",
        "I'll",
        "approve",
        "pending",
        "anna@x.example.org",
        "only",
        "no",
        "3.11",
        "the",
        "flight",
        "e.g.",
        "must",
        "later",
    ]
)
_sentence = st.lists(_words, min_size=1, max_size=12).map(lambda ws: " ".join(ws) + ".")
_message = st.lists(_sentence, min_size=1, max_size=4).map(" ".join)


@st.composite
def conversations(draw: st.DrawFn) -> list[Item]:
    items: list[Item] = []
    for turn in range(draw(st.integers(1, 6))):
        items.append(user(draw(_message)))
        if draw(st.booleans()):
            call_id = f"call_{turn}"
            amount = draw(st.integers(1, 5000))
            items.append(call(call_id, "pay", {"order_id": f"ORD-{turn}", "amount": amount}))
            if draw(st.booleans()):
                items.append(result(call_id, {"status": "ok", "receipt": f"RC-{turn}"}))
        items.append(assistant(draw(_message)))
    return items


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(conversations())
def test_must_keep_is_kept_by_a_render_with_room(items: list[Item]) -> None:
    counter = TokenCounter.for_model("gpt-4o")
    state = extract(items)
    text = render(state, counter, 100_000)
    for kept in must_keep(items):
        assert kept in text
    assert render(parse(text), counter, 100_000) == text  # a digest reads back whole
    assert from_json(to_json(state)) == state


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(conversations(), st.integers(0, 600))
def test_render_never_exceeds_the_budget_when_the_header_fits(
    items: list[Item], max_tokens: int
) -> None:
    counter = TokenCounter.for_model("gpt-4o")
    state = extract(items)
    text = render(state, counter, max_tokens)
    assert text.startswith(SUMMARY_MARKER)
    header_tokens = counter.text(text.split("\n", 1)[0])
    if header_tokens <= max_tokens:
        assert counter.text(text) <= max_tokens
    assert text == render(state, counter, max_tokens)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(conversations(), st.integers(60, 500))
def test_summarize_turns_fits_its_item_budget(items: list[Item], max_tokens: int) -> None:
    counter = TokenCounter.for_model("gpt-4o")
    summary = summarize_turns(items, counter, max_tokens, None)
    assert counter.item(summary) <= max_tokens


def test_referenced_values_are_the_entities_later_items_mention() -> None:
    later = [
        user("What happened to refund RF-5501 of 89.99 EUR?"),
        call("call_9", "lookup_refund", {"refund_id": "RF-5502"}),
    ]
    assert referenced_values(later) == frozenset({"RF-5501", "89.99 EUR", "RF-5502"})


def test_deeply_nested_results_are_walked_to_a_bounded_depth() -> None:
    deep = '{"next": ' * 400 + '{"refund_id": "RF-1"}' + "}" * 400
    text = '{"id": "ORD-1", "deep": ' + deep + "}"
    items = [
        call("c1", "f", {}),
        chat_item({"role": "tool", "tool_call_id": "c1", "content": text}),
    ]
    (fact,) = extract(items).facts
    assert fact == "f() -> id=ORD-1"


def test_a_result_nested_past_the_json_parser_is_text() -> None:
    text = "[" * 100_000 + "]" * 100_000
    items = [
        call("c1", "f", {}),
        chat_item({"role": "tool", "tool_call_id": "c1", "content": text}),
    ]
    (fact,) = extract(items).facts
    assert fact.startswith('f() -> "[[[')


def test_guard_appends_what_an_llm_state_lost(counter: TokenCounter) -> None:
    reference = extract(support_thread())
    written = MemoryState(
        count=9,
        constraints=(reference.constraints[0],),
        decisions=("Refunded the order.",),
        entities=("ORD-7731",),
    )
    guarded = guard(written, reference)
    assert guarded.constraints == reference.constraints  # present: not repeated
    assert guarded.decisions[0] == "Refunded the order."
    assert guarded.decisions[1:] == reference.decisions
    assert guarded.entities.count("ORD-7731") == 1
    text = render(guarded, counter, 100_000)
    assert all(kept in text for kept in reference.must_keep())
    assert guard(guarded, reference) == guarded


def test_a_change_of_mind_replaces_the_preference_on_its_subject() -> None:
    state = extract(
        [
            user("I prefer a window seat."),
            user("Actually, make it an aisle seat. Actually, the order never arrived."),
        ]
    )
    assert state.preferences == (
        Preference("Actually, make it an aisle seat.", "I prefer a window seat."),
    )


def test_compressed_results_are_read_for_their_facts_and_excerpts(counter: TokenCounter) -> None:
    log = "\n".join([*(f"step {i} ok" for i in range(400)), "src/billing/proration.py:88: Error"])
    json_body = {"order": {"id": "ORD-9", "status": "lost"}, "rows": ["x" * 90] * 200}
    items = [
        call("c1", "run_tests", {}),
        compress_tool_output(
            chat_item({"role": "tool", "tool_call_id": "c1", "content": log}),
            None,
            200,
            counter,
        ),
        call("c2", "lookup", {}),
        compress_tool_output(result("c2", json_body), None, 200, counter),
    ]
    tests, lookup = extract(items).facts
    assert tests.startswith('run_tests() -> "') and "proration.py:88: Error" in tests
    assert lookup.startswith("lookup() -> order.id=ORD-9, order.status=lost")


def test_a_log_result_is_remembered_by_its_error_line_not_its_first_lines() -> None:
    """A 160-line log with one `ERROR` line in the middle (upper case, as services log):
    the digest's fact is that line (it was the log's first lines: the error was lost)."""
    from proxy.core.items import responses_item
    from proxy.core.memory import summarize_turns
    from proxy.core.tokens import TokenCounter

    lines = [
        f"2026-11-30T10:{i % 60:02d}:00Z INFO payments-api p99 {100 + i}ms" for i in range(160)
    ]
    lines.insert(55, "ERROR pg: remaining connection slots are reserved")
    lines.insert(90, "FATAL: the database system is shutting down")
    items = [
        responses_item({"type": "message", "role": "user", "content": "Check payments-api."}),
        responses_item(
            {"type": "function_call", "call_id": "c1", "name": "query_logs", "arguments": "{}"}
        ),
        responses_item(
            {"type": "function_call_output", "call_id": "c1", "output": "\n".join(lines)}
        ),
    ]
    text = summarize_turns(items, TokenCounter.for_model("gpt-4o"), 600, None).text()
    assert "ERROR pg: remaining connection slots are reserved" in text
    assert "FATAL: the database system is shutting down" in text
    assert "INFO payments-api" not in text


def test_a_change_of_plan_replaces_the_preference_on_its_subject() -> None:
    """ "Change of plan: I want a window seat, not aisle." was kept only as a request, so
    an LLM summary (which has no requests section) lost it while the aisle seat stood."""
    items = [
        chat_item({"role": "user", "content": "I'm vegetarian. I prefer an aisle seat."}),
        chat_item({"role": "assistant", "content": "Noted."}),
        chat_item({"role": "user", "content": "Change of plan: I want a window seat, not aisle."}),
        chat_item({"role": "assistant", "content": "Noted, a window seat."}),
    ]
    state = extract(items)
    [preference] = state.preferences
    assert preference.text == "Change of plan: I want a window seat, not aisle."
    assert preference.changed_from == "I prefer an aisle seat."
    assert preference.text in state.must_keep()
    # Without a stated preference on the subject, "I want" is a request, not a preference.
    assert extract([chat_item({"role": "user", "content": "I want a refund."})]).preferences == ()


def test_a_decision_the_assistant_labels_is_a_decision() -> None:
    said = "Decision: we offer Nordwind a 12% discount if they sign this quarter."
    assert extract([assistant(said)]).decisions == (said,)


def test_ids_of_listed_elements_are_facts_not_entities(counter: TokenCounter) -> None:
    """A lookup listing nine deals put every deal id among the entities, which rank above
    tool facts: in a 60-turn agent run they filled the summary and pushed the user's later
    instructions and the assistant's decisions out (bench/fidelity.py, sales agent)."""
    body = {
        "account": "ACC-1001",
        "deals": [{"deal": f"D-{i:05d}", "value_eur": 100 * i} for i in range(9)],
        "refund": {"refund_id": "RF-77", "amount": 12.5, "currency": "EUR"},
    }
    state = extract(
        [call("call_1", "get_account", {"account": "ACC-1001"}), result("call_1", body)]
    )
    assert "D-00001" in state.facts[0]
    assert "D-00001" not in state.entities
    assert {"ACC-1001", "RF-77", "12.5 EUR"} <= set(state.entities)


def test_a_warning_inside_a_result_leads_its_fact_and_ranks_first(counter: TokenCounter) -> None:
    """The warning sat in the last key of a long record: the fact was cut before it, and
    older routine facts took the summary's room first."""
    warning = "WARN contract CT-3390 expires 2026-12-31, renewal not started"
    items: list[Item] = []
    for n in range(12):
        record: dict[str, Any] = {
            "account": f"ACC-{n}",
            "contacts": [{"name": f"Contact {i}", "role": "buyer"} for i in range(6)],
            "deals": [{"deal": f"D-{n}{i:03d}", "stage": "proposal"} for i in range(9)],
        }
        if n == 9:
            record["notes"] = warning
        items += [
            call(f"call_{n}", "get_account", {"account": f"ACC-{n}"}),
            result(f"call_{n}", record),
        ]
    state = extract(items)
    assert warning in state.facts[9]
    assert any(warning in kept for kept in state.must_keep())
    assert warning in render(state, counter, 250)


def test_a_change_of_plan_alone_is_a_preference_when_its_subject_is_known() -> None:
    """A summary block of a later chunk of the chain does not see the earlier block's
    "I prefer an aisle seat.": the change of plan was filed as a request, which an LLM
    summary has no section for, and 8 of 17 travel requests lost it (bench/fidelity.py)."""
    said = "Change of plan: I want a window seat, not aisle."
    state = extract([chat_item({"role": "user", "content": said})])
    assert [p.text for p in state.preferences] == [said]
    assert said in state.must_keep()
    # Without an explicit change, "I'd like" names a request, not a preference.
    asked = "I'd like to book a room for Friday."
    assert extract([chat_item({"role": "user", "content": asked})]).preferences == ()


def test_a_pending_mcp_approval_is_listed_as_pending_until_answered() -> None:
    ask = responses_item(
        {
            "type": "mcp_approval_request",
            "id": "mcpr_9",
            "server_label": "shop",
            "name": "refund",
            "arguments": json.dumps({"order": "ORD-4410", "amount": "80 EUR"}),
        }
    )
    state = extract([responses_item({"role": "user", "content": "Refund it."}), ask])
    assert [p.call_id for p in state.pending] == ["mcpr_9"]
    assert state.pending[0].text.startswith("approval requested: shop.refund(")
    assert "ORD-4410" in state.pending[0].text
    answer = {"type": "mcp_approval_response", "approval_request_id": "mcpr_9", "approve": True}
    assert extract([responses_item(answer)], state).pending == ()


def tracking_log() -> str:
    events = [f"2026-11-{d:02d}T0{d % 9}:15:00Z in transit at hub HB-{d % 4}" for d in range(1, 28)]
    events.insert(19, "2026-11-20T08:40:00Z held at locker, pickup code E119-97")
    return "\n".join(events)


def test_the_digest_carries_a_rare_line_that_reports_no_error() -> None:
    """A log's one rare line is the signal even when it reports no error: the digest's
    gist follows the plan's rank (TextPlan.signal_lines), not the first lines."""
    log = chat_item({"role": "tool", "tool_call_id": "c1", "content": tracking_log()})
    items = [call("c1", "track_parcel", {"order": "ORD-1"}), log]
    fact = next(f for f in extract(items).facts if f.startswith("track_parcel"))
    assert "pickup code E119-97" in fact


def test_the_digest_carries_a_json_lists_outlier_record_and_rare_string() -> None:
    points = [{"t": f"14:{m:02d}", "p99_ms": 180 + (m * 37) % 240} for m in range(60)]
    points[36]["p99_ms"] = 5363
    notes = [
        f"2026-11-{d:02d}T10:00:00Z call logged by ana: follow-up scheduled" for d in range(1, 21)
    ]
    notes.insert(
        12, "2026-11-13T10:00:00Z legal hold: do not contact until 2027-07-15 (dispute 437)"
    )
    items = [
        call("c1", "query_metrics", {"metric": "p99"}),
        result("c1", {"metric": "payments-api p99", "points": points}),
        call("c2", "get_account", {"account": "ACC-7093"}),
        result("c2", {"account": "ACC-7093", "activity": notes}),
    ]
    facts = extract(items).facts
    assert '"p99_ms": 5363' in facts[0]
    assert "legal hold: do not contact until 2027-07-15 (dispute 437)" in facts[1]


def test_the_digest_carries_the_line_a_turn_names_by_number() -> None:
    code = []
    for n in range(30):
        code += [f"def helper_{n}(value, factor={n + 2}):", f"    return value * factor + {n}", ""]
    code[55] = "    rounding = ROUND_DOWN"
    items = [
        call("c1", "read_file", {"path": "billing/tax.py"}),
        result("c1", {"path": "billing/tax.py", "content": "\n".join(code)}),
        assistant("Read it."),
        user("I think line 56 of billing/tax.py explains the rounding bug."),
    ]
    fact = next(f for f in extract(items).facts if f.startswith("read_file"))
    assert "rounding = ROUND_DOWN" in fact


def test_the_digest_leads_with_verified_facts_and_marks_the_assistants_words(
    counter: TokenCounter,
) -> None:
    """Facts first (seed 3.3): tool(arguments) -> values, then the user's own words, the
    assistant's statements last and labelled unverified."""
    text = render(extract(support_thread()), counter, 4000)
    titles = [line for line in text.splitlines() if line.endswith(":")]
    assert titles[0] == "Verified facts from tool results:"
    assert titles.index("Constraints stated by the user (their words):") == 1
    assert titles[-1] == "Said by the assistant (not verified):"
    assert "- lookup_order(order_id=ORD-7731) -> order.id=ORD-7731" in text


def test_an_instruction_scoped_to_the_work_is_a_constraint() -> None:
    """ "For this analysis: exclude ..." is a standing rule in the user's words (and so
    must-keep: an LLM summary that drops it gets it back from the guard)."""
    text = (
        "For this analysis: exclude test accounts (their ids start with TST-), and report in EUR."
    )
    assert constraints(text) == [text]
    assert not is_rule("For this reason the test fails.")


def tool_text(call_id: str, text: str) -> Item:
    return chat_item({"role": "tool", "tool_call_id": call_id, "content": text})


def routine_warnings(service: str) -> str:
    """A log of one service's routine warnings: every line the same template."""
    return "\n".join(
        f"2026-11-14T14:{m:02d}:10Z WARN {service} slow request path=/v2/cart "
        f"took={900 + 37 * m}ms trace={m:016x}"
        for m in range(40)
    )


def latency_series(spike: int) -> str:
    points = [f"14:{m:02d} p99={180 + (m * 37) % 240}ms" for m in range(60)]
    points[36] = f"14:36 p99={spike}ms"
    return "\n".join(points)


def test_a_series_outlier_outranks_routine_warnings_in_a_small_digest(
    counter: TokenCounter,
) -> None:
    """A fact carrying a series' one outlier ranks with the facts that report an error:
    over budget, the spike survives before the fourth log of routine warnings (all of
    which say WARN, none of which says anything new)."""
    items: list[Item] = []
    for n, service in enumerate(("cart", "orders")):
        items += [
            call(f"c{n}", "query_logs", {"service": service}),
            tool_text(f"c{n}", routine_warnings(service)),
        ]
    items += [call("m1", "query_metrics", {"metric": "p99"}), tool_text("m1", latency_series(5446))]
    for n, service in enumerate(("gateway", "search", "auth")):
        items += [
            call(f"d{n}", "query_logs", {"service": service}),
            tool_text(f"d{n}", routine_warnings(service)),
        ]
    state = extract(items)
    metrics = next(f for f in state.facts if f.startswith("query_metrics"))
    assert "p99=5446ms (outlier)" in metrics
    assert metrics in state.must_keep()
    text = render(state, counter, 250)
    assert "p99=5446ms" in text
    assert sum(line.startswith("- query_logs") for line in text.splitlines()) < 5


def test_the_digest_keeps_a_compressed_results_outlier_record_whole(
    counter: TokenCounter,
) -> None:
    """A compressed JSON result keeps its series' outlier record whole (`points[36]`);
    the digest of that form keeps it as the record, not as loose `t=`, `p99_ms=` values."""
    points = [{"t": f"14:{m:02d}", "p99_ms": 180 + (m * 37) % 240} for m in range(60)]
    points[36]["p99_ms"] = 4973
    raw = result("c1", {"metric": "payments-api p99", "points": points})
    first = call("c1", "query_metrics", {"metric": "p99"})
    compressed = compress_tool_output(raw, first, 200, counter)
    assert '"points[36]": {"t": "14:36", "p99_ms": 4973}' in compressed.text()
    fact = extract([first, compressed]).facts[0]
    assert 'points[36]={"t": "14:36", "p99_ms": 4973}' in fact


def test_the_digest_quotes_a_named_code_line_verbatim() -> None:
    """The spaces inside a quoted line are the line's: `timeout = 30  # seconds` is
    what a later turn (or a reader's search) finds, not `timeout = 30 # seconds`."""
    lines = []
    for n in range(30):
        lines += [f"def helper_{n}(value, factor={n + 2}):", f"    return value * factor + {n}", ""]
    lines[55] = "    timeout = 30  # seconds"
    listing = "\n".join(f"{n:>4} | {line}" for n, line in enumerate(lines, start=1))
    items = [
        call("c1", "read_file", {"path": "billing/tax.py"}),
        tool_text("c1", "==> billing/tax.py <==\n" + listing),
        assistant("Read it."),
        user("I think line 56 of billing/tax.py, the client timeout, is too short."),
    ]
    fact = next(f for f in extract(items).facts if f.startswith("read_file"))
    assert "timeout = 30  # seconds" in fact
    assert "\n" not in fact


def test_the_digest_carries_a_rare_line_that_is_also_the_last() -> None:
    """A text's last line is kept by position when it is compressed; in the digest's
    gist it is still the rare line it is (TextPlan.signal_lines): the one step-free
    hotel at the end of a list of hotels, each a template of its own."""
    names = ("Casa", "Hotel", "Residencia", "Maison")
    places = ("Sol", "Luz", "Mar", "Rio", "Alto", "Verde")
    rows = [
        f"{names[n % 4]} {places[n % 6]} {n + 3:<12} {70 + 7 * n:>4} EUR/night "
        f"rating {6.5 + (n % 30) / 10} step-free: no"
        for n in range(22)
    ]
    rows.append(f"{'Hotel Atlantico':<24} 171 EUR/night rating 8.7 step-free: yes")
    items = [call("c1", "search_hotels", {"city": "Lisbon"}), tool_text("c1", "\n".join(rows))]
    fact = extract(items).facts[0]
    assert "Hotel Atlantico 171 EUR/night rating 8.7 step-free: yes" in fact


def test_a_facts_rare_string_outranks_plain_facts_in_a_small_digest(
    counter: TokenCounter,
) -> None:
    """A JSON fact leading with what stands out of its lists (`activity[12]=legal hold:
    ...`) ranks with the facts that report an error, before the plain facts of accounts
    whose lists hold nothing unusual."""
    items: list[Item] = []
    for n in range(6):
        notes = [f"2026-11-{d:02d}T10:00:00Z call logged by ana: follow-up" for d in range(1, 21)]
        if n == 3:
            notes.insert(12, "2026-11-13T10:00:00Z legal hold: do not contact (dispute 437)")
        account = f"ACC-{7000 + n}"
        items += [
            call(f"c{n}", "get_account", {"account": account}),
            result(f"c{n}", {"account": account, "city": "Lyon", "activity": notes}),
        ]
    state = extract(items)
    held = next(f for f in state.facts if "ACC-7003" in f)
    assert "legal hold: do not contact (dispute 437)" in held
    assert held in state.must_keep()
    text = render(state, counter, 400)
    assert "legal hold" in text
    assert sum(line.startswith("- get_account") for line in text.splitlines()) < 6


def test_a_small_gist_shows_each_class_of_signal_before_a_second_of_one() -> None:
    """Four lines of 200 characters: a second rare error does not push out the one rare
    line that reports no error (the config change behind both)."""
    lines = [
        f"2026-11-14T14:{m:02d}:00Z INFO worker job {m} done in {100 + m}ms" for m in range(40)
    ]
    lines.insert(
        10,
        "2026-11-14T14:10:30Z ERROR payments: card processor timeout after 30000ms on "
        "attempt 3 of 3 (gateway=adyen-eu)",
    )
    lines.insert(
        20,
        "2026-11-14T14:20:30Z ERROR ledger: write conflict on account ACC-1 retried 5 times "
        "then gave up (tx=88ab12)",
    )
    lines.insert(30, POOL_CHANGE)
    items = [call("c1", "query_logs", {"service": "payments"}), tool_text("c1", "\n".join(lines))]
    fact = extract(items).facts[0]
    assert "card processor timeout" in fact
    assert POOL_CHANGE in fact


POOL_CHANGE = "2026-11-14T14:30:30Z INFO db.pool: max_connections lowered to 20 by deploy 8812"


def test_the_digest_lists_every_id_of_a_short_list_of_records() -> None:
    """Few records, every identifier (the shape's ids, FEW_IDS), not the first eight and
    a count: any of them may be the one a later turn asks about."""
    rows = [
        {"account_id": f"ACC-{100000 + 7919 * n}", "plan": "team", "mrr_eur": 20.5 + n * 31}
        for n in range(20)
    ]
    items = [call("c1", "run_sql", {"sql": "SELECT * FROM churned"}), result("c1", {"rows": rows})]
    fact = extract(items).facts[0]
    assert all(row["account_id"] in fact for row in rows)
    assert "(+12 more)" not in fact


def test_a_fact_that_stands_out_is_essential_like_one_with_ids(counter: TokenCounter) -> None:
    """Facts holding ids rank first when over budget; a fact whose one record stands out
    of its list (the only step-free hotel, no id in it) ranks with them, not after."""
    items: list[Item] = []
    for n in range(5):
        offers = [{"flight": f"LH{1000 + 37 * n + k}", "price_eur": 90 + k} for k in range(25)]
        items += [
            call(f"f{n}", "search_flights", {"to": f"city {n}"}),
            result(f"f{n}", {"offers": offers}),
        ]
    hotels = [
        {"hotel": f"Casa {name} {k}", "eur_night": 80 + 7 * k, "step_free": "no"}
        for k, name in enumerate(["Sol", "Mar", "Rio", "Luz", "Alto"] * 4)
    ]
    hotels.insert(9, {"hotel": "Hotel Atlantico", "eur_night": 92, "step_free": "yes"})
    items += [call("h1", "search_hotels", {"city": "Porto"}), result("h1", {"hotels": hotels})]
    state = extract(items)
    fact = next(f for f in state.facts if f.startswith("search_hotels"))
    assert '"hotel": "Hotel Atlantico"' in fact
    for budget in (400, 560, 700):
        assert "Hotel Atlantico" in render(state, counter, budget)
