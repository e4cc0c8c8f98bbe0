"""Operator commands on the store: `threadkeeper threads ...` and `threadkeeper ledger ...`.

They open the store `serve` would open (same flags, environment and config file), so an
operator reads and repairs exactly what the proxy serves. Every command returns JSON-able
data; `proxy/cli.py` prints it as a table, or as JSON with `--json`. A problem the operator
can fix (a bad store URL, an unknown thread, an ambiguous id) raises AdminError, which the
CLI prints as one line with exit code 2.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, Literal, Protocol, TypeVar

from proxy import operations
from proxy.clock import utc_now
from proxy.core.blocks import compile_pins, pinned_flags
from proxy.core.checkpoint import state_to_cut
from proxy.core.compress import COMPRESSED_KEY
from proxy.core.items import Item, JsonDict, content_digest, item_of, message_text
from proxy.core.tokens import TokenCounter
from proxy.core.validate import (
    ApiError,
    NotJson,
    check_json_tree,
    duplicate_item,
    list_of_objects,
    load_json,
    metadata_param,
    store_key,
    validate_chat_message,
    validate_stored_item,
)
from proxy.ids import item_id_for, new_id
from proxy.namespaces import SEPARATOR, Scope, fields, label
from proxy.store.base import (
    AlreadyExists,
    ExplainStore,
    LedgerEntry,
    LedgerStatus,
    LedgerStore,
    NewItem,
    ResponseStore,
    StoredItem,
    StoredResponse,
    Thread,
    ThreadKind,
    ThreadStore,
)
from proxy.threads import first_orphan

EXPORT_OBJECT = "threadkeeper.thread"
TEXT_PREVIEW = 72  # characters of an item's text in `threads show`
STOOD_FOR_MAX_ITEMS = 10_000  # items stood_for_tokens reads at most (else: unknown)
_T = TypeVar("_T")
THREAD_KINDS: tuple[ThreadKind, ...] = ("conversation", "chat", "responses")


class FindStore(ThreadStore, ResponseStore, ExplainStore, Protocol):
    """What `threads find` reads: a response's or a request's thread."""


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


async def resolve_thread(store: ThreadStore, thread_id: str, tenant: str | None) -> Thread:
    """The thread with this id; without --tenant the id must exist in exactly one
    namespace. `tenant` is a namespace (`default:<hash>`), or a tenant, which includes its
    passthrough callers' namespaces (proxy/namespaces.py)."""
    if tenant is not None:
        thread = await store.get_thread(tenant, thread_id)
        if thread is not None:
            return thread
        if SEPARATOR in tenant:
            raise AdminError(f"no thread {thread_id!r} in namespace {tenant!r}")
    scope = Scope(tenant=tenant)
    found = [t for t in await store.find_threads(thread_id) if scope.matches(t.tenant)]
    if not found:
        raise AdminError(f"no thread {thread_id!r} in {scope.describe()}")
    if len(found) > 1:
        namespaces = ", ".join(t.tenant for t in found)
        raise AdminError(
            f"thread id {thread_id!r} exists in namespaces {namespaces}: pass --tenant NAMESPACE"
        )
    return found[0]


def thread_json(thread: Thread) -> JsonDict:
    cut = state_to_cut(thread.state)
    return {
        "object": EXPORT_OBJECT,
        **fields(thread.tenant),
        "id": thread.id,
        "kind": thread.kind,
        "metadata": dict(thread.metadata),
        "created_at": thread.created_at,
        "items": thread.next_seq,
        "window_start": cut.start if cut is not None else None,
    }


async def list_threads(store: ThreadStore, scope: Scope, limit: int) -> list[JsonDict]:
    """Newest first, in the scope: one namespace, or a tenant with its passthrough callers."""
    if scope.namespace is not None:
        found = await store.list_threads(scope.namespace, limit=limit)
    else:
        found = await store.list_threads(scope.tenant, limit=limit, callers=True)
    return [thread_json(t) for t in found]


