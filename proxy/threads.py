"""The thread service: load a thread's live window, commit a turn under OCC (SPEC 3, 7).

The handlers of both APIs use it the same way:

    loaded = await threads.load(tenant, thread_id)
    projection = ...rebuild(loaded.items + new, first_position=loaded.first_position,
                            cut=loaded.cut())...
    ...forward, relay...
    await threads.commit(loaded, items, state=loaded.state_after(projection.cut),
                         restate=recompute_state)

Log positions given to the projection are contiguous from `first_position`; the store's
seqs may have gaps (a deleted conversation item), so `Loaded` translates the cut between
the two. A commit that loses the race (VersionConflict, or a thread created meanwhile)
reloads the window, recomputes the derived state with `restate` and retries: appends
commute, the state is rebuilt. An item id the thread already holds is no race: the
store's AlreadyExists goes to the caller at once (callers refuse such ids up front with
`first_taken_id`).

Stored items come back with the digest and token count written beside them, so a load
never re-serializes or recounts them. With a `WindowCache` (one per process, the app's
WINDOWS key) a load of a thread this process served reads the thread row and only the
rows past what it holds; the row's version, epoch and created_at say when that is not
enough and the window is read whole.
"""

from __future__ import annotations

import asyncio
import json
import random
from bisect import bisect_left
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any, Literal, Protocol

import orjson

from proxy.core.checkpoint import cut_to_state, state_to_cut
from proxy.core.items import Item, content_digest, item_of, message_text
from proxy.core.ledger import is_synthetic_output
from proxy.core.projection import CutPoint
from proxy.core.tokens import TokenCounter
from proxy.ids import item_id_for, new_id
from proxy.store.base import (
    AlreadyExists,
    JsonDict,
    NewItem,
    NotFound,
    ResponseStore,
    StoredItem,
    Thread,
    ThreadKind,
    ThreadStore,
    VersionConflict,
    stored_items,
    window_start,
)
from proxy.tracing import NO_TRACING, Tracing

# Each lost race means another turn on the thread committed after this one last read it,
# so a commit among N concurrent turns loses at most N - 1 times: the attempts bound how
# many concurrent turns one thread absorbs (10 failed 20 concurrent turns, SPEC 7).
COMMIT_ATTEMPTS = 64
MAX_PAUSE = 0.05  # the jitter stops growing: a long loser must not fall ever further behind
Restate = Callable[["Loaded"], Awaitable[JsonDict]]
# The (kind, type) pairs of some items: Item.kind is the API-independent one (a Chat
# message's tool calls are a "tool_calls" kind of type None), Item.type the Responses type.
Sorts = frozenset[tuple[str, str | None]]


def stored_item_view(stored: StoredItem) -> Item:
    """The item as the store kept it: its digest and token count are read, not computed
    again (an item never counted, encoding "", is counted when first needed)."""
    tokens = stored.tokens if stored.encoding else None
    return item_of(
        stored.api, stored.raw, digest=stored.digest, tokens=tokens, encoding=stored.encoding
    )


