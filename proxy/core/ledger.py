"""The side-effect ledger's rules (SPEC section 6; seed sections 3.2, 7.2, 10).

The seed's point: "the model emitted a call", "the tool received it" and "the side effect
was committed" are three different facts, and a restart or a retry must never turn the
first into a second refund. So every call of a side-effecting tool gets a ledger entry
keyed by a key rendered from its arguments, written before the call reaches the client;
a later call with the same key is decided here, never handed out blindly.

Pure functions only. The edge runs them in this order::

    for call in side_effect_calls(assistant_message_or_output_items, rules):
        rule = rules[call.name]
        rendered = render_idempotency_key(rule, call)       # log rendered.reason if fallback
        scope = ledger_scope(rule, thread_id)
        entry, created = await store.ledger_issue(LedgerEntry(scope=scope, key=rendered.key, ...))
        decision = decide(entry.status, created, entry.call_id, call.call_id, rule)
        if decision is not Decision.HAND_OUT: feed model_output(call, decision, ...) back

and, when the client answers, `outputs_in` + `output_outcome` resolve the entries. Before
a request is sent, every call the client left unanswered (`dangling_calls`) gets an answer
(`dangling_decision` from its entry, or `unanswered_output`) placed by `place_answers`:
the provider refuses a call without its output.
"""

from __future__ import annotations

import enum
import hashlib
import json
import re
import string
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from proxy.core.items import (
    MAX_KEY_LENGTH,
    Api,
    Item,
    JsonDict,
    canonical_json,
    legacy_call_id,
    message_text,
)

Scope = Literal["tenant", "thread"]
OnDuplicate = Literal["replay", "block"]
CallKind = Literal["function", "custom"]
Outcome = Literal["completed", "failed"]


@dataclass(frozen=True)
class ToolRule:
    """The core's view of one policy `tools:` entry (built from proxy.policy.ToolPolicy)."""

    side_effect: bool = False
    idempotency_key: str | None = None
    scope: Scope = "tenant"
    on_duplicate: OnDuplicate = "replay"


@dataclass(frozen=True)
class ToolCall:
    """A tool call the provider emitted; `arguments` is the raw string (custom: `input`)."""

    call_id: str
    name: str
    arguments: str
    api: Api
    kind: CallKind = "function"
    index: int = 0  # position in tool_calls / in the output items


# -- which calls are guarded ----------------------------------------------------------------


def side_effect_calls(
    message_or_items: Mapping[str, Any] | Sequence[Mapping[str, Any]],
    rules: Mapping[str, ToolRule],
) -> list[ToolCall]:
    """The side-effecting calls of a Chat assistant message or of Responses output items.

    A Mapping is a Chat message (`tool_calls`, legacy `function_call`); a sequence is
    Responses output (`function_call`, `custom_tool_call`). Order is the emitted order.
    """
    if isinstance(message_or_items, Mapping):
        calls = _chat_calls(message_or_items)
    else:
        calls = _responses_calls(message_or_items)
    return [call for call in calls if _is_side_effect(rules.get(call.name))]


def _is_side_effect(rule: ToolRule | None) -> bool:
    return rule is not None and rule.side_effect


_ARGUMENTS_FIELD: Mapping[CallKind, str] = {"function": "arguments", "custom": "input"}


def _chat_calls(message: Mapping[str, Any]) -> list[ToolCall]:
    calls: list[ToolCall] = []
    tool_calls = message.get("tool_calls")
    for index, raw in enumerate(tool_calls if isinstance(tool_calls, list) else ()):
        if not isinstance(raw, Mapping) or not isinstance(raw.get("id"), str):
            continue
        kind: CallKind = "custom" if raw.get("type") == "custom" else "function"
        body = raw.get(kind)  # {"function": {name, arguments}} or {"custom": {name, input}}
        if isinstance(body, Mapping) and isinstance(body.get("name"), str):
            arguments = _arguments_text(body.get(_ARGUMENTS_FIELD[kind]))
            calls.append(ToolCall(raw["id"], body["name"], arguments, "chat", kind, index))
    legacy = message.get("function_call")
    if isinstance(legacy, Mapping) and isinstance(legacy.get("name"), str):
        # Legacy calls carry no id; items.py pairs them with their result by name.
        call_id = legacy_call_id(legacy["name"])
        arguments = _arguments_text(legacy.get("arguments"))
        calls.append(ToolCall(call_id, legacy["name"], arguments, "chat", "function", len(calls)))
    return calls


_RESPONSES_CALL_KINDS: Mapping[str, CallKind] = {
    "function_call": "function",
    "custom_tool_call": "custom",
}


