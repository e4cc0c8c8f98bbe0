"""`threadkeeper serve --workers 2` as a real child process (issue 9, item 6): two worker
processes share the port, every turn of concurrent conversations commits exactly once on
SQLite and on PostgreSQL, a killed worker is replaced and its cut-off response ends
`incomplete`, a crash loop ends the supervisor with exit 1, and SIGTERM stops everything
with exit 0 and no process left behind."""

from __future__ import annotations

import asyncio
import gc
import json
import multiprocessing
import os
import signal
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from structlog.testing import capture_logs

from proxy.fake_provider import FakeProvider, Reply
from proxy.server.recovery import pid_exists
from proxy.server.workers import MAX_RESTARTS, Supervisor, serve, start_with_stop_signals_held
from proxy.settings import Settings, SettingsError
from proxy.store import open_store
from proxy.store.base import Store

from .conftest import TENANT_KEY, write_policies
from .test_crash_recovery import (
    READY_TIMEOUT,
    SLOW_TEXT,
    STREAM_TIMEOUT,
    Server,
    conversation_texts,
    read_until_first_delta,
    running,
)

CONVERSATIONS = 6
TURNS = 3


def workers(tmp_path: Path, provider: FakeProvider, store_url: str | None = None) -> Server:
    write_policies(tmp_path / "policies")
    assert provider.base_url is not None
    return Server(tmp_path, provider.base_url, store_url=store_url, args=["--workers", "2"])


def client_of(server: Server) -> openai.AsyncOpenAI:
    """No keep-alive: every request opens a new connection, which the kernel hands to
    either worker."""
    http = httpx.AsyncClient(
        limits=httpx.Limits(max_keepalive_connections=0), timeout=STREAM_TIMEOUT
    )
    return openai.AsyncOpenAI(
        base_url=server.base_url, api_key=TENANT_KEY, max_retries=0, http_client=http
    )


def log_lines(server: Server) -> list[dict[str, Any]]:
    lines = []
    for line in server.log.read_text(errors="replace").splitlines():
        if line.startswith("{"):
            lines.append(json.loads(line))
    return lines


def served_pids(server: Server) -> set[int]:
    return {line["pid"] for line in log_lines(server) if line.get("event") == "request"}


def worker_pids(server: Server) -> set[int]:
    return {line["pid"] for line in log_lines(server) if line.get("event") == "listening"}


async def stop(server: Server) -> int:
    """SIGTERM to the supervisor; its exit code."""
    assert server.process is not None
    server.process.send_signal(signal.SIGTERM)
    return await asyncio.to_thread(server.process.wait, 90)


async def talk(client: openai.AsyncOpenAI, n: int) -> tuple[str, list[str]]:
    conversation = await client.conversations.create()
    expected: list[str] = []
    for turn in range(TURNS):
        said = f"Conversation {n}, turn {turn}."
        response = await client.responses.create(
            model="gpt-4o", conversation=conversation.id, input=said
        )
        assert response.status == "completed"
        expected += [said, response.output_text]
    return conversation.id, expected


async def test_two_workers_serve_one_port_and_commit_every_turn_once(
    tmp_path: Path, provider: FakeProvider, store_url: str
) -> None:
    server = workers(tmp_path, provider, store_url)
    with running(server):
        await server.wait_ready()
        client = client_of(server)
        try:
            talks = await asyncio.gather(*(talk(client, n) for n in range(CONVERSATIONS)))
            for conversation_id, expected in talks:
                assert await conversation_texts(client, conversation_id) == expected
        finally:
            await client.close()
        assert await stop(server) == 0, server.output()
    assert len(provider.model_requests) == CONVERSATIONS * TURNS
    pids = worker_pids(server)
    assert len(pids) == 2
    assert served_pids(server) == pids  # both workers served requests
    assert not any(pid_exists(pid) for pid in pids)  # no worker outlives the supervisor
    assert log_lines(server)[-1]["event"] == "workers_stopped"


class SlowTurn:
    """A streamed turn on its own conversation, read up to its first text."""

    def __init__(self, conversation_id: str, stream: Any, response_id: str) -> None:
        self.conversation_id = conversation_id
        self.stream = stream
        self.response_id = response_id

    @classmethod
    async def start(cls, client: openai.AsyncOpenAI, provider: FakeProvider) -> SlowTurn:
        conversation = await client.conversations.create()
        provider.script.append(Reply(text=SLOW_TEXT, stream_chunk_delay=0.1))
        stream = await client.responses.create(
            model="gpt-4o", conversation=conversation.id, input="A long story.", stream=True
        )
        return cls(conversation.id, stream, await read_until_first_delta(stream))

    async def finish(self) -> None:
        async with asyncio.timeout(STREAM_TIMEOUT):
            async for _ in self.stream:
                pass


