"""What the provider receives once a thread outgrows its window (issue 10, item 4): the
summary keeps the user's rules stated without a pin pattern, never files fragments of an
e-mail address or a version as rules, keeps tool values nested in results and arguments,
and holds no call ids."""

from __future__ import annotations

import json
import re
from typing import Any

from proxy.core.memory import SUMMARY_MARKER

RULES = "My rules: total budget 1800 EUR, no red-eye flights, and I'm vegetarian."
OPENING = (
    "Customer Anna (anna.berg@shop.example.org) says her headphones never arrived. "
    f"The tooling needs Python 3.11 only. {RULES}"
)


def turn_input(turn: int) -> list[dict[str, Any]]:
    log = [f"fare {i} for LH-{100 + turn}: class {i % 5}, seat map row {i}" for i in range(60)]
    said = OPENING if turn == 0 else f"Check flight LH-{100 + turn}."
    return [
        {"role": "user", "content": said},
        {
            "type": "function_call",
            "call_id": f"call_{turn}",
            "name": "hold_fare",
            "arguments": json.dumps({"flight": f"LH-{100 + turn}", "amount": 400 + turn}),
        },
        {
            "type": "function_call_output",
            "call_id": f"call_{turn}",
            "output": json.dumps(
                {
                    "request_id": f"req_{turn}x9",
                    "served_by": "fares-eu-2",
                    "data": {"hold": {"hold_id": f"HLD-{turn}", "status": "held"}, "log": log},
                }
            ),
        },
    ]


def summary_of(inputs: list[dict[str, Any]]) -> str | None:
    for item in inputs:
        content = item.get("content")
        if isinstance(content, str) and content.startswith(SUMMARY_MARKER):
            return content
    return None


async def converse(proxy: Any, turns: list[list[dict[str, Any]]]) -> None:
    """One conversation through the proxy, a Responses turn per input."""
    client = proxy.client()
    conversation = await client.conversations.create()
    for turn in turns:
        await client.responses.create(model="gpt-4o", conversation=conversation.id, input=turn)


async def test_summaries_keep_unpinned_rules_and_nested_values(make_proxy) -> None:  # type: ignore[no-untyped-def]
    proxy = await make_proxy(window=6000)
    await converse(proxy, [turn_input(turn) for turn in range(14)])
    summaries = [summary_of(r.json["input"]) for r in proxy.provider.model_requests]
    summarized = [s for s in summaries if s is not None]
    assert summarized, "the thread never outgrew its window"
    for summary in summarized:
        assert RULES in summary
        constraints = summary.split("Constraints stated by the user (their words):\n")[1]
        rule_lines = constraints.split("\n\n")[0].splitlines()
        assert "- org) says her headphones never arrived." not in rule_lines
        assert "- 11 only." not in rule_lines
        assert not re.search(r"\bcall_\d+\b", summary)  # no call ids
        assert "req_" not in summary and "fares-eu-2" not in summary  # no transport metadata
        assert "HLD-0" in summary and "LH-100" in summary  # ids from results and arguments


def account_turn(turn: int) -> list[dict[str, Any]]:
    """A sales agent's turn: a lookup whose result lists nine deals (ids the conversation
    never mentions), the assistant's answer; three turns plant what must be kept."""
    said = {
        3: "From now on summarize accounts in bullet points, not paragraphs.",
    }.get(turn, f"Look up ACC-{1000 + turn}.")
    answer = {
        5: "Decision: we offer Nordwind a 12% discount if they sign this quarter.",
    }.get(turn, f"- ACC-{1000 + turn}: nothing urgent.")
    record: dict[str, Any] = {
        "account": f"ACC-{1000 + turn}",
        "deals": [
            {"deal": f"D-{turn:02d}{i:03d}", "stage": "proposal", "value_eur": 1000 * i}
            for i in range(9)
        ],
        "contacts": [{"name": f"Contact {i}", "role": "buyer"} for i in range(4)],
    }
    if turn == 7:
        record["notes"] = "WARN contract CT-3390 expires 2026-12-31, renewal not started"
    return [
        {"role": "user", "content": said},
        {
            "type": "function_call",
            "call_id": f"call_acc_{turn}",
            "name": "get_account",
            "arguments": json.dumps({"account": f"ACC-{1000 + turn}"}),
        },
        {
            "type": "function_call_output",
            "call_id": f"call_acc_{turn}",
            "output": json.dumps(record),
        },
        {"role": "assistant", "content": answer},
    ]


KEPT = ("bullet points, not paragraphs", "12% discount", "CT-3390 expires 2026-12-31")


async def test_long_agent_thread_keeps_instructions_decisions_and_warnings(make_proxy) -> None:  # type: ignore[no-untyped-def]
    """Regression: in a 60-turn agent run the ids of every listed deal filled the summary,
    so a "from now on" instruction, the assistant's "Decision:" and a warning inside a
    lookup result went missing from half the requests (bench/fidelity.py, sales agent)."""
    proxy = await make_proxy(window=6000)
    await converse(proxy, [account_turn(turn) for turn in range(40)])
    checked = 0
    for request in proxy.provider.model_requests:
        sent = json.dumps(request.json["input"])
        summary = summary_of(request.json["input"])
        if summary is None:
            continue
        for text in KEPT:
            assert text in sent, (text, summary)
        entities = summary.split("Entities (ids, references, amounts):\n")[-1]
        assert "- D-01003\n" not in entities  # a listed deal nobody named is no entity
        checked += 1
    assert checked >= 25, checked  # the thread was cut early and kept cut


def reused_id_history(turns: int) -> list[dict[str, Any]]:
    """A chat history whose every tool call has the id "call_0", as some providers and
    local servers answer: valid (an output answers the call just before it). The first
    result is small, the later ones large; the tools alternate."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You scan parcels."}]
    for turn in range(turns):
        rows = [
            f"row {i} of batch {turn}: parcel ORD-{1000 + i}" for i in range(120 if turn else 3)
        ]
        function = {"name": ("scan", "weigh")[turn % 2], "arguments": json.dumps({"batch": turn})}
        messages += [
            {"role": "user", "content": f"Check batch {turn}."},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"id": "call_0", "type": "function", "function": function}],
            },
            {"role": "tool", "tool_call_id": "call_0", "content": json.dumps({"rows": rows})},
            {"role": "assistant", "content": f"Batch {turn} checked."},
        ]
    return [*messages, {"role": "user", "content": "Anything damaged?"}]


async def test_tool_call_ids_reused_across_turns_are_compressed_and_cut_in_order(
    make_proxy,
) -> None:  # type: ignore[no-untyped-def]
    """A compressed output took the log position of the first output with its call id,
    so a compressed later "call_0" looked sent before the earlier one: the projection
    raised InvariantViolation and the client got a 500. Compression also named the
    tool of the thread's last "call_0" on every output."""
    proxy = await make_proxy(window=6000)
    client = proxy.client()
    for turns in (6, 12, 24):
        await client.chat.completions.create(model="gpt-4o", messages=reused_id_history(turns))
        sent = proxy.provider.model_requests[-1].json["messages"]
        assert sent[-1] == {"role": "user", "content": "Anything damaged?"}
        compressed = 0
        for index, message in enumerate(sent):
            if message["role"] != "tool":
                continue
            [call] = sent[index - 1]["tool_calls"]  # right after its call
            if "threadkeeper_compressed" in message["content"]:
                compressed += 1
                facts = json.loads(message["content"])["threadkeeper_compressed"]
                assert facts["tool"] == call["function"]["name"]
        assert compressed >= 4
