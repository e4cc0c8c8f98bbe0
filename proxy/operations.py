"""Operator actions, each implemented once for both doors: the HTTP routes
(proxy/server/ledger_routes.py, the fork route of proxy/server/conversations.py) and the
CLI (proxy/admin.py). An action reads and writes the store and raises what went wrong as
an `OperationError`; each door words that in its own dialect (a 404/409 with OpenAI's
error shape, or one AdminError line).

    entry = await resolve_ledger_entry(store, tenant, scope, key, status="failed",
                                       result=None, now=clock.iso())
    fork = await fork_thread(store, thread, at_item="msg_3", now=clock.iso())
"""

from __future__ import annotations

import re
from typing import Any, Literal

from proxy.core.ledger import ledger_result
from proxy.ids import new_id
from proxy.store.base import LedgerEntry, LedgerStore, NotFound, Thread, ThreadStore

SEQ = re.compile("[0-9]{1,18}")  # a fork point given as a sequence number (the CLI's --at)


class OperationError(Exception):
    """An action could not be done; nothing was written."""


class NoLedgerEntry(OperationError):
    """No entry with (tenant, scope, key)."""

    def __init__(self, tenant: str, scope: str, key: str) -> None:
        super().__init__(f"no ledger entry {scope}/{key} for tenant {tenant!r}")
        self.tenant, self.scope, self.key = tenant, scope, key


class LedgerEntryNotIssued(OperationError):
    """Only an `issued` entry is resolved: `entry` is what is stored (completed, failed)."""

    def __init__(self, entry: LedgerEntry) -> None:
        super().__init__(f"ledger entry {entry.scope}/{entry.key} is {entry.status!r}")
        self.entry = entry


class NoForkPoint(OperationError):
    """The fork point names no item of the thread."""

    def __init__(self, thread: Thread, at_item: str) -> None:
        super().__init__(f"no item {at_item!r} in thread {thread.id!r}")
        self.thread, self.at_item = thread, at_item


class ThreadGone(OperationError):
    """The thread was deleted between reading it and acting on it."""

    def __init__(self, thread: Thread) -> None:
        super().__init__(f"thread {thread.id!r} was deleted meanwhile")
        self.thread = thread


async def resolve_ledger_entry(
    store: LedgerStore,
    tenant: str,
    scope: str,
    key: str,
    *,
    status: Literal["completed", "failed"],
    result: Any,
    now: str,
) -> LedgerEntry:
    """An operator settles an entry whose outcome the client never reported (SPEC 6): only
    an `issued` one changes (a conditional update, so a client's own report racing it wins
    or loses whole). `result` is the outcome to keep (any JSON; None for none). Returns the
    entry as stored after."""
    entry = await store.ledger_get(tenant, scope, key)
    if entry is None:
        raise NoLedgerEntry(tenant, scope, key)
    kept = None if result is None else ledger_result(result)
    if not await store.ledger_resolve(tenant, scope, key, status=status, result=kept, now=now):
        raise LedgerEntryNotIssued(entry)
    resolved = await store.ledger_get(tenant, scope, key)
    if resolved is None:
        raise NoLedgerEntry(tenant, scope, key)
    return resolved


def fork_id_for(thread: Thread) -> str:
    """A new id for a fork of `thread`: a conversation's fork is a conversation."""
    return new_id("conv" if thread.kind == "conversation" else "thread")


async def fork_thread(
    store: ThreadStore,
    thread: Thread,
    at_item: str | None,
    *,
    now: str,
    fork_id: str | None = None,
    by_seq: bool = False,
) -> Thread:
    """A new thread holding copies of `thread`'s items up to and including `at_item` (an
    item id; with `by_seq` also a sequence number; the whole log when None). Writes to
    either thread never touch the other (SPEC 7)."""
    through = await _fork_point(store, thread, at_item, by_seq)
    try:
        return await store.fork_thread(
            thread.tenant,
            thread.id,
            fork_id or fork_id_for(thread),
            through_seq=through,
            now=now,
        )
    except NotFound:
        raise ThreadGone(thread) from None


async def _fork_point(store: ThreadStore, thread: Thread, at_item: str | None, by_seq: bool) -> int:
    """The last seq a fork copies."""
    if at_item is None:
        return thread.next_seq - 1
    stored = await store.get_item(thread.tenant, thread.id, at_item)
    if stored is not None:
        return stored.seq
    if by_seq and SEQ.fullmatch(at_item) and int(at_item) < thread.next_seq:
        return int(at_item)
    raise NoForkPoint(thread, at_item)
