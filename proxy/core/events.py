"""The Responses stream's event vocabulary: every event name the proxy reads or writes,
and the builders of the events it writes itself (issue 23, item 3).

Names and fields follow OpenAI's Response*Event schemas (/work/shared/openapi): an event
is built as `(name, fields)` without `type` and `sequence_number`, and a `Numbering`
gives it both, in the order the stream writes them. A writer never spells an event name
or its fields anywhere else: the checks (proxy/core/answers.py), the accumulator
(proxy/sse.py) and the writers (chat_translate.py, the ledger's holdback, local answers)
read them here.

>>> numbering = Numbering()
>>> numbering.events([item_added(0, {"type": "message", "id": "msg_1"})])
[{'type': 'response.output_item.added', 'output_index': 0, 'item': {'type': 'message', 'id': 'msg_1'}, 'sequence_number': 0}]
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from proxy.core.items import JsonDict

CREATED = "response.created"
IN_PROGRESS = "response.in_progress"
QUEUED = "response.queued"
COMPLETED = "response.completed"
INCOMPLETE = "response.incomplete"
FAILED = "response.failed"
ERROR = "error"
ITEM_ADDED = "response.output_item.added"
ITEM_DONE = "response.output_item.done"
PART_ADDED = "response.content_part.added"
PART_DONE = "response.content_part.done"
TEXT_DELTA = "response.output_text.delta"
TEXT_DONE = "response.output_text.done"
REFUSAL_DELTA = "response.refusal.delta"
REFUSAL_DONE = "response.refusal.done"
REASONING_DELTA = "response.reasoning_text.delta"
REASONING_DONE = "response.reasoning_text.done"
ARGUMENTS_DELTA = "response.function_call_arguments.delta"
ARGUMENTS_DONE = "response.function_call_arguments.done"
CUSTOM_INPUT_DELTA = "response.custom_tool_call_input.delta"
CUSTOM_INPUT_DONE = "response.custom_tool_call_input.done"

# The events carrying the whole Response: a snapshot before any output, the last word.
SNAPSHOT_EVENTS = frozenset({CREATED, IN_PROGRESS, QUEUED})
TERMINAL_EVENTS = frozenset({COMPLETED, INCOMPLETE, FAILED})
ITEM_EVENTS = frozenset({ITEM_ADDED, ITEM_DONE})
PART_EVENTS = frozenset({PART_ADDED, PART_DONE})


# The text of a content part, by the part's type: its delta and done events and the field
# that holds the text (in the part and in the done event).
PART_TEXT: dict[str, tuple[str, str, str]] = {
    "output_text": (TEXT_DELTA, TEXT_DONE, "text"),
    "refusal": (REFUSAL_DELTA, REFUSAL_DONE, "refusal"),
    "reasoning_text": (REASONING_DELTA, REASONING_DONE, "text"),
}
# Each part event by name: the part type it writes and the field it sets.
PART_DELTAS = {delta: (kind, key) for kind, (delta, _, key) in PART_TEXT.items()}
PART_DONES = {done: (kind, key) for kind, (_, done, key) in PART_TEXT.items()}
# Events addressing one content part of an output item (`content_index` required).
CONTENT_EVENTS = PART_EVENTS | PART_DELTAS.keys() | PART_DONES.keys()
# A call item's text: its delta and done events, by the item field they set.
ITEM_DELTAS = {ARGUMENTS_DELTA: "arguments", CUSTOM_INPUT_DELTA: "input"}
ITEM_DONES = {ARGUMENTS_DONE: "arguments", CUSTOM_INPUT_DONE: "input"}
# Delta events whose `delta` text the accumulator appends; done events, the text field
# they must carry.
DELTA_TEXT = frozenset(PART_DELTAS.keys() | ITEM_DELTAS.keys())
DONE_TEXT = {done: key for done, (_, key) in PART_DONES.items()} | ITEM_DONES

Event = tuple[str, JsonDict]  # a name and its fields, before it is numbered


class Numbering:
    """Gives the events of one stream their `type` and `sequence_number`, counting from
    `start` in the order they are numbered."""

    def __init__(self, start: int = 0) -> None:
        self.next = start

    def event(self, name: str, fields: JsonDict) -> JsonDict:
        numbered = {"type": name, **fields, "sequence_number": self.next}
        self.next += 1
        return numbered

    def events(self, events: Iterable[Event]) -> list[JsonDict]:
        return [self.event(name, fields) for name, fields in events]


# -- content parts and items ----------------------------------------------------------------


def text_part(text: str) -> JsonDict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def content_part(kind: str, text: str) -> JsonDict:
    """A part of `kind` (output_text, refusal, reasoning_text) holding `text`."""
    if kind == "output_text":
        return text_part(text)
    return {"type": kind, PART_TEXT[kind][2]: text}


def message_item(item_id: str, parts: list[JsonDict], status: str = "completed") -> JsonDict:
    return {
        "id": item_id,
        "type": "message",
        "status": status,
        "role": "assistant",
        "content": parts,
    }


def reasoning_item(item_id: str, parts: list[JsonDict], status: str = "completed") -> JsonDict:
    """A ReasoningItem whose text is the model's own (`content`, reasoning_text parts)."""
    return {"id": item_id, "type": "reasoning", "status": status, "summary": [], "content": parts}


