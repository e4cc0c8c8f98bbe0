import json
from collections.abc import Sequence

import pytest

from proxy.core.items import Item, chat_item, responses_item
from proxy.core.memory import SUMMARY_MARKER, summary_item
from proxy.core.projection import (
    ContextLengthExceeded,
    CutPoint,
    ProjectionPolicy,
    ProjectionRequest,
    project_context,
)
from proxy.core.tokens import REPLY_PRIMING, TokenCounter

NOW = "2025-01-02T03:04:05Z"
POLICY = ProjectionPolicy(keep_recent_turns=2, tool_result_max_tokens=200)


@pytest.fixture(scope="module")
def counter() -> TokenCounter:
    return TokenCounter.for_model("gpt-4o")


def chat_turn(n: int, rows: int = 0) -> list[Item]:
    """A user question answered through one tool call; `rows` makes the result large."""
    result = {
        "status": "shipped",
        "order": n,
        "rows": [{"i": i, "t": "lorem " * 8} for i in range(rows)],
    }
    function = {"name": "lookup_order", "arguments": json.dumps({"order": n})}
    return [
        chat_item({"role": "user", "content": f"Where is order {n}?"}),
        chat_item(
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"id": f"call_{n}", "type": "function", "function": function}],
            }
        ),
        chat_item({"role": "tool", "tool_call_id": f"call_{n}", "content": json.dumps(result)}),
        chat_item({"role": "assistant", "content": f"Order {n} has shipped."}),
    ]


def chat_history(turns: int, rows: int = 0) -> list[Item]:
    items = [chat_item({"role": "system", "content": "You are a support agent."})]
    for n in range(turns):
        items += chat_turn(n, rows)
    return [*items, chat_item({"role": "user", "content": "And the last one?"})]


def request(items: Sequence[Item], window: int, **kwargs: object) -> ProjectionRequest:
    return ProjectionRequest(items, window=window, output=500, epsilon=100, now=NOW, **kwargs)  # type: ignore[arg-type]


def recount(counter: TokenCounter, items: Sequence[Item], req: ProjectionRequest) -> int:
    return counter.items(items) + req.instructions_tokens + req.tools_tokens + REPLY_PRIMING


def test_fitting_history_is_sent_unchanged(counter: TokenCounter) -> None:
    items = chat_history(3)
    projection = project_context(request(items, 16000), counter, POLICY)
    assert projection.items == tuple(items)
    assert projection.changed is False and projection.cut is None
    report = projection.report
    assert report.prompt_tokens == recount(counter, items, request(items, 16000))
    assert report.history_before == report.history_after
    assert (report.dropped, report.compressed, report.summarized) == (0, 0, 0)


def test_budget_breakdown_adds_up(counter: TokenCounter) -> None:
    items = chat_history(3)
    req = ProjectionRequest(items, 16000, 500, 100, tools_tokens=40, instructions_tokens=12)
    r = project_context(req, counter, POLICY).report
    assert r.history_budget == r.window - r.system - r.tools - r.current - r.output - r.epsilon
    assert r.prompt_tokens == r.system + r.tools + r.current + r.history_after
    assert r.system == counter.item(items[0]) + 12 + REPLY_PRIMING
    assert r.current == counter.item(items[-1])


def test_old_tool_results_are_compressed_first(counter: TokenCounter) -> None:
    items = chat_history(6, rows=40)
    total = recount(counter, items, request(items, 0))
    projection = project_context(request(items, total - 400 + 600), counter, POLICY)
    assert projection.changed and projection.report.compressed >= 1
    assert projection.report.summarized == 0 and projection.report.dropped == 0
    compressed = [i for i in projection.items if "threadkeeper_compressed" in str(i.raw)]
    assert compressed[0].output_for == "call_0"
    # the last keep_recent_turns turns are untouched
    assert projection.items[-9:] == tuple(items[-9:])
    assert projection.cut is not None and projection.cut.start == 0


def test_old_turns_are_summarized_down_to_the_target(counter: TokenCounter) -> None:
    items = chat_history(40)
    projection = project_context(request(items, 2500), counter, POLICY)
    report = projection.report
    assert report.summarized > 0
    assert report.history_after <= POLICY.target_fill * report.history_budget
    assert projection.items[0] == items[0]
    assert projection.items[1].text().startswith(SUMMARY_MARKER)
    assert projection.items[-1] == items[-1]
    assert report.prompt_tokens == recount(counter, projection.items, request(items, 2500))
    assert report.prompt_tokens <= 2500 - 500 - 100
    assert projection.cut is not None and projection.cut.summary == projection.items[:2]


