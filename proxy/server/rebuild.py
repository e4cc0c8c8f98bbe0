"""Budgeted rebuild of one request's history: policy + counts -> projection (SPEC 4-5).

The pure projection lives in proxy/core; this module only gathers its inputs from the
tenant policy and the request, and turns an overflow into OpenAI's 400. A request whose
whole history plainly fits (no stored cut, every item counted under the budget) is not
projected: `whole_fit` builds the very Projection project_context would return for it
(tests/server/test_rebuild_fit.py checks the two against each other), on the loop.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from itertools import accumulate
from typing import Any, TypeVar

from aiohttp import web

from proxy.core.blocks import Block, SettledBlocks, reusable, segment_after
from proxy.core.budget import Learned, corrected_window, history_budget, output_reserve
from proxy.core.invariants import (
    NOTHING_SENT,
    SentAsGiven,
    check_sent_after,
    check_sent_as_given,
)
from proxy.core.items import Item
from proxy.core.projection import (
    BlockReport,
    ContextLengthExceeded,
    CutPoint,
    Projection,
    ProjectionPolicy,
    ProjectionReport,
    ProjectionRequest,
    project_context,
)
from proxy.core.tokens import TokenCounter, is_openai_model
from proxy.counting import ProviderCounter, calibrated_counter, counter_for
from proxy.metrics import Metrics
from proxy.policy import Policy
from proxy.server.discovery import discover
from proxy.server.errors import ApiError
from proxy.server.explain import PROJECTION
from proxy.server.model_budget import Counted, learned_key, model_window, provider_counts
from proxy.server.state import LEARNED, LOG_FIELDS, METRICS, STORE, TENANT_POLICY, TRACING
from proxy.threads import Loaded
from proxy.tracing import set_attributes

# Below this many items and characters a count or projection costs well under a
# millisecond: not worth a thread. Above, it runs in a worker thread (tiktoken's encoder
# releases the GIL) so the event loop keeps serving: an 8 MB message took seconds.
INLINE_ITEMS = 64
INLINE_CHARS = 64 * 1024
# `whole_fit` costs a few microseconds an item once the items are counted (a stored
# window's are: their counts are stored with them), so up to this many it runs on the
# loop: about a millisecond, less than a hop to a worker thread and back under load.
FIT_INLINE_ITEMS = 512

T = TypeVar("T")

SETTLED = "settled_blocks"  # Loaded.memo's keys: whole_fit's blocks.SettledBlocks,
FITTED = "settled_fit"  # and what it found of their items (_Fitted)


async def off_the_loop(work: Callable[[], T], *reads: Any, small: bool = False) -> T:
    """`work()` (a token count or a projection over `reads`): inline when what it reads is
    small, else in a worker thread. `small`: the caller knows (the client's body is at
    most INLINE_CHARS bytes, which bounds the characters it holds), so nothing is walked."""
    if small or is_small(reads):
        return work()
    return await asyncio.to_thread(work)


def small_body(raw: bytes) -> bool:
    """Whether a request body is small enough for anything parsed from it to be worked on
    inline (bytes bound the characters of its strings)."""
    return 0 < len(raw) <= INLINE_CHARS


def is_small(value: Any, limit: int = INLINE_CHARS) -> bool:
    """Whether the strings and containers in `value` (JSON-like) add up to at most `limit`;
    stops walking as soon as they do not."""
    stack = [value]
    size = 0
    while stack:
        node = stack.pop()
        if isinstance(node, str):
            size += len(node)
        elif isinstance(node, dict):
            size += 1
            stack.extend(node.values())
        elif isinstance(node, list | tuple):
            size += 1
            stack.extend(node)
        if size > limit:
            return False
    return True


def projection_policy(policy: Policy) -> ProjectionPolicy:
    return ProjectionPolicy(
        keep_recent_turns=policy.memory.keep_recent_turns,
        tool_result_max_tokens=policy.memory.tool_result_max_tokens,
        pin_patterns=tuple(policy.memory.pin_patterns),
        target_fill=policy.budget.target_fill,
        summary_chain_max_share=policy.memory.summary_chain_max_share,
        keep_opening_share=policy.memory.keep_opening_share,
    )


@dataclass(frozen=True)
class _Fitted:
    """What whole_fit found of a window's settled items (`settled`, counted by the
    `tokenizer` counter) while the history they began fitted: their tokens, their
    blocks' reports and tokens by kind, what the invariants need of them."""

    settled: SettledBlocks
    tokenizer: str
    tokens: int
    reports: tuple[BlockReport, ...]
    pinned: int
    turns: int
    checked: SentAsGiven


