"""The invariants every projected context must keep (SPEC section 5, seed section 6.1).

A violation is a bug in the projection: it is raised, never sent. Positions are indices
into `original`, the history the projection was given.
"""

from __future__ import annotations

import json
from bisect import bisect_right
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from proxy.core.items import MCP_KINDS, Item, pending_approvals


class InvariantViolation(AssertionError):
    """The projected context breaks an invariant of SPEC section 5."""


def check_invariants(
    original: Sequence[Item],
    sent: Sequence[Item],
    pinned_positions: Iterable[int],
    current_positions: Iterable[int],
    prefix: int = 0,
) -> None:
    """`prefix`: how many of the first sent items stand before the window (a cut's
    carried items and summaries): they have a log position only if `original` holds
    that very item."""
    _check_one_api(sent)
    _check_pinned_kept(original, sent, pinned_positions)
    _check_current_verbatim(original, sent, current_positions)
    _check_calls_closed(original, sent)
    _check_approvals_whole(original, sent)
    _check_causal_order(original, sent, prefix)
    _check_serializable(original, sent)


def check_sent_as_given(items: Sequence[Item]) -> None:
    """check_invariants(items, items, ...) for a context that is the history itself, every
    item the one given, in its order (a history that fits whole, proxy/server/turn.py):
    nothing is dropped, moved or made, so the pinned, current-turn, closed-call, approval,
    log-order and serialization checks hold by construction, and only these two can fail
    (tests/server/test_rebuild_fit.py checks it against check_invariants)."""
    _check_one_api(items)
    _check_calls_before_outputs(items)


@dataclass(frozen=True)
class SentAsGiven:
    """What `check_sent_as_given` needs of a history that passed it to check a longer
    one starting with it (`check_sent_after`): its API, the calls it makes, and the
    outputs it holds before any call of theirs, in log order (none of their calls may
    follow)."""

    api: str | None
    called: frozenset[str]
    early: tuple[str, ...]


NOTHING_SENT = SentAsGiven(None, frozenset(), ())


def check_sent_after(before: SentAsGiven, items: Sequence[Item]) -> SentAsGiven:
    """`check_sent_as_given(prefix + items)` for a prefix that passed it and that `before`
    describes (the same verdict, the same message); what describes `prefix + items`."""
    apis: set[str] = {item.api for item in items}
    if before.api is not None:
        apis.add(before.api)
    if len(apis) > 1:
        raise InvariantViolation(f"context mixes item shapes of {sorted(apis)}")
    later = _call_ids(items)
    for output_for in before.early:
        if output_for in later:
            raise InvariantViolation(f"output for {output_for!r} is sent before its call")
    every = before.called | later
    called = set(before.called)
    early = dict.fromkeys(before.early)
    for item in items:
        called.update(item.call_ids)
        if item.output_for is not None and item.output_for not in called:
            if item.output_for in every:
                raise InvariantViolation(f"output for {item.output_for!r} is sent before its call")
            early[item.output_for] = None
    api = next(iter(apis)) if apis else None
    return SentAsGiven(api, frozenset(called), tuple(early))


def _check_one_api(sent: Sequence[Item]) -> None:
    apis = {item.api for item in sent}
    if len(apis) > 1:
        raise InvariantViolation(f"context mixes item shapes of {sorted(apis)}")


def _check_pinned_kept(
    original: Sequence[Item], sent: Sequence[Item], pinned_positions: Iterable[int]
) -> None:
    available = Counter(item.digest for item in sent)
    for position in pinned_positions:
        digest = original[position].digest
        if available[digest] <= 0:
            raise InvariantViolation(f"pinned item at position {position} was dropped")
        available[digest] -= 1


def _check_current_verbatim(
    original: Sequence[Item], sent: Sequence[Item], current_positions: Iterable[int]
) -> None:
    current = [original[p] for p in current_positions]
    if not current:
        return
    tail = sent[-len(current) :]
    if len(tail) != len(current) or any(
        a.digest != b.digest or a.raw != b.raw for a, b in zip(tail, current, strict=True)
    ):
        raise InvariantViolation("the current turn is not sent whole and verbatim at the end")


