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
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from proxy.clock import utc_now
from proxy.core.items import (
    Item,
    ResponsesInput,
    items_from_responses_input,
    responses_input_from_items,
    responses_item,
)
from proxy.core.projection import Projection
from proxy.core.tokens import ANY_MODEL, TokenCounter
from proxy.ids import new_id
from proxy.server.errors import ApiError, invalid
from proxy.server.holdback import Guarded, relay_guarded
from proxy.server.ledger import LedgerGuard, custom_tool_names
from proxy.server.rebuild import context_headers, off_the_loop, rebuild_turn
from proxy.server.relay import relay_kept, relay_response, send_upstream
from proxy.server.state import LOG_FIELDS, NAMESPACE, OWNER, STORE, TENANT_POLICY, WINDOWS
from proxy.server.validate import (
    JsonDict,
    duplicate_item,
    list_of_objects,
    optional,
    optional_positive_int,
    read_json_object,
    required_string,
    wrong_type,
)
from proxy.store.base import StoredResponse
from proxy.threads import Loaded, ThreadService, first_orphan, new_items

REASONING_PREFIXES = ("o1", "o3", "o4", "gpt-5")
ENCRYPTED_REASONING = "reasoning.encrypted_content"


def validate_responses(body: JsonDict) -> None:
    if body.get("model") is not None:  # optional: a stored `prompt` may name the model
        required_string(body, "model")
    value = body.get("input")
    if value is not None and not isinstance(value, str):
        for index, item in enumerate(list_of_objects(value, "input")):
            validate_input_item(item, f"input[{index}]")
    optional(body, "instructions", str)
    optional_positive_int(body, "max_output_tokens")
    optional(body, "stream", bool)
    optional(body, "store", bool)
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


def validate_input_item(item: JsonDict, param: str) -> None:
    item_type = item.get("type")
    if item_type is not None and not isinstance(item_type, str):
        raise wrong_type(f"{param}.type", "a string", item_type)
    role = item.get("role")
    if item_type in (None, "message"):
        if role is None:
            raise invalid(
                f"Missing required parameter: '{param}.role'.",
                param=f"{param}.role",
                code="missing_required_parameter",
            )
        if not isinstance(role, str):
            raise wrong_type(f"{param}.role", "a string", role)
        content = item.get("content")
        if not isinstance(content, str | list):
            raise wrong_type(f"{param}.content", "a string or an array", content)
    if item_type in ("function_call", "function_call_output", "custom_tool_call_output"):
        if not isinstance(item.get("call_id"), str):
            raise invalid(
                f"Missing required parameter: '{param}.call_id'.",
                param=f"{param}.call_id",
                code="missing_required_parameter",
            )


def is_stateful(body: JsonDict) -> bool:
    return body.get("conversation") is not None or body.get("previous_response_id") is not None


async def _input(body: JsonDict) -> ResponsesInput:
    """The input as items (each digested: off the loop when the input is large)."""
    value = body.get("input")
    given = value if value is not None else []
    return await off_the_loop(lambda: items_from_responses_input(given), given)


def budget_model(body: JsonDict) -> str:
    """The model the budget is computed for: without `model` (a stored prompt names it),
    the policy's "*" limits and the default encoding."""
    return body.get("model") or ANY_MODEL


def is_reasoning_model(model: str) -> bool:
    return model.startswith(REASONING_PREFIXES)


def conversation_id(body: JsonDict) -> str | None:
    value = body.get("conversation")
    if isinstance(value, dict):
        inner = value.get("id")
        if not isinstance(inner, str) or not inner:
            raise invalid(
                "Missing required parameter: 'conversation.id'.",
                param="conversation.id",
                code="missing_required_parameter",
            )
        return inner
    return value


async def create_response(request: web.Request) -> web.StreamResponse:
    body, raw = await read_json_object(request)
    validate_responses(body)
    request[LOG_FIELDS].update(model=body.get("model"))
    if await resolve_references(request, body):
        raw = json.dumps(body, ensure_ascii=False).encode()
    if body.get("store") is False and not is_stateful(body):
        return await _stateless(request, body, raw)
    return await _stateful(request, body)


