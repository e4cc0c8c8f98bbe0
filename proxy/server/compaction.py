"""OpenAI's compaction, served by the proxy for any provider (SPEC 1; issue 10, item 5).

- `POST /v1/responses/compact`: the conversation (`input` and/or `previous_response_id`,
  both optional)
  becomes OpenAI's `response.compaction` object: the user messages verbatim, then one
  compaction item whose `encrypted_content` is threadkeeper's own sealed summary
  (proxy/core/compaction.py), bound to the tenant.
- `Compactions`, a turn hook of `POST /v1/responses`: a compaction item in the input, or
  in a stored thread, reaches the provider as its summary text (a developer message),
  never as the opaque item; with `context_management: [{"type": "compaction",
  "compact_threshold": N}]` a turn whose input crosses N tokens is compacted before it
  is forwarded and the compaction item leads the response's `output` (streams: its
  `response.output_item.added` / `.done` at output_index 0), as OpenAI does.
- A final `{"type": "compaction_trigger"}` input item (OpenAI: "must be the final input
  item"; elsewhere a 400 naming it) is answered here with a Response whose one output is
  the compaction `responses/compact` makes of the whole history (`compaction_of`); the
  provider gets no request (`Compactions.local_answer`), and the response is stored
  and chained like any other. `responses/compact` of no input at all is 200 too.
- The summary is the tenant's LLM summarizer's when its policy sets `memory.summarizer`
  (`llm_summary`: the app's one summarizer, guarded, stored by the compaction's digest,
  at most `timeout_seconds`), else, and whenever that gives none, the deterministic one.
- `POST /threadkeeper/v1/compactions/open`: an operator reads what a compaction of their
  tenant holds (OpenAI's blobs are opaque); `threadkeeper compaction show` is the CLI.

Policy `compaction.mode: upstream` turns all of this off for a tenant: requests and items
go to the provider untouched (a tenant whose provider is OpenAI itself).

The key is `THREADKEEPER_COMPACTION_KEY` (32 bytes, base64) when set, else the one the
store holds, created at the first start (table server_secrets, first write wins, so
replicas that start together share it).
"""

from __future__ import annotations

import asyncio
import base64
import json
import secrets
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

from aiohttp import web
from multidict import CIMultiDict, CIMultiDictProxy

from proxy.clock import Clock
from proxy.core import fastjson
from proxy.core.compaction import (
    SUMMARY_TOKENS,
    CompactionError,
    CompactionKey,
    Plan,
    compacted_output,
    compaction_summary,
    covers,
    current_turn_start,
    last_compaction,
    plan_compaction,
    render_summary,
    replaced,
    summary_message,
)
from proxy.core.items import Item, JsonDict
from proxy.core.tokens import TokenCounter
from proxy.counting import counter_for, provider_count
from proxy.ids import new_id
from proxy.namespaces import fields
from proxy.server import passthrough
from proxy.server.api import RESPONSES
from proxy.server.errors import ApiError, invalid
from proxy.server.hooks.summaries import kept_for, summarizer_target
from proxy.server.provider_counts import budget_counter
from proxy.server.rebuild import learned_for, off_the_loop
from proxy.server.state import (
    CLOCK,
    LOG_FIELDS,
    NAMESPACE,
    SETTINGS,
    STORE,
    SUMMARIES,
    TENANT_POLICY,
    thread_service,
)
from proxy.server.summaries import Job
from proxy.server.turn import Turn, TurnHook
from proxy.server.validate import (
    list_of_objects,
    missing,
    optional,
    read_json_object,
    required_string,
    too_long,
    wrong_type,
)
from proxy.sse import SSEDecoder, encode_event
from proxy.store.base import Store
from proxy.upstream import UpstreamResponse

SECRET_NAME = "compaction"
CONTEXT_MANAGEMENT = "context_management"
MIN_THRESHOLD = 1000  # OpenAI's ContextManagementParam.compact_threshold minimum
PROMPT_CACHE_KEY_CHARS = 64
OPERATOR_MODEL = "gpt-4o"  # the vocabulary operator views render with (no budget applies)


