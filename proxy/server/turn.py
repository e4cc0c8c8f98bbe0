"""One model turn, the SPEC's request path (seed section 13) written once for both APIs
and every thread mode. Each stage is a function over frozen values; `run_turn` applies
them in order and nothing else writes them (LangGraph's nodes return an update, the
graph applies it):

    load      the mode's seam reads the thread (proxy/server/modes.py: Stateless,
              ChatThread, ResponseChain, Conversation)                 -> Turn, Window
    rewrite   the ordered item rewriters, (window, new) -> (window, new), named for
              what they do (REWRITERS; the ledger's in ledger.py, compaction's in
              compaction.py)
                                                                       -> Window, New
    project   budget + projection (SPEC 4-5, `rebuild_turn`, which logs the budget
              breakdown), again with LLM summaries other processes wrote
                                                                       -> Projected
    forward   the provider's body; the client's tool outputs into the ledger; the
              mode's begin; the provider's answer (relay.send_model), or one the
              proxy serves itself; a context-length refusal is projected again and sent
              once more (model_budget.py)                                -> Forwarded
    relay     the answer through a transformer (relay.py): the ledger's holdback when a
              tool is guarded, else Keep (a stored turn) or Passthrough
    commit    the mode's commit, which the relay calls before the answer's end reaches
              the client (modes.Kept)
    finish    the mode's finish, then the observers'

The projection stage's work is at the end of this module: the pure projection lives in
proxy/core, `rebuild` only gathers its inputs from the tenant policy and the request and
turns an overflow into OpenAI's 400. A request whose whole history plainly fits (no
stored cut, every item counted under the budget) is not projected: `whole_fit` builds
the very Projection project_context would return for it (tests/server/test_rebuild_fit.py
checks the two against each other), on the loop. Work over large values runs in a worker
thread (`off_the_loop`).

Observers (proxy/server/observe.py: usage, summaries ahead, a background run's start)
are the only hooks: they are shown the values and never change them.

    >>> plan = Plan(Stateless(), REWRITERS, [Usage()])  # modes, rewrite, observe
    >>> await run_turn(request, CHAT, body, raw, plan)   # a stateless Chat turn
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from functools import cached_property
from itertools import accumulate
from typing import Any, Protocol, TypeVar

import structlog
from aiohttp import web

from proxy.core import fastjson
from proxy.core.blocks import (
    Block,
    SettledBlocks,
    compile_pins,
    pinned_flags,
    reusable,
    segment_after,
)
from proxy.core.budget import Learned, corrected_window, history_budget, output_reserve
from proxy.core.invariants import (
    NOTHING_SENT,
    SentAsGiven,
    check_sent_after,
    check_sent_as_given,
)
from proxy.core.items import CALL_KINDS, Item
from proxy.core.memory import may_take_in
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
from proxy.core.tokens import TokenCounter
from proxy.counting import ProviderCounter, calibrated_counter, counter_for
from proxy.metrics import Metrics
from proxy.policy import Policy
from proxy.server.api import ApiShape, BudgetInputs
from proxy.server.compacted import LocalAnswer, WithCompaction
from proxy.server.errors import ApiError
from proxy.server.explain import PROJECTION
from proxy.server.holdback import Guarded, holdback
from proxy.server.ledger import (
    LedgerGuard,
    answer_dangling_calls,
    refuse_orphans,
    restore_ledger_calls,
)
from proxy.server.model_budget import (
    Counted,
    Refusal,
    cannot_fit,
    context_refusal,
    learn,
    learned_for,
    model_window,
    observe,
    provider_counts,
    refused_again,
    retry_window,
)
from proxy.server.relay import (
    Keep,
    Keeper,
    Passthrough,
    Transformer,
    Untranslatable,
    relay_answer,
    send_model,
)
from proxy.server.state import (
    CLOCK,
    LOG_FIELDS,
    METRICS,
    NAMESPACE,
    SUMMARIES,
    TENANT_POLICY,
    THREADS,
    TRACING,
)
from proxy.server.summaries import Ready, replayed, sent_chunks
from proxy.server.validate import JsonDict
from proxy.store.base import StoredItem
from proxy.threads import MEMO_BYTES, Loaded, json_size, stored_item_view
from proxy.tracing import genai_request, genai_response, set_attributes
from proxy.upstream import UpstreamResponse

log = structlog.get_logger("threadkeeper.summaries")

# Projections a stateless request makes at most while other processes' summaries for its
# chunks turn up (each found one may change the digests of the blocks after it).
CLAIM_ROUNDS = 3


# -- the values ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Load:
    """What a mode's load returns: the stored window (None: stateless) and the part of
    the client's history the thread does not hold yet (raw entries)."""

    loaded: Loaded | None
    history: Any


