import json
import re
from collections.abc import Sequence
from dataclasses import replace
from itertools import pairwise

import pytest

from proxy.core.items import Item, chat_item, responses_item
from proxy.core.memory import SUMMARY_MARKER, is_summary, summary_item
from proxy.core.projection import (
    SUMMARY_MAX_TOKENS,
    SUMMARY_MIN_TOKENS,
    SUMMARY_SHARE,
    ContextLengthExceeded,
    CutPoint,
    Projection,
    ProjectionPolicy,
    ProjectionRequest,
    chunk_digest,
    project_context,
)
from proxy.core.tokens import REPLY_PRIMING, TokenCounter

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
    return ProjectionRequest(items, window=window, output=500, epsilon=100, **kwargs)  # type: ignore[arg-type]


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


def compressed_calls(projection: Projection) -> list[str | None]:
    return [i.output_for for i in projection.items if "threadkeeper_compressed" in str(i.raw)]


def test_large_results_are_compressed_from_the_end_of_the_prefix(counter: TokenCounter) -> None:
    """The prompt cache keys an exact prefix: a result rewritten at position p costs
    everything after it, so the newest results are compressed first, as many as leave
    room for one more turn like the recent ones; the older ones stay whole."""
    items = chat_history(6, rows=40)
    total = recount(counter, items, request(items, 0))
    projection = project_context(request(items, total - 400 + 600), counter, POLICY)
    assert projection.changed and projection.report.compressed >= 1
    assert projection.report.summarized == 0 and projection.report.dropped == 0
    assert compressed_calls(projection) == ["call_4", "call_5"]
    report = projection.report
    typical = (counter.items(chat_turn(4, rows=40)) + counter.items(chat_turn(5, rows=40))) // 2
    assert report.history_after <= report.history_budget - typical
    # The prefix up to the first compressed result is sent as it was.
    first = next(n for n, i in enumerate(projection.items) if i.output_for == "call_4")
    assert projection.items[:first] == tuple(items[:first])
    # Everything else is sent as it was, in its place.
    assert [i for i in projection.items if i.kind != "tool_output"] == [
        i for i in items if i.kind != "tool_output"
    ]
    assert projection.cut is not None and projection.cut.start == 0


def test_a_later_relief_compresses_only_the_results_after_the_last_compressed(
    counter: TokenCounter,
) -> None:
    """The turns closed since the last relief are compressed, not the older results still
    whole: the prefix keeps everything up to the first of the new ones."""
    items = chat_history(6, rows=40)
    window = recount(counter, items, request(items, 0)) + 200
    first = project_context(request(items, window), counter, POLICY)
    assert compressed_calls(first) == ["call_4", "call_5"]
    later = [*items[:-1], *chat_turn(6, rows=40), *chat_turn(7, rows=40), *chat_turn(8)[:1]]
    second = project_context(request(later, window, cut=first.cut), counter, POLICY)
    assert second.report.summarized == 0
    assert compressed_calls(second) == ["call_4", "call_5", "call_6", "call_7"]
    # All the first request sent but its current turn (the question answered since).
    assert second.items[: len(first.items) - 1] == first.items[:-1]


def test_all_large_results_are_compressed_at_once_when_the_newest_are_not_enough(
    counter: TokenCounter,
) -> None:
    """When the results after the last compressed one do not bring the history under its
    budget, every large result is compressed in the same request: the change reaches the
    oldest one anyway, once, instead of a little earlier at every relief."""
    items = chat_history(6, rows=40)
    window = recount(counter, items, request(items, 0)) + 200
    first = project_context(request(items, window), counter, POLICY)
    later = [*items[:-1], *chat_turn(6, rows=40), *chat_turn(7, rows=40), *chat_turn(8)[:1]]
    second = project_context(request(later, window - 1500, cut=first.cut), counter, POLICY)
    assert second.report.summarized == 0
    assert compressed_calls(second) == [f"call_{n}" for n in range(8)]


