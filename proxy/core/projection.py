"""The model context of one request: a projection of the history under the budget.

SPEC section 5, seed sections 4, 6, 7, 8 and 13. The history is cut into blocks
(proxy/core/blocks.py); pinned items and the current turn are fixed, the closed turns
are history H with budget B_H (proxy/core/budget.py). When H > B_H, pressure is relieved
in this order, stopping as soon as the context fits:

1. compress large tool results of the older closed turns (all but keep_recent_turns);
2. replace the oldest closed turns by one summary; when cutting, cut down to
   target_fill * B_H, so the next turns send the same prefix (cache-aware, SPEC 5);
3. compress, then summarize, the recent closed turns too;
4. if pinned + current turn alone exceed the window, raise ContextLengthExceeded.

The cut is sticky: the returned CutPoint is passed back with the next request and
applied before anything else. Every projection is checked by check_invariants before
it is returned.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from proxy.core.blocks import Block, segment
from proxy.core.budget import history_budget
from proxy.core.compress import compress_tool_output, is_compressible
from proxy.core.invariants import check_invariants
from proxy.core.items import Item
from proxy.core.memory import Summarizer, is_summary, summarize_turns
from proxy.core.tokens import REPLY_PRIMING, TokenCounter

# The summary gets at most this share of B_H, and never more than SUMMARY_MAX_TOKENS.
SUMMARY_SHARE = 0.1
SUMMARY_MAX_TOKENS = 1000


@dataclass(frozen=True)
class ProjectionPolicy:
    keep_recent_turns: int = 3
    tool_result_max_tokens: int = 800
    pin_patterns: tuple[str, ...] = ()
    target_fill: float = 0.65


@dataclass(frozen=True)
class CutPoint:
    """Where the verbatim history starts, and what stands for everything before it.

    `summary` holds the pinned items before `start` (verbatim, in log order) followed by
    the digest, if any; `compressed` maps log positions to compressed tool results.
    """

    start: int
    summary: tuple[Item, ...]
    compressed: tuple[tuple[int, Item], ...] = ()


@dataclass(frozen=True)
class ProjectionRequest:
    items: Sequence[Item]
    window: int
    output: int
    epsilon: int
    tools_tokens: int = 0
    instructions_tokens: int = 0
    first_position: int = 0
    cut: CutPoint | None = None
    now: str = ""


@dataclass(frozen=True)
class BlockReport:
    kind: str
    first: int
    last: int
    tokens_before: int
    tokens_after: int
    action: str


@dataclass(frozen=True)
class ProjectionReport:
    window: int
    system: int
    tools: int
    current: int
    output: int
    epsilon: int
    history_budget: int
    history_before: int
    history_after: int
    prompt_tokens: int
    blocks: tuple[BlockReport, ...]
    dropped: int
    compressed: int
    summarized: int

    def totals(self) -> dict[str, int]:
        """The breakdown without the per-block list (what a log line carries)."""
        return {name: getattr(self, name) for name in _TOTALS}

    def as_dict(self) -> dict[str, object]:
        # Built by hand: dataclasses.asdict deep-copies, and this runs on every request.
        data: dict[str, object] = dict(self.totals())
        data["blocks"] = [
            {
                "kind": b.kind,
                "first": b.first,
                "last": b.last,
                "tokens_before": b.tokens_before,
                "tokens_after": b.tokens_after,
                "action": b.action,
            }
            for b in self.blocks
        ]
        return data


_TOTALS = (
    "window",
    "system",
    "tools",
    "current",
    "output",
    "epsilon",
    "history_budget",
    "history_before",
    "history_after",
    "prompt_tokens",
    "dropped",
    "compressed",
    "summarized",
)


@dataclass(frozen=True)
class Projection:
    items: tuple[Item, ...]
    report: ProjectionReport
    cut: CutPoint | None
    changed: bool


class ContextLengthExceeded(Exception):
    """Pinned text + tools + current turn + output reserve alone exceed the window."""

    def __init__(self, report: ProjectionReport) -> None:
        self.report = report
        r = report
        needed = r.system + r.tools + r.current + r.output + r.epsilon
        super().__init__(
            f"This model's maximum context length is {r.window} tokens. However, your "
            f"messages resulted in {needed} tokens even with all earlier history removed "
            f"(pinned {r.system}, tools {r.tools}, current turn {r.current}, output reserve "
            f"{r.output}, margin {r.epsilon}). Please reduce the length of the messages, "
            "instructions or tools, or lower the maximum output tokens."
        )


# --- the working state of one projection ----------------------------------------------------


@dataclass
class _State:
    """What the projection decided so far; positions are absolute log positions."""

    request: ProjectionRequest
    blocks: list[Block]
    counter: TokenCounter
    start: int  # first position still sent verbatim
    carried: tuple[Item, ...]  # pinned items from before the given items (from the cut)
    digest: Item | None  # summary of everything before start
    new_cut: bool = False  # the digest must be rebuilt for the turns cut now
    replaced: dict[int, Item] = field(default_factory=dict)
    counts: list[int] = field(default_factory=list)  # tokens of each given item, counted once
    closed: list[Block] = field(default_factory=list)  # closed turns at or after start
    turn_tokens: list[int] = field(default_factory=list)

    def tokens(self, position: int) -> int:
        """Tokens the item at `position` costs as sent (compressed when replaced)."""
        replacement = self.replaced.get(position)
        if replacement is not None:
            return self.counter.item(replacement)
        return self.counts[position - self.request.first_position]

    def original_tokens(self, block: Block) -> int:
        offset = self.request.first_position
        return sum(self.counts[p - offset] for p in block.positions)


def project_context(
    request: ProjectionRequest,
    counter: TokenCounter,
    policy: ProjectionPolicy,
    summarizer: Summarizer = summarize_turns,
) -> Projection:
    """The context to send for `request`, under its budget, with the cut to keep."""
    blocks = segment(request.items, policy.pin_patterns, request.first_position)
    state = _initial_state(request, blocks, counter)
    fixed = _fixed_tokens(state)
    budget = history_budget(
        request.window,
        fixed.system,
        request.tools_tokens,
        fixed.current,
        request.output,
        request.epsilon,
    )
    if budget < 0:
        raise ContextLengthExceeded(_overflow_report(state, fixed, budget))
    relieved = _relieve(state, budget, policy)
    digest = _final_digest(state, budget, summarizer) if state.new_cut else state.digest
    return _finish(state, fixed, budget, digest, relieved or request.cut is not None)


# --- the sticky cut -------------------------------------------------------------------------


def _initial_state(
    request: ProjectionRequest, blocks: list[Block], counter: TokenCounter
) -> _State:
    """The state after applying the previous cut, realigned to a block boundary."""
    cut = request.cut
    start = request.first_position
    carried: tuple[Item, ...] = ()
    digest = None
    replaced: dict[int, Item] = {}
    if cut is not None:
        end = request.first_position + len(request.items)
        start = _aligned_start(min(max(cut.start, start), end), blocks)
        given = {
            item.digest
            for block in blocks
            if block.kind == "pinned" and block.first < start
            for item in block.items
        }
        carried = tuple(i for i in cut.summary if not is_summary(i) and i.digest not in given)
        digest = next((i for i in reversed(cut.summary) if is_summary(i)), None)
        current = {p for block in blocks if block.kind == "current" for p in block.positions}
        replaced = {p: i for p, i in cut.compressed if p >= start and p not in current}
    counts = [counter.item(item) for item in request.items]
    state = _State(
        request, blocks, counter, start, carried, digest, replaced=replaced, counts=counts
    )
    state.closed = [b for b in blocks if b.kind == "turn" and b.first >= start]
    state.turn_tokens = [_block_tokens(state, b) for b in state.closed]
    return state


def _aligned_start(start: int, blocks: list[Block]) -> int:
    """Moves a cut that falls inside a turn (e.g. a late tool output merged two turns)
    back to that turn's start, so a call is never cut from its output."""
    for block in blocks:
        if block.kind != "pinned" and block.positions and block.first < start <= block.last:
            return block.first
        if block.kind == "current" and block.positions and block.first < start:
            return block.first  # a stale cut beyond the current turn's start
    return start