# -- the key ---------------------------------------------------------------------------------


class KeyRing:
    """The process's compaction key, read once at start: the configured one, else the
    store's (created by the first replica that starts)."""

    def __init__(self, configured: bytes | None) -> None:
        self._key = CompactionKey(configured) if configured is not None else None
        self._lock = asyncio.Lock()

    async def key(self, store: Store, clock: Clock) -> CompactionKey:
        if self._key is not None:
            return self._key
        async with self._lock:
            if self._key is None:
                self._key = await stored_key(store, clock, create=True)
        assert self._key is not None
        return self._key


COMPACTION_KEY = web.AppKey("compaction_key", KeyRing)


async def stored_key(store: Store, clock: Clock, *, create: bool) -> CompactionKey:
    """The store's compaction key; created (insert-if-absent) when `create`, else
    LookupError when there is none."""
    value = await store.secret(SECRET_NAME)
    if value is None:
        if not create:
            raise LookupError("the store holds no compaction key (no proxy has started on it)")
        candidate = base64.b64encode(secrets.token_bytes(32)).decode("ascii")
        value = await store.create_secret(SECRET_NAME, candidate, clock.iso())
    return CompactionKey(base64.b64decode(value))


async def request_key(request: web.Request) -> CompactionKey:
    app = request.app
    return await app[COMPACTION_KEY].key(app[STORE], app[CLOCK])


def is_local(request: web.Request) -> bool:
    return request[TENANT_POLICY].compaction.mode == "local"


# -- opening and expanding -------------------------------------------------------------------


def opened(key: CompactionKey, tenant: str, item: Item, param: str) -> JsonDict:
    """The summary a compaction item seals; OpenAI's 400 naming `param` otherwise."""
    try:
        return key.open(tenant, item.raw.get("encrypted_content"))
    except CompactionError as exc:
        raise invalid(
            f"Invalid '{param}.encrypted_content': {exc}",
            param=f"{param}.encrypted_content",
            code="invalid_encrypted_content",
        ) from None


async def check_stored_compactions(request: web.Request, raws: Sequence[JsonDict]) -> None:
    """Compaction items a conversation is given must open for its tenant: one that does
    not would refuse every later turn of the conversation (400 naming `items[i]`)."""
    if not is_local(request) or not any(raw.get("type") == "compaction" for raw in raws):
        return
    key, tenant = await request_key(request), request[NAMESPACE]
    for index, raw in enumerate(raws):
        if raw.get("type") == "compaction":
            opened(key, tenant, RESPONSES.item(raw), f"items[{index}]")


@dataclass(frozen=True)
class Expanded:
    """Items with their last compaction replaced by its summary text (what it covers
    dropped); `kept` the source index of each item; `summary` that compaction's content."""

    items: list[Item]
    kept: list[int]
    summary: JsonDict | None = None


def expand(
    key: CompactionKey, tenant: str, items: Sequence[Item], counter: TokenCounter, param: str
) -> Expanded:
    """The one place a compaction item becomes what the provider reads. Every compaction
    item is verified (a forged or foreign one is a 400 naming its index); the last one
    stands for everything before it but user messages and instructions (OpenAI's
    compacted output is those messages, then the compaction)."""
    last = last_compaction(items)
    if last is None:
        return Expanded(list(items), list(range(len(items))))
    for index, item in enumerate(items[:last]):
        if item.kind == "compaction":
            opened(key, tenant, item, f"{param}[{index}]")
    summary = opened(key, tenant, items[last], f"{param}[{last}]")
    text = render_summary(summary, counter)
    pairs = replaced(items, last + 1, summary_message(text))
    return Expanded([item for _, item in pairs], [index for index, _ in pairs], summary)