def test_old_turns_are_summarized_down_to_the_target(counter: TokenCounter) -> None:
    items = chat_history(40)
    projection = project_context(request(items, 2500), counter, POLICY)
    report = projection.report
    assert report.summarized > 0
    assert report.history_after <= POLICY.target_fill * report.history_budget
    cut = projection.cut
    assert cut is not None and cut.opening > 1  # the system message and the first turns
    assert projection.items[: cut.opening] == tuple(items[: cut.opening])
    assert projection.items[cut.opening].text().startswith(SUMMARY_MARKER)
    assert projection.items[-1] == items[-1]
    assert report.prompt_tokens == recount(counter, projection.items, request(items, 2500))
    assert report.prompt_tokens <= 2500 - 500 - 100
    assert cut.summary == projection.items[: cut.opening + 1]


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
    summary = next(item for item in sent if is_summary(item))
    assert summary.raw == {"type": "message", "role": "developer", "content": summary.text()}
    for index, item in enumerate(sent):
        if item.kind == "reasoning":
            assert sent[index + 1].kind == "tool_calls"
    assert projection.report.prompt_tokens <= 3000 - 600


def test_custom_summarizer_is_used(counter: TokenCounter) -> None:
    def summarizer(items: Sequence[Item], _c: TokenCounter, _m: int, _p: Item | None) -> Item:
        return summary_item("chat", f"{SUMMARY_MARKER} {len(items)} items about orders.")

    projection = project_context(request(chat_history(40), 2500), counter, POLICY, summarizer)
    summaries = [item for item in projection.items if is_summary(item)]
    assert len(summaries) == 1 and summaries[0].text().endswith("items about orders.")


def test_report_serializes_for_logs(counter: TokenCounter) -> None:
    projection = project_context(request(chat_history(40), 2500), counter, POLICY)
    data = projection.report.as_dict()
    json.dumps(data)
    kinds = {block["kind"] for block in data["blocks"]}  # type: ignore[attr-defined]
    assert kinds == {"pinned", "summary", "turn", "current"}


# --- issue 10: a summary is never dropped; summary room; the summary chain --------------------


def stands_for(summaries: Sequence[Item]) -> int:
    """How many earlier items a chain of summary blocks says it stands for."""
    found = [
        re.match(re.escape(SUMMARY_MARKER) + r" Stands for (\d+)", s.text()) for s in summaries
    ]
    assert all(found)
    return sum(int(m.group(1)) for m in found if m)


def booking_history(turns: int) -> list[Item]:
    items = [chat_item({"role": "system", "content": "You are a travel agent."})]
    for n in range(turns):
        items += [
            chat_item({"role": "user", "content": f"Q{n}: hotel {n} must be near the station."}),
            chat_item({"role": "assistant", "content": f"Booked hotel {n}, ref BK-{n}."}),
        ]
    return items


def test_summary_is_never_dropped_when_the_recent_turns_fill_the_budget(
    counter: TokenCounter,
) -> None:
    """Issue 10 (travel thread): the recent turns left 2 tokens of a 4686-token budget, the
    summary got no room and was dropped with the cut stored; from then on the summary
    stood for 4 earlier items instead of 13. Now the earlier summary stays in the chain
    and more turns are cut into a new block until it fits."""
    first_items = [*booking_history(200), chat_item({"role": "user", "content": "Q200: flights"})]
    big = "lorem ipsum " * 900
    later = [
        *first_items,
        chat_item({"role": "assistant", "content": f"Flights: {big}"}),
        chat_item({"role": "user", "content": "Q201: and trains?"}),
        chat_item({"role": "assistant", "content": f"Trains: {big}"}),
        chat_item({"role": "user", "content": "Pick one."}),
    ]
    recent = counter.items(later[-5:-1])
    fixed = counter.item(later[0]) + REPLY_PRIMING + counter.item(later[-1])
    window = fixed + recent + 2 + 500 + 100  # the two recent turns leave 2 tokens
    policy = replace(POLICY, keep_opening_share=0)  # the window is sized without a head
    first = project_context(request(first_items, window), counter, policy)
    assert first.cut is not None and len(first.cut.chain) == 1
    earlier = first.cut.chain[0]
    second = project_context(request(later, window, cut=first.cut), counter, policy)
    report = second.report
    assert report.history_budget == recent + 2
    assert report.dropped == 0 and report.history_after <= report.history_budget
    assert second.cut is not None
    chain = second.cut.chain
    assert chain[0] == earlier and chain[0].raw == earlier.raw  # the earlier block, as sent
    cut_items = second.cut.start - 1  # everything before the window but the system message
    assert stands_for(chain) == cut_items == report.summarized
    assert second.items[: len(first.cut.summary)] == first.cut.summary
    assert second.items[-1] == later[-1]


