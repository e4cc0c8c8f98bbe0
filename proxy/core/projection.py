"""The model context of one request: a projection of the history under the budget.

SPEC section 5, seed sections 4, 6, 7, 8 and 13. The history is cut into blocks
(proxy/core/blocks.py); pinned items and the current turn are fixed, the closed turns
are history H with budget B_H (proxy/core/budget.py). While H <= B_H nothing changes:
the turns are sent as the cut left them, so the prefix repeats. When H > B_H, it is
relieved in this order (SPEC 5):

1. compress the large tool results of the closed turns from the end of the prefix back
   (the provider caches an exact prefix: a result rewritten at position p costs every
   token after p): those after the last one compressed, the newest turn first, until
   one more turn like the recent ones fits; when they are not enough, every large
   result at once (`_compress`). If H fits, nothing else changes;
2. otherwise cut: replace the oldest closed turns but keep_recent_turns by a summary
   block appended to the summary chain (`[pinned][summary 1][summary 2]...` keeps its
   bytes from one cut to the next), down to target_fill * B_H at once (cache-aware), or
   lower when the recent turns are large (`_cut_target`); above
   summary_chain_max_share of B_H the chain is consolidated once into one block;
3. only if H still exceeds B_H, summarize the recent closed turns too, the oldest first;
4. a summary is never dropped: it gets at least SUMMARY_MIN_TOKENS, more of the oldest
   turns being cut into it if need be; if pinned + current turn alone exceed the
   window, or leave less than that for a history that must be cut, raise
   ContextLengthExceeded.

At a history's first cut that summarizes turns, its opening turns (up to
keep_opening_share of B_H, counted as sent) become a head sent ahead of the chain from
then on as the request before sent them, a compressed result compressed (`_opening`):
the cut summarizes the oldest turns after it, and every later cut leaves it in place,
so the provider's prompt cache keeps it. It never takes the recent turns' room: it
gives way (`_released`, its turns becoming the chain's first block) when they or the
current turn would not fit beside it.

A value a later turn names of the items the chain stands for, which the chain lacks (a
block written before anybody named it), is taken in as one small block at the end of the
summary region (`_take_in`): no block is rewritten, so the prefix before it repeats.

A request without a stored cut (a stateless client, a thread's first request) gets the
cut a stored thread would hold had each of its user messages been sent on its own
(`_replayed_cut`): the same history prefix gives the same cut and the same bytes.

A block's room comes from the budget without the current turn, so a large current turn
does not starve it; a block that had to be smaller is kept in full in the cut
(`deferred`) and takes its place when room returns. Summaries come from the request's
ready ones (`ProjectionRequest.summaries`, by chunk_digest), else the Summarizer; the
blocks made are listed in Projection.chunks.

The cut is sticky: the returned CutPoint is passed back with the next request and
applied before anything else. Every projection is checked by check_invariants before
it is returned.
"""

from __future__ import annotations

import hashlib
import itertools
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from proxy.core.blocks import Block, compile_pins, pinned_flags, segment
from proxy.core.budget import history_budget
from proxy.core.compress import compressed_for, is_compressible
from proxy.core.invariants import check_invariants
from proxy.core.items import APPROVAL_ANSWERS, APPROVAL_REQUEST, Item, content_digest
from proxy.core.memory import (
    HEADER,
    SUMMARY_MARKER,
    MemoryState,
    Summarizer,
    fit_summary,
    is_summary,
    referenced_values,
    summarize_turns,
    summary_item,
    taken_in,
)
from proxy.core.tokens import REPLY_PRIMING, TokenCounter

# A cut leaves room for this many more turns the size of the recent ones.
HEADROOM_TURNS = 2
# Compressing the newest results stops when it leaves room for this many more.
COMPRESS_HEADROOM_TURNS = 1
# A summary block gets this share of B_H (the budget without the current turn), never
# more than SUMMARY_MAX_TOKENS; a summary is never given less than SUMMARY_MIN_TOKENS
# (if that cannot fit, the request is refused rather than the summary dropped).
SUMMARY_SHARE = 0.1
SUMMARY_MAX_TOKENS = 1000
SUMMARY_MIN_TOKENS = 64


@dataclass(frozen=True)
class ProjectionPolicy:
    keep_recent_turns: int = 3
    tool_result_max_tokens: int = 800
    pin_patterns: tuple[str, ...] = ()
    target_fill: float = 0.65
    # The summary chain is consolidated into one block above this share of B_H.
    summary_chain_max_share: float = 0.3
    # At a history's first cut, its opening turns up to this share of B_H become a head
    # sent verbatim ahead of the summary chain from then on (`_opening`); 0: none.
    keep_opening_share: float = 0.4


@dataclass(frozen=True)
class CutPoint:
    """Where the verbatim history starts, and what stands for everything before it.

    `summary` holds the pinned items before `start` (verbatim, in log order) followed by
    the digest, if any; its first `opening` items are the history's first ones, verbatim
    (the opening head, `_opening`). `compressed` maps log positions to compressed tool
    results.
    """

    start: int
    summary: tuple[Item, ...]
    compressed: tuple[tuple[int, Item], ...] = ()
    deferred: Item | None = None  # full-room form of the last block, sent smaller
    opening: int = 0

    @property
    def chain(self) -> tuple[Item, ...]:
        """The summary blocks, oldest first (a cut stored before the chain holds one)."""
        return tuple(item for item in self.summary if is_summary(item))


@dataclass(frozen=True)
class SummaryChunk:
    """One summary block this projection made: what it stands for and under which limit.

    `digest` names the inputs (`chunk_digest`): a summary written elsewhere for them (an
    LLM summarizer in the background) comes back in ProjectionRequest.summaries under
    that key and is used instead of calling the summarizer. `ready` says it was.
    """

    digest: str
    items: tuple[Item, ...]
    max_tokens: int
    previous: Item | None
    summary: Item
    ready: bool = False


def chunk_digest(items: Sequence[Item], max_tokens: int, previous: Item | None) -> str:
    """The key of a summary's inputs: the items' content digests, the limit and the
    previous summary it extends (consolidation), if any."""
    return content_digest(
        {
            "items": [item.digest for item in items],
            "max_tokens": max_tokens,
            "previous": previous.digest if previous is not None else None,
        }
    )