def whole_fit(
    request: ProjectionRequest,
    counter: TokenCounter,
    policy: ProjectionPolicy,
    memo: dict[str, Any] | None = None,
    lasting: int = 0,
) -> Projection | None:
    """project_context's answer for a request whose whole history fits, without
    projecting it; None when it may not fit (the caller then projects).

    It applies only without a stored cut and off `truncation: "disabled"`. The items'
    counts, instructions, tools, reply priming, output reserve and margin summed are
    then exactly what the projection compares with the window (S + T + U + H + O + e
    <= W, SPEC 4: the blocks partition the items), and while they fit it changes
    nothing: it sends the items as given, keeps no cut, and checks the invariants such a
    context can break (`check_sent_as_given`: what the projection would refuse, this
    refuses). The report is the one the projection writes for an unchanged history.

    `memo` (a stored window's Loaded.memo) keeps what is settled among the first
    `lasting` items (the window's): their blocks (blocks.segment_after), counts, reports
    and invariant facts, so the next turn counts, checks and segments only the items
    after them. It is used only for the very items it was made of (blocks.reusable
    compares them by identity) and the same tokenizer."""
    if request.verbatim or request.cut is not None:
        return None
    items = request.items
    offset = request.first_position
    settled = memo.get(SETTLED) if memo is not None else None
    fitted = memo.get(FITTED) if memo is not None else None
    if fitted is not None and (
        fitted.tokenizer != counter.tokenizer_id
        or policy.pin_patterns
        or fitted.settled is not settled
        or reusable(settled, items, offset) is None
    ):
        fitted = None
    start = len(fitted.settled.items) if fitted is not None else 0
    counts = [counter.item(item) for item in items[start:]]
    once = request.instructions_tokens + request.tools_tokens + request.reply_tokens
    earlier = fitted.tokens if fitted is not None else 0
    if earlier + sum(counts) + once + request.output + request.epsilon > request.window:
        return None
    if fitted is not None:
        check_sent_after(fitted.checked, items[start:])
    else:
        check_sent_as_given(items)
    blocks, settled = segment_after(settled, items, policy.pin_patterns, offset, lasting=lasting)
    before = len(fitted.reports) if fitted is not None else 0
    report, tail = _unchanged_report(request, blocks[before:], counts, start, fitted)
    if memo is not None:
        if settled is not None:
            memo[SETTLED] = settled
            memo[FITTED] = _fitted(fitted, settled, counter, items, counts, tail)
        else:
            memo.pop(SETTLED, None)
            memo.pop(FITTED, None)
    return Projection(tuple(items), report, None, False)


def _fitted(
    fitted: _Fitted | None,
    settled: SettledBlocks,
    counter: TokenCounter,
    items: Sequence[Item],
    counts: Sequence[int],
    reports: Sequence[BlockReport],
) -> _Fitted:
    """`fitted` (of the first `start` items) carried on to the items `settled` holds:
    `counts` and `reports` are those of the items and blocks after `start`."""
    if fitted is not None and fitted.settled is settled:
        return fitted  # nothing more settled this turn
    start = len(fitted.settled.items) if fitted is not None else 0
    end = len(settled.items)
    new = reports[: len(settled.blocks) - (len(fitted.reports) if fitted is not None else 0)]
    pinned = sum(r.tokens_before for r in new if r.kind == "pinned")
    turns = sum(r.tokens_before for r in new if r.kind == "turn")
    known = fitted if fitted is not None else _Fitted(settled, "", 0, (), 0, 0, NOTHING_SENT)
    return _Fitted(
        settled,
        counter.tokenizer_id,
        known.tokens + sum(counts[: end - start]),
        (*known.reports, *new),
        known.pinned + pinned,
        known.turns + turns,
        check_sent_after(known.checked, items[start:end]),
    )