async def compact_items(
    request: web.Request,
    key: CompactionKey,
    items: Sequence[Item],
    end: int,
    counter: TokenCounter,
    previous: JsonDict | None,
    thread_id: str | None = None,
) -> tuple[JsonDict, list[tuple[int, Item]]] | None:
    """A compaction of what precedes `end` (after `previous`, the compaction those items
    follow): the compaction item, and `items` with its summary in place of what it covers.
    None when nothing there can be compacted. The summary is the tenant's LLM
    summarizer's when its policy sets one and it gives one (`llm_summary`, kept for
    `thread_id`: deleted with that stored thread), else the deterministic one."""
    read = raws(items)
    plan = await off_the_loop(lambda: plan_compaction(items, end, counter, previous), read)
    if plan is None:
        return None
    written = await llm_summary(request, plan, counter, thread_id)
    tenant = request[NAMESPACE]

    def seal() -> tuple[JsonDict, list[tuple[int, Item]]]:
        summary = plan.summary(written)
        text = render_summary(summary, counter)
        return key.item(tenant, summary), replaced(items, end, summary_message(text))

    return await off_the_loop(seal, read)


async def llm_summary(
    request: web.Request, plan: Plan, counter: TokenCounter, thread_id: str | None = None
) -> JsonDict | None:
    """The state the tenant's summarizer model writes of `plan`, checked and guarded
    (proxy/core/llm_summary.py: what the plan's items do not bear out is only the
    summarizer's notes, every must-keep string the model left out is appended),
    for `Plan.summary` to seal. The same plan (items, the state they
    follow, the model) is read back from the store, so it is paid for once and seals to
    the same bytes and id. None without a summarizer, or when it gives none (an error, a
    timeout, an unparseable answer, must-keep strings that do not fit, a plan that failed
    lately): the deterministic summary stands. Waits at most the call's timeout_seconds,
    the SDK's retries and reading the answer (off the loop) included."""
    policy = request[TENANT_POLICY]
    settings = policy.memory.summarizer
    background = request.app.get(SUMMARIES)
    if settings is None or background is None or not plan.items:
        return None
    try:
        target = summarizer_target(request, policy)
    except ApiError:  # no provider key: the summary is the deterministic one
        return None

    def prepare() -> tuple[Item | None, str]:
        return plan.previous_item(counter), plan.digest(SUMMARY_TOKENS)

    previous, digest = await asyncio.to_thread(prepare) if plan.base is not None else prepare()
    job = Job(
        namespace=request[NAMESPACE],
        thread_id=thread_id,  # None: left to the retention
        policy=policy,
        target=target,
        api=RESPONSES.name,
        digest=digest,
        items=plan.items,
        max_tokens=SUMMARY_TOKENS,
        previous=previous,
        counter=counter,
        base=plan.base,
    )
    stored = await background.now(job)
    return stored.state if stored is not None else None


def raws(items: Sequence[Item]) -> list[JsonDict]:
    """What off_the_loop measures: the items' JSON (an Item is not walked)."""
    return [item.raw for item in items]


# -- validation --------------------------------------------------------------------------------


def compaction_threshold(body: JsonDict) -> int | None:
    """`context_management` checked against OpenAI's ContextManagementParam (an array of
    at least one {type, compact_threshold >= 1000 or null}; only type "compaction" is
    supported); the compaction's threshold, or None (null: the proxy's own budget
    decides, SPEC 5)."""
    value = body.get(CONTEXT_MANAGEMENT)
    if value is None:
        return None
    entries = list_of_objects(value, CONTEXT_MANAGEMENT)
    if not entries:
        raise invalid(
            f"Invalid '{CONTEXT_MANAGEMENT}': empty array. Expected an array with minimum "
            "length 1, but got an empty array instead.",
            param=CONTEXT_MANAGEMENT,
            code="empty_array",
        )
    threshold = None
    for index, entry in enumerate(entries):
        param = f"{CONTEXT_MANAGEMENT}[{index}]"
        kind = entry.get("type")
        if kind is None:
            raise missing(f"{param}.type")
        if not isinstance(kind, str):
            raise wrong_type(f"{param}.type", "a string", kind)
        if kind != "compaction":
            raise invalid(
                f"Invalid value: '{kind}'. Supported values are: 'compaction'.",
                param=f"{param}.type",
                code="invalid_value",
            )
        given = optional(entry, "compact_threshold", int, f"{param}.compact_threshold")
        if given is not None and given < MIN_THRESHOLD:
            raise invalid(
                f"Invalid '{param}.compact_threshold': integer below minimum value. Expected "
                f"a value >= {MIN_THRESHOLD}, but got {given} instead.",
                param=f"{param}.compact_threshold",
                code="integer_below_min_value",
            )
        if given is not None:
            threshold = given if threshold is None else min(threshold, given)
    return threshold