@dataclass(frozen=True)
class Loaded:
    """A thread's live window as the projection reads it. `thread` is None for a thread
    the first commit creates: a new chat thread or response chain, or a branch forked
    from `fork_of` (source thread id, last seq copied)."""

    tenant: str
    thread_id: str
    kind: ThreadKind
    thread: Thread | None
    stored: tuple[StoredItem, ...] = ()
    items: tuple[Item, ...] = ()
    fork_of: tuple[str, int] | None = None
    # What later turns of this window reuse (the projection's settled blocks, turn.py),
    # kept with the window in the WindowCache; each user checks it against `items`.
    memo: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)
    # The kinds and types of these very `items` (compared by identity: `replace` may
    # change them), gathered by the WindowCache as its window grows.
    sorts: tuple[tuple[Item, ...], Sorts] | None = field(default=None, compare=False, repr=False)

    @property
    def state(self) -> JsonDict:
        return dict(self.thread.state) if self.thread is not None else {}

    @property
    def next_seq(self) -> int:
        if self.thread is not None:
            return self.thread.next_seq
        return self.stored[-1].seq + 1 if self.stored else 0

    @property
    def first_position(self) -> int:
        return self.stored[0].seq if self.stored else self.next_seq

    def cut(self) -> CutPoint | None:
        """The stored cut in the projection's positions (read once per Loaded)."""
        return self._cut

    @cached_property
    def item_sorts(self) -> Sorts:
        """The (kind, type) of the window's items, gathered once per Loaded, or once per
        window and extended as it grows (the rewriters that apply only to some items ask
        every turn, turn.ForItems)."""
        if self.sorts is not None and self.sorts[0] is self.items:
            return self.sorts[1]
        return sorts_of(self.items)

    @cached_property
    def item_types(self) -> frozenset[str | None]:
        return frozenset(type_ for _, type_ in self.item_sorts)

    @cached_property
    def item_kinds(self) -> frozenset[str]:
        return frozenset(kind for kind, _ in self.item_sorts)

    @cached_property
    def _cut(self) -> CutPoint | None:
        cut = state_to_cut(self.state)
        if cut is None:
            return None
        compressed = tuple(
            (position, item)
            for seq, item in cut.compressed
            if (position := self._position_of(seq, exact=True)) is not None
        )
        return replace(cut, start=self._position_of(cut.start) or 0, compressed=compressed)

    def state_after(self, cut: CutPoint | None) -> JsonDict:
        """The thread state to commit: the projection's cut in store seqs (None keeps
        the current state)."""
        if cut is None:
            return self.state
        in_seqs = replace(
            cut,
            start=self._seq_of(cut.start),
            compressed=tuple((self._seq_of(p), item) for p, item in cut.compressed),
        )
        return cut_to_state(in_seqs, self.state)

    def _seq_of(self, position: int) -> int:
        index = position - self.first_position
        if index < len(self.stored):
            return self.stored[max(index, 0)].seq
        return self.next_seq + index - len(self.stored)

    @cached_property
    def _seqs(self) -> list[int]:
        return [s.seq for s in self.stored]

    def _position_of(self, seq: int, *, exact: bool = False) -> int | None:
        seqs = self._seqs
        if seq >= self.next_seq:
            index = len(seqs) + seq - self.next_seq
        else:
            index = bisect_left(seqs, seq)
            if exact and (index >= len(seqs) or seqs[index] != seq):
                return None
        return self.first_position + index


def sorts_of(items: Iterable[Item]) -> Sorts:
    return frozenset((item.kind, item.type) for item in items)


def first_orphan(
    known: Iterable[Item], new: Sequence[Item], *, stateless: bool = False
) -> str | None:
    """The call id of the first new tool output that answers no call before it, in the
    window or earlier in the new items (SPEC 6: an output for an unknown call id is a 400).

    `stateless`: the history is the client's own, and an output for a call it never shows
    goes to the provider to judge; an output placed before its call is still refused (no
    order of the two can be sent)."""
    before = {call_id for item in known for call_id in item.call_ids}
    later = {call_id for item in new for call_id in item.call_ids} if stateless else set()
    for item in new:
        if item.kind == "tool_output" and item.output_for not in before:
            if not stateless or item.output_for in later:
                return item.output_for or ""
        before.update(item.call_ids)
    return None


def new_items(
    items: Iterable[Item],
    counter: TokenCounter,
    *,
    role: Literal["input", "output"],
    response_id: str | None = None,
) -> list[NewItem]:
    """Items to append, counted once here so a rebuild never recounts them."""
    return [
        NewItem(
            item_id=item_id_for(item.raw),
            raw=item.raw,
            api=item.api,
            tokens=counter.item(item),
            encoding=counter.tokenizer_id,
            response_id=response_id,
            role=role,
            digest=item.digest,
        )
        for item in items
    ]


# Loaded.memo's key: the bytes of what its writers keep there beyond the window's items
# (turn.chain_sources' rows), counted by the WindowCache when the window is next put.
MEMO_BYTES = "memo_bytes"


