"""Operator commands on the store: `threadkeeper threads ...` and `threadkeeper ledger ...`.

They open the store `serve` would open (same flags, environment and config file), so an
operator reads and repairs exactly what the proxy serves. Every command returns JSON-able
data; `proxy/cli.py` prints it as a table, or as JSON with `--json`. A problem the operator
can fix (a bad store URL, an unknown thread, an ambiguous id) raises AdminError, which the
CLI prints as one line with exit code 2.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from proxy.clock import utc_now
from proxy.core.blocks import compile_pins, is_pinned
from proxy.core.checkpoint import state_to_cut
from proxy.core.compress import COMPRESSED_KEY
from proxy.core.items import Item, JsonDict, chat_item, content_digest, message_text, responses_item
from proxy.core.ledger import ledger_result
from proxy.core.tokens import TokenCounter
from proxy.ids import item_id_for, new_id
from proxy.store.base import (
    AlreadyExists,
    LedgerEntry,
    LedgerStatus,
    NewItem,
    NotFound,
    Store,
    StoredItem,
    Thread,
)

EXPORT_OBJECT = "threadkeeper.thread"
TEXT_PREVIEW = 72  # characters of an item's text in `threads show`


class AdminError(Exception):
    """A problem the operator can fix; printed as one line, exit code 2."""


@dataclass(frozen=True)
class Row:
    """One table: column titles and rows of cells (already strings)."""

    columns: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]


def table(data: Row) -> str:
    widths = [len(c) for c in data.columns]
    for row in data.rows:
        widths = [max(w, len(cell)) for w, cell in zip(widths, row, strict=True)]
    lines = [data.columns, *data.rows]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)).rstrip()
        for line in lines
    )


# --- threads ------------------------------------------------------------------------------


async def resolve_thread(store: Store, thread_id: str, tenant: str | None) -> Thread:
    """The thread with this id; without --tenant the id must exist in exactly one tenant."""
    if tenant is not None:
        thread = await store.get_thread(tenant, thread_id)
        if thread is None:
            raise AdminError(f"no thread {thread_id!r} for tenant {tenant!r}")
        return thread
    found = await store.find_threads(thread_id)
    if not found:
        raise AdminError(f"no thread {thread_id!r} in any tenant")
    if len(found) > 1:
        tenants = ", ".join(t.tenant for t in found)
        raise AdminError(f"thread id {thread_id!r} exists for tenants {tenants}: pass --tenant")
    return found[0]


def thread_json(thread: Thread) -> JsonDict:
    cut = state_to_cut(thread.state)
    return {
        "object": EXPORT_OBJECT,
        "tenant": thread.tenant,
        "id": thread.id,
        "kind": thread.kind,
        "metadata": dict(thread.metadata),
        "created_at": thread.created_at,
        "items": thread.next_seq,
        "window_start": cut.start if cut is not None else None,
    }


async def list_threads(store: Store, tenant: str | None, limit: int) -> list[JsonDict]:
    return [thread_json(t) for t in await store.list_threads(tenant, limit=limit)]


def threads_table(threads: Sequence[JsonDict]) -> Row:
    return Row(
        ("TENANT", "ID", "KIND", "ITEMS", "WINDOW FROM", "CREATED"),
        tuple(
            (
                t["tenant"],
                t["id"],
                t["kind"],
                str(t["items"]),
                "-" if t["window_start"] is None else str(t["window_start"]),
                t["created_at"],
            )
            for t in threads
        ),
    )


async def show_thread(
    store: Store,
    thread_id: str,
    tenant: str | None,
    *,
    pin_patterns: tuple[str, ...] = (),
    detail: bool = False,
    first_seq: int | None = None,
    max_items: int | None = None,
) -> JsonDict:
    """The thread's log, where its verbatim window starts, what stands for the cut part
    (carried pinned items and summaries) and the compressed forms of tool results.

    Items the projection always keeps (instructions, user messages matching the tenant's
    `pin_patterns`) are marked `pinned`. With `detail` each log entry also carries its
    whole text (`full`) and the tool call ids it issues or answers (`call_ids`), which the
    inspector's timeline shows. `max_items` bounds the log to that many items from
    `first_seq` on (the last ones when `first_seq` is None): one page of a long thread."""
    thread = await resolve_thread(store, thread_id, tenant)
    first, last = 0, thread.next_seq - 1
    if max_items is not None:
        first = max(0, last - max_items + 1) if first_seq is None else max(0, first_seq)
        last = min(last, first + max_items - 1)
    items = await _log(store, thread, first, last)
    cut = state_to_cut(thread.state)
    counter = TokenCounter.for_model("*")
    originals = {stored.seq: stored for stored in items}
    pins = compile_pins(pin_patterns)
    log = []
    for stored in items:
        item = _item_of(stored)
        entry: JsonDict = {
            "seq": stored.seq,
            "id": stored.item_id,
            "api": stored.api,
            "type": _item_kind(item),
            "tokens": stored.tokens,
            "text": _preview(item),
            "cut": cut is not None and stored.seq < cut.start,
            "pinned": is_pinned(item, pins),
        }
        if detail:
            entry["full"] = _full_text(item)
            entry["call_ids"] = _call_ids(item)
        log.append(entry)
    return {
        **thread_json(thread),
        "log": log,
        # `opening`: one of the thread's opening turns' items, sent verbatim (the head).
        "summary": [
            {
                "type": _item_kind(item),
                "tokens": counter.item(item),
                "text": item.text(),
                "opening": cut is not None and index < cut.opening,
            }
            for index, item in enumerate(cut.summary if cut is not None else ())
        ],
        "compressed": [
            {
                "seq": seq,
                "original_tokens": originals[seq].tokens if seq in originals else None,
                "tokens": counter.item(item),
                "text": _compressed_text(item),
            }
            for seq, item in (cut.compressed if cut is not None else ())
        ],
    }


def show_text(shown: JsonDict) -> str:
    lines = [
        f"thread {shown['id']}  tenant {shown['tenant']}  kind {shown['kind']}  "
        f"items {shown['items']}  created {shown['created_at']}",
        "",
    ]
    rows = []
    start = shown["window_start"]
    for entry in shown["log"]:
        if start is not None and entry["seq"] == start:
            rows.append(
                ("----", f"---- cut: the model sees items from seq {start} on ----", "", "")
            )
        rows.append((str(entry["seq"]), entry["type"], str(entry["tokens"]), entry["text"]))
    lines.append(table(Row(("SEQ", "TYPE", "TOKENS", "TEXT"), tuple(rows))))
    if shown["summary"]:
        lines += ["", "Stands for the cut part (sent before the window):"]
        for block in shown["summary"]:
            verbatim = ", opening turn, verbatim" if block["opening"] else ""
            lines += [f"[{block['type']}, {block['tokens']} tokens{verbatim}]", block["text"], ""]
    if shown["compressed"]:
        lines += ["", "Compressed tool results:"]
        for entry in shown["compressed"]:
            lines.append(
                f"seq {entry['seq']}: {entry['original_tokens']} -> {entry['tokens']} tokens"
            )
    return "\n".join(lines).rstrip()


async def delete_thread(store: Store, thread_id: str, tenant: str | None) -> JsonDict:
    thread = await resolve_thread(store, thread_id, tenant)
    await store.delete_thread(thread.tenant, thread.id)
    return {"object": f"{EXPORT_OBJECT}.deleted", "tenant": thread.tenant, "id": thread.id}


async def fork_thread(
    store: Store, thread_id: str, tenant: str | None, at_item: str | None
) -> JsonDict:
    """A copy of the thread's items up to and including `at_item` (all when None)."""
    thread = await resolve_thread(store, thread_id, tenant)
    through = thread.next_seq - 1
    if at_item is not None:
        stored = await store.get_item(thread.tenant, thread.id, at_item)
        if stored is None:
            raise AdminError(f"no item {at_item!r} in thread {thread.id!r}")
        through = stored.seq
    fork_id = new_id("conv" if thread.kind == "conversation" else "thread")
    try:
        fork = await store.fork_thread(
            thread.tenant, thread.id, fork_id, through_seq=through, now=utc_now()
        )
    except NotFound:
        raise AdminError(f"thread {thread.id!r} was deleted meanwhile") from None
    return thread_json(fork)


