"""One internal view over Chat Completions messages and Responses input items.

The raw JSON dict of each item is the source of truth: it is kept as given and sent
upstream byte for byte. The core only reads a small frozen view of the fields it acts
on (STYLE.md, "openai-python"): kind, role, id, call ids, status, name. Unknown item
types become opaque items that keep their place in the history.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import orjson

Api = Literal["chat", "responses"]
JsonDict = dict[str, Any]

# Responses item types that answer a call made by an earlier item, keyed by the type of
# the call they answer. The provider rejects a request where either half is missing.
OUTPUT_TO_CALL_TYPE: Mapping[str, str] = {
    "function_call_output": "function_call",
    "custom_tool_call_output": "custom_tool_call",
    "computer_call_output": "computer_call",
    "local_shell_call_output": "local_shell_call",
    "shell_call_output": "shell_call",
    "apply_patch_call_output": "apply_patch_call",
    "tool_search_output": "tool_search_call",
}
CALL_TYPES = frozenset(OUTPUT_TO_CALL_TYPE.values())
# Types that pair only by a `call_id` they carry (OpenAI's hosted tool search has none).
PAIRED_BY_CALL_ID_ONLY = frozenset({"tool_search_call", "tool_search_output"})

# An MCP approval (openapi: MCPApprovalRequest, MCPApprovalResponse, MCPToolCall): the
# request is a call named by its `id`, the response and the mcp_call that runs it answer
# it by `approval_request_id`, so the three pair like a call and its outputs (one block,
# no cut between them). A request no response answers is a pending action (SPEC 5).
APPROVAL_REQUEST = "mcp_approval_request"
APPROVAL_ANSWERS = frozenset({"mcp_approval_response", "mcp_call"})
MCP_KINDS = frozenset({APPROVAL_REQUEST, *APPROVAL_ANSWERS, "mcp_list_tools"})
# The kinds of the items that make a call or answer one: no item of another kind has
# `call_ids` or an `output_for`, so a history without them pairs nothing (the ledger's
# rewriters have no work there, turn.REWRITERS).
CALL_KINDS = frozenset({"tool_calls", "tool_output", APPROVAL_REQUEST, *APPROVAL_ANSWERS})

# The longest id or key the stores index (items are unique by id, ledger entries by key):
# PostgreSQL refuses a btree entry above ~2.7 kB, and 512 characters of UTF-8 stay below.
MAX_KEY_LENGTH = 512

# Roles whose text is instructions rather than conversation (SPEC section 5: pinned).
INSTRUCTION_ROLES = frozenset({"system", "developer"})


@dataclass(frozen=True, slots=True)
class Item:
    """A history entry: the raw dict plus the few fields the core reasons about.

    `kind` is normalized across APIs: "message", "tool_calls" (a Chat assistant message
    carrying tool_calls / function_call), "tool_output", "reasoning", "compaction",
    "item_reference", the MCP types (MCP_KINDS) or "other". `call_ids` are the calls this
    item makes; `output_for` is the call this item answers (an MCP approval request is a
    call its response and its mcp_call answer).
    """

    raw: JsonDict = field(compare=False)
    api: Api
    kind: str
    type: str | None
    role: str | None = None
    id: str | None = None
    status: str | None = None
    name: str | None = None
    call_ids: tuple[str, ...] = ()
    output_for: str | None = None
    digest: str = ""
    # The count stored with the item (NewItem.tokens) and the encoding it was counted
    # with: TokenCounter.item returns it for that encoding instead of counting again.
    tokens: int | None = field(default=None, compare=False)
    encoding: str = field(default="", compare=False)

    @property
    def is_instruction(self) -> bool:
        return self.kind == "message" and self.role in INSTRUCTION_ROLES

    @property
    def is_user_message(self) -> bool:
        return self.kind == "message" and self.role == "user" and self.output_for is None

    def text(self) -> str:
        """The plain text of a message item (content string or its text parts)."""
        return message_text(self.raw.get("content"))


_FIELDS = tuple(Item.__dataclass_fields__)
_GENERATED_INIT = Item.__init__  # the dataclass's: tests/core/test_items.py compares the two
(_raw, _api, _kind, _type, _role, _id, _status, _name, _calls, _output_for, _digest, _tokens,
 _encoding) = (getattr(Item, name).__set__ for name in _FIELDS)  # fmt: skip


def _init(
    self: Item,
    raw: JsonDict,
    api: Api,
    kind: str,
    type: str | None,
    role: str | None = None,
    id: str | None = None,
    status: str | None = None,
    name: str | None = None,
    call_ids: tuple[str, ...] = (),
    output_for: str | None = None,
    digest: str = "",
    tokens: int | None = None,
    encoding: str = "",
) -> None:
    """Item's __init__: the generated one's signature and values, each slot set through
    its descriptor (a frozen dataclass's own sets each with object.__setattr__, about
    twice as slow; a request builds an Item for every message it sends)."""
    _raw(self, raw)
    _api(self, api)
    _kind(self, kind)
    _type(self, type)
    _role(self, role)
    _id(self, id)
    _status(self, status)
    _name(self, name)
    _calls(self, call_ids)
    _output_for(self, output_for)
    _digest(self, digest)
    _tokens(self, tokens)
    _encoding(self, encoding)


Item.__init__ = _init  # type: ignore[assignment,method-assign]


def message_text(content: Any) -> str:
    """Text of a message's content: the string, or its text parts joined by newlines."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, Mapping):
                text = part.get("text")
                if isinstance(text, str):
                    parts.append(text)
            elif isinstance(part, str):
                parts.append(part)
        return "\n".join(parts)
    return ""