def _block_tokens(state: _State, block: Block) -> int:
    return sum(state.tokens(p) for p in block.positions)


@dataclass(frozen=True)
class _Fixed:
    system: int
    current: int


def _fixed_tokens(state: _State) -> _Fixed:
    """S (pinned, carried, instructions, reply priming) and U (the current turn)."""
    pinned = sum(state.original_tokens(b) for b in state.blocks if b.kind == "pinned")
    pinned += state.counter.items(state.carried)
    system = pinned + state.request.instructions_tokens + REPLY_PRIMING
    current = sum(state.original_tokens(b) for b in state.blocks if b.kind == "current")
    return _Fixed(system, current)


# --- pressure relief (SPEC section 5) -------------------------------------------------------


def _relieve(state: _State, budget: int, policy: ProjectionPolicy) -> bool:
    """Compresses and cuts until the history fits; True when anything changed."""
    if _history(state) <= budget:
        return False
    turns = len(state.closed)
    older = max(0, turns - policy.keep_recent_turns)
    target = int(budget * policy.target_fill)
    room = _summary_room(budget)
    _compress_until_fits(state, budget, policy, older)
    if _history(state) > budget and older > 0:
        _cut_to_target(state, older, target, room)
    if _history(state) > budget:
        _compress_until_fits(state, budget, policy, turns)
    if _history(state) > budget:
        _cut_to_target(state, turns, target, room)
    return True


