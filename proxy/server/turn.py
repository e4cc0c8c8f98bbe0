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
    project   budget + projection (SPEC 4-5, rebuild.rebuild_turn, which logs the
              budget breakdown), again with LLM summaries other processes wrote
                                                                       -> Projected
    forward   the provider's body; the client's tool outputs into the ledger; the
              mode's begin; the provider's answer (chat_upstream.send_model), or one the
              proxy serves itself; a context-length refusal is projected again and sent
              once more (model_budget.py)                                -> Forwarded
    relay     the answer through a transformer (relay.py): the ledger's holdback when a
              tool is guarded, else Keep (a stored turn) or Passthrough
    commit    the mode's commit, which the relay calls before the answer's end reaches
              the client (modes.Kept)
    finish    the mode's finish, then the observers'

Observers (proxy/server/observe.py: usage, summaries ahead, a background run's start)
are the only hooks: they are shown the values and never change them.

    >>> plan = Plan(Stateless(), REWRITERS, [Usage()])  # modes, rewrite, observe
    >>> await run_turn(request, CHAT, body, raw, plan)   # a stateless Chat turn
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any, Protocol

import structlog
from aiohttp import web

from proxy.core import fastjson
from proxy.core.items import Item
from proxy.core.projection import Projection
from proxy.core.tokens import TokenCounter
from proxy.server.api import ApiShape, BudgetInputs
from proxy.server.chat_upstream import Untranslatable, send_model
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
    Refusal,
    cannot_fit,
    context_refusal,
    learn,
    observe,
    refused_again,
    retry_window,
)
from proxy.server.rebuild import (
    budget_log_fields,
    context_headers,
    off_the_loop,
    rebuild_turn,
    small_body,
)
from proxy.server.relay import relay_answer
from proxy.server.state import (
    CLOCK,
    LOG_FIELDS,
    NAMESPACE,
    SUMMARIES,
    TENANT_POLICY,
    THREADS,
    TRACING,
)
from proxy.server.summaries import Ready, replayed, sent_chunks
from proxy.server.transform import Keep, Keeper, Passthrough, Transformer
from proxy.server.validate import JsonDict
from proxy.threads import Loaded
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

    @property
    def item_types(self) -> frozenset[str | None]:
        return self.loaded.item_types if self.loaded is not None else frozenset()


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
    one of `types`: any other turn passes it by uncalled, so what does not apply to a
    turn is seen in its plan (a turn without a compaction item has none to expand)."""

    types: frozenset[str]
    rewriter: Rewriter

    async def __call__(self, turn: Turn, window: Window, new: New) -> tuple[Window, New]:
        types = self.types
        if not types.isdisjoint(window.item_types) or any(i.type in types for i in new.items):
            return await self.rewriter(turn, window, new)
        return window, new


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
    restore_ledger_calls,
    refuse_orphans,
    answer_dangling_calls,
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
    if turn.guard.active:
        guarded = Guarded(
            turn.request, turn.api, turn.guard, forwarded.sent, keeper, turn.mode.response_id
        )
        return holdback(guarded)
    return Keep(turn.api, keeper) if keeper is not None else Passthrough(turn.api)


async def _send(turn: Turn, sent: JsonDict, raw: bytes) -> UpstreamResponse:
    """The provider's answer, through the API its upstream serves (chat_upstream.py)."""
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