def _unchanged_report(
    request: ProjectionRequest,
    blocks: Sequence[Block],
    counts: Sequence[int],
    start: int = 0,
    fitted: _Fitted | None = None,
) -> tuple[ProjectionReport, list[BlockReport]]:
    """The projection's report of a history sent as given: every block kept. `blocks`
    and `counts` are those after the first `start` items, whose reports and tokens
    `fitted` holds; the reports of `blocks` come back too."""
    offset = request.first_position + start
    by_kind = {"pinned": 0, "turn": 0, "current": 0}
    reports = []
    upto = [0, *accumulate(counts)]  # upto[i]: the tokens of the first i items
    for block in blocks:
        positions = block.positions
        if not positions:
            continue
        first, last = positions[0], positions[-1]
        if last - first + 1 == len(positions):  # a run without gaps: every block but a
            tokens = upto[last + 1 - offset] - upto[first - offset]  # turn a pin splits
        else:
            tokens = sum(counts[p - offset] for p in positions)
        by_kind[block.kind] += tokens
        reports.append(_kept(block.kind, first, last, tokens))
    earlier: tuple[BlockReport, ...] = ()
    if fitted is not None:
        by_kind["pinned"] += fitted.pinned
        by_kind["turn"] += fitted.turns
        earlier = fitted.reports
    system = by_kind["pinned"] + request.instructions_tokens + request.reply_tokens
    current = by_kind["current"]
    history = upto[-1] + (fitted.tokens if fitted is not None else 0)
    prompt = history + request.instructions_tokens + request.tools_tokens
    prompt += request.reply_tokens
    budget = history_budget(
        request.window, system, request.tools_tokens, current, request.output, request.epsilon
    )
    report = ProjectionReport(
        window=request.window,
        system=system,
        tools=request.tools_tokens,
        current=current,
        output=request.output,
        epsilon=request.epsilon,
        history_budget=budget,
        history_before=by_kind["turn"],
        history_after=prompt - system - request.tools_tokens - current,
        prompt_tokens=prompt,
        blocks=(*earlier, *reports),
        # the log before the window, as the projection counts it without a cut
        dropped=request.first_position,
        compressed=0,
        summarized=0,
    )
    return report, reports


@functools.lru_cache(maxsize=8192)
def _kept(kind: str, first: int, last: int, tokens: int) -> BlockReport:
    """A kept block's report. Reports are frozen, and a stored thread's closed turns
    report the same from one request to the next: one object serves them all."""
    return BlockReport(kind, first, last, tokens, tokens, "kept")


def counted_already(
    items: Sequence[Item],
    counter: TokenCounter,
    tools: Sequence[dict[str, Any]],
    instructions: str | None,
) -> bool:
    """Whether `whole_fit` may run on the loop: at most FIT_INLINE_ITEMS items, and what
    it counts (the items without a count stored for `counter`'s tokenizer, the tools,
    the instructions) small, so no unbounded encoding runs there."""
    if len(items) > FIT_INLINE_ITEMS:
        return False
    tokenizer = counter.tokenizer_id
    fresh = [i.raw for i in items if i.tokens is None or i.encoding != tokenizer]
    return is_small((fresh, tools, instructions))