async def one_turn_per_worker(
    client: openai.AsyncOpenAI, provider: FakeProvider, store: Store
) -> dict[int, SlowTurn]:
    """Slow turns, opened until each worker (by pid) runs one; extras are abandoned."""
    by_pid: dict[int, SlowTurn] = {}
    for _ in range(16):  # new connections land on either worker
        turn = await SlowTurn.start(client, provider)
        stored = await store.get_response("acme", turn.response_id)
        assert stored is not None and stored.status == "in_progress"
        [pid] = [b.pid for b in await store.heartbeats() if b.owner == stored.owner]
        if pid in by_pid:
            await turn.stream.close()
        else:
            by_pid[pid] = turn
        if len(by_pid) == 2:
            return by_pid
    raise AssertionError("every slow turn landed on one worker")


async def status_becomes(store: Store, response_id: str, status: str) -> bool:
    for _ in range(1000):
        stored = await store.get_response("acme", response_id)
        if stored is not None and stored.status == status:
            return True
        await asyncio.sleep(0.02)
    return False


async def test_a_killed_worker_is_replaced_and_only_its_own_stream_ends_incomplete(
    tmp_path: Path, provider: FakeProvider
) -> None:
    """The replacement's start-up sweep ends the killed worker's response at once (its pid
    is gone) and leaves the sibling's running stream alone, which completes."""
    server = workers(tmp_path, provider)
    with running(server):
        await server.wait_ready()
        client = client_of(server)
        store = await open_store(server.store_url)
        try:
            turns = await one_turn_per_worker(client, provider, store)
            killed, survivor = list(turns)
            os.kill(killed, signal.SIGKILL)
            await turns[killed].stream.close()
            cut, alive = turns[killed], turns[survivor]

            assert await status_becomes(store, cut.response_id, "incomplete")
            await alive.finish()
            assert await status_becomes(store, alive.response_id, "completed")
            assert await conversation_texts(client, cut.conversation_id) == []
            assert len(await conversation_texts(client, alive.conversation_id)) == 2
            for n in range(4):  # both workers (the replacement included) keep serving
                await talk(client, n)
        finally:
            await store.close()
            await client.close()
        assert await stop(server) == 0, server.output()
    events = {line["event"]: line for line in log_lines(server)}
    assert events["worker_exited"]["pid"] == killed
    assert events["worker_exited"]["exit_code"] == -signal.SIGKILL
    assert events["worker_restarted"]["replaced"] == killed
    assert len(worker_pids(server)) == 3
    assert not any(pid_exists(pid) for pid in worker_pids(server))


@pytest.mark.parametrize("count", ["1", "2"])
async def test_sigterm_is_a_clean_shutdown_that_retires_every_process(
    tmp_path: Path, provider: FakeProvider, count: str
) -> None:
    """One process or a supervisor with workers: exit 0, and each process retired its
    heartbeat row on the way out (its cleanup ran, it was not just killed)."""
    write_policies(tmp_path / "policies")
    assert provider.base_url is not None
    server = Server(tmp_path, provider.base_url, args=["--workers", count])
    with running(server):
        await server.wait_ready()
        store = await open_store(server.store_url)
        try:

            async def all_beat() -> bool:
                return len(await store.heartbeats()) == int(count)

            await until(all_beat)
            assert len(await store.heartbeats()) == int(count)
            assert await stop(server) == 0, server.output()
            assert len(await store.heartbeats()) == 0
        finally:
            await store.close()


async def test_sigterm_while_the_workers_start_is_a_clean_shutdown(
    tmp_path: Path, provider: FakeProvider
) -> None:
    """SIGTERM right after the workers were forked, before they listen: each worker stops
    once started, as on a later SIGTERM (it was killed by the signal, exit -15, leaving its
    heartbeat row; the supervisor exited 1)."""
    server = workers(tmp_path, provider)
    with running(server):
        await logged(server, "workers_started")
        assert not worker_pids(server), "a worker was listening already: too late to test"
        assert await stop(server) == 0, server.output()
    store = await open_store(server.store_url)
    try:
        assert await store.heartbeats() == ()
    finally:
        await store.close()