@dataclass(frozen=True)
class ProjectionRequest:
    items: Sequence[Item]
    window: int
    output: int
    epsilon: int
    tools_tokens: int = 0
    instructions_tokens: int = 0
    # Once per prompt (reply priming, or a chat template's fixed part): TokenCounter.reply_tokens.
    reply_tokens: int = REPLY_PRIMING
    first_position: int = 0
    cut: CutPoint | None = None
    # No stored cut comes back (a stateless client, or a thread's first cut): the cut is
    # replayed from the history (`_replayed_cut`).
    stateless: bool = False
    # Summaries already written for chunks, by chunk_digest (e.g. by an LLM summarizer
    # after an earlier request exposed the chunk in Projection.chunks).
    summaries: Mapping[str, Item] = field(default_factory=dict)
    # Responses `truncation: "disabled"`: the items are sent as given, nothing compressed,
    # summarized or dropped, and a history that does not fit is refused (`_verbatim`).
    verbatim: bool = False
    # For a window that starts at its cut (a stored thread): the items the cut's summary
    # chain stands for, in log order (the store's items from the opening head's end to
    # the window start, pinned ones left out), so a later turn naming one of their
    # values takes it in (`_take_in`). A stateless history holds them itself.
    chain_sources: Sequence[Item] = ()


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
    chunks: tuple[SummaryChunk, ...] = ()  # the summary blocks made for this projection


class ContextLengthExceeded(Exception):
    """Pinned text + tools + current turn + output reserve alone exceed the window, or
    leave less than SUMMARY_MIN_TOKENS for the summary of a history that must be cut."""

    def __init__(
        self, report: ProjectionReport, summary_min: int = 0, *, verbatim: bool = False
    ) -> None:
        self.report = report
        r = report
        needed = r.system + r.tools + r.current + r.output + r.epsilon
        if verbatim:
            needed += r.history_before
            super().__init__(
                f"This model's maximum context length is {r.window} tokens. However, your "
                f"request resulted in {needed} tokens (history {r.history_before}, pinned "
                f"{r.system}, tools {r.tools}, current turn {r.current}, output reserve "
                f"{r.output}, margin {r.epsilon}), and truncation is 'disabled', so nothing "
                "was dropped. Please reduce the length of the input, or set truncation to "
                "'auto' to let the history be summarized."
            )
            return
        if summary_min:
            needed += summary_min
            removed = f"even with all earlier history replaced by a {summary_min}-token summary"
        else:
            removed = "even with all earlier history removed"
        super().__init__(
            f"This model's maximum context length is {r.window} tokens. However, your "
            f"messages resulted in {needed} tokens {removed} "
            f"(pinned {r.system}, tools {r.tools}, current turn {r.current}, output reserve "
            f"{r.output}, margin {r.epsilon}). Please reduce the length of the messages, "
            "instructions or tools, or lower the maximum output tokens."
        )


# --- the working state of one projection ----------------------------------------------------


@dataclass
class _State:
    """What the projection decided so far; positions are absolute log positions."""

    request: ProjectionRequest
    policy: ProjectionPolicy
    summarizer: Summarizer
    blocks: list[Block]
    counter: TokenCounter
    start: int  # first position still sent verbatim
    old: tuple[Item, ...]  # the cut's prefix: carried pinned items and summary blocks, in order
    carried: tuple[Item, ...]  # the old pinned items no given item repeats (part of S)
    chain: tuple[Item, ...]  # the old summary blocks, oldest first
    deferred: Item | None = None  # the full-room form of the last block, made smaller
    replaced: dict[int, Item] = field(default_factory=dict)
    counts: list[int] = field(default_factory=list)  # tokens of each given item, counted once
    closed: list[Block] = field(default_factory=list)  # closed turns at or after start
    turn_tokens: list[int] = field(default_factory=list)  # of each closed turn, as sent
    cut: int = 0  # closed turns cut now (the first `cut` of `closed`)
    new_cut: bool = False
    capacity: int = 0  # B_H as if the current turn were empty and nothing pinned
    room: int = 0  # a new summary block's full room
    chain_max: int = 0  # the chain is consolidated above this
    new_blocks: list[tuple[int, Item]] = field(default_factory=list)  # (region end, block)
    consolidated: bool = False  # the new block replaces the old chain
    made: dict[str, SummaryChunk] = field(default_factory=dict)  # by chunk digest
    cut_changed: bool = False  # the stored cut changes without a new cut (deferred used)
    addendum: Item | None = None  # what the chain takes in of later-named values (`_take_in`)

    def tokens(self, position: int) -> int:
        """Tokens the item at `position` costs as sent (compressed when replaced)."""
        replacement = self.replaced.get(position)
        if replacement is not None:
            return self.counter.item(replacement)
        return self.counts[position - self.request.first_position]

    def original_tokens(self, block: Block) -> int:
        offset = self.request.first_position
        return sum(self.counts[p - offset] for p in block.positions)

    @property
    def chain_tokens(self) -> int:
        return self.counter.items(self.chain)

    @property
    def addendum_tokens(self) -> int:
        return self.counter.item(self.addendum) if self.addendum is not None else 0

    def rest(self, cut: int | None = None) -> int:
        """Tokens of the closed turns kept after cutting the first `cut` (default: now)."""
        return sum(self.turn_tokens[self.cut if cut is None else cut :])


def project_context(
    request: ProjectionRequest,
    counter: TokenCounter,
    policy: ProjectionPolicy,
    summarizer: Summarizer = summarize_turns,
) -> Projection:
    """The context to send for `request`, under its budget, with the cut to keep."""
    if request.verbatim:
        return _verbatim(request, counter, policy)
    if not request.stateless or request.cut is not None:
        return _project(request, counter, policy, summarizer)
    whole = _prepared(request, counter, policy, summarizer)
    if _history(whole.state) <= whole.budget:
        # It fits whole, so each earlier request of its history did (they hold fewer of
        # the same items): there is no cut to replay.
        return _projected(whole)
    cut, made = _replayed_cut(request, counter, policy, summarizer)
    projection = _project(replace(request, cut=cut), counter, policy, summarizer)
    # The blocks sent were made while replaying, most of them: Projection.chunks lists them.
    known = {id(chunk.summary): chunk for chunk in (*made, *projection.chunks)}
    sent = (known.get(id(item)) for item in projection.items if is_summary(item))
    return replace(projection, chunks=tuple(chunk for chunk in sent if chunk is not None))