@dataclass(frozen=True)
class _Window:
    """A thread's live window as one process last read it, and what it was read at."""

    created_at: str  # a thread deleted and created again under its id is another thread
    version: int
    epoch: int
    window_start: int
    next_seq: int
    stored: tuple[StoredItem, ...]
    items: tuple[Item, ...]
    sizes: tuple[int, ...]  # bytes of each item's JSON text
    # Loaded.memo, passed on as the window is extended
    memo: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)
    sorts: Sorts | None = field(default=None, compare=False, repr=False)

    @classmethod
    def of(
        cls,
        thread: Thread,
        start: int,
        stored: tuple[StoredItem, ...],
        items: tuple[Item, ...],
        sizes: tuple[int, ...],
        memo: dict[str, Any] | None = None,
        sorts: Sorts | None = None,
    ) -> _Window:
        """`sorts`: those of `items`, if known (else gathered here)."""
        return cls(
            thread.created_at,
            thread.version,
            thread.epoch,
            start,
            thread.next_seq,
            stored,
            items,
            sizes,
            memo if memo is not None else {},
            sorts if sorts is not None else sorts_of(items),
        )

    def loaded(self, tenant: str, thread_id: str, thread: Thread) -> Loaded:
        sorts = self.sorts if self.sorts is not None else sorts_of(self.items)
        return Loaded(
            tenant,
            thread_id,
            thread.kind,
            thread,
            self.stored,
            self.items,
            memo=self.memo,
            sorts=(self.items, sorts),
        )

    def grown(
        self, thread: Thread, start: int, stored: Sequence[StoredItem], items: Sequence[Item]
    ) -> _Window:
        """This window with `stored` (and their views, `items`) appended, and the items
        before the window's new `start` left behind."""
        every = (*self.stored, *stored)
        kept = 0 if not every or every[0].seq >= start else bisect_left(every, start, key=_seq)
        sizes = (*self.sizes, *(json_size(s.raw) for s in stored))
        if kept == 0:
            sorts = self.sorts.union(sorts_of(items)) if self.sorts is not None else None
            return _Window.of(thread, start, every, (*self.items, *items), sizes, self.memo, sorts)
        left = (*self.items, *items)[kept:]
        return _Window.of(thread, start, every[kept:], left, sizes[kept:], self.memo)

    def extends_to(self, thread: Thread) -> bool:
        """Whether `thread` is this window's thread, moved on by appends only: then the
        items held stay valid and what is new starts at `next_seq`."""
        return (
            thread.created_at == self.created_at
            and thread.epoch == self.epoch
            and thread.version >= self.version
            and thread.next_seq >= self.next_seq
            and window_start(thread.state) >= self.window_start
        )


def _seq(stored: StoredItem) -> int:
    return stored.seq


def json_size(raw: JsonDict) -> int:
    try:
        return len(orjson.dumps(raw))
    except TypeError:  # a lone surrogate or an integer beyond 64 bits: the stdlib writes it
        return len(json.dumps(raw))


