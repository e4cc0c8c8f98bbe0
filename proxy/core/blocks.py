"""Segmentation of a history into the blocks the projection keeps or replaces whole.

SPEC section 5, seed section 6.2: trimming works on logical blocks, never on single
messages, so a tool call is never separated from its result. The blocks are

- pinned: one system/developer message, a user message matching a pin pattern, or an
  MCP approval request nothing answers yet (a pending action, SPEC 5); it stays at its
  log position and is never dropped, compressed or summarized;
- turn: a closed turn, i.e. a user message and everything up to the next user message,
  minus pinned items (items before the first user message form a leading turn);
- current: the last user message and everything after it, always sent verbatim.

A tool trajectory (the call, every output answering it, the reasoning item before it;
an MCP approval request, its response and the mcp_call that runs it) lives inside one
turn. When an output arrives late, after the next user message, the
turns in between are merged so no cut can fall between the call and its output.
"""

from __future__ import annotations

import operator
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Literal

from proxy.core.items import APPROVAL_REQUEST, Item, is_pending_approval, pending_approvals

BlockKind = Literal["pinned", "turn", "current"]


@dataclass(frozen=True, slots=True)
class Block:
    """Items that are kept, compressed or summarized together; positions are absolute."""

    kind: BlockKind
    positions: tuple[int, ...]
    items: tuple[Item, ...]

    @property
    def first(self) -> int:
        return self.positions[0]

    @property
    def last(self) -> int:
        return self.positions[-1]


@lru_cache(maxsize=64)
def compile_pins(pin_patterns: tuple[str, ...]) -> tuple[re.Pattern[str], ...] | None:
    """The pin patterns, compiled once per distinct policy. Kept apart rather than joined
    into one alternation: a pattern may carry its own global flags, e.g. "(?i)..."."""
    if not pin_patterns:
        return None
    return tuple(re.compile(p) for p in pin_patterns)


def is_pinned(item: Item, pins: tuple[re.Pattern[str], ...] | None) -> bool:
    if item.is_instruction:
        return True
    if pins is None or not item.is_user_message:
        return False
    text = item.text()
    return any(pin.search(text) is not None for pin in pins)


def pinned_flags(items: Sequence[Item], pins: tuple[re.Pattern[str], ...] | None) -> list[bool]:
    """Whether each of `items` is pinned: `is_pinned`, or a pending approval among them."""
    pending = pending_approvals(items)
    if pins is None and not pending:  # the usual case: instructions alone are pinned
        return [item.is_instruction for item in items]
    return [is_pinned(item, pins) or is_pending_approval(item, pending) for item in items]


def segment(
    items: Sequence[Item], pin_patterns: Iterable[str] = (), first_position: int = 0
) -> list[Block]:
    """Blocks in log order (a pinned block sorts by its position among turns)."""
    if not isinstance(items, list | tuple):
        items = list(items)
    pins = compile_pins(tuple(pin_patterns))
    pinned = pinned_flags(items, pins)
    turn_of = _merged_turn_ids(items)
    current_start = _current_start(items, turn_of, pinned)
    blocks: list[Block] = []
    pending: list[int] = []
    pending_turn: int | None = None
    out_of_order = False  # a pinned block inside a turn comes before the turn's block
    for index in range(current_start):
        if pinned[index]:
            out_of_order = out_of_order or bool(pending)
            blocks.append(_block("pinned", [index], items, first_position))
            continue
        if pending and turn_of[index] != pending_turn:
            blocks.append(_block("turn", pending, items, first_position))
            pending = []
        pending.append(index)
        pending_turn = turn_of[index]
    if pending:
        blocks.append(_block("turn", pending, items, first_position))
    if out_of_order:  # turn ids never decrease, so only a pinned block can be out of place
        blocks.sort(key=lambda block: block.first)
    current = list(range(current_start, len(items)))
    blocks.append(_block("current", current, items, first_position))
    return blocks


def _block(kind: BlockKind, indices: list[int], items: Sequence[Item], offset: int) -> Block:
    """The block of `items` at `indices` (ascending); a run without gaps, the usual
    block, is sliced rather than gathered one by one."""
    if indices and indices[-1] - indices[0] + 1 == len(indices):
        start, stop = indices[0], indices[-1] + 1
        return Block(kind, tuple(range(start + offset, stop + offset)), tuple(items[start:stop]))
    return Block(kind, tuple(i + offset for i in indices), tuple(items[i] for i in indices))


