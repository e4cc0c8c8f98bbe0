"""The Conversations API served from the local store, plus forks (SPEC sections 1 and 7).

A conversation is a thread of kind "conversation"; its items are the thread's event log.
Every item is stored exactly as the client sent it (the raw JSON is the source of truth)
with its id and token count beside it; what the API returns is a view of that raw item in
OpenAI's shape, built on the way out and never written back.

Routes (all tenant-scoped: another tenant's conversation is a 404):
    POST   /v1/conversations
    GET    /v1/conversations/{conversation_id}            POST (metadata), DELETE
    GET    /v1/conversations/{conversation_id}/items      POST (append 1..20 items)
    GET    /v1/conversations/{conversation_id}/items/{item_id}    DELETE
    POST   /threadkeeper/v1/conversations/{conversation_id}/fork  {"item_id"?: "..."}

Reading items honours `include` (the spec's IncludeEnum): data OpenAI returns only on
request is left out of the view otherwise (`included`).

Bad input is a 400 raised before any write, so it changes nothing in the store.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

from aiohttp import web

from proxy.core.items import Item, responses_item
from proxy.core.tokens import TokenCounter
from proxy.core.validate import metadata_param, validate_stored_item
from proxy.ids import item_id_for, new_id
from proxy.operations import NoForkPoint, ThreadGone, fork_id_for, fork_thread
from proxy.server.api import RESPONSES
from proxy.server.compaction import check_stored_compactions
from proxy.server.errors import ApiError, invalid
from proxy.server.explain import EXPLAIN
from proxy.server.pagination import page_params
from proxy.server.state import CLOCK, LOG_FIELDS, NAMESPACE, STORE, SUMMARIES, THREADS
from proxy.server.validate import (
    JsonDict,
    duplicate_item,
    list_of_objects,
    missing,
    no_repeated_ids,
    read_json_object,
    unsupported_value,
    wrong_type,
)
from proxy.store.base import AlreadyExists, NewItem, NotFound, StoredItem, Thread
from proxy.threads import Loaded, first_orphan, stored_item_view

MAX_ITEMS_PER_REQUEST = 20  # OpenAI: "You may add up to 20 items at a time."
# Items are counted once at write time with this model's encoding, so rebuilds never
# re-tokenize (SPEC section 4); a request for another encoding recounts what it needs.
COUNTING_MODEL = "gpt-4o"


def add_routes(app: web.Application) -> None:
    """Register before the `/v1/{tail}` passthrough, or these paths would be forwarded."""
    conv = "/v1/conversations/{conversation_id}"
    router = app.router
    router.add_post("/v1/conversations", create_conversation, name="conversations.create")
    router.add_get(conv, retrieve_conversation, name="conversations.retrieve")
    router.add_post(conv, update_conversation, name="conversations.update")
    router.add_delete(conv, delete_conversation, name="conversations.delete")
    router.add_get(f"{conv}/items", list_items, name="conversations.items.list")
    router.add_post(f"{conv}/items", create_items, name="conversations.items.create")
    router.add_get(f"{conv}/items/{{item_id}}", retrieve_item, name="conversations.items.retrieve")
    router.add_delete(f"{conv}/items/{{item_id}}", delete_item, name="conversations.items.delete")
    router.add_post(
        "/threadkeeper/v1/conversations/{conversation_id}/fork",
        fork_conversation,
        name="conversations.fork",
    )


# --- handlers ---------------------------------------------------------------------------


async def create_conversation(request: web.Request) -> web.Response:
    body, _ = await read_json_object(request)
    metadata = metadata_param(body.get("metadata"))
    raws = items_param(body.get("items"), required=False)
    check_outputs_answer_calls((), raws)
    await check_stored_compactions(request, raws)
    thread_id = new_id("conv")
    await check_ids_free(request, Loaded(tenant_of(request), thread_id, "conversation", None), raws)
    request[LOG_FIELDS]["conversation_id"] = thread_id
    thread = await request.app[STORE].create_thread(
        tenant_of(request),
        thread_id,
        kind="conversation",
        metadata=metadata,
        items=items_to_add(raws),
        now=request.app[CLOCK].iso(),
    )
    return web.json_response(conversation_object(thread))


async def retrieve_conversation(request: web.Request) -> web.Response:
    return web.json_response(conversation_object(await conversation(request)))


async def update_conversation(request: web.Request) -> web.Response:
    body, _ = await read_json_object(request)
    if "metadata" not in body:
        raise missing("metadata")
    metadata = metadata_param(body["metadata"])
    thread = await conversation(request)
    updated = await request.app[STORE].update_metadata(thread.tenant, thread.id, metadata)
    if updated is None:
        raise conversation_not_found(thread.id)
    return web.json_response(conversation_object(updated))


async def delete_conversation(request: web.Request) -> web.Response:
    thread = await conversation(request)
    if not await request.app[STORE].delete_thread(thread.tenant, thread.id):
        raise conversation_not_found(thread.id)
    forget_thread(request, thread.tenant, thread.id)
    return web.json_response({"id": thread.id, "object": "conversation.deleted", "deleted": True})


def forget_thread(request: web.Request, tenant: str, thread_id: str) -> None:
    """The store deleted what quoted the thread (or an item of it): the LLM summaries
    only it kept and its explain records. This process's memory of them goes too: the
    tenant's summaries (the others refill from the store) and the thread's queued
    records."""
    background = request.app.get(SUMMARIES)
    if background is not None:
        background.forget(request[NAMESPACE])
    recorder = request.app.get(EXPLAIN)
    if recorder is not None:
        recorder.forget_thread(tenant, thread_id)


async def list_items(request: web.Request) -> web.Response:
    params = page_params(request.query)
    include = include_param(request)
    thread = await conversation(request)
    try:
        page = await request.app[STORE].list_items(
            thread.tenant, thread.id, after=params.after, limit=params.limit, order=params.order
        )
    except NotFound:
        raise item_not_found(params.after or "", param="after") from None
    data = [included(item_object(i), include) for i in page.items]
    return web.json_response(item_list(data, page.has_more))


async def create_items(request: web.Request) -> web.Response:
    body, _ = await read_json_object(request)
    raws = items_param(body.get("items"), required=True)
    thread = await conversation(request)
    store = request.app[STORE]
    history = await all_items(request, thread) if needs_history(raws) else ()
    check_outputs_answer_calls([stored_item_view(i) for i in history], raws)
    await check_stored_compactions(request, raws)
    await check_ids_free(request, Loaded(thread.tenant, thread.id, thread.kind, thread), raws)
    items = items_to_add(raws)
    try:
        await store.append_items(thread.tenant, thread.id, items, now=request.app[CLOCK].iso())
    except NotFound:
        raise conversation_not_found(thread.id) from None
    except AlreadyExists:
        raise invalid("An item with one of these ids already exists.", param="items") from None
    return web.json_response(item_list([created_item_object(i) for i in items], False))


async def retrieve_item(request: web.Request) -> web.Response:
    include = include_param(request)
    thread = await conversation(request)
    item_id = request.match_info["item_id"]
    stored = await request.app[STORE].get_item(thread.tenant, thread.id, item_id)
    if stored is None:
        raise item_not_found(item_id)
    return web.json_response(included(item_object(stored), include))


async def delete_item(request: web.Request) -> web.Response:
    thread = await conversation(request)
    item_id = request.match_info["item_id"]
    store = request.app[STORE]
    if not await store.delete_item(thread.tenant, thread.id, item_id):
        raise item_not_found(item_id)
    forget_thread(request, thread.tenant, thread.id)
    after = await store.get_thread(thread.tenant, thread.id)
    return web.json_response(conversation_object(after or thread))


async def fork_conversation(request: web.Request) -> web.Response:
    """Extension (SPEC section 7): a new conversation holding copies of the source's items
    up to and including `item_id` (the whole log when omitted)."""
    body = await optional_json_object(request)
    item_id = body.get("item_id")
    if item_id is not None and not isinstance(item_id, str):
        raise wrong_type("item_id", "a string", item_id)
    thread = await conversation(request)
    fork_id = fork_id_for(thread)
    request[LOG_FIELDS]["conversation_id"] = fork_id
    try:
        fork = await fork_thread(
            request.app[STORE],
            thread,
            item_id or None,
            now=request.app[CLOCK].iso(),
            fork_id=fork_id,
        )
    except NoForkPoint as exc:
        raise item_not_found(exc.at_item, param="item_id") from None
    except ThreadGone:
        raise conversation_not_found(thread.id) from None
    return web.json_response(conversation_object(fork))


# --- lookups ----------------------------------------------------------------------------


def tenant_of(request: web.Request) -> str:
    return request[NAMESPACE]


async def conversation(request: web.Request) -> Thread:
    """The path's conversation for this tenant; any other thread kind is not one (404)."""
    thread_id = request.match_info["conversation_id"]
    request[LOG_FIELDS]["conversation_id"] = thread_id
    thread = await request.app[STORE].get_thread(tenant_of(request), thread_id)
    if thread is None or thread.kind != "conversation":
        raise conversation_not_found(thread_id)
    return thread


