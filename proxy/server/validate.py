"""Request-body checks that mirror the provider's own 400s.

The proxy is never stricter than the provider on a stateless request: only what the
provider would reject anyway, or what the proxy must read to do its job, is checked here.
Unknown fields are forwarded untouched. The exceptions keep the proxy itself safe: the
nesting limit (MAX_JSON_DEPTH), and NUL or more than MAX_KEY_LENGTH characters in the ids
and names the store keys rows by.

`read_json_object` is the one door of every JSON route, and `url_keys_middleware` the
one check of path and query values; both answer 400 before anything is written or sent.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from typing import Any

import orjson
from aiohttp import web

from proxy.core.items import MAX_KEY_LENGTH, JsonDict
from proxy.server.errors import ApiError, Handler, invalid

_TYPE_NAMES = {
    str: "a string",
    int: "an integer",
    bool: "a boolean",
    list: "an array",
    dict: "an object",
}


# The deepest nesting a body may have (objects and arrays, the body itself is level 1).
# Generous for real requests (OpenAI's strict schemas stop at 10 levels, about 35 here), and
# low enough that nothing downstream (copies, token counting, the JSON encoder) runs out of
# stack on a body that got in (issue 8, item 3).
MAX_JSON_DEPTH = 128
# Strings the store uses as keys (a chat `name` names a legacy function call): a NUL
# cannot be stored in a PostgreSQL TEXT column.
STORE_KEY_FIELDS = frozenset(
    {"id", "call_id", "tool_call_id", "item_id", "conversation", "previous_response_id", "name"}
)
# MAX_KEY_LENGTH (512) still takes any metadata value OpenAI allows under these names.
_SURROGATE = re.compile("[\ud800-\udfff]")
Path = tuple[Any, ...]  # (parent path, key or index); () is the body itself


async def read_json_object(request: web.Request) -> tuple[JsonDict, bytes]:
    """The body as a JSON object plus its raw bytes (forwarded as is when nothing changes).

    The one door for every JSON route: what passes it is standard JSON (no NaN or
    Infinity, every number finite, integers within Python's 4,300 digits), nested at most
    MAX_JSON_DEPTH levels, free of lone UTF-16 surrogates (in keys and values), and the ids
    the store keys rows by hold no NUL and at most MAX_KEY_LENGTH characters. Anything else
    is a 400 before any work."""
    raw = await request.read()
    if not raw.strip():
        raise invalid(
            "We could not parse the JSON body of your request: the body is empty. "
            "(HINT: send a JSON object with Content-Type: application/json.)"
        )
    body = plainly_valid(raw)
    if body is not None:
        return body, raw
    body = parse_json(raw)
    if not isinstance(body, dict):
        raise invalid(
            f"Invalid type for request body: expected an object, but got {_json_type(body)}.",
            code="invalid_type",
        )
    check_json_tree(body)
    return body, raw


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


class _NotStandardJson(ValueError):
    pass


def _refuse_constant(name: str) -> Any:
    raise _NotStandardJson(f"{name} is not a valid JSON value")


def parse_json(raw: bytes) -> Any:
    """`json.loads`, refusing what Python accepts but JSON does not, as a 400."""
    try:
        return json.loads(raw, parse_constant=_refuse_constant)
    except RecursionError:
        raise too_deep() from None
    except (json.JSONDecodeError, UnicodeDecodeError, _NotStandardJson) as exc:
        raise unparsable(str(exc)) from None
    except ValueError:  # int(): more than sys.get_int_max_str_digits() digits
        raise unparsable("an integer literal is too long (the limit is 4300 digits)") from None


def unparsable(reason: str) -> ApiError:
    return invalid(
        f"We could not parse the JSON body of your request: {reason}. "
        "(HINT: make sure the body is valid JSON.)"
    )


def too_deep() -> ApiError:
    return invalid(
        f"The JSON body of your request is nested too deeply: at most {MAX_JSON_DEPTH} "
        "levels of objects and arrays are accepted.",
        code="json_too_deep",
    )


def check_json_tree(body: JsonDict) -> None:
    """Depth, lone surrogates, non-finite numbers and NUL in store keys, walked without
    recursion (the body may be exactly what a recursive walk cannot take). Containers
    are visited in document order; scalars are checked where they sit."""
    stack: list[tuple[Any, int, Path]] = [(body, 1, ())]
    while stack:
        value, depth, path = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise too_deep()
        entries = value.items() if isinstance(value, dict) else enumerate(value)
        containers = []
        for key, entry in entries:
            if isinstance(key, str) and not key.isascii() and _SURROGATE.search(key):
                raise lone_surrogate(param_of(path), "an object key")
            if isinstance(entry, dict | list):
                containers.append((entry, depth + 1, (path, key)))
            elif isinstance(entry, str):
                _check_string(entry, key, path)
            elif isinstance(entry, float) and not math.isfinite(entry):
                raise unparsable(f"the number at '{param_of((path, key))}' is out of range")
        stack.extend(reversed(containers))


def _check_string(value: str, key: str | int, parent: Path) -> None:
    if not value.isascii() and _SURROGATE.search(value):
        raise lone_surrogate(param_of((parent, key)), "a string")
    if key in STORE_KEY_FIELDS:
        if "\x00" in value:
            raise nul_in_key(param_of((parent, key)))
        if len(value) > MAX_KEY_LENGTH:
            raise too_long(param_of((parent, key)), MAX_KEY_LENGTH, len(value))


def param_of(path: Path) -> str:
    """`input[3].content[0].text` for ((((((), "input"), 3), "content"), 0), "text")."""
    steps: list[Any] = []
    while path:
        path, step = path
        steps.append(step)
    text = ""
    for step in reversed(steps):
        text += f"[{step}]" if isinstance(step, int) else (f".{step}" if text else str(step))
    return text


def lone_surrogate(param: str, where: str) -> ApiError:
    return invalid(
        f"Invalid '{param or 'body'}': {where} contains a lone UTF-16 surrogate (such as "
        "\\ud800), which is not valid Unicode.",
        param=param or None,
        code="invalid_unicode",
    )


def nul_in_key(param: str) -> ApiError:
    return invalid(
        f"Invalid '{param}': the NUL character (\\u0000) is not allowed in ids and names.",
        param=param,
        code="invalid_value",
    )


@web.middleware
async def url_keys_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Path parameters and query values of the routes served locally become store keys:
    one with a NUL or undecodable bytes is a 400 before the handler runs. (Passthrough
    URLs go to the provider as they came.)"""
    if request.match_info.route.name != "passthrough":
        for name, value in (*request.match_info.items(), *request.query.items()):
            store_key(value, name)
    return await handler(request)


def too_long(param: str, limit: int, length: int) -> ApiError:
    return invalid(
        f"Invalid '{param}': string too long. Expected a string with maximum length {limit}, "
        f"but got a string with length {length} instead.",
        param=param,
        code="string_above_max_length",
    )


def duplicate_item(param: str, item_id: str) -> ApiError:
    """OpenAI's answer to an item id that is repeated, or already in the conversation."""
    shown = item_id if len(item_id) <= 128 else item_id[:128] + "..."
    return invalid(
        f"Duplicate item found with id {shown}. Remove duplicate items from your input "
        "and try again.",
        param=param,
        code="duplicate_item",
    )


def no_repeated_ids(items: Sequence[JsonDict], param: str) -> None:
    """An item id given twice in one request is a 400 `duplicate_item` whatever the store
    holds or the request's `store` says: decided from the body alone, before the store is
    read or the provider called. An `item_reference` names an item on purpose: skipped.
    (Ids the thread already holds are the turn's check, proxy/threads.py first_taken_id.)"""
    seen: set[str] = set()
    for index, item in enumerate(items):
        own = item.get("id")
        if item.get("type") == "item_reference" or not isinstance(own, str) or not own:
            continue
        if own in seen:
            raise duplicate_item(f"{param}[{index}].id", own)
        seen.add(own)


def store_key(value: str, param: str) -> str:
    """A string from the URL or a header that the store will use as a key: no NUL and no
    undecodable bytes (aiohttp hands them over as lone surrogates)."""
    if _SURROGATE.search(value):
        raise invalid(f"Invalid '{param}': not valid UTF-8.", param=param, code="invalid_unicode")
    if "\x00" in value:
        raise nul_in_key(param)
    return value


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"


def wrong_type(param: str, expected: str, value: Any) -> ApiError:
    return invalid(
        f"Invalid type for '{param}': expected {expected}, but got {_json_type(value)}.",
        param=param,
        code="invalid_type",
    )


def missing(param: str) -> ApiError:
    return invalid(
        f"Missing required parameter: '{param}'.", param=param, code="missing_required_parameter"
    )


def required_role(message: JsonDict, param: str) -> str:
    """A message's role: present and a string (which roles are allowed is the API's)."""
    role = message.get("role")
    if role is None:
        raise missing(f"{param}.role")
    if not isinstance(role, str):
        raise wrong_type(f"{param}.role", "a string", role)
    return role


def required_string(body: JsonDict, key: str) -> str:
    if key not in body or body[key] is None:
        raise missing(key)
    value = body[key]
    if not isinstance(value, str):
        raise wrong_type(key, "a string", value)
    if not value:
        raise invalid(f"Invalid '{key}': empty string.", param=key, code="empty_string")
    return value


def optional(body: JsonDict, key: str, kind: type, param: str | None = None) -> Any:
    value = body.get(key)
    if value is None:
        return None
    ok = isinstance(value, kind) and not (kind is int and isinstance(value, bool))
    if not ok:
        raise wrong_type(param or key, _TYPE_NAMES[kind], value)
    return value


def optional_positive_int(body: JsonDict, key: str) -> int | None:
    value = optional(body, key, int)
    if value is not None and value < 1:
        raise invalid(
            f"Invalid '{key}': integer below minimum value. Expected a value >= 1, but got "
            f"{value} instead.",
            param=key,
            code="integer_below_min_value",
        )
    return value


def list_of_objects(value: Any, param: str) -> list[JsonDict]:
    if not isinstance(value, list):
        raise wrong_type(param, "an array", value)
    for index, entry in enumerate(value):
        if not isinstance(entry, dict):
            raise wrong_type(f"{param}[{index}]", "an object", entry)
    return value


def unsupported_value(value: object, allowed: Sequence[str], param: str) -> ApiError:
    """OpenAI's 400 for a value outside an enum, listing what is allowed."""
    quoted = [f"'{option}'" for option in allowed]
    listed = (
        " and ".join(quoted) if len(quoted) < 3 else ", ".join(quoted[:-1]) + f", and {quoted[-1]}"
    )
    return invalid(
        f"Invalid value: '{value}'. Supported values are: {listed}.",
        param=param,
        code="invalid_value",
    )
