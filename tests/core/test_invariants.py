import functools
import itertools
import math
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.core.invariants import (
    NOTHING_SENT,
    InvariantViolation,
    check_invariants,
    check_sent_after,
    check_sent_as_given,
)
from proxy.core.items import Item, chat_item, responses_item


def call(call_id: str) -> Item:
    function = {"name": "f", "arguments": "{}"}
    return chat_item(
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": call_id, "type": "function", "function": function}],
        }
    )


def out(call_id: str, text: str = "ok") -> Item:
    return chat_item({"role": "tool", "tool_call_id": call_id, "content": text})


SYSTEM = chat_item({"role": "system", "content": "rules"})
U1 = chat_item({"role": "user", "content": "one"})
U2 = chat_item({"role": "user", "content": "two"})
HISTORY = [SYSTEM, U1, call("c1"), out("c1"), U2]
PINNED = [0]
CURRENT = [4]


def test_unchanged_history_passes() -> None:
    check_invariants(HISTORY, HISTORY, PINNED, CURRENT)


def test_dropping_a_whole_trajectory_passes() -> None:
    check_invariants(HISTORY, [SYSTEM, U2], PINNED, CURRENT)


def test_compressed_output_in_place_passes() -> None:
    check_invariants(HISTORY, [SYSTEM, U1, call("c1"), out("c1", "short"), U2], PINNED, CURRENT)


def test_missing_pinned_item_is_a_violation() -> None:
    with pytest.raises(InvariantViolation, match="pinned"):
        check_invariants(HISTORY, [U1, call("c1"), out("c1"), U2], PINNED, CURRENT)


def test_altered_current_turn_is_a_violation() -> None:
    altered = chat_item({"role": "user", "content": "two!"})
    with pytest.raises(InvariantViolation, match="current turn"):
        check_invariants(HISTORY, [SYSTEM, altered], PINNED, CURRENT)


def test_call_without_its_output_is_a_violation() -> None:
    with pytest.raises(InvariantViolation, match="c1"):
        check_invariants(HISTORY, [SYSTEM, U1, call("c1"), U2], PINNED, CURRENT)


def test_output_without_its_call_is_a_violation() -> None:
    with pytest.raises(InvariantViolation, match="c1"):
        check_invariants(HISTORY, [SYSTEM, out("c1"), U2], PINNED, CURRENT)


def test_unanswered_call_of_the_log_may_be_sent() -> None:
    history = [U1, call("c7"), U2]
    check_invariants(history, history, [], [2])


def test_reordered_items_are_a_violation() -> None:
    with pytest.raises(InvariantViolation, match="order"):
        check_invariants(HISTORY, [SYSTEM, call("c1"), U1, out("c1"), U2], PINNED, CURRENT)


def test_output_before_its_call_is_a_violation() -> None:
    with pytest.raises(InvariantViolation):
        check_invariants(HISTORY, [SYSTEM, U1, out("c1"), call("c1"), U2], PINNED, CURRENT)


def test_unserializable_item_made_by_the_projection_is_a_violation() -> None:
    middle = chat_item({"role": "assistant", "content": "long answer"})
    bad = chat_item({"role": "assistant", "content": "short"})  # e.g. a compressed form
    object.__setattr__(bad, "raw", {"role": "assistant", "content": math.nan})
    with pytest.raises(InvariantViolation, match="serialize"):
        check_invariants([U1, middle, U2], [U1, bad, U2], [], [2])


def test_mixed_api_shapes_are_a_violation() -> None:
    other = responses_item({"role": "user", "content": "two"})
    with pytest.raises(InvariantViolation, match="mixes"):
        check_invariants(HISTORY, [SYSTEM, other, U2], PINNED, CURRENT)


def test_a_carried_prefix_item_has_no_log_position() -> None:
    """A window [U1, "Noted.", U2] whose cut carries an earlier "Noted." ahead of it: the
    carried copy must not take the window's position (it made a stateless request with
    an opening head a 500)."""
    noted = {"role": "assistant", "content": "Noted."}
    window = [U1, chat_item(noted), U2]
    carried = chat_item(noted)  # the same content, from the stored cut
    check_invariants(window, [SYSTEM, carried, *window], [], [2], prefix=2)


