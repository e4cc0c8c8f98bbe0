from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.core.blocks import (
    Block,
    BlockKind,
    _current_start,
    compile_pins,
    pinned_flags,
    segment,
    segment_after,
)
from proxy.core.items import Item, chat_item, responses_item


def sys(text: str = "be brief") -> Item:
    return chat_item({"role": "system", "content": text})


def user(text: str) -> Item:
    return chat_item({"role": "user", "content": text})


def assistant(text: str) -> Item:
    return chat_item({"role": "assistant", "content": text})


def call(*ids: str) -> Item:
    calls = [
        {"id": i, "type": "function", "function": {"name": "f", "arguments": "{}"}} for i in ids
    ]
    return chat_item({"role": "assistant", "content": None, "tool_calls": calls})


def out(call_id: str) -> Item:
    return chat_item({"role": "tool", "tool_call_id": call_id, "content": "ok"})


def shape(blocks: list[Block]) -> list[tuple[str, tuple[int, ...]]]:
    return [(b.kind, b.positions) for b in blocks]


def test_turns_pinned_and_current() -> None:
    items = [sys(), user("a"), assistant("A"), user("b"), call("c1"), out("c1"), user("c")]
    assert shape(segment(items)) == [
        ("pinned", (0,)),
        ("turn", (1, 2)),
        ("turn", (3, 4, 5)),
        ("current", (6,)),
    ]


def test_items_before_the_first_user_message_form_a_leading_turn() -> None:
    items = [assistant("hello"), sys(), user("a"), assistant("A")]
    assert shape(segment(items)) == [("turn", (0,)), ("pinned", (1,)), ("current", (2, 3))]


def test_system_message_mid_turn_is_pinned_in_place() -> None:
    items = [user("a"), assistant("A"), sys("new rule"), assistant("B"), user("b")]
    assert shape(segment(items)) == [("turn", (0, 1, 3)), ("pinned", (2,)), ("current", (4,))]


def test_pin_patterns_pin_matching_user_messages() -> None:
    items = [user("All amounts in CNY"), assistant("ok"), user("price?"), assistant("1")]
    blocks = segment(items, [r"\bCNY\b"])
    assert shape(blocks) == [("pinned", (0,)), ("turn", (1,)), ("current", (2, 3))]


def test_last_user_message_is_current_even_when_pinned() -> None:
    items = [user("a"), assistant("A"), user("always CNY")]
    assert shape(segment(items, ["CNY"]))[-1] == ("current", (2,))


def test_parallel_calls_stay_in_their_turn() -> None:
    items = [user("a"), call("c1", "c2"), out("c2"), out("c1"), assistant("A"), user("b")]
    assert shape(segment(items)) == [("turn", (0, 1, 2, 3, 4)), ("current", (5,))]


def test_late_output_merges_the_turns_it_spans() -> None:
    items = [user("a"), call("c1"), user("b"), assistant("B"), out("c1"), user("c"), user("d")]
    assert shape(segment(items)) == [
        ("turn", (0, 1, 2, 3, 4)),
        ("turn", (5,)),
        ("current", (6,)),
    ]


def test_late_output_in_the_current_turn_makes_its_call_current() -> None:
    items = [user("a"), assistant("A"), user("b"), call("c1"), user("c"), out("c1")]
    assert shape(segment(items)) == [("turn", (0, 1)), ("current", (2, 3, 4, 5))]


def test_positions_are_absolute() -> None:
    items = [user("a"), assistant("A"), user("b")]
    assert shape(segment(items, first_position=100)) == [
        ("turn", (100, 101)),
        ("current", (102,)),
    ]


def test_history_without_user_messages_is_all_current() -> None:
    items = [sys(), assistant("A"), assistant("B")]
    assert shape(segment(items)) == [("pinned", (0,)), ("current", (1, 2))]


