"""Replica-safe crash recovery (SPEC 7, 8): two app instances on one database. A starting
replica leaves a live replica's in_progress responses alone and marks a dead process's
incomplete; once a replica falls silent, the others' periodic sweep ends its responses;
a clean shutdown ends the replica's own leftovers. Runs on a SQLite file and, when
THREADKEEPER_TEST_PG_DSN is set, on PostgreSQL."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path

import pytest
from aiohttp import web

from proxy.clock import ManualClock, utc_iso
from proxy.server import recovery
from proxy.server.app import create_app, start
from proxy.server.state import OWNER, STORE
from proxy.settings import Settings
from proxy.store.base import Store, StoredResponse

from .conftest import PROVIDER_KEY, write_policies


class Replicas:
    """App instances started on one store, as replicas behind a load balancer run."""

    def __init__(self, store_url: str, policies: Path) -> None:
        self.store_url = store_url
        self.policies = policies
        self.runners: dict[int, web.AppRunner] = {}
        # One clock for all replicas; periodic heartbeats and sweeps run only when a test
        # advances it.
        self.clock = ManualClock()

    async def start(self) -> web.Application:
        settings = Settings(
            port=0,
            policies_dir=self.policies,
            upstream_url="http://127.0.0.1:9",
            policy_reload_interval=0,
            store_url=self.store_url,
        )
        app = create_app(settings, env={"ACME_OPENAI_KEY": PROVIDER_KEY}, clock=self.clock)
        self.runners[id(app)] = await start(settings, app)
        return app

    async def stop(self, app: web.Application) -> None:
        """A clean shutdown (SIGTERM): the app's cleanup hooks run."""
        await self.runners.pop(id(app)).cleanup()


@pytest.fixture
async def replicas(store_url: str, tmp_path: Path) -> AsyncIterator[Replicas]:
    write_policies(tmp_path / "policies")
    running = Replicas(store_url, tmp_path / "policies")
    yield running
    for app_id in list(running.runners):
        await running.runners.pop(app_id).cleanup()


def in_progress(response_id: str, owner: str) -> StoredResponse:
    return StoredResponse(
        tenant="acme",
        id=response_id,
        thread_id=None,
        previous_response_id=None,
        status="in_progress",
        request={"model": "gpt-4o", "stream": True},
        response=None,
        created_at=utc_iso(datetime.now(UTC)),
        owner=owner,
    )


def dead_pid() -> int:
    """The pid of a process that has exited and been reaped."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


async def status_of(store: Store, response_id: str) -> str | None:
    stored = await store.get_response("acme", response_id)
    return None if stored is None else stored.status


async def test_a_starting_replica_spares_a_live_replica_and_sweeps_it_once_silent(
    replicas: Replicas,
) -> None:
    a = await replicas.start()
    await a[STORE].begin_response(in_progress("resp_streaming", a[OWNER]))
    await a[STORE].begin_response(in_progress("resp_of_dead", "proc_killed_before"))

    b = await replicas.start()
    store = b[STORE]
    assert await status_of(store, "resp_streaming") == "in_progress"
    assert await status_of(store, "resp_of_dead") == "incomplete"

    now = replicas.clock.now()
    await store.heartbeat(a[OWNER], utc_iso(now - 2 * recovery.STALE_AFTER))
    assert await recovery.sweep(store, b[OWNER], now=now) == 1
    assert await status_of(store, "resp_streaming") == "incomplete"


async def test_a_restart_on_the_same_host_ends_a_killed_process_at_once(
    replicas: Replicas,
) -> None:
    """No waiting for staleness: the killed process's pid is gone from this host."""
    a = await replicas.start()
    now = replicas.clock.iso()
    await a[STORE].heartbeat("proc_killed", now, host=recovery.this_host(), pid=dead_pid())
    await a[STORE].begin_response(in_progress("resp_killed", "proc_killed"))
    await a[STORE].begin_response(in_progress("resp_a", a[OWNER]))

    b = await replicas.start()
    assert await status_of(b[STORE], "resp_killed") == "incomplete"
    assert await status_of(b[STORE], "resp_a") == "in_progress"  # a's pid is alive


async def test_a_sweep_spares_its_own_and_fresh_responses(replicas: Replicas) -> None:
    a, b = await replicas.start(), await replicas.start()
    await a[STORE].begin_response(in_progress("resp_a", a[OWNER]))
    await b[STORE].begin_response(in_progress("resp_b", b[OWNER]))

    now = replicas.clock.now()
    await recovery.heartbeat(a[STORE], a[OWNER], now=now)
    await b[STORE].heartbeat(b[OWNER], utc_iso(now - 2 * recovery.STALE_AFTER))
    assert await recovery.sweep(b[STORE], b[OWNER], now=now) == 0
    assert await status_of(b[STORE], "resp_a") == "in_progress"
    assert await status_of(b[STORE], "resp_b") == "in_progress"


async def test_a_clean_shutdown_ends_only_its_own_leftovers(replicas: Replicas) -> None:
    a, b = await replicas.start(), await replicas.start()
    await a[STORE].begin_response(in_progress("resp_a", a[OWNER]))
    await b[STORE].begin_response(in_progress("resp_b", b[OWNER]))

    await replicas.stop(a)
    assert await status_of(b[STORE], "resp_a") == "incomplete"
    assert await status_of(b[STORE], "resp_b") == "in_progress"


async def until(condition: Callable[[], Awaitable[bool]]) -> bool:
    """Lets the woken periodic tasks run until `condition` holds (bounded)."""
    for _ in range(500):
        if await condition():
            return True
        await asyncio.sleep(0.01)
    return False


async def test_the_periodic_sweep_ends_a_silent_replica_once_time_passes(
    replicas: Replicas,
) -> None:
    """No restart and no real waiting: the running replica's own sweep, every SWEEP_EVERY
    of its clock, ends the responses of a replica on another host that fell silent, and
    spares one that still heartbeats."""
    a = await replicas.start()
    store, clock = a[STORE], replicas.clock
    await store.heartbeat("proc_silent", clock.iso(), host="another-host", pid=1)
    await store.heartbeat("proc_alive", clock.iso(), host="another-host", pid=2)
    await store.begin_response(in_progress("resp_silent", "proc_silent"))
    await store.begin_response(in_progress("resp_alive", "proc_alive"))

    later = clock.now() + recovery.STALE_AFTER + recovery.SWEEP_EVERY
    await store.heartbeat("proc_alive", utc_iso(later), host="another-host", pid=2)
    clock.advance(recovery.STALE_AFTER + recovery.SWEEP_EVERY)
    assert await until(lambda: status_is(store, "resp_silent", "incomplete"))
    assert await status_of(store, "resp_alive") == "in_progress"


async def status_is(store: Store, response_id: str, status: str) -> bool:
    return await status_of(store, response_id) == status