@dataclass(frozen=True)
class Turn:
    """What every stage reads and none writes: the request, its API, the client's body
    and bytes, the mode, and the client's new items as it sent them."""

    request: web.Request
    api: ApiShape
    body: JsonDict  # the client's request; the provider's is a copy (sent_body)
    raw: bytes  # the client's bytes: forwarded as they are when nothing changed
    mode: Mode
    thread_id: str | None  # the stored thread; None: stateless
    outputs: Sequence[JsonDict] | str  # where the client's new tool outputs are
    given: tuple[Item, ...]  # the client's new items as it sent them

    @cached_property
    def inputs(self) -> BudgetInputs:
        return self.api.budget_inputs(self.body)

    @property
    def verbatim(self) -> bool:
        """Responses `truncation: "disabled"`: the whole history is sent as it is, or the
        request is refused (OpenAI's 400 context_length_exceeded); nothing is trimmed."""
        return not self.inputs.truncate

    @cached_property
    def guarded(self) -> bool:
        """Whether the tenant's policy names a side-effecting tool (LedgerGuard.active,
        read without building the guard): only then is the client's tool output recorded
        and the answer held back, so a turn that neither guards a tool nor holds a call
        never enters the ledger (proxy/server/ledger.py)."""
        return bool(self.request[TENANT_POLICY].side_effect_tools)

    @cached_property
    def guard(self) -> LedgerGuard:
        """The side-effect ledger's rules for this request (SPEC 6)."""
        now = self.request.app[CLOCK].iso
        return LedgerGuard(self.request, api=self.api, thread_id=self.thread_id, now=now)


@dataclass(frozen=True)
class Window:
    """What the turn's new items follow: the stored thread's live window (None:
    stateless) and the LLM summaries ready for the projection's chunks."""

    loaded: Loaded | None = None
    summaries: Mapping[str, Item] = field(default_factory=dict)

    @property
    def items(self) -> Sequence[Item]:
        return self.loaded.items if self.loaded is not None else ()


@dataclass(frozen=True)
class New:
    """The turn's new items, and what a rewriter decided about the answer: the
    compaction item it leads with (`compaction`), or a Response the proxy serves itself
    so the provider gets no request (`served`, a compaction_trigger's)."""

    items: tuple[Item, ...]
    summary: JsonDict | None = None  # the last compaction the items hold, opened
    compaction: JsonDict | None = None
    served: JsonDict | None = None


# An item rewriter: the window and new items in, the window and new items out.
Rewriter = Callable[[Turn, Window, New], Awaitable[tuple[Window, New]]]