async def rebuild(
    policy: Policy,
    model: str,
    items: Sequence[Item],
    *,
    tools: Sequence[dict[str, Any]] = (),
    requested_output: int | None = None,
    instructions: str | None = None,
    param: str = "messages",
    metrics: Metrics | None = None,
    route: str = "",
    first_position: int = 0,
    cut: CutPoint | None = None,
    small: bool = False,
    stateless: bool = False,
    summaries: Mapping[str, Item] | None = None,
    background: bool = False,
    verbatim: bool = False,
    learned: Learned | None = None,
    window_cap: int | None = None,
    provider: Counted | None = None,
    memo: dict[str, Any] | None = None,
    lasting: int = 0,
) -> tuple[Projection, TokenCounter]:
    """`first_position` and `cut` place a stored thread's window in its log and re-apply
    its sticky cut (SPEC 5); a stateless request starts at 0 with no cut, and its cut is
    replayed from its history (`stateless`) so its prefix repeats from one request to
    the next. `summaries`: LLM summaries ready for chunks the projection may cut, by
    chunk digest. `background`: nobody waits for it (a prediction), so it runs in a worker
    thread whatever its size, never taking the loop from the requests. `verbatim`: the
    request's `truncation` is "disabled" (nothing trimmed; too long is a 400). `learned`:
    what the provider taught about the model (a smaller window, a heavier count, a
    per-item overhead, the window it lists), applied to W and to every item's count (the
    report is in those counts); `window_cap`: a W the projection must stay under (the
    retry after a refusal). `provider`: the provider's own counts (`tokenizer: provider`):
    the budget then counts in its tokens. `memo` and `lasting`: a stored window's memo
    and its item count (whole_fit). The counter returned is the tokenizer's own,
    uncorrected: what is stored with items."""
    base = await counter_for(policy, model)
    counter: TokenCounter
    if provider is not None:
        counter = ProviderCounter(base, learned, provider.items, provider.prompt)
    else:
        counter = calibrated_counter(base, learned)
    limits = policy.limits_for(model)

    output = output_reserve(
        requested_output, policy.budget.reserve_output_tokens, limits.max_output_tokens
    )
    window = corrected_window(model_window(policy, model, learned)[0], output, learned)
    if window_cap is not None:
        window = min(window, window_cap)

    def asked() -> ProjectionRequest:
        return ProjectionRequest(
            items=items,
            window=window,
            output=output,
            epsilon=policy.budget.safety_margin_tokens,
            tools_tokens=counter.tools(tools),
            instructions_tokens=counter.instructions(instructions),
            reply_tokens=counter.reply_tokens,
            first_position=first_position,
            cut=cut,
            stateless=stateless,
            summaries=summaries if summaries is not None else {},
            verbatim=verbatim,
        )

    rules = projection_policy(policy)
    # What a small client body holds is small: counting it on the loop is bounded.
    bounded = small and len(items) <= FIT_INLINE_ITEMS
    on_loop = (
        not background
        and cut is None
        and (bounded or counted_already(items, base, tools, instructions))
    )

    def run() -> Projection:
        request = asked()
        fit = None if on_loop else whole_fit(request, counter, rules, memo, lasting)
        return fit or project_context(request, counter, rules)

    started = time.perf_counter()
    try:
        fit = whole_fit(asked(), counter, rules, memo, lasting) if on_loop else None
        if fit is not None:
            projection = fit
        elif background or len(items) > INLINE_ITEMS:
            projection = await asyncio.to_thread(run)
        else:
            reads = () if small else ([i.raw for i in items], tools, instructions)
            projection = await off_the_loop(run, *reads, small=small)
    except ContextLengthExceeded as exc:
        raise ApiError(400, str(exc), param=param, code="context_length_exceeded") from None
    if metrics is not None:
        observe_projection(metrics, route, projection, time.perf_counter() - started)
    return projection, base


def observe_projection(
    metrics: Metrics, route: str, projection: Projection, seconds: float
) -> None:
    metrics.rebuild_seconds.observe(seconds)
    metrics.child(metrics.context_tokens, route).observe(projection.report.prompt_tokens)
    removed: dict[str, int] = {}
    for block in projection.report.blocks:
        if block.action in ("dropped", "compressed", "summarized"):
            saved = max(0, block.tokens_before - block.tokens_after)
            removed[block.action] = removed.get(block.action, 0) + saved
    for kind, tokens in removed.items():
        if tokens:
            metrics.trimmed.labels(kind).inc(tokens)