def _merged_turn_ids(items: Sequence[Item]) -> list[int]:
    """Turn id of each item (how many user messages came before or at it), where every
    turn between a call and its late output is merged into the call's turn."""
    ids: list[int] = []
    turn = 0
    reach = [0]  # the last turn each turn must be merged up to
    call_turn: dict[str, int] = {}
    late = False
    for item in items:
        if item.is_user_message:
            turn += 1
            reach.append(turn)
        ids.append(turn)
        for call_id in item.call_ids:
            call_turn[call_id] = turn
        start = call_turn.get(item.output_for) if item.output_for is not None else None
        if start is not None and turn > reach[start]:
            reach[start] = turn
            late = True
    if not late:  # the usual history: every output in its call's turn
        return ids
    merged_to: list[int] = []
    group, group_end = 0, -1
    for at, end in enumerate(reach):
        if at > group_end:
            group = at
        group_end = max(group_end, end)
        merged_to.append(group)
    return [merged_to[t] for t in ids]


def _current_start(items: Sequence[Item], turn_of: list[int], pinned: list[bool]) -> int:
    """Index where the current turn begins (len(items) when there is none).

    It is the first item of the (merged) turn holding the last user message; a history
    without user messages is all current except its leading pinned items.
    """
    for last_user in range(len(items) - 1, -1, -1):
        if items[last_user].is_user_message:
            return turn_of.index(turn_of[last_user])  # the turn's first item
    return next((i for i in range(len(items)) if not pinned[i]), len(items))


@dataclass(frozen=True, slots=True)
class SettledBlocks:
    """The blocks of a history's first `len(items)` items that no item after them can
    change, kept so a longer history starting with these very items (a stored window one
    turn later) is segmented without walking them again (`segment_after`).

    They end before a user message, the start of a turn; no pin pattern applies and no
    MCP approval request is among them (either makes an item's pin depend on later
    items), so each of their blocks stays as it is while no later output answers one of
    their `calls` (a late output merges the turns between)."""

    items: tuple[Item, ...]
    first_position: int
    blocks: tuple[Block, ...]
    calls: frozenset[str]


def segment_after(
    settled: SettledBlocks | None,
    items: Sequence[Item],
    pin_patterns: Iterable[str] = (),
    first_position: int = 0,
    *,
    lasting: int = 0,
) -> tuple[list[Block], SettledBlocks | None]:
    """`segment(items, pin_patterns, first_position)`, reusing `settled` when `items`
    start with its very items (compared by identity), and what is settled of the first
    `lasting` items (those that outlive this call: a stored window's) for the next call.
    tests/core/test_blocks.py checks the blocks equal `segment`'s."""
    pins = tuple(pin_patterns)
    if pins:
        return segment(items, pins, first_position), None
    if not isinstance(items, list | tuple):
        items = list(items)
    reused = reusable(settled, items, first_position)
    if reused is None:
        blocks = segment(items, (), first_position)
        return blocks, _settle(None, blocks, items, first_position, lasting)
    start = len(reused.items)
    tail = segment(items[start:], (), first_position + start)
    blocks = [*reused.blocks, *tail]
    return blocks, _settle(reused, tail, items, first_position, lasting)


def reusable(
    settled: SettledBlocks | None, items: Sequence[Item], first_position: int
) -> SettledBlocks | None:
    """`settled` when its blocks are `items`' own (segment_after reuses them): the same
    first items (by identity) at the same position, a user message right after them,
    and no later item that answers one of their calls or asks an approval."""
    if settled is None or settled.first_position != first_position:
        return None
    start = len(settled.items)
    if start >= len(items) or not items[start].is_user_message:
        return None
    if not all(map(operator.is_, settled.items, items)):
        return None
    calls = settled.calls
    for item in items[start:]:
        if item.kind == APPROVAL_REQUEST or (
            item.output_for is not None and item.output_for in calls
        ):
            return None
    return settled


def _settle(
    reused: SettledBlocks | None,
    blocks: Sequence[Block],
    items: Sequence[Item],
    first_position: int,
    lasting: int,
) -> SettledBlocks | None:
    """What is settled of `items[:lasting]`: the items before its last user message, with
    their blocks (`reused`'s and those of `blocks`, which cover the items after it)."""
    start = len(reused.items) if reused is not None else 0
    end = next(
        (i for i in range(min(lasting, len(items)) - 1, start - 1, -1) if items[i].is_user_message),
        None,
    )
    if end is None or end <= start:
        return reused
    fresh = items[start:end]
    if any(item.kind == APPROVAL_REQUEST for item in fresh):
        return None
    edge = first_position + end
    kept: list[Block] = []
    for block in blocks:
        if block.last < edge:
            kept.append(block)
        elif block.first < edge:  # a late output's merge reaches past the edge
            return None
    calls = {call_id for item in fresh for call_id in item.call_ids}
    if reused is not None:
        calls.update(reused.calls)
        kept[:0] = reused.blocks
    return SettledBlocks(tuple(items[:end]), first_position, tuple(kept), frozenset(calls))