async def until(condition: Callable[[], Awaitable[bool]]) -> None:
    """Until `condition` holds or READY_TIMEOUT passes (a worker process starts in
    seconds on a loaded machine); the caller asserts the condition after."""
    deadline = time.monotonic() + READY_TIMEOUT
    while not await condition():
        if time.monotonic() > deadline:
            return
        await asyncio.sleep(0.02)


async def logged(server: Server, event: str) -> None:
    """Until the server logged `event` (it starts a Python process: seconds on a loaded
    machine); an AssertionError when it exits first or READY_TIMEOUT passes."""
    deadline = time.monotonic() + READY_TIMEOUT
    while not any(line.get("event") == event for line in log_lines(server)):
        assert server.process is not None
        if server.process.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"no {event} line:\n{server.output()}")
        await asyncio.sleep(0.005)


def _exit_0_when_sigterm_is_blocked() -> None:
    os._exit(0 if signal.SIGTERM in signal.pthread_sigmask(signal.SIG_BLOCK, ()) else 3)


def test_a_worker_is_forked_with_sigterm_held() -> None:
    """Regression (flaky under load): a SIGTERM between the fork and the worker's own
    blocking ran the supervisor's inherited handler and was lost; the worker served on."""
    context = multiprocessing.get_context("fork")

    def start() -> multiprocessing.process.BaseProcess:
        process = context.Process(target=_exit_0_when_sigterm_is_blocked)
        process.start()
        return process

    process = start_with_stop_signals_held(start)
    process.join(60)
    assert process.exitcode == 0
    assert signal.SIGTERM not in signal.pthread_sigmask(signal.SIG_BLOCK, ())


def _exit_0_when_the_supervisors_objects_are_frozen() -> None:
    os._exit(0 if gc.get_freeze_count() > 0 else 3)


def test_a_worker_starts_with_the_supervisors_objects_frozen() -> None:
    """The imports a worker inherits are out of its collector's reach (gc.freeze before
    the fork): its full collections walk its own objects only."""
    context = multiprocessing.get_context("fork")
    gc.unfreeze()

    def start() -> multiprocessing.process.BaseProcess:
        process = context.Process(target=_exit_0_when_the_supervisors_objects_are_frozen)
        process.start()
        return process

    try:
        process = start_with_stop_signals_held(start)
        process.join(60)
    finally:
        gc.unfreeze()
    assert process.exitcode == 0


async def test_workers_do_not_outlive_a_killed_supervisor(
    tmp_path: Path, provider: FakeProvider
) -> None:
    """Linux: each worker asked for SIGTERM when its parent dies (PR_SET_PDEATHSIG)."""
    server = workers(tmp_path, provider)
    with running(server):
        await server.wait_ready()

        async def both_listen() -> bool:
            return len(worker_pids(server)) == 2

        await until(both_listen)
        pids = worker_pids(server)
        assert len(pids) == 2
        server.kill()
    for _ in range(1000):
        if not any(pid_exists(pid) for pid in pids):
            break
        await asyncio.sleep(0.02)
    assert not any(pid_exists(pid) for pid in pids)


def test_workers_that_keep_dying_end_the_supervisor_with_exit_1() -> None:
    """A crash loop is not restarted forever: the process manager above gets exit 1."""
    context = multiprocessing.get_context("fork")

    def start_failing_worker() -> multiprocessing.process.BaseProcess:
        process = context.Process(target=os._exit, args=(3,))
        process.start()
        return process

    with capture_logs() as logs:
        assert Supervisor(start_failing_worker, 2).run() == 1
    exited = [entry for entry in logs if entry["event"] == "worker_exited"]
    assert len(exited) >= MAX_RESTARTS + 1
    assert {entry["exit_code"] for entry in exited} == {3}
    assert [entry["event"] for entry in logs][-1] == "workers_stopped"


def test_more_than_one_worker_refuses_a_port_another_program_holds(tmp_path: Path) -> None:
    import socket
    import subprocess
    import sys

    write_policies(tmp_path / "policies")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "proxy",
                "serve",
                "--workers",
                "2",
                "--port",
                str(port),
                "--store",
                f"sqlite:///{tmp_path / 'tk.db'}",
                "--policies",
                str(tmp_path / "policies"),
            ],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=tmp_path,
        )
    assert result.returncode == 2
    assert f"--port: cannot bind 127.0.0.1:{port}" in result.stderr


def test_workers_refuse_an_in_memory_store() -> None:
    with pytest.raises(SettingsError, match="in-memory SQLite"):
        serve(Settings(workers=2, store_url="sqlite:///:memory:"))