# Stored items that need their id as input (a reasoning item is replayed by id).
REFERENCE_KEEPS_ID = frozenset({"reasoning", "compaction"})


async def resolve_references(request: web.Request, body: JsonDict) -> bool:
    """Replaces each `item_reference` of `input` by the tenant's stored item it names, so
    it is budgeted and forwarded as an item (providers other than OpenAI do not know the
    reference, nor do they have the item). A 404 names the input index of an unknown id.

    The copy drops the stored item's `id` (except REFERENCE_KEEPS_ID types): it is a new
    occurrence in this turn, committed under a fresh id, and the provider refuses two
    items with one id. Returns whether `input` changed."""
    given = body.get("input")
    if not isinstance(given, list) or not any(_is_reference(item) for item in given):
        return False
    store, tenant = request.app[STORE], request[NAMESPACE]
    resolved: list[JsonDict] = []
    for index, item in enumerate(given):
        if not _is_reference(item):
            resolved.append(item)
            continue
        item_id = item.get("id")
        if not isinstance(item_id, str):
            raise invalid(
                f"Missing required parameter: 'input[{index}].id'.",
                param=f"input[{index}].id",
                code="missing_required_parameter",
            )
        stored = await store.find_item(tenant, item_id)
        if stored is None or stored.api != "responses":
            raise ApiError(404, f"Item with id '{item_id}' not found.", param=f"input[{index}]")
        keep_id = stored.raw.get("type") in REFERENCE_KEEPS_ID
        resolved.append({k: v for k, v in stored.raw.items() if keep_id or k != "id"})
    body["input"] = resolved
    return True


def _is_reference(item: Any) -> bool:
    return isinstance(item, dict) and item.get("type") == "item_reference"


async def _stateless(request: web.Request, body: JsonDict, raw: bytes) -> web.StreamResponse:
    given = body.get("input") or []
    guard = LedgerGuard(request, api="responses", thread_id=None, now=utc_now)
    parsed = (await _input(body)).items
    items: Sequence[Item] = parsed
    if guard.active:  # a side-effecting call the client never answered (SPEC 6)
        items = await guard.answer_dangling((), items, unguarded_too=False)
    projection, _ = await _rebuild(request, body, items)
    if projection.changed or len(items) != len(parsed):
        body["input"] = responses_input_from_items(projection.items)
        raw = json.dumps(body, ensure_ascii=False).encode()
    await guard.record_outputs(given)
    upstream = await send_upstream(
        request,
        request[TENANT_POLICY],
        path="/responses",
        body=raw,
        stream=bool(body.get("stream")),
        route="responses",
    )
    extra = context_headers(projection)
    if guard.active:  # SPEC 6: side-effecting calls pass the ledger first
        guarded = Guarded(request, "responses", guard, body)
        return await relay_guarded(upstream, guarded, extra_headers=extra)
    return await relay_response(request, upstream, family="responses", extra_headers=extra)


async def _rebuild(
    request: web.Request,
    body: JsonDict,
    new: Sequence[Item],
    loaded: Loaded | None = None,
    *,
    observe: bool = True,
) -> tuple[Projection, TokenCounter]:
    """The projection of the thread's window plus the new input (SPEC 3-5)."""
    return await rebuild_turn(
        request,
        budget_model(body),
        new,
        loaded,
        tools=list(body.get("tools") or []),
        requested_output=body.get("max_output_tokens"),
        instructions=body.get("instructions"),
        param="input",
        route="responses",
        observe=observe,
    )


@dataclass(frozen=True)
class Chain:
    """Where a stateful request reads and writes: the thread, and the ids it echoes."""

    loaded: Loaded
    conversation: str | None = None
    previous_response_id: str | None = None


async def resolve_chain(request: web.Request, threads: ThreadService, body: JsonDict) -> Chain:
    tenant = request[NAMESPACE]
    conversation = conversation_id(body)
    if conversation is not None:
        loaded = await threads.load(tenant, conversation)
        if loaded is None or loaded.kind != "conversation":
            raise ApiError(
                404, f"Conversation with id '{conversation}' not found.", param="conversation"
            )
        return Chain(loaded, conversation=conversation)
    previous = body.get("previous_response_id")
    if previous is None:
        return Chain(Loaded(tenant, new_id("thread"), "responses", None))
    return Chain(await _continued(threads, tenant, previous), previous_response_id=previous)