def _summary_room(budget: int) -> int:
    return min(SUMMARY_MAX_TOKENS, int(budget * SUMMARY_SHARE))


def _history(state: _State) -> int:
    """Tokens of the closed turns still kept, plus the old digest while no new cut.

    After a new cut the digest is sized to what is left (_final_digest), so only the
    turns count here.
    """
    kept = sum(state.turn_tokens)
    if not state.new_cut and state.digest is not None:
        kept += state.counter.item(state.digest)
    return kept


def _cut_count(state: _State) -> int:
    return len(state.closed) - len(state.turn_tokens)


def _compress_until_fits(state: _State, budget: int, policy: ProjectionPolicy, upto: int) -> None:
    """Steps 1 and 3: large tool results of the kept closed turns before `upto`, oldest
    first, until the history fits."""
    offset = _cut_count(state)
    calls = _calls_by_id(state.closed)
    history = _history(state)
    for turn in range(offset, upto):
        block = state.closed[turn]
        for position, item in zip(block.positions, block.items, strict=True):
            if history <= budget:
                return
            if position in state.replaced or not is_compressible(item):
                continue
            before = state.tokens(position)
            if before <= policy.tool_result_max_tokens:
                continue
            smaller = compress_tool_output(
                item,
                calls.get(item.output_for or ""),
                policy.tool_result_max_tokens,
                state.counter,
                state.request.now,
            )
            after = state.counter.item(smaller)
            if after < before:
                state.replaced[position] = smaller
                state.turn_tokens[turn - offset] -= before - after
                history -= before - after


def _calls_by_id(blocks: Sequence[Block]) -> dict[str, Item]:
    return {call_id: item for b in blocks for item in b.items for call_id in item.call_ids}


def _cut_to_target(state: _State, highest: int, target: int, room: int) -> None:
    """Steps 2 and 3: summarize the fewest oldest turns (at least one more, at most up to
    `highest`) that bring the kept turns plus a summary down to target_fill * B_H."""
    offset = _cut_count(state)
    rest = sum(state.turn_tokens)
    cut = offset
    while cut < highest:
        rest -= state.turn_tokens[cut - offset]
        cut += 1
        if rest + room <= target:
            break
    del state.turn_tokens[: cut - offset]
    state.new_cut = True


def _final_digest(state: _State, budget: int, summarizer: Summarizer) -> Item | None:
    """The summary of the turns cut now (and the old digest), if it fits what is left."""
    dropped = _cut_count(state)
    items = [item for block in state.closed[:dropped] for item in block.items]
    room = min(_summary_room(budget), budget - sum(state.turn_tokens))
    if room <= 0 or (not items and state.digest is None):
        return None
    digest = summarizer(items, state.counter, room, state.digest)
    return digest if state.counter.item(digest) <= room else None


# --- the result -----------------------------------------------------------------------------


@dataclass(frozen=True)
class _Outcome:
    """Where the verbatim history now starts and what stands before it."""

    start: int
    prefix: tuple[Item, ...]
    digest: Item | None
    cut_away: tuple[int, ...]  # positions of given, non-pinned items before start