async def export_thread(
    store: Store, thread_id: str, tenant: str | None, fmt: Literal["jsonl", "openai"]
) -> list[JsonDict]:
    """jsonl: the thread's header line, then each item as stored (re-importable).
    openai: the log as Responses input items, to replay as `input=`."""
    thread = await resolve_thread(store, thread_id, tenant)
    items = await _log(store, thread)
    if fmt == "openai":
        return responses_input(_item_of(stored) for stored in items)
    header = {k: v for k, v in thread_json(thread).items() if k != "window_start"}
    return [
        header,
        *(
            {"seq": s.seq, "id": s.item_id, "api": s.api, "role": s.role, "raw": s.raw}
            for s in items
        ),
    ]


async def import_thread(
    store: Store, lines: Iterable[str], tenant: str | None, thread_id: str | None
) -> JsonDict:
    """A new thread from a `threads export --format jsonl` file (tenant and id from the
    file unless given)."""
    header, entries = _parse_export(lines)
    tenant = tenant or _required_str(header, "tenant", 1)
    thread_id = thread_id or _required_str(header, "id", 1)
    kind = header.get("kind")
    if kind not in ("conversation", "chat", "responses"):
        raise AdminError(f"line 1: 'kind' must be conversation, chat or responses, not {kind!r}")
    metadata = header.get("metadata") or {}
    if not isinstance(metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise AdminError("line 1: 'metadata' must map strings to strings")
    counter = TokenCounter.for_model("*")
    new_items = [_new_item(entry, number, counter) for number, entry in entries]
    try:
        thread = await store.create_thread(
            tenant, thread_id, kind=kind, metadata=metadata, items=new_items, now=utc_now()
        )
    except AlreadyExists:
        raise AdminError(
            f"thread {thread_id!r} already exists for tenant {tenant!r}: pass --id NEW_ID"
        ) from None
    return thread_json(thread)


def responses_input(items: Iterable[Item]) -> list[JsonDict]:
    """Items as Responses input items: Responses items as they are; Chat messages become
    messages, function_call and function_call_output items, in order."""
    converted: list[JsonDict] = []
    for item in items:
        if item.api == "responses":
            converted.append(_without_output_ids(item.raw))
            continue
        raw = item.raw
        role = raw.get("role")
        if role == "tool":
            converted.append(
                {
                    "type": "function_call_output",
                    "call_id": raw.get("tool_call_id", ""),
                    "output": message_text(raw.get("content")),
                }
            )
            continue
        text = message_text(raw.get("content"))
        if text or not raw.get("tool_calls"):
            converted.append({"type": "message", "role": role, "content": text})
        for call in raw.get("tool_calls") or []:
            function = call.get("function") or {}
            converted.append(
                {
                    "type": "function_call",
                    "call_id": call.get("id", ""),
                    "name": function.get("name", ""),
                    "arguments": function.get("arguments", ""),
                }
            )
    return converted


async def explain_request(store: Store, request_id: str, tenant: str | None) -> JsonDict:
    """The explain record of one model request (the x-threadkeeper-request-id header)."""
    found = await store.explain_get(tenant, request_id)
    if found is None:
        raise AdminError(f"no explain record {request_id!r} (kept for explain_retention_seconds)")
    return found.record


def explain_text(record: JsonDict) -> str:
    projection = record["projection"]
    lines = [
        f"request {record['id']}  tenant {record.get('tenant', '-')}  "
        f"thread {record.get('thread_id', '-')}  status {record['status']}  "
        f"{record['latency_ms']} ms",
        f"window {projection['window']} = pinned {projection['system']} + tools "
        f"{projection['tools']} + history {projection['history_after']} (budget "
        f"{projection['history_budget']}, was {projection['history_before']}) + current turn "
        f"{projection['current']} + output reserve {projection['output']} + margin "
        f"{projection['epsilon']}",
        f"prompt tokens: estimated {projection['prompt_tokens']}, provider reported "
        f"{record.get('usage_input_tokens', '-')}; retries {record.get('retries', '-')}",
        "",
        table(
            Row(
                ("BLOCK", "ITEMS", "TOKENS BEFORE", "AFTER", "DECISION"),
                tuple(
                    (
                        b["kind"],
                        f"{b['first']}-{b['last']}",
                        str(b["tokens_before"]),
                        str(b["tokens_after"]),
                        b["action"],
                    )
                    for b in projection["blocks"]
                ),
            )
        ),
    ]
    for verdict in record.get("ledger", []):
        lines.append(f"ledger: {verdict['tool']} {verdict['key']}: {verdict['verdict']}")
    for stand_in in record.get("stand_ins", []):
        lines += ["", f"[{stand_in['kind']} sent at position {stand_in['position']}]"]
        lines.append(stand_in["text"])
    return "\n".join(lines)


# --- what the model saw ----------------------------------------------------------------------

BAR_GLYPHS = {
    "pinned": "#",
    "tools": "T",
    "summary": "S",
    "history": "=",
    "current": "@",
    "output reserve": "o",
    "margin": "~",
    "free": ".",
}


def token_bar(projection: Mapping[str, Any]) -> list[tuple[str, int]]:
    """The window split into what one request sent and what it left: pinned (system
    text, instructions, reply priming), tools, summaries, the kept history, the current
    turn (these sum to its prompt tokens), then the output reserve, the margin and what
    stayed free. `projection` is an explain record's `projection`."""
    summary = sum(b["tokens_after"] for b in projection["blocks"] if b["kind"] == "summary")
    sent = [
        ("pinned", projection["system"]),
        ("tools", projection["tools"]),
        ("summary", summary),
        ("history", projection["history_after"] - summary),
        ("current", projection["current"]),
    ]
    reserve = [("output reserve", projection["output"]), ("margin", projection["epsilon"])]
    used = projection["prompt_tokens"] + projection["output"] + projection["epsilon"]
    return [*sent, *reserve, ("free", max(0, projection["window"] - used))]


def token_bar_text(projection: Mapping[str, Any], width: int = 72) -> str:
    """The bar for a terminal: one glyph per window/width tokens, and a legend."""
    segments = token_bar(projection)
    total = max(1, sum(tokens for _, tokens in segments))
    cells = "".join(
        BAR_GLYPHS[name] * round(tokens * width / total) for name, tokens in segments if tokens
    )
    legend = "  ".join(f"{BAR_GLYPHS[name]} {name} {tokens}" for name, tokens in segments)
    return f"[{cells[:width]}]\n{legend}"


# --- ledger -------------------------------------------------------------------------------


def ledger_json(entry: LedgerEntry) -> JsonDict:
    return {
        "tenant": entry.tenant,
        "scope": entry.scope,
        "key": entry.key,
        "tool": entry.tool,
        "call_id": entry.call_id,
        "thread_id": entry.thread_id,
        "status": entry.status,
        "attempts": entry.attempts,
        "arguments": entry.arguments,
        "result": entry.result,
        "created_at": entry.created_at,
        "updated_at": entry.updated_at,
    }


def ledger_table(entries: Sequence[JsonDict]) -> Row:
    return Row(
        ("TENANT", "SCOPE", "KEY", "TOOL", "STATUS", "ATTEMPTS", "CREATED"),
        tuple(
            (
                e["tenant"],
                e["scope"],
                e["key"],
                e["tool"],
                e["status"],
                str(e["attempts"]),
                e["created_at"],
            )
            for e in entries
        ),
    )


async def ledger_list(
    store: Store, tenant: str | None, status: LedgerStatus | None, limit: int
) -> list[JsonDict]:
    return [ledger_json(e) for e in await store.ledger_list(tenant, status=status, limit=limit)]


async def ledger_for_calls(store: Store, tenant: str, call_ids: Iterable[str]) -> list[JsonDict]:
    """The ledger entries of these tool calls (a thread's), in call order."""
    entries = []
    for call_id in dict.fromkeys(call_ids):
        entry = await store.ledger_by_call(tenant, call_id)
        if entry is not None:
            entries.append(ledger_json(entry))
    return entries


async def ledger_show(store: Store, tenant: str, scope: str, key: str) -> JsonDict:
    entry = await store.ledger_get(tenant, scope, key)
    if entry is None:
        raise AdminError(f"no ledger entry {scope}/{key} for tenant {tenant!r}")
    return ledger_json(entry)


async def ledger_resolve(
    store: Store,
    tenant: str,
    scope: str,
    key: str,
    status: Literal["completed", "failed"],
    result: str | None,
) -> JsonDict:
    """Settles an entry whose outcome the client never reported (only an `issued` one)."""
    entry = await store.ledger_get(tenant, scope, key)
    if entry is None:
        raise AdminError(f"no ledger entry {scope}/{key} for tenant {tenant!r}")
    kept = None if result is None else ledger_result(result)
    resolved = await store.ledger_resolve(
        tenant, scope, key, status=status, result=kept, now=utc_now()
    )
    if not resolved:
        raise AdminError(f"ledger entry {scope}/{key} is {entry.status!r}; only 'issued' resolves")
    return await ledger_show(store, tenant, scope, key)


# --- helpers ------------------------------------------------------------------------------


async def _log(
    store: Store, thread: Thread, first: int = 0, last: int | None = None
) -> tuple[StoredItem, ...]:
    """The log (the part before the cut included), whole unless bounded."""
    last = thread.next_seq - 1 if last is None else last
    return await store.items_between(thread.tenant, thread.id, first, last)


def _item_of(stored: StoredItem) -> Item:
    return chat_item(stored.raw) if stored.api == "chat" else responses_item(stored.raw)


def _item_kind(item: Item) -> str:
    if item.api == "chat":
        role = item.raw.get("role", "?")
        return f"{role} (tool calls)" if item.raw.get("tool_calls") else str(role)
    kind = item.raw.get("type", "message")
    return f"{kind} {item.raw.get('role', '')}".strip() if kind == "message" else str(kind)


def _full_text(item: Item) -> str:
    """What the item says: its text, else a tool call's arguments or a tool result."""
    text = item.text() or item.raw.get("output") or item.raw.get("arguments") or ""
    if item.api == "chat" and item.raw.get("tool_calls"):
        calls = [
            f"{(call.get('function') or {}).get('name', '')}"
            f"({(call.get('function') or {}).get('arguments', '')})"
            for call in item.raw["tool_calls"]
            if isinstance(call, dict)
        ]
        text = "\n".join([text, *calls]) if text else "\n".join(calls)
    return text if isinstance(text, str) else json.dumps(text, ensure_ascii=False)


def _preview(item: Item) -> str:
    text = " ".join(_full_text(item).split())
    return text if len(text) <= TEXT_PREVIEW else text[: TEXT_PREVIEW - 1] + "…"


def _call_ids(item: Item) -> list[str]:
    """The tool call ids the item issues (a call) or answers (a result)."""
    raw = item.raw
    if item.api == "chat":
        ids = [c.get("id") for c in raw.get("tool_calls") or [] if isinstance(c, dict)]
        ids.append(raw.get("tool_call_id"))
    else:
        ids = [raw.get("call_id")]
    return [i for i in ids if isinstance(i, str) and i]


def _compressed_text(item: Item) -> str:
    text = item.raw.get("content") if item.api == "chat" else item.raw.get("output")
    return text if isinstance(text, str) and COMPRESSED_KEY in text else item.text()


def _without_output_ids(raw: Mapping[str, Any]) -> JsonDict:
    """Output items replayed as input keep their content; their provider ids (msg_...,
    fc_...) belong to the original response, so they are dropped."""
    return {k: v for k, v in raw.items() if k not in ("id", "status")}


def _parse_export(lines: Iterable[str]) -> tuple[JsonDict, list[tuple[int, JsonDict]]]:
    parsed: list[tuple[int, JsonDict]] = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except ValueError as exc:
            raise AdminError(f"line {number}: not JSON ({exc})") from None
        if not isinstance(value, dict):
            raise AdminError(f"line {number}: expected a JSON object")
        parsed.append((number, value))
    if not parsed or parsed[0][1].get("object") != EXPORT_OBJECT:
        raise AdminError(
            f"line 1: expected the header of `threads export --format jsonl` "
            f"(object {EXPORT_OBJECT!r})"
        )
    return parsed[0][1], parsed[1:]


def _required_str(entry: Mapping[str, Any], name: str, number: int) -> str:
    value = entry.get(name)
    if not isinstance(value, str) or not value:
        raise AdminError(f"line {number}: {name!r} must be a non-empty string")
    return value


def _new_item(entry: Mapping[str, Any], number: int, counter: TokenCounter) -> NewItem:
    api = entry.get("api")
    raw = entry.get("raw")
    role = entry.get("role", "input")
    if api not in ("chat", "responses") or not isinstance(raw, dict):
        raise AdminError(f"line {number}: expected 'api' chat|responses and an object 'raw'")
    if role not in ("input", "output"):
        raise AdminError(f"line {number}: 'role' must be input or output")
    item = chat_item(raw) if api == "chat" else responses_item(raw)
    item_id = entry.get("id")
    return NewItem(
        item_id=item_id if isinstance(item_id, str) and item_id else item_id_for(raw),
        raw=raw,
        api=api,
        tokens=counter.item(item),
        encoding=counter.tokenizer_id,
        role=role,
        digest=content_digest(raw),
    )