async def _continued(threads: ThreadService, tenant: str, previous: str) -> Loaded:
    """The chain a previous response ends: its own thread while it is the head, else a
    branch of it (a fork written with the turn) that later responses never see."""
    stored = await threads.store.get_response(tenant, previous)
    thread = None
    if stored is not None and stored.status == "completed" and stored.thread_id is not None:
        thread = await threads.load(tenant, stored.thread_id)
    if stored is None or thread is None or thread.thread is None:
        raise ApiError(
            400,
            f"Previous response with id '{previous}' not found.",
            param="previous_response_id",
            code="previous_response_not_found",
        )
    if thread.kind == "responses" and thread.thread.head_response_id == previous:
        return thread
    through = stored.output_last_seq if stored.output_last_seq is not None else -1
    return await threads.branch(tenant, thread.thread_id, through)


def upstream_body(body: JsonDict, items: Sequence[Item]) -> JsonDict:
    """The stateless request the provider gets (SPEC 3)."""
    sent = {k: v for k, v in body.items() if k not in ("conversation", "previous_response_id")}
    sent["store"] = False
    sent["input"] = [item.raw for item in items]
    if is_reasoning_model(body.get("model") or ""):
        # Reasoning items can only be replayed statelessly with their encrypted content.
        include = list(body.get("include") or [])
        if ENCRYPTED_REASONING not in include:
            include.append(ENCRYPTED_REASONING)
        sent["include"] = include
    return sent


async def _stateful(request: web.Request, body: JsonDict) -> web.StreamResponse:
    threads = ThreadService(request.app[STORE], utc_now, cache=request.app[WINDOWS])
    chain = await resolve_chain(request, threads, body)
    raws = body["input"] if isinstance(body.get("input"), list) else []
    taken = await threads.first_taken_id(chain.loaded, raws)
    if taken is not None:
        raise duplicate_item(f"input[{taken}].id", raws[taken]["id"])
    new: Sequence[Item] = (await _input(body)).items
    guard = LedgerGuard(request, api="responses", thread_id=chain.loaded.thread_id, now=utc_now)
    if guard.active:
        custom = custom_tool_names(body.get("tools") or ())
        new = await guard.restore_calls(chain.loaded.items, new, custom)
    orphan = first_orphan(chain.loaded.items, new)
    if orphan is not None:
        raise invalid(
            f"No tool call found for function call output with call_id {orphan}.", param="input"
        )
    turn_items = await guard.answer_dangling(chain.loaded.items, new, unguarded_too=True)
    projection, counter = await _rebuild(request, body, turn_items, chain.loaded)
    await guard.record_outputs([item.raw for item in new])
    turn = ResponseTurn(request, body, threads, chain, turn_items, counter, projection)
    try:
        await turn.begin()
        sent = upstream_body(body, projection.items)
        upstream = await send_upstream(
            request,
            request[TENANT_POLICY],
            path="/responses",
            body=json.dumps(sent, ensure_ascii=False).encode(),
            stream=bool(body.get("stream")),
            route="responses",
        )
        if guard.active:  # SPEC 6: side-effecting calls pass the ledger first
            guarded = Guarded(request, "responses", guard, sent, turn, response_id=turn.id)
            extra = context_headers(projection)
            return await relay_guarded(upstream, guarded, extra_headers=extra)
        return await relay_kept(
            request,
            upstream,
            family="responses",
            extra_headers=context_headers(projection),
            keeper=turn,
        )
    finally:
        await turn.abandon_unless_kept()