async def all_items(request: web.Request, thread: Thread) -> tuple[StoredItem, ...]:
    """The whole log, not just the live window: a call trimmed from the window still
    pairs with a late output."""
    if thread.next_seq == 0:
        return ()
    return await request.app[STORE].items_between(thread.tenant, thread.id, 0, thread.next_seq - 1)


def conversation_not_found(thread_id: str) -> ApiError:
    return ApiError(404, f"Conversation with id '{thread_id}' not found.")


def item_not_found(item_id: str, param: str | None = None) -> ApiError:
    return ApiError(404, f"Item with id '{item_id}' not found.", param=param)


async def optional_json_object(request: web.Request) -> JsonDict:
    """The fork body may be absent: no body means fork the whole conversation."""
    if not (await request.read()).strip():
        return {}
    body, _ = await read_json_object(request)
    return body


# --- input checks -----------------------------------------------------------------------


def items_param(value: Any, *, required: bool) -> list[JsonDict]:
    if value is None and not required:
        return []
    if value is None:
        raise missing("items")
    raws = list_of_objects(value, "items")
    if not raws and required:
        raise invalid(
            "Invalid 'items': empty array. Expected an array with minimum length 1, but got an "
            "empty array instead.",
            param="items",
            code="empty_array",
        )
    if len(raws) > MAX_ITEMS_PER_REQUEST:
        raise invalid(
            f"Invalid 'items': array too long. Expected an array with maximum length "
            f"{MAX_ITEMS_PER_REQUEST}, but got an array with length {len(raws)} instead.",
            param="items",
            code="array_above_max_length",
        )
    for index, raw in enumerate(raws):
        validate_stored_item(raw, f"items[{index}]")
    no_repeated_ids(raws, "items")
    return raws