def _verbatim(
    request: ProjectionRequest, counter: TokenCounter, policy: ProjectionPolicy
) -> Projection:
    """OpenAI's `truncation: "disabled"`: every item as given (no stored cut applies, no
    result is compressed, nothing is summarized or dropped), or ContextLengthExceeded
    when the whole history does not fit. No cut is kept: the thread's stays as it was."""
    request = replace(request, cut=None, stateless=True, first_position=0)
    blocks = segment(request.items, policy.pin_patterns, request.first_position)
    state = _initial_state(request, policy, summarize_turns, blocks, counter)
    fixed = _fixed_tokens(state)
    budget = history_budget(
        request.window,
        fixed.system,
        request.tools_tokens,
        fixed.current,
        request.output,
        request.epsilon,
    )
    if _history(state) > budget:
        raise ContextLengthExceeded(_overflow_report(state, fixed, budget), verbatim=True)
    return _finish(state, fixed, budget, keep_cut=False)


@dataclass
class _Prepared:
    state: _State
    fixed: _Fixed
    budget: int


def _project(
    request: ProjectionRequest,
    counter: TokenCounter,
    policy: ProjectionPolicy,
    summarizer: Summarizer,
) -> Projection:
    """The projection of `request`. At its history's first cut that summarizes turns,
    with the opening head (`_opening`) if that fits. The head is given up (`_released`)
    when it leaves a later request no room, or keeps its recent turns from their place:
    it may cost a cached prefix, never a refused request or a recent turn."""
    try:
        prepared = _prepared(request, counter, policy, summarizer)
        released = _released(request, counter, policy, summarizer) if _crowded(prepared) else None
        if released is not None:
            prepared = _prepared(released, counter, policy, summarizer)
        opened = _opening(prepared)
        projection = _projected(prepared)
        if opened is not None and projection.cut is not None and projection.cut.chain:
            try:
                return _projected(_prepared(opened, counter, policy, summarizer))
            except ContextLengthExceeded:
                pass
        return projection
    except ContextLengthExceeded:
        released = _released(request, counter, policy, summarizer)
        if released is None:
            raise
        return _projected(_prepared(released, counter, policy, summarizer))


def _opening(prepared: _Prepared) -> ProjectionRequest | None:
    """Before a history's first cut, the request with a cut that makes its opening turns
    a head: the whole turns from the start, up to keep_opening_share of B_H (without the
    current turn: a large one at the first cut would shrink the head for good), carried
    verbatim ahead of the summary chain from then on. Every later cut then re-sends less
    (the provider caches the head), and the task and rules of the first turns stay as
    they were said. Its items are the ones the last request sent, a tool result
    compressed before in its compressed form: the prefix then repeats up to the end of
    the head and breaks only at the first summary block (a result sent whole again would
    break it at that result, near the start). Everything here is counted as sent: the
    head's turns, and the recent turns (keep_recent_turns, not summarized, their results
    compressed where they are), which keep their room beside a full summary block and
    HEADROOM_TURNS more turns like them (a later turn's large result is compressed as
    theirs were; counted as they arrived, a head would hardly ever fit). None
    when no cut is due, one was made before (a cut that only compressed does not count),
    or no turn fits."""
    state, budget = prepared.state, prepared.budget
    request, cut = state.request, state.request.cut
    share = state.policy.keep_opening_share
    if not share or _history(state) <= budget:
        return None
    if cut is not None and (cut.chain or cut.opening or cut.start > request.first_position):
        return None
    kept, count = _recent_sent(state)
    headroom = HEADROOM_TURNS * kept // max(1, count)
    room = min(int(share * state.capacity), budget - state.room - kept - headroom)
    end, total = request.first_position, 0
    for block in state.closed:
        total += _block_tokens(state, block)
        if total > room:
            break
        end = block.last + 1
    count = end - request.first_position
    if not count:
        return None
    sent = dict(cut.compressed) if cut else {}
    first = request.first_position
    items = tuple(sent.get(first + i, item) for i, item in enumerate(request.items[:count]))
    compressed = tuple((p, item) for p, item in cut.compressed if p >= end) if cut else ()
    head = CutPoint(end, items, compressed, opening=count)
    return replace(request, cut=head)


def _recent(state: _State) -> tuple[int, int]:
    """(tokens, count) of the recent closed turns (keep_recent_turns), as they arrived."""
    keep = state.policy.keep_recent_turns
    recent = state.closed[-keep:] if keep else []
    return sum(map(state.original_tokens, recent)), len(recent)


def _recent_sent(state: _State) -> tuple[int, int]:
    """(tokens, count) of the recent closed turns (keep_recent_turns), as sent (their
    results compressed where they are): what they take beside an opening head."""
    keep = state.policy.keep_recent_turns
    recent = state.turn_tokens[-keep:] if keep else []
    return sum(recent), len(recent)


def _crowded(prepared: _Prepared) -> bool:
    """Whether, at a cut, the recent turns (keep_recent_turns, as sent: not summarized,
    their results compressed where they are) and a full summary block do not fit beside
    the opening head: it then gives way to them. Measured as `_opening` sized it."""
    state, budget = prepared.state, prepared.budget
    cut = state.request.cut
    if cut is None or not cut.opening or _history(state) <= budget:
        return False
    return budget < state.room + _recent_sent(state)[0]


def _released(
    request: ProjectionRequest,
    counter: TokenCounter,
    policy: ProjectionPolicy,
    summarizer: Summarizer,
) -> ProjectionRequest | None:
    """The request with its cut's opening head given up: the head's pinned items stay,
    its turns become one summary block ahead of the chain (they are its oldest items).
    The block is not listed in Projection.chunks: no LLM summary replaces it."""
    cut = request.cut
    if cut is None or not cut.opening:
        return None
    head = cut.summary[: cut.opening]
    flags = pinned_flags(head, compile_pins(policy.pin_patterns))
    kept = tuple(item for item, pinned in zip(head, flags, strict=True) if pinned)
    turns = [item for item, pinned in zip(head, flags, strict=True) if not pinned]
    room = _summary_room(_capacity(request))
    digest = chunk_digest(turns, room, None)
    block = (_summarize(summarizer, counter, turns, room, None, digest),) if turns else ()
    summary = (*kept, *block, *cut.summary[cut.opening :])
    return replace(request, cut=replace(cut, summary=summary, opening=0))


def _capacity(request: ProjectionRequest) -> int:
    """B_H as if the current turn were empty and nothing pinned."""
    return (
        request.window
        - request.tools_tokens
        - request.output
        - request.epsilon
        - request.instructions_tokens
        - request.reply_tokens
    )