@dataclass(frozen=True)
class ForItems:
    """A rewriter with work only for a turn whose items, stored or new, include an item of
    one of `types` (Item.type) or of `kinds` (Item.kind, the same for both APIs: a Chat
    message's tool calls are a "tool_calls" kind): any other turn passes it by uncalled,
    so what does not apply to a turn is seen in its plan (a turn without a compaction
    item has none to expand, one without a call or output none to pair)."""

    types: frozenset[str]
    rewriter: Rewriter
    kinds: frozenset[str] = frozenset()
    new_only: bool = False  # only the new items count (the window's are never read)

    async def __call__(self, turn: Turn, window: Window, new: New) -> tuple[Window, New]:
        types, kinds, stored = self.types, self.kinds, window.loaded
        held = (
            not self.new_only
            and stored is not None
            and not (types.isdisjoint(stored.item_types) and kinds.isdisjoint(stored.item_kinds))
        )
        if not held:  # the window's are gathered once (Loaded.item_sorts); the new, here
            for item in new.items:
                if item.type in types or item.kind in kinds:
                    break
            else:
                return window, new
        return await self.rewriter(turn, window, new)


def for_calls(rewriter: Rewriter) -> ForItems:
    """`rewriter` for a turn whose items make or answer a call (items.CALL_KINDS): the
    ledger's rewriters read only call ids and the calls they answer, which no other
    item has."""
    return ForItems(frozenset(), rewriter, CALL_KINDS)


def for_outputs(rewriter: Rewriter) -> ForItems:
    """`rewriter` for a turn whose new items hold a tool output: the ledger's restore of
    a call the thread never saw and its orphan check act on those alone (a stored
    window's outputs were checked when they were new)."""
    return ForItems(frozenset(), rewriter, frozenset({"tool_output"}), new_only=True)


@dataclass(frozen=True)
class Projected:
    """The turn's items and what the provider is sent of them."""

    window: Window
    new: New
    projection: Projection
    counter: TokenCounter


@dataclass(frozen=True)
class Forwarded:
    """The provider's answer (or the proxy's), the projection it answers, what it got."""

    upstream: UpstreamResponse
    projected: Projected
    sent: JsonDict


@dataclass(frozen=True)
class Finished:
    """What the observers are shown once the turn is over (relayed, refused or failed):
    the values it reached (None where it stopped before), and whether it committed."""

    turn: Turn | None
    projected: Projected | None
    committed: bool


Restate = Callable[[Loaded], Awaitable[JsonDict]]


class Mode(Protocol):
    """One thread mode's seam (proxy/server/modes.py): how a turn's thread is read and
    its items written."""

    response_id: str | None  # the proxy's own id of this answer, when it has one

    async def load(self, api: ApiShape, body: JsonDict) -> Load: ...

    def provider_body(self, body: JsonDict) -> JsonDict:
        """The provider's request, once its history is the projection's."""
        ...

    async def begin(self) -> None:
        """The last step before the provider is called (a Responses row `in_progress`)."""
        ...

    def keeper(self, turn: Turn, projected: Projected, restate: Restate) -> Keeper | None:
        """What commits the answer (relay.Keeper); None: nothing is kept."""
        ...

    def provider_answered(self, status: int) -> None:
        """The provider's (last) answer had this status."""
        ...

    async def finish(self) -> None:
        """Always, once the turn is over."""
        ...

    @property
    def committed(self) -> bool: ...


class Observer:
    """A hook that reads the turn's values and never writes them. Every method is
    optional (these do nothing)."""

    def forwarding(self, turn: Turn) -> None:
        """The provider is about to be called (the ledger and the mode are ready)."""

    def answered(self, turn: Turn, projected: Projected, answer: JsonDict) -> None:
        """A whole answer, or a stream's usage holder, as the provider sent it."""

    async def finished(self, finished: Finished) -> None:
        """Always, once the turn is over."""


@dataclass(frozen=True)
class Plan:
    """What a handler chooses for one turn: its mode, its rewriters in order, its
    observers."""

    mode: Mode
    rewriters: Sequence[Rewriter]
    observers: Sequence[Observer] = ()


# -- the stem ---------------------------------------------------------------------------------


