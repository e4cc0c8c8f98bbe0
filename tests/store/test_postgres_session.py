"""A PostgreSQL connection goes back to the pool as it came (proxy/store/postgres.py,
`_session_kept`): the pool runs no reset query, so nothing the store does may outlive its
transaction on the connection: no advisory lock, no open transaction, no cursor, and the
`search_path` the store connected with."""

from __future__ import annotations

import pytest

from proxy.store.postgres import open_postgres_store
from tests.store.conftest import Backend
from tests.store.test_background_store import background
from tests.store.test_conformance import T2, cancelled_appends, items, thread_with


async def test_a_pooled_connection_keeps_no_session_state(backend: Backend) -> None:
    if backend.name != "postgres":
        pytest.skip("PostgreSQL's pool only: SQLite keeps two connections of its own")
    store = await open_postgres_store(backend.url, schema=backend.schema, min_size=1, max_size=1)
    try:
        await store.migrate()
        await thread_with(store, "seed")
        # the background count takes the tenant's advisory lock (transaction-scoped)
        await store.begin_response(background("resp_1", thread_id="t1"), max_running=4)
        await store.commit_turn(
            "acme",
            "t1",
            expected_version=0,
            items=items("in", "out"),
            state={},
            now=T2,
            response_id="resp_1",
            response={"id": "resp_1"},
        )
        await cancelled_appends(store, 4)
        assert await store.load_window("acme", "t1") is not None
        pool = store.db._pool  # type: ignore[attr-defined]
        async with pool.acquire() as conn:  # the one connection every call above used
            assert not conn.is_in_transaction()
            locks = await conn.fetchval(
                "SELECT count(*) FROM pg_locks WHERE pid = pg_backend_pid() "
                "AND locktype = 'advisory'"
            )
            cursors = await conn.fetchval("SELECT count(*) FROM pg_cursors WHERE name <> ''")
            search_path = await conn.fetchval("SHOW search_path")
        assert (locks, cursors, search_path) == (0, 0, backend.schema)
    finally:
        await store.close()