class WindowCache:
    """Hot threads' windows, per process, bounded by the bytes of their items' JSON text
    and what their memos say they hold besides (MEMO_BYTES; Python objects take a few
    times more), least recently used first out.

    An entry is checked against the thread row on every load (ThreadService.load): rows
    only ever get appended under a new version, and anything else (a deleted item: the
    epoch; a thread created again: created_at) makes the load read the window whole. So
    replicas and worker processes sharing a store stay correct; the cache only saves
    reading and parsing rows this process has seen."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self._entries: OrderedDict[tuple[str, str], _Window] = OrderedDict()
        self._counted: dict[tuple[str, str], int] = {}  # each entry's bytes when put

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, tenant: str, thread_id: str) -> _Window | None:
        entry = self._entries.get((tenant, thread_id))
        if entry is not None:
            self._entries.move_to_end((tenant, thread_id))
        return entry

    def put(self, tenant: str, thread_id: str, entry: _Window) -> None:
        self.drop(tenant, thread_id)
        size = sum(entry.sizes) + entry.memo.get(MEMO_BYTES, 0)
        if size > self.max_bytes or self.max_bytes == 0:
            return
        self._entries[(tenant, thread_id)] = entry
        self._counted[(tenant, thread_id)] = size
        self.bytes += size
        while self.bytes > self.max_bytes:
            key, _ = self._entries.popitem(last=False)
            self.bytes -= self._counted.pop(key)

    def drop(self, tenant: str, thread_id: str) -> None:
        if self._entries.pop((tenant, thread_id), None) is not None:
            self.bytes -= self._counted.pop((tenant, thread_id))


class TurnStore(ThreadStore, ResponseStore, Protocol):
    """What a turn reads and writes: its thread's rows and, for Responses, the
    response rows its modes begin and finish (proxy/server/modes.py)."""


class ThreadService:
    """Loads windows and commits turns; every commit is shielded from cancellation so a
    client that disconnects cannot leave half a turn written (SPEC 7). With a
    `WindowCache`, a load of a thread this process holds reads its row and what is new."""

    def __init__(
        self,
        store: TurnStore,
        clock: Callable[[], str],
        *,
        attempts: int = COMMIT_ATTEMPTS,
        pause: float = 0.005,
        cache: WindowCache | None = None,
        tracing: Tracing = NO_TRACING,
    ) -> None:
        self.store = store
        self.clock = clock
        self.attempts = attempts
        self.pause = pause
        self.cache = cache
        self.tracing = tracing

    async def load(self, tenant: str, thread_id: str) -> Loaded | None:
        with self.tracing.span("thread.load", {"threadkeeper.thread_id": thread_id}) as span:
            loaded = await self._load(tenant, thread_id)
            if span is not None and loaded is not None:
                span.set_attribute("threadkeeper.thread.items_loaded", len(loaded.items))
            return loaded

    async def _load(self, tenant: str, thread_id: str) -> Loaded | None:
        if self.cache is None:
            window = await self.store.load_window(tenant, thread_id)
            if window is None:
                return None
            items = tuple(stored_item_view(s) for s in window.items)
            thread = window.thread
            return Loaded(tenant, thread_id, thread.kind, thread, window.items, items)
        return await self._load_cached(self.cache, tenant, thread_id)

    async def _load_cached(self, cache: WindowCache, tenant: str, thread_id: str) -> Loaded | None:
        held = cache.get(tenant, thread_id)
        from_seq = held.next_seq if held is not None else 0
        window = await self.store.load_window(tenant, thread_id, from_seq=from_seq)
        if window is not None and held is not None and not held.extends_to(window.thread):
            held = None
            window = await self.store.load_window(tenant, thread_id)
        if window is None:
            cache.drop(tenant, thread_id)
            return None
        thread = window.thread
        start = window_start(thread.state)
        items = tuple(map(stored_item_view, window.items))
        if held is not None:
            entry = held.grown(thread, start, window.items, items)
        else:
            sizes = tuple(json_size(s.raw) for s in window.items)
            entry = _Window.of(thread, start, window.items, items, sizes)
        cache.put(tenant, thread_id, entry)
        return entry.loaded(tenant, thread_id, thread)

    async def load_or_new(self, tenant: str, thread_id: str, kind: ThreadKind) -> Loaded:
        """The thread, or an empty one the first commit creates."""
        loaded = await self.load(tenant, thread_id)
        return loaded if loaded is not None else Loaded(tenant, thread_id, kind, None)

    async def whole(self, loaded: Loaded) -> Loaded:
        """`loaded` with the thread's whole log, not only its live window: what a request
        with `truncation: "disabled"` sends (items a cut left behind included). The
        thread's state, version and cut are unchanged: its next request may trim again."""
        thread = loaded.thread
        if thread is None or window_start(thread.state) == 0:
            return loaded  # a new thread or a branch, or a window that is the whole log
        stored = await self.store.items_between(
            loaded.tenant, loaded.thread_id, 0, loaded.next_seq - 1
        )
        return replace(loaded, stored=stored, items=tuple(map(stored_item_view, stored)))

    async def branch(self, tenant: str, source_id: str, through_seq: int) -> Loaded:
        """A new thread of the source's items up to `through_seq`, read now and written
        (forked) by the first commit; it starts with no cut and computes its own."""
        stored = await self.store.items_between(tenant, source_id, 0, through_seq)
        items = tuple(stored_item_view(s) for s in stored)
        fork_of = (source_id, through_seq)
        return Loaded(tenant, new_id("thread"), "responses", None, stored, items, fork_of)

    async def commit(
        self,
        loaded: Loaded,
        items: Sequence[NewItem],
        *,
        state: JsonDict,
        restate: Restate,
        response_id: str | None = None,
        response: JsonDict | None = None,
    ) -> Thread:
        """Append the turn's items with the new state at the version read, retrying a
        lost race after reloading; NotFound if a conversation vanished meanwhile."""
        with self.tracing.span("thread.commit", {"threadkeeper.thread.items_added": len(items)}):
            return await asyncio.shield(
                self._commit(loaded, items, state, restate, response_id, response)
            )

    async def _commit(
        self,
        loaded: Loaded,
        items: Sequence[NewItem],
        state: JsonDict,
        restate: Restate,
        response_id: str | None,
        response: JsonDict | None,
    ) -> Thread:
        for attempt in range(self.attempts):
            try:
                thread = loaded.thread or await self._create(loaded)
                now = self.clock()
                committed = await self.store.commit_turn(
                    loaded.tenant,
                    loaded.thread_id,
                    expected_version=thread.version,
                    items=items,
                    state=state,
                    now=now,
                    response_id=response_id,
                    response=response,
                )
                self._remember(loaded, committed, items, now, response_id)
                return committed
            except (VersionConflict, _LostCreate):
                await asyncio.sleep(random.uniform(0, min(self.pause * (attempt + 1), MAX_PAUSE)))
                loaded = await self._reload(loaded)
                state = await restate(loaded)
        raise VersionConflict(
            f"thread {loaded.thread_id} kept changing: {self.attempts} commits lost the race"
        )

    def _remember(
        self,
        loaded: Loaded,
        thread: Thread,
        items: Sequence[NewItem],
        now: str,
        response_id: str | None,
    ) -> None:
        """Add a turn this process committed to the window it holds, as the store wrote
        it, so the next load reads only the thread row. Only a window read from the
        cache and committed right after (no other write between) is extended."""
        cache = self.cache
        held = cache.get(loaded.tenant, loaded.thread_id) if cache is not None else None
        if cache is None or held is None or held.stored is not loaded.stored:
            return
        first_seq = thread.next_seq - len(items)
        if (thread.version, first_seq) != (held.version + 1, held.next_seq):
            return
        if (thread.created_at, thread.epoch) != (held.created_at, held.epoch):
            return
        start = window_start(thread.state)
        if held.window_start > start:
            return
        added = stored_items(items, first_seq, now, response_id)
        entry = held.grown(thread, start, added, tuple(map(stored_item_view, added)))
        cache.put(loaded.tenant, loaded.thread_id, entry)

    async def _create(self, loaded: Loaded) -> Thread:
        """The thread's first commit creates it; a concurrent first commit that created it
        meanwhile is a lost race (_LostCreate). An AlreadyExists from commit_turn is not:
        it is an item id the thread holds, and retrying cannot help."""
        try:
            return await self._create_thread(loaded)
        except AlreadyExists as exc:
            raise _LostCreate(str(exc)) from exc

    async def _create_thread(self, loaded: Loaded) -> Thread:
        if loaded.fork_of is not None:
            source_id, through_seq = loaded.fork_of
            return await self.store.fork_thread(
                loaded.tenant,
                source_id,
                loaded.thread_id,
                through_seq=through_seq,
                now=self.clock(),
            )
        return await self.store.create_thread(
            loaded.tenant, loaded.thread_id, kind=loaded.kind, now=self.clock()
        )

    async def first_taken_id(self, loaded: Loaded, raws: Sequence[Mapping[str, Any]]) -> int | None:
        """Index of the first raw item whose own id repeats an earlier one or one the
        thread's whole log holds (or a branch will copy): committing it would hit the
        unique key, so the caller refuses the turn before the provider is called. An
        item_reference's id names an item the thread holds on purpose: it is skipped."""
        given = [None if raw.get("type") == "item_reference" else raw.get("id") for raw in raws]
        ids = {i for i in given if isinstance(i, str) and i}
        if not ids:
            return None
        held = {s.item_id for s in loaded.stored if s.item_id in ids}
        if loaded.thread is not None:
            for item_id in sorted(ids - held):
                if await self.store.get_item(loaded.tenant, loaded.thread_id, item_id):
                    held.add(item_id)
        for index, own in enumerate(given):
            if isinstance(own, str) and own:
                if own in held:
                    return index
                held.add(own)
        return None

    async def _reload(self, loaded: Loaded) -> Loaded:
        fresh = await self.load(loaded.tenant, loaded.thread_id)
        if fresh is not None:
            return fresh
        if loaded.kind == "conversation":
            raise NotFound(f"conversation {loaded.thread_id} was deleted")
        return replace(loaded, thread=None)  # created again by the next attempt