async def run_turn(
    request: web.Request, api: ApiShape, body: JsonDict, raw: bytes, plan: Plan
) -> web.StreamResponse:
    """The request path (SPEC 3-7) for a validated body of `api`."""
    turn: Turn | None = None
    projected: Projected | None = None
    try:
        turn, window = await load(request, api, body, raw, plan.mode)
        window, new = await rewrite(turn, window, New(turn.given), plan.rewriters)
        projected = await project(turn, window, new)
        sent, raw = sent_body(turn, projected)
        await before_forward(turn, plan.observers)
        with model_call(turn, sent) as span:
            forwarded = await forward(turn, projected, sent, raw)
            projected = forwarded.projected
            return await relay(turn, forwarded, plan.observers, span)
    finally:
        await plan.mode.finish()
        finished = Finished(turn, projected, plan.mode.committed)
        for observer in plan.observers:
            await observer.finished(finished)


async def load(
    request: web.Request, api: ApiShape, body: JsonDict, raw: bytes, mode: Mode
) -> tuple[Turn, Window]:
    """The thread the mode reads (the whole log when nothing may be trimmed), and the
    client's new history entries as items."""
    loaded = await mode.load(api, body)
    window = loaded.loaded
    history = loaded.history if loaded.history is not None else []
    given = await off_the_loop(lambda: api.items(history), history, small=small_body(raw))
    thread_id = window.thread_id if window is not None else None
    turn = Turn(request, api, body, raw, mode, thread_id, history, tuple(given))
    if turn.verbatim and window is not None:
        window = await request.app[THREADS].whole(window)
    return turn, Window(window)


async def rewrite(
    turn: Turn, window: Window, new: New, rewriters: Sequence[Rewriter]
) -> tuple[Window, New]:
    """The rewriters in their order, each given what the one before returned."""
    for rewriter in rewriters:
        window, new = await rewriter(turn, window, new)
    return window, new


async def attach_ready_summaries(turn: Turn, window: Window, new: New) -> tuple[Window, New]:
    """The LLM summaries ready for the projection's chunks, for a tenant whose policy
    sets a summarizer (the projection asks it for each chunk it cuts)."""
    settings = turn.request[TENANT_POLICY].memory.summarizer
    background = turn.request.app.get(SUMMARIES)
    if settings is None or background is None:
        return window, new
    ready = background.ready(turn.request[NAMESPACE], settings.model, turn.api.name)
    return replace(window, summaries=ready), new


# Every turn's rewriters, in order (a Responses turn with local compaction adds its own).
REWRITERS: tuple[Rewriter, ...] = (
    for_outputs(restore_ledger_calls),
    for_outputs(refuse_orphans),
    for_calls(answer_dangling_calls),
    attach_ready_summaries,
)


async def project(turn: Turn, window: Window, new: New) -> Projected:
    """The projection of the window plus the new items (SPEC 3-5), made again while the
    LLM summaries it lacked turn up in the store (another process wrote them)."""
    projected = await projected_once(turn, window, new)
    if isinstance(window.summaries, Ready):
        projected = await with_found_summaries(turn, projected, window.summaries)
    return projected


async def projected_once(
    turn: Turn,
    window: Window,
    new: New,
    *,
    observe: bool = True,
    window_cap: int | None = None,
) -> Projected:
    """One projection; `observe` False: not the request's own (a restate after a lost
    race, a projection made again); `window_cap`: the smaller W of a retry after a
    context-length refusal."""
    inputs = turn.inputs
    projection, counter = await rebuild_turn(
        turn.request,
        inputs.model,
        new.items,
        window.loaded,
        tools=inputs.tools,
        requested_output=inputs.requested_output,
        instructions=inputs.instructions,
        param=turn.api.history,
        route=turn.api.route,
        observe=observe,
        small=small_body(turn.raw),
        summaries=window.summaries,
        verbatim=not inputs.truncate,
        window_cap=window_cap,
    )
    return Projected(window, new, projection, counter)