def test_a_given_item_in_the_prefix_still_keeps_the_log_order() -> None:
    with pytest.raises(InvariantViolation, match="out of order"):
        check_invariants(HISTORY, [U2, SYSTEM, U1, call("c1"), out("c1"), U2], PINNED, [], prefix=2)


def test_a_compressed_output_of_a_reused_call_id_stands_at_its_own_position() -> None:
    """Clients may reuse a call id in later turns: a compressed later output took the
    first output's position and looked sent out of order."""
    history = [SYSTEM, U1, call("c0"), out("c0", "small"), U2, call("c0"), out("c0", "big")]
    compressed = out("c0", "compressed big")
    check_invariants(history, [*history[:6], compressed], PINNED, [])
    with pytest.raises(InvariantViolation, match="out of order"):
        check_invariants(history, [SYSTEM, compressed, U1, call("c0")], PINNED, [])


ASK = responses_item({"type": "mcp_approval_request", "id": "mcpr_1", "name": "refund"})
YES = responses_item({"type": "mcp_approval_response", "approval_request_id": "mcpr_1"})
RAN = responses_item({"type": "mcp_call", "id": "mcp_1", "approval_request_id": "mcpr_1"})
R_SYSTEM = responses_item({"role": "system", "content": "rules"})
R_U1 = responses_item({"role": "user", "content": "one"})
R_U2 = responses_item({"role": "user", "content": "two"})


def test_an_approval_block_sent_whole_or_not_at_all_passes() -> None:
    history = [R_SYSTEM, R_U1, ASK, YES, RAN, R_U2]
    check_invariants(history, history, [0], [5])
    check_invariants(history, [R_SYSTEM, R_U2], [0], [5])


@pytest.mark.parametrize("kept", [[ASK, YES], [ASK, RAN], [YES, RAN], [ASK]])
def test_an_approval_block_cut_apart_is_a_violation(kept: list[Item]) -> None:
    history = [R_SYSTEM, R_U1, ASK, YES, RAN, R_U2]
    with pytest.raises(InvariantViolation, match="mcpr_1"):
        check_invariants(history, [R_SYSTEM, R_U1, *kept, R_U2], [0], [5])


def test_a_pending_approval_dropped_is_a_violation() -> None:
    history = [R_SYSTEM, R_U1, ASK, R_U2]
    check_invariants(history, [R_SYSTEM, ASK, R_U2], [0, 2], [3])
    with pytest.raises(InvariantViolation, match="pending approval"):
        check_invariants(history, [R_SYSTEM, R_U2], [0], [3])


def verdict(check: Callable[[], object]) -> str | None:
    """The violation `check` raises, as text; None when it passes."""
    try:
        check()
    except InvariantViolation as exc:
        return str(exc)
    return None


sent_entries = st.lists(
    st.one_of(
        st.sampled_from(["a", "b", "c"]).map(call),
        st.sampled_from(["a", "b", "c", "z"]).map(out),
        st.just(responses_item({"role": "user", "content": "hi"})),
        st.just(chat_item({"role": "user", "content": "hi"})),
    ),
    max_size=14,
)


@settings(max_examples=400, derandomize=True)
@given(sent_entries, st.lists(st.integers(0, 5), max_size=4))
def test_check_sent_after_is_check_sent_as_given_of_the_whole(
    items: list[Item], splits: list[int]
) -> None:
    """A history checked in pieces, each piece after what the ones before passed: the
    same verdict and message as the whole checked at once (a piece refused means the
    whole is refused too: what precedes the refused piece passed, as the contract asks)."""
    whole = verdict(lambda: check_sent_as_given(items))
    state, at = NOTHING_SENT, 0
    for end in [*itertools.accumulate(splits), len(items)]:
        end = min(max(end, at), len(items))
        try:
            state = check_sent_after(state, items[at:end])
        except InvariantViolation as exc:
            assert whole is not None
            prefix = verdict(functools.partial(check_sent_as_given, items[:end]))
            assert str(exc) == prefix  # what passed, then this piece: as the whole up to it
            return
        at = end
    assert whole is None
