"""The explain record's JSON text, as its writer makes it (explain.record_text): the
record the endpoint serves, field for field."""

from __future__ import annotations

import json
import math
from typing import Any

from proxy.core import fastjson
from proxy.core.compress import COMPRESSED_KEY
from proxy.core.items import Item, chat_item, responses_item
from proxy.core.memory import SUMMARY_MARKER
from proxy.core.projection import BlockReport, Projection, ProjectionReport
from proxy.server.explain import record_text, stand_ins

COMPRESSED = json.dumps({COMPRESSED_KEY: True, "status": "shipped"})


def report(*blocks: BlockReport) -> ProjectionReport:
    return ProjectionReport(8000, 12, 40, 30, 1024, 100, 6000, 900, 300, 1400, blocks, 1, 1, 1)


def projection(items: list[Item], *blocks: BlockReport) -> Projection:
    return Projection(tuple(items), report(*blocks), None, True)


def composed(facts: dict[str, Any], shown: Projection) -> dict[str, Any]:
    """The record as a dict, the way it was composed before it was written as text."""
    return {
        **facts,
        "estimated_input_tokens": shown.report.prompt_tokens,
        "projection": shown.report.as_dict(),
        "stand_ins": stand_ins(shown),
    }


BLOCKS = (
    BlockReport("turn", 0, 4, 500, 0, "summarized"),
    BlockReport("turn", 5, 9, 400, 120, "compressed"),
    BlockReport("turn", 10, 12, 300, 300, "kept"),
)
CHAT = [
    chat_item({"role": "system", "content": "You track orders."}),
    chat_item({"role": "system", "content": f"{SUMMARY_MARKER}\nORD-1 and ORD-2 shipped."}),
    chat_item({"role": "user", "content": "Where is ORD-3?"}),
    chat_item(
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
            ],
        }
    ),
    chat_item({"role": "tool", "tool_call_id": "c1", "content": COMPRESSED}),
    chat_item({"role": "tool", "tool_call_id": "c2", "content": "plain result"}),
]
RESPONSES = [
    responses_item({"type": "message", "role": "developer", "content": SUMMARY_MARKER + " x"}),
    responses_item(
        {"type": "function_call_output", "call_id": "c1", "output": [{"text": COMPRESSED}]}
    ),
    responses_item({"type": "function_call_output", "call_id": "c2", "output": {"k": 1}}),
    responses_item({"type": "message", "role": "user", "content": SUMMARY_MARKER}),
]
FACTS: dict[str, Any] = {
    "object": "threadkeeper.request",
    "id": "req_1",
    "status": 200,
    "latency_ms": 3.25,
    "thread_id": None,
    "ledger": {"verdicts": [{"call_id": "c1", "verdict": "done"}]},
}


def test_the_text_reads_back_as_the_composed_record_in_its_key_order() -> None:
    for items in (CHAT, RESPONSES):
        shown = projection(items, *BLOCKS)
        text = record_text(FACTS, shown)
        expected = composed(FACTS, shown)
        assert json.loads(text) == expected
        assert list(json.loads(text)) == list(expected)
        assert fastjson.loads(text) == expected


def test_stand_ins_are_the_summaries_and_compressed_results_in_order() -> None:
    assert [(s["position"], s["kind"]) for s in stand_ins(projection(CHAT))] == [
        (1, "summary"),
        (4, "compressed"),
    ]
    found = stand_ins(projection(RESPONSES))
    assert [(s["position"], s["kind"]) for s in found] == [(0, "summary"), (1, "compressed")]
    assert found[1]["text"] == COMPRESSED and found[1]["call_id"] == "c1"


def test_a_nan_a_huge_integer_and_a_lone_surrogate_read_back_as_they_were() -> None:
    """What orjson cannot write as itself goes through the stdlib."""
    facts = {**FACTS, "latency_ms": math.nan, "count": 2**70}
    text = record_text(facts, projection(CHAT, *BLOCKS))
    back = json.loads(text)
    assert math.isnan(back.pop("latency_ms")) and back["count"] == 2**70
    lone = [chat_item({"role": "system", "content": f"{SUMMARY_MARKER} \ud800"})]
    shown = projection(lone, BlockReport("turn", 0, 0, 10, 10, "kept"))
    assert json.loads(record_text(FACTS, shown)) == composed(FACTS, shown)


def test_facts_named_like_the_reports_parts_are_written_once() -> None:
    facts = {**FACTS, "projection": "log's own", "stand_ins": 3, "estimated_input_tokens": 1}
    shown = projection(CHAT, *BLOCKS)
    text = record_text(facts, shown)
    assert text.count('"projection"') == 1 and text.count('"stand_ins"') == 1
    assert json.loads(text) == composed(facts, shown)
