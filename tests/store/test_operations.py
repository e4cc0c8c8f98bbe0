"""The operator actions both doors share (proxy/operations.py), on both databases: what
each refuses is an OperationError naming what the door needs for its message."""

from __future__ import annotations

import pytest

from proxy import operations
from proxy.store.base import Store, Thread
from tests.store.test_conformance import T1, ledger_entry, thread_with


async def test_resolving_an_issued_entry_keeps_any_json_result_and_returns_it(
    store: Store,
) -> None:
    await store.ledger_issue(ledger_entry("k1"))
    resolved = await operations.resolve_ledger_entry(
        store, "acme", "tenant", "k1", status="completed", result={"ok": True}, now=T1
    )
    assert (resolved.status, resolved.result, resolved.updated_at) == (
        "completed",
        '{"ok":true}',
        T1,
    )


async def test_only_an_issued_entry_resolves_and_a_missing_one_is_named(store: Store) -> None:
    await store.ledger_issue(ledger_entry("k1"))
    await operations.resolve_ledger_entry(
        store, "acme", "tenant", "k1", status="failed", result=None, now=T1
    )
    with pytest.raises(operations.LedgerEntryNotIssued) as refused:
        await operations.resolve_ledger_entry(
            store, "acme", "tenant", "k1", status="completed", result="done", now=T1
        )
    assert refused.value.entry.status == "failed"
    assert (await store.ledger_get("acme", "tenant", "k1")).result is None  # type: ignore[union-attr]
    with pytest.raises(operations.NoLedgerEntry):
        await operations.resolve_ledger_entry(
            store, "other", "tenant", "k1", status="completed", result=None, now=T1
        )


async def source(store: Store) -> Thread:
    await thread_with(store, "msg_a", "msg_b", "msg_c")
    thread = await store.get_thread("acme", "t1")
    assert thread is not None
    return thread


async def test_a_fork_copies_up_to_an_item_id_or_with_by_seq_a_seq(store: Store) -> None:
    thread = await source(store)
    by_id = await operations.fork_thread(store, thread, "msg_b", now=T1)
    assert by_id.next_seq == 2 and by_id.id.startswith("conv_")
    whole = await operations.fork_thread(store, thread, None, now=T1, fork_id="conv_mine")
    assert (whole.id, whole.next_seq) == ("conv_mine", 3)
    assert (await operations.fork_thread(store, thread, "0", now=T1, by_seq=True)).next_seq == 1
    for point, by_seq in (("0", False), ("3", True), ("msg_x", True)):
        with pytest.raises(operations.NoForkPoint):
            await operations.fork_thread(store, thread, point, now=T1, by_seq=by_seq)


async def test_a_thread_deleted_after_it_was_read_is_not_forked(store: Store) -> None:
    thread = await source(store)
    await store.delete_thread("acme", "t1")
    with pytest.raises(operations.ThreadGone):
        await operations.fork_thread(store, thread, None, now=T1)
    assert [t.id for t in await store.list_threads("acme", limit=10)] == []