def test_sticky_cut_keeps_the_prefix_on_the_next_turn(counter: TokenCounter) -> None:
    items = chat_history(40)
    first = project_context(request(items, 2500), counter, POLICY)
    later = items + chat_turn(99)[1:] + [chat_item({"role": "user", "content": "thanks"})]
    second = project_context(request(later, 2500, cut=first.cut), counter, POLICY)
    assert second.items[: len(first.items)] == first.items
    assert second.cut == first.cut


def test_live_window_with_the_cut_equals_the_full_history(counter: TokenCounter) -> None:
    items = chat_history(40)
    first = project_context(request(items, 2500), counter, POLICY)
    assert first.cut is not None
    later = [
        *items,
        chat_item({"role": "assistant", "content": "ok"}),
        chat_item({"role": "user", "content": "one more"}),
    ]
    full = project_context(request(later, 2500, cut=first.cut), counter, POLICY)
    start = first.cut.start
    window = project_context(
        request(later[start:], 2500, cut=first.cut, first_position=start), counter, POLICY
    )
    assert [i.raw for i in window.items] == [i.raw for i in full.items]
    assert window.cut == full.cut


def test_cut_is_moved_back_when_a_late_output_joins_two_turns(counter: TokenCounter) -> None:
    turn = chat_turn(7)
    items = [
        chat_item({"role": "system", "content": "You are a support agent."}),
        turn[0],
        turn[1],  # call_7, unanswered when the cut was made
        chat_item({"role": "user", "content": "still there?"}),
        turn[2],  # the late output for call_7
        chat_item({"role": "user", "content": "ok"}),
    ]
    stale = CutPoint(start=3, summary=(items[0],))  # made before the output arrived
    projection = project_context(request(items, 16000, cut=stale), counter, POLICY)
    assert projection.cut is not None and projection.cut.start == 1
    assert projection.items == tuple(items)


def test_stale_cut_beyond_the_history_never_cuts_the_current_turn(counter: TokenCounter) -> None:
    items = chat_history(2)
    stale = CutPoint(start=10_000, summary=(items[0],))
    projection = project_context(request(items, 16000, cut=stale), counter, POLICY)
    assert projection.items == (items[0], items[-1])
    assert projection.cut is not None and projection.cut.start == len(items) - 1


def test_current_turn_too_large_raises_with_the_breakdown(counter: TokenCounter) -> None:
    items = [*chat_history(2)[:-1], chat_item({"role": "user", "content": "word " * 3000})]
    with pytest.raises(ContextLengthExceeded) as caught:
        project_context(request(items, 2000), counter, POLICY)
    report = caught.value.report
    message = str(caught.value)
    assert message.startswith("This model's maximum context length is 2000 tokens.")
    assert f"current turn {report.current}" in message and "output reserve 500" in message
    assert report.history_budget < 0


def test_responses_history_keeps_reasoning_with_its_call(counter: TokenCounter) -> None:
    items = [responses_item({"role": "developer", "content": "Be terse."})]
    for n in range(30):
        items += [
            responses_item({"role": "user", "content": f"question {n}"}),
            responses_item(
                {
                    "type": "reasoning",
                    "id": f"rs_{n}",
                    "summary": [],
                    "encrypted_content": "x" * 400,
                }
            ),
            responses_item(
                {"type": "function_call", "call_id": f"c{n}", "name": "search", "arguments": "{}"}
            ),
            responses_item(
                {"type": "function_call_output", "call_id": f"c{n}", "output": "result " * 300}
            ),
        ]
    items.append(responses_item({"role": "user", "content": "done?"}))
    projection = project_context(request(items, 3000), counter, POLICY)
    sent = projection.items
    assert sent[1].raw == {"type": "message", "role": "developer", "content": sent[1].text()}
    for index, item in enumerate(sent):
        if item.kind == "reasoning":
            assert sent[index + 1].kind == "tool_calls"
    assert projection.report.prompt_tokens <= 3000 - 600


def test_custom_summarizer_is_used(counter: TokenCounter) -> None:
    def summarizer(items: Sequence[Item], _c: TokenCounter, _m: int, _p: Item | None) -> Item:
        return summary_item("chat", f"{SUMMARY_MARKER} {len(items)} items about orders.")

    projection = project_context(request(chat_history(40), 2500), counter, POLICY, summarizer)
    assert projection.items[1].text().endswith("items about orders.")


def test_report_serializes_for_logs(counter: TokenCounter) -> None:
    projection = project_context(request(chat_history(40), 2500), counter, POLICY)
    data = projection.report.as_dict()
    json.dumps(data)
    kinds = {block["kind"] for block in data["blocks"]}  # type: ignore[attr-defined]
    assert kinds == {"pinned", "summary", "turn", "current"}