def threads_table(threads: Sequence[JsonDict]) -> Row:
    return Row(
        ("TENANT", "NAMESPACE", "ID", "KIND", "ITEMS", "WINDOW FROM", "CREATED"),
        tuple(
            (
                t["tenant"],
                t["namespace"],
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
    store: ThreadStore,
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
    views = [_item_of(stored) for stored in items]
    pinned = pinned_flags(views, compile_pins(pin_patterns))
    log = []
    for stored, item, is_pinned in zip(items, views, pinned, strict=True):
        entry: JsonDict = {
            "seq": stored.seq,
            "id": stored.item_id,
            "api": stored.api,
            "type": _item_kind(item),
            "tokens": stored.tokens,
            "text": _preview(item),
            "cut": cut is not None and stored.seq < cut.start,
            "pinned": is_pinned,
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
        f"thread {shown['id']}  {label(shown['namespace'])}  kind {shown['kind']}  "
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


async def find_thread(store: FindStore, some_id: str, tenant: str | None) -> JsonDict:
    """The thread behind a response id (resp_...) or a request id (the
    x-threadkeeper-request-id header): where to point `threads show`."""
    found = await _owners(store, some_id, tenant)
    if not found:
        where = f"for tenant {tenant!r}" if tenant is not None else "in any tenant"
        raise AdminError(f"no response or request {some_id!r} {where}")
    if len(found) > 1:
        tenants = ", ".join(owner for owner, _, _ in found)
        raise AdminError(f"{some_id!r} exists for tenants {tenants}: pass --tenant")
    owner, kind, thread_id = found[0]
    thread = None if thread_id is None else await store.get_thread(owner, thread_id)
    return {
        "object": f"{EXPORT_OBJECT}.found",
        "id": some_id,
        "kind": kind,
        "tenant": owner,
        "thread_id": thread_id,
        "thread": None if thread is None else thread_json(thread),
    }


async def _owners(
    store: FindStore, some_id: str, tenant: str | None
) -> list[tuple[str, str, str | None]]:
    """(tenant, "response" or "request", thread id) of each record with this id."""
    if tenant is not None:
        stored = await store.get_response(tenant, some_id)
        responses: tuple[StoredResponse, ...] = (stored,) if stored is not None else ()
    else:
        responses = await store.find_responses(some_id)
    found = [(r.tenant, "response", r.thread_id) for r in responses]
    if not found:
        record = await store.explain_get(tenant, some_id)
        if record is not None:
            found.append((record.tenant, "request", record.thread_id))
    return found


def find_text(found: JsonDict) -> str:
    head = f"{found['kind']} {found['id']}  tenant {found['tenant']}"
    thread = found["thread"]
    if thread is not None:
        return (
            f"{head}  thread {thread['id']} ({thread['kind']}, {thread['items']} items)\n"
            f"threadkeeper threads show {thread['id']} --tenant {thread['tenant']}"
        )
    if found["thread_id"] is not None:
        return f"{head}  thread {found['thread_id']}, since deleted"
    return f"{head}  on no thread (a stateless request, or store: false)"


async def delete_thread(store: ThreadStore, thread_id: str, tenant: str | None) -> JsonDict:
    thread = await resolve_thread(store, thread_id, tenant)
    await store.delete_thread(thread.tenant, thread.id)
    return {"object": f"{EXPORT_OBJECT}.deleted", **fields(thread.tenant), "id": thread.id}


async def erase_thread(store: ThreadStore, thread_id: str, tenant: str | None) -> JsonDict:
    """The thread and everything derived from it (Store.erase_thread). A thread already
    deleted (DELETE of its conversation) is erased by id with --tenant: what it left."""
    if tenant is None:
        if not await store.find_threads(thread_id):
            raise AdminError(
                f"no thread {thread_id!r} in any tenant (to erase what a deleted one left, "
                "pass --tenant)"
            )
        tenant = (await resolve_thread(store, thread_id, None)).tenant
    erased = await store.erase_thread(tenant, thread_id)
    if not any(erased.values()):
        raise AdminError(f"nothing of thread {thread_id!r} is stored for tenant {tenant!r}")
    return {"object": f"{EXPORT_OBJECT}.erased", "tenant": tenant, "id": thread_id, **erased}


def erased_text(erased: JsonDict) -> str:
    counts = ", ".join(f"{erased[name]} {name}" for name in ERASED_ROWS if erased.get(name))
    return f"erased thread {erased['id']} of tenant {erased['tenant']}: {counts}"


# What Store.erase_thread reports, in the order the CLI prints it.
ERASED_ROWS = (
    "threads",
    "items",
    "responses",
    "idempotency",
    "ledger",
    "explain_records",
    "summaries",
)


async def fork_thread(
    store: ThreadStore, thread_id: str, tenant: str | None, at_item: str | None
) -> JsonDict:
    """A copy of the thread's items up to and including `at_item` (all when None): an
    item id, or the sequence number `threads show` prints."""
    thread = await resolve_thread(store, thread_id, tenant)
    try:
        fork = await operations.fork_thread(store, thread, at_item, now=utc_now(), by_seq=True)
    except operations.NoForkPoint:
        raise AdminError(
            f"no item {at_item!r} in thread {thread.id!r} (--at takes an item id or a "
            f"seq from 0 to {thread.next_seq - 1})"
        ) from None
    except operations.ThreadGone:
        raise AdminError(f"thread {thread.id!r} was deleted meanwhile") from None
    return thread_json(fork)


async def export_thread(
    store: ThreadStore, thread_id: str, tenant: str | None, fmt: Literal["jsonl", "openai"]
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
    store: ThreadStore,
    text: str,
    *,
    tenants: Collection[str],
    tenant: str | None = None,
    namespace: str | None = None,
    thread_id: str | None = None,
) -> JsonDict:
    """A new thread from what `threads export` prints: jsonl (tenant, id and kind from its
    header line unless given) or openai (a list of Responses input items: a new
    conversation, for `--tenant`).

    Every line and item goes through the HTTP API's checks (proxy/core/validate.py), the
    items must be of the thread's API and hold no repeated id and no output before its
    call: what the proxy would refuse from a client, it refuses from a file. The thread
    goes to a configured tenant (`tenants`), or to `namespace` (any store namespace, a
    passthrough caller's included) when the operator names it."""
    header, entries = read_export(text)
    kind = _import_kind(header)
    if thread_id is not None:
        _checked(partial(store_key, thread_id, "--id"), "")
    else:
        thread_id = _required_str(header, "id", 1) if header else new_id("conv")
    metadata = _checked(lambda: metadata_param(header.get("metadata")), "line 1") if header else {}
    counter = TokenCounter.for_model("*")
    items = [_new_item(where, param, entry, kind, counter) for where, param, entry in entries]
    _refuse_repeated_ids(items, [where for where, _, _ in entries])
    _refuse_orphans(items, [where for where, _, _ in entries])
    target = _import_namespace(header, tenants, tenant, namespace)
    try:
        thread = await store.create_thread(
            target, thread_id, kind=kind, metadata=metadata, items=items, now=utc_now()
        )
    except AlreadyExists:
        raise AdminError(
            f"thread {thread_id!r} already exists for tenant {target!r}: pass --id NEW_ID"
        ) from None
    return thread_json(thread)


def read_export(text: str) -> tuple[JsonDict | None, list[tuple[str, str, JsonDict]]]:
    """The header (None for the openai format) and the item entries of an export file,
    each with where it is (for messages) and its parameter name; every line has passed
    the checks of the HTTP API's JSON door."""
    if text.lstrip().startswith("["):
        try:
            replay = load_json(text)
        except NotJson as exc:
            raise AdminError(f"not JSON ({exc})") from None
        body = {"input": replay}
        _checked(lambda: check_json_tree(body), "")
        items = _checked(lambda: list_of_objects(replay, "input"), "")
        return None, [
            (f"item {index}", f"input[{index}]", {"api": "responses", "raw": item})
            for index, item in enumerate(items)
        ]
    parsed: list[tuple[str, JsonDict]] = []
    for number, line in enumerate(text.splitlines(), start=1):
        if line.strip():
            parsed.append((f"line {number}", _json_line(line, f"line {number}")))
    if not parsed or parsed[0][1].get("object") != EXPORT_OBJECT:
        raise AdminError(
            f"line 1: expected the header of `threads export --format jsonl` "
            f"(object {EXPORT_OBJECT!r}) or the JSON array of `--format openai`"
        )
    return parsed[0][1], [(where, "raw", entry) for where, entry in parsed[1:]]


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


async def explain_request(store: ExplainStore, request_id: str, tenant: str | None) -> JsonDict:
    """The explain record of one model request (the x-threadkeeper-request-id header)."""
    found = await store.explain_get(tenant, request_id)
    if found is None:
        raise AdminError(f"no explain record {request_id!r} (kept for explain_retention_seconds)")
    return found.record


async def stood_for_tokens(
    store: ThreadStore, tenant: str, thread_id: str, last_seq: int, pin_patterns: tuple[str, ...]
) -> int | None:
    """What the items a summary block of a stored thread stands for weigh: the thread's
    non-pinned items up to `last_seq`, at the tokens stored with each (as `threads show`
    lists them). A request on a thread with a stored cut reads only the window, so its
    explain record has the summary's size there, not theirs. None when the thread is gone
    or holds more than STOOD_FOR_MAX_ITEMS items up to there."""
    if last_seq >= STOOD_FOR_MAX_ITEMS:
        return None
    if await store.get_thread(tenant, thread_id) is None:
        return None
    items = await store.items_between(tenant, thread_id, 0, last_seq)
    pinned = pinned_flags([_item_of(s) for s in items], compile_pins(pin_patterns))
    return sum(s.tokens for s, kept in zip(items, pinned, strict=True) if not kept)


def provider_error_lines(record: JsonDict) -> list[str]:
    """The provider's error answer, when the request got one (explain.provider_error)."""
    error = record.get("provider_error")
    if not isinstance(error, dict):
        return []
    kind = error.get("code") or error.get("type") or "-"
    return [f"provider answered {error.get('status')} ({kind}): {error.get('message')}"]


def explain_text(record: JsonDict) -> str:
    projection = record["projection"]
    lines = [
        f"request {record['id']}  {label(record.get('namespace') or record.get('tenant', '-'))}  "
        f"thread {record.get('thread_id', '-')}  status {record['status']}  "
        f"{record['latency_ms']} ms",
        f"window {projection['window']} = pinned {projection['system']} + tools "
        f"{projection['tools']} + history {projection['history_after']} (budget "
        f"{projection['history_budget']}, was {projection['history_before']}) + current turn "
        f"{projection['current']} + output reserve {projection['output']} + margin "
        f"{projection['epsilon']}",
        f"prompt tokens: estimated {projection['prompt_tokens']}, provider reported "
        f"{record.get('usage_input_tokens', '-')}; retries {record.get('retries', '-')}",
        *provider_error_lines(record),
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
        **fields(entry.tenant),
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
        ("TENANT", "NAMESPACE", "SCOPE", "KEY", "TOOL", "STATUS", "ATTEMPTS", "CREATED"),
        tuple(
            (
                e["tenant"],
                e["namespace"],
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
    store: LedgerStore, scope: Scope, status: LedgerStatus | None, limit: int
) -> list[JsonDict]:
    """Oldest first, in the scope: one namespace, or a tenant with its passthrough callers."""
    if scope.namespace is not None:
        found = await store.ledger_list(scope.namespace, status=status, limit=limit)
    else:
        found = await store.ledger_list(scope.tenant, status=status, limit=limit, callers=True)
    return [ledger_json(e) for e in found]


async def ledger_for_calls(
    store: LedgerStore, tenant: str, call_ids: Iterable[str]
) -> list[JsonDict]:
    """The ledger entries of these tool calls (a thread's), in call order."""
    entries = []
    for call_id in dict.fromkeys(call_ids):
        entry = await store.ledger_by_call(tenant, call_id)
        if entry is not None:
            entries.append(ledger_json(entry))
    return entries


async def ledger_show(store: LedgerStore, tenant: str, scope: str, key: str) -> JsonDict:
    entry = await store.ledger_get(tenant, scope, key)
    if entry is None:
        raise AdminError(f"no ledger entry {scope}/{key} for tenant {tenant!r}")
    return ledger_json(entry)


async def ledger_resolve(
    store: LedgerStore,
    tenant: str,
    scope: str,
    key: str,
    status: Literal["completed", "failed"],
    result: str | None,
) -> JsonDict:
    """Settles an entry whose outcome the client never reported (only an `issued` one)."""
    try:
        entry = await operations.resolve_ledger_entry(
            store, tenant, scope, key, status=status, result=result, now=utc_now()
        )
    except operations.NoLedgerEntry:
        raise AdminError(f"no ledger entry {scope}/{key} for tenant {tenant!r}") from None
    except operations.LedgerEntryNotIssued as exc:
        raise AdminError(
            f"ledger entry {scope}/{key} is {exc.entry.status!r}; only 'issued' resolves"
        ) from None
    return ledger_json(entry)


# --- helpers ------------------------------------------------------------------------------


async def _log(
    store: ThreadStore, thread: Thread, first: int = 0, last: int | None = None
) -> tuple[StoredItem, ...]:
    """The log (the part before the cut included), whole unless bounded."""
    last = thread.next_seq - 1 if last is None else last
    return await store.items_between(thread.tenant, thread.id, first, last)


def _item_of(stored: StoredItem) -> Item:
    return item_of(stored.api, stored.raw)


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


def _checked(check: Callable[[], _T], where: str) -> _T:
    """The check's value; its ApiError (the HTTP API's 400) as one AdminError line."""
    try:
        return check()
    except ApiError as exc:
        raise AdminError(f"{where}: {exc.message}" if where else exc.message) from None


def _json_line(line: str, where: str) -> JsonDict:
    try:
        value = load_json(line)
    except NotJson as exc:
        raise AdminError(f"{where}: not JSON ({exc})") from None
    if not isinstance(value, dict):
        raise AdminError(f"{where}: expected a JSON object")
    _checked(lambda: check_json_tree(value), where)
    return value


def _import_namespace(
    header: JsonDict | None, tenants: Collection[str], tenant: str | None, namespace: str | None
) -> str:
    """Where an import goes: `namespace` as given, else a configured tenant (--tenant or
    the file's): a namespace no policy names (a passthrough caller's, a typo) only when
    the operator says so."""
    if tenant is not None and namespace is not None:
        raise AdminError("pass --tenant or --namespace, not both")
    if namespace is not None:
        return _checked(partial(store_key, namespace, "--namespace"), "")
    if tenant is None:
        if header is None:
            raise AdminError("an openai-format file names no tenant: pass --tenant")
        # Where the thread was: its "namespace" (a passthrough caller's), else "tenant"
        # (files written before namespaces were exported)
        tenant = _required_str(header, "namespace" if "namespace" in header else "tenant", 1)
    if tenant not in tenants:
        configured = ", ".join(sorted(tenants)) or "none"
        raise AdminError(
            f"{tenant!r} is not a configured tenant (the policies define: {configured}); "
            f"pass --namespace {tenant} to import into that namespace anyway"
        )
    return tenant


def _import_kind(header: JsonDict | None) -> ThreadKind:
    kind = header.get("kind") if header is not None else "conversation"
    for known in THREAD_KINDS:
        if kind == known:
            return known
    raise AdminError(f"line 1: 'kind' must be conversation, chat or responses, not {kind!r}")


def _required_str(entry: Mapping[str, Any], name: str, number: int) -> str:
    value = entry.get(name)
    if not isinstance(value, str) or not value:
        raise AdminError(f"line {number}: {name!r} must be a non-empty string")
    return value


def _new_item(
    where: str, param: str, entry: Mapping[str, Any], kind: ThreadKind, counter: TokenCounter
) -> NewItem:
    """One entry as the item to store, once it passes the HTTP API's checks for its API;
    a thread holds items of one API (the projection cannot mix them)."""
    api = entry.get("api")
    raw = entry.get("raw")
    role = entry.get("role", "input")
    if api not in ("chat", "responses") or not isinstance(raw, dict):
        raise AdminError(f"{where}: expected 'api' chat|responses and an object 'raw'")
    wanted = "chat" if kind == "chat" else "responses"
    if api != wanted:
        raise AdminError(f"{where}: a {kind} thread holds {wanted} items, not {api} items")
    if role not in ("input", "output"):
        raise AdminError(f"{where}: 'role' must be input or output")
    validate = validate_chat_message if api == "chat" else validate_stored_item
    _checked(lambda: validate(raw, param), where)
    item = item_of(api, raw)
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


def _refuse_repeated_ids(items: Sequence[NewItem], places: Sequence[str]) -> None:
    first: dict[str, str] = {}
    for item, where in zip(items, places, strict=True):
        if item.item_id in first:
            message = duplicate_item("id", item.item_id).message
            raise AdminError(f"{where}: {message} ({first[item.item_id]} has it too)")
        first[item.item_id] = where


def _refuse_orphans(items: Sequence[NewItem], places: Sequence[str]) -> None:
    """SPEC 6, as a turn applies it: an output answers a call earlier in the log."""
    views = [item_of(i.api, i.raw) for i in items]
    orphan = first_orphan((), views)
    if orphan is None:
        return
    where = next(
        place
        for view, place in zip(views, places, strict=True)
        if view.kind == "tool_output" and view.output_for == orphan
    )
    raise AdminError(f"{where}: no tool call before this output has the call id {orphan!r}")
