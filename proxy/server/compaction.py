"""OpenAI's compaction, served by the proxy for any provider (SPEC 1; issue 10, item 5).

- `POST /v1/responses/compact`: the conversation (`input` and/or `previous_response_id`,
  both optional)
  becomes OpenAI's `response.compaction` object: the user messages verbatim, then one
  compaction item whose `encrypted_content` is threadkeeper's own sealed summary
  (proxy/core/compaction.py), bound to the tenant.
- the rewriters of a `POST /v1/responses` turn (`rewriters`): a compaction item in the input, or
  in a stored thread, reaches the provider as its summary text (a developer message),
  never as the opaque item; with `context_management: [{"type": "compaction",
  "compact_threshold": N}]` a turn whose input crosses N tokens is compacted before it
  is forwarded and the compaction item leads the response's `output` (streams: its
  `response.output_item.added` / `.done` at output_index 0), as OpenAI does.
- A final `{"type": "compaction_trigger"}` input item (OpenAI: "must be the final input
  item"; elsewhere a 400 naming it) is answered here with a Response whose one output is
  the compaction `responses/compact` makes of the whole history (`compaction_of`); the
  provider gets no request (`serve_compaction_trigger`), and the response is stored
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
import secrets
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

from aiohttp import web

from proxy.clock import Clock
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
from proxy.server.ledger import answer_dangling_calls, refuse_orphans, restore_ledger_calls
from proxy.server.model_budget import budget_counter, learned_for
from proxy.server.modes import last_seq, previous_response
from proxy.server.observe import summarizer_target, summary_job
from proxy.server.state import (
    CLOCK,
    LOG_FIELDS,
    NAMESPACE,
    SETTINGS,
    STORE,
    SUMMARIES,
    TENANT_POLICY,
    THREADS,
)
from proxy.server.summaries import kept_for
from proxy.server.turn import (
    ForItems,
    New,
    Rewriter,
    Turn,
    Window,
    attach_ready_summaries,
    for_calls,
    for_outputs,
    off_the_loop,
)
from proxy.server.validate import (
    TRIGGER,
    ends_with_trigger,
    list_of_objects,
    missing,
    optional,
    read_json_object,
    required_string,
    resolve_references,
    too_long,
    validate_input,
    wrong_type,
)
from proxy.store.base import SecretStore, ThreadStore

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

    async def key(self, store: SecretStore, clock: Clock) -> CompactionKey:
        if self._key is not None:
            return self._key
        async with self._lock:
            if self._key is None:
                self._key = await stored_key(store, clock, create=True)
        assert self._key is not None
        return self._key


COMPACTION_KEY = web.AppKey("compaction_key", KeyRing)


async def stored_key(store: SecretStore, clock: Clock, *, create: bool) -> CompactionKey:
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
    if not request[TENANT_POLICY].compaction.local or not any(
        raw.get("type") == "compaction" for raw in raws
    ):
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
    chunk = (digest, plan.items, SUMMARY_TOKENS, previous)
    # thread_id None: left to the retention
    job = summary_job(request, target, thread_id, RESPONSES.name, counter, chunk, plan.base)
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


def validate_compact(body: JsonDict) -> None:
    """OpenAI's CompactResponseMethodPublicBody: `model` required; `input` a string or
    items; `previous_response_id`, `instructions`, `prompt_cache_key` (<= 64) strings.
    Neither `input` nor `previous_response_id` is a compaction of an empty history."""
    required_string(body, "model")
    validate_input(body)
    optional(body, "previous_response_id", str)
    optional(body, "instructions", str)
    key = optional(body, "prompt_cache_key", str)
    if key is not None and len(key) > PROMPT_CACHE_KEY_CHARS:
        raise too_long("prompt_cache_key", PROMPT_CACHE_KEY_CHARS, len(key))


# -- POST /v1/responses/compact --------------------------------------------------------------


async def compact(request: web.Request) -> web.StreamResponse:
    if not request[TENANT_POLICY].compaction.local:
        return await passthrough.passthrough(request)
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
    """The thread of the chain that `previous_response_id` ends (the one rule,
    modes.previous_response) and every item of it, from the thread's log (the log keeps
    what the live window no longer sends, SPEC 2)."""
    previous = body.get("previous_response_id")
    if previous is None:
        return None, []
    tenant = request[NAMESPACE]
    stored, _ = await previous_response(request.app[THREADS], tenant, previous)
    assert stored.thread_id is not None
    request[LOG_FIELDS]["thread_id"] = stored.thread_id  # its answer is the thread's data
    store: ThreadStore = request.app[STORE]
    rows = await store.items_between(tenant, stored.thread_id, 0, last_seq(stored))
    return stored.thread_id, [RESPONSES.item(row.raw) for row in rows if row.api == RESPONSES.name]


def _usage(input_tokens: int, output_tokens: int) -> JsonDict:
    return {
        "input_tokens": input_tokens,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": input_tokens + output_tokens,
    }


# -- the rewriters of a POST /v1/responses turn (proxy/server/turn.py) ------------------------


def rewriters(threshold: int | None) -> tuple[Rewriter, ...]:
    """A Responses turn's rewriters with local compaction, in order: compaction items
    reach the provider as text, a final `compaction_trigger` makes the answer one
    compaction of the whole history (the provider gets no request), and
    `context_management` compacts a turn that crosses its threshold (before the dangling
    calls are answered). The first two are called only for a turn that holds such an
    item (turn.ForItems): others never enter this module. LOCAL_REWRITERS: the list
    without a threshold."""
    past = (compact_past(threshold),) if threshold is not None else ()
    return (
        ForItems(frozenset({TRIGGER}), serve_compaction_trigger),
        ForItems(frozenset({"compaction"}), expand_compactions),
        for_outputs(restore_ledger_calls),
        for_outputs(refuse_orphans),
        *past,
        for_calls(answer_dangling_calls),
        attach_ready_summaries,
    )


async def serve_compaction_trigger(turn: Turn, window: Window, new: New) -> tuple[Window, New]:
    """The compaction a final trigger asks for: of the thread's whole log (what the
    window no longer sends included, as `responses/compact` reads a chain) and the
    input before the trigger, which is the turn's input as it is kept. It is the answer
    (`New.served`); the trigger itself is neither sent nor kept."""
    if not new.items or new.items[-1].type != TRIGGER:
        return window, new
    request, items = turn.request, new.items[:-1]
    counter = await counter_for(request[TENANT_POLICY], turn.inputs.model)
    known: Sequence[Item] = ()
    if window.loaded is not None:
        known = (await request.app[THREADS].whole(window.loaded)).items
    key, tenant = await request_key(request), request[NAMESPACE]
    made = await compaction_of(request, key, [*known, *items], counter, kept_for(window.loaded))
    instructions = turn.body.get("instructions")
    usage = await off_the_loop(
        lambda: made.usage(key, tenant, counter, instructions), raws(made.items)
    )
    request[LOG_FIELDS]["compaction"] = made.item["id"]
    served = triggered_response(request, turn.body, made.item, usage)
    return window, replace(new, items=items, served=served)


def triggered_response(
    request: web.Request, body: JsonDict, item: JsonDict, usage: JsonDict
) -> JsonDict:
    """The Response a trigger is answered with, shaped as the provider's would be (the
    response keeper gives it this proxy's id and chain)."""
    now = int(request.app[CLOCK].now().timestamp())
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


