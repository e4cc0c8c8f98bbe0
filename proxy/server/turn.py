"""One model turn, the SPEC's request path written once for both APIs and every mode.

    load the thread (when stored)     hooks: load
    restore ledger calls              hooks: restore
    orphan check (SPEC 6)             here, on a stored thread
    answer dangling calls             hooks: close_calls
    budget + projection (SPEC 4-5)    rebuild.rebuild_turn (logs the budget breakdown)
                                      hooks: projected
    the provider's body               here; hooks: upstream_body
    ledger outputs, begin the turn    hooks: before_forward
    forward                           relay.send_upstream; a context-length refusal is
                                      projected again and sent once more (overflow.py)
                                      hooks: upstream_response
    relay (+ commit)                  relay.relay_answer with the hooks' transformer
    always, at the end                hooks: finished

What differs between Chat and Responses is the adapter's (proxy/server/api.py). What
differs between modes is which hooks a handler passes: the ledger guard
(hooks/ledger.py), a persistence hook for a stored thread (hooks/persist.py), usage
logging (hooks/usage.py). Hooks are plain objects like mitmproxy's addons: each method
is a named point of the turn, called on every hook in the order given.

    >>> hooks = [LedgerHook(request, CHAT), UsageHook(request)]   # a stateless Chat turn
    >>> await run_turn(request, CHAT, body, raw, hooks)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from proxy.core import fastjson
from proxy.core.items import Item
from proxy.core.projection import Projection
from proxy.core.tokens import TokenCounter
from proxy.server.api import ApiShape
from proxy.server.errors import ApiError, invalid
from proxy.server.explain import PROJECTION
from proxy.server.overflow import (
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
from proxy.server.relay import Keep, Keeper, Passthrough, Transformer, relay_answer, send_upstream
from proxy.server.state import LOG_FIELDS, TENANT_POLICY, TRACING, thread_service
from proxy.server.validate import JsonDict
from proxy.threads import Loaded, first_orphan
from proxy.tracing import genai_request, genai_response, set_attributes
from proxy.upstream import UpstreamResponse


@dataclass
class Turn:
    """One request on its way through run_turn; the hooks read and fill it in."""

    request: web.Request
    api: ApiShape
    body: JsonDict  # the client's request (its history replaced before forwarding)
    raw: bytes  # the client's bytes: forwarded as they are when nothing changed
    loaded: Loaded | None = None  # the stored thread's window; None: stateless
    history: Any = None  # the client's history entries that are new (raw)
    new: list[Item] = field(default_factory=list)  # the request's new items
    given: int = 0  # how many items the client's history held
    outputs: Sequence[JsonDict] | str = ()  # where the client's new tool outputs are
    projection: Projection | None = None
    sent: JsonDict | None = None  # the provider's request (a continuation extends it)
    counter: TokenCounter | None = None
    keeper: Keeper | None = None  # a stored turn's commit (hooks/persist.py)
    committed: bool = False  # the turn's items were written to `loaded`'s thread
    response_id: str | None = None  # the proxy's own id of this answer, when it has one
    # LLM summaries ready for the projection's chunks, by chunk digest (hooks/summaries.py)
    summaries: Mapping[str, Item] = field(default_factory=dict)
    rewritten: bool = False  # a hook changed what the provider gets: never the client's bytes

    @property
    def verbatim(self) -> bool:
        """Responses `truncation: "disabled"`: the whole history is sent as it is, or the
        request is refused (OpenAI's 400 context_length_exceeded); nothing is trimmed."""
        return not self.api.budget_inputs(self.body).truncate

    @property
    def known(self) -> Sequence[Item]:
        """The stored window the new items follow (empty when stateless)."""
        return self.loaded.items if self.loaded is not None else ()


class TurnHook:
    """A cross-cutting step of the turn. Every method is optional (these do nothing)."""

    async def load(self, turn: Turn) -> None:
        """Read the stored thread into `turn.loaded`; `turn.history` may become the part
        of the client's history the thread does not hold yet."""

    async def restore(self, turn: Turn) -> None:
        """Put back calls the thread lost before their outputs (before the orphan check)."""

    async def close_calls(self, turn: Turn) -> None:
        """Answer calls that would otherwise reach the provider without an output."""

    async def projected(self, turn: Turn) -> None:
        """The projection is made; a hook may make it again (`project`) with what it
        learnt from it (summaries read since)."""

    def upstream_body(self, turn: Turn, body: JsonDict) -> JsonDict:
        """The provider's request, once its history is the projection's."""
        return body

    async def before_forward(self, turn: Turn) -> None:
        """The last step before the provider is called (record outputs, begin a turn)."""

    def upstream_response(self, turn: Turn, upstream: UpstreamResponse) -> UpstreamResponse:
        """The provider's answer as the rest of the turn reads it (relay, keeper, ledger)."""
        return upstream

    def transformer(self, turn: Turn, current: Transformer) -> Transformer:
        """The relay's transformer; `current` is what the hooks before chose."""
        return current

    def answered(self, turn: Turn, answer: JsonDict) -> None:
        """A whole answer, or a stream's usage holder, as the provider sent it."""

    async def finished(self, turn: Turn) -> None:
        """Always, once the turn is over (relayed, refused or failed)."""


async def run_turn(
    request: web.Request, api: ApiShape, body: JsonDict, raw: bytes, hooks: Sequence[TurnHook]
) -> web.StreamResponse:
    """The request path (SPEC 3-7) for a validated body of `api`."""
    turn = Turn(request, api, body, raw)
    try:
        await _prepare(turn, hooks)
        return await _forward(turn, hooks)
    finally:
        for hook in hooks:
            await hook.finished(turn)


async def _prepare(turn: Turn, hooks: Sequence[TurnHook]) -> None:
    """Everything before the provider's body: the turn's items and their projection."""
    turn.history = turn.body.get(turn.api.history)
    for hook in hooks:
        await hook.load(turn)
    if turn.verbatim and turn.loaded is not None:
        turn.loaded = await thread_service(turn.request.app).whole(turn.loaded)
    history = turn.outputs = turn.history if turn.history is not None else []
    small = small_body(turn.raw)
    turn.new = await off_the_loop(lambda: turn.api.items(history), history, small=small)
    turn.given = len(turn.new)
    for hook in hooks:
        await hook.restore(turn)
    orphan = first_orphan(turn.known, turn.new, stateless=turn.loaded is None)
    if orphan is not None:
        raise invalid(turn.api.orphan_message(orphan), param=turn.api.history)
    for hook in hooks:
        await hook.close_calls(turn)
    turn.projection, turn.counter = await project(turn)
    for hook in hooks:
        await hook.projected(turn)


async def project(
    turn: Turn,
    loaded: Loaded | None = None,
    *,
    observe: bool = True,
    window_cap: int | None = None,
) -> tuple[Projection, TokenCounter]:
    """The projection of the window plus the new items (SPEC 3-5); `loaded` replaces the
    turn's window (a restate after a lost race, which is not observed); `window_cap`: the
    smaller W of a retry after a context-length refusal."""
    inputs = turn.api.budget_inputs(turn.body)
    return await rebuild_turn(
        turn.request,
        inputs.model,
        turn.new,
        loaded or turn.loaded,
        tools=inputs.tools,
        requested_output=inputs.requested_output,
        instructions=inputs.instructions,
        param=turn.api.history,
        route=turn.api.route,
        observe=observe,
        small=small_body(turn.raw),
        summaries=turn.summaries,
        verbatim=not inputs.truncate,
        window_cap=window_cap,
    )


def sent_body(turn: Turn, hooks: Sequence[TurnHook]) -> tuple[JsonDict, bytes]:
    """The provider's request: the client's own bytes when the projection changed
    nothing on a stateless request, else the body with the projection as its history."""
    assert turn.projection is not None
    unchanged = turn.loaded is None and not turn.projection.changed and not turn.rewritten
    if unchanged and len(turn.new) == turn.given:
        return turn.body, turn.raw
    sent = turn.api.with_items(turn.body, turn.projection.items)
    for hook in hooks:
        sent = hook.upstream_body(turn, sent)
    return sent, fastjson.dumps(sent)


async def _forward(turn: Turn, hooks: Sequence[TurnHook]) -> web.StreamResponse:
    assert turn.projection is not None
    sent, raw = sent_body(turn, hooks)
    turn.sent = sent
    for hook in hooks:
        await hook.before_forward(turn)
    request, api = turn.request, turn.api
    tracing = request.app[TRACING]
    thread_id = turn.loaded.thread_id if turn.loaded is not None else None
    attributes = genai_request(sent, thread_id) if tracing.on else {}
    name = f"chat {sent.get('model')}"
    with tracing.span(name, kind="client") as span:  # the model call, retries included
        set_attributes(span, attributes)
        upstream = await _send(turn, raw)
        refusal = await context_refusal(upstream)
        if refusal is not None:
            upstream = await _retry_smaller(turn, hooks, upstream, refusal)
        for hook in hooks:
            upstream = hook.upstream_response(turn, upstream)
        transformer: Transformer = (
            Keep(api, turn.keeper) if turn.keeper is not None else Passthrough(api)
        )
        for hook in hooks:
            transformer = hook.transformer(turn, transformer)

        def answered(answer: JsonDict) -> None:
            for hook in hooks:
                hook.answered(turn, answer)
            if span is not None:
                set_attributes(span, genai_response(answer))

        extra = context_headers(turn.projection)
        with tracing.span("relay"):
            return await relay_answer(
                request, upstream, api, transformer, extra_headers=extra, on_answer=answered
            )


async def _send(turn: Turn, raw: bytes) -> UpstreamResponse:
    assert turn.sent is not None
    return await send_upstream(
        turn.request,
        turn.request[TENANT_POLICY],
        path=turn.api.path,
        body=raw,
        stream=bool(turn.sent.get("stream")),
        route=turn.api.route,
    )


async def _retry_smaller(
    turn: Turn, hooks: Sequence[TurnHook], refused: UpstreamResponse, refusal: Refusal
) -> UpstreamResponse:
    """The provider refused the request for its length (SPEC round 3): what it states is
    learnt, and the turn is projected again under it and sent once more, before any byte
    reached the client. Hooks' before_forward is not run again: the client's tool outputs
    are recorded once, a Responses row begun once. A turn that cannot fit the stated
    window is a 400 with the breakdown; so is a retry refused in turn (never a third
    call); `truncation: "disabled"` is never trimmed: its refusal is relayed."""
    assert turn.projection is not None
    request, route = turn.request, turn.api.route
    model = turn.api.budget_inputs(turn.body).model
    first = turn.projection.report
    assert turn.counter is not None
    learned = learn(request, model, refusal.overflow, first, turn.counter, sent_items(turn))
    facts = {"refusal": refusal.shown, "refused_estimate": first.prompt_tokens}
    if turn.verbatim:
        observe(request, route, "not_retried", **facts, reason="truncation_disabled")
        return refused
    window = retry_window(request, model, learned, refusal.overflow, first)
    try:
        turn.projection, turn.counter = await project(turn, observe=False, window_cap=window)
    except ApiError as exc:
        observe(request, route, "refused", **facts, window=window)
        raise await _refused(turn, hooks, refused, cannot_fit(refusal.error, exc)) from None
    request[PROJECTION] = turn.projection
    request[LOG_FIELDS].update(budget_log_fields(turn.projection))
    await refused.aclose()
    turn.sent, raw = sent_body(turn, hooks)
    observe(
        request, route, "retried", **facts, retried_estimate=turn.projection.report.prompt_tokens
    )
    retried = await _send(turn, raw)
    again = await context_refusal(retried)
    if again is None:
        return retried
    learn(request, model, again.overflow, turn.projection.report, turn.counter, sent_items(turn))
    observe(request, route, "not_retried", **facts, reason="refused_again", again=again.shown)
    param = turn.api.history
    raise await _refused(
        turn, hooks, retried, refused_again(again.error, turn.projection.report, param)
    )


def sent_items(turn: Turn) -> int:
    """How many items the provider got: the projection's, and instructions as one more."""
    assert turn.projection is not None
    instructions = turn.api.budget_inputs(turn.body).instructions
    return len(turn.projection.items) + (1 if instructions else 0)


async def _refused(
    turn: Turn, hooks: Sequence[TurnHook], upstream: UpstreamResponse, error: ApiError
) -> ApiError:
    """The provider's refusal, shown to the hooks (a refused Responses turn leaves no row),
    then released; `error` is what the client gets."""
    for hook in hooks:
        upstream = hook.upstream_response(turn, upstream)
    await upstream.aclose()
    return error