async def with_found_summaries(turn: Turn, projected: Projected, ready: Ready) -> Projected:
    """Digests the projection asked for and lacked are read from the store; when some
    were there, the projection is made again with them. A stateless request then stores
    the deterministic digests it sends as their chunks' summaries (`claim`: once sent,
    no process may send an LLM summary for the same chunk later, which would change the
    replayed cut's prefix); a summary stored first is sent instead, and may change the
    digests of the blocks after it, which are claimed in turn. A store failure here is
    logged and the projection stands."""
    background = turn.request.app.get(SUMMARIES)
    if background is None:
        return projected
    try:
        if ready.missing() and await background.fetch(ready):
            projected = await projected_again(turn, projected)
        for _ in range(CLAIM_ROUNDS if replayed(projected.window.loaded) else 0):
            chunks = sent_chunks(projected.projection)
            if not chunks or not await background.claim(ready, chunks):
                break
            projected = await projected_again(turn, projected)
    except Exception:
        log.exception("summaries_store_failed", tenant=turn.request[TENANT_POLICY].tenant)
    return projected


async def projected_again(turn: Turn, projected: Projected) -> Projected:
    """Made again (observed once): the request's log line gets the projection it sends."""
    again = await projected_once(turn, projected.window, projected.new, observe=False)
    turn.request[LOG_FIELDS].update(budget_log_fields(again.projection))
    return again


def sent_body(turn: Turn, projected: Projected) -> tuple[JsonDict, bytes]:
    """The provider's request: the client's own bytes when nothing changed on a
    stateless request, else a copy of the body with the projection as its history."""
    new = projected.new.items
    same = len(new) == len(turn.given) and all(a is b for a, b in zip(new, turn.given, strict=True))
    if projected.window.loaded is None and not projected.projection.changed and same:
        return turn.body, turn.raw
    sent = turn.api.with_items(dict(turn.body), projected.projection.items)
    sent = turn.mode.provider_body(sent)
    return sent, fastjson.dumps(sent)


@contextmanager
def model_call(turn: Turn, sent: JsonDict) -> Iterator[Any]:
    """The tracing span of the model call (retries and the relay included)."""
    tracing = turn.request.app[TRACING]
    attributes = genai_request(sent, turn.thread_id) if tracing.on else {}
    with tracing.span(f"chat {sent.get('model')}", kind="client") as span:
        set_attributes(span, attributes)
        yield span


async def before_forward(turn: Turn, observers: Sequence[Observer]) -> None:
    """The client's tool outputs complete their ledger entries, the mode begins (a
    Responses row `in_progress`), the observers hear the provider is called."""
    if turn.guarded:
        await turn.guard.record_outputs(turn.outputs)
    await turn.mode.begin()
    for observer in observers:
        observer.forwarding(turn)


async def forward(turn: Turn, projected: Projected, sent: JsonDict, raw: bytes) -> Forwarded:
    """The provider's answer to `sent` (or the one the proxy serves itself), retried once
    smaller after a context-length refusal."""
    served = projected.new.served
    if served is not None:
        upstream: UpstreamResponse = LocalAnswer(served, bool(turn.body.get("stream")))  # type: ignore[assignment]
    else:
        upstream = await _send(turn, sent, raw)
    refusal = await context_refusal(upstream)
    if refusal is not None:
        upstream, projected, sent = await _retry_smaller(turn, projected, sent, upstream, refusal)
    turn.mode.provider_answered(upstream.status)
    if projected.new.compaction is not None:
        upstream = WithCompaction(upstream, projected.new.compaction)  # type: ignore[assignment]
    return Forwarded(upstream, projected, sent)