def test_summary_that_cannot_get_its_floor_is_refused_with_the_breakdown(
    counter: TokenCounter,
) -> None:
    items = [*booking_history(30), chat_item({"role": "user", "content": "word " * 400})]
    fixed = counter.item(items[0]) + REPLY_PRIMING + counter.item(items[-1])
    window = fixed + SUMMARY_MIN_TOKENS - 1 + 500 + 100
    with pytest.raises(ContextLengthExceeded) as caught:
        project_context(request(items, window), counter, POLICY)
    message = str(caught.value)
    assert caught.value.report.history_budget == SUMMARY_MIN_TOKENS - 1
    assert f"replaced by a {SUMMARY_MIN_TOKENS}-token summary" in message
    assert f"current turn {caught.value.report.current}" in message
    # one token more and the whole history stands in a summary of at least the floor
    projection = project_context(request(items, window + 1), counter, POLICY)
    assert projection.report.dropped == 0 and projection.cut is not None
    assert stands_for(projection.cut.chain) == len(items) - 2


def test_summary_room_is_not_starved_by_a_large_current_turn(counter: TokenCounter) -> None:
    """The room of a block comes from the budget without the current turn, and older
    turns are cut to give it that room."""
    items = [*chat_history(150)[:-1], chat_item({"role": "user", "content": "word " * 3000})]
    projection = project_context(request(items, 9000), counter, POLICY)
    report = projection.report
    capacity = report.history_budget + report.current + report.system - REPLY_PRIMING
    assert report.history_budget < 6000 < capacity
    room = min(SUMMARY_MAX_TOKENS, int(capacity * SUMMARY_SHARE))
    assert [c.max_tokens for c in projection.chunks] == [room]
    assert projection.cut is not None and projection.cut.deferred is None
    assert projection.chunks[0].summary == projection.cut.chain[0]


def test_squeezed_block_takes_its_full_room_when_room_returns(counter: TokenCounter) -> None:
    """When the recent turns and a large current turn leave a block less than its room,
    it is sent smaller, its full form is kept in the cut, and a later request that has
    the room sends the full form in its place, the bytes before it unchanged."""
    recent = [
        chat_item({"role": "user", "content": "Q90: compare the two routes"}),
        chat_item({"role": "assistant", "content": "Route A: " + "lorem " * 700}),
    ]
    items = [*booking_history(60), *recent, chat_item({"role": "user", "content": "x " * 1500})]
    fixed = counter.item(items[0]) + REPLY_PRIMING + counter.item(items[-1])
    window = fixed + counter.items(items[-5:-1]) + 150 + 600  # two recent turns, 150 left
    first = project_context(request(items, window), counter, POLICY)
    assert first.cut is not None and first.cut.deferred is not None
    squeezed = first.cut.chain[-1]
    assert counter.item(squeezed) < counter.item(first.cut.deferred)
    assert [c.max_tokens for c in first.chunks] == [150]
    assert counter.items(first.items[-5:-1]) + 150 == first.report.history_budget
    small = [*items[:-1], chat_item({"role": "user", "content": "Thanks."})]
    second = project_context(request(small, window, cut=first.cut), counter, POLICY)
    assert second.cut is not None and second.cut.deferred is None
    assert second.cut.chain[-1] == first.cut.deferred
    before = first.items.index(squeezed)
    assert second.items[:before] == first.items[:before]
    assert second.items[before] == first.cut.deferred


def test_successive_cuts_append_blocks_until_the_chain_is_consolidated(
    counter: TokenCounter,
) -> None:
    items = booking_history(10)
    cut = None
    chains: list[tuple[Item, ...]] = []
    for n in range(10, 400):
        items += [
            chat_item({"role": "user", "content": f"Q{n}: hotel {n} must be near the station."}),
            chat_item({"role": "assistant", "content": f"Booked hotel {n}, ref BK-{n}."}),
        ]
        projection = project_context(
            request([*items, chat_item({"role": "user", "content": "next"})], 3000, cut=cut),
            counter,
            POLICY,
        )
        cut = projection.cut
        if cut is not None and (not chains or cut.chain != chains[-1]):
            chains.append(cut.chain)
    appended = consolidated = 0
    for before, after in pairwise(chains):
        if after[: len(before)] == before:
            assert len(after) == len(before) + 1
            appended += 1
        else:
            assert len(after) == 1  # a consolidation: one block for the whole chain
            assert stands_for(after) > stands_for(before)
            consolidated += 1
    assert appended >= 3 and consolidated >= 1
    # The chain stands for every item before the window that is not sent verbatim (the
    # system message and the opening head are).
    assert cut is not None and cut.opening > 1
    assert stands_for(cut.chain) == cut.start - cut.opening