def call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> JsonDict:
    return {
        "id": item_id,
        "type": "function_call",
        "status": status,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
    }


# -- events -----------------------------------------------------------------------------------


def snapshot(name: str, response: JsonDict) -> Event:
    """response.created / .in_progress / .queued, or a terminal event."""
    return name, {"response": response}


def item_added(output_index: int, item: JsonDict) -> Event:
    return ITEM_ADDED, {"output_index": output_index, "item": item}


def item_done(output_index: int, item: JsonDict) -> Event:
    return ITEM_DONE, {"output_index": output_index, "item": item}


def _at(item_id: Any, output_index: int, content_index: int) -> JsonDict:
    return {"item_id": item_id, "output_index": output_index, "content_index": content_index}


def part_added(item_id: Any, output_index: int, content_index: int, part: JsonDict) -> Event:
    return PART_ADDED, {**_at(item_id, output_index, content_index), "part": part}


def part_done(item_id: Any, output_index: int, content_index: int, part: JsonDict) -> Event:
    return PART_DONE, {**_at(item_id, output_index, content_index), "part": part}


def part_delta(kind: str, item_id: Any, output_index: int, content_index: int, delta: str) -> Event:
    """A delta of a part's text (output_text deltas carry `logprobs`, as OpenAI's do)."""
    fields = {**_at(item_id, output_index, content_index), "delta": delta}
    if kind == "output_text":
        fields["logprobs"] = []
    return PART_TEXT[kind][0], fields


def part_text_done(
    kind: str, item_id: Any, output_index: int, content_index: int, text: str
) -> Event:
    _, name, key = PART_TEXT[kind]
    fields = {**_at(item_id, output_index, content_index), key: text}
    if kind == "output_text":
        fields["logprobs"] = []
    return name, fields


def arguments_delta(item_id: Any, output_index: int, delta: str) -> Event:
    return ARGUMENTS_DELTA, {"item_id": item_id, "output_index": output_index, "delta": delta}


def arguments_done(item_id: Any, output_index: int, name: Any, arguments: str) -> Event:
    fields = {"item_id": item_id, "output_index": output_index, "name": name}
    return ARGUMENTS_DONE, {**fields, "arguments": arguments}


def error_event(error: JsonDict) -> Event:
    """The `error` event for a failure: its fields flat, as OpenAI sends them, and nested
    under `error`, where the SDKs read them."""
    shaped = {
        "message": str(error.get("message") or "The provider failed this answer."),
        "type": error.get("type") if isinstance(error.get("type"), str) else "server_error",
        "param": error.get("param") if isinstance(error.get("param"), str) else None,
        "code": error.get("code") if isinstance(error.get("code"), str) else None,
    }
    flat = {key: shaped[key] for key in ("code", "message", "param")}
    return ERROR, {**flat, "error": shaped}


def item_events(output_index: int, item: JsonDict) -> list[Event]:
    """A finished item as the events OpenAI streams for it, its text in one delta each:
    a message's or reasoning item's parts, a function call's arguments; any other item
    is added and done whole."""
    kind = item.get("type")
    item_id = item.get("id")
    if kind in ("message", "reasoning"):
        parts = item.get("content") or ()
        events = [item_added(output_index, {**item, "status": "in_progress", "content": []})]
        for index, part in enumerate(parts):
            part_kind = part.get("type")
            text_of = PART_TEXT.get(part_kind) if isinstance(part_kind, str) else None
            if text_of is None:
                events += [part_added(item_id, output_index, index, part)]
            else:
                assert isinstance(part_kind, str)
                text = str(part.get(text_of[2], ""))
                events += [
                    part_added(item_id, output_index, index, {**part, text_of[2]: ""}),
                    part_delta(part_kind, item_id, output_index, index, text),
                    part_text_done(part_kind, item_id, output_index, index, text),
                ]
            events.append(part_done(item_id, output_index, index, part))
    elif kind == "function_call":
        arguments = str(item.get("arguments", ""))
        events = [
            item_added(output_index, {**item, "status": "in_progress", "arguments": ""}),
            arguments_delta(item_id, output_index, arguments),
            arguments_done(item_id, output_index, item.get("name"), arguments),
        ]
    else:
        events = [item_added(output_index, item)]
    return [*events, item_done(output_index, item)]


def response_events(response: JsonDict) -> list[JsonDict]:
    """OpenAI's event sequence for a finished Response whose items come whole (no
    deltas), numbered from 0: created, in_progress, each item's added and done, then the
    terminal event of its status."""
    started = {**response, "status": "in_progress", "output": [], "usage": None}
    events = [snapshot(CREATED, started), snapshot(IN_PROGRESS, started)]
    for index, item in enumerate(response.get("output") or ()):
        events += [item_added(index, item), item_done(index, item)]
    events.append(snapshot(terminal_name(response), response))
    return Numbering().events(events)


def terminal_name(response: JsonDict) -> str:
    """The terminal event of a Response's status."""
    status = response.get("status")
    return INCOMPLETE if status == "incomplete" else FAILED if status == "failed" else COMPLETED
