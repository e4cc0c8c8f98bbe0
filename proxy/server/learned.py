"""What the proxy has learnt about each (tenant, upstream, model): one small place that
every budget reads (proxy/server/rebuild.py), that a context-length refusal writes
(proxy/server/overflow.py), that every answer's usage calibrates (observe.Usage) and
that window discovery fills in (proxy/server/discovery.py).

Kept in memory, per process, bounded (the least recently used entry goes first), and in
the store so replicas and restarts share it. The store is never on every turn's path: an
entry is read on its first use and again after TTL_SECONDS, and written when the
correction changed meaningfully, after WRITE_EVERY answers otherwise, and at shutdown;
an answer's write (`save_soon`) runs in a task of its own, so no answer waits for it."""

from __future__ import annotations

import asyncio
import math
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import structlog

from proxy.core.budget import MAX_SAMPLES, Learned, Sample
from proxy.policy import Policy
from proxy.store.base import LearnedRecord, LearnedStore, StoreError

log = structlog.get_logger("threadkeeper.learned")

MAX_ENTRIES = 4096  # model names come from clients: never an unbounded map
TTL_SECONDS = 60.0  # how long a process trusts its copy before reading the store again
WRITE_EVERY = 8  # answers between writes while the correction holds still
MEANINGFUL = 0.01  # a ratio that moved by this share is written at once
DISCOVERY_TTL_SECONDS = 3600.0  # how long a provider's listed window is trusted

Key = tuple[str, str, str]  # (tenant, upstream base URL, model)


@dataclass
class _Entry:
    learned: Learned
    read_at: float  # when the store was last read for it (monotonic seconds)
    written: Learned | None = None  # what the store holds, as far as this process knows
    pending: int = 0  # changes since the last write
    asked_at: float | None = None  # when the provider was last asked for its window


