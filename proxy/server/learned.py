"""What the proxy has learnt about each (tenant, upstream, model): one small place that
every budget reads (proxy/server/rebuild.py) and that a context-length refusal writes
(proxy/server/overflow.py). Calibration from usage and window discovery are to write here
too. Kept in memory, per process, bounded: the least recently used entry goes first."""

from __future__ import annotations

from collections import OrderedDict

from proxy.core.budget import Learned

MAX_ENTRIES = 4096  # model names come from clients: never an unbounded map

Key = tuple[str, str, str]  # (tenant, upstream base URL, model)


class LearnedLimits:
    def __init__(self, max_entries: int = MAX_ENTRIES) -> None:
        self._entries: OrderedDict[Key, Learned] = OrderedDict()
        self._max = max_entries

    def get(self, key: Key) -> Learned | None:
        found = self._entries.get(key)
        if found is not None:
            self._entries.move_to_end(key)
        return found

    def put(self, key: Key, learned: Learned) -> None:
        self._entries[key] = learned
        self._entries.move_to_end(key)
        while len(self._entries) > self._max:
            self._entries.popitem(last=False)