def _finish(
    state: _State, fixed: _Fixed, budget: int, digest: Item | None, keep_cut: bool
) -> Projection:
    request, offset = state.request, state.request.first_position
    outcome = _outcome(state, digest)
    sent = list(outcome.prefix)
    for index in range(outcome.start - offset, len(request.items)):
        sent.append(state.replaced.get(index + offset, request.items[index]))
    check_invariants(request.items, sent, _relative(state, "pinned"), _relative(state, "current"))
    report = _report(state, fixed, budget, sent, outcome)
    compressed = tuple(sorted((p, i) for p, i in state.replaced.items() if p >= outcome.start))
    cut = CutPoint(outcome.start, outcome.prefix, compressed) if keep_cut else None
    changed = len(sent) != len(request.items) or any(
        a is not b for a, b in zip(sent, request.items, strict=True)
    )
    return Projection(tuple(sent), report, cut, changed)


def _relative(state: _State, kind: str) -> list[int]:
    offset = state.request.first_position
    return [p - offset for b in state.blocks if b.kind == kind for p in b.positions]


def _outcome(state: _State, digest: Item | None) -> _Outcome:
    start = _new_start(state)
    pinned_before = [
        item for b in state.blocks if b.kind == "pinned" and b.first < start for item in b.items
    ]
    prefix = (*state.carried, *pinned_before, *((digest,) if digest is not None else ()))
    pinned = {p for b in state.blocks if b.kind == "pinned" for p in b.positions}
    offset = state.request.first_position
    cut_away = tuple(p for p in range(offset, start) if p not in pinned)
    return _Outcome(start, prefix, digest, cut_away)


def _new_start(state: _State) -> int:
    dropped = _cut_count(state)
    if dropped == 0:
        return state.start
    if dropped < len(state.closed):
        return state.closed[dropped].first
    current = [b for b in state.blocks if b.kind == "current" and b.positions]
    return current[0].first if current else state.request.first_position + len(state.request.items)


def _report(
    state: _State, fixed: _Fixed, budget: int, sent: Sequence[Item], outcome: _Outcome
) -> ProjectionReport:
    """The budget breakdown; prompt_tokens is what the provider counts for `sent`."""
    request = state.request
    sent_tokens = state.counter.items(outcome.prefix) + sum(
        state.tokens(p) for p in range(outcome.start, request.first_position + len(request.items))
    )
    prompt = sent_tokens + request.instructions_tokens + request.tools_tokens + REPLY_PRIMING
    summarized = len(outcome.cut_away) if outcome.digest is not None else 0
    return replace(
        _overflow_report(state, fixed, budget),
        history_after=prompt - fixed.system - request.tools_tokens - fixed.current,
        prompt_tokens=prompt,
        blocks=_block_reports(state, outcome),
        dropped=len(outcome.cut_away) - summarized,
        compressed=sum(1 for p in state.replaced if p >= outcome.start),
        summarized=summarized,
    )


def _overflow_report(state: _State, fixed: _Fixed, budget: int) -> ProjectionReport:
    """The breakdown with no history at all: what ContextLengthExceeded carries."""
    request = state.request
    return ProjectionReport(
        window=request.window,
        system=fixed.system,
        tools=request.tools_tokens,
        current=fixed.current,
        output=request.output,
        epsilon=request.epsilon,
        history_budget=budget,
        history_before=sum(state.original_tokens(b) for b in state.blocks if b.kind == "turn"),
        history_after=0,
        prompt_tokens=fixed.system + request.tools_tokens + fixed.current,
        blocks=(),
        dropped=0,
        compressed=0,
        summarized=0,
    )


def _block_reports(state: _State, outcome: _Outcome) -> tuple[BlockReport, ...]:
    counter = state.counter
    reports: list[BlockReport] = []
    if outcome.digest is not None or outcome.cut_away:
        offset = state.request.first_position
        before = sum(state.counts[p - offset] for p in outcome.cut_away)
        after = counter.item(outcome.digest) if outcome.digest is not None else 0
        first = 0 if state.request.cut is not None else offset
        action = "summarized" if outcome.digest is not None else "dropped"
        reports.append(
            BlockReport("summary", first, outcome.start - 1, before or after, after, action)
        )
    for block in state.blocks:
        if not block.positions or (block.kind == "turn" and block.first < outcome.start):
            continue
        before = state.original_tokens(block)
        after = before if block.kind == "pinned" else _block_tokens(state, block)
        action = "compressed" if after != before else "kept"
        reports.append(BlockReport(block.kind, block.first, block.last, before, after, action))
    return tuple(reports)
