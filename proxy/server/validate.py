"""Request-body checks that mirror the provider's own 400s.

The proxy is never stricter than the provider on a stateless request: only what the
provider would reject anyway, or what the proxy must read to do its job, is checked here.
Unknown fields are forwarded untouched.
"""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from proxy.server.errors import ApiError, invalid

JsonDict = dict[str, Any]

_TYPE_NAMES = {
    str: "a string",
    int: "an integer",
    bool: "a boolean",
    list: "an array",
    dict: "an object",
}


async def read_json_object(request: web.Request) -> tuple[JsonDict, bytes]:
    """The body as a JSON object plus its raw bytes (forwarded as is when nothing changes)."""
    raw = await request.read()
    if not raw.strip():
        raise invalid(
            "We could not parse the JSON body of your request: the body is empty. "
            "(HINT: send a JSON object with Content-Type: application/json.)"
        )
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise invalid(
            f"We could not parse the JSON body of your request: {exc}. "
            "(HINT: make sure the body is valid JSON.)"
        ) from None
    if not isinstance(body, dict):
        raise invalid(
            f"Invalid type for request body: expected an object, but got {_json_type(body)}.",
            code="invalid_type",
        )
    return body, raw


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


def required_string(body: JsonDict, key: str) -> str:
    if key not in body or body[key] is None:
        raise invalid(
            f"Missing required parameter: '{key}'.", param=key, code="missing_required_parameter"
        )
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