def _prepared(
    request: ProjectionRequest,
    counter: TokenCounter,
    policy: ProjectionPolicy,
    summarizer: Summarizer,
) -> _Prepared:
    """The state with the previous cut applied, the fixed tokens and B_H."""
    blocks = segment(request.items, policy.pin_patterns, request.first_position)
    state = _initial_state(request, policy, summarizer, blocks, counter)
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
    # The summary's room is decided on the budget without the current turn and the pinned
    # items: a transient large current turn must not starve a block that then stays for
    # many turns, and a pinned message appearing must not change every block's bytes.
    state.capacity = capacity = budget + fixed.current + fixed.pinned
    state.room = _summary_room(capacity)
    state.chain_max = int(capacity * policy.summary_chain_max_share)
    return _Prepared(state, fixed, budget)


def _projected(prepared: _Prepared) -> Projection:
    state, fixed, budget = prepared.state, prepared.fixed, prepared.budget
    _expand_deferred(state, budget)
    _recompress_named(state, state.policy)  # a later turn named what a form lacks
    _take_in(state, state.start, state.chain)  # ... or what the summary region lacks
    relieved = _relieve(state, budget, state.policy)
    if state.new_cut:
        _settle(state, budget, fixed)
        _take_in_cut(state, budget)
    keep = relieved or state.request.cut is not None or state.cut_changed
    return _finish(state, fixed, budget, keep)


def _replayed_cut(
    request: ProjectionRequest,
    counter: TokenCounter,
    policy: ProjectionPolicy,
    summarizer: Summarizer,
) -> tuple[CutPoint | None, list[SummaryChunk]]:
    """A stateless client's cut: the one a stored thread would hold had the client sent
    each of its earlier requests to it (the history up to each model answer, with the cut
    carried from the one before). It depends on the history alone, so the same history
    prefix always gives the same cut and the same bytes, and a later request only adds to
    it: its prefix repeats until the next cut, as a stored thread's does.

    The replay resumes from the last request of the same history it has seen (`_replays`),
    so a client resending its history pays for its new requests only, and it projects
    only the requests that do not fit as the cut left them (`_Fit`): at the others the
    projection changes nothing, so a long history costs one projection per cut."""
    items = request.items
    fit = _Fit(request, counter, policy)
    ends = [end for end in request_ends(items) if end < len(items)]
    keys = _replay_keys(request, counter, policy, summarizer, ends)
    cut: CutPoint | None = None
    made: list[SummaryChunk] = []
    resume = 0
    for index in range(len(ends) - 1, -1, -1):
        hit = _replays.get(keys[index])
        if hit is not None and _still_made(hit, request.summaries):
            cut, made, resume = hit.cut, list(hit.made), index + 1
            break
    for end in ends[resume:]:
        if fit.fits(cut, end):
            continue
        # A stored thread's window: the items from its cut on (its prefix stands for the
        # rest), and so a replayed request costs what the window holds, not the history.
        first = fit.window_start(cut)
        asked = replace(
            request,
            items=items[first:end],
            first_position=request.first_position + first,
            cut=cut,
            stateless=False,
        )
        try:
            projection = _project(asked, counter, policy, summarizer)
        except ContextLengthExceeded:
            continue  # that request alone was too large: the cut stays as it was
        cut = projection.cut
        made += projection.chunks
    if cut is not None:
        chain = {id(item) for item in cut.chain}
        made = [chunk for chunk in made if id(chunk.summary) in chain]
    if ends and resume < len(ends):
        if len(_replays) >= REPLAY_CACHE_MAX:
            _replays.clear()
        _replays[keys[-1]] = _Replay(cut, tuple(made))
    return cut, made


class _Fit:
    """Whether the request of the first `end` items fits as `cut` leaves it, so its
    projection would change nothing. Counted from above (a pinned item both given and
    carried in the cut's prefix counts twice): a request that would be cut is never
    taken to fit. A cut holding a deferred block never fits (it may grow back)."""

    def __init__(
        self, request: ProjectionRequest, counter: TokenCounter, policy: ProjectionPolicy
    ) -> None:
        self.request, self.counter = request, counter
        pins = compile_pins(policy.pin_patterns)
        self.counts = [counter.item(item) for item in request.items]
        self.total = list(itertools.accumulate(self.counts, initial=0))
        flags = pinned_flags(request.items, pins)
        pinned = (c if p else 0 for p, c in zip(flags, self.counts, strict=True))
        self.pinned = list(itertools.accumulate(pinned, initial=0))
        self.limit = _capacity(request)
        self._cut: CutPoint | None = None
        self._cut_tokens = 0
        # reach[i]: the earliest call that an output at or after i answers (len: none).
        calls: dict[str, int] = {}
        answered = []
        for index, item in enumerate(request.items):
            for call_id in item.call_ids:
                calls.setdefault(call_id, index)
            answered.append(calls.get(item.output_for or "", index))
        self.reach = list(itertools.accumulate(reversed(answered), min, initial=len(answered)))
        self.reach.reverse()

    def fits(self, cut: CutPoint | None, end: int) -> bool:
        if cut is None:
            return self.total[end] <= self.limit
        if cut.deferred is not None:
            return False
        if cut is not self._cut:
            self._cut, self._cut_tokens = cut, self._tokens_before(cut)
        start = self._index(cut.start)
        if start > end:
            return False
        return self._cut_tokens + self.total[end] - self.total[start] <= self.limit

    def window_start(self, cut: CutPoint | None) -> int:
        """The index a stored thread's window would start at: the cut's start, moved back
        so that no output in the window answers a call before it (turns merged across a
        late output are realigned whole, as in the full history)."""
        start = self._index(cut.start) if cut is not None else 0
        while self.reach[start] < start:
            start = self.reach[start]
        return start

    def _index(self, position: int) -> int:
        return min(max(0, position - self.request.first_position), len(self.counts))

    def _tokens_before(self, cut: CutPoint) -> int:
        """The cut's prefix, the given pinned items before its start, and what its
        compressed tool results weigh above the originals."""
        start = self._index(cut.start)
        compressed = sum(
            self.counter.item(item) - self.counts[self._index(position)]
            for position, item in cut.compressed
            if start <= self._index(position) < len(self.counts)
        )
        return self.counter.items(cut.summary) + self.pinned[start] + compressed


@dataclass(frozen=True)
class _Replay:
    cut: CutPoint | None
    made: tuple[SummaryChunk, ...]  # the blocks of its chain, as made