TRIGGER = "compaction_trigger"


def ends_with_trigger(body: JsonDict) -> bool:
    """Whether `input` ends with a compaction_trigger item; one anywhere else is OpenAI's
    400 naming it (CompactionTriggerItemParam: "Must be the final input item")."""
    given = body.get("input")
    if not isinstance(given, list):
        return False
    last = len(given) - 1
    for index, item in enumerate(given):
        if isinstance(item, dict) and item.get("type") == TRIGGER and index != last:
            raise invalid(
                f"Invalid 'input[{index}]': a compaction_trigger item must be the final "
                "input item.",
                param=f"input[{index}]",
                code="invalid_value",
            )
    return last >= 0 and isinstance(given[last], dict) and given[last].get("type") == TRIGGER


def validate_compact(body: JsonDict) -> None:
    """OpenAI's CompactResponseMethodPublicBody: `model` required; `input` a string or
    items; `previous_response_id`, `instructions`, `prompt_cache_key` (<= 64) strings.
    Neither `input` nor `previous_response_id` is a compaction of an empty history."""
    from proxy.server.responses import validate_input  # responses imports this module

    required_string(body, "model")
    validate_input(body)
    optional(body, "previous_response_id", str)
    optional(body, "instructions", str)
    key = optional(body, "prompt_cache_key", str)
    if key is not None and len(key) > PROMPT_CACHE_KEY_CHARS:
        raise too_long("prompt_cache_key", PROMPT_CACHE_KEY_CHARS, len(key))


# -- POST /v1/responses/compact --------------------------------------------------------------


async def compact(request: web.Request) -> web.StreamResponse:
    if not is_local(request):
        return await passthrough.passthrough(request)
    from proxy.server.responses import resolve_references  # responses imports this module

    body, _ = await read_json_object(request)
    validate_compact(body)
    await resolve_references(request, body)
    counter = await counter_for(request[TENANT_POLICY], body["model"])
    thread_id, previous_items = await _previous_items(request, body)
    history = [*previous_items, *_input_items(body)]
    key = await request_key(request)
    made = await compaction_of(request, key, history, counter, thread_id)

    def answer() -> JsonDict:
        return {
            "id": new_id("resp"),
            "object": "response.compaction",
            "created_at": int(request.app[CLOCK].now().timestamp()),
            "output": compacted_output(made.items, made.item),
            "usage": made.usage(key, request[NAMESPACE], counter, body.get("instructions")),
        }

    return web.json_response(await off_the_loop(answer, raws(made.items)))


@dataclass(frozen=True)
class Compacted:
    """A whole history compacted: its items as the provider reads them (compaction items
    expanded) and the one compaction item that stands for them."""

    items: list[Item]
    item: JsonDict

    def usage(
        self, key: CompactionKey, tenant: str, counter: TokenCounter, instructions: Any
    ) -> JsonDict:
        """OpenAI's usage of a compaction: the history read, the summary written."""
        summary = key.open(tenant, self.item["encrypted_content"])
        input_tokens = counter.responses_prompt(self.items, instructions, ())
        return _usage(input_tokens, counter.text(render_summary(summary, counter)))