def test_stateless_cuts_fall_on_whole_chunks_and_repeat_their_bytes(
    counter: TokenCounter,
) -> None:
    """Without a stored cut, the same history prefix gives the same blocks: the next
    request (one more turn) sends the previous one's summary blocks first, unchanged."""
    items = booking_history(60)
    previous: Projection | None = None
    extended = kept = 0
    for n in range(60, 260):
        items += [
            chat_item({"role": "user", "content": f"Q{n}: hotel {n} must be near the station."}),
            chat_item({"role": "assistant", "content": f"Booked hotel {n}, ref BK-{n}."}),
        ]
        req = request([*items, chat_item({"role": "user", "content": "next"})], 3000)
        projection = project_context(replace(req, stateless=True), counter, POLICY)
        assert projection.report.dropped == 0
        assert projection.report.prompt_tokens <= 3000 - 600
        chain = tuple(i for i in projection.items if is_summary(i))
        assert tuple(c.summary for c in projection.chunks) == chain
        assert stands_for(chain) == projection.report.summarized
        if previous is not None:
            before = tuple(i for i in previous.items if is_summary(i))
            if chain == before:
                kept += 1
                sent = len(previous.items) - 1  # all but the previous current turn
                assert projection.items[:sent] == previous.items[:sent]
            elif chain[: len(before)] == before:
                extended += 1
        previous = projection
    assert kept > 150 and extended >= 3


def test_ready_summaries_are_used_by_chunk_digest(counter: TokenCounter) -> None:
    items = [*booking_history(150), chat_item({"role": "user", "content": "next"})]
    req = replace(request(items, 3000), stateless=True)
    first = project_context(req, counter, POLICY)
    assert first.chunks and not any(c.ready for c in first.chunks)
    chunk = first.chunks[0]
    assert chunk.digest == chunk_digest(chunk.items, chunk.max_tokens, chunk.previous)
    better = summary_item("chat", f"{SUMMARY_MARKER} Stands for {len(chunk.items)} earlier items.")
    too_big = summary_item("chat", f"{SUMMARY_MARKER} " + "x " * (chunk.max_tokens + 10))
    second = project_context(replace(req, summaries={chunk.digest: better}), counter, POLICY)
    assert second.chunks[0].ready and second.chunks[0].summary == better
    assert better in second.items
    third = project_context(replace(req, summaries={chunk.digest: too_big}), counter, POLICY)
    assert [i.raw for i in third.items] == [i.raw for i in first.items]


def test_a_stateless_cut_is_the_cut_a_stored_thread_would_hold(counter: TokenCounter) -> None:
    """The stateless client's requests send what a stored thread's requests send, turn by
    turn (the cut replayed from the history), and the replay cache changes no byte."""
    from proxy.core import projection as module

    items = booking_history(60)
    cut = None
    for n in range(60, 140):
        items += [chat_item({"role": "user", "content": f"Q{n}: hotel {n} near the park."})]
        stored = project_context(request(items, 3000, cut=cut), counter, POLICY)
        warm = project_context(request(items, 3000, stateless=True), counter, POLICY)
        module._replays.clear()
        cold = project_context(request(items, 3000, stateless=True), counter, POLICY)
        assert [i.raw for i in warm.items] == [i.raw for i in cold.items]
        assert [i.raw for i in warm.items] == [i.raw for i in stored.items]
        assert warm.report == stored.report
        cut = stored.cut
        items.append(chat_item({"role": "assistant", "content": f"Booked hotel {n}, ref BK-{n}."}))


