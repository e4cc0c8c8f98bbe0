"""Store conformance for background responses (migration 014): the cancel transition and
its race with a completion, the per-tenant count, and a background stream's events."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any

import pytest

from proxy.store.base import (
    Cancelled,
    NotFound,
    ResponseEvent,
    Store,
    StoredResponse,
    TooManyRunning,
)
from tests.store.conftest import Backend
from tests.store.test_conformance import T0, T1, T2, items, response, status_of, thread_with


def background(rid: str, **fields: Any) -> StoredResponse:
    return replace(response(rid, **fields), background=True)


async def test_background_flag_round_trips(store: Store) -> None:
    await store.begin_response(background("resp_b"))
    await store.begin_response(response("resp_f"))
    stored = await store.get_response("acme", "resp_b")
    assert stored is not None and stored.background is True
    foreground = await store.get_response("acme", "resp_f")
    assert foreground is not None and foreground.background is False


async def test_cancel_only_a_running_background_response(store: Store) -> None:
    await store.begin_response(background("resp_b"))
    await store.begin_response(response("resp_f"))
    assert await store.cancel_response("acme", "resp_f") is False  # foreground
    assert await store.cancel_response("beta", "resp_b") is False  # another tenant's
    assert await store.cancel_response("acme", "resp_missing") is False
    assert await store.cancel_response("acme", "resp_b") is True
    assert await store.cancel_response("acme", "resp_b") is False  # already cancelled
    assert await status_of(store, "acme", "resp_b") == "cancelled"
    assert await status_of(store, "acme", "resp_f") == "in_progress"


async def test_a_finished_background_response_is_not_cancelled(store: Store) -> None:
    await store.begin_response(background("resp_b", thread_id=None))
    await store.finish_response("acme", "resp_b", status="failed", response={"id": "resp_b"})
    assert await store.cancel_response("acme", "resp_b") is False
    assert await status_of(store, "acme", "resp_b") == "failed"


async def test_a_cancelled_response_stays_cancelled_and_its_turn_writes_nothing(
    store: Store,
) -> None:
    await thread_with(store, "a")
    await store.begin_response(background("resp_b"))
    assert await store.cancel_response("acme", "resp_b") is True
    with pytest.raises(Cancelled):
        await store.commit_turn(
            "acme",
            "t1",
            expected_version=0,
            items=items("b", "c"),
            state={"late": True},
            now=T1,
            response_id="resp_b",
            response={"id": "resp_b", "status": "completed"},
        )
    thread = await store.get_thread("acme", "t1")
    assert thread is not None and (thread.version, thread.next_seq, thread.state) == (0, 1, {})
    await store.finish_response("acme", "resp_b", status="incomplete", response=None)
    stored = await store.get_response("acme", "resp_b")
    assert stored is not None and (stored.status, stored.response) == ("cancelled", None)
    with pytest.raises(NotFound):
        await store.finish_response("acme", "resp_none", status="failed", response=None)


async def test_cancel_racing_a_completion_has_exactly_one_winner(backend: Backend) -> None:
    """Two stores on one database (two replicas): whichever UPDATE lands first wins, and
    the other changes nothing."""
    first, second = await backend.open(), await backend.open()
    await first.migrate()
    for round_ in range(8):
        await thread_with(first, f"seed{round_}", tid=f"t{round_}")
        rid = f"resp_{round_}"
        await first.begin_response(background(rid, thread_id=f"t{round_}"))

        async def complete(rid: str = rid, tid: str = f"t{round_}") -> bool:
            try:
                await first.commit_turn(
                    "acme",
                    tid,
                    expected_version=0,
                    items=items(f"in{rid}", f"out{rid}"),
                    state={},
                    now=T2,
                    response_id=rid,
                    response={"id": rid},
                )
            except Cancelled:
                return False
            return True

        completed, cancelled = await asyncio.gather(complete(), second.cancel_response("acme", rid))
        assert completed != cancelled
        stored = await second.get_response("acme", rid)
        thread = await second.get_thread("acme", f"t{round_}")
        assert stored is not None and thread is not None
        assert stored.status == ("completed" if completed else "cancelled")
        assert thread.next_seq == (3 if completed else 1)


async def test_background_running_counts_the_tenants_running_ones(store: Store) -> None:
    await store.begin_response(background("r1"))
    await store.begin_response(background("r2"))
    await store.begin_response(background("r3", tenant="beta"))
    await store.begin_response(response("r4"))
    assert await store.background_running("acme") == 2
    await store.cancel_response("acme", "r1")
    assert await store.background_running("acme") == 1
    assert await store.background_running("beta") == 1
    assert await store.background_running("gamma") == 0


async def test_concurrent_begins_past_max_running_yield_exactly_the_limit(
    backend: Backend,
) -> None:
    """The count and the insert are one unit: of N concurrent background begins (on two
    stores, as two replicas would be) under a limit K, exactly K are recorded."""
    first, second = await backend.open(), await backend.open()
    await first.migrate()
    limit, tried = 3, 12
    await first.begin_response(background("r_other", tenant="beta"))  # not counted

    async def begin(index: int) -> bool:
        store = first if index % 2 else second
        try:
            await store.begin_response(background(f"r{index}"), max_running=limit)
        except TooManyRunning as exc:
            assert exc.limit == limit
            return False
        return True

    began = await asyncio.gather(*(begin(index) for index in range(tried)))
    assert sum(began) == limit
    assert await first.background_running("acme") == limit
    kept = [index for index in range(tried) if began[index]]
    refused = [index for index in range(tried) if not began[index]]
    assert await status_of(first, "acme", f"r{refused[0]}") is None  # nothing written
    await first.cancel_response("acme", f"r{kept[0]}")  # one ends: one more may begin
    await first.begin_response(background("r_next"), max_running=limit)
    with pytest.raises(TooManyRunning):
        await first.begin_response(background("r_past"), max_running=limit)
    # a foreground response, or no limit given, is not counted against it
    await first.begin_response(response("r_fore"), max_running=limit)
    await first.begin_response(background("r_unbounded"))


async def test_response_events_in_order_after_a_seq(store: Store) -> None:
    events = [ResponseEvent(n, "response.output_text.delta", f'{{"n": {n}}}') for n in range(5)]
    assert await store.response_events_last("acme", "r1") is None
    await store.response_events_append("acme", "r1", events[:3], T0)
    await store.response_events_append("acme", "r1", events[3:], T1)
    await store.response_events_append("acme", "r1", [ResponseEvent(4, None, "{}")], T1)
    assert await store.response_events("acme", "r1", after=-1, limit=10) == tuple(events)
    assert await store.response_events("acme", "r1", after=2, limit=1) == (events[3],)
    assert await store.response_events("acme", "r1", after=4, limit=10) == ()
    assert await store.response_events("beta", "r1", after=-1, limit=10) == ()
    assert await store.response_events_last("acme", "r1") == 4


async def test_response_events_go_with_their_response_and_their_retention(store: Store) -> None:
    await store.begin_response(background("r1"))
    await store.response_events_append("acme", "r1", [ResponseEvent(0, None, "{}")], T0)
    await store.response_events_append("acme", "r2", [ResponseEvent(0, None, "{}")], T0)
    await store.response_events_append("acme", "r2", [ResponseEvent(1, None, "{}")], T2)
    assert await store.delete_response("acme", "r1") is True
    assert await store.response_events("acme", "r1", after=-1, limit=10) == ()
    assert await store.response_events_purge(T1) == 1
    assert [e.seq for e in await store.response_events("acme", "r2", after=-1, limit=10)] == [1]


async def test_erasing_a_thread_erases_its_responses_events(store: Store) -> None:
    await thread_with(store, "a")
    await store.begin_response(background("r1"))
    await store.response_events_append("acme", "r1", [ResponseEvent(0, None, "{}")], T0)
    erased = await store.erase_thread("acme", "t1")
    assert erased["response_events"] == 1
    assert await store.response_events("acme", "r1", after=-1, limit=10) == ()