async def compaction_of(
    request: web.Request,
    key: CompactionKey,
    history: Sequence[Item],
    counter: TokenCounter,
    thread_id: str | None,
) -> Compacted:
    """The compaction of all of `history` (`responses/compact` and a `compaction_trigger`
    alike). A history of nothing but user messages, or of nothing at all, still gets its
    compaction item: an empty summary stands for it (OpenAI answers 200 there too)."""
    tenant = request[NAMESPACE]
    read = raws(history)
    given = await off_the_loop(lambda: expand(key, tenant, history, counter, "input"), read)
    items = given.items
    made = await compact_items(request, key, items, len(items), counter, given.summary, thread_id)
    if made is not None:
        return Compacted(items, made[0])
    empty = await off_the_loop(
        lambda: key.item(tenant, compaction_summary([], given.summary)), read
    )
    return Compacted(items, empty)


def _input_items(body: JsonDict) -> list[Item]:
    """The input's items; a final compaction_trigger asks for what this compacts anyway."""
    given = body.get("input")
    items = RESPONSES.items(given) if given is not None else []
    return items[:-1] if ends_with_trigger(body) else items


async def _previous_items(request: web.Request, body: JsonDict) -> tuple[str | None, list[Item]]:
    """The thread of the chain that `previous_response_id` ends and every item of it, from
    the thread's log (the log keeps what the live window no longer sends, SPEC 2)."""
    previous = body.get("previous_response_id")
    if previous is None:
        return None, []
    store, tenant = request.app[STORE], request[NAMESPACE]
    stored = await store.get_response(tenant, previous)
    if (
        stored is None
        or stored.status != "completed"
        or stored.thread_id is None
        or stored.output_last_seq is None
    ):
        raise ApiError(
            400,
            f"Previous response with id '{previous}' not found.",
            param="previous_response_id",
            code="previous_response_not_found",
        )
    request[LOG_FIELDS]["thread_id"] = stored.thread_id  # its answer is the thread's data
    rows = await store.items_between(tenant, stored.thread_id, 0, stored.output_last_seq)
    return stored.thread_id, [RESPONSES.item(row.raw) for row in rows if row.api == "responses"]


def _usage(input_tokens: int, output_tokens: int) -> JsonDict:
    return {
        "input_tokens": input_tokens,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": input_tokens + output_tokens,
    }


# -- the turn hook of POST /v1/responses -----------------------------------------------------