def _responses_calls(items: Sequence[Mapping[str, Any]]) -> list[ToolCall]:
    calls: list[ToolCall] = []
    for index, raw in enumerate(items):
        item_type = raw.get("type") if isinstance(raw, Mapping) else None
        kind = _RESPONSES_CALL_KINDS.get(item_type) if isinstance(item_type, str) else None
        if kind is None:
            continue
        call_id, name = raw.get("call_id"), raw.get("name")
        if isinstance(call_id, str) and isinstance(name, str):
            arguments = _arguments_text(raw.get(_ARGUMENTS_FIELD[kind]))
            calls.append(ToolCall(call_id, name, arguments, "responses", kind, index))
    return calls


def item_calls(item: Item) -> list[ToolCall]:
    """The function and custom tool calls one history item makes (legacy Chat
    `function_call`s, which carry no id, are left out)."""
    if item.api == "chat":
        return [c for c in _chat_calls(item.raw) if c.call_id != legacy_call_id(c.name)]
    return _responses_calls([item.raw])


def _arguments_text(value: Any) -> str:
    """Arguments as the string the provider sent; some compatible servers send an object."""
    if isinstance(value, str):
        return value
    return "" if value is None else canonical_json(value)


# -- the idempotency key --------------------------------------------------------------------


@dataclass(frozen=True)
class RenderedKey:
    """A ledger key. `fallback` means the template could not be used; log `reason`."""

    key: str
    fallback: bool
    reason: str | None


def render_idempotency_key(rule: ToolRule, call: ToolCall) -> RenderedKey:
    """The call's ledger key: the policy template filled from the JSON arguments.

    Placeholders name top-level arguments (`{order_id}`) or dotted paths into objects and
    arrays (`{order.id}`, `{lines.0.sku}`). Strings render as they are, every other value
    as `json.dumps` (so 7 gives "7" and 7.0 gives "7.0": the key follows what the model
    wrote). A format spec (`{amount:.2f}`) applies to the raw value. A template without
    placeholders is a constant key (one such action per scope), whatever the arguments.

    Fallback, with `fallback=True` and a reason: no template; arguments that are not a
    JSON object; a placeholder whose argument is missing, null or "" (a key built from
    "nothing" would make unrelated calls collide); a rendered key holding a NUL or a lone
    surrogate, or longer than MAX_KEY_LENGTH, which the stores cannot keep. The fallback
    key is
    `<tool>:sha256:<hex>` over the canonical JSON of the arguments (sorted keys, compact),
    or over the raw string when they do not parse, so only an identical call matches.
    """
    template = rule.idempotency_key
    if template is None:
        return _fallback(call, "no idempotency_key template for this tool")
    fields = _template_fields(template)
    if not fields:
        return RenderedKey(template, False, None)
    arguments = _parsed_arguments(call.arguments)
    if not isinstance(arguments, Mapping):
        return _fallback(call, f"arguments of {call.name} are not a JSON object")
    try:
        key = _render(template, arguments)
    except _MissingArgument as missing:
        return _fallback(call, f"template {template!r}: argument {missing} is missing or empty")
    except (TypeError, ValueError) as exc:
        return _fallback(call, f"template {template!r} cannot render: {exc}")
    if not _storable(key):
        return _fallback(
            call, f"template {template!r} renders a NUL, a lone surrogate or an overlong key"
        )
    return RenderedKey(key, False, None)


def _storable(key: str) -> bool:
    """A key both stores can keep: PostgreSQL TEXT refuses NUL and its index a key above
    ~2.7 kB, and neither database binds a lone surrogate (the model's JSON arguments may
    escape either)."""
    if "\x00" in key or len(key) > MAX_KEY_LENGTH:
        return False
    try:
        key.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


class _MissingArgument(LookupError):
    pass


_NOT_JSON = object()