async def expand_compactions(turn: Turn, window: Window, new: New) -> tuple[Window, New]:
    """Compaction items, in the stored window or the input, become the summary text the
    provider reads (`expand`); `New.summary` is the last one's content."""
    loaded = window.loaded
    has_new = any(item.kind == "compaction" for item in new.items)
    has_kept = loaded is not None and any(i.kind == "compaction" for i in loaded.items)
    if not (has_new or has_kept):
        return window, new
    request = turn.request
    key, tenant = await request_key(request), request[NAMESPACE]
    counter = await counter_for(request[TENANT_POLICY], turn.inputs.model)
    summary = new.summary
    if has_kept and loaded is not None:
        # Only a changed key fails here: stored items were checked when they came in.
        where = "conversation" if turn.body.get("conversation") else "previous_response_id"
        kept = await off_the_loop(
            lambda: expand(key, tenant, loaded.items, counter, where), raws(loaded.items)
        )
        window = replace(window, loaded=_window(loaded, kept.kept, kept.items))
        summary = kept.summary
    if has_new:
        items = new.items
        given = await off_the_loop(
            lambda: expand(key, tenant, items, counter, turn.api.history), raws(items)
        )
        new = replace(new, items=tuple(given.items))
        summary = given.summary or summary
    return window, replace(new, summary=summary)


# A turn's rewriters with local compaction and no `context_management` threshold.
LOCAL_REWRITERS = rewriters(None)


def compact_past(threshold: int) -> Rewriter:
    """`context_management`'s compaction: a turn whose input crosses `threshold` tokens
    is compacted before it is forwarded; the compaction item leads the answer's output
    (`New.compaction`), and the new items it covers are kept as what was sent."""

    async def compact_past_threshold(turn: Turn, window: Window, new: New) -> tuple[Window, New]:
        if new.served is not None:
            return window, new
        request, inputs = turn.request, turn.inputs
        counter = await counter_for(request[TENANT_POLICY], inputs.model)
        known = list(window.items)
        everything = [*known, *new.items]
        # The threshold is in the model's tokens, as input_tokens counts them.
        learned = await learned_for(request, inputs.model)
        budgeted = await budget_counter(request, inputs.model, counter, learned, everything)
        counted = await off_the_loop(
            lambda: budgeted.responses_prompt(everything, inputs.instructions, inputs.tools),
            raws(everything),
        )
        sent_items = len(everything) + (1 if inputs.instructions else 0)
        tokens = provider_count(budgeted, learned, counted, sent_items)
        if tokens <= threshold:
            return window, new
        key = await request_key(request)
        end = current_turn_start(everything)
        made = await compact_items(
            request, key, everything, end, counter, new.summary, kept_for(window.loaded)
        )
        if made is None:
            return window, new
        item, pairs = made
        request[LOG_FIELDS]["compaction"] = item["id"]
        held = len(known)
        if window.loaded is not None and held:
            kept = [(index, x) for index, x in pairs if index < held]
            loaded = _window(window.loaded, [i for i, _ in kept], [x for _, x in kept])
            window = replace(window, loaded=loaded)
        items = tuple(x for index, x in pairs if index >= held)
        return window, replace(new, items=items, compaction=item)

    return compact_past_threshold


def _window(loaded: Any, kept: Sequence[int], items: Sequence[Item]) -> Any:
    """A stored window as the projection reads it: its rows kept in step with `items`
    (positions stay those of the thread's log, so the sticky cut maps back, SPEC 5)."""
    return replace(loaded, stored=tuple(loaded.stored[i] for i in kept), items=tuple(items))


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
