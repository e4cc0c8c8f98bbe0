"""Property tests of the projection (SPEC section 5): random Chat and Responses histories
with parallel calls, huge tool results, reasoning items, system messages mid-history,
pinned messages and random windows. Run with --hypothesis-show-statistics to see the
number of examples."""

import json
from collections.abc import Sequence
from dataclasses import dataclass

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from proxy.core.blocks import segment
from proxy.core.compress import is_compressible
from proxy.core.invariants import check_invariants
from proxy.core.items import Api, Item, chat_item, responses_item
from proxy.core.projection import (
    SUMMARY_MIN_TOKENS,
    ContextLengthExceeded,
    Projection,
    ProjectionPolicy,
    ProjectionRequest,
    project_context,
)
from proxy.core.tokens import REPLY_PRIMING, TokenCounter

COUNTER = TokenCounter.for_model("gpt-4o")
PROPERTY_SETTINGS = settings(
    max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
WORDS = ("order", "refund", "CNY", "shipped", "must", "never", "数据", "状态", "lorem", "ipsum")


class Builder:
    """Makes items of one API with unique text, so every item has its own digest."""

    def __init__(self, api: Api) -> None:
        self.api = api
        self.serial = 0

    def _next(self) -> int:
        self.serial += 1
        return self.serial

    def message(self, role: str, text: str) -> Item:
        text = f"{text} #{self._next()}"
        if self.api == "chat":
            return chat_item({"role": role, "content": text})
        return responses_item({"type": "message", "role": role, "content": text})

    def calls(self, count: int) -> list[Item]:
        ids = [f"call_{self._next()}" for _ in range(count)]
        if self.api == "chat":
            tool_calls = [
                {"id": i, "type": "function", "function": {"name": "lookup", "arguments": "{}"}}
                for i in ids
            ]
            return [chat_item({"role": "assistant", "content": None, "tool_calls": tool_calls})]
        return [
            responses_item(
                {"type": "function_call", "call_id": i, "name": "lookup", "arguments": "{}"}
            )
            for i in ids
        ]

    def reasoning(self) -> Item:
        n = self._next()
        return responses_item(
            {"type": "reasoning", "id": f"rs_{n}", "summary": [], "encrypted_content": "e" * 200}
        )

    def approval(self, answered: bool, runs: bool, words: int) -> list[Item]:
        """An MCP approval request, then (when `answered`) its response and, approved,
        the mcp_call that runs it; unanswered, it is a pending action."""
        n = self._next()
        arguments = json.dumps({"order": f"ORD-{n}", "note": "lorem " * words})
        request = {
            "type": "mcp_approval_request",
            "id": f"mcpr_{n}",
            "server_label": "shop",
            "name": "refund",
            "arguments": arguments,
        }
        items = [responses_item(request)]
        if answered:
            approved = {"type": "mcp_approval_response", "approval_request_id": f"mcpr_{n}"}
            items.append(responses_item({**approved, "approve": runs, "id": f"mcpa_{n}"}))
        if answered and runs:
            call = {"type": "mcp_call", "id": f"mcp_{n}", "server_label": "shop", "name": "refund"}
            output = "refunded " * words
            items.append(
                responses_item(
                    {
                        **call,
                        "arguments": arguments,
                        "output": output,
                        "approval_request_id": f"mcpr_{n}",
                    }
                )
            )
        return items

    def output(self, call_id: str, words: int, as_json: bool) -> Item:
        body = " ".join(WORDS[(i * 7 + self._next()) % len(WORDS)] for i in range(words))
        text = json.dumps({"status": "ok", "n": words, "rows": body.split()}) if as_json else body
        if self.api == "chat":
            return chat_item({"role": "tool", "tool_call_id": call_id, "content": text})
        return responses_item({"type": "function_call_output", "call_id": call_id, "output": text})


@st.composite
def tool_round(draw: st.DrawFn, builder: Builder) -> list[Item]:
    """Parallel calls (reasoning first on Responses), then their outputs in any order."""
    calls = builder.calls(draw(st.integers(1, 3)))
    call_ids = [call_id for item in calls for call_id in item.call_ids]
    order = draw(st.permutations(call_ids))
    huge = st.sampled_from([5, 20, 60, 1500])
    outputs = [builder.output(i, draw(huge), draw(st.booleans())) for i in order]
    prefix = [builder.reasoning()] if builder.api == "responses" and draw(st.booleans()) else []
    return [*prefix, *calls, *outputs]


@st.composite
def turn(draw: st.DrawFn, builder: Builder, closed: bool) -> list[Item]:
    pinned = draw(st.integers(0, 9)) == 0
    text = "PIN: all amounts in CNY" if pinned else "please check the order"
    items = [builder.message("user", text)]
    for _ in range(draw(st.integers(0, 3))):
        step = draw(st.sampled_from(["say", "tools", "tools", "system", "approval"]))
        if step == "approval" and builder.api == "responses":
            answered = draw(st.integers(0, 3)) > 0
            words = draw(st.sampled_from([3, 40, 400]))
            items += builder.approval(answered, draw(st.booleans()), words)
        elif step == "approval":
            items.append(builder.message("assistant", "no approvals on chat"))
        elif step == "say":
            items.append(builder.message("assistant", "done " * draw(st.integers(1, 40))))
        elif step == "tools":
            items += draw(tool_round(builder))
        else:
            items.append(builder.message("system", "a new rule"))
    if closed and draw(st.booleans()):
        items.append(builder.message("assistant", "anything else?"))
    return items


@dataclass(frozen=True)
class Case:
    items: list[Item]
    next_turn: list[Item]
    window_share: float
    api: Api
    stateless: bool


@st.composite
def cases(draw: st.DrawFn) -> Case:
    api: Api = draw(st.sampled_from(["chat", "responses"]))
    builder = Builder(api)
    items = [builder.message("system", "You are a careful agent.")]
    for _ in range(draw(st.integers(0, 12))):
        items += draw(turn(builder, closed=True))
    items += draw(turn(builder, closed=False))
    next_turn = draw(turn(builder, closed=False))
    share = draw(st.integers(-5, 120)) / 100
    return Case(items, next_turn, share, api, draw(st.booleans()))


POLICY = ProjectionPolicy(keep_recent_turns=2, tool_result_max_tokens=300, pin_patterns=("^PIN",))
OUTPUT, EPSILON, TOOLS = 300, 50, 20


def window_for(case: Case) -> int:
    """From 'the fixed parts do not fit' (share < 0) to 'everything fits' (share >= 1)."""
    blocks = segment(case.items, POLICY.pin_patterns)
    fixed = sum(COUNTER.items(b.items) for b in blocks if b.kind != "turn") + REPLY_PRIMING
    history = sum(COUNTER.items(b.items) for b in blocks if b.kind == "turn")
    return fixed + TOOLS + OUTPUT + EPSILON + int(case.window_share * history)


def project(
    items: Sequence[Item], window: int, cut: object = None, stateless: bool = False
) -> Projection:
    request = ProjectionRequest(
        items,
        window,
        OUTPUT,
        EPSILON,
        tools_tokens=TOOLS,
        cut=cut,  # type: ignore[arg-type]
        stateless=stateless,
    )
    return project_context(request, COUNTER, POLICY)


def outcome(projection: Projection) -> str:
    report = projection.report
    if not projection.changed:
        return "unchanged"
    done = [k for k in ("compressed", "summarized", "dropped") if getattr(report, k)]
    return "+".join(done) or "sticky cut only"


@PROPERTY_SETTINGS
@given(cases())
def test_projection_fits_and_keeps_every_invariant(case: Case) -> None:
    window = window_for(case)
    try:
        projection = project(case.items, window, stateless=case.stateless)
    except ContextLengthExceeded as exc:
        event("outcome: context_length_exceeded")
        # Refused only when the fixed parts overflow, or when a history that must be cut
        # leaves less than a summary's floor (a summary is never dropped instead).
        r = exc.report
        assert r.history_budget < 0 or r.history_before > r.history_budget >= 0
        assert r.history_budget < SUMMARY_MIN_TOKENS
        return
    sent = projection.items
    report = projection.report
    event(f"outcome: {outcome(projection)}")
    assert report.dropped == 0  # whatever is cut is summarized, never silently dropped
    assert report.prompt_tokens == COUNTER.items(sent) + TOOLS + REPLY_PRIMING
    assert report.prompt_tokens <= window - OUTPUT - EPSILON
    blocks = segment(case.items, POLICY.pin_patterns)
    pinned = [p for b in blocks if b.kind == "pinned" for p in b.positions]
    current = [p for b in blocks if b.kind == "current" for p in b.positions]
    check_invariants(case.items, sent, pinned, current)
    assert list(sent[len(sent) - len(current) :]) == [case.items[p] for p in current]
    assert projection.changed == (sent != tuple(case.items))


@PROPERTY_SETTINGS
@given(cases())
def test_an_approval_block_is_never_split_and_a_pending_one_is_always_sent(case: Case) -> None:
    """An MCP approval request, its response and its mcp_call are sent all or none; a
    request nothing answers is sent verbatim (pinned), or the request is refused."""
    try:
        projection = project(case.items, window_for(case), stateless=case.stateless)
    except ContextLengthExceeded:
        return
    sent = {item.digest for item in projection.items}  # a carried copy counts
    groups: dict[str, list[Item]] = {}
    for item in case.items:
        if item.type and item.type.startswith("mcp_"):
            groups.setdefault((item.call_ids or (item.output_for,))[0] or "", []).append(item)
    for approval, members in groups.items():
        kept = [item.digest in sent for item in members]
        event(
            f"approval: {len(members)} items, {'kept' if all(kept) else 'cut' if not any(kept) else 'split'}"
        )
        assert all(kept) or not any(kept), approval
        if len(members) == 1:
            assert all(kept), f"pending approval {approval} was not sent"


@PROPERTY_SETTINGS
@given(cases())
def test_recent_turns_are_kept_whenever_they_fit(case: Case) -> None:
    """Never summarized while they fit: sent verbatim but for their large tool results,
    which may be compressed in their place (SPEC 5 step 1: before any turn is cut). Checked
    on a request that carries no cut: a cut made earlier, while a large current turn left
    no room, sticks (SPEC 5), for a stored thread and a stateless history's replayed cut
    alike."""
    window = window_for(case)
    blocks = segment(case.items, POLICY.pin_patterns)
    closed = [b for b in blocks if b.kind == "turn"]
    turns = closed[-POLICY.keep_recent_turns :]
    fixed = sum(COUNTER.items(b.items) for b in blocks if b.kind != "turn") + REPLY_PRIMING
    recent = sum(COUNTER.items(b.items) for b in turns)
    # Once older turns are cut, their summary needs at least SUMMARY_MIN_TOKENS too.
    history = sum(COUNTER.items(b.items) for b in closed)
    summary = SUMMARY_MIN_TOKENS if fixed + TOOLS + history + OUTPUT + EPSILON > window else 0
    if fixed + TOOLS + recent + summary + OUTPUT + EPSILON > window:
        event("recent turns do not fit")
        return
    event("recent turns fit")
    projection = project(case.items, window)
    sent = {id(item) for item in projection.items}
    outputs = {item.output_for for item in projection.items if item.output_for}
    for block in turns:
        for item in block.items:
            large = is_compressible(item) and COUNTER.item(item) > POLICY.tool_result_max_tokens
            if large:
                assert item.output_for in outputs  # verbatim or compressed, in its place
            else:
                assert id(item) in sent


@PROPERTY_SETTINGS
@given(cases())
def test_projection_is_deterministic(case: Case) -> None:
    window = window_for(case)
    try:
        first = project(case.items, window, stateless=case.stateless)
        second = project(case.items, window, stateless=case.stateless)
    except ContextLengthExceeded:
        return
    assert [i.raw for i in first.items] == [i.raw for i in second.items]
    assert first.cut == second.cut


@PROPERTY_SETTINGS
@given(cases())
def test_kept_cut_leaves_the_prefix_unchanged_until_the_budget_is_hit(case: Case) -> None:
    window = window_for(case)
    try:
        first = project(case.items, window)
        second = project([*case.items, *case.next_turn], window, first.cut)
    except ContextLengthExceeded:
        return
    event("prefix kept" if second.cut == first.cut else "budget hit again: new cut")
    if second.cut == first.cut:
        assert second.items[: len(first.items)] == first.items


def _asks(item: Item) -> bool:
    return item.is_user_message or item.output_for is not None


@PROPERTY_SETTINGS
@given(cases())
def test_a_stateless_history_is_cut_as_its_earlier_requests_left_it(case: Case) -> None:
    """The oracle, unoptimized: project every earlier request (the history up to each
    model answer) with the cut the one before left, then the request itself. The replay
    (which skips requests that fit, projects windows, and caches) sends the same."""
    from proxy.core import projection as module

    window = window_for(case)
    items = case.items
    cut = None
    for end in range(1, len(items)):
        if _asks(items[end - 1]) and not _asks(items[end]):
            try:
                cut = project(items[:end], window, cut).cut
            except ContextLengthExceeded:
                pass
    try:
        expected: Projection | None = project(items, window, cut)
    except ContextLengthExceeded:
        expected = None
    module._replays.clear()
    try:
        got: Projection | None = project(items, window, stateless=True)
    except ContextLengthExceeded:
        got = None
    event(f"cut: {expected is not None and expected.cut is not None}")
    assert (got is None) == (expected is None)
    if got is not None and expected is not None:
        assert [i.raw for i in got.items] == [i.raw for i in expected.items]


def _compressed(projection: Projection | None) -> set[int]:
    cut = projection.cut if projection is not None else None
    return {position for position, _ in cut.compressed} if cut is not None else set()


def _relief_event(first: Projection | None, second: Projection, later: Sequence[Item]) -> str:
    """Checks one request against the one before it (same window, the cut carried) and
    names what happened between them."""
    before, after = first.cut if first is not None else None, second.cut
    if after is None or after.start != (before.start if before is not None else 0):
        return "no relief, or a cut"
    if after.summary != (before.summary if before is not None else ()):
        return "the summary changed"
    old, new = _compressed(first), _compressed(second) - _compressed(first)
    if not new:
        return "nothing newly compressed"
    if min(new) > max(old, default=-1):
        # Sent: the cut's prefix, then the log from its start, results in their places.
        assert first is not None
        unchanged = min(len(first.items), len(after.summary) + min(new) - after.start)
        assert second.items[:unchanged] == first.items[:unchanged]
        return "only the results after the last compressed one"
    for block in segment(later, POLICY.pin_patterns):
        if block.kind != "turn" or block.first < after.start:
            continue
        for position, item in zip(block.positions, block.items, strict=True):
            if is_compressible(item) and COUNTER.item(item) > POLICY.tool_result_max_tokens:
                assert position in _compressed(second), position
    return "every large result at once"


@st.composite
def agent_cases(draw: st.DrawFn) -> Case:
    """An agent run: many turns, most with a large tool result, under a window that the
    history outgrows several times (so reliefs follow one another)."""
    api: Api = draw(st.sampled_from(["chat", "responses"]))
    builder = Builder(api)
    items = [builder.message("system", "You are a careful agent.")]
    for _ in range(draw(st.integers(4, 14))):
        items.append(builder.message("user", "please check the order"))
        for _ in range(draw(st.integers(0, 2))):
            calls = builder.calls(draw(st.integers(1, 2)))
            words = st.sampled_from([20, 200, 400, 900, 1500])
            items += calls
            items += [
                builder.output(i, draw(words), draw(st.booleans()))
                for c in calls
                for i in c.call_ids
            ]
        items.append(builder.message("assistant", "done " * draw(st.integers(1, 40))))
    items.append(builder.message("user", "and now?"))
    share = draw(st.integers(20, 90)) / 100
    return Case(items, [], share, api, False)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(cases(), agent_cases()))
def test_a_relief_rewrites_the_newest_results_or_every_one_at_once(case: Case) -> None:
    """Issue 22 item 6: the provider caches an exact prefix, so a relief that only
    compresses rewrites the results after the last one compressed (the prefix before
    them is sent as it was), or, when those are not enough, every large result of the
    closed turns in the same request: never a little earlier at every relief. Checked
    at every request of the history, each with the cut the one before left."""
    window = window_for(case)
    items = [*case.items, *case.next_turn]
    previous: Projection | None = None
    for end in range(1, len(items) + 1):
        if not _asks(items[end - 1]) or (end < len(items) and _asks(items[end])):
            continue
        try:
            projection = project(items[:end], window, previous.cut if previous else None)
        except ContextLengthExceeded:
            event("a request refused")
            continue
        event(_relief_event(previous, projection, items[:end]))
        previous = projection