def test_a_stateless_history_that_fits_is_not_replayed(
    counter: TokenCounter, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The hot path: a history that fits whole needs no replay (each earlier request of it
    fit too), so it costs one projection."""
    from proxy.core import projection as module

    def no_replay(*_: object) -> None:
        raise AssertionError("replayed a history that fits")

    monkeypatch.setattr(module, "_replayed_cut", no_replay)
    items = [*booking_history(20), chat_item({"role": "user", "content": "next"})]
    projection = project_context(request(items, 16000, stateless=True), counter, POLICY)
    assert projection.items == tuple(items) and projection.cut is None


def test_a_long_stateless_history_is_replayed_at_its_cuts_only(
    counter: TokenCounter, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The work is bounded by the cuts, not by the requests: a request that fits as the
    cut left it is skipped, so a 1,200-turn history does not cost 1,200 projections."""
    from proxy.core import projection as module

    calls: list[int] = []
    project = module._project

    def counted(request: ProjectionRequest, *args: object) -> Projection:
        calls.append(len(request.items))
        return project(request, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(module, "_project", counted)
    module._replays.clear()
    items = [*booking_history(1200), chat_item({"role": "user", "content": "next"})]
    projection = project_context(request(items, 3000, stateless=True), counter, POLICY)
    assert projection.cut is not None
    assert len(calls) < 1200 / 10  # one per cut (about every 25 turns here), and the last
    # Each replayed request projects a stored thread's window, not the whole history
    # (only the request itself is given whole).
    assert calls[-1] == len(items) and max(calls[:-1]) < 200


def test_a_cut_that_counted_the_chain_as_consolidated_consolidates_it(
    counter: TokenCounter,
) -> None:
    """A cut sizes itself for a consolidated chain when the chain and a block of full room
    would pass summary_chain_max_share; it then consolidates even when the block it made
    is small. It used to append the small block and consolidate at the very next cut:
    two prefix changes a few requests apart (the sales run in bench/fidelity.py)."""
    capacity = 3000 - 500 - 100 - REPLY_PRIMING
    room = max(SUMMARY_MIN_TOKENS, min(SUMMARY_MAX_TOKENS, int(capacity * SUMMARY_SHARE)))
    chain_max = int(capacity * POLICY.summary_chain_max_share)
    items = [*booking_history(100), chat_item({"role": "user", "content": "next"})]

    def block(count: int, tokens: int) -> Item:
        head = f"{SUMMARY_MARKER} Stands for {count} earlier items no longer sent verbatim."
        text = head + "\n- noted" * tokens
        while counter.item(summary_item("chat", text)) > tokens:
            text = text[: -len("\n- noted")]
        return summary_item("chat", text)

    # The chain and a full block would pass the share; the chain and a small one would not.
    chain = (block(20, (chain_max - room) // 2 + 10), block(20, (chain_max - room) // 2 + 10))
    assert counter.items(chain) + room > chain_max >= counter.items(chain) + room // 2
    cut = CutPoint(start=41, summary=(items[0], *chain))
    # A high target_fill: counting the chain consolidated leaves a small cut to make.
    policy = replace(POLICY, target_fill=0.85)
    projection = project_context(request(items, 3000, cut=cut), counter, policy)
    assert projection.cut is not None and projection.cut.chain != chain
    assert len(projection.cut.chain) == 1  # consolidated, now
    assert stands_for(projection.cut.chain) == projection.cut.start - 1


def test_verbatim_sends_everything_or_refuses_naming_the_sizes(counter: TokenCounter) -> None:
    """truncation "disabled" (issue 20, item 10): a history that trimming would compress
    and summarize is either sent item for item (no stored cut applied, none kept) or
    refused with the whole request's size."""
    items = chat_history(12, rows=30)
    whole = recount(counter, items, request(items, 16000))
    trimmed = project_context(request(items, whole + 200), counter, POLICY)
    assert trimmed.changed  # what "auto" does with this window
    stored = CutPoint(5, (summary_item("chat", f"{SUMMARY_MARKER}\nearlier"),))
    fits = request(items, whole + 600, cut=stored, verbatim=True)
    sent = project_context(fits, counter, POLICY)
    assert sent.items == tuple(items) and not sent.changed and sent.cut is None
    assert (sent.report.dropped, sent.report.compressed, sent.report.summarized) == (0, 0, 0)
    assert sent.report.prompt_tokens == whole
    with pytest.raises(ContextLengthExceeded) as caught:
        project_context(request(items, whole + 200, verbatim=True), counter, POLICY)
    message = str(caught.value)
    assert f"maximum context length is {whole + 200} tokens" in message
    assert f"resulted in {whole + 600} tokens" in message  # the output reserve and margin
    assert "truncation is 'disabled'" in message