# Replayed cuts by history prefix and everything else the projection reads. Bounded;
# cleared when full (a miss only costs a longer replay, never other bytes).
_replays: dict[tuple[object, ...], _Replay] = {}
REPLAY_CACHE_MAX = 1024


def _replay_keys(
    request: ProjectionRequest,
    counter: TokenCounter,
    policy: ProjectionPolicy,
    summarizer: Summarizer,
    ends: Sequence[int],
) -> list[tuple[object, ...]]:
    """For each replayed request (the first `end` items), what its projection depends on:
    the items (a running hash of their digests), the budget inputs, the policy."""
    context = (
        request.items[0].api if request.items else "",
        request.window,
        request.output,
        request.epsilon,
        request.tools_tokens,
        request.instructions_tokens,
        request.reply_tokens,
        request.first_position,
        counter.tokenizer_id,
        policy,
        summarizer,
    )
    running = hashlib.sha256()
    keys: list[tuple[object, ...]] = []
    done = 0
    for end in ends:
        for item in request.items[done:end]:
            running.update(item.digest.encode())
        done = end
        keys.append((running.hexdigest(), *context))
    return keys


def _still_made(replay: _Replay, summaries: Mapping[str, Item]) -> bool:
    """Whether each block was made as it would be now: with the ready summary the request
    has for it, or without one when it has none (an LLM summary written since, or one no
    longer at hand, makes the replay run again)."""
    for chunk in replay.made:
        ready = summaries.get(chunk.digest)
        if ready != (chunk.summary if chunk.ready else None):
            return False
    return True


def request_ends(items: Sequence[Item]) -> list[int]:
    """Where a client's requests ended in a history: after each user message or batch of
    tool results that the next item (the model's answer) or the history's end follows."""
    return [
        end
        for end in range(1, len(items) + 1)
        if _asks(items[end - 1]) and (end == len(items) or not _asks(items[end]))
    ]


def _asks(item: Item) -> bool:
    """Whether a request may end with the item: a user message or a tool result."""
    return item.is_user_message or item.output_for is not None


# --- the sticky cut -------------------------------------------------------------------------


