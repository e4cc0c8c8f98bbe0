"""The ledger's continuation rules (proxy/core/continuation.py), driven by hand: the test
answers each Judge / Ask command, so no store and no provider take part."""

from __future__ import annotations

from collections.abc import Generator, Sequence
from dataclasses import dataclass
from typing import Any

from proxy.core.continuation import Ask, Judge, Settled, continuation
from proxy.core.ledger import ToolCall, ToolRule
from proxy.server.api import CHAT, RESPONSES

RULES = {"refund": ToolRule(side_effect=True, idempotency_key="refund:{order}")}
SENT = {"model": "m", "input": [{"role": "user", "content": "refund 7"}], "stream": True}


@dataclass(frozen=True)
class Decided:
    call: ToolCall
    output: dict[str, Any] | None


def call_item(call_id: str, name: str = "refund") -> dict[str, Any]:
    return {"type": "function_call", "call_id": call_id, "name": name, "arguments": "{}"}


def response(*output: dict[str, Any], status: str = "completed") -> dict[str, Any]:
    return {"id": "resp_up", "object": "response", "status": status, "output": list(output)}


def message(text: str) -> dict[str, Any]:
    content = [{"type": "output_text", "text": text}]
    return {"type": "message", "role": "assistant", "content": content}


def withheld(calls: Sequence[ToolCall]) -> list[Decided]:
    return [
        Decided(c, {"type": "function_call_output", "call_id": c.call_id, "output": "done"})
        for c in calls
    ]


def handed_out(calls: Sequence[ToolCall]) -> list[Decided]:
    return [Decided(c, None) for c in calls]


def run(flow: Generator[Any, Any, Settled], *replies: Any) -> tuple[list[Any], Settled]:
    """Sends `replies` in order; the commands the flow yielded, and what it returned."""
    commands: list[Any] = []
    reply: Any = None
    pending = list(replies)
    try:
        while True:
            command = flow.send(reply)
            commands.append(command)
            reply = pending.pop(0)
            if callable(reply):
                reply = reply(command.calls)
    except StopIteration as stop:
        return commands, stop.value


def test_an_answer_whose_calls_are_handed_out_is_settled_as_it_is() -> None:
    answer = response(call_item("c1"))
    commands, settled = run(continuation(RESPONSES, SENT, answer, RULES, max_replays=2), handed_out)
    assert [type(c) for c in commands] == [Judge]
    assert commands[0].calls[0].call_id == "c1" and commands[0].answer_id == "resp_up"
    assert settled.answer == answer and settled.rounds == 0 and not settled.continued


def test_every_call_withheld_continues_upstream_with_the_synthetic_outputs() -> None:
    answer = response(call_item("c1"))
    following = {**response(message("Refunded already.")), "id": "resp_other"}
    flow = continuation(RESPONSES, SENT, answer, RULES, max_replays=2)
    commands, settled = run(flow, withheld, following, handed_out)
    assert [type(c) for c in commands] == [Judge, Ask, Judge]
    asked = commands[1].body
    assert "stream" not in asked
    assert [i.get("type") for i in asked["input"][1:]] == ["function_call", "function_call_output"]
    assert settled.continued and settled.rounds == 1
    assert settled.answer["id"] == "resp_up"  # the turn keeps its first answer's id
    assert settled.answer["output"] == [message("Refunded already.")]
    assert [i["type"] for i in settled.log] == [
        "function_call",
        "function_call_output",
        "message",
    ]
    assert [d.call.call_id for d in settled.withheld] == ["c1"]


def test_rounds_stop_at_max_replays_and_the_withheld_call_is_stripped() -> None:
    again = {**response(call_item("c2")), "id": "resp_2"}
    flow = continuation(RESPONSES, SENT, response(call_item("c1")), RULES, max_replays=1)
    commands, settled = run(flow, withheld, again, withheld)
    assert [type(c) for c in commands] == [Judge, Ask, Judge]
    assert settled.rounds == 1 and settled.answer["output"] == []


def test_a_withheld_call_beside_a_handed_out_one_is_stripped_without_continuing() -> None:
    answer = response(call_item("c1"), call_item("c2", "lookup"))
    flow = continuation(RESPONSES, SENT, answer, RULES, max_replays=2)
    commands, settled = run(flow, withheld)
    assert [type(c) for c in commands] == [Judge]
    assert settled.answer["output"] == [call_item("c2", "lookup")] and settled.rounds == 0


def test_a_failed_continuation_leaves_the_last_answer_stripped() -> None:
    flow = continuation(RESPONSES, SENT, response(call_item("c1")), RULES, max_replays=2)
    commands, settled = run(flow, withheld, None)
    assert [type(c) for c in commands] == [Judge, Ask]
    assert settled.answer["output"] == [] and settled.rounds == 0


def test_an_incomplete_answer_is_not_continued() -> None:
    answer = response(call_item("c1"), status="incomplete")
    commands, settled = run(continuation(RESPONSES, SENT, answer, RULES, max_replays=2), withheld)
    assert [type(c) for c in commands] == [Judge]
    assert settled.answer["output"] == []


def test_calls_judged_by_a_stream_are_not_judged_again() -> None:
    answer = response(call_item("c1"))
    judged = handed_out(RESPONSES.calls(answer, RULES))
    flow = continuation(RESPONSES, SENT, answer, RULES, max_replays=2, judged=judged)
    commands, settled = run(flow)
    assert commands == [] and settled.answer == answer


def test_a_chat_answer_continues_as_messages_and_loses_its_withheld_calls() -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "refund", "arguments": "{}"}}
    reply = {"role": "assistant", "content": None, "tool_calls": [call]}
    answer = {
        "id": "chat_1",
        "choices": [{"index": 0, "message": reply, "finish_reason": "tool_calls"}],
    }
    sent = {"model": "m", "messages": [{"role": "user", "content": "refund 7"}]}

    def chat_withheld(calls: Sequence[ToolCall]) -> list[Decided]:
        return [
            Decided(c, {"role": "tool", "tool_call_id": c.call_id, "content": "done"})
            for c in calls
        ]

    flow = continuation(CHAT, sent, answer, RULES, max_replays=0)
    commands, settled = run(flow, chat_withheld)
    assert [type(c) for c in commands] == [Judge]
    choice = settled.answer["choices"][0]
    assert "tool_calls" not in choice["message"] and choice["finish_reason"] == "stop"
