"""The thread service: OCC retries, cut translation, chat reconciliation, orphans."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from proxy.core.items import chat_item, responses_item
from proxy.core.projection import CutPoint
from proxy.core.tokens import TokenCounter
from proxy.store import open_store
from proxy.store.base import (
    NewItem,
    StoredItem,
    StoreUnavailable,
    Thread,
    VersionConflict,
    Window,
)
from proxy.threads import (
    MEMO_BYTES,
    Loaded,
    ThreadService,
    WindowCache,
    _Window,
    first_orphan,
    new_chat_messages,
    new_items,
    stored_item_view,
)

NOW = "2025-01-01T00:00:00+00:00"


def clock() -> str:
    return NOW


def thread(version: int, next_seq: int, state: dict[str, Any] | None = None) -> Thread:
    return Thread("acme", "t1", "chat", {}, NOW, version, next_seq, state or {})


def stored(seq: int, raw: dict[str, Any], api: str = "chat") -> StoredItem:
    return StoredItem(seq, f"msg_{seq}", raw, api, 1, "o200k_base", None, "input", NOW)  # type: ignore[arg-type]


def loaded_of(items: list[StoredItem], state: dict[str, Any] | None = None) -> Loaded:
    next_seq = items[-1].seq + 1 if items else 0
    views = tuple(stored_item_view(s) for s in items)
    return Loaded("acme", "t1", "chat", thread(1, next_seq, state), tuple(items), views)


class RacingStore:
    """A store whose first commit loses the race to another writer."""

    def __init__(self) -> None:
        self.commits: list[dict[str, Any]] = []
        self.other = stored(1, {"role": "user", "content": "from the other writer"})

    async def load_window(self, tenant: str, thread_id: str) -> Window:
        first = stored(0, {"role": "user", "content": "hi"})
        return Window(thread(2, 2), (first, self.other))

    async def commit_turn(self, tenant: str, thread_id: str, **kwargs: Any) -> Thread:
        self.commits.append(kwargs)
        if len(self.commits) == 1:
            raise VersionConflict("moved on")
        return thread(kwargs["expected_version"] + 1, 3, kwargs["state"])


async def test_lost_race_reloads_recomputes_the_state_and_retries() -> None:
    store = RacingStore()
    service = ThreadService(store, clock, pause=0)  # type: ignore[arg-type]
    start = loaded_of([stored(0, {"role": "user", "content": "hi"})])
    seen: list[Loaded] = []

    async def restate(fresh: Loaded) -> dict[str, Any]:
        seen.append(fresh)
        return {"window_start": 0, "recomputed_over": len(fresh.items)}

    item = NewItem("msg_new", {"role": "user", "content": "next"}, "chat")
    result = await service.commit(start, [item], state={"window_start": 0}, restate=restate)
    assert [c["expected_version"] for c in store.commits] == [1, 2]
    assert store.commits[1]["state"] == {"window_start": 0, "recomputed_over": 2}
    assert store.commits[1]["items"] == [item]
    assert seen[0].items[-1].raw == store.other.raw
    assert result.version == 3


class WaitingStore(RacingStore):
    """A store whose commit waits for `gate` (a lock held elsewhere) unless it is open."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = asyncio.Event()

    async def commit_turn(self, tenant: str, thread_id: str, **kwargs: Any) -> Thread:
        if not self.gate.is_set():
            await self.gate.wait()
        self.commits.append(kwargs)
        return thread(kwargs["expected_version"] + 1, 2, kwargs["state"])


async def test_a_commit_that_waits_outlives_its_cancelled_caller() -> None:
    store = WaitingStore()
    service = ThreadService(store, clock)  # type: ignore[arg-type]
    item = NewItem("msg_new", {"role": "user", "content": "next"}, "chat")
    start = loaded_of([stored(0, {"role": "user", "content": "hi"})])
    caller = asyncio.ensure_future(service.commit(start, [item], state={}, restate=same_state))
    await asyncio.sleep(0)
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller
    assert store.commits == []
    store.gate.set()
    for _ in range(5):
        await asyncio.sleep(0)
    assert [c["items"] for c in store.commits] == [[item]]