def _parsed_arguments(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except ValueError:
        return _NOT_JSON


def _fallback(call: ToolCall, reason: str) -> RenderedKey:
    return RenderedKey(f"{call.name}:sha256:{arguments_digest(call.arguments)}", True, reason)


def arguments_digest(arguments: str) -> str:
    """Hex sha256 of the arguments' canonical JSON: key order and spacing do not count."""
    parsed = _parsed_arguments(arguments)
    text = arguments if parsed is _NOT_JSON else canonical_json(parsed)
    # surrogatepass: JSON may escape a lone surrogate ("\ud800"), which UTF-8 refuses
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def _template_fields(template: str) -> list[str]:
    return [field for _, field, _, _ in string.Formatter().parse(template) if field is not None]


def _render(template: str, arguments: Mapping[str, Any]) -> str:
    parts: list[str] = []
    for literal, field, spec, conversion in string.Formatter().parse(template):
        parts.append(literal)
        if field is not None:
            parts.append(_render_value(_lookup(arguments, field), spec or "", conversion))
    return "".join(parts)


def _lookup(arguments: Mapping[str, Any], path: str) -> Any:
    value: Any = arguments
    for step in path.split("."):
        if isinstance(value, Mapping) and step in value:
            value = value[step]
        elif isinstance(value, list) and step.isdigit() and int(step) < len(value):
            value = value[int(step)]
        else:
            raise _MissingArgument(path)
    if value is None or value == "":
        raise _MissingArgument(path)
    return value


def _render_value(value: Any, spec: str, conversion: str | None) -> str:
    if conversion is not None:
        value = {"r": repr, "a": ascii}.get(conversion, str)(value)
    if spec:
        return format(value, spec)
    if isinstance(value, str):
        return value
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def ledger_scope(rule: ToolRule, thread_id: str | None) -> str:
    """The ledger scope: "tenant", or "thread:<id>" for a thread-scoped tool.

    A thread-scoped rule on a stateless request (no thread id) uses the tenant scope:
    a wider scope can only block more duplicates, never hand out a second refund.
    """
    if rule.scope == "thread" and thread_id:
        return f"thread:{thread_id}"
    return "tenant"


# -- what to do with a call whose key is in the ledger -------------------------------------


class Decision(enum.Enum):
    HAND_OUT = "hand_out"  # give the call to the client
    REPLAY = "replay"  # answer the model with the recorded result
    BLOCK = "block"  # answer the model "already done"
    UNKNOWN_OUTCOME = "unknown_outcome"  # answer "outcome unknown, check"; log loudly
    FAILED_BEFORE = "failed_before"  # hand out again, after re-arming the failed entry


def decide(
    existing_status: str | None,
    created_now: bool,
    existing_call_id: str | None,
    call_id: str,
    rule: ToolRule,
) -> Decision:
    """What to do with `call_id`, given the ledger entry its key maps to (SPEC 6).

    Called after `Store.ledger_issue`: `created_now` says this call wrote the entry.

    ==========  ===========  ==========  =================================================
    created     status       same call   decision
    ==========  ===========  ==========  =================================================
    yes         (issued)     (yes)       HAND_OUT: a fresh call
    no          issued       yes         HAND_OUT: the same call emitted again (a retried
                                         or re-read response); the client sees one call id
    no          completed    yes         REPLAY: its own recorded output, whatever
                                         on_duplicate says (it is not a duplicate)
    no          failed       yes         REPLAY: its own recorded failure
    no          completed    no          REPLAY if on_duplicate is replay, else BLOCK
    no          issued       no          UNKNOWN_OUTCOME: never hand out twice (seed 10:
                                         "submitted" is not "not done")
    no          failed       no          FAILED_BEFORE (see below)
    no          None / other             ValueError: a bug in the caller
    ==========  ===========  ==========  =================================================

    FAILED_BEFORE: a `failed` entry is only written when the client's own output for the
    earlier call said it failed (`output_outcome`) or an operator resolved it so; the
    side effect did not happen, so the new call may go out. The edge must first re-arm
    the entry with a conditional update (failed -> issued, the new call id, attempts + 1)
    and hand the call out only if that update won; a loser decides again.
    """
    if created_now:
        return Decision.HAND_OUT
    same_call = existing_call_id == call_id
    if existing_status == "issued":
        return Decision.HAND_OUT if same_call else Decision.UNKNOWN_OUTCOME
    if existing_status == "completed":
        if same_call or rule.on_duplicate == "replay":
            return Decision.REPLAY
        return Decision.BLOCK
    if existing_status == "failed":
        return Decision.REPLAY if same_call else Decision.FAILED_BEFORE
    raise ValueError(f"no ledger entry decision for status {existing_status!r}")


def dangling_decision(existing_status: str) -> Decision:
    """What answers a call left dangling (handed out, never answered, and the thread moved
    on: the client crashed after receiving it), given its own ledger entry.

    issued: UNKNOWN_OUTCOME (the call may or may not have run; the model must check
    first). completed / failed: REPLAY of its own recorded result (the output reached the
    ledger another way: an operator resolved it, or another request carried it).
    """
    if existing_status == "issued":
        return Decision.UNKNOWN_OUTCOME
    if existing_status in ("completed", "failed"):
        return Decision.REPLAY
    raise ValueError(f"no dangling-call decision for status {existing_status!r}")


# -- calls left without an output ----------------------------------------------------------


def dangling_calls(known: Sequence[Item], new: Sequence[Item]) -> list[ToolCall]:
    """Function and custom calls of `known` + `new` that no output of either answers, in
    log order. The provider refuses a request holding one ("No tool output found for
    function call ..."), so the edge answers each before anything is sent."""
    items = (*known, *new)
    answered = {item.output_for for item in items if item.output_for is not None}
    # Only an item with an unanswered call id is parsed for its calls (every call id
    # item_calls returns is among the item's call_ids, read once when it was built).
    open_ids = {call_id for item in items for call_id in item.call_ids} - answered
    if not open_ids:
        return []
    unpaired = [item for item in items if not open_ids.isdisjoint(item.call_ids)]
    return [call for item in unpaired for call in item_calls(item) if call.call_id in open_ids]


def place_answers(new: Sequence[Item], answers: Mapping[str, Item]) -> list[Item]:
    """`new` with each answer (keyed by the call id it answers) where the provider expects
    it: answers to calls of the stored window come first (right after the window, which
    ends with those calls); an answer to a call inside `new` follows that call and the
    calls and outputs right after it (Chat: a tool_calls message must be followed by its
    tool messages)."""
    position = {call_id: index for index, item in enumerate(new) for call_id in item.call_ids}
    placed: list[Item] = [answer for call_id, answer in answers.items() if call_id not in position]
    after: dict[int, list[Item]] = {}
    for call_id, answer in answers.items():
        if call_id in position:
            after.setdefault(_end_of_calls(new, position[call_id]), []).append(answer)
    for index, item in enumerate(new):
        placed += [item, *after.get(index, ())]
    return placed


def _end_of_calls(items: Sequence[Item], index: int) -> int:
    """The last index of the run of outputs (Responses: and parallel calls) after `index`."""
    seen_output = False
    while index + 1 < len(items):
        following = items[index + 1]
        parallel_call = following.kind == "tool_calls" and following.api == "responses"
        if following.kind == "tool_output":
            seen_output = True
        elif not parallel_call or seen_output:
            break
        index += 1
    return index


# -- answers fed back to the model instead of the client's output --------------------------

REPLAY_NOTE = "This action was already performed; this is the recorded result of the earlier call."


def model_output(
    call: ToolCall,
    decision: Decision,
    entry_result: str | None,
    earlier_call_id: str | None,
    at: str,
    key: str | None = None,
) -> dict[str, Any]:
    """The output item answering `call` in the provider's own shape, so it accepts it.

    `at` is when the earlier call was issued, `key` its idempotency key (both shown for
    UNKNOWN_OUTCOME so an operator can check the business system). HAND_OUT and
    FAILED_BEFORE have no synthetic output: the call goes to the client.
    """
    text = canonical_json(_output_body(decision, entry_result, earlier_call_id, at, key))
    return _output_item(call, text)


UNANSWERED_NOTE = (
    "No output was ever recorded for this call: the client did not report running it. "
    "Do not assume it ran; call the tool again if its result is still needed."
)


def unanswered_output(call: ToolCall) -> dict[str, Any]:
    """The answer to a dangling call the ledger does not guard (not side-effecting)."""
    body = {"threadkeeper": "no_output", "call_id": call.call_id, "note": UNANSWERED_NOTE}
    return _output_item(call, canonical_json(body))


SYNTHETIC_KINDS = frozenset({"replay", "blocked", "outcome_unknown", "no_output"})


def is_synthetic_output(raw: Mapping[str, Any]) -> bool:
    """Whether a tool output is one this module wrote (model_output, unanswered_output)
    rather than the client's: its text is a JSON object tagged "threadkeeper"."""
    text = raw.get("content") if "role" in raw else raw.get("output")
    if not isinstance(text, str) or '"threadkeeper"' not in text:
        return False
    parsed = _parsed_arguments(text)
    return isinstance(parsed, Mapping) and parsed.get("threadkeeper") in SYNTHETIC_KINDS


def _output_item(call: ToolCall, text: str) -> JsonDict:
    if call.api == "chat":
        return {"role": "tool", "tool_call_id": call.call_id, "content": text}
    item_type = "custom_tool_call_output" if call.kind == "custom" else "function_call_output"
    return {"type": item_type, "call_id": call.call_id, "output": text}


def _output_body(
    decision: Decision,
    entry_result: str | None,
    earlier_call_id: str | None,
    at: str,
    key: str | None,
) -> dict[str, Any]:
    if decision is Decision.REPLAY:
        return {
            "threadkeeper": "replay",
            "replay_of": earlier_call_id,
            "note": REPLAY_NOTE,
            "result": _result_value(entry_result),
        }
    if decision is Decision.BLOCK:
        return {
            "threadkeeper": "blocked",
            "replay_of": earlier_call_id,
            "note": f"This action was already performed (call {earlier_call_id}); "
            "it was not run again.",
        }
    if decision is Decision.UNKNOWN_OUTCOME:
        return {
            "threadkeeper": "outcome_unknown",
            "earlier_call_id": earlier_call_id,
            "note": f"An identical action was issued at {at} but its outcome was never "
            "reported. It was NOT run again. Check the business system (e.g. by its "
            "idempotency key) before retrying.",
            "idempotency_key": key,
        }
    raise ValueError(f"{decision.name} hands the call to the client; it has no model output")


def _result_value(result: str | None) -> Any:
    """The recorded result as JSON when it is JSON, so the model reads one document."""
    if result is None:
        return None
    parsed = _parsed_arguments(result)
    return result if parsed is _NOT_JSON else parsed


# -- the client's outputs -------------------------------------------------------------------

_FAILED_STATES = frozenset({"failed", "error", "failure"})
_FAILED_TEXT = re.compile(r"\s*(error|failed|exception|traceback)\b", re.IGNORECASE)


def ledger_result(output: Any) -> str:
    """What an entry keeps of the client's output (replayed to the model on a duplicate):
    a string as is, anything else as canonical JSON. A NUL becomes U+FFFD: PostgreSQL
    TEXT cannot hold it, and the provider got the output itself unchanged."""
    text = output if isinstance(output, str) else canonical_json(output)
    return text.replace("\x00", "\ufffd")


def output_outcome(output: str | list[Any] | dict[str, Any]) -> Outcome:
    """Whether a client's tool output reports a failure (the ledger entry's end state).

    Failed when the output is a JSON object with a truthy "error" (or MCP's "isError" /
    "is_error"), a "status" or "state" of failed/error/failure, or "ok"/"success" set to
    false; or when its text starts (case-insensitive, after whitespace) with the word
    error, failed, exception or traceback. A list of content parts is judged by its text
    parts joined. Anything else is completed: a tool that reports nothing failed.
    """
    if isinstance(output, Mapping):
        return "failed" if _object_failed(output) else "completed"
    text = output if isinstance(output, str) else message_text(output)
    parsed = _parsed_arguments(text)
    if isinstance(parsed, Mapping):
        return "failed" if _object_failed(parsed) else "completed"
    if isinstance(parsed, str):
        text = parsed
    return "failed" if _FAILED_TEXT.match(text) else "completed"


def _object_failed(output: Mapping[str, Any]) -> bool:
    if output.get("error") or output.get("isError") or output.get("is_error"):
        return True
    for field in ("status", "state"):
        value = output.get(field)
        if isinstance(value, str) and value.lower() in _FAILED_STATES:
            return True
    return output.get("ok") is False or output.get("success") is False


_RESPONSES_OUTPUT_TYPES = frozenset({"function_call_output", "custom_tool_call_output"})


def outputs_in(
    items_or_messages: str | Sequence[Mapping[str, Any]], api: Api
) -> list[tuple[str, Any]]:
    """(call id, output) for each tool output the client sent, in order.

    Chat: `tool` messages (and legacy `function` messages, by the legacy call id);
    Responses: function_call_output and custom_tool_call_output items. A string
    Responses input holds no outputs.
    """
    if isinstance(items_or_messages, str):
        return []
    found: list[tuple[str, Any]] = []
    for raw in items_or_messages:
        pair = _chat_output(raw) if api == "chat" else _responses_output(raw)
        if pair is not None:
            found.append(pair)
    return found


def _chat_output(message: Any) -> tuple[str, Any] | None:
    if not isinstance(message, Mapping):
        return None
    if message.get("role") == "tool" and isinstance(message.get("tool_call_id"), str):
        return message["tool_call_id"], message.get("content")
    if message.get("role") == "function" and isinstance(message.get("name"), str):
        return legacy_call_id(message["name"]), message.get("content")
    return None


def _responses_output(item: Any) -> tuple[str, Any] | None:
    if not isinstance(item, Mapping) or item.get("type") not in _RESPONSES_OUTPUT_TYPES:
        return None
    call_id = item.get("call_id")
    return (call_id, item.get("output")) if isinstance(call_id, str) else None