def needs_history(raws: Sequence[JsonDict]) -> bool:
    """Only an output whose call is not in the request itself needs the stored log."""
    views = [responses_item(raw) for raw in raws]
    own_calls = {call_id for view in views for call_id in view.call_ids}
    return any(v.output_for is not None and v.output_for not in own_calls for v in views)


def check_outputs_answer_calls(known: Iterable[Item], raws: Sequence[JsonDict]) -> None:
    """An output must answer a call already in the conversation or earlier in the request
    (SPEC section 6: an output for an unknown call id is a 400; threads.first_orphan, the
    one rule a turn applies too)."""
    orphan = first_orphan(known, [responses_item(raw) for raw in raws])
    if orphan is not None:
        raise invalid(RESPONSES.orphan_message(orphan), param="items")


async def check_ids_free(request: web.Request, loaded: Loaded, raws: Sequence[JsonDict]) -> None:
    """Client-chosen ids must be new to the conversation and to the request."""
    threads = request.app[THREADS]
    taken = await threads.first_taken_id(loaded, raws)
    if taken is not None:
        raise duplicate_item(f"items[{taken}].id", raws[taken]["id"])


# --- writes -----------------------------------------------------------------------------


def items_to_add(raws: Sequence[JsonDict]) -> list[NewItem]:
    """Items to store as sent, with their ids and token counts (counted once, here)."""
    counter = TokenCounter.for_model(COUNTING_MODEL)
    views = [responses_item(raw) for raw in raws]
    return [
        NewItem(
            item_id=item_id_for(view.raw),
            raw=view.raw,
            api="responses",
            tokens=counter.item(view),
            encoding=counter.tokenizer_id,
            digest=view.digest,
        )
        for view in views
    ]


