"""Learned limits (migration 013) on every backend: what one replica learnt about a model
is read by another, the last write wins, and tenants never see each other's."""

from __future__ import annotations

from proxy.store.base import LearnedRecord, Store
from tests.store.conftest import Backend

NOW = "2026-01-01T00:00:00+00:00"
LATER = "2026-01-01T00:01:00+00:00"
UP = "http://vllm:8000/v1"


def record(tenant: str, model: str, ratio: float, at: str = NOW) -> LearnedRecord:
    return LearnedRecord(tenant, UP, model, {"ratio": ratio, "answers": 3}, at)


async def test_nothing_is_learnt_until_written(store: Store) -> None:
    assert await store.learned_get("acme", UP, "qwen") is None
    assert await store.learned_list("acme") == ()


async def test_another_replica_reads_what_one_wrote(backend: Backend, store: Store) -> None:
    await store.learned_put(record("acme", "qwen", 1.35))
    other = await backend.open()
    got = await other.learned_get("acme", UP, "qwen")
    assert got == record("acme", "qwen", 1.35)
    assert await other.learned_get("acme", "http://elsewhere/v1", "qwen") is None


async def test_the_last_write_wins(store: Store) -> None:
    await store.learned_put(record("acme", "qwen", 1.35))
    await store.learned_put(record("acme", "qwen", 1.4, LATER))
    got = await store.learned_get("acme", UP, "qwen")
    assert got is not None and got.state["ratio"] == 1.4 and got.updated_at == LATER
    assert len(await store.learned_list("acme")) == 1


async def test_lists_are_per_tenant_and_ordered(store: Store) -> None:
    for tenant, model in [("acme", "b"), ("acme", "a"), ("zeta", "a")]:
        await store.learned_put(record(tenant, model, 1.1))
    assert [r.model for r in await store.learned_list("acme")] == ["a", "b"]
    assert [(r.tenant, r.model) for r in await store.learned_list(None)] == [
        ("acme", "a"),
        ("acme", "b"),
        ("zeta", "a"),
    ]
    assert len(await store.learned_list(None, limit=2)) == 2