def _check_calls_closed(original: Sequence[Item], sent: Sequence[Item]) -> None:
    """No new orphans: a call answered in the log is sent with its output or not at all."""
    answered = _call_ids(original) & _output_ids(original)
    sent_calls, sent_outputs = _call_ids(sent), _output_ids(sent)
    for call_id in sorted(answered):
        if (call_id in sent_calls) != (call_id in sent_outputs):
            half = "call" if call_id in sent_calls else "output"
            raise InvariantViolation(f"call {call_id!r}: its {half} is sent without the other")


def _check_approvals_whole(original: Sequence[Item], sent: Sequence[Item]) -> None:
    """An MCP approval request, its response and the mcp_call that runs it are sent all
    together or not at all; a pending request (nothing answers it) is always sent."""
    members: dict[str, Counter[str]] = defaultdict(Counter)
    for item in original:
        if item.kind in MCP_KINDS:
            for approval in (*item.call_ids, item.output_for):
                if approval is not None:
                    members[approval][item.digest] += 1
    if not members:
        return
    sent_members: dict[str, Counter[str]] = defaultdict(Counter)
    for item in (i for i in sent if i.kind in MCP_KINDS):
        for approval in (*item.call_ids, item.output_for):
            if approval in members and members[approval][item.digest] > 0:
                sent_members[approval][item.digest] += 1
    pending = pending_approvals(original)
    for approval in sorted(members):
        given, kept = members[approval], sent_members.get(approval, Counter())
        if approval in pending and not kept:
            raise InvariantViolation(f"pending approval request {approval!r} was dropped")
        if kept and any(kept[d] < n for d, n in given.items()):
            raise InvariantViolation(f"approval {approval!r}: part of its block is not sent")


def _call_ids(items: Iterable[Item]) -> set[str]:
    return {call_id for item in items for call_id in item.call_ids}


def _output_ids(items: Iterable[Item]) -> set[str]:
    return {item.output_for for item in items if item.output_for is not None}


def _check_causal_order(original: Sequence[Item], sent: Sequence[Item], prefix: int) -> None:
    """Items taken from the log keep the log's order; an output never precedes its call.

    A compressed output stands at its original's position (the next output with its call
    id: clients may reuse an id in later turns); summary items are new and have no
    position. An item of the prefix carried from an earlier cut has none either: matched
    by content, an opening turn's "Noted." would take the position of a later "Noted." in
    the window.
    """
    by_digest: dict[str, list[int]] = defaultdict(list)
    output_positions: dict[str, list[int]] = defaultdict(list)
    given: dict[int, int] = {}
    for position, item in enumerate(original):
        by_digest[item.digest].append(position)
        given[id(item)] = position
        if item.output_for is not None:
            output_positions[item.output_for].append(position)
    last = -1
    for index, item in enumerate(sent):
        if index < prefix:
            found = given.get(id(item))
        else:
            found = _next_position(item, by_digest, output_positions, last)
        if found is None:
            continue
        if found <= last:
            raise InvariantViolation(f"item from log position {found} sent out of order")
        last = found
    _check_calls_before_outputs(sent)


def _next_position(
    item: Item,
    by_digest: dict[str, list[int]],
    output_positions: dict[str, list[int]],
    last: int,
) -> int | None:
    positions = by_digest.get(item.digest)
    if not positions and item.output_for is not None:
        positions = output_positions.get(item.output_for)
    if not positions:
        return None
    index = bisect_right(positions, last)
    return positions[index] if index < len(positions) else positions[-1]


def _check_calls_before_outputs(sent: Sequence[Item]) -> None:
    called: set[str] = set()
    all_calls = _call_ids(sent)
    for item in sent:
        called.update(item.call_ids)
        if item.output_for in all_calls and item.output_for not in called:
            raise InvariantViolation(f"output for {item.output_for!r} is sent before its call")


def _check_serializable(original: Sequence[Item], sent: Sequence[Item]) -> None:
    """Items the projection made (summaries, compressed results) must serialize; items the
    client or the store gave are sent as they came, so they are not encoded again here."""
    given = {id(item.raw) for item in original}
    for index, item in enumerate(sent):
        if id(item.raw) in given:
            continue
        try:
            json.dumps(item.raw, allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise InvariantViolation(f"item {index} does not serialize to JSON: {exc}") from exc