class TimedStore(WaitingStore):
    """A store whose commit waits for `gate` under its own timeout, as the SQL stores'
    lock and pool waits do (asyncio.timeout binds the task current when it is entered)."""

    async def commit_turn(self, tenant: str, thread_id: str, **kwargs: Any) -> Thread:
        try:
            async with asyncio.timeout(0.05):
                await self.gate.wait()
        except TimeoutError:
            raise StoreUnavailable("busy: no connection was free") from None
        return await super().commit_turn(tenant, thread_id, **kwargs)


async def test_a_commit_whose_store_wait_times_out_fails_with_the_store_error() -> None:
    """The store's own timeout ends the store's wait and reaches the caller as its error,
    not as a cancellation of the caller (a commit run eagerly in the caller's task, then
    moved to a task of its own, left the timeout cancelling the caller while the store
    waited on unbounded)."""
    store = TimedStore()
    service = ThreadService(store, clock)  # type: ignore[arg-type]
    item = NewItem("msg_new", {"role": "user", "content": "next"}, "chat")
    start = loaded_of([stored(0, {"role": "user", "content": "hi"})])
    with pytest.raises(StoreUnavailable):
        await asyncio.wait_for(service.commit(start, [item], state={}, restate=same_state), 5)
    assert store.commits == []


async def same_state(fresh: Loaded) -> dict[str, Any]:
    return fresh.state


async def test_concurrent_commits_on_sqlite_lose_and_duplicate_nothing(tmp_path: Path) -> None:
    store = await open_store(f"sqlite:///{tmp_path / 'threads.db'}")
    await store.migrate()
    try:
        service = ThreadService(store, clock, pause=0.001)
        base = await service.load_or_new("acme", "t1", "chat")
        counter = TokenCounter.for_model("gpt-4o")

        async def restate(fresh: Loaded) -> dict[str, Any]:
            return fresh.state

        async def turn(n: int) -> None:
            message = chat_item({"role": "user", "content": f"turn {n}"})
            items = new_items([message], counter, role="input")
            await service.commit(base, items, state={}, restate=restate)

        await asyncio.gather(*(turn(n) for n in range(5)))
        window = await service.load("acme", "t1")
        assert window is not None
        texts = sorted(item.raw["content"] for item in window.items)
        assert texts == [f"turn {n}" for n in range(5)]
        assert [s.seq for s in window.stored] == list(range(5))
    finally:
        await store.close()


def test_cut_positions_map_to_seqs_across_gaps() -> None:
    # seq 2 was deleted: positions are contiguous (10, 11, 12), seqs are 10, 11, 13.
    items = [
        stored(10, {"role": "user", "content": "a"}),
        stored(11, {"role": "assistant", "content": "b"}),
    ]
    items.append(stored(13, {"role": "user", "content": "c"}))
    loaded = loaded_of(items)
    tool = chat_item({"role": "tool", "tool_call_id": "x", "content": "small"})
    cut = CutPoint(12, (), ((12, tool), (13, tool)))  # 13 = the first new item's position
    state = loaded.state_after(cut)
    assert state["window_start"] == 13
    assert [entry["position"] for entry in state["compressed"]] == [13, 14]
    reread = loaded_of(items, state).cut()
    assert reread is not None and reread.start == 12
    assert [position for position, _ in reread.compressed] == [12, 13]


def test_first_orphan_finds_outputs_without_calls() -> None:
    call = responses_item(
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}
    )
    answer = responses_item({"type": "function_call_output", "call_id": "c1", "output": "ok"})
    stray = responses_item({"type": "custom_tool_call_output", "call_id": "c9", "output": "?"})
    assert first_orphan([call], [answer]) is None
    assert first_orphan([], [call, answer]) is None
    assert first_orphan([call], [answer, stray]) == "c9"


HISTORY = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "hi"},
    {"role": "assistant", "content": "hello", "refusal": None},
]


def test_full_history_client_appends_only_what_follows_the_window() -> None:
    loaded = loaded_of([stored(i, m) for i, m in enumerate(HISTORY)])
    resent = [*HISTORY[:2], {"role": "assistant", "content": [{"type": "text", "text": "hello"}]}]
    new = {"role": "user", "content": "and now?"}
    assert new_chat_messages(loaded, [*resent, new]) == [new]