async def relay(
    turn: Turn, forwarded: Forwarded, observers: Sequence[Observer], span: Any
) -> web.StreamResponse:
    """The answer to the client through the transformer the turn calls for; the mode's
    commit is the keeper's."""
    projected = forwarded.projected

    def answered(answer: JsonDict) -> None:
        for observer in observers:
            observer.answered(turn, projected, answer)
        if span is not None:
            set_attributes(span, genai_response(answer))

    request = turn.request
    transformer = _transformer(turn, forwarded)
    extra = context_headers(projected.projection)
    with request.app[TRACING].span("relay"):
        return await relay_answer(
            request,
            forwarded.upstream,
            turn.api,
            transformer,
            extra_headers=extra,
            on_answer=answered,
        )


def _transformer(turn: Turn, forwarded: Forwarded) -> Transformer:
    projected = forwarded.projected

    async def restate(fresh: Loaded) -> JsonDict:
        """The state after a lost race: the cut recomputed over the new window."""
        window = replace(projected.window, loaded=fresh)
        try:
            again = await projected_once(turn, window, projected.new, observe=False)
        except ApiError:
            return fresh.state
        return fresh.state_after(again.projection.cut)

    keeper = turn.mode.keeper(turn, projected, restate)
    if turn.guarded:
        guarded = Guarded(
            turn.request, turn.api, turn.guard, forwarded.sent, keeper, turn.mode.response_id
        )
        return holdback(guarded)
    return Keep(turn.api, keeper) if keeper is not None else Passthrough(turn.api)


async def _send(turn: Turn, sent: JsonDict, raw: bytes) -> UpstreamResponse:
    """The provider's answer, through the API its upstream serves (relay.send_model)."""
    request = turn.request
    stream = bool(sent.get("stream"))
    try:
        return await send_model(request, request[TENANT_POLICY], turn.api, sent, raw, stream=stream)
    except Untranslatable as exc:
        raise await _refused(turn, exc.upstream, exc.error) from None


async def _retry_smaller(
    turn: Turn,
    projected: Projected,
    sent: JsonDict,
    refused: UpstreamResponse,
    refusal: Refusal,
) -> tuple[UpstreamResponse, Projected, JsonDict]:
    """The provider refused the request for its length (SPEC round 3): what it states is
    learnt, and the turn is projected again under it and sent once more, before any byte
    reached the client. The client's tool outputs are recorded once, a Responses row
    begun once. A turn that cannot fit the stated window is a 400 with the breakdown; so
    is a retry refused in turn (never a third call); `truncation: "disabled"` is never
    trimmed: its refusal is relayed."""
    request, route = turn.request, turn.api.route
    model = turn.inputs.model
    first = projected.projection.report
    counted = sent_items(turn, projected.projection)
    learned = learn(request, model, refusal.overflow, first, projected.counter, counted)
    facts = {"refusal": refusal.shown, "refused_estimate": first.prompt_tokens}
    if turn.verbatim:
        observe(request, route, "not_retried", **facts, reason="truncation_disabled")
        return refused, projected, sent
    window = retry_window(request, model, learned, refusal.overflow, first)
    try:
        projected = await projected_once(
            turn, projected.window, projected.new, observe=False, window_cap=window
        )
    except ApiError as exc:
        observe(request, route, "refused", **facts, window=window)
        raise await _refused(turn, refused, cannot_fit(refusal.error, exc)) from None
    projection = projected.projection
    request[PROJECTION] = projection
    request[LOG_FIELDS].update(budget_log_fields(projection))
    await refused.aclose()
    sent, raw = sent_body(turn, projected)
    observe(request, route, "retried", **facts, retried_estimate=projection.report.prompt_tokens)
    retried = await _send(turn, sent, raw)
    again = await context_refusal(retried)
    if again is None:
        return retried, projected, sent
    counted = sent_items(turn, projection)
    learn(request, model, again.overflow, projection.report, projected.counter, counted)
    observe(request, route, "not_retried", **facts, reason="refused_again", again=again.shown)
    error = refused_again(again.error, projection.report, turn.api.history)
    raise await _refused(turn, retried, error)


def sent_items(turn: Turn, projection: Projection) -> int:
    """How many items the provider got: the projection's, and instructions as one more."""
    return len(projection.items) + (1 if turn.inputs.instructions else 0)


