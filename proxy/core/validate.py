"""Request checks that mirror the provider's own 400s, as pure functions.

The proxy is never stricter than the provider on a stateless request: only what the
provider would reject anyway, or what the proxy must read to do its job, is checked here.
Unknown fields are forwarded untouched. The exceptions keep the proxy itself safe: the
nesting limit (MAX_JSON_DEPTH), and NUL or more than MAX_KEY_LENGTH characters in the ids
and names the store keys rows by.

A failed check raises ApiError (OpenAI's error as a value). The HTTP doors
(proxy/server/validate.py) turn it into a 400; `threadkeeper threads import` runs the
same checks on an exported file and prints it as one line.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from typing import Any

from proxy.core.items import MAX_KEY_LENGTH, JsonDict

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


class ApiError(Exception):
    """An error the client should see, already in OpenAI's terms."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(
    message: str, type: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def invalid(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


class NotJson(ValueError):
    """Why a text is not standard JSON; `too_deep`: nested beyond what the parser's stack
    takes."""

    def __init__(self, reason: str, *, too_deep: bool = False) -> None:
        super().__init__(reason)
        self.too_deep = too_deep


def _refuse_constant(name: str) -> Any:
    raise NotJson(f"{name} is not a valid JSON value")


def load_json(raw: bytes | str) -> Any:
    """`json.loads`, refusing what Python accepts but JSON does not (NotJson)."""
    try:
        return json.loads(raw, parse_constant=_refuse_constant)
    except RecursionError:
        raise NotJson(f"nested more than {MAX_JSON_DEPTH} levels deep", too_deep=True) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise NotJson(str(exc)) from None
    except NotJson:
        raise
    except ValueError:  # int(): more than sys.get_int_max_str_digits() digits
        raise NotJson("an integer literal is too long (the limit is 4300 digits)") from None


def parse_json(raw: bytes | str) -> Any:
    """`load_json`, its refusal as a 400."""
    try:
        return load_json(raw)
    except NotJson as exc:
        raise too_deep() if exc.too_deep else unparsable(str(exc)) from None


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


def json_type(value: Any) -> str:
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
        f"Invalid type for '{param}': expected {expected}, but got {json_type(value)}.",
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


# --- messages and items -------------------------------------------------------------

CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})


def validate_chat_message(message: JsonDict, param: str) -> None:
    role = required_role(message, param)
    if role not in CHAT_ROLES:
        raise invalid(
            f"Invalid value: '{role}'. Supported values are: 'system', 'assistant', 'user', "
            "'function', 'tool', and 'developer'.",
            param=f"{param}.role",
            code="invalid_value",
        )
    content = message.get("content")
    if content is not None and not isinstance(content, str | list):
        raise wrong_type(f"{param}.content", "a string or an array", content)
    if isinstance(content, list):
        list_of_objects(content, f"{param}.content")
    if role == "tool" and not isinstance(message.get("tool_call_id"), str):
        raise missing(f"{param}.tool_call_id")
    tool_calls = message.get("tool_calls")
    if tool_calls is not None:
        for index, call in enumerate(list_of_objects(tool_calls, f"{param}.tool_calls")):
            if not isinstance(call.get("id"), str):
                raise missing(f"{param}.tool_calls[{index}].id")


def validate_input_item(item: JsonDict, param: str) -> None:
    item_type = item.get("type")
    if item_type is not None and not isinstance(item_type, str):
        raise wrong_type(f"{param}.type", "a string", item_type)
    if item_type in (None, "message"):
        required_role(item, param)
        content = item.get("content")
        if not isinstance(content, str | list):
            raise wrong_type(f"{param}.content", "a string or an array", content)
    if item_type in ("function_call", "function_call_output", "custom_tool_call_output"):
        if not isinstance(item.get("call_id"), str):
            raise missing(f"{param}.call_id")
    if item_type == "compaction":
        content = item.get("encrypted_content")
        if content is None:
            raise missing(f"{param}.encrypted_content")
        if not isinstance(content, str):
            raise wrong_type(f"{param}.encrypted_content", "a string", content)