class _LostCreate(AlreadyExists):
    """Another request created the thread between this one's read and its first commit."""


# --- Chat Completions: reconciling a request's messages with its thread ----------------------


def chat_message_key(message: Mapping[str, Any]) -> str:
    """What makes two chat messages the same turn, whatever extra fields a client or the
    provider added (`refusal: null`, `annotations`, text as parts or as a string)."""
    content = message.get("content")
    parts = content if isinstance(content, list) else []
    only_text = all(isinstance(p, Mapping) and p.get("type") == "text" for p in parts)
    calls = [
        (
            c.get("id"),
            (c.get("function") or {}).get("name"),
            (c.get("function") or {}).get("arguments"),
        )
        for c in message.get("tool_calls") or ()
        if isinstance(c, Mapping)
    ]
    return content_digest(
        {
            "role": message.get("role"),
            "content": message_text(content) if only_text else content,
            "tool_calls": calls,
            "tool_call_id": message.get("tool_call_id"),
            "name": message.get("name"),
            "function_call": message.get("function_call"),
        }
    )


# chat_message_key of stored messages by content digest: a thread's window is compared
# with every request, and its messages do not change.
_message_keys: dict[str, str] = {}
MESSAGE_KEYS_MAX = 1 << 16


def _stored_message_key(item: Item) -> str:
    key = _message_keys.get(item.digest)
    if key is None:
        key = chat_message_key(item.raw)
        if len(_message_keys) >= MESSAGE_KEYS_MAX:
            _message_keys.clear()
        _message_keys[item.digest] = key
    return key