class Compactions(TurnHook):
    """Compaction items reach the provider as text; `context_management` compacts a turn
    that crosses its threshold; a final `compaction_trigger` item makes the answer one
    compaction of the whole history, served here (the provider gets no request). Runs
    before the other hooks' `restore` (ledger)."""

    def __init__(self, request: web.Request, threshold: int | None) -> None:
        self.request = request
        self.threshold = threshold
        self.tenant = request[NAMESPACE]
        self.summary: JsonDict | None = None  # the last compaction the turn's items hold
        self.item: JsonDict | None = None  # the compaction this turn made (output[0])
        self.triggered: JsonDict | None = None  # the Response a compaction_trigger gets

    async def restore(self, turn: Turn) -> None:
        if turn.new and turn.new[-1].type == TRIGGER:
            await self._triggered(turn)
        if CONTEXT_MANAGEMENT in turn.body:
            turn.rewritten = True  # the provider does not get context_management
        loaded = turn.loaded
        has_new = any(item.kind == "compaction" for item in turn.new)
        has_kept = loaded is not None and any(i.kind == "compaction" for i in loaded.items)
        if not (has_new or has_kept):
            return
        key = await request_key(self.request)
        counter = await counter_for(
            self.request[TENANT_POLICY], turn.api.budget_inputs(turn.body).model
        )
        if has_kept and loaded is not None:
            # Only a changed key fails here: stored items were checked when they came in.
            where = "conversation" if turn.body.get("conversation") else "previous_response_id"
            window = await off_the_loop(
                lambda: expand(key, self.tenant, loaded.items, counter, where), raws(loaded.items)
            )
            turn.loaded = _window(loaded, window.kept, window.items)
            self.summary = window.summary
        if has_new:
            given = await off_the_loop(
                lambda: expand(key, self.tenant, turn.new, counter, turn.api.history),
                raws(turn.new),
            )
            turn.new, turn.given, turn.rewritten = given.items, len(given.items), True
            self.summary = given.summary or self.summary

    async def _triggered(self, turn: Turn) -> None:
        """The compaction a final trigger asks for: of the thread's whole log (what the
        window no longer sends included, as `responses/compact` reads a chain) and the
        input before the trigger, which is the turn's input as it is kept."""
        turn.new, turn.rewritten = turn.new[:-1], True
        turn.given = len(turn.new)
        model = turn.api.budget_inputs(turn.body).model
        counter = await counter_for(self.request[TENANT_POLICY], model)
        known: Sequence[Item] = ()
        if turn.loaded is not None:
            known = (await thread_service(self.request.app).whole(turn.loaded)).items
        key = await request_key(self.request)
        made = await compaction_of(self.request, key, [*known, *turn.new], counter, kept_for(turn))
        instructions = turn.body.get("instructions")
        usage = await off_the_loop(
            lambda: made.usage(key, self.tenant, counter, instructions), raws(made.items)
        )
        self.triggered = self._response(turn.body, made.item, usage)
        self.request[LOG_FIELDS]["compaction"] = made.item["id"]

    def local_answer(self, turn: Turn) -> UpstreamResponse | None:
        if self.triggered is None:
            return None
        stream = bool(turn.body.get("stream"))
        return LocalAnswer(self.triggered, stream)  # type: ignore[return-value]

    def _response(self, body: JsonDict, item: JsonDict, usage: JsonDict) -> JsonDict:
        """The Response a trigger is answered with, shaped as the provider's would be (the
        response keeper gives it this proxy's id and chain)."""
        now = int(self.request.app[CLOCK].now().timestamp())
        return {
            "id": new_id("resp"),
            "object": "response",
            "created_at": now,
            "completed_at": now,
            "status": "completed",
            "background": False,
            "error": None,
            "incomplete_details": None,
            "instructions": body.get("instructions"),
            "max_output_tokens": body.get("max_output_tokens"),
            "metadata": body.get("metadata") or {},
            "model": body.get("model"),
            "output": [item],
            "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "temperature": body.get("temperature"),
            "tool_choice": body.get("tool_choice", "auto"),
            "tools": body.get("tools") or [],
            "top_p": body.get("top_p"),
            "usage": usage,
        }

    async def close_calls(self, turn: Turn) -> None:
        if self.threshold is None or self.triggered is not None:
            return
        inputs = turn.api.budget_inputs(turn.body)
        counter = await counter_for(self.request[TENANT_POLICY], inputs.model)
        known, new = list(turn.known), turn.new
        everything = [*known, *new]
        read = raws(everything)
        # The threshold is in the model's tokens, as input_tokens counts them.
        learned = await learned_for(self.request, inputs.model)
        budgeted = await budget_counter(self.request, inputs.model, counter, learned, everything)
        counted = await off_the_loop(
            lambda: budgeted.responses_prompt(everything, inputs.instructions, inputs.tools), read
        )
        items = len(everything) + (1 if inputs.instructions else 0)
        tokens = provider_count(budgeted, learned, counted, items)
        if tokens <= self.threshold:
            return
        key = await request_key(self.request)
        end = current_turn_start(everything)
        made = await compact_items(
            self.request, key, everything, end, counter, self.summary, kept_for(turn)
        )
        if made is None:
            return
        self.item, pairs = made
        self.request[LOG_FIELDS]["compaction"] = self.item["id"]
        turn.rewritten = True
        held = len(known)
        if turn.loaded is not None and held:
            window = [(index, item) for index, item in pairs if index < held]
            turn.loaded = _window(turn.loaded, [i for i, _ in window], [x for _, x in window])
        # New items it covers are committed as what was sent: the summary, not them.
        turn.new = [item for index, item in pairs if index >= held]
        turn.given = len(turn.new)

    def upstream_body(self, turn: Turn, body: JsonDict) -> JsonDict:
        body.pop(CONTEXT_MANAGEMENT, None)
        return body

    def upstream_response(self, turn: Turn, upstream: UpstreamResponse) -> UpstreamResponse:
        if self.item is None:
            return upstream
        return WithCompaction(upstream, self.item)  # type: ignore[return-value]