def test_only_new_client_keeps_its_messages_but_not_a_repeated_system_prompt() -> None:
    loaded = loaded_of([stored(i, m) for i, m in enumerate(HISTORY)])
    new = {"role": "user", "content": "and now?"}
    assert new_chat_messages(loaded, [new]) == [new]
    assert new_chat_messages(loaded, [HISTORY[0], new]) == [new]
    other_system = {"role": "system", "content": "Answer in French."}
    assert new_chat_messages(loaded, [other_system, new]) == [other_system, new]


def test_empty_thread_takes_every_message() -> None:
    empty = Loaded("acme", "t1", "chat", None)
    assert new_chat_messages(empty, HISTORY) == HISTORY


async def test_first_taken_id_reads_the_whole_log_and_skips_item_references(
    tmp_path: Path,
) -> None:
    store = await open_store(f"sqlite:///{tmp_path / 'threads.db'}")
    await store.migrate()
    try:
        old = NewItem("msg_old", {"id": "msg_old", "role": "user", "content": "x"}, "responses")
        await store.create_thread("acme", "t1", kind="conversation", items=[old], now=NOW)
        service = ThreadService(store, clock)
        loaded = await service.load("acme", "t1")
        assert loaded is not None
        fresh = {"id": "msg_new", "role": "user", "content": "y"}
        reference = {"type": "item_reference", "id": "msg_old"}
        assert await service.first_taken_id(loaded, [fresh, reference]) is None
        assert await service.first_taken_id(loaded, [fresh, {**fresh, "content": "z"}]) == 1
        assert await service.first_taken_id(loaded, [fresh, {"id": "msg_old"}]) == 1
        # a loaded window that no longer holds the item still finds it in the log
        outside = replace(loaded, stored=(), items=())
        assert await service.first_taken_id(outside, [{"id": "msg_old"}]) == 0
    finally:
        await store.close()


# --- the hot-thread cache -----------------------------------------------------------------


async def test_cached_windows_follow_appends_cuts_and_a_recreated_thread(tmp_path: Path) -> None:
    store = await open_store(f"sqlite:///{tmp_path / 'cache.db'}")
    await store.migrate()
    cache = WindowCache(1 << 20)
    service = ThreadService(store, clock, cache=cache)
    message = {"role": "user", "content": "hi"}
    try:
        await store.create_thread(
            "acme", "t1", kind="chat", items=[NewItem("m0", message, "chat")], now=NOW
        )
        first = await service.load("acme", "t1")
        assert first is not None and [s.item_id for s in first.stored] == ["m0"]
        await store.append_items(
            "acme", "t1", [NewItem(f"m{n}", message, "chat") for n in (1, 2)],
            state={"window_start": 2}, now=NOW,
        )  # fmt: skip
        moved = await service.load("acme", "t1")
        assert moved is not None and [s.item_id for s in moved.stored] == ["m2"]
        assert moved.first_position == 2 and moved.items[0].tokens is None  # never counted

        await store.delete_thread("acme", "t1")
        assert await service.load("acme", "t1") is None
        assert len(cache) == 0
        await store.create_thread(
            "acme", "t1", kind="chat", items=[NewItem("new", message, "chat")], now="2026"
        )
        again = await service.load("acme", "t1")
        assert again is not None and [s.item_id for s in again.stored] == ["new"]
    finally:
        await store.close()


def test_window_cache_is_bounded_by_bytes_least_recent_out() -> None:
    cache = WindowCache(100)
    entry = _Window("now", 1, 0, 0, 1, (), (), (40,))
    for thread_id in ("a", "b"):
        cache.put("acme", thread_id, entry)
    assert cache.get("acme", "a") is entry  # "a" is now the most recent
    cache.put("acme", "c", entry)
    assert (cache.get("acme", "b"), len(cache), cache.bytes) == (None, 2, 80)
    cache.put("acme", "big", replace(entry, sizes=(101,)))
    assert cache.get("acme", "big") is None and cache.bytes == 80
    cache.drop("acme", "a")
    assert (len(cache), cache.bytes) == (1, 40)


