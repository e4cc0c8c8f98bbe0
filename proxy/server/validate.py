"""The request's door: the HTTP side of the request checks (the checks themselves are
pure: proxy/core/validate.py, which the CLI's `threads import` runs too).

`read_json_object` is the one door of every JSON route, and `check_url_keys` the
one check of path and query values; both answer 400 before anything is written or sent.
The `input` of a Responses request or a compaction (POST /v1/responses,
/v1/responses/input_tokens, /v1/responses/compact) passes `validate_input`, and its item
references are resolved from the store by `resolve_references`, one way for all three.
The checks' names are re-exported here for the handlers.
"""

from __future__ import annotations

from typing import Any

import orjson
from aiohttp import web

from proxy.core.items import MAX_KEY_LENGTH, JsonDict
from proxy.core.validate import (
    MAX_JSON_DEPTH,
    STORE_KEY_FIELDS,
    check_json_tree,
    duplicate_item,
    json_type,
    list_of_objects,
    missing,
    no_repeated_ids,
    optional,
    optional_positive_int,
    parse_json,
    required_role,
    required_string,
    store_key,
    too_long,
    unsupported_value,
    validate_input_item,
    wrong_type,
)
from proxy.server.api import RESPONSES
from proxy.server.errors import ApiError, invalid
from proxy.server.state import NAMESPACE, STORE
from proxy.store.base import ThreadStore

__all__ = [  # the checks the handlers import from here
    "MAX_JSON_DEPTH",
    "JsonDict",
    "check_url_keys",
    "duplicate_item",
    "list_of_objects",
    "missing",
    "no_repeated_ids",
    "optional",
    "optional_positive_int",
    "plainly_valid",
    "read_json_object",
    "required_role",
    "required_string",
    "store_key",
    "too_long",
    "unsupported_value",
    "wrong_type",
]


async def read_json_object(request: web.Request) -> tuple[JsonDict, bytes]:
    """The body as a JSON object plus its raw bytes (forwarded as is when nothing changes).

    The one door for every JSON route: what passes it is standard JSON (no NaN or
    Infinity, every number finite, integers within Python's 4,300 digits), nested at most
    MAX_JSON_DEPTH levels, free of lone UTF-16 surrogates (in keys and values), and the ids
    the store keys rows by hold no NUL and at most MAX_KEY_LENGTH characters. Anything else
    is a 400 before any work."""
    raw = await request.read()
    return json_object(raw), raw


def json_object(raw: bytes) -> JsonDict:
    """read_json_object's checks on bytes already read (a WebSocket message)."""
    if not raw.strip():
        raise invalid(
            "We could not parse the JSON body of your request: the body is empty. "
            "(HINT: send a JSON object with Content-Type: application/json.)"
        )
    body = plainly_valid(raw)
    if body is not None:
        return body
    parsed = parse_json(raw)
    if not isinstance(parsed, dict):
        raise invalid(
            f"Invalid type for request body: expected an object, but got {json_type(parsed)}.",
            code="invalid_type",
        )
    check_json_tree(parsed)
    return parsed


_BEYOND_64_BITS = float(2**63)


def plainly_valid(raw: bytes) -> JsonDict | None:
    """The body when orjson parses it to an object that passes every check, else None
    (the stdlib path then parses it again and answers with the precise 400).

    orjson refuses invalid UTF-8, lone surrogates, NaN, Infinity and numbers that
    overflow a double, so only depth and store keys are left to check. It reads an
    integer beyond 64 bits as a float: a float that large sends the body to the stdlib,
    which keeps every digit. No paths are built: this is the fast door."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(body, dict):
        return None
    stack: list[tuple[Any, int]] = [(body, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            return None
        if isinstance(value, dict):
            for key, entry in value.items():
                kind = type(entry)
                if kind is dict or kind is list:
                    stack.append((entry, depth + 1))
                elif kind is str:
                    if key in STORE_KEY_FIELDS and ("\x00" in entry or len(entry) > MAX_KEY_LENGTH):
                        return None
                elif kind is float and not -_BEYOND_64_BITS < entry < _BEYOND_64_BITS:
                    return None
        else:
            for entry in value:
                kind = type(entry)
                if kind is dict or kind is list:
                    stack.append((entry, depth + 1))
                elif kind is float and not -_BEYOND_64_BITS < entry < _BEYOND_64_BITS:
                    return None
    return body


def check_url_keys(request: web.Request) -> None:
    """Path parameters and query values of the routes served locally become store keys:
    one with a NUL or undecodable bytes is a 400 before the handler runs (a step of
    app.request_middleware). Passthrough URLs go to the provider as they came."""
    if request.match_info.route.name != "passthrough":
        for name, value in (*request.match_info.items(), *request.query.items()):
            store_key(value, name)


# -- the `input` of POST /v1/responses, /v1/responses/input_tokens, /v1/responses/compact --

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