# --- views (OpenAI shapes) --------------------------------------------------------------


def conversation_object(thread: Thread) -> JsonDict:
    return {
        "id": thread.id,
        "object": "conversation",
        "created_at": unix_seconds(thread.created_at),
        "metadata": dict(thread.metadata),
    }


def unix_seconds(timestamp: str) -> int:
    moment = datetime.fromisoformat(timestamp)
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return int(moment.timestamp())


def item_list(data: list[JsonDict], has_more: bool) -> JsonDict:
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": has_more,
    }


def item_object(stored: StoredItem) -> JsonDict:
    return item_view(stored.raw, stored.item_id)


def created_item_object(item: NewItem) -> JsonDict:
    return item_view(item.raw, item.item_id)


def item_view(raw: Mapping[str, Any], item_id: str) -> JsonDict:
    """The item as OpenAI returns it: a copy of the raw item with its id, and messages
    typed, completed, and with string content as a text part. The stored raw is untouched."""
    view = dict(raw)  # top-level keys are set or replaced below, nested values never changed
    view["id"] = item_id
    if view.get("type") in (None, "message") and "role" in view:
        view.setdefault("type", "message")
        view.setdefault("status", "completed")
        if isinstance(view.get("content"), str):
            view["content"] = [text_part(view["role"], view["content"])]
    return view


# --- include ------------------------------------------------------------------------------

# OpenAI's IncludeEnum: item data returned only when `include` asks for it.
INCLUDABLE = (
    "file_search_call.results",
    "web_search_call.results",
    "web_search_call.action.sources",
    "message.input_image.image_url",
    "computer_call_output.output.image_url",
    "code_interpreter_call.outputs",
    "reasoning.encrypted_content",
    "message.output_text.logprobs",
)


def include_param(request: web.Request) -> frozenset[str]:
    """`include` (repeated, or `include[]` as the openai SDK sends arrays); an unknown
    value is a 400 naming it."""
    values = [*request.query.getall("include", ()), *request.query.getall("include[]", ())]
    for value in values:
        if value not in INCLUDABLE:
            raise unsupported_value(value, INCLUDABLE, "include")
    return frozenset(values)


def included(view: JsonDict, include: frozenset[str]) -> JsonDict:
    """The item view without the data its type returns only on request (the spec's
    IncludeEnum): encrypted reasoning, output logprobs, input image URLs, screenshot
    URLs, hosted tools' results. `view` is a shallow copy (item_view): top-level keys are
    replaced, and a nested value is copied before it changes, so the raw is untouched."""
    kind = view.get("type")
    if kind == "reasoning" and "reasoning.encrypted_content" not in include:
        view.pop("encrypted_content", None)
    if kind == "message" and isinstance(view.get("content"), list):
        view["content"] = [_included_part(part, include) for part in view["content"]]
    output = view.get("output")
    if kind == "computer_call_output" and isinstance(output, dict):
        if "computer_call_output.output.image_url" not in include:
            view["output"] = {k: v for k, v in output.items() if k != "image_url"}
    for item_type, field, name in _HOSTED_RESULTS:
        if kind == item_type and name not in include and view.get(field) is not None:
            view[field] = None
    action = view.get("action")
    if kind == "web_search_call" and isinstance(action, dict):
        if "web_search_call.action.sources" not in include:
            view["action"] = {k: v for k, v in action.items() if k != "sources"}
    return view


def _included_part(part: Any, include: frozenset[str]) -> Any:
    if not isinstance(part, dict):
        return part
    kind = part.get("type")
    if kind == "output_text" and "message.output_text.logprobs" not in include:
        if "logprobs" in part:
            return {**part, "logprobs": []}
    if kind == "input_image" and "message.input_image.image_url" not in include:
        if part.get("image_url") is not None:
            return {**part, "image_url": None}
    return part


_HOSTED_RESULTS = (
    ("file_search_call", "results", "file_search_call.results"),
    ("code_interpreter_call", "outputs", "code_interpreter_call.outputs"),
)


def text_part(role: str, text: str) -> JsonDict:
    if role == "assistant":
        return {"type": "output_text", "text": text, "annotations": []}
    return {"type": "input_text", "text": text}