def test_window_cache_counts_what_a_memo_holds_as_it_was_when_put() -> None:
    cache = WindowCache(100)
    entry = _Window("now", 1, 0, 0, 1, (), (), (40,), memo={MEMO_BYTES: 30})
    cache.put("acme", "a", entry)
    assert cache.bytes == 70
    entry.memo[MEMO_BYTES] = 50  # a writer keeps more: counted when the window is next put
    cache.put("acme", "b", _Window("now", 1, 0, 0, 1, (), (), (40,)))
    assert (cache.get("acme", "a"), cache.bytes) == (None, 40)  # 70 out, as counted
    cache.put("acme", "a", entry)
    assert (cache.get("acme", "b"), cache.bytes) == (None, 90)


async def test_a_window_memo_follows_appends_and_is_new_for_another_window(
    tmp_path: Path,
) -> None:
    """Loaded.memo lives with the cached window: appends (this process's commit, another
    process's write) keep it, a window read whole again (the thread created again) gets a
    new one. Whoever reads it checks it against the items (turn.whole_fit)."""
    store = await open_store(f"sqlite:///{tmp_path / 'memo.db'}")
    await store.migrate()
    service = ThreadService(store, clock, cache=WindowCache(1 << 20))
    message = {"role": "user", "content": "hi"}

    async def restate(loaded: Loaded) -> dict[str, Any]:
        return loaded.state

    try:
        await store.create_thread(
            "acme", "t1", kind="chat", items=[NewItem("m0", message, "chat")], now=NOW
        )
        first = await service.load("acme", "t1")
        assert first is not None
        first.memo["seen"] = 1
        await store.append_items("acme", "t1", [NewItem("m1", message, "chat")], now=NOW)
        grown = await service.load("acme", "t1")  # another process appended
        assert grown is not None and len(grown.items) == 2 and grown.memo is first.memo
        await service.commit(
            grown, [NewItem("m2", message, "chat")], state=grown.state, restate=restate
        )
        after = await service.load("acme", "t1")
        assert after is not None and len(after.items) == 3 and after.memo is first.memo
        await store.delete_thread("acme", "t1")
        await store.create_thread(
            "acme", "t1", kind="chat", items=[NewItem("n0", message, "chat")], now="2026"
        )
        again = await service.load("acme", "t1")
        assert again is not None and again.memo == {}
    finally:
        await store.close()


async def test_a_cached_windows_item_types_follow_appends_and_the_window_start(
    tmp_path: Path,
) -> None:
    """Loaded.item_types is gathered as the cached window grows (this process's commit,
    another's append), loses what the window start leaves behind, and is gathered anew for
    other items (`replace`, as `ThreadService.whole` does): always the types of the very
    items it is asked about."""
    store = await open_store(f"sqlite:///{tmp_path / 'types.db'}")
    await store.migrate()
    service = ThreadService(store, clock, cache=WindowCache(1 << 20))
    user = {"role": "user", "content": "hi"}
    call = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}
    output = {"type": "function_call_output", "call_id": "c1", "output": "ok"}
    reasoning = {"type": "reasoning", "summary": []}

    async def restate(loaded: Loaded) -> dict[str, Any]:
        return loaded.state

    def types(loaded: Loaded | None) -> frozenset[str | None]:
        assert loaded is not None
        assert loaded.item_types == frozenset(i.type for i in loaded.items)
        assert loaded.item_kinds == frozenset(i.kind for i in loaded.items)
        return loaded.item_types

    try:
        await store.create_thread(
            "acme", "t1", kind="responses", items=[NewItem("m0", user, "responses")], now=NOW
        )
        first = await service.load("acme", "t1")
        assert types(first) == {"message"}
        await store.append_items("acme", "t1", [NewItem("c1", call, "responses")], now=NOW)
        grown = await service.load("acme", "t1")  # another process appended
        assert types(grown) == {"message", "function_call"}
        assert grown is not None
        await service.commit(
            grown, [NewItem("o1", output, "responses")], state=grown.state, restate=restate
        )
        committed = await service.load("acme", "t1")  # this process's commit
        assert types(committed) == {"message", "function_call", "function_call_output"}
        assert committed is not None
        await service.commit(
            committed,
            [NewItem("r1", reasoning, "responses")],
            state={"window_start": 2},
            restate=restate,
        )
        moved = await service.load("acme", "t1")  # the call and its output left behind
        assert types(moved) == {"function_call_output", "reasoning"}
        assert moved is not None
        other = replace(moved, items=moved.items[1:])
        assert other.item_types == {"reasoning"}
    finally:
        await store.close()