class ResponseTurn:
    """One stateful response: recorded before forwarding, kept when it completes
    (relay.Keeper), marked incomplete otherwise."""

    def __init__(
        self,
        request: web.Request,
        body: JsonDict,
        threads: ThreadService,
        chain: Chain,
        new: Sequence[Item],
        counter: TokenCounter,
        projection: Projection,
    ) -> None:
        self.request = request
        self.body = body
        self.threads = threads
        self.chain = chain
        self.new = tuple(new)
        self.counter = counter
        self.projection = projection
        self.tenant = request[NAMESPACE]
        self.id = new_id("resp")
        self.persist = body.get("store") is not False
        self.kept = False
        self._begun: asyncio.Future[None] | None = None

    async def begin(self) -> None:
        """Records the response `in_progress`, shielded: a client that goes away while the
        row is written must not leave it behind unfinished (abandon waits for it)."""
        if not self.persist:
            return
        self._begun = asyncio.ensure_future(self._record_begin())
        await asyncio.shield(self._begun)

    async def _record_begin(self) -> None:
        await self.threads.store.begin_response(
            StoredResponse(
                tenant=self.tenant,
                id=self.id,
                thread_id=self.chain.loaded.thread_id,
                previous_response_id=self.chain.previous_response_id,
                status="in_progress",
                request={k: v for k, v in self.body.items() if k != "input"},
                response=None,
                created_at=utc_now(),
                owner=self.request.app[OWNER],
            )
        )

    def rewrite(self, response: JsonDict) -> JsonDict:
        """The provider's Response as the client sees it: this proxy's id and chain."""
        conversation = self.chain.conversation
        return {
            **response,
            "id": self.id,
            "previous_response_id": self.chain.previous_response_id,
            "conversation": {"id": conversation} if conversation is not None else None,
            "store": self.persist,
        }

    async def keep(self, result: JsonDict, log: Sequence[JsonDict] | None = None) -> None:
        """Commits the turn; `log` replaces the response's output as the thread's items
        when the ledger continued the turn (withheld calls and their synthetic outputs)."""
        if not self.persist:
            self.kept = True
            return
        status = result.get("status") or "completed"
        if status != "completed":
            await self._finish(status, result)
            return
        logged = log if log is not None else result.get("output") or ()
        outputs = [responses_item(raw) for raw in logged]
        items = await off_the_loop(
            lambda: [
                *new_items(self.new, self.counter, role="input", response_id=self.id),
                *new_items(outputs, self.counter, role="output", response_id=self.id),
            ],
            list(logged),
        )
        loaded = self.chain.loaded
        await self.threads.commit(
            loaded,
            items,
            state=loaded.state_after(self.projection.cut),
            restate=self._restate,
            response_id=self.id,
            response=result,
        )
        self.kept = True

    async def _restate(self, fresh: Loaded) -> JsonDict:
        """The state after a lost race: the cut recomputed over the new window."""
        try:
            projection, _ = await _rebuild(self.request, self.body, self.new, fresh, observe=False)
        except ApiError:
            return fresh.state
        return fresh.state_after(projection.cut)

    async def abandon_unless_kept(self) -> None:
        if self._begun is None or self.kept:
            return
        try:
            await asyncio.shield(self._begun)  # the row must exist before it is finished
        except Exception:
            return  # it was never written: nothing to finish
        await self._finish("incomplete", None)

    async def _finish(self, status: str, result: JsonDict | None) -> None:
        finished = self.threads.store.finish_response(
            self.tenant,
            self.id,
            status=status,  # type: ignore[arg-type]
            response=result,
        )
        await asyncio.shield(finished)
        self.kept = True


async def input_tokens(request: web.Request) -> web.StreamResponse:
    body, _ = await read_json_object(request)
    validate_responses(body)
    await resolve_references(request, body)
    if is_stateful(body):
        # The provider does not know our conversations: count what would be sent.
        threads = ThreadService(request.app[STORE], utc_now, cache=request.app[WINDOWS])
        chain = await resolve_chain(request, threads, body)
        items = (await _input(body)).items
        projection, _ = await _rebuild(request, body, items, chain.loaded)
        count = projection.report.prompt_tokens
    else:
        counter = TokenCounter.for_model(budget_model(body))
        tools: list[dict[str, Any]] = list(body.get("tools") or [])
        items = (await _input(body)).items
        instructions = body.get("instructions")
        count = await off_the_loop(
            lambda: counter.responses_prompt(items, instructions, tools), body
        )
    return web.json_response({"object": "response.input_tokens", "input_tokens": count})
