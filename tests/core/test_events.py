"""The Responses stream event vocabulary (proxy/core/events.py): the events it builds have
OpenAI's documented shapes, pass the proxy's own checks, and rebuild the item they carry."""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

from proxy.core import events
from proxy.core.answers import check_response_event
from proxy.sse import ResponsesStreamAccumulator

# OpenAI's OpenAPI document, cut to what the proxy serves (tests/reliability/make_spec.py;
# CI has no copy of the whole one): the Responses stream events are in it.
SPEC = Path(__file__).parent.parent / "reliability" / "openai-subset.json"
MESSAGE = events.message_item(
    "msg_1", [events.text_part("Hi there"), events.content_part("refusal", "No.")]
)
REASONING = events.reasoning_item("rs_1", [events.content_part("reasoning_text", "Hmm.")])
CALL = events.call_item("fc_1", "call_1", "f", '{"a": 1}', "completed")
COMPACTION = {"id": "cmp_1", "type": "compaction", "encrypted_content": "x"}
RESPONSE = {
    "id": "resp_1",
    "object": "response",
    "status": "completed",
    "output": [REASONING, MESSAGE, CALL],
    "usage": None,
}


@cache
def schemas() -> dict[str, dict[str, Any]]:
    """Each stream event's schema, by its `type`."""
    spec = json.loads(SPEC.read_text())
    out: dict[str, dict[str, Any]] = {}
    for schema in spec["components"]["schemas"].values():
        kind = (schema.get("properties") or {}).get("type", {}).get("enum")
        if kind and "sequence_number" in schema.get("properties", {}):
            out.setdefault(kind[0], schema)
    return out


def check_shape(event: dict[str, Any]) -> None:
    """The event has every field its schema requires, and no other."""
    schema = schemas()[event["type"]]
    assert set(schema.get("required", ())) <= set(event), event
    assert set(event) <= set(schema["properties"]), event


def streamed(response: dict[str, Any]) -> list[dict[str, Any]]:
    """Every item of `response` as item_events streams it, numbered, between its snapshot
    and terminal events."""
    numbering = events.Numbering()
    built = [events.snapshot(events.CREATED, {**response, "output": []})]
    for index, item in enumerate(response["output"]):
        built += events.item_events(index, item)
    built.append(events.snapshot(events.terminal_name(response), response))
    return numbering.events(built)


def test_every_built_event_has_its_documented_fields_and_passes_the_checks() -> None:
    sequence = streamed({**RESPONSE, "output": [*RESPONSE["output"], COMPACTION]})
    assert [e["sequence_number"] for e in sequence] == list(range(len(sequence)))
    for event in sequence:
        check_shape(event)
        check_response_event(event["type"], event)


def test_the_accumulator_rebuilds_each_item_from_its_deltas() -> None:
    accumulator = ResponsesStreamAccumulator()
    sequence = streamed(RESPONSE)
    for event in sequence[:-1]:  # no terminal event: the items come from the deltas
        if event["type"] != events.ITEM_DONE:
            accumulator.feed(event["type"], event)
    for index, item in enumerate(RESPONSE["output"]):
        built = accumulator.item(index)
        assert built is not None
        assert {k: v for k, v in built.items() if k != "status"} == {
            k: v for k, v in item.items() if k != "status"
        }


def test_a_message_streams_its_text_and_refusal_parts() -> None:
    names = [name for name, _ in events.item_events(3, MESSAGE)]
    assert names == [
        events.ITEM_ADDED,
        events.PART_ADDED,
        events.TEXT_DELTA,
        events.TEXT_DONE,
        events.PART_DONE,
        events.PART_ADDED,
        events.REFUSAL_DELTA,
        events.REFUSAL_DONE,
        events.PART_DONE,
        events.ITEM_DONE,
    ]
    added = events.item_events(3, MESSAGE)[0][1]
    assert added == {"output_index": 3, "item": {**MESSAGE, "status": "in_progress", "content": []}}


def test_a_whole_response_is_created_in_progress_items_and_its_terminal_event() -> None:
    sequence = events.response_events({**RESPONSE, "status": "incomplete"})
    assert [e["type"] for e in sequence] == [
        events.CREATED,
        events.IN_PROGRESS,
        *[events.ITEM_ADDED, events.ITEM_DONE] * 3,
        events.INCOMPLETE,
    ]
    assert sequence[0]["response"]["output"] == [] and sequence[0]["response"]["usage"] is None
    assert [e["sequence_number"] for e in sequence] == list(range(9))


def test_the_error_event_carries_its_fields_flat_and_nested() -> None:
    name, fields = events.error_event({"message": "down", "code": 5})
    assert name == events.ERROR
    assert fields == {
        "code": None,
        "message": "down",
        "param": None,
        "error": {"message": "down", "type": "server_error", "param": None, "code": None},
    }
