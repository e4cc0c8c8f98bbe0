"""POST /v1/responses and /v1/responses/input_tokens.

Every request is forwarded stateless (SPEC 3): `store: false`, no `conversation` or
`previous_response_id`, the input rebuilt from the thread under the budget. Stateful
modes are served from the local store:

- `conversation`: the conversation's thread; the turn is appended to it.
- `previous_response_id`: each response chain is a thread of kind "responses"; a
  response that is its thread's head continues it, an older one forks a branch (the
  fork is written with the turn, so a failed request leaves nothing behind).
- neither, and `store` not false: a new chain thread holding this turn.
- `store: false` is honoured: the thread is read, nothing is written.

The response is recorded `in_progress` before the provider is called; input and output
items commit together when it completes; a response cut off (disconnect, provider error)
is marked `incomplete` and adds no items (SPEC 7).

Which request fields are forwarded and which the proxy serves: docs/request-fields.md.
"""

from __future__ import annotations

from collections.abc import Sequence

from aiohttp import web

from proxy.core import fastjson
from proxy.counting import counter_for, provider_count
from proxy.server.api import RESPONSES
from proxy.server.background import RUNS, follow
from proxy.server.compaction import (
    CONTEXT_MANAGEMENT,
    LOCAL_REWRITERS,
    compaction_threshold,
    expand_compactions,
    rewriters,
)
from proxy.server.errors import invalid
from proxy.server.model_budget import budget_counter, learned_for
from proxy.server.modes import Conversation, ResponseChain, Stateless, resolve_chain
from proxy.server.observe import SummariesAhead, Usage
from proxy.server.relay import check_translatable
from proxy.server.response_routes import get_response
from proxy.server.state import LOG_FIELDS, TENANT_POLICY, THREADS
from proxy.server.turn import (
    REWRITERS,
    Mode,
    New,
    Plan,
    Rewriter,
    Turn,
    Window,
    off_the_loop,
    projected_once,
    run_turn,
)
from proxy.server.validate import (
    JsonDict,
    ends_with_trigger,
    list_of_objects,
    optional,
    optional_positive_int,
    read_json_object,
    required_string,
    resolve_references,
    unsupported_value,
    validate_input,
    wrong_type,
)


def validate_responses(body: JsonDict) -> None:
    if body.get("model") is not None:  # optional: a stored `prompt` may name the model
        required_string(body, "model")
    validate_input(body)
    optional(body, "instructions", str)
    optional_positive_int(body, "max_output_tokens")
    optional(body, "stream", bool)
    optional(body, "store", bool)
    if optional(body, "background", bool) and body.get("store") is False:
        raise invalid(
            "Background mode requires store=true: set 'store' to true or leave it out.",
            param="background",
        )
    tools = optional(body, "tools", list)
    if tools is not None:
        list_of_objects(tools, "tools")
    if body.get("conversation") is not None and body.get("previous_response_id") is not None:
        raise invalid(
            "Mutually exclusive parameters: Ensure you are only providing one of: "
            "'previous_response_id' or 'conversation'.",
            code="mutually_exclusive_parameters",
        )
    conversation = body.get("conversation")
    if conversation is not None and not isinstance(conversation, str | dict):
        raise wrong_type("conversation", "a string or an object", conversation)
    optional(body, "previous_response_id", str)
    truncation = optional(body, "truncation", str)
    if truncation is not None and truncation not in TRUNCATION:
        raise unsupported_value(truncation, TRUNCATION, "truncation")
    if CONTEXT_MANAGEMENT in body:
        compaction_threshold(body)


# OpenAI's `truncation` (absent or null: threadkeeper trims, as with "auto"; docs/features.md).
TRUNCATION = ("auto", "disabled")


def is_stateful(body: JsonDict) -> bool:
    return body.get("conversation") is not None or body.get("previous_response_id") is not None


async def create_response(request: web.Request) -> web.StreamResponse:
    body, raw = await read_json_object(request)
    return await respond(request, body, raw)