def _initial_state(
    request: ProjectionRequest,
    policy: ProjectionPolicy,
    summarizer: Summarizer,
    blocks: list[Block],
    counter: TokenCounter,
) -> _State:
    """The state after applying the previous cut, realigned to a block boundary."""
    cut = request.cut
    start = request.first_position
    old: tuple[Item, ...] = ()
    carried: tuple[Item, ...] = ()
    replaced: dict[int, Item] = {}
    deferred = None
    if cut is not None:
        end = request.first_position + len(request.items)
        start = _aligned_start(min(max(cut.start, start), end), blocks)
        old = cut.summary
        given = Counter(
            item.digest
            for block in blocks
            if block.kind == "pinned" and block.first < start
            for item in block.items
        )
        kept = []
        for item in old:
            if is_summary(item):
                continue
            if given[item.digest] > 0:
                given[item.digest] -= 1
            else:
                kept.append(item)
        carried = tuple(kept)
        current = {p for block in blocks if block.kind == "current" for p in block.positions}
        replaced = {p: i for p, i in cut.compressed if p >= start and p not in current}
        deferred = cut.deferred
    counts = [counter.item(item) for item in request.items]
    state = _State(
        request,
        policy,
        summarizer,
        blocks,
        counter,
        start,
        old,
        carried,
        tuple(i for i in old if is_summary(i)),
        deferred,
        replaced=replaced,
        counts=counts,
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
    pinned: int  # the pinned and carried items' share of `system`


def _fixed_tokens(state: _State) -> _Fixed:
    """S (pinned, carried, instructions, reply priming) and U (the current turn)."""
    pinned = sum(state.original_tokens(b) for b in state.blocks if b.kind == "pinned")
    pinned += state.counter.items(state.carried)
    system = pinned + state.request.instructions_tokens + state.request.reply_tokens
    current = sum(state.original_tokens(b) for b in state.blocks if b.kind == "current")
    return _Fixed(system, current, pinned)


def _expand_deferred(state: _State, budget: int) -> None:
    """A block made smaller than its room (a large current turn left little) takes its
    full form again once it fits, or when a cut comes anyway. Only the last block
    changes: the bytes of the blocks before it stay as they were."""
    full = state.deferred
    made = [item for item in state.chain if not _is_addendum(item)]
    if full is None or not made:
        state.deferred = None
        return
    last = made[-1]  # an addendum sent after it (`_take_in`) is not the block made smaller
    extra = state.counter.item(full) - state.counter.item(last)
    history = _history(state)
    if history + extra > budget and history <= budget:
        return  # no room yet, and nothing else changes: keep the prefix
    state.old = tuple(full if item is last else item for item in state.old)
    state.chain = tuple(full if item is last else item for item in state.chain)
    state.deferred = None
    state.cut_changed = True


def _is_addendum(item: Item) -> bool:
    """A block `_take_in` made: it stands for no items of its own."""
    match = HEADER.match(item.text())
    return match is not None and match.group(1) == "0"


def _take_in(state: _State, start: int, chain: Sequence[Item]) -> bool:
    """What a later turn names of the items the summary chain stands for, when the chain
    lacks it (memory.taken_in: a block was written before anybody named the value): the
    facts holding it as one small block sent after the chain and every pinned item, at
    the end of the summary region, so the prefix before it repeats byte for byte (a
    block rewritten in place would break it at that block). At most a block's room;
    counted in the history, so a cut makes room for it like for any block. `start`: the
    first position sent verbatim, `chain`: the blocks before it. The chain's items come
    from the request: a stateless client's history (positions from the opening head's
    end on, not pinned), else `chain_sources` (a stored thread's, read from the store)
    and the given items before `start`; without them nothing is taken in. True when a
    block is made (it replaces any made before for this request)."""
    request, cut = state.request, state.request.cut
    if not chain or cut is None:
        return False
    offset = request.first_position
    first = max(0, cut.opening) if offset == 0 else 0
    pinned = {p for b in state.blocks if b.kind == "pinned" for p in b.positions}
    given = [request.items[p - offset] for p in range(offset + first, start) if p not in pinned]
    sources = given if offset == 0 else [*request.chain_sources, *given]
    if not sources:
        return False
    later = request.items[start - offset :]
    written = "\n".join(item.text() for item in chain)
    facts = taken_in(sources, later, written)
    if not facts:
        return False
    block = fit_summary(chain[-1].api, MemoryState(facts=facts), state.counter, state.room)
    if not any(fact in block.text() for fact in facts):
        return False
    state.addendum = block
    state.cut_changed = True
    return True


def _take_in_cut(state: _State, budget: int) -> None:
    """After a cut: the turns it summarizes now are the chain's items too (the block made
    for them knows nothing of the current turn), so the take-in is made again over them
    and the new blocks, when what it then sends still fits; else the one made before
    the cut stands (the next request makes it again)."""
    kept = state.addendum
    blocks = [block for _, block in state.new_blocks]
    chain = [*([] if state.consolidated else state.chain), *blocks]
    if not _take_in(state, _new_start(state), chain):
        return
    sent = state.counter.items(chain) + state.rest() + state.addendum_tokens
    if sent > budget:
        state.addendum = kept


# --- pressure relief (SPEC section 5) -------------------------------------------------------


def _relieve(state: _State, budget: int, policy: ProjectionPolicy) -> bool:
    """Compresses and cuts when the history does not fit; True when anything changed.

    Step 1 compresses large tool results of the closed turns from the end of the prefix
    back (`_compress`): the provider caches an exact prefix, so a result rewritten at
    position p costs every token after p. Only a history that still does not fit is cut,
    down to _cut_target at once (SPEC 5, cache-aware): the older turns give way first;
    only a history that still does not fit loses recent turns too, the oldest first."""
    if _history(state) <= budget:
        return False
    turns = len(state.closed)
    _compress(state, policy, budget)
    if _history(state) <= budget:
        return True
    older = max(0, turns - policy.keep_recent_turns)
    target = _cut_target(state, budget, policy)
    if older > state.cut:
        _cut_to_target(state, older, target)
    if _history(state) > budget:
        _cut_to_target(state, turns, target)
    return True


def _cut_target(state: _State, budget: int, policy: ProjectionPolicy) -> int:
    """target_fill * B_H, lower when the recent turns are large: after the cut there is
    room for HEADROOM_TURNS more turns of their mean size (as they arrived, before any
    compression), so the next cut does not come with the very next turn. Every cut
    changes the prefix after the summary chain."""
    kept, count = _recent(state)
    typical = kept // max(1, count)
    return max(0, min(int(budget * policy.target_fill), budget - HEADROOM_TURNS * typical))


def _summary_room(budget: int) -> int:
    return max(SUMMARY_MIN_TOKENS, min(SUMMARY_MAX_TOKENS, int(budget * SUMMARY_SHARE)))


def _history(state: _State) -> int:
    """Tokens of the summary chain and the closed turns still kept; once turns are cut,
    at least SUMMARY_MIN_TOKENS for their summary (its size is settled last)."""
    kept = state.chain_tokens + state.addendum_tokens + state.rest()
    if state.new_cut:
        kept += SUMMARY_MIN_TOKENS
    return kept


@dataclass(frozen=True)
class _Large:
    """A tool result of a kept closed turn above tool_result_max_tokens (or, for
    `_recompress_named`, one compressed already)."""

    turn: int  # index in state.closed
    index: int  # in its turn's items
    position: int
    item: Item
    call: Item | None  # the call last made before it (clients may reuse a call id)


def _compress(state: _State, policy: ProjectionPolicy, budget: int) -> None:
    """Step 1, in chunks that keep the cached prefix: first the large results after the
    last one compressed (the turns closed since the last relief), the newest turn first,
    until the history leaves room for COMPRESS_HEADROOM_TURNS more turns like the recent
    ones; the prefix then changes only from the oldest of them on, near its end. When
    they are not enough, every large result of the kept closed turns at once: the
    change must then reach back to the oldest one anyway, and one change there is
    cheaper than one a little earlier at every relief."""
    large = _large_results(state, policy)
    later = _named_after(state)
    last = max((p for p in state.replaced if p >= state.start), default=-1)
    tail = [result for result in large if result.position > last]
    kept, count = _recent(state)
    goal = budget - COMPRESS_HEADROOM_TURNS * kept // max(1, count)
    for turn in sorted({result.turn for result in tail}, reverse=True):
        if _history(state) <= goal:
            return
        for result in tail:
            if result.turn == turn:
                _compress_one(state, policy, result, later)
    if _history(state) > budget:
        for result in large:
            if result.position not in state.replaced:
                _compress_one(state, policy, result, later)


def _recompress_named(state: _State, policy: ProjectionPolicy) -> None:
    """The results compressed already whose form lacks a value a later turn names:
    compressed again with it (one prefix break instead of a lost fact); every other
    form stays byte for byte (compressed_for)."""
    compressed = _large_results(state, policy, compressed=True)
    if not compressed:
        return
    later = _named_after(state)
    for result in compressed:
        smaller = _form(state, policy, result, later)
        if smaller.raw != state.replaced[result.position].raw:
            before, after = state.tokens(result.position), state.counter.item(smaller)
            state.replaced[result.position] = smaller
            state.turn_tokens[result.turn] += after - before


def _large_results(
    state: _State, policy: ProjectionPolicy, *, compressed: bool = False
) -> list[_Large]:
    """The kept closed turns' large results still whole, in log order; `compressed`:
    those compressed already instead."""
    calls = _calls_by_id(state.closed)
    found: list[_Large] = []
    for turn in range(state.cut, len(state.closed)):
        block = state.closed[turn]
        for index, (position, item) in enumerate(zip(block.positions, block.items, strict=True)):
            calls.update(dict.fromkeys(item.call_ids, item))
            if (position in state.replaced) != compressed or not is_compressible(item):
                continue
            if compressed or state.tokens(position) > policy.tool_result_max_tokens:
                found.append(_Large(turn, index, position, item, calls.get(item.output_for or "")))
    return found


def _form(
    state: _State, policy: ProjectionPolicy, result: _Large, later: Sequence[frozenset[str]]
) -> Item:
    """A result's compressed form: keeping what the rest of its closed turn refers to
    (fixed once the turn is closed), the assistant's statements' evidence, and what
    later turns name that the form would lack (issue 22, item 3: compressed_for)."""
    rest = state.closed[result.turn].items[result.index + 1 :]
    return compressed_for(
        result.item,
        result.call,
        policy.tool_result_max_tokens,
        state.counter,
        referenced_values(rest),
        later[result.turn],
        [i.text() for i in rest if i.role == "assistant"],
    )


def _compress_one(
    state: _State, policy: ProjectionPolicy, result: _Large, later: Sequence[frozenset[str]]
) -> None:
    """One result in its place; kept whole when its compressed form is not smaller."""
    before = state.tokens(result.position)
    smaller = _form(state, policy, result, later)
    after = state.counter.item(smaller)
    if after < before:
        state.replaced[result.position] = smaller
        state.turn_tokens[result.turn] -= before - after


def _named_after(state: _State) -> list[frozenset[str]]:
    """Per closed turn, what the turns after it name (referenced_values), the current
    turn included, in one backward pass."""
    current = [i for b in state.blocks if b.kind == "current" for i in b.items]
    seen = set(referenced_values(current))
    found: list[frozenset[str]] = [frozenset()] * len(state.closed)
    for turn in range(len(state.closed) - 1, -1, -1):
        found[turn] = frozenset(seen)
        seen.update(referenced_values(state.closed[turn].items))
    return found


def _calls_by_id(blocks: Sequence[Block]) -> dict[str, Item]:
    return {call_id: item for b in blocks for item in b.items for call_id in item.call_ids}


def _cut_to_target(state: _State, highest: int, target: int) -> None:
    """Steps 2 and 3: summarize the fewest oldest turns (at least one more, at most up to
    `highest`) that bring the chain, a new block of full room and the kept turns down to
    target_fill * B_H. A chain that the new block would push over its share is counted
    at its consolidated size."""
    chain = state.chain_tokens + state.room
    if state.chain and chain > state.chain_max:
        chain = _consolidated_room(state)
    chain += state.addendum_tokens
    rest = state.rest()
    cut = state.cut
    while cut < highest:
        rest -= state.turn_tokens[cut]
        cut += 1
        if rest + chain <= target:
            break
    state.cut = cut
    state.new_cut = True


def _consolidated_room(state: _State) -> int:
    return max(state.room, state.chain_max // 2)


# --- the summary blocks of a stateful cut ------------------------------------------------


def _settle(state: _State, budget: int, fixed: _Fixed) -> None:
    """The block for the turns cut now, appended to the chain. A summary is never
    dropped: when it does not fit, more of the oldest kept turns are cut into it (the
    older ones first), then the chain is consolidated with it; a summary gets at least
    SUMMARY_MIN_TOKENS or the request is refused with the breakdown."""
    older = max(0, len(state.closed) - state.policy.keep_recent_turns)
    while True:
        if _append_block(state, budget):
            return
        if state.cut < older:
            state.cut += 1
            continue
        if _consolidate_all(state, budget):
            return
        if state.cut < len(state.closed):
            state.cut += 1
            continue
        raise ContextLengthExceeded(_overflow_report(state, fixed, budget), SUMMARY_MIN_TOKENS)


def _cut_items(state: _State, first: int = 0, end: int | None = None) -> list[Item]:
    stop = state.cut if end is None else end
    return [item for block in state.closed[first:stop] for item in block.items]


def _region_end(state: _State, cut: int) -> int:
    """The first log position after the first `cut` closed turns (pinned items before it
    go into the prefix ahead of the block that stands for those turns)."""
    return state.closed[cut - 1].last + 1


def _append_block(state: _State, budget: int) -> bool:
    """One new block for the cut turns at its full room, or what is left of it (at least
    SUMMARY_MIN_TOKENS); consolidated with the chain when the chain outgrows its share."""
    if state.cut == 0:
        return _history(state) - SUMMARY_MIN_TOKENS <= budget
    rest = state.rest()
    room = min(state.room, budget - rest - state.chain_tokens - state.addendum_tokens)
    if room < SUMMARY_MIN_TOKENS:
        return False
    if state.chain and state.chain_tokens + state.room > state.chain_max:
        return _consolidate_all(state, budget)  # as _cut_to_target counted the chain
    items = _cut_items(state)
    block = _summary(state, items, room, None)
    if block is None:
        return False
    state.new_blocks = [(_region_end(state, state.cut), block)]
    state.consolidated = False
    if room < state.room:
        full = _summary(state, items, state.room, None)
        if full is not None and state.counter.item(full) > state.counter.item(block):
            state.deferred = full
    return True


def _consolidate_all(state: _State, budget: int) -> bool:
    """The chain and the cut turns as one block (the summarizer extends the joined chain
    with the cut turns), when at least SUMMARY_MIN_TOKENS are left for it."""
    if not state.chain and state.cut == 0:
        return False
    room = min(_consolidated_room(state), budget - state.rest() - state.addendum_tokens)
    if room < SUMMARY_MIN_TOKENS:
        return False
    previous = _joined(state.chain) if state.chain else None
    block = _summary(state, _cut_items(state), room, previous)
    if block is None:
        return False
    end = _region_end(state, state.cut) if state.cut else state.start
    state.new_blocks = [(end, block)]
    state.consolidated = True
    state.new_cut = True
    state.deferred = None
    return True


def _joined(chain: Sequence[Item]) -> Item:
    """The chain's blocks as one previous summary for the summarizer to extend: one
    header that stands for every block's items, then each block's entries."""
    if len(chain) == 1:
        return chain[0]
    texts = [item.text() for item in chain]
    headers = [HEADER.match(text) for text in texts]
    if not all(headers):
        return summary_item(chain[0].api, "\n".join(texts))
    total = sum(int(match.group(1)) for match in headers if match)
    first = texts[0].replace(
        headers[0].group(0) if headers[0] else "",
        f"{SUMMARY_MARKER} Stands for {total} earlier items",
        1,
    )
    bodies = [text.partition("\n")[2] for text in texts[1:]]
    return summary_item(chain[0].api, "\n".join([first, *(b for b in bodies if b)]))


# --- one summary block ----------------------------------------------------------------------

# Deterministic digests already made, by chunk digest, encoding and API: a stateless
# client resends the same chunks every turn. Bounded; cleared when full.
_made: dict[tuple[str, str, str], Item] = {}
MADE_CACHE_MAX = 4096


def _summary(state: _State, items: Sequence[Item], room: int, previous: Item | None) -> Item | None:
    """The summary of `items` (extending `previous`) in at most `room` tokens: a ready one
    from the request when it fits, else the summarizer's, else the deterministic digest;
    None when none fits. The ones sent are listed in Projection.chunks."""
    if not items and previous is None:
        return None
    digest = chunk_digest(items, room, previous)
    known = state.made.get(digest)
    if known is not None:
        return known.summary
    counter = state.counter
    ready = state.request.summaries.get(digest)
    if ready is not None and is_summary(ready) and counter.item(ready) <= room:
        made, from_request = ready, True
    else:
        made = _summarize(state.summarizer, counter, items, room, previous, digest)
        from_request = False
        if counter.item(made) > room:
            return None
    state.made[digest] = SummaryChunk(digest, tuple(items), room, previous, made, from_request)
    return made


def _summarize(
    summarizer: Summarizer,
    counter: TokenCounter,
    items: Sequence[Item],
    room: int,
    previous: Item | None,
    digest: str,
) -> Item:
    if summarizer is not summarize_turns:
        made = summarizer(items, counter, room, previous)
        if counter.item(made) <= room and is_summary(made):
            return made
    api = items[0].api if items else previous.api if previous is not None else "chat"
    key = (digest, counter.tokenizer_id, api)  # a Chat and a Responses history may match
    cached = _made.get(key)
    if cached is None:
        cached = summarize_turns(items, counter, room, previous)
        if len(_made) >= MADE_CACHE_MAX:
            _made.clear()
        _made[key] = cached
    return cached


# --- the result -----------------------------------------------------------------------------


@dataclass(frozen=True)
class _Outcome:
    """Where the verbatim history now starts and what stands before it."""

    start: int
    prefix: tuple[Item, ...]
    chain: tuple[Item, ...]  # the summary blocks in the prefix
    cut_away: tuple[int, ...]  # positions of given, non-pinned items before start


def _finish(state: _State, fixed: _Fixed, budget: int, keep_cut: bool) -> Projection:
    request, offset = state.request, state.request.first_position
    outcome = _outcome(state)
    sent = list(outcome.prefix)
    for index in range(outcome.start - offset, len(request.items)):
        sent.append(state.replaced.get(index + offset, request.items[index]))
    check_invariants(
        request.items,
        sent,
        _relative(state, "pinned"),
        _relative(state, "current"),
        len(outcome.prefix),
    )
    report = _report(state, fixed, budget, sent, outcome)
    compressed = tuple(sorted((p, i) for p, i in state.replaced.items() if p >= outcome.start))
    cut = None
    if keep_cut:
        opening = request.cut.opening if request.cut is not None else 0
        cut = CutPoint(outcome.start, outcome.prefix, compressed, state.deferred, opening)
    changed = len(sent) != len(request.items) or any(
        a is not b for a, b in zip(sent, request.items, strict=True)
    )
    made = {id(chunk.summary): chunk for chunk in state.made.values()}
    chunks = tuple(made[id(b)] for b in outcome.chain if id(b) in made)
    return Projection(tuple(sent), report, cut, changed, chunks)


def _relative(state: _State, kind: str) -> list[int]:
    offset = state.request.first_position
    return [p - offset for b in state.blocks if b.kind == kind for p in b.positions]


def _without_answered_approvals(
    state: _State, old: tuple[Item, ...], start: int
) -> tuple[Item, ...]:
    """The old prefix without the MCP approval requests it carried while pending (pinned
    past an earlier cut) whose answer this cut takes away: never sent half (SPEC 5)."""
    given = state.request.items[: max(0, start - state.request.first_position)]
    gone = {i.output_for for i in given if i.kind in APPROVAL_ANSWERS and i.output_for}
    gone -= {i.output_for for i in old if i.kind in APPROVAL_ANSWERS}  # an opening head's
    if not gone:
        return old
    return tuple(
        item for item in old if item.kind != APPROVAL_REQUEST or gone.isdisjoint(item.call_ids)
    )


def _outcome(state: _State) -> _Outcome:
    """The prefix: the old cut's prefix as it was (so its bytes repeat), then, for each new
    block, the pinned items of the turns it stands for and the block itself."""
    start = _new_start(state)
    old = _without_answered_approvals(state, state.old, start)
    if state.consolidated:
        old = tuple(item for item in old if not is_summary(item))
    # A given pinned item the old prefix already holds (a history resent whole) is sent
    # once, where the old prefix has it.
    repeated = Counter(item.digest for item in old if not is_summary(item))
    pinned: list[tuple[int, Item]] = []
    for block in state.blocks:
        if block.kind != "pinned" or block.first >= start:
            continue
        for position, item in zip(block.positions, block.items, strict=True):
            if position < state.start and repeated[item.digest] > 0:
                repeated[item.digest] -= 1
            else:
                pinned.append((position, item))
    prefix = list(old)
    for end, summary in state.new_blocks:
        prefix += [item for position, item in pinned if position < end]
        pinned = [(position, item) for position, item in pinned if position >= end]
        prefix.append(summary)
    prefix += [item for _, item in pinned]
    if state.addendum is not None:
        prefix.append(state.addendum)  # last: the prefix before it repeats
    chain = tuple(item for item in prefix if is_summary(item))
    pinned_positions = {p for b in state.blocks if b.kind == "pinned" for p in b.positions}
    offset = state.request.first_position
    # The given items the old prefix sends (an opening head, a history resent whole) are
    # not cut away.
    carried = Counter(item.digest for item in old if not is_summary(item))
    cut_away = tuple(
        p
        for p in range(offset, start)
        if p not in pinned_positions and not _taken(carried, state.request.items[p - offset])
    )
    return _Outcome(start, tuple(prefix), chain, cut_away)


def _taken(available: Counter[str], item: Item) -> bool:
    if available[item.digest] <= 0:
        return False
    available[item.digest] -= 1
    return True


def _new_start(state: _State) -> int:
    if state.cut == 0:
        return state.start
    if state.cut < len(state.closed):
        return state.closed[state.cut].first
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
    prompt = sent_tokens + request.instructions_tokens + request.tools_tokens + request.reply_tokens
    # Every item of the history not sent verbatim counts, whether it was cut now or on an
    # earlier request: the stored log before the given window, less its pinned items
    # (sent verbatim from the cut), plus the given items cut now.
    old_pinned = sum(1 for item in state.old if not is_summary(item))
    earlier = max(0, request.first_position - old_pinned)
    not_verbatim = earlier + len(outcome.cut_away)
    summarized = not_verbatim if outcome.chain else 0
    return replace(
        _overflow_report(state, fixed, budget),
        history_after=prompt - fixed.system - request.tools_tokens - fixed.current,
        prompt_tokens=prompt,
        blocks=_block_reports(state, outcome),
        dropped=not_verbatim - summarized,
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
    if outcome.chain or outcome.cut_away:
        offset = state.request.first_position
        before = sum(state.counts[p - offset] for p in outcome.cut_away)
        after = counter.items(outcome.chain)
        first = 0 if state.request.cut is not None else offset
        action = "summarized" if outcome.chain else "dropped"
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
