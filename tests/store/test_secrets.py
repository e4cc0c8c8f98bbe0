"""Server secrets (migration 007) on every backend: the first write of a name wins, so
replicas that create the compaction key at the same moment all end up with one."""

from __future__ import annotations

import asyncio

from proxy.clock import ManualClock
from proxy.server.compaction import stored_key
from proxy.store.base import Store
from tests.store.conftest import Backend

NOW = "2026-01-01T00:00:00+00:00"


async def test_a_secret_is_absent_until_created(store: Store) -> None:
    assert await store.secret("compaction") is None
    assert await store.create_secret("compaction", "first", NOW) == "first"
    assert await store.secret("compaction") == "first"


async def test_the_first_write_wins(store: Store) -> None:
    await store.create_secret("compaction", "first", NOW)
    assert await store.create_secret("compaction", "second", NOW) == "first"
    assert await store.secret("compaction") == "first"
    assert await store.secret("other") is None


async def test_replicas_racing_to_create_the_key_share_one(backend: Backend, store: Store) -> None:
    stores = [store, *[await backend.open() for _ in range(5)]]
    clock = ManualClock()
    keys = await asyncio.gather(*(stored_key(s, clock, create=True) for s in stores))
    blob = keys[0].seal("acme", {"format": "memory", "state": {"count": 0}})
    assert all(
        key.open("acme", blob) == {"format": "memory", "state": {"count": 0}} for key in keys
    )
    assert len({await s.secret("compaction") for s in stores}) == 1
