"""The `input` of a Responses request or a compaction (POST /v1/responses,
/v1/responses/input_tokens, /v1/responses/compact): checked, and its item references
resolved from the store, one way for all three (their modules import this one).
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from proxy.core.validate import validate_input_item
from proxy.server.api import RESPONSES
from proxy.server.errors import ApiError, invalid
from proxy.server.state import NAMESPACE, STORE
from proxy.server.validate import JsonDict, list_of_objects, missing, no_repeated_ids
from proxy.store.base import ThreadStore

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


def validate_input(body: JsonDict) -> None:
    """`input` (of a response or a compaction): a string, or input items none of which
    repeats another's id."""
    value = body.get("input")
    if value is not None and not isinstance(value, str):
        items = list_of_objects(value, "input")
        for index, item in enumerate(items):
            validate_input_item(item, f"input[{index}]")
        no_repeated_ids(items, "input")
        ends_with_trigger(body)


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
    store: ThreadStore = request.app[STORE]
    tenant = request[NAMESPACE]
    resolved: list[JsonDict] = []
    for index, item in enumerate(given):
        if not _is_reference(item):
            resolved.append(item)
            continue
        item_id = item.get("id")
        if not isinstance(item_id, str):
            raise missing(f"input[{index}].id")
        stored = await store.find_item(tenant, item_id)
        if stored is None or stored.api != RESPONSES.name:
            raise ApiError(404, f"Item with id '{item_id}' not found.", param=f"input[{index}]")
        keep_id = stored.raw.get("type") in REFERENCE_KEEPS_ID
        resolved.append({k: v for k, v in stored.raw.items() if keep_id or k != "id"})
    body["input"] = resolved
    return True


def _is_reference(item: Any) -> bool:
    return isinstance(item, dict) and item.get("type") == "item_reference"