def canonical_json(value: Any) -> str:
    """Stable serialization used for hashing and for idempotency fingerprints: sorted
    keys, no spaces, non-ASCII as itself. Persisted values (ledger keys, fingerprints,
    stored item digests) depend on these exact bytes; do not change them."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


# In orjson's output with the strings taken out, a float is a digit before "." or an
# exponent (orjson and json format floats differently); "null" may be a NaN or infinity.
_FLOAT = re.compile(rb"\d[.eE]")
# What the stdlib cannot write (dataclasses, datetimes, subclasses) must not pass either.
_ORJSON_OPTIONS = (
    orjson.OPT_SORT_KEYS
    | orjson.OPT_PASSTHROUGH_DATACLASS
    | orjson.OPT_PASSTHROUGH_DATETIME
    | orjson.OPT_PASSTHROUGH_SUBCLASS
)


def canonical_bytes(value: Any) -> bytes:
    """`canonical_json(value)` as UTF-8 (a lone surrogate passes as itself), byte for byte.

    orjson writes the same bytes as the stdlib for everything but floats, NaN and
    infinities, and raises on what it cannot write (lone surrogates, integers beyond 64
    bits, nesting past 255 levels); those go to the stdlib, so the result never depends
    on orjson's version (tests/core/test_persisted_forms.py compares the two).
    """
    try:
        fast = orjson.dumps(value, option=_ORJSON_OPTIONS)
    except TypeError:  # orjson.JSONEncodeError
        return _stdlib_bytes(value)
    return _canonical(fast, value)


def _canonical(fast: bytes, value: Any) -> bytes:
    """canonical_bytes of `value`, whose orjson form (sorted keys) is `fast`."""
    if _FLOAT.search(fast) is None and b"null" not in fast:  # not even inside strings
        return fast
    outside = b"".join(fast.replace(b"\\\\", b"").replace(b'\\"', b"").split(b'"')[::2])
    if _FLOAT.search(outside) or (b"null" in outside and orjson.loads(fast) != value):
        return _stdlib_bytes(value)
    return fast


def _stdlib_bytes(value: Any) -> bytes:
    return canonical_json(value).encode("utf-8", "surrogatepass")


# Digests of values seen recently, keyed by their orjson form: a client without a stored
# thread sends its whole history again on every turn. Without a null in it, that form
# names one JSON value (orjson writes NaN and the infinities as null, and raises on what
# it cannot write), so it names one digest. Cleared when full.
_DIGESTS: dict[bytes, str] = {}
DIGESTS_MAX_ENTRIES = 4096
DIGESTS_MAX_LENGTH = 2048  # bytes of orjson form; longer values are hashed every time


def content_digest(raw: Any) -> str:
    """sha256 of `canonical_bytes(raw)`: the digest stored with each item (column
    `items.digest`), so its form is fixed across processes and versions. Key order does
    not change the digest: it names the content, not the bytes. A lone surrogate (JSON may
    escape one: "\\ud800") is hashed as itself, never an error."""
    try:
        fast = orjson.dumps(raw, option=_ORJSON_OPTIONS)
    except TypeError:  # orjson.JSONEncodeError
        return hashlib.sha256(_stdlib_bytes(raw)).hexdigest()
    kept = len(fast) <= DIGESTS_MAX_LENGTH and b"null" not in fast
    if kept and (known := _DIGESTS.get(fast)) is not None:
        return known
    digest = hashlib.sha256(_canonical(fast, raw)).hexdigest()
    if kept:
        if len(_DIGESTS) >= DIGESTS_MAX_ENTRIES:
            _DIGESTS.clear()
        _DIGESTS[fast] = digest
    return digest


def _str_or_none(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def chat_item(
    message: JsonDict, *, digest: str = "", tokens: int | None = None, encoding: str = ""
) -> Item:
    """View of one Chat Completions message.

    An assistant message with `tool_calls` (or a legacy `function_call`) is a
    "tool_calls" item; a `tool` or legacy `function` message is a "tool_output".
    `digest`, `tokens` and `encoding` are what the store kept for the message, if any.
    """
    role = _str_or_none(message.get("role"))
    name = _str_or_none(message.get("name"))
    kind = "message"
    call_ids: tuple[str, ...] = ()
    output_for = None
    if role == "assistant" and (call_ids := chat_call_ids(message)):
        kind = "tool_calls"
    elif role == "tool":
        kind, output_for = "tool_output", _str_or_none(message.get("tool_call_id"))
    elif role == "function":
        kind, output_for = "tool_output", legacy_call_id(name or "")
    return Item(
        message,
        "chat",
        kind,
        None,
        role,
        None,
        None,
        name,
        call_ids,
        output_for,
        digest or content_digest(message),
        tokens,
        encoding,
    )


def chat_call_ids(message: Mapping[str, Any]) -> tuple[str, ...]:
    """Ids of the calls an assistant message makes, in order."""
    call_ids: list[str] = []
    tool_calls = message.get("tool_calls")
    if isinstance(tool_calls, list):
        for call in tool_calls:
            if isinstance(call, Mapping) and isinstance(call.get("id"), str):
                call_ids.append(call["id"])
    legacy = message.get("function_call")
    if isinstance(legacy, Mapping) and isinstance(legacy.get("name"), str):
        # Legacy function calls carry no id; the name pairs call and result.
        call_ids.append(legacy_call_id(legacy["name"]))
    return tuple(call_ids)


def legacy_call_id(function_name: str) -> str:
    return f"legacy-function:{function_name}"


def responses_item(
    raw: JsonDict, *, digest: str = "", tokens: int | None = None, encoding: str = ""
) -> Item:
    """View of one Responses input or output item.

    A message may omit `type` (EasyInputMessage). Calls and their outputs pair by
    `call_id`; local_shell_call_output names its call by `id` (OpenAI spec), so `id`
    is the fallback (tool_search items pair only by a call_id they carry). MCP approval
    items pair by the request's id. reasoning, compaction and item_reference keep their
    type as kind;
    any other type is "other" and keeps its place untouched. `digest`, `tokens` and
    `encoding` are what the store kept for the item, if any.
    """
    item_type = _str_or_none(raw.get("type"))
    item_id = _str_or_none(raw.get("id"))
    role = _str_or_none(raw.get("role"))
    kind = "other"
    call_ids: tuple[str, ...] = ()
    output_for = None
    call_id = _str_or_none(raw.get("call_id"))
    if item_type not in PAIRED_BY_CALL_ID_ONLY:
        call_id = call_id or item_id
    if item_type in (None, "message") and role is not None:
        kind, item_type = "message", "message"
    elif item_type in PAIRED_BY_CALL_ID_ONLY and call_id is None:
        kind = "other"
    elif item_type in MCP_KINDS:
        kind = item_type
        approval = _str_or_none(raw.get("approval_request_id"))
        if item_type == APPROVAL_REQUEST and item_id:
            call_ids = (item_id,)
        elif item_type in APPROVAL_ANSWERS and approval:
            output_for = approval
    elif item_type in CALL_TYPES:
        kind, call_ids = "tool_calls", (call_id,) if call_id else ()
    elif item_type in OUTPUT_TO_CALL_TYPE:
        kind, output_for = "tool_output", call_id
    elif item_type in ("reasoning", "compaction", "item_reference"):
        kind = item_type
    return Item(
        raw,
        "responses",
        kind,
        item_type,
        role,
        item_id,
        _str_or_none(raw.get("status")),
        _str_or_none(raw.get("name")),
        call_ids,
        output_for,
        digest or content_digest(raw),
        tokens,
        encoding,
    )


def item_of(
    api: str | None,
    raw: JsonDict,
    *,
    digest: str = "",
    tokens: int | None = None,
    encoding: str = "",
) -> Item:
    """The one view of an item kept with its API's name (a stored row, a summary, a
    checkpoint entry): "chat" is a Chat message, anything else a Responses item."""
    view = chat_item if api == "chat" else responses_item
    return view(raw, digest=digest, tokens=tokens, encoding=encoding)


def pending_approvals(items: Iterable[Item]) -> frozenset[str]:
    """Ids of the MCP approval requests among `items` that nothing later answers: pending
    actions, kept verbatim in every projection (SPEC 5 ranks them second)."""
    asked: dict[str, None] = {}
    for item in items:
        if item.kind == APPROVAL_REQUEST:
            asked.update(dict.fromkeys(item.call_ids))
        elif item.kind in APPROVAL_ANSWERS and item.output_for in asked:
            del asked[item.output_for]
    return frozenset(asked)


def is_pending_approval(item: Item, pending: frozenset[str]) -> bool:
    return item.kind == APPROVAL_REQUEST and bool(pending.intersection(item.call_ids))


def items_from_chat(messages: Iterable[JsonDict]) -> list[Item]:
    return [chat_item(m) for m in messages]


def chat_from_items(items: Iterable[Item]) -> list[JsonDict]:
    return [item.raw for item in items]


@dataclass(frozen=True, slots=True)
class ResponsesInput:
    """A Responses `input` as items, remembering whether it was a bare string."""

    items: tuple[Item, ...]
    was_string: bool = False


def items_from_responses_input(value: str | Sequence[JsonDict]) -> ResponsesInput:
    """Items of a Responses `input`; `responses_input_from_items` gives it back as sent."""
    if isinstance(value, str):
        # OpenAI treats a string input as one user message with that text.
        return ResponsesInput((responses_item({"role": "user", "content": value}),), True)
    return ResponsesInput(tuple(responses_item(raw) for raw in value))


def responses_input_from_items(value: ResponsesInput | Sequence[Item]) -> str | list[JsonDict]:
    if isinstance(value, ResponsesInput):
        if value.was_string and len(value.items) == 1:
            return str(value.items[0].raw["content"])
        return [item.raw for item in value.items]
    return [item.raw for item in value]