MAX_METADATA_PAIRS = 16
MAX_METADATA_KEY = 64
MAX_METADATA_VALUE = 512
MESSAGE_ROLES = ("assistant", "system", "developer", "user")
# The item types OpenAI's InputItem union names (openapi: InputItem, Item). A conversation
# keeps its items for later turns, so an unknown type is refused here rather than by the
# provider on some later turn.
ITEM_TYPES = (
    "message",
    "function_call",
    "function_call_output",
    "custom_tool_call",
    "custom_tool_call_output",
    "reasoning",
    "compaction",
    "compaction_trigger",
    "file_search_call",
    "web_search_call",
    "computer_call",
    "computer_call_output",
    "image_generation_call",
    "code_interpreter_call",
    "local_shell_call",
    "local_shell_call_output",
    "shell_call",
    "shell_call_output",
    "apply_patch_call",
    "apply_patch_call_output",
    "mcp_list_tools",
    "mcp_approval_request",
    "mcp_approval_response",
    "mcp_call",
    "tool_search_call",
    "tool_search_output",
    "additional_tools",
    "program",
    "program_output",
    "item_reference",
)


def metadata_param(value: Any) -> dict[str, str]:
    """OpenAI's Metadata: up to 16 string pairs, keys <= 64 chars, values <= 512 chars."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise wrong_type("metadata", "an object", value)
    if len(value) > MAX_METADATA_PAIRS:
        raise invalid(
            f"Invalid 'metadata': too many properties. Expected an object with at most "
            f"{MAX_METADATA_PAIRS} properties, but got an object with {len(value)} properties "
            "instead.",
            param="metadata",
            code="object_above_max_properties",
        )
    for key, entry in value.items():
        if len(key) > MAX_METADATA_KEY:
            raise too_long("metadata", MAX_METADATA_KEY, len(key))
        if not isinstance(entry, str):
            raise wrong_type(f"metadata.{key}", "a string", entry)
        if len(entry) > MAX_METADATA_VALUE:
            raise too_long(f"metadata.{key}", MAX_METADATA_VALUE, len(entry))
    return dict(value)


def validate_stored_item(raw: JsonDict, param: str) -> None:
    """The Responses input checks, plus what an item kept for later turns must carry."""
    validate_input_item(raw, param)
    item_type = raw.get("type")
    if item_type is not None and item_type not in ITEM_TYPES:
        raise unsupported_value(item_type, ITEM_TYPES, f"{param}.type")
    if item_type in (None, "message"):
        validate_message(raw, param)
    elif item_type == "item_reference":
        # A reference resolves against OpenAI's storage; a stored copy would dangle.
        raise invalid(
            f"Invalid '{param}': item references cannot be added to a conversation; send "
            "the item itself.",
            param=f"{param}.type",
            code="invalid_value",
        )
    elif item_type == "function_call":
        for key in ("name", "arguments"):
            required_item_string(raw, key, param)
    elif item_type == "function_call_output" and not isinstance(raw.get("output"), str | list):
        raise missing(f"{param}.output")
    given_id = raw.get("id")
    if given_id is not None and not (isinstance(given_id, str) and given_id):
        raise wrong_type(f"{param}.id", "a non-empty string", given_id)


def validate_message(raw: JsonDict, param: str) -> None:
    role = raw["role"]
    if role not in MESSAGE_ROLES:
        raise unsupported_value(role, MESSAGE_ROLES, f"{param}.role")
    content = raw["content"]
    if isinstance(content, list):
        for index, part in enumerate(content):
            if not isinstance(part, dict):
                raise wrong_type(f"{param}.content[{index}]", "an object", part)
            if not isinstance(part.get("type"), str):
                raise missing(f"{param}.content[{index}].type")


def required_item_string(raw: JsonDict, key: str, param: str) -> None:
    if key not in raw or raw[key] is None:
        raise missing(f"{param}.{key}")
    if not isinstance(raw[key], str):
        raise wrong_type(f"{param}.{key}", "a string", raw[key])