def test_responses_reasoning_travels_with_its_call() -> None:
    items = [
        responses_item({"role": "user", "content": "a"}),
        responses_item({"type": "reasoning", "id": "rs_1", "summary": []}),
        responses_item({"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}),
        responses_item({"type": "function_call_output", "call_id": "c1", "output": "ok"}),
        responses_item({"role": "user", "content": "b"}),
    ]
    assert shape(segment(items)) == [("turn", (0, 1, 2, 3)), ("current", (4,))]


def reference_turn_ids(items: list[Item]) -> list[int]:
    """Turn ids as they were computed before the one-pass version: numbered, then every
    turn between a call and its late output merged."""
    ids, turn = [], 0
    for item in items:
        turn += item.is_user_message
        ids.append(turn)
    reach = list(range(ids[-1] + 1)) if ids else []
    call_turn: dict[str, int] = {}
    for index, item in enumerate(items):
        for call_id in item.call_ids:
            call_turn[call_id] = ids[index]
        if item.output_for is not None and item.output_for in call_turn:
            start = call_turn[item.output_for]
            reach[start] = max(reach[start], ids[index])
    merged_to, group, group_end = [], 0, -1
    for at, end in enumerate(reach):
        group = at if at > group_end else group
        group_end = max(group_end, end)
        merged_to.append(group)
    return [merged_to[t] for t in ids]


def reference_segment(items: list[Item], pins: tuple[str, ...], offset: int) -> list[Block]:
    """The segmentation item by item, as it was written before the slicing fast path:
    every block gathered one index at a time, then all of them sorted."""
    pinned = pinned_flags(items, compile_pins(pins))
    turn_of = reference_turn_ids(items)
    start = _current_start(items, turn_of, pinned)
    groups: list[tuple[BlockKind, list[int]]] = []
    pending: list[int] = []
    for index in range(start):
        if pinned[index]:
            groups.append(("pinned", [index]))
            continue
        if pending and turn_of[index] != turn_of[pending[-1]]:
            groups.append(("turn", pending))
            pending = []
        pending.append(index)
    if pending:
        groups.append(("turn", pending))
    groups.sort(key=lambda group: group[1][0])
    groups.append(("current", list(range(start, len(items)))))
    return [
        Block(kind, tuple(i + offset for i in at), tuple(items[i] for i in at))
        for kind, at in groups
    ]


history_entry = st.one_of(
    st.just(sys()),
    st.sampled_from(["hi", "PIN me", "thanks"]).map(user),
    st.just(assistant("ok")),
    st.sampled_from(["a", "b", "c"]).map(call),
    st.sampled_from(["a", "b", "c", "z"]).map(out),
)
history_entries = st.lists(history_entry, max_size=30)


@settings(max_examples=400, derandomize=True)
@given(history_entries, st.sampled_from([(), ("PIN",)]), st.integers(0, 5))
def test_segment_equals_the_item_by_item_segmentation(
    items: list[Item], pins: tuple[str, ...], offset: int
) -> None:
    blocks = segment(items, pins, offset)
    assert blocks == reference_segment(items, pins, offset)
    for block in blocks:
        gathered = [items[p - offset] for p in block.positions]
        assert all(a is b for a, b in zip(block.items, gathered, strict=True))
    assert segment(tuple(items), pins, offset) == blocks


def approval(request_id: str) -> Item:
    return responses_item(
        {"type": "mcp_approval_request", "id": request_id, "name": "f", "server_label": "s"}
    )


def approved(request_id: str) -> Item:
    return responses_item(
        {"type": "mcp_approval_response", "approval_request_id": request_id, "approve": True}
    )


growing_entries = st.lists(
    st.one_of(
        history_entry,
        st.sampled_from(["p", "q"]).map(approval),
        st.sampled_from(["p", "q"]).map(approved),
    ),
    max_size=40,
)


@settings(max_examples=400, derandomize=True)
@given(
    growing_entries,
    st.lists(st.tuples(st.integers(0, 6), st.integers(0, 4)), min_size=1, max_size=8),
    st.sampled_from([(), ("PIN",)]),
    st.integers(0, 3),
)
def test_segment_after_equals_segment_as_a_window_grows(
    items: list[Item], steps: list[tuple[int, int]], pins: tuple[str, ...], offset: int
) -> None:
    """A stored window growing turn by turn (its first items the same objects), each turn
    with new items after it: the blocks equal segment's, whatever was settled before."""
    settled = None
    window = 0
    for grow, new in steps:
        window = min(len(items), window + grow)
        history = items[: window + new]
        blocks, settled = segment_after(settled, history, pins, offset, lasting=window)
        assert blocks == segment(history, pins, offset)
        for block in blocks:
            gathered = [history[p - offset] for p in block.positions]
            assert all(a is b for a, b in zip(block.items, gathered, strict=True))
        if settled is not None:
            assert len(settled.items) <= window


def agent_turns(count: int) -> list[Item]:
    items: list[Item] = [sys()]
    for turn in range(count):
        items += [user(f"q{turn}"), call(f"c{turn}"), out(f"c{turn}"), assistant("done")]
    return items


def test_segment_after_reuses_the_settled_blocks_of_the_same_items() -> None:
    window = agent_turns(5)
    first, settled = segment_after(None, [*window, user("next")], lasting=len(window))
    assert settled is not None and len(settled.items) == 17  # up to the window's last question
    grown = [*window, user("next"), assistant("ok")]
    again, _ = segment_after(settled, [*grown, user("more")], lasting=len(grown))
    assert again == segment([*grown, user("more")])
    assert all(a is b for a, b in zip(again[:5], first[:5], strict=True))  # not made again


def test_segment_after_does_not_reuse_blocks_of_other_items() -> None:
    """The same count of items, but not the same ones (the window was compacted, an item
    erased and another stored meanwhile): the blocks are made again."""
    window = agent_turns(3)
    _, settled = segment_after(None, window, lasting=len(window))
    assert settled is not None
    changed = [user("q0"), sys(), *window[2:]]  # an instruction where a call was
    blocks, _ = segment_after(settled, [*changed, user("next")], lasting=len(changed))
    assert blocks == segment([*changed, user("next")])
    moved, _ = segment_after(settled, [*window, user("next")], (), 1, lasting=len(window))
    assert moved == segment([*window, user("next")], (), 1)


def test_segment_after_a_late_output_for_a_settled_call() -> None:
    window = [*agent_turns(2)[:-2], user("later")]  # c1's output comes after a question
    _, settled = segment_after(None, window, lasting=len(window))
    late = [*window, out("c1"), user("next")]
    blocks, _ = segment_after(settled, late, lasting=len(window))
    assert blocks == segment(late)
    assert shape(blocks)[-2][1] == tuple(range(5, 9))  # c1's turn merged with "later"'s