class LearnedLimits:
    def __init__(
        self,
        max_entries: int = MAX_ENTRIES,
        *,
        ttl: float = TTL_SECONDS,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self._entries: OrderedDict[Key, _Entry] = OrderedDict()
        self._max = max_entries
        self._ttl = ttl
        self._now = monotonic
        self._saving: dict[Key, asyncio.Task[None]] = {}  # save_soon's writes in flight

    def get(self, key: Key) -> Learned | None:
        found = self._entries.get(key)
        if found is None:
            return None
        self._entries.move_to_end(key)
        return found.learned

    def put(self, key: Key, learned: Learned) -> None:
        entry = self._entries.get(key)
        if entry is None:
            entry = self._entries[key] = _Entry(learned, self._now())
        entry.learned = learned
        entry.pending += 1
        self._entries.move_to_end(key)
        while len(self._entries) > self._max:
            self._entries.popitem(last=False)

    async def load(self, key: Key, store: LearnedStore | None) -> Learned | None:
        """The entry, read from the store on first use and once its copy is older than the
        TTL (what another replica learnt since). Changes not yet written stay this
        process's; a store that fails is logged and the copy in memory serves."""
        entry = self._entries.get(key)
        fresh = entry is not None and self._now() - entry.read_at < self._ttl
        if store is None or fresh:
            return self.get(key)
        try:
            record = await store.learned_get(*key)
        except StoreError as exc:
            # Read again after the TTL, not on every request while the store is down.
            log.warning("learned_limits_unreadable", model=key[2], error=str(exc))
            if entry is None:
                entry = self._entries[key] = _Entry(Learned(), self._now())
            entry.read_at = self._now()
            return self.get(key)
        entry = self._entries.get(key)  # another request may have put it meanwhile
        stored = from_state(record.state) if record is not None else None
        if entry is None:
            if stored is None:
                entry = _Entry(Learned(), self._now())
            else:
                entry = _Entry(stored, self._now(), written=stored)
            self._entries[key] = entry
        else:
            entry.read_at = self._now()
            if stored is not None and entry.pending == 0:
                entry.learned = entry.written = stored
        self._entries.move_to_end(key)
        while len(self._entries) > self._max:
            self._entries.popitem(last=False)
        return entry.learned

    def write_due(self, key: Key) -> bool:
        entry = self._entries.get(key)
        if entry is None or entry.pending == 0:
            return False
        return entry.pending >= WRITE_EVERY or changed(entry.written, entry.learned)

    async def save(
        self, key: Key, store: LearnedStore | None, now: str, *, force: bool = False
    ) -> None:
        """Writes the entry when a write is due (or `force`, with anything unwritten)."""
        entry = self._entries.get(key)
        if store is None or entry is None or entry.pending == 0:
            return
        if not force and not self.write_due(key):
            return
        learned = entry.learned
        try:
            await store.learned_put(LearnedRecord(*key, to_state(learned), now))
        except StoreError as exc:
            log.warning("learned_limits_unwritten", model=key[2], error=str(exc))
            return
        entry.written, entry.pending = learned, 0

    def save_soon(self, key: Key, store: LearnedStore | None, now: str) -> None:
        """`save` in a task of its own when a write is due, off the answer's path (a
        SQLite write waits for the write lock behind other writers); one per key at a
        time, a later due answer writes what this one did not."""
        if store is None or key in self._saving or not self.write_due(key):
            return
        task = asyncio.get_running_loop().create_task(self.save(key, store, now))
        self._saving[key] = task

        def done(finished: asyncio.Task[None]) -> None:
            self._saving.pop(key, None)
            if not finished.cancelled() and (error := finished.exception()) is not None:
                log.error("learned_limits_unwritten", model=key[2], error=repr(error))

        task.add_done_callback(done)

    async def settled(self) -> None:
        """Until the writes `save_soon` started have ended."""
        while self._saving:
            await asyncio.wait(list(self._saving.values()))

    async def flush(self, store: LearnedStore | None, now: str) -> None:
        """Everything not yet written (at shutdown), once the writes in flight ended."""
        await self.settled()
        for key in [k for k, e in self._entries.items() if e.pending]:
            await self.save(key, store, now, force=True)

    def discovery_due(self, key: Key) -> bool:
        """Whether the provider is to be asked for the model's window now: once per
        DISCOVERY_TTL_SECONDS, whatever it answered (nothing listed included)."""
        entry = self._entries.get(key)
        if entry is None:
            entry = self._entries[key] = _Entry(Learned(), self._now())
        if entry.asked_at is not None and self._now() - entry.asked_at < DISCOVERY_TTL_SECONDS:
            return False
        entry.asked_at = self._now()
        return True


def changed(before: Learned | None, after: Learned) -> bool:
    """Whether the store's copy is meaningfully behind: a new window, another per-item
    overhead, or a ratio that moved by MEANINGFUL or more."""
    if before is None:
        return True
    if (before.window, before.discovered, before.item_overhead) != (
        after.window,
        after.discovered,
        after.item_overhead,
    ):
        return True
    return abs(after.ratio - before.ratio) >= MEANINGFUL * before.ratio


def model_window(policy: Policy, model: str, learned: Learned | None) -> tuple[int, str]:
    """The model's window before any correction, and where it came from: the policy's
    entry when it names the model, else the window the provider lists for it, else the
    policy's "*". ("learned": a refusal stated a smaller one, applied by the budget.)"""
    window = policy.limits_for(model).context_window
    source = "policy"
    if not policy.names_model(model) and learned is not None and learned.discovered:
        window, source = learned.discovered, "discovered"
    if learned is not None and learned.window is not None and learned.window < window:
        return learned.window, "learned"
    return window, source


# --- the store's JSON form ---------------------------------------------------------------


def to_state(learned: Learned) -> dict[str, Any]:
    return {
        "window": learned.window,
        "ratio": learned.ratio,
        "overhead": learned.overhead,
        "discovered": learned.discovered,
        "answers": learned.answers,
        "samples": [[s.estimate, s.items, s.actual] for s in learned.samples],
    }


def from_state(state: dict[str, Any]) -> Learned:
    """A stored state; anything malformed is left out (it is only ever a better guess)."""

    def count(value: Any) -> int | None:
        return (
            value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None
        )

    def number(value: Any, default: float) -> float:
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        return float(value) if ok and math.isfinite(value) and value >= 0 else default

    samples = []
    raw = state.get("samples")
    for row in raw[-MAX_SAMPLES:] if isinstance(raw, list) else []:
        if isinstance(row, list) and len(row) == 3 and all(count(v) is not None for v in row):
            samples.append(Sample(*row))
    return Learned(
        window=count(state.get("window")),
        ratio=max(number(state.get("ratio"), 1.0), 1e-3),
        overhead=number(state.get("overhead"), 0.0),
        discovered=count(state.get("discovered")),
        answers=count(state.get("answers")) or 0,
        samples=tuple(samples),
    )