async def respond(request: web.Request, body: JsonDict, raw: bytes) -> web.StreamResponse:
    """One Responses turn of a parsed body, HTTP's or a WebSocket's `response.create`
    (proxy/server/websocket.py): the one pipeline both run."""
    validate_responses(body)
    request[LOG_FIELDS].update(model=body.get("model"))
    # The provider never gets what the proxy serves: `background` (proxy/server/
    # background.py), and `context_management` when compaction is the proxy's.
    background = body.pop("background", None)
    local = request[TENANT_POLICY].compaction.local  # else the provider's (compaction.mode)
    threshold = compaction_threshold(body) if CONTEXT_MANAGEMENT in body else None
    managed = local and CONTEXT_MANAGEMENT in body
    if managed:
        del body[CONTEXT_MANAGEMENT]
    if await resolve_references(request, body) or background is not None or managed:
        raw = fastjson.dumps(body)
    await check_translatable(request, request[TENANT_POLICY], body)
    mode = responses_mode(request, body, background=background is True)
    plan = Plan(mode, turn_rewriters(local, threshold), [SummariesAhead(request), Usage()])
    if not isinstance(mode, ResponseChain) or not mode.background:
        return await run_turn(request, RESPONSES, body, raw, plan)
    run = await request.app[RUNS].start(request, RESPONSES, body, raw, plan, mode.id)
    if run.stream:
        return await follow(request, run.tenant, run.id, after=-1)
    return await get_response(request, run.id)


def turn_rewriters(local: bool, threshold: int | None) -> Sequence[Rewriter]:
    """Every turn's rewriters; with compaction the proxy's, compaction's too (and its
    compaction past `context_management`'s threshold when the request sets one)."""
    if not local:
        return REWRITERS
    return LOCAL_REWRITERS if threshold is None else rewriters(threshold)


def responses_mode(request: web.Request, body: JsonDict, *, background: bool) -> Mode:
    """A conversation's turn, a chain's (a previous response, or `store` not false: a
    new chain), else a stateless one (`store: false` and nothing to continue)."""
    if body.get("conversation") is not None:
        return Conversation(request, body, background=background)
    if body.get("store") is not False or is_stateful(body):
        return ResponseChain(request, body, background=background)
    return Stateless()


async def input_tokens(request: web.Request) -> web.StreamResponse:
    body, _ = await read_json_object(request)
    validate_responses(body)
    await resolve_references(request, body)
    given = body.get("input")
    history = given if given is not None else []
    items = await off_the_loop(lambda: RESPONSES.items(history), history)
    if ends_with_trigger(body):  # it asks for a compaction, which sends nothing to count
        items = items[:-1]
    loaded = None
    if is_stateful(body):
        loaded = (await resolve_chain(request, request.app[THREADS], body)).loaded
    turn = Turn(request, RESPONSES, body, b"", Stateless(), None, (), tuple(items))
    if loaded is not None and turn.verbatim:  # the whole thread would be sent
        loaded = await request.app[THREADS].whole(loaded)
    window, new = Window(loaded), New(tuple(items))
    # Compaction items count as the summary the provider would get.
    if request[TENANT_POLICY].compaction.local:
        window, new = await expand_compactions(turn, window, new)
    inputs = turn.inputs
    learned = await learned_for(request, inputs.model)
    projected = window.loaded is not None and not turn.verbatim
    if projected:
        # The provider does not know our conversations: count what would be sent, with
        # the counter the budget counted it with.
        made = await projected_once(turn, window, new)
        sent = list(made.projection.items)
        counter = await budget_counter(request, inputs.model, made.counter, learned, sent)
        counted = made.projection.report.prompt_tokens
    else:
        base = await counter_for(request[TENANT_POLICY], inputs.model)
        sent = [*window.items, *new.items]
        counter = await budget_counter(request, inputs.model, base, learned, sent)
        counted = await off_the_loop(
            lambda: counter.responses_prompt(sent, inputs.instructions, inputs.tools), body
        )
    # In the provider's count: its own counts (`tokenizer: provider`), else as its
    # answers' usage taught it (proxy/server/model_budget.py).
    sent_items = len(sent) + (1 if inputs.instructions else 0)
    count = provider_count(counter, learned, counted, sent_items)
    return web.json_response({"object": "response.input_tokens", "input_tokens": count})