async def _refused(turn: Turn, upstream: UpstreamResponse, error: ApiError) -> ApiError:
    """The provider's refusal, shown to the mode (a refused Responses turn leaves no
    row), then released; `error` is what the client gets."""
    turn.mode.provider_answered(upstream.status)
    await upstream.aclose()
    return error


# -- the projection: budget + projection (SPEC 4-5), what the project stage runs ----------

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


@dataclass(frozen=True)
class PolicySetup:
    """What a tenant policy fixes for one model's projections, found once per (policy,
    model): policies are frozen, and a reload makes new ones. `counter` is counter_for's
    (its answer for a policy and model never changes once a vocabulary is loaded)."""

    policy: Policy  # held: the id the setup is kept under is not reused meanwhile
    model: str
    counter: TokenCounter
    rules: ProjectionPolicy
    reserve_output: int
    max_output: int | None
    epsilon: int

    def window(self, learned: Learned | None) -> int:
        """The model's window before any correction (model_budget.model_window)."""
        return model_window(self.policy, self.model, learned)[0]


# (id(policy), model) -> its PolicySetup; cleared when full (model names come from clients)
_SETUPS: dict[tuple[int, str], PolicySetup] = {}
MAX_SETUPS = 1024


async def policy_setup(policy: Policy, model: str) -> PolicySetup:
    """The projection's per-policy values for `model`, made on first use."""
    key = (id(policy), model)
    setup = _SETUPS.get(key)
    if setup is not None and setup.policy is policy:
        return setup
    counter = await counter_for(policy, model)
    limits = policy.limits_for(model)
    setup = PolicySetup(
        policy,
        model,
        counter,
        projection_policy(policy),
        policy.budget.reserve_output_tokens,
        limits.max_output_tokens,
        policy.budget.safety_margin_tokens,
    )
    if len(_SETUPS) >= MAX_SETUPS:
        _SETUPS.clear()
    _SETUPS[key] = setup
    return setup


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
    chain_sources: Sequence[Item] = (),
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
    and its item count (whole_fit). `chain_sources`: the items a stored cut's summary
    chain stands for (`chain_sources`, ProjectionRequest's). The counter returned is the tokenizer's own,
    uncorrected: what is stored with items."""
    fixed = await policy_setup(policy, model)
    base = fixed.counter
    counter: TokenCounter
    if provider is not None:
        counter = ProviderCounter(base, learned, provider.items, provider.prompt)
    else:
        counter = calibrated_counter(base, learned)

    output = output_reserve(requested_output, fixed.reserve_output, fixed.max_output)
    window = corrected_window(fixed.window(learned), output, learned)
    if window_cap is not None:
        window = min(window, window_cap)

    def asked() -> ProjectionRequest:
        return ProjectionRequest(
            items=items,
            window=window,
            output=output,
            epsilon=fixed.epsilon,
            tools_tokens=counter.tools(tools),
            instructions_tokens=counter.instructions(instructions),
            reply_tokens=counter.reply_tokens,
            first_position=first_position,
            cut=cut,
            stateless=stateless,
            summaries=summaries if summaries is not None else {},
            verbatim=verbatim,
            chain_sources=chain_sources,
        )

    rules = fixed.rules
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
        seconds = time.perf_counter() - started
        observe_projection(metrics, route, projection, seconds, kept=projection is fit)
    return projection, base


def observe_projection(
    metrics: Metrics, route: str, projection: Projection, seconds: float, *, kept: bool = False
) -> None:
    """The projection's metrics; `kept`: every block was kept (whole_fit's), so none
    trimmed a token."""
    metrics.rebuild_seconds.observe(seconds)
    metrics.child(metrics.context_tokens, route).observe(projection.report.prompt_tokens)
    if kept:
        return
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
    sources = await chain_sources(request, loaded, new) if loaded is not None else ()
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
            chain_sources=sources,
        )
        if span is not None:  # tracing on
            set_attributes(span, budget_attributes(projection))
    if observe:
        request[LOG_FIELDS].update(budget_log_fields(projection))
        request[PROJECTION] = projection
    return projection, counter


# The chain's items read for a take-in: the newest, at most this many rows and stored
# tokens (a value named later than that is not taken in).
CHAIN_SOURCE_ROWS = 256
CHAIN_SOURCE_TOKENS = 128_000
CHAIN_SOURCES = "chain_sources"  # Loaded.memo's key: the last `_ChainSources` read


@dataclass(frozen=True)
class _ChainSources:
    """The store's items before a window (`end`, its first seq) after an opening head of
    `opening` items, pinned ones left out, as projection items."""

    opening: int
    end: int
    stored: tuple[StoredItem, ...]
    items: tuple[Item, ...]


async def chain_sources(
    request: web.Request, loaded: Loaded, new: Sequence[Item]
) -> tuple[Item, ...]:
    """What a stored thread's summary chain stands for, from the store (ProjectionRequest
    .chain_sources), so a turn naming a value the chain lacks takes it in: only when one
    may (memory.may_take_in, over the items since the last request: the window's answer
    rows and `new`), the newest CHAIN_SOURCE_ROWS rows and CHAIN_SOURCE_TOKENS at most,
    kept in the window's memo until the window moves (then only the rows it left are
    read; their bytes counted in the WindowCache's bound, MEMO_BYTES). The store is the source: another process, or this one restarted, reads it."""
    cut, thread = loaded.cut(), loaded.thread
    end = loaded.first_position
    if thread is None or cut is None or not cut.chain or end <= cut.opening:
        return ()
    fresh = len(loaded.items)
    if len(loaded.stored) == fresh:
        while fresh and loaded.stored[fresh - 1].role == "output":
            fresh -= 1
    written = "\n".join(item.text() for item in cut.chain)
    if not may_take_in(loaded.items[:fresh], [*loaded.items[fresh:], *new], written):
        return ()
    held = loaded.memo.get(CHAIN_SOURCES)
    if not isinstance(held, _ChainSources) or held.opening != cut.opening or held.end > end:
        held = _ChainSources(cut.opening, 0, (), ())
    if held.end < end:
        first = max(held.end, end - CHAIN_SOURCE_ROWS)
        earlier = held.stored if first == held.end else ()
        store = request.app[THREADS].store
        rows = await store.items_between(loaded.tenant, loaded.thread_id, first, end - 1)
        if first == 0:
            rows = rows[cut.opening :]  # the opening head, sent verbatim
        else:  # the head's rows: seqs below `opening` (unless items were deleted before it)
            rows = tuple(row for row in rows if row.seq >= cut.opening)
        held = _newest(cut.opening, end, (*earlier, *rows), request[TENANT_POLICY])
        loaded.memo[CHAIN_SOURCES] = held
        loaded.memo[MEMO_BYTES] = sum(json_size(row.raw) for row in held.stored)
    return held.items


def _newest(opening: int, end: int, rows: Sequence[StoredItem], policy: Policy) -> _ChainSources:
    """The newest of `rows` within CHAIN_SOURCE_ROWS and CHAIN_SOURCE_TOKENS."""
    kept, tokens = len(rows), 0
    while kept > max(0, len(rows) - CHAIN_SOURCE_ROWS):
        tokens += rows[kept - 1].tokens
        if tokens > CHAIN_SOURCE_TOKENS:
            break
        kept -= 1
    stored = tuple(rows[kept:])
    items = [stored_item_view(row) for row in stored]
    pinned = pinned_flags(items, compile_pins(tuple(policy.memory.pin_patterns)))
    sources = tuple(item for item, pin in zip(items, pinned, strict=True) if not pin)
    return _ChainSources(opening, end, stored, sources)


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