def _window(loaded: Any, kept: Sequence[int], items: Sequence[Item]) -> Any:
    """A stored window as the projection reads it: its rows kept in step with `items`
    (positions stay those of the thread's log, so the sticky cut maps back, SPEC 5)."""
    return replace(loaded, stored=tuple(loaded.stored[i] for i in kept), items=tuple(items))


# -- the compaction item in the answer -------------------------------------------------------


LEADING_EVENTS = frozenset({"response.created", "response.in_progress", "response.queued"})


class WithCompaction:
    """The provider's answer with the turn's compaction item first in its `output`, as
    OpenAI returns it; a stream gets the item's output_item.added and .done events before
    the provider's first output event, and the provider's output indexes and sequence
    numbers move up to make room. Everything else is the provider's answer."""

    def __init__(self, upstream: UpstreamResponse, item: JsonDict) -> None:
        self._upstream = upstream
        self._item = item
        self._sent = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._upstream, name)

    async def aread(self) -> bytes:
        body = await self._upstream.aread()
        if self._upstream.status >= 400:
            return body
        try:
            answer = json.loads(body)
        except ValueError:
            return body  # the relay reports the provider's malformed answer
        if isinstance(answer, dict) and isinstance(answer.get("output"), list):
            answer["output"] = [self._item, *answer["output"]]
            return fastjson.dumps(answer)
        return body

    async def aiter_bytes(self) -> AsyncIterator[bytes]:
        decoder = SSEDecoder()
        async for chunk in self._upstream.aiter_bytes():
            frames = [self._frames(event.event, event.data) for event in decoder.feed(chunk)]
            yield b"".join(frame for group in frames for frame in group)
        for event in decoder.flush():
            yield b"".join(self._frames(event.event, event.data))

    def _frames(self, name: str | None, data: str) -> list[bytes]:
        try:
            payload = json.loads(data)
        except ValueError:
            return [encode_event(data, event=name)]
        if not isinstance(payload, dict):
            return [encode_event(data, event=name)]
        kind = payload.get("type", name)
        out = []
        if not self._sent and kind not in LEADING_EVENTS:
            out.extend(self._item_events(payload.get("sequence_number")))
            self._sent = True
        out.append(encode_event(fastjson.dumps(self._moved(payload)).decode(), event=name))
        return out

    def _item_events(self, sequence: Any) -> list[bytes]:
        events = []
        for offset, kind in enumerate(("response.output_item.added", "response.output_item.done")):
            event: JsonDict = {"type": kind, "output_index": 0, "item": self._item}
            if isinstance(sequence, int):
                event["sequence_number"] = sequence + offset
            events.append(encode_event(fastjson.dumps(event).decode(), event=kind))
        return events

    def _moved(self, payload: JsonDict) -> JsonDict:
        if not self._sent:
            return payload
        moved = dict(payload)
        if isinstance(moved.get("output_index"), int):
            moved["output_index"] += 1
        if isinstance(moved.get("sequence_number"), int):
            moved["sequence_number"] += 2
        response = moved.get("response")
        if isinstance(response, dict) and isinstance(response.get("output"), list):
            moved["response"] = {**response, "output": [self._item, *response["output"]]}
        return moved