def new_chat_messages(loaded: Loaded, messages: Sequence[JsonDict]) -> list[JsonDict]:
    """The messages of a Chat request that are new to its thread (header X-Thread-Id).

    Reconciliation rule: clients either resend the whole history every turn (the usual
    Chat Completions client) or send only what is new. Messages are compared by content
    (role, text, tool calls, tool_call_id; extra fields such as `refusal: null` ignored).

    1. Full-history client: if the thread's live window (the items from the window start
       on) appears in the request as one contiguous run, the messages after its last
       occurrence are new. Messages before it are history the thread already holds (or
       trimmed into its summary) and are not appended again.
    2. Otherwise every message is new (an only-new-messages client), except leading
       system/developer messages identical to ones the thread already pins, which a
       client resends each turn and which are kept once.

    Tool messages the proxy wrote itself (an answer to a call the client left dangling,
    proxy/server/ledger.py) are not part of the run: the client never saw them.

    An empty thread takes all messages. A request that only repeats the window adds
    nothing; the provider still gets the rebuilt history.
    """
    keys = [chat_message_key(m) for m in messages]
    # Outputs the proxy wrote for calls the client never answered are never resent.
    window = [
        _stored_message_key(item)
        for stored, item in zip(loaded.stored, loaded.items, strict=True)
        if not is_synthetic_output(stored.raw)
    ]
    if not window:
        return list(messages)
    start = _last_run(keys, window)
    if start is not None:
        return list(messages[start + len(window) :])
    pinned = _pinned_keys(loaded)
    skip = 0
    while skip < len(messages) and messages[skip].get("role") in ("system", "developer"):
        if keys[skip] not in pinned:
            break
        skip += 1
    return list(messages[skip:])


def _last_run(keys: Sequence[str], run: Sequence[str]) -> int | None:
    """Index of the last occurrence of `run` as a contiguous slice of `keys`."""
    width = len(run)
    for start in range(len(keys) - width, -1, -1):
        if keys[start] == run[0] and list(keys[start : start + width]) == list(run):
            return start
    return None


def _pinned_keys(loaded: Loaded) -> set[str]:
    cut = loaded.cut()
    carried = cut.summary if cut is not None else ()
    return {chat_message_key(i.raw) for i in (*carried, *loaded.items) if i.is_instruction}
