"""The opening head (proxy/core/projection.py, `_opening`): at a history's first cut that
summarizes turns, its opening turns stay verbatim ahead of the summary chain from then
on, never at the cost of the recent turns or of a request that would fit without it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import pytest

from proxy.core.checkpoint import cut_to_state, state_to_cut
from proxy.core.items import Item, chat_item
from proxy.core.memory import is_summary
from proxy.core.projection import (
    CutPoint,
    Projection,
    ProjectionPolicy,
    project_context,
)
from proxy.core.tokens import TokenCounter

from .test_projection import booking_history, chat_history, chat_turn, compressed_calls, request

POLICY = ProjectionPolicy(keep_recent_turns=2, tool_result_max_tokens=200)
RULES = "Q0: hotel 0 must be near the station."


@pytest.fixture(scope="module")
def counter() -> TokenCounter:
    return TokenCounter.for_model("gpt-4o")


def run(
    counter: TokenCounter,
    turns: int,
    window: int,
    policy: ProjectionPolicy = POLICY,
    stateless: bool = False,
) -> list[Projection]:
    """One booking conversation, a request per user message; a stored thread passes its
    cut on, a stateless client resends the history alone."""
    items = booking_history(0)
    cut: CutPoint | None = None
    out = []
    for n in range(turns):
        items.append(
            chat_item({"role": "user", "content": f"Q{n}: hotel {n} must be near the station."})
        )
        given = request(items, window, cut=None if stateless else cut, stateless=stateless)
        projection = project_context(given, counter, policy)
        out.append(projection)
        cut = projection.cut
        items.append(chat_item({"role": "assistant", "content": f"Booked hotel {n}, ref BK-{n}."}))
    return out


def head_of(projection: Projection) -> tuple[Item, ...]:
    cut = projection.cut
    assert cut is not None
    return projection.items[: cut.opening]


def test_the_opening_turns_stay_verbatim_ahead_of_the_chain_from_the_first_cut(
    counter: TokenCounter,
) -> None:
    projections = run(counter, 300, 3000)
    cut_at = next(i for i, p in enumerate(projections) if p.cut is not None)
    first = projections[cut_at]
    head = head_of(first)
    assert len(head) > 5 and head[0].text() == "You are a travel agent."
    assert head[1].text() == RULES  # the first user message, as said
    assert not any(is_summary(item) for item in head)
    assert is_summary(first.items[len(head)])
    chains = 0
    for later in projections[cut_at:]:
        assert later.items[: len(head)] == head  # the same bytes at every later request
        assert later.cut is not None and later.cut.opening == len(head)
        chains = max(chains, len(later.cut.chain))
    assert chains >= 2  # later cuts happened, after the head
    # The head stays within its share; the cut goes down to target_fill of what is left.
    assert counter.items(head[1:]) <= POLICY.keep_opening_share * (3000 - 500 - 100)
    assert first.report.history_after <= first.report.history_budget * POLICY.target_fill


def test_a_stateless_client_gets_the_same_head_and_bytes_as_a_stored_thread(
    counter: TokenCounter,
) -> None:
    stored = run(counter, 120, 3000)
    stateless = run(counter, 120, 3000, stateless=True)
    assert any(p.cut is not None and p.cut.opening for p in stored)
    for a, b in zip(stored, stateless, strict=True):
        assert [i.raw for i in a.items] == [i.raw for i in b.items]
    # The head is sent verbatim, not counted as trimmed.
    last = stateless[-1]
    assert last.cut is not None
    sent = len(last.items) - len(last.cut.chain)
    assert last.report.summarized == 120 * 2 - sent


def test_a_share_of_zero_makes_no_head(counter: TokenCounter) -> None:
    projections = run(counter, 120, 3000, replace(POLICY, keep_opening_share=0))
    cut = projections[-1].cut
    assert cut is not None and cut.opening == 0
    assert is_summary(projections[-1].items[1])


def test_no_head_when_the_recent_turns_need_the_room(counter: TokenCounter) -> None:
    """Turns of a quarter of the window as they arrive: the recent ones, a summary block
    and two more like them leave nothing for a head, so the cut (due although every
    tool result is compressed) summarizes from the oldest turn."""
    items = chat_history(40, rows=40)
    projection = project_context(request(items, 5000), counter, POLICY)
    assert projection.cut is not None and projection.cut.chain
    assert projection.cut.opening == 0


def test_a_cut_that_only_compresses_makes_no_head_and_a_later_summarizing_cut_does(
    counter: TokenCounter,
) -> None:
    """SPEC 5 order: older tool results are compressed first; the head forms only when
    turns are summarized, with the results in the form the request before sent them."""
    items = chat_history(6, rows=40)
    whole = project_context(request(items, 100_000), counter, POLICY).report.prompt_tokens
    compressed = project_context(request(items, whole + 600 - 300), counter, POLICY)
    assert compressed.report.compressed >= 1 and compressed.report.summarized == 0
    assert compressed.cut is not None and compressed.cut.opening == 0
    # The thread goes on with small turns until turns must be summarized.
    later = list(items)
    cut = compressed.cut
    projection = previous = compressed
    for n in range(200):
        later += [
            chat_item({"role": "assistant", "content": f"Noted {n}."}),
            chat_item({"role": "user", "content": f"Q{n}: and order {n}?"}),
        ]
        previous = projection
        projection = project_context(request(later, whole + 600 - 300, cut=cut), counter, POLICY)
        cut = projection.cut
        if cut is not None and cut.chain:
            break
    assert cut is not None and cut.chain and cut.opening > 1
    # The head is sent as the request before sent it, its compressed result too: the
    # prefix repeats up to the first summary block.
    head = projection.items[: cut.opening]
    assert [i.raw for i in head] == [i.raw for i in previous.items[: cut.opening]]
    assert any(i.raw != o.raw for i, o in zip(head, later, strict=False))  # one compressed


def big_user_turn(tokens: int) -> Item:
    return chat_item({"role": "user", "content": "Please read: " + "lorem ipsum " * (tokens // 2)})


def test_the_head_gives_way_to_a_current_turn_that_fits_only_without_it(
    counter: TokenCounter,
) -> None:
    projections = run(counter, 120, 3000)
    last = projections[-1]
    cut = last.cut
    assert cut is not None and cut.opening > 1
    head = head_of(last)
    items = booking_history(120)
    # A current turn that leaves room for the recent turns and a summary only without
    # the head: the head's turns become the chain's first block instead of a 400.
    big = big_user_turn(2400 - counter.items(head[1:]) // 2)
    projection = project_context(
        request([*items, big], 3000, cut=cut, first_position=0), counter, POLICY
    )
    new = projection.cut
    assert new is not None and new.opening == 0
    assert projection.items[0] == head[0]  # the system message stays first
    assert is_summary(projection.items[1])
    assert RULES in projection.items[1].text()  # the head's turns are summarized, not lost
    assert projection.items[-1] == big
    # The stored form of the cut says there is no head any more.
    assert state_to_cut(cut_to_state(new)) == new


def test_the_head_gives_way_when_the_recent_turns_no_longer_fit_beside_it(
    counter: TokenCounter,
) -> None:
    projections = run(counter, 120, 3000)
    cut = projections[-1].cut
    assert cut is not None and cut.opening > 1
    items: list[Item] = booking_history(120)
    for n in range(2):
        items += [
            chat_item({"role": "user", "content": f"Read document {n}."}),
            chat_item({"role": "assistant", "content": "Summary: " + "lorem ipsum " * 330}),
        ]
    items.append(chat_item({"role": "user", "content": "Compare them."}))
    projection = project_context(request(items, 3000, cut=cut), counter, POLICY)
    new = projection.cut
    assert new is not None and new.opening == 0
    assert projection.items[-5:] == tuple(items[-5:])  # both recent turns whole


def test_a_stored_cut_keeps_its_head(counter: TokenCounter) -> None:
    cut = run(counter, 120, 3000)[-1].cut
    assert cut is not None and cut.opening > 1
    assert state_to_cut(cut_to_state(cut)) == cut
    # A state whose head count does not match its summary reads as having none.
    broken = {**cut_to_state(cut), "summary_opening": len(cut.summary) + 1}
    restored = state_to_cut(broken)
    assert restored is not None and restored.opening == 0


def sent_raw(projections: Sequence[Projection]) -> list[list[object]]:
    return [[i.raw for i in p.items] for p in projections]


def test_the_head_is_deterministic(counter: TokenCounter) -> None:
    assert sent_raw(run(counter, 60, 3000)) == sent_raw(run(counter, 60, 3000))


def test_requests_with_a_head_never_exceed_the_window(counter: TokenCounter) -> None:
    for projection in run(counter, 200, 3000):
        assert projection.report.prompt_tokens <= 3000 - 500 - 100


def test_the_head_is_sized_by_the_turns_as_sent_so_compressed_turns_keep_one(
    counter: TokenCounter,
) -> None:
    """A thread whose every turn brings a large result, compressed as it closes: counted
    as they arrived, the recent turns and two more like them would leave no room for a
    head; counted as sent (compressed), they do. The first summarizing cut then keeps the
    opening turns as the request before sent them, so the prefix repeats up to the first
    summary block, and the next requests keep the head (it is not crowded out)."""
    items = chat_history(1, rows=40)
    cut: CutPoint | None = None
    previous: Projection | None = None
    projection: Projection | None = None
    for n in range(1, 60):
        items = [*items[:-1], *chat_turn(n, rows=40), items[-1]]
        projection = project_context(request(items, 5000, cut=cut), counter, POLICY)
        if projection.cut is not None and projection.cut.chain:
            break
        previous, cut = projection, projection.cut
    assert previous is not None and projection is not None and projection.cut is not None
    opening = projection.cut.opening
    assert opening > 1
    assert projection.items[:opening] == previous.items[:opening]
    assert compressed_calls(previous)[0] == "call_0"  # the head's result, compressed
    assert is_summary(projection.items[opening])
    # The head stays on the next requests.
    cut = projection.cut
    for n in range(60, 63):
        items = [*items[:-1], *chat_turn(n, rows=40), items[-1]]
        later = project_context(request(items, 5000, cut=cut), counter, POLICY)
        assert later.cut is not None and later.cut.opening == opening
        assert later.items[:opening] == projection.items[:opening]
        cut = later.cut