async def rebuild_turn(
    request: web.Request,
    model: str,
    new: Sequence[Item],
    loaded: Loaded | None,
    *,
    tools: Sequence[dict[str, Any]],
    requested_output: int | None,
    instructions: str | None = None,
    param: str,
    route: str,
    observe: bool = True,
    small: bool = False,
    summaries: Mapping[str, Item] | None = None,
    verbatim: bool = False,
    window_cap: int | None = None,
) -> tuple[Projection, TokenCounter]:
    """One request's context: a stored thread's live window plus the new items (with its
    position in the log and its sticky cut), or the request alone when stateless.
    `small`: everything projected came from a small client body (`small_body`).
    `summaries`: LLM summaries ready for the chunks it may cut (rewrite.attach_ready_summaries).

    When `observe`, the projection is the request's own: it goes to the metrics and its
    budget breakdown to the request's log line (every flow, stateless or not); a restate
    after a concurrent turn passes False."""
    history = [*loaded.items, *new] if loaded is not None else list(new)
    learned = await learned_for(request, model)
    provider = await provider_counts(request, model, history)
    with request.app[TRACING].span("projection", {"gen_ai.request.model": model}) as span:
        projection, counter = await rebuild(
            request[TENANT_POLICY],
            model,
            history,
            tools=tools,
            requested_output=requested_output,
            instructions=instructions,
            param=param,
            metrics=request.app[METRICS] if observe else None,
            route=route,
            first_position=loaded.first_position if loaded is not None else 0,
            cut=loaded.cut() if loaded is not None else None,
            small=small and loaded is None,
            stateless=loaded is None or loaded.thread is None,
            summaries=summaries,
            verbatim=verbatim,
            learned=learned,
            window_cap=window_cap,
            provider=provider,
            memo=loaded.memo if loaded is not None else None,
            lasting=len(loaded.items) if loaded is not None else 0,
        )
        if span is not None:  # tracing on
            set_attributes(span, budget_attributes(projection))
    if observe:
        request[LOG_FIELDS].update(budget_log_fields(projection))
        request[PROJECTION] = projection
    return projection, counter


async def learned_for(request: web.Request, model: str) -> Learned | None:
    """What is known of the model: read from the store on first use (and after a TTL), and,
    when only the policy's "*" names it, what the provider lists (asked once per TTL)."""
    limits = request.app.get(LEARNED)
    if limits is None:
        return None
    key = learned_key(request, model)
    learned = await limits.load(key, request.app.get(STORE))
    # OpenAI lists no windows: its own model names are never asked about.
    unnamed = not request[TENANT_POLICY].names_model(model) and not is_openai_model(model)
    if unnamed and limits.discovery_due(key):
        learned = await discover(request, model, key, limits)
    return learned


def context_headers(projection: Projection) -> dict[str, str]:
    """x-threadkeeper-context-tokens and x-threadkeeper-trimmed (SPEC section 1)."""
    return {
        "x-threadkeeper-context-tokens": str(projection.report.prompt_tokens),
        "x-threadkeeper-trimmed": trimmed_header(projection),
    }


def trimmed_header(projection: Projection) -> str:
    report = projection.report
    return (
        f"dropped={report.dropped}, compressed={report.compressed}, summarized={report.summarized}"
    )


def budget_attributes(projection: Projection) -> dict[str, int]:
    """The budget as span attributes (threadkeeper.budget.*)."""
    return {
        f"threadkeeper.budget.{name}": value for name, value in projection.report.totals().items()
    }


def budget_log_fields(projection: Projection) -> dict[str, Any]:
    """The breakdown for the request's log line: totals, and only the blocks that changed
    (a long thread would otherwise log thousands of kept blocks)."""
    changed = [asdict(b) for b in projection.report.blocks if b.action != "kept"]
    return {
        "budget": projection.report.totals(),
        "trimmed_blocks": changed,
        "rebuilt": projection.changed,
    }