class LocalAnswer:
    """A Response served by the proxy, read by the turn as the provider's answer would be
    (relay, keeper, usage): whole, or as OpenAI's event stream of it."""

    status = 200
    attempts = 1
    retries = 0

    def __init__(self, response: JsonDict, stream: bool) -> None:
        self._response = response
        self.is_event_stream = stream
        kind = "text/event-stream" if stream else "application/json"
        self.headers = [("Content-Type", kind)]
        self.provider_headers = CIMultiDictProxy(CIMultiDict(self.headers))
        self.closed = False

    async def aread(self) -> bytes:
        return fastjson.dumps(self._response)

    async def aiter_bytes(self) -> AsyncIterator[bytes]:
        for event in response_events(self._response):
            yield encode_event(fastjson.dumps(event).decode(), event=event["type"])

    async def aclose(self) -> None:
        self.closed = True


def response_events(response: JsonDict) -> list[JsonDict]:
    """OpenAI's event sequence for a completed Response whose items come whole (no
    deltas): created, in_progress, each item's added and done, completed."""
    started = {**response, "status": "in_progress", "output": [], "usage": None}
    events: list[JsonDict] = [
        {"type": "response.created", "response": started},
        {"type": "response.in_progress", "response": started},
    ]
    for index, item in enumerate(response["output"]):
        for kind in ("response.output_item.added", "response.output_item.done"):
            events.append({"type": kind, "output_index": index, "item": item})
    events.append({"type": "response.completed", "response": response})
    return [{**event, "sequence_number": n} for n, event in enumerate(events)]


# -- operators ---------------------------------------------------------------------------------


SHOWN_TOKENS = 1 << 30  # an operator reads the whole state, not a budgeted excerpt


def shown(key: CompactionKey, tenant: str, summary: JsonDict) -> JsonDict:
    """What an operator reads of one compaction (CLI and endpoint alike): the structured
    summary and its whole text."""
    counter = TokenCounter.for_model(OPERATOR_MODEL)
    return {
        "object": "threadkeeper.compaction",
        "id": key.item_id(tenant, summary),
        **fields(tenant),
        "covers": covers(summary),
        "summary": summary,
        "text": render_summary(summary, counter, SHOWN_TOKENS),
    }


async def open_for_operator(request: web.Request) -> web.Response:
    """POST /threadkeeper/v1/compactions/open {"encrypted_content": "..."}: the decrypted
    summary, for the tenant that owns it (the caller's); another tenant's is a 400."""
    body, _ = await read_json_object(request)
    blob = body.get("encrypted_content")
    if blob is None:
        raise missing("encrypted_content")
    if not isinstance(blob, str):
        raise wrong_type("encrypted_content", "a string", blob)
    key, tenant = await request_key(request), request[NAMESPACE]
    try:
        summary = key.open(tenant, blob)
    except CompactionError as exc:
        raise invalid(
            f"Invalid 'encrypted_content': {exc}",
            param="encrypted_content",
            code="invalid_encrypted_content",
        ) from None
    await counter_for(None, OPERATOR_MODEL)  # its vocabulary loads off the loop
    return web.json_response(await off_the_loop(lambda: shown(key, tenant, summary), summary))


async def _key_ctx(app: web.Application) -> AsyncIterator[None]:
    """The key is read (or created) at start, after the store opens: a request never
    writes it, so a refused one leaves the store as it was."""
    await app[COMPACTION_KEY].key(app[STORE], app[CLOCK])
    yield


def add_routes(app: web.Application) -> None:
    """Register before the `/v1/{tail}` passthrough, or these paths would be forwarded;
    after the store's cleanup_ctx, which the key's reads."""
    app[COMPACTION_KEY] = KeyRing(app[SETTINGS].compaction_key)
    app.cleanup_ctx.append(_key_ctx)
    app.router.add_post("/v1/responses/compact", compact, name="responses.compact")
    app.router.add_post(
        "/threadkeeper/v1/compactions/open", open_for_operator, name="compactions.open"
    )
